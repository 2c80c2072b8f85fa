"""Every bad input ends quickly with a one-line reason, a non-zero exit, no traceback."""

import pytest

from .conftest import run


@pytest.mark.parametrize("args, reason", [
    (["-H", "a:x", "python"], "-H/--hosts entry 'a:x': slots 'x' must be a positive integer"),
    (["-H", "a,,b", "python"], "-H/--hosts entry '' is not valid"),
    (["-np", "0", "python"], "-np 0 is not valid: expected at least 1 process"),
    (["-np", "3", "-H", "localhost:2", "python"], "-np 3 is more than the 2 slot(s) available"),
    (["--no-such-flag", "-np", "1", "python"], "unrecognized arguments: --no-such-flag"),
    (["-np", "two", "python"], "argument -np/--num-proc: 'two' is not an integer"),
    (["-np", "1", "no-such-command-xyz"], "command not found: no-such-command-xyz"),
    (["-np", "1", "./missing.py"], "command not found: ./missing.py"),
    (["-np", "1"], "no command given"),
    (["-np", "1", "--cycle-time-ms", "soon", "python"], "--cycle-time-ms 'soon' is not valid"),
    (["-np", "1", "--network-interface", "nosuchif0", "true"], "--network-interface 'nosuchif0' does not exist"),
    (["-H", "no-such-host.invalid:1", "--start-timeout", "5", "true"], "host no-such-host.invalid"),
    (["--hostfile", "/nonexistent/hostfile", "python"], "cannot read hostfile"),
])
def test_bad_input(args, reason, marker):
    code, out, err, _ = run(args, timeout=60)  # a hang fails the test
    assert code != 0
    assert "Traceback" not in err + out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hvdlike-run: error: ")
    assert reason in lines[0]


def test_malformed_hostfile_line_is_named(marker):
    hostfile = marker / "hosts"
    hostfile.write_text("# two hosts\nlocalhost slots=1\nlocalhost2 slots=many\n")
    code, out, err, _ = run(["--hostfile", str(hostfile), "true"])
    assert code != 0
    assert err.strip().splitlines() == [
        f"hvdlike-run: error: hostfile '{hostfile}' line 3 ('localhost2 slots=many'): "
        "slots 'many' must be a positive integer"]
