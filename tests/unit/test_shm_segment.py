"""Shared-memory segments: owner-only creation, refusal of foreign segments, naming, sweep."""

import os
import secrets
import stat
import subprocess
import time
import sys

import pytest

from hvdlike.core import bootstrap, config, shm_plane, shm_segment
from hvdlike.core.errors import HvdlikeInternalError


def _name():
    return f"{shm_segment.NAME_PREFIX}unit-{os.getpid()}-{secrets.token_hex(4)}"


def test_created_owner_only_and_reserved():
    name = _name()
    mm = shm_segment.Segment.create(name, 8192)
    try:
        info = os.stat(shm_segment.segment_path(name))
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_uid == os.getuid() and info.st_size == 8192
        with pytest.raises(FileExistsError):
            shm_segment.Segment.create(name, 8192)  # never reuses a name that exists
    finally:
        shm_segment.unlink(name)
        mm.close()
    assert not os.path.exists(shm_segment.segment_path(name))


def test_open_refuses_a_segment_others_can_read_or_of_the_wrong_size():
    name = _name()
    path = shm_segment.segment_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.ftruncate(fd, 4096)
        with pytest.raises(HvdlikeInternalError, match="mode 0600"):
            shm_segment.Segment.open(name, 4096)
        os.fchmod(fd, 0o600)
        with pytest.raises(HvdlikeInternalError, match="expected 8192"):
            shm_segment.Segment.open(name, 8192)
        shm_segment.Segment.open(name, 4096).close()
    finally:
        os.close(fd)
        shm_segment.unlink(name)


def test_sweep_removes_only_the_jobs_names():
    tag = secrets.token_hex(8)
    mine = f"{shm_segment.NAME_PREFIX}{tag}-1-1-aa"
    other = f"{shm_segment.NAME_PREFIX}{secrets.token_hex(8)}-1-1-aa"
    for name in (mine, other):
        shm_segment.Segment.create(name, 4096).close()
    try:
        assert shm_segment.sweep(tag) == [mine]
        assert os.path.exists(shm_segment.segment_path(other))
    finally:
        shm_segment.unlink(other)


def test_process_gone_sees_exited_children():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert shm_segment.process_gone(child.pid)
    assert not shm_segment.process_gone(os.getpid())


def _topo(local_size):
    return bootstrap.Topology(rank=0, size=4, local_rank=0, local_size=local_size,
                              hostname="h")


def test_settings_name_segments_by_a_one_way_tag_and_honour_the_knob():
    secret = secrets.token_hex(16)
    rdzv = bootstrap.Rendezvous(launcher="x", addr="127.0.0.1", port=1, secret=secret)
    got = shm_plane.settings(config.load({}), _topo(2), rdzv)
    assert got is not None and secret not in got.tag and len(got.tag) == 16
    assert got.tag == shm_plane.job_tag(secret)
    assert shm_plane.settings(config.load({"HVDLIKE_SHM": "0"}), _topo(2), rdzv) is None
    # Decided on job-wide facts only: every member takes part in the host exchange.
    assert shm_plane.settings(config.load({}), _topo(1), rdzv) is not None


def test_launcher_flag_turns_it_off():
    from hvdlike.launcher import cli
    from hvdlike.launcher.launch_config import knob_environment

    args = cli.build_parser().parse_args(["-np", "2", "--no-shm", "python", "x.py"])
    values = {k[len("knob_"):]: v for k, v in vars(args).items() if k.startswith("knob_")}
    assert knob_environment(values)["HVDLIKE_SHM"] == "0"


def test_read_peer_copies_another_process_memory_and_fails_once_it_exited():
    import ctypes

    payload = bytes(range(256)) * 41  # odd length, not page aligned
    source = ctypes.create_string_buffer(payload, len(payload))
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # the forked copy of `source` lives at the same address in the child
        os.close(r)
        os.write(w, b"x")
        os.close(w)
        import time
        time.sleep(30)  # killed below
        os._exit(0)
    os.close(w)
    os.read(r, 1)
    os.close(r)
    target = ctypes.create_string_buffer(len(payload))
    try:
        try:
            shm_segment.read_peer(child, ctypes.addressof(source), ctypes.addressof(target),
                                  len(payload))
        except OSError as exc:
            pytest.skip(f"this host does not let a process read another's memory: {exc}")
        assert target.raw == payload
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
    with pytest.raises(OSError):
        shm_segment.read_peer(child, ctypes.addressof(source), ctypes.addressof(target), 8)


