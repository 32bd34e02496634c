"""Plain-torch Llama-style decoder with TorchTitan module names.

No distributed code lives here. The module names (``tok_embeddings``, ``layers``, ``attention.wq``,
``feed_forward.w1``, ...) are the conventions the automatic TP/SP and PP planners look for, and the
attention reads its head counts from instance attributes at forward time so that tensor parallelism
can rewrite ``n_heads`` / ``n_kv_heads`` to per-rank counts and feed it local ``dim / tp`` features.

Initialisation contract (shared by every model in :mod:`lightning_4d.models`): every custom module
has ``reset_parameters()`` and the top-level model has ``init_weights(seed=None)``, which
re-initialises *all* parameters and the attention's rotary tables (non-persistent buffers: there are no
persistent buffers). A model built on the meta device is therefore materialised with
``model.to_empty(device=...)`` followed by ``model.init_weights(seed)``, and gives the same weights as a model
built directly on that device type with the same seed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.core.batches import document_ids
from lightning_4d.models.flops import training_flops_per_token

__all__ = [
    "Attention", "FeedForward", "Llama", "LlamaConfig", "TransformerBlock", "apply_rope", "document_ids",
    "packed_causal_mask", "rope_at", "rope_cos_sin", "seeded",
]


def _config_error(name: str, value: object, rule: str, fix: str) -> ValueError:
    return ValueError(f"{name}={value!r} is invalid: {rule}. Fix: {fix}.")


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary-embedding tables ``cos, sin`` of shape ``(seq_len, head_dim)`` in fp32 ("rotate-half" layout).

    >>> cos, sin = rope_cos_sin(4, 8, 10000.0)
    >>> cos.shape
    torch.Size([4, 8])
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask ``(B, 1, T, T)`` (``True``: may attend) of packed documents: token ``i`` sees token
    ``j <= i`` of its own document only.

    >>> packed_causal_mask(torch.tensor([[0, 1, 0]]))[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    doc = document_ids(position_ids)  # (B, T)
    T = position_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()  # (T, T)
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]  # (B, 1, T, T)


def rope_at(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables ``cos, sin`` ``(B, 1, T, head_dim)`` at the given positions (:func:`rope_cos_sin` at
    ``arange(T)`` for every row).

    >>> cos, _ = rope_at(torch.arange(4)[None], 8, 10000.0)
    >>> bool((cos[0, 0] == rope_cos_sin(4, 8, 10000.0)[0]).all())
    True
    """
    device = position_ids.device
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, hd)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, heads, T, head_dim)`` by position; heads are independent (TP-safe).

    >>> x = torch.randn(1, 2, 4, 8)
    >>> apply_rope(x, *rope_cos_sin(4, 8, 10000.0)).shape
    torch.Size([1, 2, 4, 8])
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).type_as(x)


@contextlib.contextmanager
def seeded(module: nn.Module, seed: int | None) -> Iterator[None]:
    """Run the block with the RNG seeded to ``seed`` (and restored afterwards); no-op for ``None``.

    >>> with seeded(nn.Linear(2, 2), 0):
    ...     a = torch.rand(1)
    """
    if seed is None:
        yield
        return
    accel = {p.device.type for p in module.parameters()} - {"cpu", "meta"}
    device_type = next(iter(accel), "cuda")
    indices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == device_type})
    with torch.random.fork_rng(devices=indices, device_type=device_type):
        torch.manual_seed(seed)
        yield


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of :class:`Llama`. ``n_kv_heads=None`` means ``n_heads`` (no GQA);
    ``ffn_hidden=None`` means Llama's ``round_up(int(8 * dim / 3), multiple_of)``.

    >>> LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2).ffn_hidden
    256
    """

    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    multiple_of: int = 256
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "multiple_of"):
            if getattr(self, name) < 1:
                raise _config_error(name, getattr(self, name), "must be >= 1", f"pass a positive {name}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.dim % self.n_heads:
            raise _config_error(
                "dim", self.dim, f"dim must be divisible by n_heads={self.n_heads}",
                "choose dim as a multiple of n_heads (or n_heads a divisor of dim)")
        if self.head_dim % 2:
            raise _config_error(
                "dim", self.dim, f"head_dim = dim // n_heads = {self.head_dim} must be even for RoPE",
                "pick dim and n_heads so that dim // n_heads is even")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise _config_error(
                "n_kv_heads", self.n_kv_heads, f"n_heads={self.n_heads} must be divisible by n_kv_heads",
                "choose n_kv_heads as a divisor of n_heads (n_kv_heads=n_heads disables GQA)")
        if self.ffn_hidden is None:
            hidden = int(2 * 4 * self.dim / 3)
            object.__setattr__(self, "ffn_hidden", self.multiple_of * math.ceil(hidden / self.multiple_of))
        if self.ffn_hidden < 1:
            raise _config_error("ffn_hidden", self.ffn_hidden, "must be >= 1", "pass a positive ffn_hidden or None")
        if not 0.0 <= self.dropout < 1.0:
            raise _config_error("dropout", self.dropout, "must be in [0, 1)", "use e.g. dropout=0.0 or 0.1")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise _config_error(
                "norm_eps/rope_theta", (self.norm_eps, self.rope_theta), "both must be > 0", "pass positive values")

    @property
    def head_dim(self) -> int:
        """Features per attention head, ``dim // n_heads``."""
        return self.dim // self.n_heads


