"""Pins every private torch / Lightning / transformers name ``lightning_4d._compat`` relies on to the installed
versions, and refuses such a name anywhere else in the package (:func:`test_no_private_name_outside_compat`).

An upgrade that renames or removes one fails here, naming the symbol, instead of inside a training run. The list
of names is read from ``_compat``'s own source (imports, attribute accesses, ``getattr`` names and state keys that
start with ``_``): a private name added there without a line here fails :func:`test_every_private_name_is_pinned`.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path
from typing import Any, Callable

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_4d import _compat

COMPAT = Path(_compat.__file__).parent
THIRD_PARTY = ("torch", "lightning", "transformers")
_PRIVATE = re.compile(r"_[A-Za-z]\w*")


def _is_private(name: str) -> bool:
    return bool(_PRIVATE.fullmatch(name)) and not name.startswith("__")


def _code_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node of ``tree`` but docstrings."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if id(n) not in docs]


def _compat_sources() -> list[tuple[str, ast.Module]]:
    return [(path.name, ast.parse(path.read_text())) for path in sorted(COMPAT.glob("*.py"))]


def _imported_names(node: ast.AST) -> list[str]:
    """The components of a third-party module ``node`` imports, and the names it imports from one."""
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY:
        return node.module.split(".") + [a.name for a in node.names]
    if isinstance(node, ast.Import):
        return [part for a in node.names if a.name.split(".")[0] in THIRD_PARTY for part in a.name.split(".")]
    return []


def private_names_used() -> dict[str, list[str]]:
    """``{private name: ["file:line", ...]}`` for every ``_``-prefixed, non-dunder name ``_compat``'s code uses from
    torch / Lightning / transformers: a component of an imported module, an imported name, an attribute read or
    written, a string constant (``getattr`` names, checkpoint keys). ``_compat``'s own names are left out."""
    own = {n.name for _, tree in _compat_sources() for n in ast.walk(tree)
           if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and _is_private(n.name)}
    found: dict[str, list[str]] = {}
    for file, tree in _compat_sources():
        for node in _code_nodes(tree):
            names = _imported_names(node)
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            for name in names:
                if _is_private(name) and name not in own:
                    found.setdefault(name, []).append(f"{file}:{node.lineno}")
    return found


