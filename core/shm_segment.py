"""A shared-memory segment of the ranks of one host, and how they wait on each other.

Life cycle: the lowest member rank on the host creates ``/dev/shm/<name>``
(``O_EXCL``, mode 0600, pages reserved up front with ``posix_fallocate`` so a
full tmpfs is an error at creation instead of a ``SIGBUS`` later), the others
open it (checking that it belongs to their user and has the expected size),
and as soon as every member has mapped it, every member unlinks the name.
From then on the memory lives only as long as some member keeps it mapped:
however the job ends -- a clean shutdown, a rank killed by ``SIGKILL``, the
launcher killed -- nothing is left behind in ``/dev/shm``. Only a crash of
*every* member in the few milliseconds between creation and attachment
leaves the name; it starts with the job's tag, so the launcher sweeps it, and
when nothing survives (the launcher killed too) the next hvdlike process on the
host that creates a segment removes it once it is old enough
(:func:`sweep_orphans`).

Synchronisation uses one 32-bit counter per member, written only by that
member (no atomic read-modify-write is ever needed): arriving at the k-th
sync point stores ``k``; waiting for the others means waiting until every
counter has reached ``k``. A waiter spins -- up to 50 us, yielding the core
on every read, when each member has a core of its own; a few reads otherwise
(``spin_seconds``) -- then sleeps in the kernel on the peer's counter with
``futex(FUTEX_WAIT)`` (through ctypes, the GIL released), and an arriving
member wakes sleepers with ``futex(FUTEX_WAKE)``: an idle or late peer costs
at most the spin, and nothing on a host with more ranks than cores. Where
futex is unavailable, waiting falls back to naps that grow to 1 ms. A waiter
about to spin that finds the late member on its own CPU moves itself to another
(``Segment._leave_core``): two members left on one core by the kernel otherwise
pay a time slice per sync point.

Ordering: counters and data are plain stores. x86-64 keeps stores in program
order and loads in program order, so data written before a counter is seen
by a peer that has seen the counter; a system call (futex) is a full barrier
on the other architectures Linux runs on.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import mmap
import os
import platform
import secrets
import stat
import threading
import time
import weakref
from typing import Callable, List, Optional, Sequence

from . import store_wait
from .errors import HvdlikeInternalError

SHM_DIR = "/dev/shm"
NAME_PREFIX = "hvdlike-"
LINE = 64  # bytes: each member's counter sits on its own cache line
_WORDS_PER_LINE = LINE // 4
_SPINS = 20  # counter reads before the clock is consulted (a few microseconds)
# How long a waiter keeps reading the counters before it sleeps, when the
# members of the segment have a core each (see ``spin_seconds``).
_SPIN_SECONDS = 50e-6
_SLICE_SECONDS = 0.1  # longest single sleep: how often liveness is checked
_FIRST_NAP_SECONDS = 0.002  # first sleep of a wait (bounds the cost of a missed wake)
_FENCE = threading.Lock()
_sched_yield = getattr(os, "sched_yield", lambda: None)


def _fence() -> None:
    """A full memory barrier: taking a lock is an atomic read-modify-write."""
    _FENCE.acquire()
    _FENCE.release()

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221,
              "s390x": 238, "riscv64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not the PRIVATE variants: the word is shared


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc():
    if _SYS_FUTEX is None or platform.system() != "Linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return libc
    except OSError:
        return None


_LIBC = _libc()


def _cpu_reader():
    """``sched_getcpu`` (the CPU the calling thread runs on), or None where absent."""
    fn = getattr(_LIBC, "sched_getcpu", None) if _LIBC is not None else None
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = []
    return fn


_GETCPU = _cpu_reader()
_native_id = threading.get_native_id
# A waiter moves itself off the core of the member it waits for (see
# ``Segment._leave_core``) at most this often.
_MOVE_INTERVAL_SECONDS = 0.002


def job_tag(secret: str) -> str:
    """The job's public tag (starts segment names), one-way from the secret."""
    try:
        from .job_secret import job_tag as derived  # the store layer's derivation
    except ImportError:
        digest = hmac.new(secret.encode(), b"hvdlike derive\0job tag", hashlib.sha256)
        return digest.hexdigest()[:16]
    return derived(secret)


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


