"""What an elastic re-form carries from one runtime to the next.

A re-form is ``shutdown()`` + ``init()``, and a runtime owns everything it
was given, so without help the next generation would start from the
environment alone. :func:`capture` takes, before the old runtime shuts down:

* the knob arguments of ``init(**settings)`` (environment knobs apply anyway);
* the registered process sets -- those given to ``init(process_sets=...)``
  and those added since -- with their ids. As in Horovod a set is its global
  ranks: it is registered again with the same ranks and the same id; a set
  naming a rank the new generation does not have is no longer valid (its
  ``process_set_id`` becomes None and using it raises, as after a removal);
* the timeline being recorded: the same file goes on;
* the autotuner: a settled choice stays in force on every rank, a search in
  progress goes on from rank 0's current candidate (see ``Runtime._agree_tuning``).

:func:`resume` starts the next runtime with all of it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional

from hvdlike.core.log import logger


@dataclasses.dataclass
class Carry:
    overrides: Dict[str, object]
    process_sets: list  # ProcessSet objects, by id
    timeline_request: Optional[tuple] = None
    timeline: Optional[object] = None  # the open Timeline, handed over unclosed
    tuning: Optional[tuple] = None  # (Candidate, settled, rank 0's search or None)


def capture(runtime) -> Carry:
    """Take what the next runtime continues from ``runtime`` (before it shuts down)."""
    sets = []
    if runtime.sets is not None:
        sets = [runtime.sets.objects[i] for i in sorted(runtime.sets.objects)]
    request, timeline = runtime.recording.detach()
    tuning = None
    if runtime.autotuner is not None:
        tuning = (runtime.autotuner.current, False, runtime.autotuner.search)
    elif runtime.tuned is not None:
        tuning = (runtime.tuned, True, None)
    return Carry(dict(runtime.overrides), sets, request, timeline, tuning)


def valid_sets(carry: Carry, size: int) -> List[object]:
    """The carried process sets that still exist in a job of ``size`` ranks;
    the others are invalidated (id None), with a warning naming them."""
    kept = []
    for pset in carry.process_sets:
        if max(pset.ranks) < size:
            kept.append(pset)
            continue
        logger.warning("process set %s is no longer valid: the job has %d rank(s) after the "
                       "re-form", pset, size)
        pset.process_set_id = None
    return kept


def resume(carry: Optional[Carry], environ=None) -> None:
    """Start the next generation's runtime with what ``carry`` holds."""
    from hvdlike.core import api, bootstrap

    if carry is None:
        api.init()
        return
    environ = os.environ if environ is None else environ
    size = int(environ.get(bootstrap.ENV_SIZE, "1"))
    api.start(valid_sets(carry, size), dict(carry.overrides), carried=carry)
    carry.timeline = None  # adopted (or closed) by the runtime now
