"""Context parallelism on CPU: per-rank peak memory of one training step, activations and cp bytes against the
formulas and the planner, cp = 1, 2, 4, each algorithm (K/V all-gather, Ulysses, ring).

One forward + backward of the package's Llama (4 layers, dim 128, 8 heads, 4 K/V heads, fp32) on one sequence of
``T`` tokens (``--seq``, default 8192 16384 32768) split zigzag over ``cp`` gloo ranks, attention made global by
:class:`~lightning_4d.context_parallel.ContextParallelAttention` with each algorithm. Measured per rank: the step's
peak memory (the process's resident high-water mark during the step, reset just before it, minus its resident
memory then: everything the step allocates, transient buffers included; every tensor of 128 KiB or more gets its own
mapping, ``MALLOC_MMAP_THRESHOLD_``, so freed memory leaves the resident set at once), the activation bytes the backward keeps
(every tensor saved for backward, counted once per storage, via ``saved_tensors_hooks``; the weights the matmuls
save are parameters, left out) and the bytes sent on the cp axis (:class:`~lightning_4d.core.comm.CommCounter`).
cp = 1 is the plain model (its own causal attention, no context-parallel machinery). Printed beside them: the peak
against cp = 1's, the formula :func:`~lightning_4d.context_parallel.cost.activation_bytes_per_rank` (activations ÷ cp,
plus the gathered K/V under the all-gather), the planner's own activation term (:func:`planner_activation_bytes`:
:func:`~lightning_4d.planner.memory.memory_per_rank`'s ``activations`` for the same model, sequence, cp and
algorithm) with its ratio to the measurement, and :func:`~lightning_4d.context_parallel.cost.wire_bytes_per_rank`.
The table is docs/context_parallel_measurements.md (tests/unit/test_cp_measurements.py checks it).

Beyond 16k tokens only cp = 4 runs besides cp = 1 (each configuration costs about four 16k ones on a CPU).
``--keep`` keeps the rows of the ``--markdown`` file for the lengths not measured now (one length re-run alone).

Run: python bench/bench_context_parallel.py [--seq 8192 16384 32768] [--markdown docs/context_parallel_measurements.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lightning_4d.testing import run_world  # noqa: E402

LAYERS, DIM, HEADS, KV_HEADS, VOCAB = 4, 128, 8, 4, 256


def _model_config() -> Any:
    from lightning_4d.models import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS,
                       ffn_hidden=4 * DIM, max_seq_len=1 << 16)


def _model() -> Any:
    from lightning_4d.models import Llama

    torch.manual_seed(0)
    return Llama(_model_config())


def _status_bytes(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process (bytes; 0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as status:
            return next((int(line.split()[1]) * 1024 for line in status if line.startswith(key)), 0)
    except OSError:
        return 0


def _reset_peak() -> int:
    """Return freed heap memory to the system, reset the resident high-water mark (Linux ``clear_refs``) and
    return the resident bytes now."""
    from lightning_4d import _compat

    _compat.release_freed_host_memory()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def _saved_bytes(fn: Any, params: set[int]) -> tuple[Any, float]:
    """``fn()`` and the bytes of the distinct storages it saved for backward, parameters (``params``: their storages'
    addresses; weights saved by the matmuls are not activations) left out."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, float(sum(seen.values()))


def _rank(rank: int, seq: int, cp: int, algorithm: str = "allgather") -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_4d.core.comm import CommCounter, mesh_axis_groups
    from lightning_4d.context_parallel import ContextParallelAttention, shard_batch
    from lightning_4d.context_parallel.check import check_context_parallel, example_length

    model = _model()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    inputs, _, shard = shard_batch(tokens, tokens, mesh.get_group(), cp, rank, takes_positions=True)
    masks = None
    if cp > 1:  # each attention call's mask, read by the set-up check as the strategy does
        example = torch.randint(0, VOCAB, (2, example_length(model, cp)), generator=torch.Generator().manual_seed(2))
        masks = check_context_parallel(model, example, mesh.get_group(), cp, rank).layer_masks(model)
    base = _reset_peak()
    with CommCounter(mesh_axis_groups(mesh)) as counter:
        if cp == 1:  # what a run without context parallelism does: the model's own causal attention
            logits, saved = _saved_bytes(lambda: model(tokens), params)
        else:
            with ContextParallelAttention(shard, algorithm=algorithm, masks=masks):
                logits, saved = _saved_bytes(lambda: model(*inputs), params)
        logits.float().pow(2).mean().backward()
        del logits
    peak = _status_bytes("VmHWM") - base
    sent = sum(v["sent_bytes"] for (axis, kind), v in counter.totals().items() if axis == "cp" and kind != "recv")
    return {"saved": saved, "sent": sent, "peak": float(peak)}


def planner_activation_bytes(seq: int, cp: int, algorithm: str = "allgather") -> float:
    """The planner's activation term for the bench's model, one sequence of ``seq`` tokens, fp32, ``cp`` ranks,
    ``algorithm``: :func:`lightning_4d.planner.memory.memory_per_rank`'s ``activations`` (its blocks) of the one
    rank."""
    from lightning_4d.mesh import ParallelDims
    from lightning_4d.planner import TrainSpec, TransformerSpec, memory_per_rank

    spec = TransformerSpec.from_config(_model_config(), seq_len=seq)
    train = TrainSpec(1, seq_len=seq, precision="32-true", kernels="eager", cp_algorithm=algorithm)
    return memory_per_rank(spec, ParallelDims.from_world(cp, cp=cp), train)[0].activations


