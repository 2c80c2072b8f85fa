"""Which discovered hosts an elastic job may use now: discovery minus the blacklist.

A host on which a rank failed is blacklisted. Without a cooldown range it stays
out for the rest of the job; with ``--blacklist-cooldown-range LO HI`` it
returns after a random delay drawn from [LO, HI] seconds, doubled for each
earlier failure of the same host (capped at 2**5 times), so a flapping host is
tried less and less often. A slot dropped on a host that stays in use (a process
there never arrived while others on the host did) is kept out the same way: for
the rest of the job, or under a cooldown range for a delay drawn like a host's
(doubled for each earlier drop on that host). Pure bookkeeping: the clock and the
random draw are passed in.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, Hashable, List, Optional, Set, Tuple

from ..hosts import HostSlots

_MAX_DOUBLINGS = 5


class HostTable:
    """Discovered hosts, in discovery order, and the blacklist."""

    def __init__(self, cooldown_range: Optional[Tuple[float, float]] = None,
                 draw: Callable[[float, float], float] = random.uniform):
        self.cooldown_range = cooldown_range
        self._draw = draw
        self.discovered: List[HostSlots] = []
        self._until: Dict[str, Optional[float]] = {}  # host -> back at (None: never)
        self._failures: Dict[str, int] = {}
        self._slots_until: Dict[Hashable, Optional[float]] = {}  # slot -> back at
        self._slot_drops: Dict[str, int] = {}  # host -> slots dropped there so far

    def update(self, hosts: List[HostSlots]) -> bool:
        """Take a new discovery result; True when it differs from the previous one."""
        changed = hosts != self.discovered
        self.discovered = list(hosts)
        return changed

    def _back_at(self, count: int, now: float) -> Optional[float]:
        if self.cooldown_range is None:
            return None
        lo, hi = self.cooldown_range
        return now + self._draw(lo, hi) * 2 ** min(count, _MAX_DOUBLINGS)

    def blacklist(self, host: str, now: float) -> Optional[float]:
        """Keep ``host`` out; return when it may come back (None: never)."""
        count = self._failures.get(host, 0)
        self._failures[host] = count + 1
        self._until[host] = self._back_at(count, now)
        return self._until[host]

    def drop_slot(self, slot, now: float) -> Optional[float]:
        """Keep ``slot`` (a ``Slot``, of host ``slot.host``) out; return when it may come
        back (None: never)."""
        count = self._slot_drops.get(slot.host, 0)
        self._slot_drops[slot.host] = count + 1
        self._slots_until[slot] = self._back_at(count, now)
        return self._slots_until[slot]

    def dropped_slots(self, now: float) -> Set:
        """The slots kept out at ``now`` (those whose cooldown ended are forgotten)."""
        for slot, until in list(self._slots_until.items()):
            if until is not None and now >= until:
                del self._slots_until[slot]
        return set(self._slots_until)

    def blacklisted(self, host: str, now: float) -> bool:
        if host not in self._until:
            return False
        until = self._until[host]
        if until is not None and now >= until:
            del self._until[host]
            return False
        return True

    def available(self, now: float) -> List[HostSlots]:
        """Discovered hosts not blacklisted at ``now``, in discovery order."""
        return [h for h in self.discovered if not self.blacklisted(h.host, now)]

    def hopeless(self, now: float) -> bool:
        """True when nothing is usable now and no blacklisted host will come back."""
        if self.available(now):
            return False
        return all(self._until.get(h.host) is None for h in self.discovered)
