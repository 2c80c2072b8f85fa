"""Waiting on the store for other members while a process set is being built.

Building a set is collective: each member publishes a record (its host, a
segment's name, its arrival at a group) and waits for the others'. A plain
``store.get`` cannot be given up: a member that died at that moment would hold
the others for the store's whole timeout and leave them a store error that
names nobody. :func:`await_keys` polls instead, and stops as soon as

* the job has failed (``abandon()``, the runtime's fatal error), or
* the ranks still missing are known to be gone (``gone(ranks)``, the health
  watcher's probe: they left word in the store, or their heartbeat stopped), or
* the timeout has passed,

each time with an error that says which ranks it waited for and why it stopped.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, List, Optional, Sequence

from .errors import HvdlikeInternalError

# ``gone(global ranks)`` -> what is known about those that are gone ('' for none).
Gone = Callable[[Sequence[int]], str]
# Makes a fresh ``gone`` probe for one wait (the probe remembers heartbeats).
Watch = Callable[[], Gone]

PROBE_SECONDS = 0.25  # how often the ranks still missing are looked up
_LONGEST_NAP = 0.02


def no_watch() -> Gone:
    """A probe that knows nothing (no health watcher yet: the runtime is starting)."""
    return lambda ranks: ""


def await_keys(store, keys: Sequence[str], owners: Sequence[int], timeout_seconds: float,
               abandon: Callable[[], Optional[BaseException]], gone: Gone, what: str) -> None:
    """Return once every one of ``keys`` is in ``store``.

    Args:
        keys: the records waited for; ``owners[i]`` is the global rank that writes ``keys[i]``.
        timeout_seconds: how long to wait in all.
        abandon: returns the job's failure once there is one.
        gone: names the ranks among those given that will never write (see module doc).
        what: what is being set up, for the error ("the shared memory of process set 1").

    Raises:
        HvdlikeInternalError: naming the ranks still missing and why the wait stopped.
    """
    keys = list(keys)
    if not keys:
        return
    await_all(lambda: store.check(keys),
              lambda: [owner for key, owner in zip(keys, owners) if not store.check([key])],
              timeout_seconds, abandon, gone, what)


def await_all(done: Callable[[], bool], missing: Callable[[], List[int]],
              timeout_seconds: float, abandon: Callable[[], Optional[BaseException]],
              gone: Gone, what: str, doing: str = "take part",
              longest_nap: float = _LONGEST_NAP) -> None:
    """Return once ``done()``; the general form of :func:`await_keys`.

    ``done()`` is polled (cheaply, with naps growing to ``longest_nap``);
    ``missing()`` -- the global ranks not there yet -- only every
    ``PROBE_SECONDS`` and at the timeout, for ``gone`` and the errors, which
    say the ranks did not ``doing`` in time.
    """
    deadline = time.monotonic() + timeout_seconds
    probe_at = time.monotonic() + PROBE_SECONDS
    nap = min(0.001, longest_nap)
    while not done():
        error = abandon()
        if error is not None:
            raise HvdlikeInternalError(f"gave up setting up {what}, the job has failed: "
                                       f"{error}")
        now = time.monotonic()
        if now >= probe_at or now >= deadline:
            late = missing()
            if not late:
                return
            why = gone(late)
            if why:
                raise HvdlikeInternalError(f"could not set up {what}: {why}")
            if now >= deadline:
                raise HvdlikeInternalError(
                    f"could not set up {what}: rank(s) {late} did not {doing} within "
                    f"{timeout_seconds:g}s")
            probe_at = now + PROBE_SECONDS
        time.sleep(nap)
        nap = min(nap * 2, longest_nap)


def gather(store, prefix: str, rank: int, size: int, mine: Any,
           decide: Callable[[List[Any]], Any], timeout_seconds: float,
           abandon: Callable[[], Optional[BaseException]], gone: Gone, what: str) -> Any:
    """Every rank's ``mine`` gathered at rank 0, ``decide``d there, the outcome on every rank.

    Rank 0 applies ``decide`` to the values in rank order and publishes what it
    returns; each value and the outcome must be JSON. One key per rank and one
    read of the outcome each, not ``size`` reads per rank. Collective over
    ``size`` ranks; ``prefix`` names the exchange.
    """
    outcome = f"{prefix}outcome"
    if rank != 0:
        store.set(f"{prefix}{rank}", json.dumps(mine).encode())
        await_keys(store, [outcome], [0], timeout_seconds, abandon, gone, what)
        return json.loads(store.get(outcome).decode())
    owners = list(range(1, size))
    keys = [f"{prefix}{r}" for r in owners]
    await_keys(store, keys, owners, timeout_seconds, abandon, gone, what)
    decided = decide([mine] + [json.loads(store.get(key).decode()) for key in keys])
    store.set(outcome, json.dumps(decided).encode())
    return decided
