"""hvdlike-run, run by root, and output folders another user planted as symbolic links.

A sticky, world-writable folder (like ``/tmp``) holds another user's link at the
folder given to ``--output-filename`` or ``--timeline-filename``: the launcher
refuses it in one line before any rank starts and writes nothing through it,
whether the kernel's ``fs.protected_symlinks`` is on or not. The user's own
link there keeps working.
"""

import os
import pwd

import pytest

from .conftest import run

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="needs root: the other user's links are made by root and handed over with lchown")


def _unprivileged_uid():
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody' to own the planted links")


def test_root_does_not_write_through_a_link_another_user_planted_in_a_shared_folder(marker):
    uid = _unprivileged_uid()
    shared = marker / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    rootonly = marker / "rootonly"
    (rootonly / "rank.0").mkdir(parents=True)
    rootonly.chmod(0o700)
    (rootonly / "rank.0" / "stdout").write_text("precious\n")
    (rootonly / "timeline.json").write_text("precious\n")
    for name in ("out", "tl"):
        (shared / name).symlink_to(rootonly)
        os.lchown(shared / name, uid, uid)
    script = marker / "hi.py"
    script.write_text("print('hi from the job')\n")

    for flags, link in ((["--output-filename", str(shared / "out")], shared / "out"),
                        (["--timeline-filename", str(shared / "tl" / "timeline.json")],
                         shared / "tl")):
        code, out, err, _ = run(["-np", "2", *flags, "python", str(script)], timeout=60)
        assert code == 2, err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("hvdlike-run: error: "), err
        assert (f"{link} is a symbolic link owned by user nobody (uid {uid}) in {shared}, "
                "a sticky world-writable folder owned by user root (uid 0)") in err, err
        assert "hi from the job" not in out
    assert (rootonly / "rank.0" / "stdout").read_text() == "precious\n"
    assert (rootonly / "timeline.json").read_text() == "precious\n"
    assert sorted(p.name for p in rootonly.iterdir()) == ["rank.0", "timeline.json"]

    # The user's own link in the same folder: followed, as the kernel would.
    scratch = marker / "scratch"
    scratch.mkdir()
    (shared / "mine").symlink_to(scratch)
    code, out, err, _ = run(["-np", "1", "--output-filename", str(shared / "mine"), "python",
                             str(script)], timeout=60)
    assert code == 0, err
    assert (scratch / "rank.0" / "stdout").read_text() == "hi from the job\n"
