"""Output paths through folders another local user controls.

Another user plants a symbolic link in a sticky, world-writable folder (``/tmp``)
at a folder of ``--output-filename`` or of the timeline; the job, run by root,
must not write through it where the kernel's ``fs.protected_symlinks`` rule
would not follow it -- whether that rule is on or not. Nor may it create or
write files in a folder another (non-root) user owns: that user could swap them.
Links the user made, and links outside sticky shared folders, keep working.

The links and folders "of another user" are made by root and handed over with
``lchown``/``chown``, so these tests need root.
"""

import io
import os
import pwd
import shutil
import stat
import subprocess
import threading
from types import SimpleNamespace

import pytest

from hvdlike.core.errors import ConfigError
from hvdlike.core.output_file import UnsafeOutputPath, open_output_file, output_folder

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root: the links and folders of another user are made by root and "
           "handed over with lchown")

TESTER = "hvdlike-tester"


def _other_user() -> int:
    """The uid of an unprivileged user (``nobody``, else one made with useradd)."""
    for name in ("nobody", TESTER):
        try:
            uid = pwd.getpwnam(name).pw_uid
        except KeyError:
            continue
        if uid != 0:
            return uid
    if shutil.which("useradd"):
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", TESTER], capture_output=True, timeout=30)
        try:
            return pwd.getpwnam(TESTER).pw_uid
        except KeyError:
            pass
    pytest.skip("no unprivileged user here and useradd could not make one")


@pytest.fixture
def place(tmp_path):
    """``shared`` (mode 1777, root's, like /tmp), root-only folders holding
    precious files, and ``plant(link, target)``: another user's link."""
    uid = _other_user()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    rootonly = tmp_path / "rootonly"
    (rootonly / "rank.0").mkdir(parents=True)
    rootonly.chmod(0o700)
    (rootonly / "rank.0" / "stdout").write_text("precious\n")
    (rootonly / "timeline.json").write_text("precious\n")
    (rootonly / "autotune.csv").write_text("precious\n")

    def plant(link, target, owner=uid):
        link.symlink_to(target)
        os.lchown(link, owner, owner)
        return link

    def untouched():
        assert (rootonly / "rank.0" / "stdout").read_text() == "precious\n"
        assert (rootonly / "timeline.json").read_text() == "precious\n"
        assert (rootonly / "autotune.csv").read_text() == "precious\n"
        assert sorted(p.name for p in rootonly.iterdir()) == [
            "autotune.csv", "rank.0", "timeline.json"]
        assert [p.name for p in (rootonly / "rank.0").iterdir()] == ["stdout"]

    return SimpleNamespace(uid=uid, user=pwd.getpwuid(uid).pw_name, tmp=tmp_path,
                           shared=shared, rootonly=rootonly, plant=plant, untouched=untouched)


def _planted_link_message(place, link):
    return (f"{link} is a symbolic link owned by user {place.user} (uid {place.uid}) in "
            f"{place.shared}, a sticky world-writable folder owned by user root (uid 0)")


# --- every writer refuses another user's link in a sticky shared folder -----------------


def _pump_into(log_dir, rank=0):
    """The launcher's pump of one rank's stdout with ``--output-filename log_dir``:
    what it said, after forwarding one line."""
    from hvdlike.launcher.hosts import HostSlots, assign_ranks
    from hvdlike.launcher.monitor import Output, Worker

    placement = assign_ranks([HostSlots("localhost", rank + 1)], rank + 1)[rank]
    out, err = io.StringIO(), io.StringIO()
    worker = Worker(placement, ["true"], {}, remote=False, output=Output(stdout=out, stderr=err),
                    log_dir=str(log_dir))
    read, write = os.pipe()
    worker._proc = SimpleNamespace(stdout=os.fdopen(read, "rb"))
    pump = threading.Thread(target=worker._pump, args=("stdout",), daemon=True)
    pump.start()
    os.write(write, b"the job's output\n")
    os.close(write)
    pump.join(timeout=30)
    assert not pump.is_alive()
    assert "[%d]<stdout>:the job's output" % rank in out.getvalue()  # still forwarded
    return err.getvalue() + out.getvalue()


