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
import operator
import random
import warnings
from typing import Iterable, Iterator, List, Set

import torch.utils.data

from hvdlike.core import api


def _integer(value, what: str) -> int:
    """``value`` as an int (Python, numpy or 0-d tensor integers); a TypeError naming
    ``what`` for anything else (floats, bools, strings, None)."""
    if isinstance(value, bool) or (torch.is_tensor(value) and value.is_floating_point()):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} "
                        f"{value!r}") from None


class ElasticSampler(torch.utils.data.Sampler):
    """Partition ``dataset`` over the ranks; keep track of processed samples.

    Put it in the :class:`TorchState`, call :meth:`record_batch` after every
    batch (or :meth:`record_indices` with the indices this rank processed) and
    :meth:`set_epoch` at the *end* of every epoch.

    Args:
        dataset: anything with ``len()`` (its length must not change, and must be
            the same on every rank).
        shuffle: draw a new permutation every epoch.
        seed: permutation seed, the same on every rank.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        try:
            len(dataset)
        except TypeError:
            raise TypeError(f"ElasticSampler needs a dataset with a length (len()), got "
                            f"{type(dataset).__name__}") from None
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = _integer(seed, "ElasticSampler seed")
        self.epoch = 0
        self.processed_indices: Set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.num_samples = 0
        self._dealt: List[List[int]] = [[]]
        self._before_init = True
        self._warned_past_end = False
        self.reset()

    def _order(self) -> List[int]:
        return self._order_of(self.epoch)

    def _order_of(self, epoch: int) -> List[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def reset(self) -> None:
        """Deal the samples not yet processed this epoch to the current ranks."""
        initialized = api.is_initialized()
        self._before_init = not initialized
        self.num_replicas = api.size() if initialized else 1
        self.rank = api.rank() if initialized else 0
        remaining = [i for i in self._order() if i not in self.processed_indices]
        self.num_samples = math.ceil(len(remaining) / self.num_replicas)
        total = self.num_samples * self.num_replicas
        # Pad by repeating the remaining samples (cyclically: fewer samples may be
        # left than ranks), so that every rank is dealt exactly num_samples.
        padded = [remaining[i % len(remaining)] for i in range(total)] if remaining else []
        self._dealt = [padded[r:total:self.num_replicas] for r in range(self.num_replicas)]

    def _current(self) -> None:
        """Re-deal when the samples were dealt for another job: a sampler built
        before ``init()`` (dealt for one rank), or kept outside the state across a
        re-form that changed the job's size."""
        if api.is_initialized() and (self._before_init or api.size() != self.num_replicas):
            self.reset()

    @property
    def remaining_indices(self) -> List[int]:
        return [i for i in self._order() if i not in self.processed_indices]

    def get_indices(self, batch_idx: int, batch_size: int) -> List[int]:
        """The indices this rank was dealt for batch ``batch_idx`` of ``batch_size``
        (counted from the last re-form)."""
        lo, hi = self._batch_bounds(batch_idx, batch_size)
        return self._dealt[self.rank][lo:hi]

    def _batch_bounds(self, batch_idx, batch_size):
        batch_idx = _integer(batch_idx, "record_batch: batch_idx")
        batch_size = _integer(batch_size, "record_batch: batch_size")
        if batch_idx < 0:
            raise ValueError(f"record_batch: batch_idx must be >= 0, got {batch_idx}")
        if batch_size <= 0:
            raise ValueError(f"record_batch: batch_size must be > 0, got {batch_size}")
        self._current()
        lo = batch_idx * batch_size
        if lo >= self.num_samples and not (lo == 0 and self.num_samples == 0):
            # Horovod ignores such a batch, and scripts written for it (several batches
            # per allreduce, counted past the end) rely on that: record nothing, say so once.
            if not self._warned_past_end:
                self._warned_past_end = True
                warnings.warn(
                    f"record_batch: batch {batch_idx} of size {batch_size} starts at sample "
                    f"{lo}, but each rank was dealt only {self.num_samples} sample(s) since the "
                    f"last re-form; nothing recorded (count batches from 0 each time the "
                    f"sampler is iterated afresh)", stacklevel=3)
            return lo, lo
        return lo, lo + batch_size

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` (counted from the last re-form) as processed on every rank."""
        lo, hi = self._batch_bounds(batch_idx, batch_size)
        for indices in self._dealt:
            self.processed_indices.update(indices[lo:hi])

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark dataset ``indices`` as processed (this rank's; the ranks' sets are
        united when the state is synced after a re-form)."""
        if torch.is_tensor(indices):
            indices = indices.reshape(-1).tolist()
        try:
            values = list(indices)
        except TypeError:
            raise TypeError(f"record_indices takes an iterable of dataset indices, got "
                            f"{type(indices).__name__} {indices!r}") from None
        checked = set()
        size = len(self.dataset)
        for value in values:
            index = _integer(value, "record_indices: each index")
            if not 0 <= index < size:
                raise ValueError(f"record_indices: index {index} is outside the dataset "
                                 f"(length {size})")
            checked.add(index)
        self.processed_indices.update(checked)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new permutation, nothing processed yet."""
        self.epoch = _integer(epoch, "set_epoch: epoch")
        self.processed_indices = set()
        self.reset()

    @property
    def processed_num(self) -> int:
        """How many samples of this epoch every rank together has processed
        (Horovod's counter; here the size of ``processed_indices``)."""
        return len(self.processed_indices)

    @processed_num.setter
    def processed_num(self, count: int) -> None:
        # Horovod's meaning: the first ``count`` samples of the epoch's order are done
        # (dealt again at the next reset(), as there).
        count = _integer(count, "processed_num")
        if count < 0:
            raise ValueError(f"processed_num must be >= 0, got {count}")
        self.processed_indices = set(self._order()[:count])

    def state_dict(self) -> dict:
        """``epoch``, ``processed_indices`` and Horovod's ``processed_num``."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices),
                "processed_num": self.processed_num}

    def load_state_dict(self, state: dict) -> None:
        """Take ``state_dict()``'s dict, or Horovod's ``{'epoch', 'processed_num'}``
        (the first ``processed_num`` samples of that epoch's order are done)."""
        try:
            epoch = state["epoch"]
            indexed = "processed_indices" in state
            processed = state["processed_indices" if indexed else "processed_num"]
        except (TypeError, KeyError):
            raise ValueError(f"ElasticSampler.load_state_dict expects a dict with 'epoch' and "
                             f"'processed_indices' (as state_dict() returns) or "
                             f"'processed_num' (as Horovod's does), got {state!r:.200}") from None
        epoch = _integer(epoch, "load_state_dict: 'epoch'")
        if not indexed:
            count = _integer(processed, "load_state_dict: 'processed_num'")
            if count < 0:
                raise ValueError(f"load_state_dict: 'processed_num' must be >= 0, got {count}")
            processed = self._order_of(epoch)[:count]
        if torch.is_tensor(processed):
            processed = processed.reshape(-1).tolist()
        try:
            processed = {_integer(i, "load_state_dict: each of 'processed_indices'")
                         for i in processed}
        except TypeError as exc:
            if "must be an integer" in str(exc):
                raise
            raise TypeError(f"load_state_dict: 'processed_indices' must be an iterable of "
                            f"integers, got {type(processed).__name__}") from None
        self.epoch = epoch
        self.processed_indices = processed
        self.reset()

    def __iter__(self) -> Iterator[int]:
        self._current()
        return iter(list(self._dealt[self.rank]))

    def __len__(self) -> int:
        self._current()
        return self.num_samples