def private_imports() -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from module import name`` in ``_compat`` where either is private."""
    out = []
    for _, tree in _compat_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY:
                for alias in node.names:
                    if any(_is_private(p) for p in node.module.split(".")) or _is_private(alias.name):
                        out.append((node.module, alias.name))
    return sorted(set(out))


# (module, attribute path) of each private symbol used in lightning_4d/_compat.
PRIVATE_SYMBOLS = [
    ("lightning.fabric.utilities.distributed", "_init_dist_connection"),
    ("lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    ("lightning.fabric.strategies.strategy", "_BackwardSyncControl.no_backward_sync"),
    ("lightning.pytorch.loops.fit_loop", "_FitLoop._should_accumulate"),
    ("lightning.fabric.strategies.registry", "_StrategyRegistry"),
    ("torch", "ops.aten.mm.default._schema"),
    ("torch._dynamo.exc", "Unsupported"),
    ("torch._dynamo.exc", "UserError"),
    ("torch._dynamo.utils", "counters"),
    ("torch._dynamo.config", "capture_scalar_outputs"),
    ("torch._functorch.config", "donated_buffer"),
    ("torch.distributed.pipelining.schedules", "_wait_batch_p2p"),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.forward_one_chunk"),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.backward_one_chunk"),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase.backward_weight_one_chunk"),
    ("torch", "_foreach_norm"),
    ("torch", "_foreach_mul_"),
    ("torch.utils._foreach_utils", "_get_fused_kernels_supported_devices"),
    ("torch", "Tensor._make_wrapper_subclass"),
    ("torch", "_C._disabled_torch_function_impl"),
    ("torch.nn.init", "_no_grad_trunc_normal_"),
    ("torch", "_grouped_mm"),
    ("torch", "_C._current_graph_task_id"),
    ("torch", "_ops.HigherOrderOperator"),
    ("torch", "ops.aten._local_scalar_dense"),
    ("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu"),
    ("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu_backward"),
    ("torch", "ops.aten._scaled_dot_product_efficient_attention"),
    ("torch", "ops.aten._scaled_dot_product_efficient_attention_backward"),
    ("torch", "ops.aten._scaled_dot_product_flash_attention"),
    ("torch", "ops.aten._scaled_dot_product_cudnn_attention"),
    ("torch", "ops._c10d_functional.all_reduce"),
    ("torch", "ops._c10d_functional.reduce_scatter_tensor"),
    ("torch", "ops._c10d_functional.all_to_all_single"),
    ("torch", "ops.aten.mm.default._overloadpacket"),
    ("torch.nn.modules.loss", "_Loss"),
    ("torch.nn", "Module._apply"),
    ("torch.utils._pytree", "tree_flatten"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher"),
    ("torch.distributed.tensor._api", "DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos"),
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
    ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state"),
    ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    ("torch.distributed.distributed_c10d", "_world.pg_map"),
    ("torch.distributed", "ProcessGroupGloo._Options"),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten"),
    ("torch.distributed.device_mesh", "DeviceMesh._unflatten"),
    ("torch.distributed._composable.replicate_with_fsdp", "replicate"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    ("lightning.pytorch.callbacks", "ModelSummary._summary"),
    ("lightning.pytorch.utilities.model_summary", "ModelSummary._get_summary_data"),
    # lightning_4d/_compat/modules.py init_calls (a Hugging Face init_weights, module by module) and
    # dispatch.meta_scalar_mode (tracing on the meta device)
    ("transformers", "PreTrainedModel._initialize_weights"),
    ("transformers", "PreTrainedModel._keys_to_ignore_on_save"),
    ("transformers", "PreTrainedModel.is_custom_code"),
    ("transformers.initialization", "guard_torch_init_functions"),
    # lightning_4d/_compat/hf_saving.py (streamed export-hf: what save_pretrained drops and converts)
    ("transformers.modeling_utils", "remove_tied_weights_from_state_dict"),
    ("transformers.core_model_loading", "revert_weight_conversion"),
    # lightning_4d/_compat/hf_loading.py (pretrained weights streamed into shards: from_pretrained's key conversions)
    ("transformers.conversion_mapping", "get_model_conversion_mapping"),
    ("transformers.core_model_loading", "rename_source_key"),
    ("transformers.core_model_loading", "WeightConverter.add_tensor"),
    ("transformers.core_model_loading", "WeightConverter.convert"),
    ("transformers.core_model_loading", "WeightRenaming"),
    ("transformers.core_model_loading", "dot_natural_key"),
    ("transformers", "PreTrainedModel._supports_sdpa"),
    ("torch", "Tensor._base"),  # lightning_4d/_compat/dispatch.py view_base
]


def _fsdp_state() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return FSDPState()


# Private attributes of instances (set in ``__init__``, not on the class): name -> a fresh owner.
INSTANCE_SLOTS: dict[str, Callable[[], Any]] = {
    "_modules": lambda: torch.nn.Linear(2, 2),
    "_parameters": lambda: torch.nn.Linear(2, 2),
    "_buffers": lambda: torch.nn.BatchNorm1d(2),
    "_current_fx_name": L.LightningModule,
    "_timeout": lambda: torch.distributed.ProcessGroupGloo._Options(),
    "_launcher": lambda: L.pytorch.strategies.SingleDeviceStrategy(device="cpu"),
    "_backward_sync_control": lambda: L.fabric.strategies.SingleDeviceStrategy(device="cpu"),
    "_device_mesh": L.LightningModule,
    "_trainer": L.LightningModule,
    "_max_depth": lambda: L.pytorch.callbacks.ModelSummary(),
    "_summarize_kwargs": lambda: L.pytorch.callbacks.ModelSummary(),
    "_fsdp_param_group": _fsdp_state,
}
# Private keys of Lightning's checkpoint, pinned by a fit in the test named here.
PINNED_BY_TEST = {"_batches_that_stepped": "test_fit_loop_state_layout_is_lightnings"}


def _pinned() -> set[str]:
    parts = {p for module, path in PRIVATE_SYMBOLS for p in (*module.split("."), *path.split("."))}
    return {p for p in parts if _is_private(p)} | set(INSTANCE_SLOTS) | set(PINNED_BY_TEST)


def test_every_private_name_is_pinned() -> None:
    used = private_names_used()
    assert {"_foreach_norm", "_modules", "_wait_batch_p2p", "_should_accumulate"} <= set(used)  # the reader reads
    missing = {name: where for name, where in used.items() if name not in _pinned()}
    assert not missing, (f"private names used in lightning_4d/_compat but not pinned in {Path(__file__).name} "
                         f"(add them to PRIVATE_SYMBOLS or INSTANCE_SLOTS): {missing}")
    for name, test in PINNED_BY_TEST.items():
        assert name in Path(__file__).read_text().split(f"def {test}(", 1)[1]


@pytest.mark.parametrize(("module", "name"), private_imports(), ids=[f"{m}:{n}" for m, n in private_imports()])
def test_private_import_resolves(module: str, name: str) -> None:
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        importlib.import_module(f"{module}.{name}")  # a submodule not imported by its package


@pytest.mark.parametrize(("module", "path"), PRIVATE_SYMBOLS, ids=[f"{m}:{p}" for m, p in PRIVATE_SYMBOLS])
def test_private_symbol_exists(module: str, path: str) -> None:
    obj = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(obj, part), f"{module}.{path} is gone in this version: update lightning_4d/_compat"
        obj = getattr(obj, part)


@pytest.mark.parametrize("name", sorted(INSTANCE_SLOTS))
def test_private_instance_slot_exists(name: str) -> None:
    owner = INSTANCE_SLOTS[name]()
    assert hasattr(owner, name), f"{type(owner).__name__}().{name} is gone in this version: update lightning_4d/_compat"


def test_lightning_private_instance_slots() -> None:
    summary = L.pytorch.callbacks.ModelSummary(max_depth=2, foo=1)
    assert _compat.model_summary_options(summary) == (2, {"foo": 1})


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.lin(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fit_loop_state_layout_is_lightnings(tmp_path) -> None:
    # The keys set_fit_loop_position rewrites are the ones the installed Lightning saves, and the
    # batch counter reads back the batches a real fit processed.
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Tiny(), DataLoader(torch.ones(10, 2), batch_size=2))
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    ckpt = torch.load(tmp_path / "c.ckpt", weights_only=False)
    fit = ckpt["loops"]["fit_loop"]
    assert _compat.fit_loop_batches_processed(ckpt) == 3
    assert {"epoch_progress", "epoch_loop.batch_progress", "epoch_loop.state_dict"} <= set(fit)
    assert fit["epoch_loop.state_dict"]["_batches_that_stepped"] == 3
    assert set(fit["epoch_loop.batch_progress"]["current"]) == {"ready", "started", "processed", "completed"}
    _compat.set_fit_loop_position(ckpt, epoch=0, in_epoch=3, total=3, last_batch=False)
    assert fit["epoch_loop.state_dict"]["_batches_that_stepped"] == 2
    assert fit["epoch_progress"]["current"] == {"ready": 1, "started": 1, "processed": 0, "completed": 0}


def test_a_save_on_train_batch_end_keeps_its_logged_step() -> None:
    # ModelCheckpoint(every_n_train_steps) and preemption save in on_train_batch_end: the batch is processed, not
    # completed, and Lightning has not counted it in _batches_that_stepped yet; its restart increment does.
    progress = {"ready": 4, "started": 4, "processed": 4, "completed": 3}
    ckpt = {"loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": dict(progress), "current": dict(progress)},
                                   "epoch_progress": {}, "epoch_loop.state_dict": {"_batches_that_stepped": 3}}}}
    _compat.set_fit_loop_position(ckpt, epoch=0, in_epoch=4, total=4, last_batch=False)
    assert ckpt["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] == 3


# ---------------------------------------------------------------------------------------------- outside _compat
# Private names of other libraries allowed outside _compat, with the reason.
ALLOWED_OUTSIDE = {"_exit": "os._exit, the standard library's documented exit without clean-up (a frozen rank)"}


def _own_names(trees: list[ast.Module]) -> set[str]:
    """Every name the package defines itself: functions, classes, arguments, assigned names and attributes,
    attributes set by name (``setattr``, ``object.__setattr__``)."""
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
                if not isinstance(node, ast.ClassDef):
                    own.update(a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs])
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
            elif isinstance(node, ast.Call) and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and (
                    getattr(node.func, "id", None) == "setattr" or getattr(node.func, "attr", None) == "__setattr__"):
                own.add(str(node.args[1].value))
    return own


def private_names_outside_compat() -> dict[str, list[str]]:
    """``{private name: ["path:line", ...]}`` of torch / Lightning / transformers private names the package uses
    outside ``_compat``: a private component of an imported third-party module or name, an attribute read that the
    package does not define itself, a ``getattr`` / ``hasattr`` / ``setattr`` name, or a string naming one of the
    private instance attributes of an ``nn.Module`` or a ``LightningModule`` (``"_parameters"`` as a ``__dict__``
    key)."""
    root = COMPAT.parent
    sources = {p: ast.parse(p.read_text()) for p in sorted(root.rglob("*.py"))}
    own = _own_names(list(sources.values()))
    instance = {n for n in [*vars(torch.nn.Linear(2, 2)), *vars(L.LightningModule())] if _is_private(n)}
    found: dict[str, list[str]] = {}
    for path, tree in sources.items():
        if COMPAT in path.parents:
            continue
        for node in _code_nodes(tree):
            names = _imported_names(node)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr not in own:
                names = [node.attr]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr") \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value not in own:
                names = [str(node.args[1].value)]
            elif isinstance(node, ast.Constant) and node.value in instance:
                names = [node.value]
            for name in names:
                if _is_private(name) and name not in ALLOWED_OUTSIDE:
                    found.setdefault(name, []).append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_private_name_outside_compat() -> None:
    found = private_names_outside_compat()
    assert not found, ("private torch / Lightning / transformers names outside lightning_4d/_compat (reach them "
                       f"through a _compat helper, pinned above): {found}")


def test_the_outside_reader_finds_what_it_should(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_4d

    fake = tmp_path / "lightning_4d"
    (fake / "_compat").mkdir(parents=True)
    (fake / "_compat" / "__init__.py").write_text("x = 1\n")
    (fake / "bad.py").write_text("import torch\nfrom torch._ops import OperatorBase\n"
                                 "def f(m):\n    m._current_fx_name\n    return m.__dict__['_parameters']\n")
    monkeypatch.setattr(sys.modules[__name__], "COMPAT", fake / "_compat")
    assert set(private_names_outside_compat()) == {"_ops", "_current_fx_name", "_parameters"}
    assert lightning_4d.__file__  # the real package is read by test_no_private_name_outside_compat
