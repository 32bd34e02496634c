"""The layout search with context parallelism (pure, no process group): cp is enumerated where the sequence cuts
into 2·cp zigzag chunks and the attention can be split, every proposal passes the strategy's validation, and cp is
ranked like every other degree (it wins when memory forces it)."""

from __future__ import annotations

import pytest

from lightning_4d.config import FourDConfig
from lightning_4d.planner import CPU_TOY, ClusterSpec, TrainSpec, TransformerSpec, search
from lightning_4d.planner.search import enumerate_layouts


def _spec(**kw) -> TransformerSpec:
    return TransformerSpec(**{"vocab_size": 64, "hidden": 32, "layers": 4, "heads": 4, "seq_len": 16, **kw})


def test_cp_is_enumerated_within_what_the_runtime_accepts() -> None:
    spec = _spec()
    seen = list(enumerate_layouts(spec, ClusterSpec(2, 4), TrainSpec(global_batch_size=8)))
    assert {d.cp for d, _ in seen} == {1, 2, 4, 8}
    for dims, train in seen:
        assert dims.dp * dims.cp * dims.tp * dims.pp == 8
        assert 16 % (2 * dims.cp) == 0 and (not dims.sp or dims.tp == 1 or (16 // dims.cp) % dims.tp == 0)
        FourDConfig(tp=dims.tp, pp=dims.pp, ep=dims.ep, cp=dims.cp, sequence_parallel=dims.sequence_parallel,
                    schedule=train.schedule, data_parallel=train.data_parallel, dp_shard=train.dp_shard,
                    activation_checkpointing=train.activation_checkpointing).resolve(8)
    assert any(d.cp == 8 and d.tp == 1 for d, _ in seen)  # 16 tokens in 16 chunks of one
    # HSDP with cp: FSDP2 over dp_shard × cp inside a node, replicated across nodes
    assert any(d.cp == 2 and t.data_parallel == "hsdp" and t.dp_shard == 1 for d, t in seen)


def test_cp_only_where_the_sequence_and_the_attention_allow_it() -> None:
    cluster, train = ClusterSpec(1, 4), TrainSpec(global_batch_size=4)
    assert {d.cp for d, _ in enumerate_layouts(_spec(seq_len=6), cluster, train)} == {1}  # 6 is not 2·cp chunks
    assert {d.cp for d, _ in enumerate_layouts(_spec(seq_len=4), cluster, train)} == {1, 2}  # 4 = 2·2, not 2·4
    # a sliding window is split (its mask recomputed from global positions); soft-capping and ALiBi are refused
    assert {d.cp for d, _ in enumerate_layouts(_spec(attention="sliding_window"), cluster, train)} == {1, 2, 4}
    assert {d.cp for d, _ in enumerate_layouts(_spec(attention="softcap"), cluster, train)} == {1}
    assert {d.cp for d, _ in enumerate_layouts(_spec(attention="alibi"), cluster, train)} == {1}
    assert {d.cp for d, _ in enumerate_layouts(_spec(), cluster, train, context_parallel=(1, 2))} == {1, 2}
    # 8 tokens, cp=2: 4 per rank split again over tp=4 with SP; cp=2 × tp=4 needs 16 (SP off is fine)
    both = [(d.sp, d.tp) for d, _ in enumerate_layouts(_spec(seq_len=4), ClusterSpec(1, 8), TrainSpec(8))
            if d.cp == 2 and d.tp == 4]
    assert both and all(not sp for sp, _ in both)
    assert _spec(seq_len=4).cp_refusal(2, tp=4) is not None and _spec(seq_len=4).cp_refusal(2) is None


def test_search_picks_cp_when_memory_forces_it_and_reports_it() -> None:
    """One long sequence per step (global batch 1: dp = 1): of the layouts that fit when no cp = 1 layout does, the
    fastest (by the same ranking) is chosen, and it is context-parallel."""
    spec = TransformerSpec(vocab_size=256, hidden=256, layers=2, heads=2, seq_len=2048)
    every = search(spec, ClusterSpec(1, 4, CPU_TOY), TrainSpec(1), top=1000, distinct=False)
    assert {c.dims.cp for c in every} >= {1, 2, 4}
    cap = min(c.peak_memory for c in every if c.dims.cp == 1) - 1
    expected = min((c for c in every if c.peak_memory <= cap), key=lambda c: (c.estimate.step_s, c.peak_memory))
    res = search(spec, ClusterSpec(1, 4, CPU_TOY.with_(memory_bytes=cap)), TrainSpec(1))
    assert res[0].label == expected.label and res[0].dims.cp > 1
    assert all(c.dims.cp > 1 and c.peak_memory <= cap for c in res)
    assert f"cp={res[0].dims.cp} " in res[0].label and res[0].as_dict()["cp"] == res[0].dims.cp
    assert res[0].estimate.comm_s["cp"] > 0  # the K/V traffic is on the critical path
    # Without context parallelism nothing fits: the search says so rather than proposing a layout.
    with pytest.raises(ValueError, match="No layout"):
        search(spec, ClusterSpec(1, 4, CPU_TOY.with_(memory_bytes=cap)), TrainSpec(1), context_parallel=(1,))


def test_hf_attention_kind_follows_the_config() -> None:
    from transformers import LlamaConfig as HFLlamaConfig, MistralConfig

    from lightning_4d.recipes.hf_model import _spec_fields

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    assert _spec_fields(HFLlamaConfig(**small))[0]["attention"] == "causal"
    assert _spec_fields(MistralConfig(sliding_window=8, **small))[0]["attention"] == "sliding_window"
    assert _spec_fields(MistralConfig(sliding_window=None, **small))[0]["attention"] == "causal"
    from transformers import Gemma2Config

    assert _spec_fields(Gemma2Config(**small))[0]["attention"] == "softcap"  # attn_logit_softcapping=50
