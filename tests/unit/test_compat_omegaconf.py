"""``lightning_4d._compat.omegaconf``: the recipes' schemas are the package's dataclasses, field for field, and the
workaround is still needed (OmegaConf cannot type ``Literal``; when it can, drop the mapping)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Literal

import omegaconf
import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from lightning_4d._compat.omegaconf import owner_of, structured_schema
from lightning_4d.config import FourDConfig
from lightning_4d.models import GPT2Config, LlamaConfig
from lightning_4d.models.moe import MoEConfig


def test_omegaconf_still_cannot_type_literal() -> None:
    @dataclasses.dataclass
    class WithLiteral:
        mode: Literal["a", "b"] = "a"

    assert omegaconf.__version__.startswith("2.3"), "re-check whether OmegaConf types Literal now"
    with pytest.raises(ValidationError, match="Literal"):
        OmegaConf.structured(WithLiteral)


@pytest.mark.parametrize("owner", [FourDConfig, LlamaConfig, MoEConfig, GPT2Config])
def test_schema_has_the_owners_fields_and_defaults(owner: type) -> None:
    schema = structured_schema(owner, "Schema", name=(str, "x"))
    node = OmegaConf.structured(schema)  # OmegaConf accepts it
    fields = dataclasses.fields(owner)
    assert [f.name for f in dataclasses.fields(schema)] == [f.name for f in fields] + ["name"]
    # as a recipe writes them: a timedelta in seconds, a tuple as a list
    written = {timedelta: timedelta.total_seconds, tuple: list}
    assert all(node[f.name] == written.get(type(f.default), lambda v: v)(f.default) for f in fields)
    assert owner_of(OmegaConf.to_object(node)) == owner()  # the owner builds it, defaults equal


def test_owner_rules_run_and_types_are_checked() -> None:
    schema = structured_schema(FourDConfig, "Schema")
    node = OmegaConf.structured(schema)
    node.dp = 4
    node.dp = "auto"  # Union[int, Literal["auto"]] → Any: the owner checks it
    with pytest.raises(ValidationError, match="tp"):
        node.tp = "two"
    with pytest.raises(ValueError, match="schedule='2f2b' is not known"):
        owner_of(schema(schedule="2f2b"))
    assert owner_of("not a schema") == "not a schema"
    node.timeout, node.preemption_signals = 90, ["SIGUSR2"]  # seconds and a list: the owner converts them back
    owned = owner_of(OmegaConf.to_object(node))
    assert owned.timeout == timedelta(seconds=90) and owned.preemption_signals == ("SIGUSR2",)
