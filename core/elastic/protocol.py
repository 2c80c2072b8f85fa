"""What the launcher and the ranks of an elastic job tell each other through the store.

The launcher writes, for generation ``g``, its roster (:func:`roster_key`: the
members' worker ids, the id of a process being stable for its whole life), a
seat per member, and one value under :func:`generation_key` listing every
member with its topology in that generation, then sets :data:`LATEST_KEY` to
``g``. Ranks read the latest number at every commit and, when they re-form,
the member table of the generation they join. A process started for generation
``g`` finds ``g``, its worker id and its topology in its environment.

Each generation's collectives rendezvous under :func:`store_prefix`, so Gloo
groups of successive generations never see each other's keys.

The store is the job's own (a ``JobStore`` connection on the ranks,
``StoreServer.client()`` in the launcher): whatever guards its keys guards these.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
from typing import Dict, List, Mapping, Optional

# Set by the launcher on every rank of an elastic job.
ENV_GENERATION = "HVDLIKE_ELASTIC_GENERATION"
ENV_WORKER = "HVDLIKE_ELASTIC_WORKER"
ENV_TIMEOUT = "HVDLIKE_ELASTIC_TIMEOUT"
# The process's own secret, from the launcher at spawn (like the job secret,
# on the rank's stdin, never on a command line): its generation keys are sealed with it.
ENV_WORKER_SECRET = "HVDLIKE_ELASTIC_WORKER_SECRET"

LATEST_KEY = "elastic/latest"

TOPOLOGY_FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
                   "hostname")


def generation_key(number: int) -> str:
    return f"elastic/g{number}/members"


def roster_key(number: int) -> str:
    """Generation ``number``'s members' worker ids (MACed with the job secret).

    What tells a process whose seat is missing whether it was left out of the
    generation (not listed: it leaves) or someone deleted its seat (listed).
    """
    return f"elastic/g{number}/roster"


def seat_key(number: int, worker: str) -> str:
    """Where ``worker`` finds generation ``number``'s key, sealed for it alone."""
    return f"elastic/g{number}/seat/{worker}"


def _pad(worker_secret: str, number: int, worker: str) -> bytes:
    return hmac.new(worker_secret.encode(), f"seat {number} {worker}".encode(),
                    hashlib.sha256).digest()


def seal_key(worker_secret: str, number: int, worker: str, key: bytes) -> bytes:
    """Generation ``number``'s ``key`` (32 bytes) for ``worker``: XORed with a pad only
    the worker's secret gives (each pad seals one key once), then MACed with it."""
    body = bytes(a ^ b for a, b in zip(key, _pad(worker_secret, number, worker)))
    tag = hmac.new(worker_secret.encode(), b"seal\0" + str(number).encode() + b"\0" +
                   worker.encode() + b"\0" + body, hashlib.sha256).digest()
    return body + tag


def open_key(worker_secret: str, number: int, worker: str, sealed: bytes) -> bytes:
    """The key :func:`seal_key` sealed; raises ``StoreTamperedError`` if it was not
    sealed for this worker and generation with this secret."""
    from hvdlike.core.store_auth import StoreTamperedError

    body, tag = sealed[:32], sealed[32:]
    expected = hmac.new(worker_secret.encode(), b"seal\0" + str(number).encode() + b"\0" +
                        worker.encode() + b"\0" + body, hashlib.sha256).digest()
    if len(sealed) != 64 or not hmac.compare_digest(tag, expected):
        raise StoreTamperedError(seat_key(number, worker),
                                 "holds a generation key not sealed for this process")
    return bytes(a ^ b for a, b in zip(body, _pad(worker_secret, number, worker)))


def publish(store, generation: "Generation", worker_secrets: Mapping[str, str]) -> bytes:
    """Write generation ``generation`` (not yet :data:`LATEST_KEY`): its roster, a
    fresh random key sealed for each member, then the member table MACed with
    that key.

    ``store``: the job's authenticated store; returns the generation's key.
    """
    key = secrets.token_bytes(32)
    store.set(roster_key(generation.number), json.dumps(sorted(generation.members)).encode())
    for worker in generation.members:
        store.set(seat_key(generation.number, worker),
                  seal_key(worker_secrets[worker], generation.number, worker, key))
    store.for_generation(key).set(generation_key(generation.number), generation.encode())
    return key


def read_roster(store, number: int) -> Optional[List[str]]:
    """Generation ``number``'s roster, or None once it is gone (the generation was
    forgotten, or the key deleted).

    Raises:
        StoreTamperedError: the roster was not written by a holder of the job secret.
    """
    key = roster_key(number)
    if not store.check([key]):
        return None
    try:
        workers = json.loads(store.get(key).decode())
    except ValueError:
        workers = None
    if not isinstance(workers, list) or not all(isinstance(w, str) for w in workers):
        from hvdlike.core.store_auth import StoreTamperedError

        # Signed, so written with the job secret -- but not by hvdlike's launcher.
        raise StoreTamperedError(key, "holds something that is not a list of worker ids")
    return workers


def ready_key(number: int, worker: str) -> str:
    return f"elastic/g{number}/ready/{worker}"


def finished_key(number: int) -> str:
    """Set by the launcher (MACed with generation ``number``'s key) once a rank of
    that generation exited 0: the job is finishing and no generation follows.
    Its value: that rank's worker id."""
    return f"elastic/g{number}/finished"


def late_key(number: int) -> str:
    """Where a member of generation ``number`` reports the members that did not
    arrive within the start timeout (MACed with the generation's key: only its
    members and the launcher can write it). The launcher decides from it which
    processes to stop, never the reporter."""
    return f"elastic/g{number}/late"


