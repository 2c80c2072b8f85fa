"""Process sets: subsets of ranks that negotiate and communicate on their own."""

from __future__ import annotations

from typing import List, Optional, Sequence

from .errors import NotInitializedError


class ProcessSet:
    """A subset of the job's ranks; collectives take it as ``process_set=``.

    Args:
        ranks: global ranks in the set (order does not matter; stored sorted).
            ``None`` is the global set of all ranks.
    """

    def __init__(self, ranks: Optional[Sequence[int]] = None):
        if ranks is not None:
            ranks = [int(r) for r in ranks]
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"process set ranks must be unique, got {ranks}")
            ranks = sorted(ranks)
        self.ranks: Optional[List[int]] = ranks
        self.process_set_id: Optional[int] = 0 if ranks is None else None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    def _runtime(self):
        from . import api

        return api.runtime()

    def _check_registered(self) -> int:
        if self.process_set_id is None:
            raise ValueError(f"{self!r} is not registered: pass it to init(process_sets=...) "
                             f"or add_process_set()")
        return self.process_set_id

    def size(self) -> int:
        runtime = self._runtime()
        return runtime.topology.size if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set."""
        runtime = self._runtime()
        if self.ranks is None:
            return runtime.topology.rank
        if runtime.topology.rank not in self.ranks:
            raise ValueError(f"rank {runtime.topology.rank} is not in {self!r}")
        return self.ranks.index(runtime.topology.rank)

    def included(self) -> bool:
        runtime = self._runtime()
        return self.ranks is None or runtime.topology.rank in self.ranks


global_process_set = ProcessSet(None)


def resolve(process_set) -> int:
    """The id a collective's ``process_set=`` argument refers to."""
    if process_set is None:
        return 0
    if isinstance(process_set, ProcessSet):
        return process_set._check_registered()
    raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")


__all__ = ["ProcessSet", "global_process_set", "NotInitializedError"]
