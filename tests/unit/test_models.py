"""Pure, fast tests of the reference models in ``lightning_4d.models`` (no process group)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lightning_4d.models import (
    GPT2,
    Attention,
    CausalSelfAttention,
    FeedForward,
    GPT2Config,
    HFStyleAttention,
    HFStyleConfig,
    HFStyleLM,
    Llama,
    LlamaConfig,
    interleave_qkv,
)

V, D, L, T, B = 64, 32, 2, 8, 2


def llama_cfg(**kw) -> LlamaConfig:
    base = dict(vocab_size=V, dim=D, n_layers=L, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)
    return LlamaConfig(**{**base, **kw})


def gpt2_cfg(**kw) -> GPT2Config:
    return GPT2Config(**{**dict(vocab_size=V, n_embd=D, n_layer=L, n_head=4, block_size=16), **kw})


def hf_cfg(**kw) -> HFStyleConfig:
    base = dict(vocab_size=V, hidden_size=D, intermediate_size=48, num_hidden_layers=L, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=16, attention_bias=True)
    return HFStyleConfig(**{**base, **kw})


BUILDERS = {
    "llama": lambda: Llama(llama_cfg()),
    "llama_tied": lambda: Llama(llama_cfg(tie_embeddings=True)),
    "gpt2": lambda: GPT2(gpt2_cfg()),
    "gpt2_untied": lambda: GPT2(gpt2_cfg(tie_embeddings=False, bias=False)),
    "hf": lambda: HFStyleLM(hf_cfg()),
}


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_output_shape_and_finite(name: str) -> None:
    model = BUILDERS[name]().eval()
    out = model(tokens())
    assert out.shape == (B, T, V)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_causal(name: str) -> None:
    model = BUILDERS[name]().eval()
    x = tokens()
    y = x.clone()
    y[:, 5] = (y[:, 5] + 1) % V
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("name", list(BUILDERS))
def test_forward_is_sequential_composition_and_stage_split(name: str) -> None:
    model = BUILDERS[name]().eval()
    x = tokens()
    emb, blocks, norm, head = [getattr(model, n) for n in (
        ("tok_embeddings", "layers", "norm", "output") if isinstance(model, Llama) else
        ("embeddings", "h", "ln_f", "lm_head") if isinstance(model, GPT2) else
        ("embed_tokens", "layers", "norm", "lm_head"))]
    with torch.no_grad():
        h = emb(x)
        for blk in blocks:
            h = blk(h)
        manual = head(norm(h))
        full = model(x)
        # two "pipeline stages": parts a stage does not own are set to None and skipped
        first, last = copy.deepcopy(model), copy.deepcopy(model)
        children = [n for n, _ in model.named_children()]
        blist = next(n for n, m in model.named_children() if m is blocks)
        for n in children[children.index(blist) + 1:]:
            setattr(first, n, None)
        for n in children[: children.index(blist)]:
            setattr(last, n, None)
        setattr(first, blist, nn.ModuleList(list(getattr(first, blist))[:1]))
        setattr(last, blist, nn.ModuleDict({"1": list(getattr(last, blist))[1]}))
        staged = last(first(x))
    torch.testing.assert_close(full, manual)
    torch.testing.assert_close(full, staged)


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    gqa = Attention(dim=D, n_heads=4, n_kv_heads=2)
    mha = Attention(dim=D, n_heads=4, n_kv_heads=4)
    hd = D // 4
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for src, dst in ((gqa.wk, mha.wk), (gqa.wv, mha.wv)):  # query head i uses kv head i // 2
            dst.weight.copy_(src.weight.view(2, hd, D).repeat_interleave(2, dim=0).reshape(4 * hd, D))
    x = torch.randn(B, T, D)
    torch.testing.assert_close(gqa(x), mha(x))
    assert gqa.wk.weight.shape == (2 * hd, D)



def test_kept_rotary_tables_equal_computed_ones_and_survive_meta_materialisation() -> None:
    """The Llama attention's ``rope_cos`` / ``rope_sin`` buffers give bitwise the on-the-fly tables' output; they
    are not in the state dict, are refilled by ``init_weights`` after ``to_empty``, and a longer input or tables
    cast from fp32 fall back to computing them."""
    kept = Attention(dim=D, n_heads=4, n_kv_heads=2, max_seq_len=T)
    computed = Attention(dim=D, n_heads=4, n_kv_heads=2)
    computed.load_state_dict(kept.state_dict())
    x = torch.randn(B, T, D)
    assert torch.equal(kept(x), computed(x)) and torch.equal(kept(x[:, :3]), computed(x[:, :3]))
    assert kept.rope_cos.shape == (T, D // 8) and computed.rope_cos is None
    assert not any("rope" in k for k in kept.state_dict())
    y = torch.randn(B, 2 * T, D)
    assert torch.equal(kept(y), computed(y))  # longer than the tables: computed
    with torch.device("meta"):
        model = Llama(llama_cfg())
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    direct = Llama(llama_cfg())
    for a, b in zip(model.layers, direct.layers):
        assert torch.equal(a.attention.rope_cos, b.attention.rope_cos)
        assert torch.equal(a.attention.rope_sin, b.attention.rope_sin)
    cast = copy.deepcopy(kept)
    cast.rope_cos, cast.rope_sin = cast.rope_cos.bfloat16(), cast.rope_sin.bfloat16()
    assert torch.equal(cast(x), computed(x))  # tables cast from fp32 (bf16-true) are not used

@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: llama_cfg(n_heads=5), r"dim=32.*divisible by n_heads=5"),
        (lambda: llama_cfg(n_heads=4, n_kv_heads=3), r"n_kv_heads=3.*divisor of n_heads"),
        (lambda: llama_cfg(n_heads=32, n_kv_heads=None), r"head_dim.*even"),
        (lambda: llama_cfg(dropout=1.5), r"dropout=1.5"),
        (lambda: llama_cfg(vocab_size=0), r"vocab_size=0.*>= 1"),
        (lambda: gpt2_cfg(n_head=5), r"n_embd=32.*divisible by n_head=5"),
        (lambda: hf_cfg(num_key_value_heads=3), r"num_key_value_heads=3"),
        (lambda: hf_cfg(num_attention_heads=3), r"hidden_size=32.*num_attention_heads=3"),
    ],
)
def test_config_validation(make, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        make()
    assert "Fix:" in str(info.value)


def test_config_defaults_resolved() -> None:
    cfg = LlamaConfig(vocab_size=V, dim=D, n_layers=1, n_heads=4, multiple_of=16)
    assert cfg.n_kv_heads == 4 and cfg.head_dim == 8
    assert cfg.ffn_hidden == 96  # int(8 * 32 / 3) = 85 -> rounded up to a multiple of 16
    with pytest.raises(AttributeError):
        cfg.dim = 64  # frozen


@pytest.mark.parametrize("name", list(BUILDERS))
def test_meta_materialisation_is_deterministic(name: str) -> None:
    with torch.device("meta"):
        m1 = BUILDERS[name]()
        m2 = BUILDERS[name]()
    assert all(p.is_meta for p in m1.parameters())
    rng_before = torch.get_rng_state()
    for m in (m1, m2):
        m.to_empty(device="cpu")
        m.init_weights(seed=7)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the seeded init restores the RNG
    direct = BUILDERS[name]()
    direct.init_weights(seed=7)
    sd1, sd2, sd3 = m1.state_dict(), m2.state_dict(), direct.state_dict()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
        assert torch.equal(sd1[k], sd3[k]), k
    assert torch.isfinite(m1.eval()(tokens())).all()
    other = BUILDERS[name]()
    other.init_weights(seed=8)
    assert not torch.equal(other.state_dict()[next(iter(sd1))], sd1[next(iter(sd1))])


@pytest.mark.parametrize("name", ["gpt2", "llama_tied"])
def test_tie_survives_meta_materialisation(name: str) -> None:
    with torch.device("meta"):
        model = BUILDERS[name]()
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    head, emb = (model.lm_head, model.embeddings.wte) if name == "gpt2" else (model.output, model.tok_embeddings)
    assert head.weight is emb.weight
    with torch.no_grad():
        emb.weight.add_(1.0)
    assert torch.equal(head.weight, emb.weight)


def test_num_params_analytic() -> None:
    # Llama: emb V*D + per layer [2 norms 2D + wq D*H*hd + wk,wv 2*D*KV*hd + wo H*hd*D + w1,w2,w3 3*D*F]
    #        + final norm D + output V*D (only when untied)
    H, KV, hd, F = 4, 2, 8, 48
    per_layer = 2 * D + D * H * hd + 2 * D * KV * hd + H * hd * D + 3 * D * F
    assert Llama(llama_cfg()).num_params() == V * D + L * per_layer + D + V * D
    assert Llama(llama_cfg(tie_embeddings=True)).num_params() == V * D + L * per_layer + D
    assert Llama(llama_cfg()).num_params(exclude_embeddings=True) == L * per_layer + D + V * D
    # GPT-2 (bias): wte V*C + wpe S*C + per layer [ln_1, ln_2 2*2C + c_attn 3C*C+3C + c_proj C*C+C
    #               + c_fc 4C*C+4C + c_proj 4C*C+C] + ln_f 2C; lm_head tied -> counted once
    C, S = D, 16
    g_layer = 4 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    assert GPT2(gpt2_cfg()).num_params() == V * C + S * C + L * g_layer + 2 * C
    g_layer_nobias = 2 * C + 3 * C * C + C * C + 4 * C * C + 4 * C * C
    assert GPT2(gpt2_cfg(tie_embeddings=False, bias=False)).num_params() == 2 * V * C + S * C + L * g_layer_nobias + C
    # HF-style with q/k/v biases: Llama layer + H*hd + 2*KV*hd biases
    assert HFStyleLM(hf_cfg()).num_params() == 2 * V * D + L * (per_layer + H * hd + 2 * KV * hd) + D


def test_flops_per_token_formula() -> None:
    model = Llama(llama_cfg())
    n = model.num_params() - V * D  # embedding lookup is not a matmul
    assert model.flops_per_token(T) == 6 * n + 12 * L * D * T


# ---- manual 2-way tensor-parallel split: proves the attention modules are TP-ready ----------------

def col_shard(lin: nn.Linear, r: int, n: int) -> nn.Linear:
    """Rank r's contiguous block of output features (column-parallel)."""
    k = lin.out_features // n
    out = nn.Linear(lin.in_features, k, bias=lin.bias is not None)
    with torch.no_grad():
        out.weight.copy_(lin.weight[r * k:(r + 1) * k])
        if lin.bias is not None:
            out.bias.copy_(lin.bias[r * k:(r + 1) * k])
    return out


