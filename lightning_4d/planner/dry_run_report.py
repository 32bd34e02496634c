"""What a dry run found, per rank and in all (:class:`RankTrace`, :class:`DryRunResult`), and the assumptions it
states (:data:`DRY_RUN_ASSUMPTIONS`); :mod:`lightning_4d.planner.dry_run` fills them.

Example:
    >>> RankTrace(0, {"pp": 0}, [0], [0, 1], {}, {}, {}, {}, ["tp all_reduce: traced 2, formula 1"], 0.1).matches
    False
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

__all__ = ["DRY_RUN_ASSUMPTIONS", "DryRunResult", "RankTrace"]

DRY_RUN_ASSUMPTIONS = [
    "dry run: lightning_4d.layout.parallelize.parallelize_module and lightning_4d.runtime.step (the code FourDStrategy runs) on a "
    "meta model, one rank per pipeline rank in a fake process group of the full world size; one training step of "
    "one micro-batch on fake tensors, compared with the formulas for m = 1",
    "dry run: uniform routing (assignments round-robin over the ep ranks, then their experts); the expert "
    "all-to-alls, dispatch and combine are the real ones",
    "dry run: pipeline sends measured from the stage boundary tensors (torch's schedule is not run; the rest of "
    "the strategy's step, lightning_4d.runtime.step, is); the pipeline's sequential check is skipped on meta",
]

_AXES = ("pp", "dp", "cp", "dp_cp", "tp", "edp", "ep")  # the axes the formulas name, in the order reports list them


# ---------------------------------------------------------------------------------------------- results
@dataclass
class RankTrace:
    """One traced role: the rank, its coordinates and stages, bytes sent per axis and kind (traced and
    from the formulas), call counts and the differences found.

    Example:
        >>> RankTrace(0, {"pp": 0}, [0], [0, 1], {}, {}, {}, {}, [], 0.1).matches
        True
    """

    rank: int
    coordinates: dict[str, int]
    stages: list[int]
    layers: list[int]
    traced: dict[str, dict[str, float]]
    traced_calls: dict[str, dict[str, int]]
    analytic: dict[str, dict[str, float]]
    analytic_calls: dict[str, dict[str, int]]
    differences: list[str]
    seconds: float
    notes: list[str] = field(default_factory=list)
    expert_reshard_after_forward: Optional[bool] = None

    @property
    def matches(self) -> bool:
        """Traced bytes equal the formulas' on every axis and kind."""
        return not self.differences

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON (with ``matches``)."""
        return {**asdict(self), "matches": self.matches}


@dataclass
class DryRunResult:
    """What :func:`dry_run` found: one :class:`RankTrace` per role plus the traced setting.

    Example:
        >>> DryRunResult(world_size=8, layout={}, model="toy", layers=2, micro_batch_size=1, seq_len=16,
        ...              precision="32-true").ok
        True
    """

    world_size: int
    layout: dict[str, Any]
    model: str
    layers: int
    micro_batch_size: int
    seq_len: int
    precision: str
    ranks: list[RankTrace] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=lambda: list(DRY_RUN_ASSUMPTIONS))
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every traced role matches the formulas."""
        return all(r.matches for r in self.ranks)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        out = asdict(self)
        out["ranks"] = [r.as_dict() for r in self.ranks]
        out["ok"] = self.ok
        return out

    def format(self) -> str:
        """A short text report: per role, bytes per axis traced vs formula, and the differences.

        Example:
            >>> print(DryRunResult(8, {}, "toy", 2, 1, 16, "32-true").format().splitlines()[0])  # doctest: +ELLIPSIS
            dry run of toy (2 blocks) on a fake 8-rank group: ...
        """
        n_entries = sum(len(k) for r in self.ranks for k in _union(r.traced, r.analytic).values())
        n_diff = sum(len(r.differences) for r in self.ranks)
        lines = [f"dry run of {self.model} ({self.layers} blocks) on a fake {self.world_size}-rank group: "
                 f"{len(self.ranks)} role(s), micro-batch {self.micro_batch_size}×{self.seq_len}, {self.precision}, "
                 f"{self.seconds:.1f} s; traced = formulas on {n_entries - n_diff} of {n_entries} axis·kind entries"]
        for r in self.ranks:
            coords = " ".join(f"{k}={v}" for k, v in r.coordinates.items())
            lines.append(f"  rank {r.rank} ({coords}; stages {r.stages}, blocks {_span(r.layers)}): "
                         + ("matches" if r.matches else f"{len(r.differences)} difference(s)"))
            for axis, kinds in _union(r.traced, r.analytic).items():
                parts = []
                for kind in kinds:
                    t, a = r.traced.get(axis, {}).get(kind, 0.0), r.analytic.get(axis, {}).get(kind, 0.0)
                    mark = "" if _close(t, a) else f" (formula {_fmt(a)})"
                    parts.append(f"{kind} {_fmt(t)}{mark}")
                lines.append(f"    {axis:>4}: " + ", ".join(parts))
            lines += [f"    ! {d}" for d in r.differences]
        notes = list(dict.fromkeys(n for r in self.ranks for n in r.notes))
        lines += [f"  note: {n}" for n in notes]
        return "\n".join(lines)

    @property
    def expert_reshard_after_forward(self) -> Optional[bool]:
        """Whether the traced experts' FSDP units reshard after forward (``None``: no expert unit traced)."""
        values = {r.expert_reshard_after_forward for r in self.ranks} - {None}
        return values.pop() if len(values) == 1 else None


def _union(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for src in (a, b):
        for axis, kinds in src.items():
            lst = out.setdefault(axis, [])
            lst += [k for k in kinds if k not in lst]
    return {axis: out[axis] for axis in sorted(out, key=lambda x: (_AXES + (x,)).index(x))}


def _close(x: float, y: float, rel: float = 1e-9) -> bool:
    return abs(x - y) <= rel * max(abs(x), abs(y), 1.0)


def _fmt(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x:.0f} B"


def _span(ids: Sequence[int]) -> str:
    ids = list(ids)
    if not ids:
        return "-"
    return f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1 else str(ids)
