"""Per-block ``torch.compile``: compiled / eager step time on CPU, the package's against TorchTitan's, in one run.

Two models of the same sizes (dim ≥ 512): the package's Llama, compiled by ``FourDStrategy``'s path
(:func:`lightning_4d.speed.compile.apply_compile`, through :func:`~lightning_4d.layout.parallelize.parallelize_module`
at tp=2), and TorchTitan's own Llama 3 compiled by TorchTitan's ``apply_compile`` (every ``TransformerBlock``,
``fullgraph=True``). Each is timed eager and compiled; the printed ratio is compiled / eager median step time
(forward, backward, SGD step), ours beside TorchTitan's, and ours over TorchTitan's (target ≤ 1.05). At tp=1 both
use Inductor; at tp=2 both use ``aot_eager`` (the package refuses Inductor with tp > 1: torch 2.13's Inductor cannot
lower the mesh ops its TP styles leave in a block's graph) and both are sharded by the package's TP plan, so the two
sides differ only in the model and who compiles it. Rounds alternate the four runs so machine noise hits all alike.

Run: python bench/bench_compile.py [--steps 6 --rounds 2 --dim 512 --layers 2 --seq 128] [--doc: write docs/speed.md's
table]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_4d.testing import run_world


def _ours(a: argparse.Namespace) -> nn.Module:
    from lightning_4d.models import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.heads // 2,
                             ffn_hidden=a.ffn, max_seq_len=a.seq))


def _titan(a: argparse.Namespace) -> nn.Module:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    from tests.distributed.byom_zoo import TitanLogits

    init = {"weight": lambda p: nn.init.trunc_normal_(p, std=0.02), "bias": nn.init.zeros_}
    norm: Callable[[int], Any] = lambda d: RMSNorm.Config(normalized_shape=d, param_init={"weight": nn.init.ones_})  # noqa: E731
    rope = ComplexRoPE.Config(dim=a.dim // a.heads, max_seq_len=a.seq, theta=10000.0)
    attention = dict(dim=a.dim, n_heads=a.heads, n_kv_heads=a.heads // 2, wqkv_param_init=init, wo_param_init=init,
                     inner_attention=ScaledDotProductAttention.Config(), rope=rope, fuse_qkv=False)
    blocks = [Llama3TransformerBlock.Config(
        attention_norm=norm(a.dim), ffn_norm=norm(a.dim), attention=make_gqa_config(**attention),
        feed_forward=make_ffn_config(dim=a.dim, hidden_dim=a.ffn, w1_param_init=init, w2w3_param_init=init))
        for _ in range(a.layers)]
    cfg = Llama3Model.Config(dim=a.dim, vocab_size=a.vocab, norm=norm(a.dim), layers=blocks,
                             tok_embeddings=Embedding.Config(num_embeddings=a.vocab, embedding_dim=a.dim,
                                                             param_init={"weight": nn.init.normal_}),
                             lm_head=Linear.Config(in_features=a.dim, out_features=a.vocab, param_init=init))
    model = cfg.build()
    model.init_states()
    return TitanLogits(model)


def _titan_compile(model: nn.Module, backend: str) -> None:
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    apply_compile(model, compile_config=CompileConfig(enable=True, backend=backend),
                  parallel_dims=SimpleNamespace(tp_enabled=False))  # async TP off: its mesh is not read


def _prepare(kind: str, compiled: bool, a: argparse.Namespace, backend: str, mesh: Any) -> nn.Module:
    """One model, sharded (tp=2: the package's plan) and compiled as ``kind`` does."""
    from lightning_4d.config import FourDConfig
    from lightning_4d.layout.parallelize import parallelize_module
    from lightning_4d.models import CausalLM
    from lightning_4d.speed.compile import apply_compile

    torch.manual_seed(0)
    net = _ours(a) if kind == "ours" else _titan(a)
    lm = CausalLM(net)
    ours_compile = backend if compiled and kind == "ours" else False
    if mesh is not None:
        parallelize_module(lm, mesh, FourDConfig(tp=2, compile=ours_compile), "32-true")
    elif ours_compile:
        apply_compile(list(net.layers), backend)  # what apply_layout does at tp=1
    if compiled and kind == "titan":
        _titan_compile(net.model, backend)
    return lm.model


def _step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(rank: int, a: argparse.Namespace, tp: int) -> dict[str, list[float]]:
    """Median step seconds of the four runs (ours / titan × eager / compiled) on this rank."""
    mesh = None
    if tp > 1:
        from lightning_4d.mesh import ParallelDims, build_mesh

        mesh = build_mesh(ParallelDims.from_world(tp, tp=tp), "cpu")
    backend = a.backend or ("inductor" if tp == 1 else "aot_eager")
    runs = {f"{k} {'compiled' if c else 'eager'}": _prepare(k, c, a, backend, mesh)
            for k in ("ours", "titan") for c in (False, True)}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-4) for name, m in runs.items()}
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, model in runs.items():  # compile and warm up (two steps: nothing recompiles after the second)
        start = time.perf_counter()
        for _ in range(2):
            _step(model, opts[name], tokens)
        times[name + " warm-up"] = [time.perf_counter() - start]
    for _ in range(a.rounds):
        for name, model in runs.items():
            for _ in range(a.steps):
                start = time.perf_counter()
                _step(model, opts[name], tokens)
                times[name].append(time.perf_counter() - start)
    return times