def test_output_files_are_not_written_through_another_users_link(place):
    from hvdlike.launcher.errors import LaunchError
    from hvdlike.launcher.job import check_output_files

    link = place.plant(place.shared / "out", place.rootonly)
    for rank in (0, 1):
        with pytest.raises(LaunchError) as caught:
            check_output_files(str(link), rank)
        text = str(caught.value)
        assert text.startswith(f"--output-filename {link}: {_planted_link_message(place, link)}")
        assert "refusing to follow it" in text and "\n" not in text
    said = _pump_into(link, rank=1)  # planted after the launcher's check
    assert f"cannot write {link}/rank.1/stdout: {_planted_link_message(place, link)}" in said
    with pytest.raises(UnsafeOutputPath) as caught:
        open_output_file(str(link / "rank.0" / "stdout"), make_folders=True, own_names=2)
    assert caught.value.component == str(link)
    place.untouched()


def test_the_timeline_is_not_written_through_another_users_link(place):
    from hvdlike.core.timeline import Recording, Timeline
    from hvdlike.launcher.errors import LaunchError
    from hvdlike.launcher.job import check_writable_file

    link = place.plant(place.shared / "tl", place.rootonly)
    path = str(link / "timeline.json")
    with pytest.raises(LaunchError) as caught:  # the launcher's check (--dry-run's too)
        check_writable_file(path, str(place.tmp), "--timeline-filename")
    assert str(caught.value).startswith(
        f"--timeline-filename {path}: {_planted_link_message(place, link)}")
    with pytest.raises(UnsafeOutputPath, match="refusing to follow it"):
        Timeline(path)  # rank 0
    recording = Recording(rank=0)
    with pytest.raises(ValueError) as caught:  # init() turns it into a ConfigError
        recording.open(path)
    assert _planted_link_message(place, link) in str(caught.value)
    assert "Errno" not in str(caught.value)
    recording.close()
    place.untouched()


def test_the_autotune_log_is_not_written_through_another_users_link(place):
    from hvdlike.core.autotune import SampleLog
    from hvdlike.launcher.errors import LaunchError
    from hvdlike.launcher.job import check_writable_file

    link = place.plant(place.shared / "at", place.rootonly)
    path = str(link / "autotune.csv")
    with pytest.raises(LaunchError, match="is a symbolic link owned by user"):
        check_writable_file(path, str(place.tmp), "--autotune-log-file")
    with pytest.raises(ConfigError) as caught:
        SampleLog(path)
    assert _planted_link_message(place, link) in str(caught.value)
    place.untouched()


def test_mpich_output_folders_are_not_made_through_another_users_link(place, monkeypatch):
    from hvdlike.launcher import mpi_exec
    from hvdlike.launcher.errors import LaunchError
    from hvdlike.launcher.hosts import HostSlots
    from hvdlike.launcher.launch_config import LaunchConfig

    link = place.plant(place.shared / "mpi", place.rootonly)
    monkeypatch.setattr(mpi_exec, "detect_flavour", lambda mpirun: mpi_exec.MPICH)
    config = LaunchConfig(command=["true"], hosts=[HostSlots("localhost", 2)], np=2,
                          output_dir=str(link), use_mpi=True, cwd=str(place.tmp))
    with pytest.raises(LaunchError, match="is a symbolic link owned by user"):
        mpi_exec.run_with_mpirun(config, 2, mpirun="/nonexistent/mpirun",
                                 verbose=lambda text: None)
    place.untouched()