class Attention(nn.Module):
    """Causal multi-head attention with GQA and RoPE; projections ``wq wk wv wo`` (no bias).

    ``forward`` reads ``self.n_heads`` / ``self.n_kv_heads`` / ``self.head_dim`` at call time, so a
    tensor-parallel rewrite may set them to per-rank counts and feed local ``n_heads*head_dim``
    features. With ``max_seq_len`` the rotary tables of positions ``0..max_seq_len-1`` are kept as fp32
    non-persistent buffers ``rope_cos`` / ``rope_sin`` ``(max_seq_len, head_dim/2)`` (refilled by
    ``reset_parameters``): a compiled block then reads them instead of computing ``cos``/``sin`` in its graph, which
    Inductor would fuse into every element of ``q`` and ``k`` (forward and backward). Without it, or for packed
    ``position_ids``, a longer input, or tables cast away from fp32 on ``x``'s device, they are computed on the fly
    (the same values). The module stays self-contained (pipeline-safe).

    >>> attn = Attention(dim=32, n_heads=4, n_kv_heads=2, max_seq_len=8)
    >>> attn(torch.randn(2, 5, 32)).shape, attn.rope_cos.shape
    (torch.Size([2, 5, 32]), torch.Size([8, 4]))
    """

    rope_cos: torch.Tensor | None
    rope_sin: torch.Tensor | None

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int | None = None, rope_theta: float = 10000.0,
        dropout: float = 0.0, init_std: float = 0.02, out_init_std: float = 0.02, max_seq_len: int | None = None,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = dim // n_heads
        self.rope_theta = rope_theta
        self.dropout = dropout
        self.init_std = init_std
        self.out_init_std = out_init_std
        self.wq = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        half = (max_seq_len, self.head_dim // 2)
        self.register_buffer("rope_cos", None if max_seq_len is None else torch.empty(half), persistent=False)
        self.register_buffer("rope_sin", None if max_seq_len is None else torch.empty(half), persistent=False)
        self.reset_rope()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for ``wq wk wv``; Normal(0, out_init_std) for ``wo``; the rotary tables refilled."""
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, std=self.init_std)
        nn.init.normal_(self.wo.weight, std=self.out_init_std)
        self.reset_rope()

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Fill ``rope_cos`` / ``rope_sin`` ``(max_seq_len, head_dim/2)`` with :func:`rope_cos_sin`'s first half
        (its second half repeats it); a no-op without them."""
        if self.rope_cos is None or self.rope_sin is None:
            return
        n, half = self.rope_cos.shape  # (max_seq_len, hd/2)
        cos, sin = rope_cos_sin(n, 2 * half, self.rope_theta, device=self.rope_cos.device)  # (max_seq_len, hd)
        self.rope_cos.copy_(cos[:, :half])
        self.rope_sin.copy_(sin[:, :half])

    def rope_tables(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``(seq_len, head_dim)`` of positions ``0..seq_len-1`` (:func:`rope_cos_sin`): the kept
        tables where they cover ``seq_len`` in fp32 on ``device``, else computed."""
        cos, sin = self.rope_cos, self.rope_sin  # (max_seq_len, hd/2) or None
        if (cos is None or sin is None or seq_len > cos.shape[0] or cos.dtype != torch.float32
                or cos.device != device or sin.dtype != torch.float32):
            return rope_cos_sin(seq_len, self.head_dim, self.rope_theta, device=device)  # (T, hd)
        # narrow, not [:T]: context parallelism re-indexes buffers sliced [:T] (position_tables); these rows are
        # positions 0..T-1 of this call, and a context-parallel call takes the position_ids path
        cos, sin = cos.narrow(0, 0, seq_len), sin.narrow(0, 0, seq_len)  # (T, hd/2)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # (T, hd)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ``(B, T)`` of packed documents: rotary at those positions, attention within each
        document (:func:`packed_causal_mask`); ``None``: positions ``0..T-1``, plain causal attention."""
        B, T, _ = x.shape  # (B, T, D)
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        if position_ids is None:
            cos, sin = self.rope_tables(T, x.device)  # (T, hd)
        else:
            cos, sin = rope_at(position_ids, self.head_dim, self.rope_theta)  # (B, 1, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # query head i uses kv head i // (H / KV): SDPA reads the shared heads in place (no (B, H, T, hd) copies)
        gqa = self.n_heads != self.n_kv_heads
        p = self.dropout if self.training else 0.0
        if position_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)  # (B, H, T, hd)
        else:
            mask = packed_causal_mask(position_ids)  # (B, 1, T, T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, enable_gqa=gqa)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*hd)
        return self.wo(y)  # (B, T, D)


class FeedForward(nn.Module):
    """SwiGLU MLP ``w2(silu(w1 x) * w3 x)`` (no bias); ``w1``/``w3`` column-, ``w2`` row-parallel under TP.

    >>> FeedForward(dim=32, hidden_dim=64)(torch.randn(2, 5, 32)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, dim: int, hidden_dim: int, init_std: float = 0.02, out_init_std: float = 0.02) -> None:
        super().__init__()
        self.init_std = init_std
        self.out_init_std = out_init_std
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for ``w1``; Normal(0, out_init_std) for ``w2`` and ``w3``."""
        nn.init.normal_(self.w1.weight, std=self.init_std)
        nn.init.normal_(self.w2.weight, std=self.out_init_std)
        nn.init.normal_(self.w3.weight, std=self.out_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, F) -> (B, T, D)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn_dropout(attention(attention_norm(x)))``;
    ``out = h + ffn_dropout(feed_forward(ffn_norm(h)))``.

    >>> cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=64)
    >>> TransformerBlock(cfg, layer_id=0)(torch.randn(2, 5, 32)).shape
    torch.Size([2, 5, 32])
    """

    def __init__(self, config: LlamaConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_id = layer_id
        out_std = config.init_std / math.sqrt(2 * config.n_layers)  # depth-scaled residual projections
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(
            config.dim, config.n_heads, config.n_kv_heads, config.rope_theta, config.dropout,
            config.init_std, out_std, max_seq_len=config.max_seq_len)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden, config.init_std, out_std)
        self.ffn_dropout = nn.Dropout(config.dropout)

    def reset_parameters(self) -> None:
        """Re-initialise both norms, the attention and the feed-forward."""
        for m in (self.attention_norm, self.attention, self.ffn_norm, self.feed_forward):
            m.reset_parameters()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` ``(B, T)``: packed documents (see :meth:`Attention.forward`)."""
        attn_in = self.attention_norm(x)  # (B, T, D)
        a = self.attention(attn_in) if position_ids is None else self.attention(attn_in, position_ids=position_ids)
        h = x + self.attn_dropout(a)  # (B, T, D)
        return h + self.ffn_dropout(self.feed_forward(self.ffn_norm(h)))  # (B, T, D)


