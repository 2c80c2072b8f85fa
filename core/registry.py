"""The process-set registry of one runtime: tables, ids and the add/remove protocol.

The runtime owns one :class:`ProcessSetRegistry`. It holds

* ``ranks``: every registered set, member or not (``{id: global ranks}``);
* ``states``: the :class:`~hvdlike.core.set_state.ProcessSetState` of each set
  this rank belongs to;
* the id counter, the serial number of add/remove calls, and the lock that
  lets one add/remove run at a time in this process.

Both tables are replaced, never mutated, so the background thread and
submitting threads always read a consistent table without a lock.

Registration is collective over *all* ranks, which must pass the same sets
in the same order; that is checked, and a difference makes every rank raise
(never hang). So does a set that is invalid on one rank only: its problem is
carried through the exchange, never raised before it. Static sets (``init(process_sets=[...])``) are registered
before the background thread starts, over the global set's control plane.
A dynamic change goes like this: members build the new set's groups, then
every rank submits a barrier on the global set; its response comes back in
the same negotiation cycle everywhere, and the background thread applies
the change at the end of that cycle (:meth:`take_changes`), so every member
starts (or stops) cycling the set in the same cycle -- the lock-step their
control collectives need.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from . import generation_keys, process_sets
from .collectives import allgather_entry, barrier_entry
from .errors import HvdlikeError, HvdlikeInternalError
from .log import logger
from .process_sets import ProcessSet
from .set_state import ProcessSetState, SetParts

# How long a set that failed to build waits for the runtime to learn why (see _build).
_CAUSE_WAIT_SECONDS = 2.0


# What was wrong with one rank's argument: (the exception class it would have
# raised alone, "TypeError" or "ValueError"; the reason). A rank never raises
# such a problem on its own: the other ranks are entering the exchange that
# registration is, and would wait there until the job fails. The problem goes
# through the exchange instead, and every rank raises.
Problem = Optional[Tuple[str, str]]


def _ranks_problem(pset: ProcessSet, size: int) -> Problem:
    """Why ``pset``'s ranks cannot be a set of a job of ``size`` ranks, or None."""
    if not pset.ranks:
        return ("ValueError", "a process set needs at least one rank")
    bad = [r for r in pset.ranks if r >= size]
    if bad:
        return ("ValueError", f"ranks {bad} of {pset!r} do not exist in a job of "
                              f"{size} rank(s)")
    return None


def _static_entry(index: int, pset: Any, size: int) -> Tuple[Any, Problem]:
    """What ``init(process_sets=...)``'s element ``index`` is shown as, and its problem."""
    if not isinstance(pset, ProcessSet):
        return repr(pset), ("TypeError", f"process_sets[{index}] must be a ProcessSet, got "
                                         f"{type(pset).__name__}")
    problem = _ranks_problem(pset, size)
    if problem is not None:
        problem = (problem[0], f"process_sets[{index}]: {problem[1]}")
    return list(pset.ranks), problem


def _merged(problems: List[Problem]) -> Problem:
    """One rank's problems as one (a TypeError among them makes it a TypeError)."""
    found = [p for p in problems if p]
    if not found:
        return None
    kind = "TypeError" if any(k == "TypeError" for k, _ in found) else "ValueError"
    return kind, "; ".join(text for _, text in found)


def _disagreement(what: str, values: List[Any]) -> Optional[str]:
    if all(v == values[0] for v in values[1:]):
        return None
    lines = [f"{what} must be called with the same process sets, in the same order, on "
             f"every rank; the ranks passed:"]
    lines += [f"  rank {r}: {v}" for r, v in enumerate(values)]
    return "\n".join(lines)


def _refusal(what: str, reports: List[Tuple[Any, Problem]]) -> Optional[str]:
    """The message every rank raises, given each rank's ``(value, problem)``
    (see :func:`_well_formed`); None when the call may go on.

    A problem on any rank refuses the call everywhere (naming the rank and what
    was wrong); otherwise the values must be equal (:func:`_disagreement`).
    """
    faulty = [str(r) for r, (_, problem) in enumerate(reports) if problem]
    if not faulty:
        return _disagreement(what, [value for value, _ in reports])
    lines = [f"{what} was refused on every rank: rank(s) {', '.join(faulty)} passed an "
             f"invalid process set; the ranks passed:"]
    for r, (value, problem) in enumerate(reports):
        lines.append(f"  rank {r}: {value}" + (f"  <- {problem[1]}" if problem else ""))
    return "\n".join(lines)


