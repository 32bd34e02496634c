"""``docs/moe_setup.md`` (written by ``bench/bench_moe_setup.py --markdown``) supports what docs/how_it_works.md,
``docs/measurements.md`` and the CHANGELOG claim from it: under ep=8, every rank's set-up peak is within ``1.5 · share + one expert's largest
matrix`` for both pretrained and random initialisation, a rank reads only its experts' keys (1/8 of them), and
initialisation seconds per rank fall with ep. A re-run of the benchmark that broke a claim fails here."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "moe_setup.md"


def _tables() -> dict[str, list[list[str]]]:
    tables: dict[str, list[list[str]]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            current = line[3:]
            tables[current] = []
        elif current and line.startswith("|") and not line.startswith("|---") and not re.match(r"\|\s*[a-z]", line):
            tables[current].append([c.strip() for c in line.strip("|").split("|")])
    return tables


def test_set_up_within_the_bound_on_every_rank() -> None:
    tables = _tables()
    ep8 = {k: v for k, v in tables.items() if "ep=8" in k}
    assert {k.split("`")[1] for k in ep8} == {"pretrained", "random"}, sorted(tables)
    for name, rows in ep8.items():
        assert len(rows) == 8, name
        for rank, share, setup, bound, ratio, *_ in rows:
            assert float(setup) <= float(bound), f"{name} rank {rank}: set-up {setup} MiB over the bound {bound}"
            assert abs(float(ratio) - float(setup) / float(bound)) < 0.01


def test_pretrained_ranks_read_only_their_experts() -> None:
    text = DOC.read_text()
    total = int(re.search(r"of (\d+) per-expert keys", text).group(1))
    rows = next(v for k, v in _tables().items() if k.startswith("`pretrained`"))
    assert all(int(r[-1]) == total // 8 for r in rows), [r[-1] for r in rows]


def test_initialisation_seconds_fall_with_ep() -> None:
    rows = next(v for k, v in _tables().items() if k.startswith("Initialisation seconds"))
    eps = [int(r[0]) for r in rows]
    seconds = [float(r[1]) for r in rows]
    assert eps == [1, 2, 4, 8]
    assert all(b < a for a, b in zip(seconds, seconds[1:])), seconds
    assert seconds[-1] <= 0.5 * seconds[0], "ep=8 should take well under half of ep=1's seconds"


def test_how_it_works_quotes_the_chunk_and_scratch_of_the_code() -> None:
    from lightning_4d.materialize.init_pieces import CHUNK_ELEMENTS, scratch_bytes

    readme = (DOC.parent / "how_it_works.md").read_text()
    assert f"{CHUNK_ELEMENTS // 1024} Ki elements at a time" in readme
    assert f"a scratch of at most {scratch_bytes() / 2**20:.0f} MiB" in readme


def test_measurements_summary_is_the_documents() -> None:
    """``docs/measurements.md``'s summary table and seconds line are computed here from ``docs/moe_setup.md``."""
    readme = (DOC.parent / "measurements.md").read_text()
    tables = _tables()
    for path, label in (("pretrained", "`from_pretrained` under the strategy"), ("random", "random init from the config")):
        rows = next(v for k, v in tables.items() if k.startswith(f"`{path}`"))
        setup, ratio = [float(r[2]) for r in rows], [float(r[4]) for r in rows]
        line = (f"| {label} | {rows[0][1]} | {min(setup):.1f}–{max(setup):.1f} | "
                f"{min(ratio):.2f}–{max(ratio):.2f} |")
        assert line in readme, f"docs/measurements.md's row should read: {line}"
    sweep = next(v for k, v in tables.items() if k.startswith("Initialisation seconds"))
    assert f"mean over ranks): {', '.join(r[1] for r in sweep)}." in readme