#: The configurations measured per sequence length: (cp, algorithm); beyond 16k tokens only cp = 4 besides cp = 1
#: (each costs about four 16k ones on a CPU, whatever its cp).
CONFIGS = ((1, "-"), *((cp, a) for cp in (2, 4) for a in ("allgather", "ulysses", "ring")))
LONG_CONFIGS = ((1, "-"), *((4, a) for a in ("allgather", "ulysses", "ring")))
LONG = 16384


def _kept_rows(path: Optional[Path], seqs: list[int]) -> list[str]:
    """The table rows of ``path`` (an earlier ``--markdown``) for sequence lengths not measured now."""
    if path is None or not path.exists():
        return []
    return [line for line in path.read_text().splitlines()
            if line.startswith("| ") and line[2].isdigit() and int(line.split("|")[1]) not in seqs]


def main() -> None:
    from lightning_4d.context_parallel.cost import activation_bytes_per_rank, wire_bytes_per_rank

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--markdown", type=Path, default=None,
                        help="also write the table as this markdown file (docs/context_parallel_measurements.md)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the rows of the --markdown file for the sequence lengths not measured now")
    args = parser.parse_args()
    # Every tensor of 128 KiB or more in its own mapping, returned to the system when freed: the resident memory then
    # follows the live tensors (no heap fragmentation in the peak). Read by the C library when the ranks start.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    kv_width = HEADS * DIM // HEADS  # the package's Llama repeats K/V to every head before SDPA
    rows = [HEADER, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(rows), flush=True)
    kept = _kept_rows(args.markdown, args.seq) if args.keep else []
    for seq in args.seq:
        base_peak, base_saved = 0.0, 0.0
        for cp, algorithm in (CONFIGS if seq <= LONG else LONG_CONFIGS):
            alg = algorithm if cp > 1 else "allgather"
            got = run_world(_rank, cp, seq, cp, alg, timeout_s=3600)
            saved, peak = max(r["saved"] for r in got), max(r["peak"] for r in got)
            base_peak, base_saved = base_peak or peak, base_saved or saved
            formula = activation_bytes_per_rank(base_saved, 1, seq, kv_width, LAYERS, cp, act_bytes=4, algorithm=alg)
            planner = planner_activation_bytes(seq, cp, alg)
            sent = wire_bytes_per_rank(alg, 1, seq, kv_width, kv_width, LAYERS, cp, act_bytes=4)
            rows.append(f"| {seq} | {algorithm} | {cp} | {peak / 1e6:.1f} | {peak / base_peak:.2f} | "
                        f"{saved / 1e6:.1f} | {formula / 1e6:.1f} | {planner / 1e6:.1f} | {planner / saved:.2f} | "
                        f"{got[0]['sent'] / 1e6:.2f} | {sent / 1e6:.2f} |")
            print(rows[-1], flush=True)
    if args.markdown is not None:
        body = sorted(kept + rows[2:], key=lambda line: int(line.split("|")[1]))  # by T, measured order kept
        seqs = sorted({int(line.split("|")[1]) for line in body})
        args.markdown.write_text(markdown(rows[:2] + body, seqs))


HEADER = ("| T | algorithm | cp | peak MB/rank | peak / cp=1 | saved MB/rank | formula | planner | planner / saved | "
          "cp sent MB | formula |")


def markdown(rows: list[str], seqs: list[int]) -> str:
    """The measurements document: what was measured, how, and the table ``rows`` (header included) over the
    sequence lengths ``seqs``."""
    return f"""# Context parallelism: measured per-rank memory and cp bytes (CPU)

Written by
`python bench/bench_context_parallel.py --seq {' '.join(map(str, seqs))} --markdown docs/context_parallel_measurements.md`;
`tests/unit/test_cp_measurements.py` recomputes the planner and formula columns from the code and checks the
claims quoted from it (docs/context_parallel.md).

One forward + backward of the package's Llama (4 layers, dim 128, 8 heads, 4 K/V heads, fp32) on one sequence of `T`
tokens split zigzag over `cp` gloo ranks by each algorithm (cp = 1: the plain model, its own causal attention).
**peak**: the step's peak memory on the busiest rank (the process's resident high-water mark during the step minus
its resident memory before it: activations, gradients and every transient buffer), and its ratio to cp = 1's.
**saved**: the activation bytes the backward keeps (every tensor saved for backward, once per storage, the weights
left out). **formula**: `lightning_4d.context_parallel.cost.activation_bytes_per_rank` from the cp = 1 measurement
(÷ cp, plus per layer the gathered K/V beyond the rank's share under the all-gather). **planner**: the planner's own
activation term (`lightning_4d.planner.memory.memory_per_rank(...).activations` for the same model, sequence, cp and
`cp_algorithm`, fp32), and its ratio to the measurement. **cp sent**: bytes this rank sent on the cp axis
(`CommCounter`; the ring's point-to-point sends) against `wire_bytes_per_rank`. Beyond {LONG} tokens only cp = 4 runs
besides cp = 1 (each configuration costs about four {LONG}-token ones on a CPU).

{chr(10).join(rows)}

Every algorithm runs attention in pieces merged by log-sum-exp (`lightning_4d.context_parallel.blockwise`), so no
rank holds a `T/cp × T` mask: memory falls with cp for all three. Ulysses and the ring keep only the rank's share of
the activations; the all-gather keeps, per layer, the whole sequence's K/V besides (the `formula` column's extra
term), which is why it sits above the others. The ring sends the most bytes (its backward passes the K/V around again
with their gradients) but overlaps each transfer with a chunk's attention.
"""


if __name__ == "__main__":
    main()
