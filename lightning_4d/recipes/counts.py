"""Parameter counts of a model config as the recipes report them: dense, in experts, active per token.

The counts themselves come from their owners (the planner's :class:`~lightning_4d.planner.TransformerSpec`, or a
Hugging Face model built on the meta device, :func:`~lightning_4d.recipes.hf_model.hf_param_count`); this module
holds only the record both return and its formatting, below both, so neither imports the other.

Example:
    >>> ParamCount(dense=8_150_000_000, expert=1_030_000_000_000, active=40_400_000_000).describe()
    '1.04T parameters (8.15B dense, 1.03T in experts; 40.4B active per token)'
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParamCount", "format_count"]


def format_count(n: float) -> str:
    """``1.04T``, ``8.03B``, ``125M``, ``4.1K``.

    Example:
        >>> format_count(1_038_000_000_000), format_count(124_439_808), format_count(188)
        ('1.04T', '124M', '188')
    """
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{int(n)}"


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model config: ``dense`` (replicated over ep; split by tp/pp), ``expert`` (routed
    expert weights; split by ep/pp) and ``active`` (used per token: dense + ``top_k`` experts).

    Example:
        >>> ParamCount(dense=10, expert=40, active=20).total
        50
    """
    dense: int
    expert: int
    active: int

    @property
    def total(self) -> int:
        """All parameters."""
        return self.dense + self.expert

    def describe(self) -> str:
        """One line, e.g. ``1.04T parameters (8.15B dense, 1.03T in experts; 40.4B active per token)``."""
        if not self.expert:
            return f"{format_count(self.total)} parameters (dense)"
        return (f"{format_count(self.total)} parameters ({format_count(self.dense)} dense, "
                f"{format_count(self.expert)} in experts; {format_count(self.active)} active per token)")