def _well_formed(reports: List[Any]) -> List[Tuple[Any, Problem]]:
    """Every rank's report as ``(value, problem)``."""
    return [_one_report(rank, report) for rank, report in enumerate(reports)]


def _one_report(rank: int, report: Any) -> Tuple[Any, Problem]:
    """``report`` as ``(value, problem)``; a report of another shape (a rank running
    other code, or lying) is that rank's problem, named, not this rank's crash."""
    try:
        value, problem = report
        if problem is not None:
            kind, text = problem
            problem = (str(kind), str(text))
        return value, problem
    except (TypeError, ValueError):
        return (f"<{type(report).__name__}>",
                ("ValueError", f"rank {rank} sent a malformed process-set report"))


def _raise_refusal(message: str, mine: Problem) -> NoReturn:
    """Raise ``message``: as a ``TypeError`` on a rank whose own argument had the
    wrong type (what it raised alone), else as a ``ValueError``."""
    if mine is not None and mine[0] == "TypeError":
        raise TypeError(message)
    raise ValueError(message)


class ProcessSetRegistry:
    """The process sets of one runtime.

    Args:
        size: the job's number of ranks.
        parts: what each set is built with (:class:`SetParts`).
        submit: the runtime's ``submit(entries, set_id)`` (the protocol's own
            collectives run on the global set).
        wait: the runtime's ``wait(handle)``.
        alive_error: the runtime's ``alive_error()``.
        removed: told the id of each set removed (on every rank, on the
            background thread): what the runtime keeps per set goes with it.
    """

    def __init__(self, size: int, parts: SetParts, submit: Callable, wait: Callable,
                 alive_error: Callable[[], Optional[BaseException]],
                 removed: Callable[[int], None] = lambda set_id: None):
        process_sets.open_registrations()  # ids given from now on are this runtime's
        self.rank = parts.rank
        self.size = size
        self.parts = parts
        self._submit = submit
        self._wait = wait
        self._alive_error = alive_error
        self._removed = removed
        self.ranks: Dict[int, List[int]] = {}
        self.states: Dict[int, ProcessSetState] = {}
        # The user's objects of every registered set but the global one: an
        # elastic re-form registers them again, with the same ids.
        self.objects: Dict[int, ProcessSet] = {}
        self._lock = threading.Lock()  # the counters
        self._next_id = 1
        self._change_count = 0
        self.change_lock = threading.RLock()  # one add/remove at a time per process
        self._changes: Dict[str, Callable[[], None]] = {}
        self._changes_lock = threading.Lock()
        self._running = False

    # -- tables ----------------------------------------------------------------------

    def state(self, set_id: int) -> ProcessSetState:
        """The state of a set this rank belongs to.

        Raises:
            ValueError: the set is not registered, or this rank is not a member.
        """
        state = self.states.get(set_id)
        if state is None:
            ranks = self.ranks.get(set_id)
            if ranks is None:
                raise ValueError(f"process set {set_id} is not registered (never added, or "
                                 f"removed)")
            raise ValueError(
                f"rank {self.rank} is not a member of process set {set_id} "
                f"(ranks {ranks}); only its members may call collectives on it")
        return state

    def ranks_of(self, set_id: int) -> List[int]:
        """The global ranks of a registered set.

        Raises:
            ValueError: the set is not registered (it was removed).
        """
        ranks = self.ranks.get(set_id)
        if ranks is None:
            raise ValueError(f"process set {set_id} is not registered (it was removed)")
        return ranks

    def members(self, set_id: int) -> List[int]:
        """The global ranks of ``set_id``; every rank for a set no longer registered."""
        return self.ranks.get(set_id) or list(range(self.size))

    def waiting_since(self) -> Dict[tuple, float]:
        """``{(process set id, name): submission time}`` of everything pending here."""
        waiting: Dict[tuple, float] = {}
        for set_id, state in list(self.states.items()):
            for name, since in state.queue.waiting_since().items():
                waiting[(set_id, name)] = since
        return waiting

    def coordinated(self) -> Dict[tuple, tuple]:
        """``{(process set id, name): (seconds waiting, global ranks missing)}`` of
        the incomplete names held by the coordinators on this rank: what the
        other ranks actually requested, whatever their own records say."""
        held: Dict[tuple, tuple] = {}
        for set_id, state in list(self.states.items()):
            coordinator = getattr(state.controller, "coordinator", None)
            if coordinator is None:
                continue
            for name, seconds, missing in coordinator.pending():
                if missing:
                    held[(set_id, name)] = (seconds, missing)
        return held

    def joins(self) -> List[tuple]:
        """``(process set id, name)`` of every join pending here."""
        return [(set_id, name) for set_id, state in list(self.states.items())
                for name in state.queue.joins()]

    # -- building --------------------------------------------------------------------

    def _build(self, set_id: int, ranks: Sequence[int]) -> Optional[ProcessSetState]:
        """Create the groups of a set; None on non-member ranks.

        Blocks until every member has called it (the groups rendezvous).
        """
        ranks = list(ranks)
        if self.rank not in ranks:
            return None
        try:
            state = ProcessSetState(set_id, ranks, self.parts)
        except HvdlikeError:
            raise
        except Exception as exc:
            # An engine's own error (Gloo's rendezvous, a store timeout): say
            # which set it was, and why the job failed if the runtime knows --
            # a member that died breaks the rendezvous and the global set's
            # next negotiation alike; the latter names it (give it a moment).
            deadline = time.monotonic() + (_CAUSE_WAIT_SECONDS if self._running else 0.0)
            cause = self._alive_error()
            while cause is None and time.monotonic() < deadline:
                time.sleep(0.05)
                cause = self._alive_error()
            raise HvdlikeInternalError(
                f"rank {self.rank} could not set up process set {set_id} (ranks {ranks}): "
                f"{cause if cause is not None else exc}") from None
        if self._running:
            state.start()
        return state

    def _install(self, set_id: int, ranks: Sequence[int],
                 state: Optional[ProcessSetState]) -> None:
        """Make a built set live: before the thread starts, or on it between cycles."""
        self.ranks = {**self.ranks, set_id: list(ranks)}
        if state is not None:
            self.states = {**self.states, set_id: state}

    def _uninstall(self, set_id: int) -> None:
        """Retire a set on the background thread: fail what is pending, free its groups."""
        self.ranks = {k: v for k, v in self.ranks.items() if k != set_id}
        self._removed(set_id)
        state = self.states.get(set_id)
        if state is None:
            return
        self.states = {k: v for k, v in self.states.items() if k != set_id}
        reason = HvdlikeInternalError(
            f"process set {set_id} was removed before this collective completed")
        self.fail_pending(state, reason)
        state.close(0)
        self._forget_keys(state)

    def _forget_keys(self, state: ProcessSetState) -> None:
        """Delete a removed set's store records (its groups' rendezvous, its
        shared-memory names) once every member has closed it: a set added and
        removed again and again would pile them up in the job's store."""
        try:
            generation_keys.forget_part(self.parts.store, f"ps{state.id}/", state.rank,
                                        state.size)
        except Exception as exc:  # the store went away with the job: nothing to keep tidy
            logger.debug("keys of process set %d left in the store: %s", state.id, exc)

    def fail_pending(self, state: ProcessSetState, reason: BaseException) -> None:
        """Let ``state``'s launched work finish, then fail everything still pending."""
        state.executor.finisher.close(self.parts.cfg.gloo_timeout_seconds)
        for entry in state.controller.pending_entries() + state.queue.drain():
            self.parts.hooks.complete(entry, None, reason)

    def start(self) -> None:
        """Start the threads of every set built so far (and of later ones on build)."""
        self._running = True
        for state in self.states.values():
            state.start()

    def close(self) -> None:
        """Free every set's groups and buffers (pending work must be failed first)."""
        states, self.states = self.states, {}
        self.ranks = {}
        for state in states.values():
            state.close(self.parts.cfg.gloo_timeout_seconds)
        self._running = False

    def _next_id_value(self) -> int:
        with self._lock:
            set_id = self._next_id
            self._next_id += 1
        return set_id

    # -- registration ------------------------------------------------------------------

    def register_global(self) -> None:
        """Build and install the global set (id 0)."""
        ranks = list(range(self.size))
        self._install(0, ranks, self._build(0, ranks))

    def register_static(self, psets: Sequence[ProcessSet], elastic: bool = False) -> None:
        """Register ``init(process_sets=...)`` before the background thread starts.

        Sets with the ranks of an earlier one (or of the whole job) share its id.
        A set that already carries an id on rank 0 (an elastic re-form registers
        the previous generation's sets again) keeps it on every rank, even when
        its ranks are now those of the whole job; the others get the next free ids.

        Raises:
            TypeError: an element is not a :class:`ProcessSet` (on that rank; the
                others raise ``ValueError`` naming it).
            ValueError: ranks out of range or none, on any rank, or the ranks
                passed differ across ranks (raised on every rank) -- except in an
                elastic generation (``elastic``), where rank 0's sets win.
        """
        entries = [_static_entry(i, p, self.size) for i, p in enumerate(psets)]
        mine = [value for value, _ in entries]
        problem = _merged([p for _, p in entries])
        control = self.states[0].controller.control
        gathered = control.gather(pickle.dumps((mine, problem)))
        verdict = ids = lists = None
        if gathered is not None:
            reports = _well_formed([pickle.loads(g) for g in gathered])
            verdict = _refusal("init()", reports)
            if verdict and elastic and not any(p for _, p in reports):
                # Survivors pass what they carried (sets dropped by a shrink are gone,
                # sets added while the job ran are there); a process started for this
                # generation passes its script's init(). Rank 0's sets win.
                verdict, lists = None, reports[0][0]
            if not verdict:
                ids = [p.process_set_id for p in psets]
        verdict, ids, lists = pickle.loads(control.broadcast(pickle.dumps((verdict, ids, lists))))
        if verdict:
            _raise_refusal(verdict, problem)
        if lists is not None and lists != mine:
            psets = self._adopt(psets, lists)
        self._install_static(psets, ids)

    def _adopt(self, psets: Sequence[ProcessSet], lists: List[List[int]]) -> List[ProcessSet]:
        """This rank's sets for rank 0's ``lists`` (an elastic generation): its own
        object where it has one with those ranks, a new one otherwise; its sets
        rank 0 does not have are left unregistered, with a warning."""
        unused = list(psets)
        adopted = []
        for ranks in lists:
            match = next((p for p in unused if list(p.ranks) == list(ranks)), None)
            if match is None:
                match = ProcessSet(ranks)
            else:
                unused.remove(match)
            adopted.append(match)
        for pset in unused:
            pset.process_set_id = None
            logger.warning("process set with ranks %s is not registered in this elastic "
                           "generation: rank 0 does not have it (the ranks' sets differ "
                           "after a re-form, and rank 0's win); add_process_set() registers "
                           "it again", list(pset.ranks))
        return adopted

    def _install_static(self, psets: Sequence[ProcessSet], ids: List[Optional[int]]) -> None:
        """Give ``psets`` their ids (``ids``: those they carried on rank 0) and build them."""
        by_ranks: Dict[tuple, int] = {tuple(range(self.size)): 0}
        kept = {i for i in ids if i}
        if kept:
            with self._lock:
                self._next_id = max(self._next_id, max(kept) + 1)
        for pset, wanted in zip(psets, ids):
            key = tuple(pset.ranks)
            if wanted and wanted not in self.ranks:
                # registered again: its id stays, even if its ranks are now the whole job's
                by_ranks.setdefault(key, wanted)
                set_id = wanted
            elif key in by_ranks:
                set_id = by_ranks[key]
            else:
                set_id = by_ranks[key] = self._next_id_value()
            if set_id not in self.ranks:
                self._install(set_id, pset.ranks, self._build(set_id, pset.ranks))
                self.objects[set_id] = pset
            first = self.objects.get(set_id)
            if first is None or first is pset:
                pset.process_set_id = set_id
            else:  # equal sets share one registration: removing one invalidates them all
                process_sets.share_id(pset, first)

    def _check_dynamic(self, what: str) -> None:
        if not self.parts.cfg.dynamic_process_sets:
            raise HvdlikeError(
                f"{what} needs dynamic process sets: set HVDLIKE_DYNAMIC_PROCESS_SETS=1 (or "
                f"HOROVOD_DYNAMIC_PROCESS_SETS=1) or call init(process_sets='dynamic')")

    def _serial_name(self) -> str:
        with self._lock:
            self._change_count += 1
            return f"hvdlike.process_set.{self._change_count}"

    def _gather_everywhere(self, value: Any, name: str) -> List[Any]:
        """Every rank's ``value`` through the global set (works while the runtime runs)."""
        import torch

        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        # Names made for this change alone: never cached (Request.once).
        handles = self._submit([allgather_entry(length, f"{name}.size", once=True),
                                allgather_entry(data, f"{name}.data", once=True)], 0)
        lengths, blob = [self._wait(h) for h in handles]
        out, start = [], 0
        for n in lengths.tolist():
            out.append(pickle.loads(blob[start:start + n].numpy().tobytes()))
            start += n
        return out

    def add(self, pset: ProcessSet) -> ProcessSet:
        """:func:`hvdlike.add_process_set` on this runtime (see there)."""
        self._check_dynamic("add_process_set")
        with self.change_lock:
            return self._add(pset, ("add", pset.ranks), self._add_problem(pset))

    def refuse_add(self, argument: Any, error: Exception) -> NoReturn:
        """``add_process_set(argument)`` where ``argument`` could not become a
        :class:`ProcessSet` (``error``): take part in the exchange so that every
        rank raises, naming this one. Always raises (``error``'s type here)."""
        self._check_dynamic("add_process_set")
        with self.change_lock:
            self._add(None, f"('add', {argument!r})", (type(error).__name__, str(error)))

    def _add_problem(self, pset: ProcessSet) -> Problem:
        """What makes ``pset`` impossible to add here, whatever the other ranks pass."""
        set_id = process_sets.live_id(pset)
        if set_id is not None:
            return ("ValueError", f"{pset!r} is already registered (process set {set_id})")
        return _ranks_problem(pset, self.size)

    def _add(self, pset: Optional[ProcessSet], value: Any, problem: Problem) -> ProcessSet:
        """The add protocol (``change_lock`` held): exchange, check, build, install."""
        name = self._serial_name()
        verdict = _refusal("add_process_set()",
                           _well_formed(self._gather_everywhere((value, problem), name)))
        if verdict:
            _raise_refusal(verdict, problem)
        if pset.ranks in self.ranks.values():
            raise ValueError(f"add_process_set: a process set with ranks {pset.ranks} is "
                             f"already registered")
        set_id = self._next_id_value()
        state = self._build(set_id, pset.ranks)
        try:
            self._change(f"{name}.add", lambda: self._install(set_id, pset.ranks, state))
        except BaseException:
            if state is not None and self.states.get(set_id) is not state:
                state.close(0)
            raise
        pset.process_set_id = set_id
        self.objects[set_id] = pset
        return pset

    def remove(self, pset: ProcessSet) -> bool:
        """:func:`hvdlike.remove_process_set` on this runtime (see there).

        A set not registered in this runtime -- never, removed, or only by an
        earlier runtime, whose id may now name another set -- is not removed.
        """
        self._check_dynamic("remove_process_set")
        set_id = process_sets.live_id(pset)
        with self.change_lock:
            name = self._serial_name()
            verdict = _disagreement("remove_process_set()",
                                    self._gather_everywhere(("remove", set_id), name))
            if verdict:
                raise ValueError(verdict)
            if set_id is None or set_id == 0 or set_id not in self.ranks:
                return False
            self._change(f"{name}.remove", lambda: self._uninstall(set_id))
        process_sets.drop_id(pset)
        process_sets.drop_id(self.objects.pop(set_id, None))
        return True

    def _change(self, name: str, change: Callable[[], None]) -> None:
        """Run ``change`` on the background thread in the same cycle on every rank.

        Submits a barrier named ``name`` on the global set; the cycle whose
        responses include it ends by running ``change`` (:meth:`take_changes`).
        """
        applied = threading.Event()
        errors: List[BaseException] = []

        def apply() -> None:
            try:
                change()
            except BaseException as exc:
                errors.append(exc)
            finally:
                applied.set()

        with self._changes_lock:
            self._changes = {**self._changes, name: apply}
        self._wait(self._submit([barrier_entry(name)], 0)[0])
        while not applied.wait(0.05):
            error = self._alive_error()
            if error is not None:
                raise HvdlikeInternalError(f"process set change {name!r} failed: {error}")
        if errors:
            raise errors[0]

    def has_changes(self) -> bool:
        return bool(self._changes)

    def take_changes(self, work) -> List[Callable[[], None]]:
        """The changes whose barriers are among this cycle's responses (background thread)."""
        with self._changes_lock:
            changes = dict(self._changes)
            taken = [changes.pop(response.name) for response, _ in work
                     if response.name in changes]
            self._changes = changes
        return taken