def test_waiters_spin_only_when_every_member_has_a_core(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert shm_segment.spin_seconds(1) == shm_segment._SPIN_SECONDS > 0
    assert shm_segment.spin_seconds(2) == shm_segment._SPIN_SECONDS
    # More members than cores: a spinning waiter would hold the core a late peer needs.
    assert shm_segment.spin_seconds(3) == 0.0
    assert shm_segment.spin_seconds(4) == 0.0


def _two_members(masks):
    import mmap as _mmap

    mm = _mmap.mmap(-1, 4096)
    views = [shm_segment.Segment(mm, len(masks), me, 4096) for me in range(len(masks))]
    for view, cpus in zip(views, masks):
        shm_segment._publish_affinity(view, cpus)
    return views


@pytest.mark.parametrize("masks, cores", [
    ([{0}, {1}], 2),                  # ranks bound one to a core: each has its own
    ([{0}, {0}], 1),                  # the whole job confined to one core
    ([{0, 1}, {0, 1}], 2),
    ([{31, 63}, {32}], 3),            # CPUs on a word's sign bit and the next word
    ([{5, 400, 401}, {6, 402}], 4),   # beyond the bitmap: the largest count is added
])
def test_every_member_reads_the_union_of_the_members_cpu_masks(masks, cores):
    for view in _two_members(masks):
        assert shm_segment.shared_cores(view) == cores
    spin = shm_segment.spin_seconds(len(masks), cores)
    assert (spin > 0) == (cores >= len(masks))


def _cgroup(tmp_path, membership, files):
    tmp_path.mkdir()
    (tmp_path / "cgroup").write_text(membership)
    for rel, text in files.items():
        path = tmp_path / "fs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return shm_segment.cpu_quota(str(tmp_path / "fs"), str(tmp_path / "cgroup"))


def test_a_cgroup_cpu_quota_caps_the_cores_a_job_may_spin_on(tmp_path):
    v2 = "0::/job.slice/rank\n"
    assert _cgroup(tmp_path / "a", v2, {"job.slice/rank/cpu.max": "200000 100000\n"}) == 2.0
    assert _cgroup(tmp_path / "b", v2, {"job.slice/rank/cpu.max": "max 100000\n"}) is None
    # Inside a container the cgroup's own directory is the root.
    assert _cgroup(tmp_path / "c", "0::/\n", {"cpu.max": "150000 100000\n"}) == 1.5
    v1 = "4:memory:/x\n3:cpu,cpuacct:/x\n"
    assert _cgroup(tmp_path / "d", v1, {"cpu,cpuacct/x/cpu.cfs_quota_us": "-1\n",
                                        "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"}) is None
    assert _cgroup(tmp_path / "e", v1, {"cpu,cpuacct/x/cpu.cfs_quota_us": "300000\n",
                                        "cpu,cpuacct/x/cpu.cfs_period_us": "100000\n"}) == 3.0
    assert _cgroup(tmp_path / "f", v1, {}) is None  # nothing readable: no limit seen
    assert _cgroup(tmp_path / "g", "garbage", {}) is None
    assert shm_segment.cpu_quota(str(tmp_path / "none"), str(tmp_path / "missing")) is None


@pytest.mark.parametrize("quota, spins", [(None, True), (2.0, True), (1.5, False), (1.0, False)])
def test_the_quota_is_applied_to_the_members_cores(monkeypatch, quota, spins):
    monkeypatch.setattr(shm_segment, "cpu_quota", lambda: quota)
    for view in _two_members([{0}, {1}]):
        assert (shm_segment.spin_for(view) > 0) == spins


def test_runnable_on_names_a_running_threads_cpu_and_minus_one_for_a_sleeper():
    import threading

    if shm_segment._GETCPU is None:
        pytest.skip("sched_getcpu is not available on this platform")
    me = threading.get_native_id()
    assert shm_segment.runnable_on(os.getpid(), me) in os.sched_getaffinity(0)
    stop, started, tids = threading.Event(), threading.Event(), []

    def sleeper():
        tids.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        deadline = time.monotonic() + 10
        while shm_segment.runnable_on(os.getpid(), tids[0]) != -1:  # asleep on the event
            assert time.monotonic() < deadline, "the sleeping thread never showed as asleep"
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(10)
    assert shm_segment.runnable_on(os.getpid(), 0) == -1
    assert shm_segment.runnable_on(2 ** 22 + 7, me) == -1


def _stacked_pair():
    """Two views of one segment where member 1 last arrived on this thread's CPU
    as this very thread -- what a waiter sees when the late peer shares its core."""
    import threading

    views = _two_members([{0, 1}, {0, 1}])
    for view in views:
        view.spin = shm_segment._SPIN_SECONDS
        view.pids = [os.getpid(), os.getpid()]
    views[1].arrive()  # publishes this thread and its CPU as member 1's
    assert views[0].read(1, shm_segment._TID) == threading.get_native_id()
    return views


@pytest.fixture
def two_cpus(monkeypatch):
    if shm_segment._GETCPU is None or not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs sched_getcpu and sched_setaffinity")
    mask = os.sched_getaffinity(0)
    if len(mask) < 2:
        pytest.skip(f"needs two CPUs in this process's affinity mask, has {sorted(mask)}")
    # A quiet host whatever else runs meanwhile (see test_no_move_when_every_cpu...).
    monkeypatch.setattr(shm_segment, "runnable_tasks", lambda: 1)
    restore = os.sched_setaffinity  # the real one, whatever a test patches in
    yield mask
    restore(0, mask)


def test_a_waiter_sharing_the_late_members_core_moves_and_keeps_its_cpu_mask(two_cpus):
    views = _stacked_pair()
    # The peer "is" this thread: the kernel reports it on exactly this CPU.
    views[0]._leave_core(1, time.monotonic())
    assert views[0].moves == 1
    assert os.sched_getaffinity(0) == two_cpus  # narrowed for a moment, then restored


def test_a_waiter_stays_when_the_late_member_runs_elsewhere_or_moved_since(two_cpus, monkeypatch):
    views = _stacked_pair()
    line = shm_segment._WORDS_PER_LINE
    cpu = shm_segment._GETCPU()
    views[0].words[line + shm_segment._CPU] = cpu + 1  # arrived on another CPU
    views[0]._leave_core(1, time.monotonic())
    assert views[0].moves == 0
    # Arrived here, but the kernel now has it elsewhere (it slept and woke
    # on the other core) or asleep: moving would gain nothing, or put the two together.
    views[0].words[line + shm_segment._CPU] = cpu
    for elsewhere in (cpu + 1, -1):
        monkeypatch.setattr(shm_segment, "runnable_on", lambda pid, tid, where=elsewhere: where)
        views[0]._leave_core(1, time.monotonic())
        assert views[0].moves == 0
    assert os.sched_getaffinity(0) == two_cpus


def test_moving_off_a_core_is_rate_limited_and_off_for_good_when_refused(two_cpus, monkeypatch):
    views = _stacked_pair()
    now = time.monotonic()
    views[0]._leave_core(1, now)
    assert views[0].moves == 1
    # wait_all consults the limit before calling; the limit is set past ``now``.
    assert views[0]._next_move == pytest.approx(now + shm_segment._MOVE_INTERVAL_SECONDS)

    def refuse(pid, mask):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    views[1].arrive()  # the "peer" (this thread) arrives again, on the CPU it moved to
    views[0]._leave_core(1, now + 1.0)
    assert views[0].moves == 1 and views[0]._next_move == float("inf")


def test_a_member_alone_on_its_cpu_mask_never_moves(monkeypatch, two_cpus):
    views = _stacked_pair()
    cpu = shm_segment._GETCPU()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {cpu})
    calls = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, mask: calls.append(mask))
    views[0]._leave_core(1, time.monotonic())
    assert views[0].moves == 0 and calls == []


