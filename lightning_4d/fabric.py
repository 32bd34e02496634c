"""``FourDStrategy`` for Lightning Fabric: the Trainer strategy's plan and set-up, in a loop you write.

Lightning ships one ``ModelParallelStrategy`` class per API; so does lightning_4d: :class:`lightning_4d.FourDStrategy`
for the Trainer, ``lightning_4d.fabric.FourDStrategy`` for Fabric (``strategy="fourd"`` once ``lightning_4d`` is
imported). The class is :class:`lightning_4d.runtime.fabric_strategy.FourDStrategy`; docs/fabric.md is the guide.

Example:
    >>> import lightning as L
    >>> strategy = FourDStrategy(tp=2, pp=2)  # the options of FourDConfig but TRAINER_ONLY
    >>> # not run: needs a process group
    >>> fabric = L.Fabric(strategy=strategy, devices=8, accelerator="cpu")  # doctest: +SKIP
    >>> model, optimizer = fabric.setup(model, optimizer)  # doctest: +SKIP
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_4d.runtime.fabric_strategy import TRAINER_ONLY, FourDStrategy

__all__ = ["FourDStrategy", "TRAINER_ONLY"]

FourDStrategy.register_strategies(STRATEGY_REGISTRY)
