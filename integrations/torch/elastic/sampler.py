"""A sampler that re-partitions what is left of the epoch after every re-form.

Every rank draws from the same per-epoch permutation, padded to a multiple of
the job size and dealt round-robin, so ranks run equally many batches and stay
in lockstep. :meth:`ElasticSampler.record_batch` therefore knows which indices
*every* rank has just processed and records them all: the processed set is
identical on every rank, and a rank that is lost takes nothing with it. After a
re-form the state objects agree on the union of the survivors' sets and the
rest of the epoch is dealt to the new ranks.
"""

from __future__ import annotations

import math
import random
from typing import Iterator, List, Set

import torch.utils.data

from hvdlike.core import api


class ElasticSampler(torch.utils.data.Sampler):
    """Partition ``dataset`` over the ranks; keep track of processed samples.

    Put it in the :class:`TorchState`, call :meth:`record_batch` after every
    batch and :meth:`set_epoch` at the *end* of every epoch.

    Args:
        dataset: anything with ``len()`` (its length must not change).
        shuffle: draw a new permutation every epoch.
        seed: permutation seed, the same on every rank.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: Set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.num_samples = 0
        self._dealt: List[List[int]] = [[]]
        self.reset()

    def _order(self) -> List[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def reset(self) -> None:
        """Deal the samples not yet processed this epoch to the current ranks."""
        initialized = api.is_initialized()
        self.num_replicas = api.size() if initialized else 1
        self.rank = api.rank() if initialized else 0
        remaining = [i for i in self._order() if i not in self.processed_indices]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        total = self.num_samples * self.num_replicas
        padded = remaining + remaining[:total - len(remaining)]
        self._dealt = [padded[r:total:self.num_replicas] for r in range(self.num_replicas)]

    @property
    def remaining_indices(self) -> List[int]:
        return [i for i in self._order() if i not in self.processed_indices]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` (counted from the last re-form) as processed on every rank."""
        lo, hi = batch_idx * batch_size, (batch_idx + 1) * batch_size
        for indices in self._dealt:
            self.processed_indices.update(indices[lo:hi])

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new permutation, nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._dealt[self.rank]))

    def __len__(self) -> int:
        return self.num_samples
