"""The parity helpers' tolerance (:func:`tests.distributed.common.assert_parity`), derived from each quantity's own
reordering noise, on the computation where a fixed 1e-5 failed on another CPU (a meta-built Llama, three AdamW
steps: the reference of the cp=2 parity case): another summation order of the same run passes on any CPU, and real
errors — a gradient off by 0.1 %, a loss off by 1e-4, a wrong layout, a missing shard — still fail. Single-process
runs only (three of a tiny model)."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

from tests.distributed.common import NOISE_FACTOR, assert_parity, fit_spec, parity_errors, reordering_noise

FLOOR = 1e-5
SPEC = dict(model="llama", steps=3, clip=None, meta=True)  # the reference of test_context_parallel's meta cp=2 case


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return fit_spec(SPEC)


def _noisiest(ref: dict[str, Any]) -> str:
    noise = reordering_noise(ref)
    assert noise is not None
    return max((k for k in noise if k.startswith("grad ")), key=noise.__getitem__).removeprefix("grad ")


def test_another_summation_order_passes(ref: dict[str, Any]) -> None:
    rotated = fit_spec(dict(SPEC, reorder="rotate"))  # the same batches, another order than the noise run's
    assert_parity(rotated, ref, FLOOR, label="rotated batches")
    noise = reordering_noise(ref)
    assert noise is not None and set(noise) == set(parity_errors(rotated, ref))
    # Every derived tolerance stays far below the smallest bug worth catching (0.1 % relative).
    assert max(max(FLOOR, NOISE_FACTOR * n) for n in noise.values()) < 1e-3, sorted(noise.items(), key=lambda x: x[1])[-3:]


def _perturbed(ref: dict[str, Any], how: str) -> dict[str, Any]:
    got = copy.deepcopy({k: v for k, v in ref.items() if k != "noise"})
    name = _noisiest(ref)  # where the tolerance is loosest
    g = got["grads"][name]
    if how == "scaled":  # e.g. a missing 1/accumulate or 1/tp on a gradient, at 0.1 %
        got["grads"][name] = g * (1 + 1e-3)
    elif how == "loss":  # the loss of one step off by 1e-4 relative
        got["losses"][1] *= 1 + 1e-4
    elif how == "layout":  # a wrong layout: the two halves of dim 0 (two tp shards) swapped
        got["grads"][name] = torch.cat(g.chunk(2, 0)[::-1])
    elif how == "missing shard":  # one of two shards' contribution never summed
        got["grads"][name] = torch.cat([g.chunk(2, 0)[0], torch.zeros_like(g.chunk(2, 0)[1])])
    return got


@pytest.mark.parametrize("how", ["scaled", "loss", "layout", "missing shard"])
def test_real_errors_fail(ref: dict[str, Any], how: str) -> None:
    with pytest.raises(AssertionError, match=re.escape("rel err")):
        assert_parity(_perturbed(ref, how), ref, FLOOR, label=how)
