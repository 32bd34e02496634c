"""The planner's analytic bytes against collectives traced on torch's ``fake`` process group (one process,
a 256-rank world, a meta-device Llama under DTensor TP + SP + loss parallel and the package's FSDP2 wrap)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_4d.mesh import ParallelDims
from lightning_4d.models import Llama, LlamaConfig
from lightning_4d.planner import TrainSpec, TransformerSpec, comm_per_rank, summarize

pytestmark = pytest.mark.skipif(dist.is_initialized(), reason="needs a process without a process group")


def _tp_plan(model: Llama, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(), "attention": gather, "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)), "ffn_norm": SequenceParallel(),
            "feed_forward": gather, "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
        block.attention.n_heads //= tp_mesh.size()
        block.attention.n_kv_heads //= tp_mesh.size()
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(), "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)})


def test_traced_tp_and_fsdp_bytes_equal_the_analytic_ones():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_4d.data_parallel import apply_data_parallel
    from lightning_4d.planner.fake_world import CollectiveRecorder, fake_forward_backward, fake_world

    cfg = LlamaConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=8, ffn_hidden=512, max_seq_len=64)
    b, s = 2, 64
    with fake_world(256, rank=3):
        mesh = init_device_mesh("cpu", (4, 8, 8), mesh_dim_names=("pp", "dp", "tp"))
        with torch.device("meta"):
            model = Llama(cfg)
        _tp_plan(model, mesh["tp"])
        apply_data_parallel(model, mesh["dp"], blocks=list(model.layers), mode="fsdp", precision="32-true")
        tokens, targets = torch.randint(0, 1024, (b, s)), torch.randint(0, 1024, (b, s))
        with CollectiveRecorder(mesh) as rec, loss_parallel():
            fake_forward_backward(model, tokens, lambda y: F.cross_entropy(y.flatten(0, 1), targets.flatten()))
    assert not dist.is_initialized()
    traced = rec.summary()
    # The traced rank runs the whole model (one pipeline stage): compare with a pp = 1 layout, dp = 8, tp = 8.
    dims = ParallelDims.from_world(64, tp=8)
    analytic = summarize(comm_per_rank(TransformerSpec.from_config(cfg), dims,
                                       TrainSpec(global_batch_size=b * dims.dp, precision="32-true"))[0])
    assert set(traced) == set(analytic) == {"tp", "dp"}
    for axis in analytic:
        assert traced[axis].keys() == analytic[axis].keys()
        for kind, value in analytic[axis].items():
            assert traced[axis][kind] == pytest.approx(value, rel=1e-9), (axis, kind)
    assert rec.counts()["tp"] == {"all_gather": 10, "reduce_scatter": 10, "all_reduce": 8}
