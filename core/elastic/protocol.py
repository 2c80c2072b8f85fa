"""What the launcher and the ranks of an elastic job tell each other through the store.

The launcher writes, for generation ``g``, one value under :func:`generation_key`
listing every member (by worker id: the id of the process, stable for its
whole life) with its topology in that generation, then sets :data:`LATEST_KEY`
to ``g``. Ranks read the latest number at every commit and, when they re-form,
the member table of the generation they join. A process started for generation
``g`` finds ``g``, its worker id and its topology in its environment.

Each generation's collectives rendezvous under :func:`store_prefix`, so Gloo
groups of successive generations never see each other's keys.

The store is the job's own (a ``JobStore`` connection on the ranks,
``StoreServer.client()`` in the launcher): whatever guards its keys guards these.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, Mapping, Optional

# Set by the launcher on every rank of an elastic job.
ENV_GENERATION = "HVDLIKE_ELASTIC_GENERATION"
ENV_WORKER = "HVDLIKE_ELASTIC_WORKER"
ENV_TIMEOUT = "HVDLIKE_ELASTIC_TIMEOUT"

LATEST_KEY = "elastic/latest"

TOPOLOGY_FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
                   "hostname")


def generation_key(number: int) -> str:
    return f"elastic/g{number}/members"


def ready_key(number: int, worker: str) -> str:
    return f"elastic/g{number}/ready/{worker}"


def store_prefix(environ: Mapping[str, str], process_generation: int) -> str:
    """The prefix one runtime's keys live under.

    Elastic ranks use the job-wide generation the launcher gave them, so a
    process started for generation 3 and a survivor re-initializing into it meet
    under the same keys; otherwise each ``init()`` of a process has its own.
    """
    number = environ.get(ENV_GENERATION)
    if number:
        return f"elastic{int(number)}/"
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