def test_a_refused_restore_of_the_cpu_mask_stops_further_moves(two_cpus, monkeypatch):
    views = _stacked_pair()
    real, calls = os.sched_setaffinity, []

    def second_refused(pid, mask):
        calls.append(set(mask))
        if len(calls) == 2:
            raise OSError(22, "Invalid argument")
        real(pid, mask)

    monkeypatch.setattr(os, "sched_setaffinity", second_refused)
    views[0]._leave_core(1, time.monotonic())
    assert views[0].moves == 1 and views[0]._next_move == float("inf")
    assert len(calls) == 2 and calls[1] == two_cpus and calls[0] < two_cpus


def test_runnable_tasks_reads_the_hosts_runnable_count_and_zero_when_unreadable(tmp_path):
    good = tmp_path / "loadavg"
    good.write_text("0.52 0.58 0.59 5/467 12345\n")
    assert shm_segment.runnable_tasks(str(good)) == 5
    bad = tmp_path / "bad"
    bad.write_text("garbage\n")
    assert shm_segment.runnable_tasks(str(bad)) == 0
    assert shm_segment.runnable_tasks(str(tmp_path / "missing")) == 0


def test_no_move_when_every_cpu_of_the_host_has_work(two_cpus, monkeypatch):
    views = _stacked_pair()
    monkeypatch.setattr(shm_segment, "runnable_tasks", lambda: (os.cpu_count() or 1) + 1)
    now = time.monotonic()
    views[0]._leave_core(1, now)
    assert views[0].moves == 0
    assert os.sched_getaffinity(0) == two_cpus
    # The look at the host counts against the rate limit like a move.
    assert views[0]._next_move == pytest.approx(now + shm_segment._MOVE_INTERVAL_SECONDS)


