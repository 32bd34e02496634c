"""Doctests are collected from the package (``lightning_4d/``) only.

``--doctest-modules`` (pyproject addopts) would otherwise import every ``.py`` file under
``tests/`` to look for doctests, including helper modules and launcher scripts that pytest never
collects as tests; the tests themselves hold no doctests. The test worlds' forkserver preloads the modules every
rank would otherwise import on its own (below).
"""

from __future__ import annotations

import os

import pytest
from _pytest.doctest import DoctestModule

from lightning_4d.testing import PRELOAD_ENV


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    collected = yield
    return [c for c in collected if not isinstance(c, DoctestModule)]


# Every rank of a test world imports the test helpers and, for the bring-your-own-model tests, Hugging Face,
# torchtitan and LitGPT model modules: the forkserver imports them once instead.
_WORLD_PRELOAD = ["tests.distributed.common", "tests.distributed.byom_models", "transformers.modeling_utils",
                  *(f"transformers.models.{m}.modeling_{m}" for m in (
                      "llama", "qwen2", "qwen3", "mistral", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")),
                  "torchtitan.models.llama3", "torchtitan.models.qwen3", "litgpt"]
os.environ.setdefault(PRELOAD_ENV, ",".join(_WORLD_PRELOAD))