DOC = Path(__file__).resolve().parents[1] / "docs" / "speed.md"
BEGIN, END = "<!-- bench-compile: begin (generated) -->", "<!-- bench-compile: end -->"


def _row(tp: int, backend: str, med: dict[str, float]) -> str:
    ours = med["ours compiled"] / med["ours eager"]
    titan = med["titan compiled"] / med["titan eager"]
    return (f"| {tp} | {backend} | {med['ours eager']:.4f} | {med['ours compiled']:.4f} | {ours:.3f} | "
            f"{med['titan eager']:.4f} | {med['titan compiled']:.4f} | {titan:.3f} | {ours / titan:.3f} |")


def write_doc(rows: list[str], args: argparse.Namespace) -> None:
    """Put ``rows`` into docs/speed.md's generated table (``--doc``)."""
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    header = ("| tp | backend | ours eager s | ours compiled s | ours compiled/eager | TorchTitan eager s | "
              "TorchTitan compiled s | TorchTitan compiled/eager | ours / TorchTitan | planner's compiled/eager |\n"
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    sizes = (f"dim {args.dim}, {args.layers} blocks, {args.heads} heads, SwiGLU {args.ffn}, vocabulary {args.vocab}, "
             f"batch {args.batch} × {args.seq} tokens; median of {args.rounds} × {args.steps} steps")
    DOC.write_text(head + BEGIN + "\n" + sizes + "\n\n" + header + "\n" + "\n".join(rows) + "\n" + END + tail,
                   encoding="utf-8")


def planner_ratio(a: argparse.Namespace, tp: int) -> float:
    """The planner's compiled / eager step time for this model and layout on its CPU device (``COMPILE_FACTOR`` on
    the memory-bound traffic), fp32 as measured here."""
    from lightning_4d.mesh import ParallelDims
    from lightning_4d.planner import CPU, ClusterSpec, TrainSpec, TransformerSpec, estimate_step

    spec = TransformerSpec(vocab_size=a.vocab, hidden=a.dim, layers=a.layers, heads=a.heads, kv_heads=a.heads // 2,
                           ffn_hidden=a.ffn, seq_len=a.seq)
    dims, cluster = ParallelDims.from_world(tp, tp=tp), ClusterSpec(1, tp, CPU)
    train = TrainSpec(global_batch_size=a.batch, seq_len=a.seq, precision="32-true")
    eager = estimate_step(spec, dims, train, cluster).step_s
    return estimate_step(spec, dims, train.with_(compile=True), cluster).step_s / eager


def _report(tp: int, times: dict[str, list[float]], backend: str) -> float:
    med = {k: statistics.median(v) for k, v in times.items()}
    ours = med["ours compiled"] / med["ours eager"]
    titan = med["titan compiled"] / med["titan eager"]
    print(f"tp={tp} ({backend}): step s eager / compiled — ours {med['ours eager']:.4f} / {med['ours compiled']:.4f}, "
          f"TorchTitan {med['titan eager']:.4f} / {med['titan compiled']:.4f}; compile warm-up s ours "
          f"{med['ours compiled warm-up']:.1f}, TorchTitan {med['titan compiled warm-up']:.1f}")
    print(f"tp={tp}: compiled/eager ratio ours {ours:.3f}, TorchTitan {titan:.3f}; ours / TorchTitan's "
          f"{ours / titan:.3f} (target <= 1.05)")
    return ours / titan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--backend", default=None, help="default: inductor at tp=1, aot_eager at tp=2")
    p.add_argument("--doc", action="store_true", help="write the table of docs/speed.md")
    a = p.parse_args()
    rows = []
    assert a.dim >= 512 or a.dim % a.heads == 0
    for tp in a.tp:
        backend = a.backend or ("inductor" if tp == 1 else "aot_eager")
        times = measure(0, a, 1) if tp == 1 else run_world(measure, tp, a, tp, timeout_s=3000)[0]
        _report(tp, times, backend)
        med = {k: statistics.median(v) for k, v in times.items()}
        predicted = planner_ratio(a, tp)
        print(f"tp={tp}: the planner's compiled/eager on its CPU device {predicted:.3f}, measured (ours) "
              f"{med['ours compiled'] / med['ours eager']:.3f}")
        rows.append(_row(tp, backend, med) + f" {predicted:.3f} |")
    if a.doc:
        write_doc(rows, a)


if __name__ == "__main__":
    main()
