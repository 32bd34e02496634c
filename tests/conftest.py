"""Doctests are collected from the package (``lightning_4d/``) only.

``--doctest-modules`` (pyproject addopts) would otherwise import every ``.py`` file under
``tests/`` to look for doctests, including helper modules and launcher scripts that pytest never
collects as tests; the tests themselves hold no doctests.
"""

from __future__ import annotations

import pytest
from _pytest.doctest import DoctestModule


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path, parent):
    collected = yield
    return [c for c in collected if not isinstance(c, DoctestModule)]
