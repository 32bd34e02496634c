"""Exact resume: put Lightning's loop state and the data position where the uninterrupted run would be.

Lightning 2.x mis-positions a resumed run from a map-style DataLoader: after a fit that ended
mid-epoch (``max_steps``) the resumed run counts the next epoch and restarts the data from the
epoch's first batch; after a fit that ended at an epoch end the first resumed epoch stops after one
batch; a mid-epoch ``ModelCheckpoint`` restarts the epoch's data from its first batch. We rewrite the
saved loop state from one number — the training batches consumed so far, ``T`` — into the canonical
"saved on train-batch end after batch ``b`` of epoch ``e``" form (``e, b = divmod(T, N)``), which
Lightning restores consistently, and skip the ``b`` batches of epoch ``e`` that were already used
(the distributed sampler reproduces epoch ``e``'s order from its seed and epoch number).

Example:
    >>> consumed_batches({"loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": {"processed": 6}}}}})
    6
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, TypeVar

from lightning_4d import _compat

__all__ = ["consumed_batches", "normalize_loop_state", "SkipFirstBatches", "skip_first_batches"]

_Loader = TypeVar("_Loader")


def consumed_batches(checkpoint: dict[str, Any]) -> int:
    """Training batches processed before the checkpoint was written (pure)."""
    return _compat.fit_loop_batches_processed(checkpoint)


def normalize_loop_state(checkpoint: dict[str, Any], batches_per_epoch: int) -> int:
    """Rewrite ``checkpoint["loops"]`` in place to the canonical state; return the batches to skip.

    Example:
        >>> ckpt = {"loops": {"fit_loop": {"epoch_loop.batch_progress": {"total": {"processed": 6}},
        ...                                "epoch_progress": {}, "epoch_loop.state_dict": {}}}}
        >>> normalize_loop_state(ckpt, batches_per_epoch=4)
        2
        >>> ckpt["loops"]["fit_loop"]["epoch_progress"]["total"]["ready"]
        2
    """
    if checkpoint.get("loops", {}).get("fit_loop") is None or batches_per_epoch <= 0:
        return 0
    total = consumed_batches(checkpoint)
    if total == 0:
        return 0
    epoch, in_epoch = divmod(total, batches_per_epoch)
    if in_epoch == 0:  # an epoch boundary: "after the last batch of the previous epoch"
        epoch, in_epoch = epoch - 1, batches_per_epoch
    _compat.set_fit_loop_position(checkpoint, epoch, in_epoch, total, last_batch=in_epoch == batches_per_epoch)
    return 0 if in_epoch == batches_per_epoch else in_epoch


class SkipFirstBatches:
    """A batch sampler that drops its first ``skip`` batches once (the resumed part of an epoch).

    ``len()`` stays the full epoch length, as Lightning counts the skipped batches as done.

    Example:
        >>> list(SkipFirstBatches([[0], [1], [2]], 2)), list(SkipFirstBatches([[0], [1]], 0))
        ([[2]], [[0], [1]])
    """

    def __init__(self, batch_sampler: Iterable[list[int]], skip: int) -> None:
        self.inner = batch_sampler
        self.skip = skip

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        for i, batch in enumerate(self.inner):
            if i >= skip:
                yield batch

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def skip_first_batches(dataloader: _Loader, skip: int) -> _Loader:
    """Make ``dataloader``'s next iteration start at batch ``skip`` (later epochs are untouched).

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = skip_first_batches(DataLoader(list(range(6)), batch_size=2), 1)
        >>> [b.tolist() for b in loader], len(loader)
        ([[2, 3], [4, 5]], 3)
    """
    if skip <= 0 or getattr(dataloader, "batch_sampler", None) is None:
        return dataloader
    # DataLoader forbids re-assigning its batch sampler after construction; this is the same object.
    _compat.replace_batch_sampler(dataloader, SkipFirstBatches(dataloader.batch_sampler, skip))
    return dataloader

