"""The recipes' config error and the small value rules their sections share.

Example:
    >>> _positive("trainer.devices", 2)
"""

from __future__ import annotations

from typing import Any

__all__ = ["RecipeConfigError"]


class RecipeConfigError(ValueError):
    """A recipe config value breaks a rule; the message names the key, the rule and a fix.

    Example:
        >>> str(RecipeConfigError("parallel.tp=0 must be >= 1"))
        'parallel.tp=0 must be >= 1'
    """


def _positive(key: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeConfigError(f"{key}={value!r} must be a positive integer; e.g. {key}=1.")


def _non_negative(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise RecipeConfigError(f"{key}={value!r} must be a number >= 0.")


def _one_of(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        shown = ", ".join("null" if c is None else repr(c) for c in choices)
        raise RecipeConfigError(f"{key}={value!r} is not one of {shown}.")
