"""Settings every rank of a job must share, checked once at ``init()``.

Most knobs are a rank's own business (its log level, its timeline, how long it
waits before warning). Some decide what the ranks do together: how responses
are fused into buffers, the response cache's slots, which data plane or
algorithm a collective takes (under mpirun, MPI without threads sends
negotiation to Gloo), whether the autotuner changes them. Ranks that
differ there do not fail cleanly later: they exchange buffers laid out
differently (wrong sums, returned without an error) or wait on collectives
the others never start. So ``init()`` compares them first: each rank files its
values in the job's store, rank 0 compares them with its own and files a
verdict, and every rank raises the same :class:`~.errors.ConfigError`, naming
each setting that differs and every rank's value, when they disagree. Rank 0
raises it once the others have read it (or after :data:`READ_SECONDS`): under
mpirun, srun and torchrun it hosts the store, which ends with its process.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from . import store_wait
from .config import KNOBS_BY_FIELD, Config
from .errors import ConfigError

# Knob fields the ranks of one job must agree on (see the module docstring).
SHARED = ("fusion_threshold", "cache_capacity", "disable_group_fusion", "autotune",
          "autotune_warmup_samples", "autotune_steps_per_sample",
          "autotune_bayes_opt_max_samples", "dynamic_process_sets", "controller",
          "cpu_operations", "shm", "hierarchical_allreduce", "hierarchical_allgather",
          "adasum_hierarchical", "torus_allreduce", "mpi_threads_disable")

MAX_LISTED = 8  # ranks named per differing setting; the rest are counted
# How long rank 0 waits for the others to read a disagreement before raising it:
# under mpirun, srun and torchrun it hosts the store, which goes when it exits.
READ_SECONDS = 5.0


def values(cfg: Config) -> Dict[str, object]:
    return {field: getattr(cfg, field) for field in SHARED}


def disagreements(mine: Dict[str, object], theirs: Dict[int, Dict[str, object]]) -> str:
    """'' when every rank in ``theirs`` (rank -> values) has ``mine``; else the
    message: one line per differing setting, with each differing rank's value."""
    lines = []
    for field in SHARED:
        odd = {r: v.get(field) for r, v in sorted(theirs.items()) if v.get(field) != mine[field]}
        if not odd:
            continue
        knob = KNOBS_BY_FIELD[field]
        listed = [f"rank {r} {value!r}" for r, value in list(odd.items())[:MAX_LISTED]]
        if len(odd) > MAX_LISTED:
            listed.append(f"and {len(odd) - MAX_LISTED} more rank(s)")
        lines.append(f"  {knob.env} (or {knob.fallback_env}): rank 0 {mine[field]!r}, "
                     + ", ".join(listed))
    if not lines:
        return ""
    return ("init: the ranks disagree on settings every rank of a job must share "
            "(set them alike on every rank, or only in the launcher's environment):\n"
            + "\n".join(lines))


def check(store, prefix: str, rank: int, size: int, cfg: Config, timeout_seconds: float,
          gone: store_wait.Gone, abandon: Callable[[], Optional[BaseException]]) -> None:
    """Raise :class:`ConfigError` on every rank when the ranks' shared settings differ.

    Raises:
        ConfigError: the settings differ (the same message on every rank).
        HvdlikeInternalError: a rank did not file its settings in time (named).
    """
    if size < 2:
        return
    what = "the check that every rank has the same shared settings"
    said = store_wait.gather(
        store, f"{prefix}agree/", rank, size, values(cfg),
        lambda every: disagreements(every[0], dict(enumerate(every[1:], start=1))),
        timeout_seconds, abandon, gone, what)
    if not said:
        return
    read = f"{prefix}agree/read/"
    if rank != 0:
        try:
            store.set(f"{read}{rank}", b"1")
        except Exception:  # the store is gone already: the verdict was read all the same
            pass
    else:  # each rank is to raise this error, not a lost store's
        peers = list(range(1, size))
        try:
            store_wait.await_keys(store, [f"{read}{r}" for r in peers], peers,
                                  min(timeout_seconds, READ_SECONDS), abandon, gone, what)
        except Exception:  # gone or slow: it has its own error to raise
            pass
    raise ConfigError(said)