def test_a_deeper_link_is_refused_too_and_a_missing_folder_is_not_made_through_it(place,
                                                                                  monkeypatch):
    (place.rootonly / "deep").mkdir()
    link = place.plant(place.shared / "d", place.rootonly)
    with pytest.raises(UnsafeOutputPath) as caught:
        output_folder(str(link / "deep" / "new" / "rank.0"), make=True, own_names=1)
    assert caught.value.component == str(link)
    assert not (place.rootonly / "deep" / "new").exists()
    # A relative path names the component as given.
    monkeypatch.chdir(place.tmp)
    with pytest.raises(UnsafeOutputPath, match=r"^shared/d is a symbolic link owned by"):
        open_output_file("shared/d/timeline.json")
    (place.rootonly / "deep").rmdir()
    place.untouched()


def test_a_link_that_appears_where_a_folder_was_just_made_is_looked_at_again(place, monkeypatch):
    # The race between creating a folder and entering it: another user replaces the new
    # folder by a link (here the mkdir itself plants it). Entering it must not follow it.
    real_mkdir = os.mkdir
    planted = []

    def mkdir_then_swapped(path, mode=0o777, *, dir_fd=None):
        if not planted and os.path.basename(os.fspath(path)) == "out":
            planted.append(path)
            os.symlink(place.rootonly, path, dir_fd=dir_fd)
            os.chown(path, place.uid, place.uid, dir_fd=dir_fd, follow_symlinks=False)
            return
        real_mkdir(path, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", mkdir_then_swapped)
    with pytest.raises(UnsafeOutputPath, match="is a symbolic link owned by user"):
        open_output_file(str(place.shared / "out" / "rank.1" / "stdout"), make_folders=True,
                         own_names=2)
    assert planted
    place.untouched()


# --- a folder of another user: written into, but never through a link at hvdlike's names ---


def test_a_folder_another_user_owns_is_written_into_but_never_through_their_links(place):
    """A container's bind mount of a user's folder, written by root: allowed. A link
    of theirs at ``rank.N`` or at the file (which the kernel would follow there,
    the folder being theirs) is still refused."""
    from hvdlike.launcher.errors import LaunchError
    from hvdlike.launcher.job import check_output_files, check_writable_file

    theirs = place.shared / "theirs"
    theirs.mkdir()
    os.chown(theirs, place.uid, place.uid)
    check_output_files(str(theirs / "logs"), 0)
    assert (theirs / "logs" / "rank.0" / "stdout").is_file()
    check_writable_file(str(theirs / "t.json"), str(place.tmp), "--timeline-filename")
    os.close(open_output_file(str(theirs / "t.json")))
    assert (theirs / "t.json").is_file()
    # their link at rank.0 / at the file: refused, root's file untouched
    place.plant(theirs / "rank.0", place.rootonly / "rank.0")
    with pytest.raises(LaunchError, match="rank.0 is a symbolic link; refusing to follow it"):
        check_output_files(str(theirs), 0)
    place.plant(theirs / "t2.json", place.rootonly / "rank.0" / "stdout")
    with pytest.raises(OSError, match="symbolic link"):
        open_output_file(str(theirs / "t2.json"))
    place.untouched()


def test_a_rank_folder_is_never_a_link_even_the_users_own(tmp_path):
    from hvdlike.launcher.errors import LaunchError
    from hvdlike.launcher.job import check_output_files

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "rank.0").symlink_to(elsewhere)
    with pytest.raises(LaunchError, match=r"out/rank\.0 is a symbolic link; refusing to follow "
                                          r"it$"):
        check_output_files(str(tmp_path / "out"), 0)
    assert "is a symbolic link; refusing to follow it" in _pump_into(tmp_path / "out")
    assert list(elsewhere.iterdir()) == []


# --- what keeps working ------------------------------------------------------------------