@dataclasses.dataclass(frozen=True)
class LateReport:
    """A member's word that others of its generation did not arrive in time."""

    by: str  # the reporting member's worker id
    missing: List[str]  # worker ids that had not arrived
    seconds: float  # how long the reporter waited for them


def report_late(view, number: int, report: LateReport) -> None:
    """Write ``report`` for generation ``number`` through the generation's ``view``."""
    view.set(late_key(number), json.dumps({"by": report.by, "missing": report.missing,
                                           "seconds": report.seconds}).encode())


def read_late(view, number: int) -> Optional[LateReport]:
    """Generation ``number``'s report of late members, or None when there is none.

    Raises:
        StoreTamperedError: the record was not written by a holder of the
            generation's key, or is not a report (signed, but not hvdlike's).
    """
    key = late_key(number)
    if not view.check([key]):
        return None
    raw = view.get(key)
    try:
        data = json.loads(raw.decode())
        report = LateReport(data["by"], list(data["missing"]), float(data["seconds"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        report = None
    if report is None or not isinstance(report.by, str) or \
            not all(isinstance(w, str) for w in report.missing):
        from hvdlike.core.store_auth import StoreTamperedError

        raise StoreTamperedError(key, "holds something that is not a report of late members")
    return report


def generation_prefix(number: int) -> str:
    """The prefix of generation ``number``'s runtime keys (Gloo, health, ...)."""
    return f"elastic{number}/"


def lost_key(number: int, rank: int) -> str:
    """Where the launcher reports how rank ``rank`` of generation ``number`` ended.

    It is the key the rank itself would announce its reason under, so the
    survivors' diagnosis (``Health.diagnose``) names it as soon as it is there.
    """
    return f"{generation_prefix(number)}health/shutdown/{rank}"


def key_list(rank: int, log: int) -> str:
    """Under a generation's prefix: the keys rank ``rank``'s ``log``-th store view wrote."""
    return f"keys/{rank}.{log}"


MAX_KEY_LISTS = 8  # store views a runtime opens (it opens two today)


def forget_generation(store, number: int, view=None) -> int:
    """Delete what generation ``number`` left in the store; return how many keys.

    Its roster, member table, sealed keys and ready marks, the launcher's reports of
    lost ranks, and every key its ranks' runtimes wrote (listed by them as
    they wrote, so a generation that ended in a failure is cleaned as well as
    one that closed cleanly). Call when no process uses the generation any
    more: once every member of a later generation has arrived.

    Args:
        store: the job store (deleting needs no key).
        view: the generation's view (its key), to read the member table and
            key lists; None when the caller was not a member: nothing is deleted.
    """
    import json

    members_key = generation_key(number)
    if view is None or not store.check([members_key]):
        return 0
    members = Generation.decode(view.get(members_key))
    prefix = generation_prefix(number)
    # The roster goes first: a process that finds its seat missing while the
    # roster still lists it knows that the seat was deleted by someone else.
    doomed = [roster_key(number)]
    doomed += [ready_key(number, w) for w in members.members] + [finished_key(number)]
    doomed.append(late_key(number))
    doomed += [seat_key(number, w) for w in members.members]
    doomed += [lost_key(number, r) for r in range(members.size)]
    for rank in range(members.size):
        for log in range(MAX_KEY_LISTS):
            name = prefix + key_list(rank, log)
            if not store.check([name]):
                break
            try:
                doomed.extend(json.loads(view.get(name)))
            except Exception:  # an unreadable list: delete it, keep the rest
                doomed.append(name)
    doomed.append(members_key)  # last: it is what marks the generation as still there
    deleted = 0
    for key in dict.fromkeys(doomed):
        deleted += bool(store.delete_key(key))
    return deleted


def store_prefix(environ: Mapping[str, str], process_generation: int) -> str:
    """The prefix one runtime's keys live under.

    Elastic ranks use the job-wide generation the launcher gave them, so a
    process started for generation 3 and a survivor re-initializing into it meet
    under the same keys; otherwise each ``init()`` of a process has its own.
    """
    number = environ.get(ENV_GENERATION)
    if number:
        return generation_prefix(int(number))
    return f"gen{process_generation}/"


@dataclasses.dataclass(frozen=True)
class Generation:
    """One published generation: its number and members."""

    number: int
    members: Dict[str, Dict[str, object]]  # worker id -> topology fields
    removed_only: bool = False  # nobody joined: survivors' committed state already agrees

    def encode(self) -> bytes:
        return json.dumps({"number": self.number, "members": self.members,
                           "removed_only": self.removed_only}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Generation":
        data = json.loads(raw.decode())
        return cls(int(data["number"]), {str(k): dict(v) for k, v in data["members"].items()},
                   bool(data.get("removed_only", False)))

    @property
    def size(self) -> int:
        return len(self.members)

    def topology_of(self, worker: str) -> Optional[Dict[str, object]]:
        return self.members.get(worker)


def rank_variables(topology: Mapping[str, object], number: int) -> Dict[str, str]:
    """The environment variables that place a rank in generation ``number``."""
    from hvdlike.core import bootstrap

    names = {
        "rank": bootstrap.ENV_RANK, "size": bootstrap.ENV_SIZE,
        "local_rank": bootstrap.ENV_LOCAL_RANK, "local_size": bootstrap.ENV_LOCAL_SIZE,
        "cross_rank": bootstrap.ENV_CROSS_RANK, "cross_size": bootstrap.ENV_CROSS_SIZE,
        "hostname": bootstrap.ENV_HOSTNAME,
    }
    env = {names[field]: str(topology[field]) for field in TOPOLOGY_FIELDS}
    env[ENV_GENERATION] = str(number)
    return env