def test_members_arrive_without_sched_getcpu(monkeypatch):
    views = _two_members([{0, 1}, {0, 1}])
    monkeypatch.setattr(shm_segment, "_GETCPU", None)
    for view in views:
        view.spin = shm_segment._SPIN_SECONDS
    assert views[0].arrive() == 1 and views[1].arrive() == 1
    views[0].wait_all(lambda missing: None)  # both arrived: returns at once
    assert views[0].read(1, shm_segment._TID) == 0  # nothing published


def test_orphans_of_jobs_that_died_attaching_are_removed_once_old(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setattr(shm_segment, "SHM_DIR", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    tag = shm_segment.job_tag("some job")
    names = {
        "orphan": f"hvdlike-{tag}-{gone.pid}-1-0badcafe",
        "young": f"hvdlike-{tag}-{gone.pid}-2-0badcafe",
        "creator alive": f"hvdlike-{tag}-{os.getpid()}-1-0badcafe",
        "other user": f"hvdlike-{tag}-{gone.pid}-3-0badcafe",
        "not ours": f"other-{tag}-{gone.pid}-1-0badcafe",
        "odd shape": f"hvdlike-{tag}-x-1-0badcafe",
    }
    now = 1_000_000.0
    for label, name in names.items():
        path = tmp_path / name
        path.write_bytes(b"\0" * 64)
        age = 60.0 if label == "young" else shm_segment.ORPHAN_AGE_SECONDS + 60.0
        os.utime(path, (now - age, now - age))
    if os.getuid() == 0:
        os.chown(tmp_path / names["other user"], 65534, 65534)
    else:
        names.pop("other user")
        (tmp_path / f"hvdlike-{tag}-{gone.pid}-3-0badcafe").unlink()
    assert shm_segment.sweep_orphans(now=now) == [names["orphan"]]
    left = set(os.listdir(tmp_path))
    assert left == {name for label, name in names.items() if label != "orphan"}