def test_links_the_kernel_would_follow_keep_working(place):
    from hvdlike.core.timeline import Timeline
    from hvdlike.launcher.job import check_output_files

    scratch = place.tmp / "scratch"
    scratch.mkdir()
    # 1. The user's own link in the sticky shared folder.
    mine = place.plant(place.shared / "mine", scratch, owner=0)
    check_output_files(str(mine / "run1"), 0)
    said = _pump_into(mine / "run1")
    assert "cannot write" not in said
    assert (scratch / "run1" / "rank.0" / "stdout").read_bytes() == b"the job's output\n"
    # 2. Another user's link in a folder that is not sticky (as the kernel: followed).
    open_dir = place.tmp / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    other = place.plant(open_dir / "link", scratch)
    timeline = Timeline(str(other / "t.json"))
    timeline.start()
    timeline.close()
    assert (scratch / "t.json").read_text().startswith("[")
    # 3. A link in a sticky shared folder by the folder's owner.
    sticky_theirs = place.tmp / "sticky-theirs"
    sticky_theirs.mkdir()
    sticky_theirs.chmod(0o1777)
    os.chown(sticky_theirs, place.uid, place.uid)
    owners = place.plant(sticky_theirs / "link", scratch)
    os.close(open_output_file(str(owners / "deeper" / "rank.3" / "stderr"), make_folders=True,
                              own_names=2))
    assert stat.S_ISREG(os.stat(scratch / "deeper" / "rank.3" / "stderr").st_mode)
    # 4. Root's folders, made one level at a time in the shared folder.
    os.close(open_output_file(str(place.shared / "a" / "b" / "rank.0" / "stdout"),
                              make_folders=True, own_names=2))
    assert (place.shared / "a" / "b" / "rank.0" / "stdout").is_file()
    place.untouched()



# --- regular files planted at an output file's own name ----------------------------------


def test_a_hard_link_planted_at_an_output_name_is_refused_and_its_file_kept(place):
    """With ``fs.protected_hardlinks`` off another user can give a file of root's a
    second name in a shared folder; opening that name must not empty the file."""
    from hvdlike.launcher.errors import LaunchError
    from hvdlike.launcher.job import check_output_files

    out = place.shared / "out"
    (out / "rank.0").mkdir(parents=True)
    os.chown(out, place.uid, place.uid)
    os.chown(out / "rank.0", place.uid, place.uid)
    # made by root here, as the other user could where the kernel rule is off
    os.link(place.rootonly / "rank.0" / "stdout", out / "rank.0" / "stdout")
    os.link(place.rootonly / "timeline.json", place.shared / "t.json")
    with pytest.raises(LaunchError) as caught:
        check_output_files(str(out), 0)
    assert "rank.0/stdout has 2 names (hard links) and is in " in str(caught.value)
    assert "a folder other users can write" in str(caught.value)
    for path in (out / "rank.0" / "stdout", place.shared / "t.json"):
        for kwargs in ({}, {"truncate": False}):
            with pytest.raises(UnsafeOutputPath, match="has 2 names"):
                open_output_file(str(path), **kwargs)
    place.untouched()


def test_another_users_file_in_a_sticky_shared_folder_is_refused_the_users_own_reused(place):
    theirs = place.shared / "t.json"
    theirs.write_text("theirs\n")
    os.chown(theirs, place.uid, place.uid)
    with pytest.raises(UnsafeOutputPath) as caught:
        open_output_file(str(theirs))
    assert str(caught.value) == (
        f"{theirs} is a file owned by user {place.user} (uid {place.uid}) in "
        f"{place.shared}, a sticky world-writable folder owned by user root (uid 0): another "
        f"user's file there; refusing to write it")
    assert theirs.read_text() == "theirs\n"
    mine = place.shared / "mine.json"
    mine.write_text("old run\n")
    os.close(open_output_file(str(mine)))  # the user's own file: emptied and reused
    assert mine.read_text() == ""
    # a hard link in the user's own private folder is the user's business
    private = place.tmp / "private"
    private.mkdir(mode=0o700)
    (private / "a.json").write_text("x\n")
    os.link(private / "a.json", private / "b.json")
    fd = open_output_file(str(private / "b.json"), truncate=False)
    os.write(fd, b"y\n")
    os.close(fd)
    assert (private / "a.json").read_text() == "x\ny\n"
