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
    """The package's own automatic TP/SP plan (traced on the meta model), applied by hand to a raw mesh."""
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_4d.tensor_parallel import tp_styles
    from lightning_4d.tensor_parallel.styles import install_sequence_boundary
    from lightning_4d.analysis.trace import trace_model

    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    layout = tp_styles(model, trace_model(model, "layers", tokens), tp_mesh.size(), sp=True)
    parallelize_module(model, tp_mesh, {name: spec.build() for name, spec in layout.styles.items()})
    for region, attrs in layout.heads.items():
        for attr, value in attrs.items():
            setattr(model.get_submodule(region), attr, value // tp_mesh.size())
    first, last = layout.boundary
    install_sequence_boundary(model.get_submodule(first), model.get_submodule(last), layout.hidden, tp_mesh)


def test_traced_tp_and_fsdp_bytes_equal_the_analytic_ones():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_4d.layout.data_parallel import apply_data_parallel
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
    records = comm_per_rank(TransformerSpec.from_config(cfg), dims,
                            TrainSpec(global_batch_size=b * dims.dp, precision="32-true"))[0]
    # a bare forward + backward: none of the step's global-loss scalars (the dry run's step has them)
    analytic = summarize([r for r in records if not r.what.startswith("global loss")])
    assert set(traced) == set(analytic) == {"tp", "dp"}
    for axis in analytic:
        assert traced[axis].keys() == analytic[axis].keys()
        for kind, value in analytic[axis].items():
            assert traced[axis][kind] == pytest.approx(value, rel=1e-9), (axis, kind)
    # 2 layers × 4 (SP region inputs/outputs, both directions) + the first block's input split (bwd) and
    # the last block's output gather (fwd); all-reduces: embedding fwd, head input grad bwd, 3 for the
    # parallel loss, 4 SP norm gradients (2 per layer, inside the FSDP wrap).
    assert rec.counts()["tp"] == {"all_gather": 10, "reduce_scatter": 8, "all_reduce": 9}