ORPHAN_AGE_SECONDS = 600.0
"""A segment name older than this whose creator is gone is an orphan (see
:func:`sweep_orphans`): a live job's names exist only while its members attach."""

_NAME_PARTS = 5  # hvdlike-<tag>-<creator pid>-<count>-<random>


def sweep_orphans(now: Optional[float] = None) -> List[str]:
    """Remove names left by jobs every process of which died while attaching.

    A name is removed when it has hvdlike's shape, belongs to this user, is
    older than :data:`ORPHAN_AGE_SECONDS` and its creator (the pid in the name)
    no longer runs. Another user's names, young names and names whose creator
    lives are left alone; a creator in another pid namespace that shares this
    ``/dev/shm`` would look gone, hence the age. Returns the removed names.
    """
    now = time.time() if now is None else now

    def orphan(name: str) -> bool:
        parts = name.split("-")
        if not name.startswith(NAME_PREFIX) or len(parts) != _NAME_PARTS:
            return False
        try:
            pid = int(parts[2])
            info = os.lstat(segment_path(name))
        except (ValueError, OSError):
            return False
        return (info.st_uid == os.getuid() and stat.S_ISREG(info.st_mode)
                and now - info.st_mtime >= ORPHAN_AGE_SECONDS and not _alive(pid))

    return _remove_where(orphan)


def _remove_where(wanted: Callable[[str], bool]) -> List[str]:
    """Unlink the names in :data:`SHM_DIR` ``wanted`` accepts; return those removed."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if wanted(name):
            try:
                os.unlink(segment_path(name))
                removed.append(name)
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid this module writes: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: a process of another user has it
        return True
    return True


def sweep(tag: str) -> List[str]:
    """Remove segments whose name starts with the job's tag; return the removed names."""
    start = f"{NAME_PREFIX}{tag}-"
    return _remove_where(lambda name: name.startswith(start))


def spin_seconds(members: int, cores: Optional[int] = None) -> float:
    """How long a waiter of a segment with ``members`` members spins before sleeping.

    A peer that is about to arrive is seen within a microsecond by a spinning
    waiter, while a sleeper pays a system call on each side and a wake-up that
    may wait for a core: a synchronous small allreduce costs about three times
    as much when every wait sleeps. Spinning only pays when every member has a
    core of its own; on a host with more members than usable cores the waiter
    would take the core the late member needs, so it sleeps right away. Each
    spin yields the core, so a waiter sharing a core with a runnable peer (the
    scheduler sometimes puts both on one) lets that peer run instead.

    ``cores``: the CPUs the members may run on together (:func:`attach` counts
    the union of every member's affinity mask, so ranks bound one to a core
    still spin, capped by the cgroup's CPU quota); by default this process's
    own mask.
    """
    if cores is None:
        cores = len(affinity())
    return _SPIN_SECONDS if members <= cores else 0.0


def cpu_quota(root: str = "/sys/fs/cgroup",
              membership: str = "/proc/self/cgroup") -> Optional[float]:
    """CPUs' worth of time this process's cgroup may use per period, or None (no limit seen).

    A container limited to two CPUs on a larger host still shows every CPU in
    its affinity mask; the quota (cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) is what says how many run at once.
    """
    try:
        with open(membership) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.strip("/")
        if controllers == "":
            for base in (os.path.join(root, path), root):
                candidates.append(("v2", os.path.join(base, "cpu.max")))
        elif "cpu" in controllers.split(","):
            for base in (os.path.join(root, controllers, path), os.path.join(root, controllers),
                         os.path.join(root, "cpu", path), os.path.join(root, "cpu")):
                candidates.append(("v1", os.path.join(base, "cpu.cfs_quota_us")))
    for kind, path in candidates:
        try:
            if kind == "v2":
                with open(path) as f:
                    quota, period = f.read().split()[:2]
                if quota == "max":
                    return None
            else:
                with open(path) as f:
                    quota = f.read().strip()
                with open(os.path.join(os.path.dirname(path), "cpu.cfs_period_us")) as f:
                    period = f.read().strip()
                if int(quota) < 0:
                    return None
            return int(quota) / int(period) if int(period) > 0 else None
        except (OSError, ValueError):
            continue
    return None


