"""Private Lightning Fabric APIs: the strategy's launcher and its gradient-sync control slots.

Example:
    >>> from lightning.fabric.strategies import SingleDeviceStrategy
    >>> strategy = SingleDeviceStrategy(device="cpu")
    >>> set_backward_sync_control(strategy, lambda module, enabled: None)
    >>> strategy._backward_sync_control is not None
    True
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Generator

if TYPE_CHECKING:
    from lightning.fabric.strategies import ParallelStrategy, Strategy
    from torch import nn

__all__ = ["install_fabric_launcher", "set_backward_sync_control"]


def install_fabric_launcher(strategy: ParallelStrategy) -> None:
    """Give a Fabric ``strategy`` Fabric's private ``_SubprocessScriptLauncher`` (re-executes ``sys.argv`` for the
    other local ranks) in its private ``Strategy._launcher`` slot, unless the cluster environment creates the
    processes itself (torchrun, SLURM). Called from the strategy's ``_configure_launcher`` hook, as Fabric's own
    ``ModelParallelStrategy`` does."""
    from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    env = strategy.cluster_environment
    if env is not None and not env.creates_processes_externally:
        strategy._launcher = _SubprocessScriptLauncher(env, strategy.num_processes, strategy.num_nodes)


def set_backward_sync_control(strategy: Strategy, set_sync: Callable[[nn.Module, bool], None]) -> None:
    """Make ``fabric.no_backward_sync(model, enabled)`` work for ``strategy``: an instance of Fabric's private
    ``_BackwardSyncControl`` in the private ``Strategy._backward_sync_control`` slot, whose context calls
    ``set_sync(module, False)`` on entry and ``set_sync(module, True)`` on exit when ``enabled`` (``module``: what the
    strategy's ``setup_module`` returned)."""
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    class _Control(_BackwardSyncControl):
        def no_backward_sync(self, module: nn.Module, enabled: bool) -> Any:
            return _no_sync(module, enabled, set_sync)

    strategy._backward_sync_control = _Control()


@contextmanager
def _no_sync(module: nn.Module, enabled: bool, set_sync: Callable[[nn.Module, bool], None]
             ) -> Generator[None, None, None]:
    if not enabled:
        yield
        return
    set_sync(module, False)
    try:
        yield
    finally:
        set_sync(module, True)
