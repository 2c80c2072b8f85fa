"""Running an elastic job: generations of rank processes that shrink and grow.

The driver owns the rank processes (the same :class:`~..monitor.Worker` as a
static job), the host table and the generation counter. It publishes each
generation through the job's store (:mod:`hvdlike.core.elastic.protocol`) and
re-forms the job when

* a rank process fails (non-zero exit or death): its host is blacklisted and
  its surviving peers meet again without it;
* a member reports that others of its generation did not arrive within the
  start timeout: those that never arrived in any generation (alive, but hung or
  slow before ``init()``) are stopped and their hosts blacklisted -- or only
  their slots dropped, on a host where members did arrive -- and the members
  that did arrive meet again without them;
* discovery adds usable slots while the job is below ``--max-np``, or removes a
  host that runs ranks.

Failures arriving close together are gathered into one re-form
(``SETTLE_SECONDS``). Fewer usable slots than ``--min-np`` for longer than
``--elastic-timeout``, more re-forms than ``--reset-limit``, or every host
blacklisted for good ends the job with a message that says which, followed by
every rank that was lost and why. The job succeeds once a rank of the current
generation exits 0 and every other process has ended; from that exit on no
generation follows, and ranks waiting to re-form leave (exit 0).

``elastic/latest`` is the driver's alone: anything else found there (the key
deleted, or an earlier generation's signed value written back -- neither needs
the job secret) is put back, with a note.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import secrets
import signal
import threading
import time
from typing import Callable, Dict, List, Optional

from hvdlike.core.elastic import protocol
from hvdlike.core.job_secret import StoreTamperedError

from ..monitor import (
    CLOSED_OUTPUT_STATUS, Output, Worker, WorkerState, _ClosedOutput, _Interrupts, closed_reason,
    describe_exit,
)
from ..rendezvous import is_local
from ..ssh_exec import start_delay
from .assignment import Member, assign, placements, usable_slots
from .discovery import LastGood
from .host_table import HostTable
from .settings import ElasticSettings

SETTLE_SECONDS = 0.5
# A process left out of a generation leaves by itself at its next re-form;
# one still running this long afterwards is stopped.
REMOVED_GRACE_SECONDS = 30.0
WAIT_MARGIN_SECONDS = 60.0
# How often the driver checks that elastic/latest still says what it wrote,
# and looks for the current generation's arrivals and reports of late members.
LATEST_CHECK_SECONDS = 0.2


@dataclasses.dataclass
class Lost:
    """A rank process that failed."""

    rank: int
    worker: str
    host: str
    reason: str
    generation: int


@dataclasses.dataclass
class ElasticResult:
    exit_code: int
    message: str = ""
    interrupted: Optional[str] = None
    lost: List[Lost] = dataclasses.field(default_factory=list)
    generations: int = 0
    sizes: List[int] = dataclasses.field(default_factory=list)
    # The newest generation's number when the job was completed before all of its
    # members arrived (published, never formed); None when it formed or is unknown.
    unformed: Optional[int] = None

    def summary(self) -> str:
        lines = [self.message] if self.message else []
        for item in self.lost:
            lines.append(f"lost rank {item.rank} (generation {item.generation}) on host "
                         f"{item.host}: {item.reason}")
        return "\n".join(lines)


class ElasticDriver:
    """Runs one elastic job.

    Args:
        job: a prepared (entered) :class:`~..job.Job`: command, store, rank specs.
        settings: the elastic flags.
        discovery: the host source (first result already taken by the caller is fine).
        clock: monotonic clock (a seam for tests).
    """

    def __init__(self, job, settings: ElasticSettings, discovery: LastGood,
                 clock: Callable[[], float] = time.monotonic):
        self.job = job
        self.settings = settings
        self.discovery = discovery
        self.clock = clock
        self.output: Output = job.output
        self.table = HostTable(settings.cooldown_range)
        self.store = job.store.client()
        self.generation = 0
        self.members: List[Member] = []
        self.workers: Dict[str, Worker] = {}
        self.live: Dict[str, Worker] = {}
        self.result = ElasticResult(exit_code=0)
        self._ids = (f"w{n}" for n in itertools.count())
        self._events: "queue.Queue" = queue.Queue()
        self._reform_at: Optional[float] = None
        self._below_since: Optional[float] = None
        self._finishing = False
        self._removed_at: Dict[str, float] = {}
        self._stopping_since: Optional[float] = None
        self._stop_discovery = threading.Event()
        self._secrets: Dict[str, str] = {}  # worker id -> its own secret (seals its keys)
        self._keys: Dict[int, bytes] = {}  # generation number -> its key
        self._latest_checked = float("-inf")
        self._latest_restored = 0  # times elastic/latest was found changed and put back
        self._arrivals_checked = float("-inf")
        self._arrived: set = set()  # workers seen announced in some generation
        self._dropped: set = set()  # workers stopped for not arriving
        self._late_noted: set = set()  # (generation, worker) reported but kept
        self._tamper_noted: set = set()  # generations with a forged record, said once

    # -- the loop --------------------------------------------------------------------

    def run(self) -> ElasticResult:
        self.table.update(self.discovery.hosts if self.discovery.hosts is not None
                          else self.discovery.find())
        self._reform_at = self.clock()
        poller = threading.Thread(target=self._poll_discovery, daemon=True,
                                  name="hvdlike-run discovery")
        self.output.on_closed = lambda stream: self._events.put(("closed", stream))
        with _Interrupts(self._events), _ClosedOutput(self.output):
            poller.start()
            try:
                self._loop()
            finally:
                self._stop_discovery.set()
                self._stop_everything()
        return self.result

    def _loop(self) -> None:
        interrupts = 0
        while True:
            try:
                event = self._events.get(timeout=0.1)
            except queue.Empty:
                event = None
            if event is not None and event[0] == "signal":
                interrupts += 1
                name = signal.Signals(event[1]).name
                if self.result.interrupted is None:
                    self.result.interrupted = name
                    self.result.exit_code = 128 + event[1]
                self._stop_all(f"received {name}")
                if interrupts > 1:
                    for w in self.live.values():
                        w.kill()
            elif event is not None and event[0] == "closed":
                if self.result.interrupted is None and self.result.exit_code == 0:
                    self.result.interrupted = closed_reason(event[1])
                    self.result.exit_code = CLOSED_OUTPUT_STATUS
                self._stop_all(closed_reason(event[1]))
            elif event is not None and event[0] == "exit":
                self._exited(event[1], event[2])
            elif event is not None and event[0] == "hosts":
                # Checked on every discovery run, changed or not: a blacklisted
                # host whose cooldown ended is usable again under the same list.
                self.table.update(event[1])
                if self.generation > 0 and self._hosts_matter():
                    self._schedule_reform()
            if self.result.interrupted is None and not self._finishing and self.result.exit_code == 0:
                self._check_progress()
            if self.result.interrupted is None and self.result.exit_code == 0:
                self._guard_latest()
                if not self._finishing:
                    self._check_arrivals()
            self._stop_removed()
            if not self.live and (self._finishing or self.result.interrupted
                                  or self.result.exit_code != 0):
                if self._finishing and self.result.exit_code == 0 and not self._formed():
                    self.result.unformed = self.generation
                break

    def _formed(self) -> bool:
        """Whether every member of the newest generation arrived in it (an unknown
        answer counts as yes: it only changes how the summary counts re-forms)."""
        keys = [protocol.ready_key(self.generation, m.worker) for m in self.members]
        try:
            return bool(self.store.check(keys))
        except Exception:
            return True

    def _check_progress(self) -> None:
        now = self.clock()
        if self._reform_at is not None and now >= self._reform_at:
            self._reform()
        if self._below_since is not None:
            if self.table.hopeless(now):
                self._fail("every host is blacklisted: no rank can run")
            elif now - self._below_since > self.settings.elastic_timeout:
                have = len(self._usable_members())
                self._fail(f"fewer than --min-np {self.settings.min_np} slots usable "
                           f"({have}) for more than --elastic-timeout "
                           f"{self.settings.elastic_timeout:g}s")

    # -- events ----------------------------------------------------------------------

    def _exited(self, worker_id: str, code: int) -> None:
        worker = self.live.pop(worker_id, None)
        if worker is None:
            return
        worker.exit_code = code
        member = worker_id in {m.worker for m in self.members}
        if worker_id in self._dropped:  # stopped for not arriving: counted already
            worker.state = WorkerState.STOPPED
            return
        if not member:  # left out of the current generation: expected to leave
            worker.state = WorkerState.STOPPED
            return
        if code == 0:
            worker.state = WorkerState.SUCCEEDED
            if not self._finishing:
                self._finishing = True
                # Ranks waiting to re-form (their collective failed as this one
                # shut down) leave instead of waiting for a generation that will
                # not come; ranks still working finish as they would.
                view = self.store.for_generation(self._keys.get(self.generation))
                view.set(protocol.finished_key(self.generation), worker_id.encode())
                members = {m.worker for m in self.members}
                others = sorted(w.rank for wid, w in self.live.items() if wid in members)
                if others:
                    who = (f"rank {others[0]} has" if len(others) == 1 else
                           f"ranks {', '.join(map(str, others))} have")
                    self.output.note(f"rank {worker.rank} completed; the job ends once {who} "
                                     "ended (no further re-forms)")
            return
        worker.state = WorkerState.FAILED
        if worker.stop_requested_at is not None:
            worker.state = WorkerState.STOPPED
            return
        # A rank that is not a process (a Ray actor) says itself why it ended.
        reason = getattr(worker, "exit_reason", None) or describe_exit(code, worker.remote)
        self._report_lost(worker.rank, reason)
        self.result.lost.append(Lost(worker.rank, worker_id, worker.host, reason, self.generation))
        if self._finishing or self.result.interrupted:
            return
        until = self.table.blacklist(worker.host, self.clock())
        back = "for the rest of the job" if until is None else \
            f"for {until - self.clock():.0f}s"
        self.output.note(f"rank {worker.rank} on host {worker.host} {reason}; host "
                         f"{worker.host} blacklisted {back}; re-forming")
        self._schedule_reform()

    def _report_lost(self, rank: int, reason: str) -> None:
        """Tell the survivors at once how the rank ended, unless it said so itself.

        Their diagnosis reads it instead of waiting for its heartbeat to stop.
        """
        key = protocol.lost_key(self.generation, rank)
        try:
            if not self.store.check([key]):
                view = self.store.for_generation(self._keys.get(self.generation))
                view.set(key, f"{reason} (seen by hvdlike-run)")
        except Exception as exc:  # the survivors' diagnosis falls back to heartbeats
            self.output.note(f"could not report rank {rank}'s end to its peers: {exc}")

    def _guard_latest(self) -> None:
        """Put ``elastic/latest`` back when it no longer says the newest generation.

        Anybody who reaches the store can delete the key or write back the value
        it had for an earlier generation (signed, but old): ranks waiting for the
        newest generation would wait without end, having never seen it. Ranks
        that did see it refuse the older value (core/elastic/worker.py).
        """
        now = self.clock()
        if self.generation == 0 or now - self._latest_checked < LATEST_CHECK_SECONDS:
            return
        self._latest_checked = now
        expected = str(self.generation)
        try:
            if not self.store.check([protocol.LATEST_KEY]):
                found = None
            else:
                try:
                    found = self.store.get(protocol.LATEST_KEY).decode(errors="replace")
                except StoreTamperedError:
                    found = ""
            if found == expected:
                return
            self.store.set(protocol.LATEST_KEY, expected.encode())
        except Exception:  # noqa: BLE001 - the store is closing with the job: nothing to guard
            return
        self._latest_restored += 1
        if self._latest_restored > 1 and self._latest_restored % 50:
            return  # said already; an attacker that keeps at it gets a line every 50
        if found is None:
            what = f"elastic/latest (generation {expected}) was deleted from the job's store"
        elif found:
            what = (f"elastic/latest in the job's store said generation {found} instead of "
                    f"{expected}: an old record was written back")
        else:
            what = (f"elastic/latest in the job's store held a value hvdlike did not sign "
                    f"instead of generation {expected}")
        again = f" ({self._latest_restored} times so far)" if self._latest_restored > 1 else ""
        self.output.note(f"{what} by a process without the job's secret; restored it{again}")

    # -- members that do not arrive ------------------------------------------------------

    def _check_arrivals(self) -> None:
        """Note which members of the current generation have arrived, and act on
        a member's report that others did not (see :meth:`_drop_late`)."""
        now = self.clock()
        if self.generation == 0 or now - self._arrivals_checked < LATEST_CHECK_SECONDS:
            return
        self._arrivals_checked = now
        number = self.generation
        view = self.store.for_generation(self._keys.get(number))
        try:
            self._note_arrivals(number, view)
            report = protocol.read_late(view, number)
        except StoreTamperedError as exc:
            if number not in self._tamper_noted:
                self._tamper_noted.add(number)
                self.output.note(f"ignoring a record of generation {number} hvdlike did not "
                                 f"write: {exc}")
            return
        except Exception:  # noqa: BLE001 - the store is closing with the job
            return
        if report is not None:
            self._drop_late(number, report)

    def _note_arrivals(self, number: int, view) -> None:
        """Remember the members whose ready mark in generation ``number`` is there
        and is their generation's (a process that arrived once is not "late to
        start" when it later takes long to reach a commit). A mark not signed
        with the generation's key is no arrival."""
        for m in self.members:
            key = protocol.ready_key(number, m.worker)
            if m.worker in self._arrived or not self.store.check([key]):
                continue
            try:
                view.get(key)
            except StoreTamperedError:
                continue
            self._arrived.add(m.worker)

    def _drop_late(self, number: int, report: protocol.LateReport) -> None:
        """Stop the members ``report`` names that never arrived, and re-form without them.

        Only a member that has arrived may report, and only members that have
        never arrived in any generation are dropped: a survivor still on its way
        to its next commit is waited for (see :meth:`_note_waited_for`). The
        reporter, which did arrive, is never blamed.
        """
        members = {m.worker: m for m in self.members}
        if report.by not in members or report.by not in self._arrived:
            return
        late = [members[w] for w in dict.fromkeys(report.missing)
                if w in members and w in self.live and w not in self._arrived
                and w not in self._dropped]
        self._note_waited_for(number, report, members)
        if not late:
            return
        arrived_hosts = {m.slot.host for m in self.members if m.worker in self._arrived}
        blacklisted: set = set()
        for m in late:
            self._drop(m, number, report, arrived_hosts, blacklisted)
        self._schedule_reform()

    def _drop(self, member: Member, number: int, report: protocol.LateReport,
              arrived_hosts: set, blacklisted: set) -> None:
        """Stop one member that never arrived and keep its place out of the job.

        Its host is blacklisted as a failed rank's would be, unless a member that
        arrived runs there too (blacklisting it would drop that one as well): then
        only its slot is dropped, never given to a new process.
        """
        host, worker, now = member.slot.host, self.live[member.worker], self.clock()
        self._dropped.add(member.worker)
        worker.request_stop()
        reason = f"did not arrive for generation {number} within {report.seconds:g}s"
        self.result.lost.append(Lost(worker.rank, member.worker, host, reason, number))
        if host in arrived_hosts:
            until = self.table.drop_slot(member.slot, now)
            back = "" if until is None else f" for {until - now:.0f}s"
            what = f"its slot dropped{back} (host {host} stays: members that arrived run there)"
        elif host in blacklisted:
            what = f"host {host} blacklisted"
        else:
            blacklisted.add(host)
            until = self.table.blacklist(host, now)
            back = "for the rest of the job" if until is None else f"for {until - now:.0f}s"
            what = f"host {host} blacklisted {back}"
        self.output.note(f"member {member.worker} (rank {worker.rank}) on {host} {reason} "
                         f"(reported by {report.by}); stopping it; {what}; re-forming")

    def _note_waited_for(self, number: int, report: protocol.LateReport, members) -> None:
        """Say once per generation and member when a reported member is kept: it took
        part in an earlier generation, and reaches this one at its next commit."""
        wait = self.settings.elastic_timeout + WAIT_MARGIN_SECONDS
        for w in report.missing:
            if w in self._arrived and w in members and (number, w) not in self._late_noted:
                self._late_noted.add((number, w))
                self.output.note(f"member {w} has not arrived for generation {number} within "
                                 f"{report.seconds:g}s; it took part in an earlier one (on its "
                                 f"way to its next commit), so it is waited for up to {wait:g}s "
                                 "(--elastic-timeout plus a minute)")

    def _hosts_matter(self) -> bool:
        """Whether the new host list calls for a re-form."""
        now = self.clock()
        usable = set(usable_slots(self.table.available(now))) - self.table.dropped_slots(now)
        if any(m.slot not in usable for m in self.members):
            return True
        return len(self.members) < self.settings.max_np and len(usable) > len(self.members)

    def _schedule_reform(self) -> None:
        if self._reform_at is None:
            self._reform_at = self.clock() + SETTLE_SECONDS

    def _poll_discovery(self) -> None:
        while not self._stop_discovery.wait(self.settings.discovery_interval):
            try:
                hosts = self.discovery.find()
            except Exception as exc:  # LastGood only raises on the first run
                self.output.note(f"host discovery failed: {exc}")
                continue
            self._events.put(("hosts", hosts))

    # -- generations -------------------------------------------------------------------

    def _usable_members(self) -> List[Member]:
        """What a re-form would give now (for messages; starts nothing)."""
        placeholder_ids = itertools.repeat("new")
        now = self.clock()
        return assign(self._survivors(), self.table.available(now),
                      self.settings.max_np, placeholder_ids, self.table.dropped_slots(now))

    def _survivors(self):
        """``(worker, slot)`` of the current members still running and not dropped."""
        return [(m.worker, m.slot) for m in self.members
                if m.worker in self.live and m.worker not in self._dropped]

    def _reform(self) -> None:
        now = self.clock()
        target = self.settings.np if self.generation == 0 else self.settings.max_np
        members = assign(self._survivors(), self.table.available(now), target, self._ids,
                         self.table.dropped_slots(now))
        if len(members) < self.settings.min_np:
            if self._below_since is None:
                self._below_since = now
                self.output.note(f"{len(members)} slot(s) usable, fewer than --min-np "
                                 f"{self.settings.min_np}; waiting up to "
                                 f"{self.settings.elastic_timeout:g}s for more hosts")
            self._reform_at = now + 1.0  # look again with the next discovery
            return
        limit = self.settings.reset_limit
        if self.generation >= 1 and limit is not None and self.generation - 1 >= limit:
            self._fail(f"the job would re-form more than --reset-limit {limit} time(s)")
            return
        self._below_since = None
        self._reform_at = None
        previous = {m.worker for m in self.members}
        self._publish(members, removed_only=not any(m.new for m in members))
        for worker_id in previous - {m.worker for m in members}:
            self._removed_at.setdefault(worker_id, now)

    def _publish(self, members: List[Member], removed_only: bool) -> None:
        if self.generation:
            try:  # arrivals not seen yet: its ready marks go once the next one forms
                self._note_arrivals(self.generation,
                                    self.store.for_generation(self._keys.get(self.generation)))
            except Exception:  # noqa: BLE001 - the store is closing with the job
                pass
        self.generation += 1
        number = self.generation
        places = placements(members)
        table = {}
        for m in members:
            topo = places[m.worker].topology
            table[m.worker] = {field: getattr(topo, field) for field in protocol.TOPOLOGY_FIELDS}
        generation = protocol.Generation(number, table, removed_only)
        for m in members:
            if m.new:
                self._secrets[m.worker] = secrets.token_hex(16)
        self._keys[number] = protocol.publish(self.store, generation, self._secrets)
        self.members = members
        for m in members:
            if not m.new:
                self.workers[m.worker].placement = places[m.worker]  # output prefix: the new rank
        # Announced before any of its processes starts: a process started for
        # generation N never legitimately reads an older elastic/latest, so a
        # rank takes any value below what it knows for an old record written back.
        self.store.set(protocol.LATEST_KEY, str(number).encode())
        started = [self._start(m.worker, places[m.worker], number) for m in members if m.new]
        self.result.generations = number
        self.result.sizes.append(len(members))
        hosts = ", ".join(f"{h}:{sum(1 for m in members if m.slot.host == h)}"
                          for h in dict.fromkeys(m.slot.host for m in members))
        self.output.note(f"generation {number}: {len(members)} rank(s) on {hosts}"
                         + (f" ({len(started)} new)" if number > 1 and started else ""))

    def worker_env(self, worker_id: str, number: int) -> Dict[str, str]:
        """What a new rank process of generation ``number`` is told (with its secret:
        hand it over the way the job secret is, never on a command line)."""
        return {
            protocol.ENV_WORKER: worker_id,
            protocol.ENV_GENERATION: str(number),
            protocol.ENV_TIMEOUT: str(self.settings.elastic_timeout + WAIT_MARGIN_SECONDS),
            protocol.ENV_WORKER_SECRET: self._secrets[worker_id],
        }

    def _start(self, worker_id: str, placement, number: int) -> Worker:
        job = self.job
        if placement.host not in job.local:
            job.local[placement.host] = is_local(placement.host)
        addr, port = job.store.endpoint()
        spec = job.rank_spec(placement, addr, port)
        spec["env"].update(self.worker_env(worker_id, number))
        worker = Worker(placement, job.launch_argv(placement), spec,
                        remote=not job.local[placement.host], output=self.output,
                        log_dir=job.config.output_dir)
        self.workers[worker_id] = worker
        if worker.remote:
            time.sleep(start_delay(placement.topology.local_rank))
        try:
            worker.start()
        except OSError as exc:
            worker.state, worker.exit_code = WorkerState.FAILED, 127
            worker.stderr_tail.append(f"cannot start {worker.argv[0]}: {exc.strerror or exc}")
            self.live[worker_id] = worker
            self._events.put(("exit", worker_id, 127))
            return worker
        self.live[worker_id] = worker

        def wait() -> None:
            self._events.put(("exit", worker_id, worker.wait()))

        threading.Thread(target=wait, daemon=True, name=f"hvdlike-run wait {worker_id}").start()
        return worker

    # -- stopping ----------------------------------------------------------------------

    def _fail(self, message: str) -> None:
        self.result.message = message
        self.result.exit_code = 1
        self._stop_all(message)

    def _stop_all(self, reason: str) -> None:
        running = [w for w in self.live.values() if w.state is WorkerState.RUNNING]
        if running and self._stopping_since is None:
            self.output.note(f"{reason}; stopping {len(running)} rank(s)")
        if self._stopping_since is None:
            self._stopping_since = self.clock()
        for w in running:
            w.request_stop()

    def _stop_removed(self) -> None:
        now = self.clock()
        for worker_id, since in list(self._removed_at.items()):
            worker = self.live.get(worker_id)
            if worker is None:
                del self._removed_at[worker_id]
            elif now - since > REMOVED_GRACE_SECONDS:
                worker.request_stop()
        if self._stopping_since is not None and \
                now - self._stopping_since > self.job.config.grace_seconds + 10:
            for w in self.live.values():
                w.kill()

    def _stop_everything(self) -> None:
        """On the way out (normally nothing is left): stop, then kill what remains."""
        for w in self.live.values():
            w.request_stop()
        deadline = time.monotonic() + self.job.config.grace_seconds + 5
        while self.live and time.monotonic() < deadline:
            try:
                event = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            if event[0] == "exit":
                self.live.pop(event[1], None)
        for w in self.live.values():
            w.kill()