def spin_for(segment: "Segment") -> float:
    """:func:`spin_seconds` for ``segment``'s members: their CPU masks together,
    capped by this process's cgroup quota."""
    cores = shared_cores(segment)
    quota = cpu_quota()
    if quota is not None:  # the cgroup runs at most this many at once
        cores = min(cores, max(1, int(quota)))
    return spin_seconds(segment.members, cores)


def affinity() -> set:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _publish_affinity(segment: "Segment", cpus) -> None:
    """Write this member's CPU mask into its header line (before it marks itself attached)."""
    words = [0] * _MASK_WORDS
    beyond = 0
    for cpu in cpus:
        if cpu < 32 * _MASK_WORDS:
            words[cpu // 32] |= 1 << (cpu % 32)
        else:
            beyond += 1
    for i, word in enumerate(words):  # the header's words are signed 32-bit
        segment.publish(_MASK + i, word - (1 << 32) if word >= 1 << 31 else word)
    segment.publish(_BEYOND, min(beyond, 0x7FFFFFFF))


def shared_cores(segment: "Segment") -> int:
    """How many CPUs the members may run on together (each member's published mask).

    CPUs numbered beyond the masks' reach are not told apart: the largest such
    count of one member is added (an undercount when members hold different
    ones, which only makes waiters sleep sooner).
    """
    union = [0] * _MASK_WORDS
    beyond = 0
    for member in range(segment.members):
        for i in range(_MASK_WORDS):
            union[i] |= segment.read(member, _MASK + i) & 0xFFFFFFFF
        beyond = max(beyond, segment.read(member, _BEYOND))
    return sum(bin(word).count("1") for word in union) + beyond


class Segment:
    """One mapped segment: a header of counters, then the data area.

    Args:
        mm: the mapping.
        members: number of members on this host.
        me: this process's index among them.
        header_bytes: bytes before the data area.
    """

    def __init__(self, mm: mmap.mmap, members: int, me: int, header_bytes: int):
        self.mm = mm
        self.members = members
        self.me = me
        self.header_bytes = header_bytes
        words = (ctypes.c_int32 * (header_bytes // 4)).from_buffer(mm)
        self.words = words
        self.base = ctypes.addressof(words)
        self.count = 0  # sync points passed by this member
        self.spin = 0.0  # seconds a waiter spins: set by attach() once every member's mask is in
        self.moves = 0  # times a waiter left the core of the member it waited for
        self._next_move = 0.0 if _GETCPU is not None else float("inf")
        self.pids: List[int] = []
        self.name = ""
        _LIVE.add(self)

    # -- creation --------------------------------------------------------------------

    @staticmethod
    def create(name: str, size: int) -> mmap.mmap:
        path = segment_path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise HvdlikeInternalError(
                    f"cannot reserve {size} bytes of shared memory in {SHM_DIR} for {name}: "
                    f"{exc.strerror} (free space in {SHM_DIR}, or set HVDLIKE_SHM=0)") from None
            return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            unlink(name)
            raise
        finally:
            os.close(fd)

    @staticmethod
    def open(name: str, size: int) -> mmap.mmap:
        path = segment_path(name)
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
                raise HvdlikeInternalError(
                    f"shared-memory segment {path} is not owned by this user with mode 0600; "
                    "refusing to use it")
            if info.st_size != size:
                raise HvdlikeInternalError(
                    f"shared-memory segment {path} has {info.st_size} bytes, expected {size}")
            return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    # -- counters --------------------------------------------------------------------

    def _word(self, member: int, slot: int = 0) -> int:
        return member * _WORDS_PER_LINE + slot

    def publish(self, slot: int, value: int) -> None:
        """Set one of this member's own header words (slot 1..15; 0 is the counter)."""
        self.words[self._word(self.me, slot)] = value

    def read(self, member: int, slot: int) -> int:
        return self.words[self._word(member, slot)]

    def arrive(self) -> int:
        """Mark this member as having reached the next sync point; return its number.

        Wakes only members that announced they sleep (``_SLEEPING``): a wake
        call costs a system call and, on a busy host, often a switch to the
        woken process before this one goes on. The fence between writing the
        counter and reading the flags (and between the sleeper's flag and
        its last look at the counter) keeps both from missing each other;
        were one missed anyway, the sleeper wakes by itself after
        ``_FIRST_NAP_SECONDS``.
        """
        self.count = (self.count + 1) & 0x7FFFFFFF
        words = self.words
        if self.spin and _GETCPU is not None:  # for a waiter to see it shares its core
            line = self.me * _WORDS_PER_LINE
            words[line + _CPU] = _GETCPU()
            words[line + _TID] = _native_id()
        words[self.me * _WORDS_PER_LINE] = self.count
        if _LIBC is None:
            return self.count
        _fence()
        for member in range(self.members):
            if member != self.me and words[member * _WORDS_PER_LINE + _SLEEPING]:
                _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(self.base + 4 * self.me * _WORDS_PER_LINE),
                              _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
                break
        return self.count

    def wait_all(self, check: Callable[[List[int]], None]) -> None:
        """Wait until every member has arrived at this member's last sync point.

        ``check(missing)`` runs about every 0.1 s while some members are missing;
        it raises to give up (the job failed, a member died, the deadline passed).
        """
        target = self.count
        words = self.words
        flag = self.me * _WORDS_PER_LINE + _SLEEPING
        for member in range(self.members):
            if member == self.me:
                continue
            index = self._word(member)
            spins = 0
            nap = 20e-6
            next_check = 0.0
            spin_until = 0.0
            sleep = _FIRST_NAP_SECONDS
            # Arrived, or already past: a peer is at most one sync point ahead.
            while ((words[index] - target) & 0x7FFFFFFF) >= (1 << 30):
                spins += 1
                if spins <= _SPINS:
                    continue
                now = time.monotonic()
                if not spin_until:
                    spin_until = now + self.spin
                    if self.spin and now >= self._next_move:
                        self._leave_core(member, now)
                if now < spin_until:
                    # Were the peer runnable on this core (the scheduler put both
                    # here), spinning would only delay it: let it run first.
                    _sched_yield()
                    continue
                if now >= next_check:
                    if next_check:
                        check(self._missing(target))
                    next_check = now + _SLICE_SECONDS
                if _LIBC is None:
                    time.sleep(nap)
                    nap = min(nap * 2, 1e-3)
                    continue
                words[flag] = 1
                _fence()
                value = words[index]
                if ((value - target) & 0x7FFFFFFF) >= (1 << 30):
                    ts = _Timespec(0, int(sleep * 1e9))
                    _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(self.base + 4 * index),
                                  _FUTEX_WAIT, ctypes.c_int32(value), ctypes.byref(ts), None, 0)
                    sleep = _SLICE_SECONDS
                words[flag] = 0

    def _leave_core(self, member: int, now: float) -> None:
        """Move this thread to another of its CPUs when the thread of ``member``
        that arrived last -- late now -- waits to run on the CPU this one runs on.

        Woken by each other, the threads of two members are often placed on
        one core by the kernel and left there while another core idles (on a
        virtual machine for whole seconds): every sync point then waits for a
        switch between them, a synchronous 4 KiB allreduce taking ~6x as long.
        Only while waiters spin (every member has a core of its own, see
        :func:`spin_seconds`) and some CPU of the host has nothing to run; the
        thread's CPU mask is narrowed for a moment and then restored as it
        was, so the kernel picks where it goes.
        """
        cpu = _GETCPU()
        line = member * _WORDS_PER_LINE
        if cpu != self.words[line + _CPU]:
            return
        # Where it arrived may be stale (it slept since, and woke elsewhere), and
        # a sleeping thread takes no CPU: ask the kernel whether that thread
        # waits to run right here before moving (a look rate-limited like a move).
        self._next_move = now + _MOVE_INTERVAL_SECONDS
        if runnable_on(self.pids[member], self.words[line + _TID]) != cpu:
            return
        if runnable_tasks() > (os.cpu_count() or 1):
            return  # every CPU has work: a move would only queue this thread elsewhere
        try:
            mask = os.sched_getaffinity(0)
            others = mask - {cpu}
            if not others:
                return
            os.sched_setaffinity(0, others)
        except OSError:
            self._next_move = float("inf")  # not allowed here: never again
            return
        self.moves += 1
        try:
            os.sched_setaffinity(0, mask)
        except OSError:
            # The CPUs allowed changed meanwhile (a cpuset): the thread keeps
            # the subset it has; no more moves that could narrow it further.
            self._next_move = float("inf")

    def _missing(self, target: int) -> List[int]:
        out = []
        for member in range(self.members):
            value = self.words[self._word(member)]
            if ((value - target) & 0x7FFFFFFF) >= (1 << 30):
                out.append(member)
        return out

    def sync(self, what: str, ranks: Sequence[int], timeout_seconds: float,
             abandon: Callable[[], Optional[BaseException]]) -> None:
        """Arrive, then wait for every member; raise naming a member that cannot come.

        Gives up when ``abandon()`` returns the job's failure, when a missing
        member's process has exited, or after ``timeout_seconds``.
        """
        self.arrive()
        deadline = time.monotonic() + timeout_seconds

        def check(missing: List[int]) -> None:
            error = abandon()
            if error is not None:
                raise HvdlikeInternalError(
                    f"shared-memory {what} abandoned, the job has failed: {error}") from None
            gone = [m for m in missing if process_gone(self.pids[m])]
            if gone:
                who = ", ".join(f"rank {ranks[m]} (pid {self.pids[m]})" for m in gone)
                raise HvdlikeInternalError(f"{who} exited during a shared-memory {what}")
            left = [m for m in missing if self.read(m, _ATTACHED) == _DEPARTED]
            if left:
                who = ", ".join(f"rank {ranks[m]}" for m in left)
                raise HvdlikeInternalError(f"{who} left the job (its runtime stopped) during a "
                                           f"shared-memory {what}")
            if time.monotonic() > deadline:
                who = ", ".join(f"rank {ranks[m]}" for m in missing)
                raise HvdlikeInternalError(
                    f"{who} did not reach a shared-memory {what} within {timeout_seconds:g}s")

        self.wait_all(check)

    def depart(self) -> None:
        """Tell the other members this one will reach no further sync point
        (``_ATTACHED`` set to ``_DEPARTED``): one waiting for it gives up at its
        next look, naming it, instead of waiting for its process to exit or for
        the timeout -- this process may live on (a Ray actor, a caught error)."""
        words = self.words
        if words is not None:
            words[self._word(self.me, _ATTACHED)] = _DEPARTED

    def close(self) -> None:
        _LIVE.discard(self)
        self.words = None
        try:
            self.mm.close()
        except BufferError:  # a tensor view is still alive: the GC unmaps it later
            pass


# Header words of each member: 0 is its sync counter, then these; the
# member's CPU mask fills the rest of its line: a bitmap of CPUs 0..287, the
# thread that arrived last and the CPU it arrived on (``_TID``, ``_CPU``), and
# the count of its CPUs numbered higher.
_PID, _ATTACHED, _SLEEPING, _MASK = 1, 2, 3, 4
_DEPARTED = -1  # in _ATTACHED: the member left (see Segment.depart)
# Every segment this process has mapped and not closed (see depart_all).
_LIVE: "weakref.WeakSet[Segment]" = weakref.WeakSet()


def depart_all() -> None:
    """:meth:`Segment.depart` every segment this process has open: its runtime
    stopped at once (an abort), and no member waiting for it should wait longer."""
    for segment in list(_LIVE):
        segment.depart()
_BEYOND = _WORDS_PER_LINE - 1
_CPU, _TID = _BEYOND - 1, _BEYOND - 2
_MASK_WORDS = _TID - _MASK
_ATTACH_POLL_SECONDS = 0.001
_created = 0


def attach(store, key: str, tag: str, me: int, members: int, header: int, size: int,
           ranks: Sequence[int], timeout_seconds: float,
           abandon: Callable[[], Optional[BaseException]] = lambda: None,
           gone: Callable[[Sequence[int]], str] = lambda ranks: "") -> Segment:
    """Create (member 0) or open (the others) a segment, then drop its name once all mapped it.

    Collective over the members; the name travels through ``store`` under ``key``.
    Waiting for the others gives up when ``abandon()`` returns the job's failure
    or ``gone`` names a member that has not come as gone (see :mod:`.store_wait`).
    """
    global _created
    name = ""
    what = f"shared memory for ranks {list(ranks)}"
    try:
        if me == 0:
            if _created == 0:  # once per process: what earlier jobs could not remove
                sweep_orphans()
            _created += 1
            name = f"{NAME_PREFIX}{tag}-{os.getpid()}-{_created}-{secrets.token_hex(4)}"
            mm = Segment.create(name, size)
            store.set(key, name)
        else:
            store_wait.await_keys(store, [key], [ranks[0]], timeout_seconds, abandon, gone, what)
            name = store.get(key).decode()
            mm = Segment.open(name, size)
        segment = Segment(mm, members, me, header)
        segment.name = name
        segment.publish(_PID, os.getpid())
        _publish_affinity(segment, affinity())
        segment.publish(_ATTACHED, 1)
        store_wait.await_all(
            lambda: all(segment.read(m, _ATTACHED) for m in range(members)),
            lambda: [ranks[m] for m in range(members) if not segment.read(m, _ATTACHED)],
            timeout_seconds, abandon, gone, what, doing="map the shared-memory segment",
            longest_nap=_ATTACH_POLL_SECONDS)
    except HvdlikeInternalError:
        raise
    except Exception as exc:
        raise HvdlikeInternalError(
            f"could not set up shared memory {name or '(unnamed)'} in {SHM_DIR}: {exc} "
            "(HVDLIKE_SHM=0 turns it off)") from None
    finally:
        if name:
            unlink(name)  # mapped by everyone (or failed): drop the name
    segment.pids = [segment.read(m, _PID) for m in range(members)]
    segment.spin = spin_for(segment)
    return segment


def unlink(name: str) -> None:
    try:
        os.unlink(segment_path(name))
    except OSError:
        pass


def runnable_tasks(path: str = "/proc/loadavg") -> int:
    """Threads running or waiting to run on the whole host now (0: cannot tell)."""
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return 0


def _stat_fields(path: str) -> List[bytes]:
    """The fields of a ``/proc/.../stat`` file after the command name (raises OSError):
    the first is field 3 of proc(5), the state."""
    with open(path, "rb") as f:
        return f.read().rsplit(b")", 1)[-1].split()


def runnable_on(pid: int, tid: int) -> int:
    """The CPU thread ``tid`` of process ``pid`` runs or waits to run on; -1 when
    it sleeps (it competes for no CPU) or cannot be read."""
    try:
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        # fields[0] is the state; field 39 of proc(5) is "processor".
        return int(fields[36]) if fields[0] == b"R" else -1
    except (OSError, ValueError, IndexError):
        return -1


def process_gone(pid: int) -> bool:
    """True when ``pid`` has exited (or is a zombie waiting to be reaped)."""
    if pid <= 0:
        return False
    try:
        fields = _stat_fields(f"/proc/{pid}/stat")
        return bool(fields) and fields[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _vm_readv():
    if _LIBC is None:
        return None
    fn = getattr(_LIBC, "process_vm_readv", None)
    if fn is not None:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_VM_READV = _vm_readv()


def read_peer(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy ``nbytes`` at address ``remote`` of process ``pid`` to ``local`` of this one.

    One kernel copy between the address spaces (``process_vm_readv``,
    "cross-memory attach"), the GIL released. Needs the right to ptrace
    ``pid`` (same user; Yama's ``ptrace_scope`` 0, or no Yama); raises
    ``OSError`` otherwise, when ``pid`` has exited, or when the range is not mapped.
    """
    if _VM_READV is None:
        raise OSError(0, "process_vm_readv is not available")
    while nbytes > 0:
        mine, theirs = _Iovec(local, nbytes), _Iovec(remote, nbytes)
        got = _VM_READV(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else 0
            raise OSError(err, os.strerror(err) if err else "nothing was read")
        remote += got
        local += got
        nbytes -= got


def header_bytes(members: int, extra_per_member: int = 0) -> int:
    need = members * LINE + members * extra_per_member
    return (need + 4095) // 4096 * 4096

