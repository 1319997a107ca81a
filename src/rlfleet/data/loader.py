"""A dataloader over an in-memory list whose position is saved and restored exactly.

Each epoch visits a permutation of the items drawn from ``seed + epoch``, so the order is reproducible and
independent of how many times the run was interrupted. Incomplete final batches are dropped (every step
sees the same number of prompts). After ``load_state_dict`` the next batch is exactly the one an
uninterrupted run would have produced: no item is skipped or repeated.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ResumableLoader(Generic[T]):
    """Yields fixed-size batches from ``items``, epoch after epoch.

    Args:
        items: The dataset (held in memory).
        batch_size: Items per batch; must not exceed ``len(items)``.
        shuffle: Permute each epoch (seeded by ``seed + epoch``) or keep file order.
        seed: Base seed of the per-epoch permutations.
    """

    def __init__(self, items: Sequence[T], batch_size: int, *, shuffle: bool, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(items) < batch_size:
            raise ValueError(
                f"the dataset has {len(items)} items, fewer than one batch of {batch_size}; "
                "add data or lower the number of prompts per step"
            )
        self.items = items
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.batch_in_epoch = 0

    @property
    def batches_per_epoch(self) -> int:
        return len(self.items) // self.batch_size

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[T]:
        """Returns the next batch, moving into the next epoch when the current one is exhausted."""
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
        order = self._order(self.epoch)
        start = self.batch_in_epoch * self.batch_size
        self.batch_in_epoch += 1
        return [self.items[i] for i in order[start : start + self.batch_size]]

    @property
    def completed_epochs(self) -> int:
        """Full passes finished so far (an epoch counts once its last batch has been taken)."""
        return self.epoch + (1 if self.batch_in_epoch >= self.batches_per_epoch else 0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "num_items": len(self.items),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the position; refuses a state saved for a different dataset or batch size."""
        for key in ("num_items", "batch_size", "shuffle", "seed"):
            current = len(self.items) if key == "num_items" else getattr(self, key)
            if state[key] != current:
                raise ValueError(
                    f"the checkpoint's dataloader has {key}={state[key]!r} but this run has {current!r}; "
                    "resume with the recipe the checkpoint was written with, or start a new checkpoint_dir"
                )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
