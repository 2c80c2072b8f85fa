"""``hvdlike.run(fn)`` as an elastic job, or under ``mpirun`` (``use_mpi=True``).

Both ship ``fn`` the way the plain launch does (sealed under the job secret in a
store the launcher hosts, run by :mod:`.task` on every rank) and differ in how
ranks start and where their outcomes are filed:

* elastic: the ranks are the elastic driver's workers; each files its outcome
  under the generation it ended in and its rank there, and the results are
  those of the newest generation every rank of which returned one;
* mpirun: mpirun starts the ranks, which find the launcher's store through
  ``HVDLIKE_RUN_STORE``/``HVDLIKE_RUN_SECRET`` (handed over in the environment,
  as hvdlike-run hands the job secret to its ranks; mpirun gets only their
  names on its command line) and file under their MPI rank.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List

from .api import RankError, first_cause, gather, interrupted, raise_outcome, shipped
from .launch_config import LaunchConfig
from .task import RUN_SECRET_ENV, RUN_STORE_ENV


def _results(outcomes: Dict[int, dict], ranks: List[int], host_of: Callable[[int], str],
             missing: Callable[[int], str]) -> List[Any]:
    """Every rank's value, or the :class:`RankError` that explains the failure."""
    blamed = first_cause(outcomes)
    if blamed is not None:
        raise_outcome(blamed, host_of(blamed), outcomes[blamed])
    for rank in ranks:
        if rank not in outcomes:
            raise RankError(f"rank {rank} (host {host_of(rank)}) {missing(rank)}", rank,
                            host_of(rank))
    return [outcomes[rank]["value"] for rank in ranks]


def _warn(text: str) -> None:
    sys.stderr.write(f"hvdlike.run: {text}\n")


def run_elastic_function(config: LaunchConfig, fn, args, kwargs) -> List[Any]:
    """Run ``fn`` as an elastic job; the results of the newest generation whose every
    rank returned one, in rank order."""
    from .elastic.driver import ElasticDriver
    from .elastic.launch import discovery_for

    settings = config.elastic
    discovery, config = discovery_for(config, settings, _warn)
    seen = []
    with shipped(config, fn, args, kwargs) as (job, store):
        driver = ElasticDriver(job, settings, discovery)
        result = driver.run()
        if not result.interrupted:
            hosts = {rank: member.slot.host for rank, member in enumerate(driver.members)}

            def host_of(rank: int) -> str:
                return hosts.get(rank, "?")

            # The ranks that completed the job did so in one generation, not always
            # the newest: ranks that end without entering a generation published
            # meanwhile complete the one before (its new ranks then leave). The
            # results are those of the newest generation whose every rank has one.
            for number in range(driver.generation, 0, -1):
                ranks = list(range(result.sizes[number - 1]))
                found = gather(job, store, ranks, number, host_of)
                if result.exit_code == 0 and len(found) == len(ranks) and \
                        all(o["ok"] for o in found.values()):
                    return [found[rank]["value"] for rank in ranks]
                seen.append((number, ranks, found))
    if result.interrupted:
        interrupted(result.interrupted)
    for number, ranks, found in seen:  # someone's fn raised: name it
        failed = {rank: o for rank, o in found.items() if not o["ok"] and not o.get("left")}
        if failed:  # the host each rank reported: the last generation's may differ
            _results(failed, ranks, lambda rank: failed[rank].get("host") or host_of(rank),
                     lambda rank: "")
    lost = result.lost[-1] if result.lost else None
    what = result.summary() or (f"exit status {result.exit_code}" if result.exit_code else
                                "no generation's ranks all returned a result")
    raise RankError(f"elastic job failed: {what}", lost.rank if lost else -1,
                    lost.host if lost else "")


def run_under_mpirun(config: LaunchConfig, fn, args, kwargs) -> List[Any]:
    """Run ``fn`` on ranks mpirun starts; their results in MPI rank order."""
    from .mpi_exec import run_with_mpirun

    with shipped(config, fn, args, kwargs) as (job, store):
        hosts = {p.rank: p.host for p in job.placements}
        ranks = list(hosts)
        addr, port = job.store.endpoint()
        code = run_with_mpirun(config, len(ranks), verbose=print,
                               job_env={RUN_STORE_ENV: f"{addr}:{port}",
                                        RUN_SECRET_ENV: job.secret})
        outcomes = gather(job, store, ranks, None, hosts.__getitem__)
    return _results(outcomes, ranks, hosts.__getitem__,
                    lambda rank: f"ended without a result (mpirun exited with status {code})")
