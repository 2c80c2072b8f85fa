"""Every bad input ends quickly with a one-line reason, a non-zero exit, no traceback.

The issue's list runs through the real ``hvdlike-run`` process; more cases run
in-process through ``cli.main`` (same code path after the interpreter starts).
"""

import pytest

from hvdlike.launcher import cli

from .conftest import run

REASONS = [
    (["-H", "a:x", "python"], "-H/--hosts entry 'a:x': slots 'x' must be a positive integer"),
    (["-np", "0", "python"], "-np 0 is not valid: expected at least 1 process"),
    (["-np", "3", "-H", "localhost:2", "python"], "-np 3 is more than the 2 slot(s) available"),
    (["--no-such-flag", "-np", "1", "python"], "unrecognized arguments: --no-such-flag"),
    (["-np", "1", "no-such-command-xyz"], "command not found: no-such-command-xyz"),
    (["-H", "no-such-host.invalid:1", "--start-timeout", "5", "true"], "host no-such-host.invalid"),
]

MORE_REASONS = [
    (["-H", "a,,b", "python"], "-H/--hosts entry '' is not valid"),
    (["-np", "two", "python"], "argument -np/--num-proc: 'two' is not an integer"),
    (["-np", "1", "./missing.py"], "command not found: ./missing.py"),
    (["-np", "1"], "no command given"),
    (["-np", "1", "--cycle-time-ms", "soon", "python"], "--cycle-time-ms 'soon' is not valid"),
    (["-np", "1", "--network-interface", "nosuchif0", "true"],
     "--network-interface 'nosuchif0' does not exist"),
    (["--hostfile", "/nonexistent/hostfile", "python"], "cannot read hostfile"),
]


@pytest.mark.parametrize("args, reason", MORE_REASONS)
def test_bad_input_in_process(args, reason, capsys):
    try:
        code = cli.main(args)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("hvdlike-run: error: ") and reason in err


@pytest.mark.parametrize("args, reason", REASONS)
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
