"""Expert load of mixture-of-experts layers: tokens per expert over all ranks, imbalance, dropped tokens,
aux loss, and a layers × experts heatmap.

Counts are the router's assignments before capacity dropping (``MoE.tokens_per_expert``) summed over
every forward of the training step (all pipeline micro-batches; activation-checkpointing recomputes
excluded) and over the ranks that route *different* tokens: data-parallel ranks, and tensor-parallel
ranks under sequence parallelism (each holds a sequence shard); without it TP peers route the same
tokens and count once. Layers on other pipeline stages are gathered too, so every rank logs every layer.

Example:
    >>> s = load_stats(torch.tensor([6.0, 2.0, 2.0, 2.0]))
    >>> s["imbalance"], round(s["cv"], 4)
    (2.0, 0.5774)
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_4d import _compat
from lightning_4d.callbacks._common import (
    RunContext,
    every_n,
    gather_rows,
    internal_comm,
    log_metrics,
    new_figure,
    resolve_every_n,
    resolve_output_dir,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch.utils.hooks import RemovableHandle

__all__ = ["ExpertLoadMonitor", "layer_labels", "load_stats", "plot_expert_heatmap"]


def load_stats(tokens: torch.Tensor) -> dict[str, float]:
    """Imbalance of one layer's tokens per expert ``(E,)``: ``max/mean`` and the coefficient of
    variation ``std/mean`` (population std; 0 and 1.0 when balanced), plus the total.

    Example:
        >>> load_stats(torch.tensor([3.0, 3.0]))
        {'tokens': 6.0, 'imbalance': 1.0, 'cv': 0.0}
    """
    t = tokens.detach().double()
    total = float(t.sum())
    mean = total / max(t.numel(), 1)
    if mean <= 0:
        return {"tokens": total, "imbalance": 0.0, "cv": 0.0}
    return {"tokens": total, "imbalance": float(t.max()) / mean, "cv": float(t.std(unbiased=False)) / mean}


def layer_labels(names: Sequence[str]) -> dict[str, str]:
    """Short, unique labels for MoE module names: ``layer{N}`` from the first number after the names'
    common prefix (``model.layers.3.feed_forward`` → ``layer3``), else the name itself.

    Example:
        >>> layer_labels(["model.layers.1.feed_forward", "model.layers.3.feed_forward"])
        {'model.layers.1.feed_forward': 'layer1', 'model.layers.3.feed_forward': 'layer3'}
    """
    labels: dict[str, str] = {}
    for name in names:
        number = next((p for p in name.split(".") if p.isdigit()), None)
        labels[name] = f"layer{number}" if number is not None else (name or "moe")
    if len(set(labels.values())) != len(labels):
        labels = {n: re.sub(r"[^0-9A-Za-z_.]", "_", n) or "moe" for n in names}
    return labels


def plot_expert_heatmap(tokens: torch.Tensor, layers: Sequence[str], path: str, title: str = "") -> Optional[str]:
    """PNG heatmap of ``tokens`` ``(layers, experts)`` as load relative to a balanced layer (1.0 = mean);
    ``None`` without matplotlib.

    Example:
        >>> # not run: needs files (writes a PNG)
        >>> plot_expert_heatmap(torch.ones(2, 4), ["layer0", "layer1"], "experts.png")  # doctest: +SKIP
        'experts.png'
    """
    fig = new_figure(figsize=(max(6.0, 0.35 * tokens.shape[1] + 2.5), max(2.4, 0.4 * tokens.shape[0] + 1.4)), dpi=100)
    if fig is None:
        return None
    t = tokens.detach().double()
    mean = t.mean(1, keepdim=True).clamp_min(1e-12)
    rel = (t / mean).numpy()
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(rel, aspect="auto", cmap="coolwarm", vmin=0.0, vmax=max(2.0, float(rel.max())),
                      interpolation="nearest")
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels(list(layers), fontsize=7)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    if tokens.shape[1] <= 32:
        ax.set_xticks(range(tokens.shape[1]))
        ax.tick_params(axis="x", labelsize=7)
    if tokens.shape[1] <= 16 and tokens.shape[0] <= 24:  # small enough to print the counts
        for i in range(tokens.shape[0]):
            for j in range(tokens.shape[1]):
                ax.text(j, i, f"{float(t[i, j]):.0f}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, label="tokens / mean")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path


class ExpertLoadMonitor(Callback):
    """Logs the global expert load of every MoE layer of the training step; writes a heatmap.

    Per recorded step and MoE layer (label ``layer{N}``, see :func:`layer_labels`):

    - ``moe/<layer>/imbalance`` (max / mean tokens per expert), ``moe/<layer>/cv`` (std / mean),
    - ``moe/<layer>/tokens``, ``moe/<layer>/dropped_tokens``, ``moe/<layer>/dropped_fraction``,
    - ``moe/<layer>/aux_loss`` (routers that compute one; mean over ranks and forwards),
    - ``moe/<layer>/tokens_expert{e}`` when ``per_expert`` (default: ``E <= 16``),

    and ``moe/imbalance_max``, ``moe/cv_mean``, ``moe/dropped_tokens``, ``moe/aux_loss`` (sum over layers,
    like :func:`~lightning_4d.expert_parallel.moe_aux_loss`). Every ``heatmap_every_n_steps`` recorded
    steps global rank 0 writes ``experts_step{N}.png`` (layers × experts, load relative to the mean)
    into ``dirpath`` (default ``<trainer.log_dir>/experts``). A no-op for a model without MoE layers.

    Args:
        every_n_steps: record every N training batches, counted from the start of fit (default:
            ``trainer.log_every_n_steps``).
        heatmap_every_n_steps: write a heatmap every N training batches (0: never; on recorded batches).
        dirpath: where to write heatmaps.
        per_expert: log one key per expert (``None``: when every layer has at most 16 experts).

    Attributes:
        last_tokens: ``(layers, experts)`` global tokens of the last recorded step; ``layers``: their labels.

    Example:
        >>> monitor = ExpertLoadMonitor(every_n_steps=1)
        >>> # not run: needs a Trainer
        >>> trainer = L.Trainer(strategy=FourDStrategy(ep=2), callbacks=[monitor])  # doctest: +SKIP
        >>> trainer.fit(moe_lm, data)  # doctest: +SKIP
        >>> float(trainer.callback_metrics["moe/layer0/imbalance"])  # doctest: +SKIP
        1.21
    """

    def __init__(self, every_n_steps: Optional[int] = None, heatmap_every_n_steps: int = 100,
                 dirpath: Optional[str] = None, per_expert: Optional[bool] = None) -> None:
        super().__init__()
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1 (or None for trainer.log_every_n_steps).")
        if heatmap_every_n_steps < 0:
            raise ValueError(f"heatmap_every_n_steps={heatmap_every_n_steps} must be >= 0.")
        self.every_n_steps = every_n_steps
        self.heatmap_every_n_steps = heatmap_every_n_steps
        self.dirpath = dirpath
        self.per_expert = per_expert
        self.layers: list[str] = []
        self.last_tokens: Optional[torch.Tensor] = None
        self.written: list[str] = []
        self._ctx: Optional[RunContext] = None
        self._every = 1
        self._dir: Optional[str] = None
        self._moe_modules: dict[str, torch.nn.Module] = {}  # global name -> local MoE module
        self._names: list[str] = []  # every rank's MoE names (global order)
        self._experts = 0
        self._hooks: list[RemovableHandle] = []
        self._recording = False
        self._acc: dict[str, list[Union[torch.Tensor, float, int]]] = {}
        self._batches = 0
        self._step = 0

    @property
    def active(self) -> bool:
        """Whether the model has MoE layers (on any rank)."""
        return bool(self._names)

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._ctx = RunContext.from_trainer(trainer)
        self._every = resolve_every_n(self.every_n_steps, trainer)
        if self.heatmap_every_n_steps > 0:
            self._dir = resolve_output_dir(trainer, self.dirpath, "experts")  # broadcasts: every rank

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._remove_hooks()
        local = {name: m for name, m in pl_module.named_modules() if _load_of(m) is not None}
        names: list[tuple[str, int]] = [(n, _load_of(m)[0]) for n, m in local.items()]  # type: ignore[index]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list[Optional[list[tuple[str, int]]]] = [None] * dist.get_world_size()
            with internal_comm():
                dist.all_gather_object(everyone, names)
            names = [item for part in everyone for item in part]
        order: dict[str, int] = {}
        for name, experts in names:
            order.setdefault(name, experts)
        self._names = sorted(order, key=_natural_key)
        self._experts = max(order.values(), default=0)
        labels = layer_labels(self._names)
        self.layers = [labels[n] for n in self._names]
        self._moe_modules = local
        for name, module in local.items():
            self._hooks.append(module.register_forward_hook(self._make_hook(name)))

    def _make_hook(self, name: str) -> Callable[[torch.nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            # Forwards of the recorded training step only; not recomputation inside backward.
            if not self._recording or _compat.in_backward():
                return
            acc = self._acc.get(name)
            aux = getattr(getattr(module, "router", None), "aux_loss", None)
            _, tokens, dropped = _load_of(module)  # type: ignore[misc]
            if tokens is None:
                return
            if acc is None:
                acc = self._acc[name] = [torch.zeros_like(tokens), torch.zeros_like(dropped), 0.0, 0]
            acc[0] += tokens
            acc[1] += dropped
            if aux is not None:
                acc[2] += aux.detach()
                acc[3] += 1
        return hook

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self._acc = {}
        self._step, self._batches = self._batches, self._batches + 1
        self._recording = self.active and every_n(self._every, self._step)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: STEP_OUTPUT,
                           batch: Any, batch_idx: int) -> None:
        if not self._recording:
            return
        self._recording = False
        ctx = self._ctx
        assert ctx is not None
        n_layers, n_exp = len(self._names), self._experts
        # Per layer: [tokens per expert (E), dropped, aux sum, aux forwards]; TP peers without SP route
        # the same tokens: only tp rank 0 contributes.
        width = n_exp + 3
        row = torch.zeros(n_layers * width, dtype=torch.float64)
        duplicate = ctx.degree("tp") > 1 and not ctx.mesh.dims.sp and ctx.coordinate("tp") != 0
        if not duplicate:
            for i, name in enumerate(self._names):
                acc = self._acc.get(name)
                if acc is None:
                    continue
                base = i * width
                row[base: base + acc[0].numel()] = acc[0].double().cpu()
                row[base + n_exp] = float(acc[1])
                row[base + n_exp + 1] = float(acc[2])
                row[base + n_exp + 2] = float(acc[3])
        total = gather_rows(row, pl_module.device).sum(0).view(n_layers, width)
        tokens = total[:, :n_exp]
        self.last_tokens = tokens
        per_expert = self.per_expert if self.per_expert is not None else n_exp <= 16
        metrics: dict[str, float] = {}
        imbalances, cvs, aux_total, dropped_total, any_aux = [], [], 0.0, 0.0, False
        for i, label in enumerate(self.layers):
            stats = load_stats(tokens[i])
            prefix = f"moe/{label}"
            dropped = float(total[i, n_exp])
            metrics[f"{prefix}/imbalance"] = stats["imbalance"]
            metrics[f"{prefix}/cv"] = stats["cv"]
            metrics[f"{prefix}/tokens"] = stats["tokens"]
            metrics[f"{prefix}/dropped_tokens"] = dropped
            metrics[f"{prefix}/dropped_fraction"] = dropped / stats["tokens"] if stats["tokens"] else 0.0
            if total[i, n_exp + 2] > 0:
                aux = float(total[i, n_exp + 1] / total[i, n_exp + 2])
                metrics[f"{prefix}/aux_loss"] = aux
                aux_total += aux
                any_aux = True
            if per_expert:
                metrics.update({f"{prefix}/tokens_expert{e}": float(tokens[i, e]) for e in range(n_exp)})
            imbalances.append(stats["imbalance"])
            cvs.append(stats["cv"])
            dropped_total += dropped
        metrics["moe/imbalance_max"] = max(imbalances)
        metrics["moe/cv_mean"] = sum(cvs) / len(cvs)
        metrics["moe/dropped_tokens"] = dropped_total
        if any_aux:
            metrics["moe/aux_loss"] = aux_total
        log_metrics(pl_module, metrics)
        step = self._step
        if (self.heatmap_every_n_steps > 0 and every_n(self.heatmap_every_n_steps, step)
                and ctx.rank == 0 and self._dir is not None):
            title = f"tokens per expert, step {step} (max imbalance {max(imbalances):.2f})"
            path = plot_expert_heatmap(tokens, self.layers, os.path.join(self._dir, f"experts_step{step}.png"), title)
            if path is not None:
                self.written.append(path)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._remove_hooks()
        self._recording = False

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._remove_hooks()
        self._recording = False

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._remove_hooks()
        self._recording = False


def _load_of(module: torch.nn.Module) -> Optional[tuple[int, Optional[torch.Tensor], torch.Tensor]]:
    """``(num_experts, tokens per expert of the last forward, dropped tokens)`` of an MoE layer: the package's
    :class:`~lightning_4d.expert_parallel.MoE` or a model's own experts module under in-place expert
    parallelism (dropless: no dropped tokens); ``None`` for any other module."""
    from lightning_4d.expert_parallel import MoE
    from lightning_4d.expert_parallel.inplace import is_inplace_experts

    if isinstance(module, MoE):
        return int(module.num_experts), module.tokens_per_expert, module.dropped_tokens
    if is_inplace_experts(module):
        tokens = module.fourd_tokens_per_expert
        return module.fourd_experts.spec.num_experts, tokens, torch.zeros((), dtype=torch.long)
    return None


def _natural_key(name: str) -> list[tuple[int, Union[int, str]]]:
    return [(0, int(p)) if p.isdigit() else (1, p) for p in name.split(".")]