def row_shard(lin: nn.Linear, r: int, n: int) -> nn.Linear:
    """Rank r's contiguous block of input features (row-parallel); the bias is added by rank 0 only."""
    k = lin.in_features // n
    out = nn.Linear(k, lin.out_features, bias=lin.bias is not None and r == 0)
    with torch.no_grad():
        out.weight.copy_(lin.weight[:, r * k:(r + 1) * k])
        if out.bias is not None:
            out.bias.copy_(lin.bias)
    return out


def tp_split_output(module: nn.Module, cols: list[str], rows: list[str], heads: list[str], x: torch.Tensor,
                    n: int = 2) -> torch.Tensor:
    """Sum over simulated ranks of the module with sharded linears and per-rank head counts."""
    total = 0
    for r in range(n):
        local = copy.deepcopy(module)
        for c in cols:
            setattr(local, c, col_shard(getattr(module, c), r, n))
        for c in rows:
            setattr(local, c, row_shard(getattr(module, c), r, n))
        for h in heads:
            setattr(local, h, getattr(module, h) // n)
        total = total + local(x)
    return total


def _randomise_biases(module: nn.Module) -> None:
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.normal_()


def test_llama_attention_manual_tp_split() -> None:
    attn = Attention(dim=D, n_heads=4, n_kv_heads=2)
    x = torch.randn(B, T, D)
    out = tp_split_output(attn, ["wq", "wk", "wv"], ["wo"], ["n_heads", "n_kv_heads"], x)
    torch.testing.assert_close(out, attn(x))


def test_llama_feed_forward_manual_tp_split() -> None:
    ffn = FeedForward(dim=D, hidden_dim=48)
    x = torch.randn(B, T, D)
    torch.testing.assert_close(tp_split_output(ffn, ["w1", "w3"], ["w2"], [], x), ffn(x))


def test_gpt2_attention_manual_tp_split() -> None:
    attn = CausalSelfAttention(n_embd=D, n_head=4, bias=True)
    _randomise_biases(attn)
    x = torch.randn(B, T, D)
    out = tp_split_output(attn, ["c_attn"], ["c_proj"], ["n_head"], x)
    torch.testing.assert_close(out, attn(x))


def test_hf_attention_manual_tp_split() -> None:
    attn = HFStyleAttention(hf_cfg())
    _randomise_biases(attn)
    x = torch.randn(B, T, D)
    out = tp_split_output(attn, ["q_proj", "k_proj", "v_proj"], ["o_proj"], ["num_heads", "num_key_value_heads"], x)
    torch.testing.assert_close(out, attn(x))


def test_interleave_qkv_matches_blocked_reference() -> None:
    # In float64: the check is about which rows go where (a wrong mapping is an O(1) difference), and with
    # unit-variance weights fp32 round-off alone reaches ~1e-5 on some CPUs (AVX-512 summation order), which
    # no fixed fp32 tolerance separates from a bug. float64 leaves ~1e-13: rtol 1e-9 is far from both.
    nh, hd = 4, D // 4
    attn = CausalSelfAttention(n_embd=D, n_head=nh, bias=True).double()
    w, b = torch.randn(3 * D, D, dtype=torch.float64), torch.randn(3 * D, dtype=torch.float64)
    with torch.no_grad():
        attn.c_attn.weight.copy_(interleave_qkv(w, nh))
        attn.c_attn.bias.copy_(interleave_qkv(b, nh))
    x = torch.randn(B, T, D, dtype=torch.float64)
    q, k, v = (x @ w.T + b).split(D, dim=-1)  # blocked [q | k | v] reference
    q, k, v = (t.view(B, T, nh, hd).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)
    torch.testing.assert_close(attn(x), attn.c_proj(y), rtol=1e-9, atol=1e-9)


def test_dropout_only_in_training() -> None:
    model = Llama(llama_cfg(dropout=0.5))
    x = tokens()
    model.train()
    assert not torch.allclose(model(x), model(x))
    model.eval()
    torch.testing.assert_close(model(x), model(x))


def test_sequence_too_long_raises() -> None:
    with pytest.raises(ValueError, match="max_seq_len=16"):
        Llama(llama_cfg())(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="block_size=16"):
        GPT2(gpt2_cfg())(torch.zeros(1, 17, dtype=torch.long))


def test_blocks_share_one_rotary_table_pair() -> None:
    """A rank keeps one rotary table pair, not one per layer, through construction, a meta build materialised with
    ``to_empty`` + ``init_weights``, and a dtype move (converted once, shared again); values as computed."""
    from lightning_4d.models.llama import rope_cos_sin

    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
    with torch.device("meta"):
        meta = Llama(cfg)
    built = meta.to_empty(device="cpu")
    built.init_weights(seed=0)
    from lightning_4d.models.moe import MoEConfig, MoETransformer

    moe = MoETransformer(MoEConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                   max_seq_len=16)).double()  # a subclass: the same override
    for model in (Llama(cfg), built, Llama(cfg).double(), moe):
        tables = {id(t) for b in model.layers for t in (b.attention.rope_cos, b.attention.rope_sin)}
        assert len(tables) == 2
        cos, sin = rope_cos_sin(16, cfg.dim // cfg.n_heads, cfg.rope_theta)  # (T, hd)
        half = cos.shape[-1] // 2
        assert torch.equal(model.layers[2].attention.rope_cos.float(), cos[:, :half])
        assert torch.equal(model.layers[2].attention.rope_sin.float(), sin[:, :half])
