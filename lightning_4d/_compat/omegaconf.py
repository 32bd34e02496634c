"""OmegaConf 2.3 cannot type ``Literal`` fields or unions with them: a structured-config schema of a dataclass.

:func:`structured_schema` derives, from a dataclass of the package, a plain (mutable) dataclass with the same
fields and defaults that OmegaConf can type — ``Literal["a", "b"]`` becomes ``str``, a union of anything but
``None`` becomes ``Any``, a ``tuple[X, ...]`` a list, a ``timedelta`` a number of seconds (the owner converts it
back) — plus extra fields (a recipe's ``name``, Hydra's ``_target_``). The dataclass stays
the one owner of its fields and rules: :func:`owner_of` builds it (running its ``__post_init__``) from a
schema instance. When OmegaConf types ``Literal`` (``tests/unit/test_compat_omegaconf.py`` pins that it does
not), the mapping can go.

Example:
    >>> from dataclasses import dataclass
    >>> from typing import Literal
    >>> @dataclass(frozen=True)
    ... class Opt:
    ...     mode: Literal["a", "b"] = "a"
    >>> Schema = structured_schema(Opt, "OptSchema", name=(str, "opt"))
    >>> from omegaconf import OmegaConf
    >>> OmegaConf.structured(Schema).mode, owner_of(Schema(mode="b"))
    ('a', Opt(mode='b'))
"""

from __future__ import annotations

import dataclasses
import types
import typing
from datetime import timedelta
from functools import partial
from typing import Any, List, Literal, Optional, Union

__all__ = ["owner_of", "structured_schema"]


def _plain(tp: Any) -> Any:
    """``tp`` with what OmegaConf 2.3 cannot type replaced (``Literal`` → its values' type, unions → ``Any``,
    ``tuple[X, ...]`` → ``List[X]``, ``timedelta`` → seconds as ``float``)."""
    if tp is timedelta:
        return float
    origin = typing.get_origin(tp)
    if origin is tuple:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return List[_plain(args[0]) if len(set(args)) == 1 else Any]
    if origin is Literal:
        return type(typing.get_args(tp)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return Optional[_plain(args[0])]
        return Any
    return tp


def structured_schema(owner: type, cls_name: str, module: Optional[str] = None, /, **extra: tuple[Any, Any]) -> type:
    """A mutable dataclass named ``cls_name`` with the fields of the dataclass ``owner`` (types OmegaConf can
    check, same defaults) followed by ``extra`` fields given as ``field_name=(type, default)``.

    Example:
        >>> from lightning_4d.config import FourDConfig
        >>> S = structured_schema(FourDConfig, "S", name=(str, "custom"))
        >>> [f.name for f in dataclasses.fields(S)][:3], S().name
        (['tp', 'pp', 'ep'], 'custom')
    """
    hints = typing.get_type_hints(owner)
    specs: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(owner):
        if f.default is dataclasses.MISSING:
            default = dataclasses.field(default_factory=f.default_factory)
        elif isinstance(f.default, tuple):
            default = dataclasses.field(default_factory=partial(list, f.default))
        elif isinstance(f.default, timedelta):
            default = dataclasses.field(default=f.default.total_seconds())
        else:
            default = dataclasses.field(default=f.default)
        specs.append((f.name, _plain(hints[f.name]), default))
    specs += [(k, tp, dataclasses.field(default=d)) for k, (tp, d) in extra.items()]
    schema = dataclasses.make_dataclass(cls_name, specs)
    schema.__module__ = module or owner.__module__
    schema.__owner__ = owner  # type: ignore[attr-defined]
    schema.__doc__ = f"Structured-config schema of :class:`{owner.__module__}.{owner.__name__}` (same fields)."
    return schema


def owner_of(obj: Any) -> Any:
    """The owner dataclass built from a schema instance's fields (its own validation runs); other objects as
    they are.

    Example:
        >>> from lightning_4d.config import FourDConfig
        >>> owner_of(structured_schema(FourDConfig, "S")(tp=2)).tp
        2
    """
    owner = getattr(type(obj), "__owner__", None)
    if owner is None:
        return obj
    hints = typing.get_type_hints(owner)
    return owner(**{f.name: _owners_value(hints[f.name], getattr(obj, f.name)) for f in dataclasses.fields(owner)})


def _owners_value(tp: Any, value: Any) -> Any:
    """A schema value as the owner types it: seconds → ``timedelta`` (a number only), a list → a tuple."""
    if timedelta in (tp, *typing.get_args(tp)) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return timedelta(seconds=value)
    if typing.get_origin(_plain(tp)) in (list, List) and isinstance(value, list) and (
            typing.get_origin(tp) is tuple or tuple in map(typing.get_origin, typing.get_args(tp))):
        return tuple(value)
    return value