def _iter_blocks(layers: nn.Module) -> Iterator[nn.Module]:
    """Blocks of a ``ModuleList`` or (after pipeline splitting) a ``ModuleDict``."""
    return iter(layers.values()) if isinstance(layers, nn.ModuleDict) else iter(layers)


class Llama(nn.Module):
    """Llama decoder: ``tok_embeddings -> layers -> norm -> output`` returning logits ``(B, T, V)``.

    The forward is the plain sequential composition of those four parts; a part that a pipeline
    stage does not own may be set to ``None`` and is then skipped (the input passes through).

    >>> cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)
    >>> with torch.device("meta"):
    ...     model = Llama(cfg)
    >>> model = model.to_empty(device="cpu")
    >>> model.init_weights(seed=0)
    >>> model(torch.randint(0, 64, (2, 8))).shape
    torch.Size([2, 8, 64])
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.share_rope_tables()
        self.init_weights()

    def _rope_owners(self) -> list[Attention]:
        blocks = _iter_blocks(self.layers) if self.layers is not None else iter(())
        attns = [getattr(block, "attention", None) for block in blocks]
        return [a for a in attns if isinstance(a, Attention) and a.rope_cos is not None and a.rope_sin is not None]

    def share_rope_tables(self) -> None:
        """Point every block's ``rope_cos`` / ``rope_sin`` at the first block's (equal tables: same length, width,
        base, dtype and device): a rank keeps one table pair, not one per layer (TorchTitan keeps one cache).
        Construction, device moves (``to``, ``to_empty``) and ``init_weights`` keep or restore the sharing."""
        owners = self._rope_owners()
        for attn in owners[1:]:
            first = owners[0]
            same = (attn.rope_theta == first.rope_theta and attn.rope_cos.shape == first.rope_cos.shape
                    and attn.rope_cos.dtype == first.rope_cos.dtype and attn.rope_cos.device == first.rope_cos.device)
            if same:
                attn.rope_cos, attn.rope_sin = first.rope_cos, first.rope_sin

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Llama:
        """``to`` / ``to_empty`` / dtype moves: each shared rotary table converted once (not once per block), then
        shared again (:func:`lightning_4d._compat.convert_shared_once`)."""
        from lightning_4d._compat import convert_shared_once

        tables = [t for a in self._rope_owners() for t in (a.rope_cos, a.rope_sin)]
        convert_shared_once(self, fn, tables, recurse)
        self.share_rope_tables()
        return self

    def tie_weights(self) -> None:
        """Share ``output.weight`` with ``tok_embeddings.weight`` if ``config.tie_embeddings``."""
        if self.config.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, seed: int | None = None) -> None:
        """(Re-)initialise every parameter, optionally under ``torch.manual_seed(seed)`` (RNG restored).

        Embedding and ``output`` Normal(0, init_std), norms ones, blocks via ``reset_parameters``.
        Re-ties the embeddings, so it also repairs a tie broken by ``to_empty``.
        """
        self.tie_weights()
        self.share_rope_tables()
        with seeded(self, seed):
            if self.tok_embeddings is not None:
                nn.init.normal_(self.tok_embeddings.weight, std=self.config.init_std)
            for block in _iter_blocks(self.layers):
                block.reset_parameters()
            if self.norm is not None:
                self.norm.reset_parameters()
            if self.output is not None and not self.config.tie_embeddings:
                nn.init.normal_(self.output.weight, std=self.config.init_std)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)``. ``position_ids`` ``(B, T)`` of packed documents (restarting at 0 where one
        starts): each token attends within its document only, rotary at its position in the document."""
        h = tokens  # (B, T) token ids, or (B, T, D) hidden states on a later pipeline stage
        if self.tok_embeddings is not None:
            if tokens.shape[1] > self.config.max_seq_len:
                raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len={self.config.max_seq_len}")
            h = self.tok_embeddings(tokens)  # (B, T, D)
        for layer in _iter_blocks(self.layers):
            h = layer(h) if position_ids is None else layer(h, position_ids=position_ids)  # (B, T, D)
        if self.norm is not None:
            h = self.norm(h)  # (B, T, D)
        if self.output is not None:
            h = self.output(h)  # (B, T, V)
        return h

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (tied weights once); ``exclude_embeddings`` drops the
        token-embedding table unless it is tied to the output head (then it is a matmul weight).

        >>> Llama(LlamaConfig(vocab_size=8, dim=4, n_layers=1, n_heads=1, ffn_hidden=4)).num_params()
        188
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and not self.config.tie_embeddings and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward): ``6 * N + 12 * L * H * hd * seq_len``.

        ``N`` is ``num_params(exclude_embeddings=True)``; the formula is
        :func:`lightning_4d.models.flops.training_flops_per_token`.

        >>> Llama(LlamaConfig(vocab_size=8, dim=4, n_layers=1, n_heads=1, ffn_hidden=4)).flops_per_token(2)
        1032
        """
        c = self.config
        return training_flops_per_token(self.num_params(exclude_embeddings=True), c.n_layers, c.n_heads * c.head_dim,
                                        seq_len)
