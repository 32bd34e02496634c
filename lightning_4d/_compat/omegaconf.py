"""OmegaConf 2.3 cannot type ``Literal`` fields or unions with them: a structured-config schema of a dataclass.

:func:`structured_schema` derives, from a dataclass of the package, a plain (mutable) dataclass with the same
fields and defaults that OmegaConf can type — ``Literal["a", "b"]`` becomes ``str``, a union of anything but
``None`` becomes ``Any`` — plus extra fields (a recipe's ``name``, Hydra's ``_target_``). The dataclass stays
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
from typing import Any, Literal, Optional, Union

__all__ = ["owner_of", "structured_schema"]


def _plain(tp: Any) -> Any:
    """``tp`` with what OmegaConf 2.3 cannot type replaced (``Literal`` → its values' type, unions → ``Any``)."""
    origin = typing.get_origin(tp)
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
        default = (dataclasses.field(default_factory=f.default_factory)
                   if f.default is dataclasses.MISSING else dataclasses.field(default=f.default))
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
    return owner(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(owner)})
