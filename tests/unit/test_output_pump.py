"""How a rank's output reaches the launcher's streams: pieces, prefixes, failed streams."""

import errno
import io
import os
import sys
import threading
import time

import pytest

from hvdlike.launcher import monitor
from hvdlike.launcher.hosts import HostSlots, assign_ranks
from hvdlike.launcher.monitor import (
    CLOSED_OUTPUT_STATUS, TAIL_LINE_CHARS, Output, PieceSplitter, Worker, WorkerState,
)

# Every kind of piece: lines, CR LF, progress updates, multi-byte and invalid UTF-8,
# an empty line, and an unfinished last line.
SAMPLE = ("first line\ncrlf line\r\n\rstep 1\rstep 2\rdone\n"
          "caf\u00e9 \u20ac \U0001f600\n\nprogress 50%\r\n").encode() + b"bad \xff\xfe!\nlast"
SAMPLE_SHOWN = ("[0]<stdout>:first line\n"
                "[0]<stdout>:crlf line\r\n"
                "[0]<stdout>:step 1\r[0]<stdout>:step 2\r[0]<stdout>:done\n"
                "[0]<stdout>:caf\u00e9 \u20ac \U0001f600\n"
                "[0]<stdout>:\n"
                "[0]<stdout>:progress 50%\r\n"
                "[0]<stdout>:bad \ufffd\ufffd!\n"
                "[0]<stdout>:last\n")


def _split(chunks, cap=1 << 16, flush_after=()):
    """Pieces of ``chunks`` fed one by one; ``flush`` (the rank paused) after the given chunks."""
    splitter = PieceSplitter(cap=cap)
    pieces = []
    for n, chunk in enumerate(chunks):
        pieces += splitter.feed(chunk)
        if n in flush_after:
            pieces += splitter.flush()
    return pieces + splitter.close()


def _shown(pieces, rank=0, stream="stdout"):
    out, err = io.StringIO(), io.StringIO()
    Output(stdout=out, stderr=err).pieces(rank, stream, pieces)
    return (out if stream == "stdout" else err).getvalue()


def test_lines_split_anywhere_come_out_whole():
    assert _split([b"hel", b"lo\nwor", b"ld\n", b"!"]) == [
        ("hello", "\n"), ("world", "\n"), ("!", "\n")]


def test_a_character_split_between_chunks_is_kept_whole():
    euro = "\u20ac".encode()  # three bytes
    assert _split([b"caf\xc3", b"\xa9 " + euro[:1], euro[1:2], euro[2:] + b"\n"]) == [
        ("caf\u00e9 \u20ac", "\n")]
    # Shown while the rank pauses inside a character: the character waits for its last byte.
    assert _split([b"caf\xc3", b"\xa9\n"], flush_after={0}) == [("caf", ""), ("\u00e9", "\n")]


def test_invalid_and_truncated_utf8_become_replacement_characters():
    assert _split([b"caf\xe9 \xff\n", b"ab\xe2\x82"]) == [
        ("caf\ufffd \ufffd", "\n"), ("ab\ufffd", "\n")]


def test_carriage_returns_end_pieces():
    assert _split([b"\rstep 1\rstep 2\r", b"\ndone\r\n"]) == [
        ("", "\r"), ("step 1", "\r"), ("step 2", "\r"), ("", "\n"), ("done", "\r\n")]
    assert _split([b"a\r\nb\n"]) == [("a", "\r\n"), ("b", "\n")]


def test_a_cr_lf_split_between_chunks_is_shown_as_one():
    split = _split([b"a\r", b"\nb\n"])
    assert split == [("a", "\r"), ("", "\n"), ("b", "\n")]
    assert _shown(split) == _shown(_split([b"a\r\nb\n"])) == "[0]<stdout>:a\r\n[0]<stdout>:b\n"


def test_a_line_longer_than_the_cap_is_forwarded_in_parts():
    splitter = PieceSplitter(cap=10)
    pieces = []
    for _ in range(20):
        pieces += splitter.feed(b"xyz")
        assert splitter._size < 10  # never more than the cap is held back
    pieces += splitter.feed(b"w\n") + splitter.close()
    assert all(end == "" for _, end in pieces[:-1]) and pieces[-1][1] == "\n"
    assert len(pieces) > 2 and "".join(text for text, _ in pieces) == "xyz" * 20 + "w"
    # Shown as one line: the parts continue each other.
    assert _shown(pieces) == "[0]<stdout>:" + "xyz" * 20 + "w\n"


def test_the_end_of_the_stream_ends_an_unfinished_line():
    assert _split([b"last"]) == [("last", "\n")]
    assert _split([b"last"], flush_after={0}) == [("last", ""), ("", "\n")]
    assert _shown(_split([b"last"], flush_after={0})) == "[0]<stdout>:last\n"
    assert _split([b"done\n"]) == [("done", "\n")]
    assert _split([]) == []


@pytest.mark.parametrize("pause", [False, True])
def test_any_split_of_the_stream_shows_the_same_text(pause):
    # Whatever the chunks (and whether the rank paused between them), the launcher
    # shows the same text: no character is split, no line end doubled or lost.
    whole = _shown(_split([SAMPLE]))
    assert whole == SAMPLE_SHOWN
    for at in range(1, len(SAMPLE)):
        chunks = [SAMPLE[:at], SAMPLE[at:]]
        assert _shown(_split(chunks, flush_after={0} if pause else ())) == whole, at
    one_by_one = [SAMPLE[n:n + 1] for n in range(len(SAMPLE))]
    assert _shown(_split(one_by_one)) == whole


def test_progress_updates_overwrite_each_other_and_the_next_piece_starts_clean():
    out, err = io.StringIO(), io.StringIO()
    output = Output(stdout=out, stderr=err)
    output.pieces(0, "stderr", [("", "\r"), ("step 1", "")])  # tqdm: "\r" then the bar
    output.pieces(0, "stderr", [("", "\r"), ("step 2", "")])
    output.pieces(0, "stderr", [("", "\r"), ("progress 10%", "\r")])
    output.pieces(1, "stderr", [("other rank", "\n")])  # keeps rank 0's update shown
    output.pieces(0, "stderr", [("progress 20%", "\r")])
    output.note("a note")
    output.pieces(0, "stderr", [("", "\n")])  # the CR LF's end: its line was already ended
    assert err.getvalue() == ("[0]<stderr>:step 1\r[0]<stderr>:step 2\r"
                              "[0]<stderr>:progress 10%\r\n"
                              "[1]<stderr>:other rank\n"
                              "[0]<stderr>:progress 20%\r\n"
                              "hvdlike-run: a note\n")
    assert out.getvalue() == ""


def test_an_open_line_interrupted_by_another_rank_goes_on_with_a_prefix():
    out = io.StringIO()
    output = Output(stdout=out, stderr=io.StringIO())
    output.pieces(0, "stdout", [("ab", "")])
    output.pieces(0, "stdout", [("cd", "")])
    output.pieces(1, "stdout", [("x", "\n")])
    output.pieces(0, "stdout", [("ef", "\n")])
    output.pieces(0, "stdout", [("gh", "")])
    output.pieces(1, "stdout", [("y", "")])
    output.pieces(0, "stdout", [("", "\n")])  # its line is ended already: no empty line
    output.pieces(1, "stdout", [("", "\n")])
    assert out.getvalue() == ("[0]<stdout>:abcd\n[1]<stdout>:x\n[0]<stdout>:ef\n"
                              "[0]<stdout>:gh\n[1]<stdout>:y\n")


def test_stdout_and_stderr_on_one_terminal_do_not_share_a_line(tmp_path):
    with open(tmp_path / "both", "w") as both:
        output = Output(stdout=both, stderr=both)
        output.pieces(0, "stderr", [("", "\r"), (" 50%|#", "")])
        output.pieces(0, "stdout", [("loss 0.3", "\n")])
        output.pieces(0, "stderr", [("", "\r"), (" 60%|##", "")])
        output.pieces(0, "stderr", [("", "\n")])
    assert (tmp_path / "both").read_text() == (
        "[0]<stderr>: 50%|#\n[0]<stdout>:loss 0.3\n[0]<stderr>: 60%|##\n")


def test_timestamps_start_each_prefixed_piece_only():
    out = io.StringIO()
    Output(stdout=out, timestamps=True).pieces(2, "stdout", [("a", ""), ("b", "\n"), ("c", "\n")])
    first, second = out.getvalue().splitlines()
    assert first.endswith("[2]<stdout>:ab") and second.endswith("[2]<stdout>:c")
    assert first[:-len("[2]<stdout>:ab")] and second[:-len("[2]<stdout>:c")]


# --- the pump: a real pipe, read as the launcher reads a rank's stream


def _worker(tmp_path=None, rank=0):
    placement = assign_ranks([HostSlots("localhost", rank + 1)], rank + 1)[rank]
    out, err = io.StringIO(), io.StringIO()
    worker = Worker(placement, ["true"], {}, remote=False, output=Output(stdout=out, stderr=err),
                    log_dir=str(tmp_path) if tmp_path else None)
    return worker, out, err


class _Pipes:
    """Stands in for the helper process: its stdout and stderr are pipes the test writes."""

    def __init__(self):
        self.writers = {}
        for stream in ("stdout", "stderr"):
            read, write = os.pipe()
            setattr(self, stream, os.fdopen(read, "rb"))
            self.writers[stream] = write

    def close(self):
        for fd in self.writers.values():
            try:
                os.close(fd)
            except OSError:
                pass


def _pumping(worker, stream):
    pipes = _Pipes()
    worker._proc = pipes
    pump = threading.Thread(target=worker._pump, args=(stream,), daemon=True)
    pump.start()
    return pipes, pump


def _wait_for(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def test_pump_shows_a_progress_update_while_the_rank_waits_and_logs_the_bytes(tmp_path):
    worker, out, err = _worker(tmp_path)
    pipes, pump = _pumping(worker, "stderr")
    try:
        fd = pipes.writers["stderr"]
        os.write(fd, b"\rstep 1")
        # Nothing more comes until it is shown: it must be shown without a line end.
        _wait_for(lambda: "step 1" in err.getvalue(), "the progress update")
        assert err.getvalue() == "[0]<stderr>:step 1"
        os.write(fd, b"\rstep 2\r")
        _wait_for(lambda: "step 2" in err.getvalue(), "the second update")
        os.write(fd, b"\ncaf\xc3")
        os.write(fd, b"\xa9\n" + b"y" * 200_000 + b"\nTraceback (most recent call last):\n")
        os.write(fd, b"ValueError: bad")
    finally:
        pipes.close()
        pump.join(timeout=30)
    assert not pump.is_alive()
    shown = err.getvalue()
    assert shown == ("[0]<stderr>:step 1\r[0]<stderr>:step 2\r\n[0]<stderr>:caf\u00e9\n"
                     "[0]<stderr>:" + "y" * 200_000 + "\n"
                     "[0]<stderr>:Traceback (most recent call last):\n[0]<stderr>:ValueError: bad\n")
    assert out.getvalue() == ""
    assert (tmp_path / "rank.0" / "stderr").read_bytes() == (
        b"\rstep 1\rstep 2\r\ncaf\xc3\xa9\n" + b"y" * 200_000
        + b"\nTraceback (most recent call last):\nValueError: bad")
    # The tail: the latest progress update, lines cut to a bounded length.
    assert list(worker.stderr_tail) == [
        "step 2", "caf\u00e9", "y" * TAIL_LINE_CHARS + " ...",
        "Traceback (most recent call last):", "ValueError: bad"]
    assert pipes.stderr.closed  # the pump let go of the pipe


def test_pump_keeps_the_tail_bounded():
    worker, _, err = _worker()
    pipes, pump = _pumping(worker, "stderr")
    try:
        for n in range(100):
            os.write(pipes.writers["stderr"], b"line %d\n" % n)
        os.write(pipes.writers["stderr"], b"z" * (3 * monitor.PIECE_CAP))  # no line end
    finally:
        pipes.close()
        pump.join(timeout=30)
    assert not pump.is_alive()
    assert list(worker.stderr_tail)[:-1] == ["line %d" % n for n in range(91, 100)]
    assert worker.stderr_tail[-1] == "z" * TAIL_LINE_CHARS + " ..."
    assert err.getvalue().count("z") == 3 * monitor.PIECE_CAP


# --- a stream that cannot be written


class _Failing(io.StringIO):
    """A stream whose writes fail with ``error`` once ``after`` writes went through."""

    def __init__(self, error, after=0):
        super().__init__()
        self.error, self.after, self.attempts = error, after, 0

    def write(self, text):
        self.attempts += 1
        if self.attempts > self.after:
            raise self.error
        return super().write(text)


@pytest.mark.parametrize("error", [BrokenPipeError(errno.EPIPE, "Broken pipe"),
                                   OSError(errno.EPIPE, "Broken pipe"),
                                   ConnectionResetError(errno.ECONNRESET, "Connection reset")])
def test_a_stream_whose_reader_went_away_stops_the_job(error):
    err = io.StringIO()
    out = _Failing(error, after=1)
    output = Output(stdout=out, stderr=err)
    closed = []
    output.on_closed = closed.append
    for n in range(3):
        output.line(0, "stdout", f"line {n}")
    output.line(1, "stderr", "still here")
    assert closed == ["stdout"] and list(output.closed) == ["stdout"] and output.dropped == {}
    assert out.getvalue() == "[0]<stdout>:line 0\n" and out.attempts == 2
    assert err.getvalue() == "[1]<stderr>:still here\n"  # no note: the job stops instead


@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "No space left on device"),
                                          (errno.EBADF, "Bad file descriptor"),
                                          (errno.EIO, "Input/output error")])
def test_a_stream_that_cannot_be_written_is_dropped_and_the_job_goes_on(code, reason):
    out = io.StringIO()
    err = _Failing(OSError(code, os.strerror(code)), after=1)
    output = Output(stdout=out, stderr=err)
    closed = []
    output.on_closed = closed.append
    output.line(0, "stderr", "first")
    for n in range(3):
        output.line(0, "stderr", f"lost {n}")
        output.line(0, "stdout", f"kept {n}")
    output.note("a note")
    assert closed == [] and output.closed == {} and output.dropped == {"stderr": reason}
    assert err.getvalue() == "[0]<stderr>:first\n" and err.attempts == 2  # not tried again
    assert out.getvalue() == (
        f"hvdlike-run: cannot write to stderr ({reason}); its lines are dropped from now on\n"
        "[0]<stdout>:kept 0\n[0]<stdout>:kept 1\n[0]<stdout>:kept 2\n")


def test_stderr_closed_at_start_is_dropped_and_said_on_stdout(monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)  # what Python makes of a closed descriptor 2
    out = io.StringIO()
    output = Output(stdout=out)
    closed = []
    output.on_closed = closed.append
    output.pieces(0, "stdout", [("open", "")])
    output.note("a note")
    output.line(0, "stdout", "kept")
    assert closed == [] and output.dropped == {"stderr": "closed at start"}
    assert out.getvalue() == ("[0]<stdout>:open\nhvdlike-run: cannot write to stderr "
                              "(closed at start); its lines are dropped from now on\n"
                              "[0]<stdout>:kept\n")


def test_a_full_stdout_is_said_on_stderr_and_both_failing_never_raises():
    out = _Failing(OSError(errno.ENOSPC, "No space left on device"))
    err = io.StringIO()
    output = Output(stdout=out, stderr=err)
    output.line(0, "stdout", "lost")
    output.line(0, "stderr", "kept")
    assert err.getvalue() == ("hvdlike-run: cannot write to stdout (No space left on device); "
                              "its lines are dropped from now on\n[0]<stderr>:kept\n")
    both = Output(stdout=_Failing(OSError(errno.EIO, "Input/output error")),
                  stderr=_Failing(OSError(errno.ENOSPC, "No space left on device")))
    closed = []
    both.on_closed = closed.append
    for n in range(3):
        both.line(0, "stdout", "x")
        both.line(0, "stderr", "y")
        both.note("z")
    assert both.dropped == {"stdout": "Input/output error", "stderr": "No space left on device"}
    assert closed == []


# --- the whole watch: real ranks, a failing launcher stream


def _run_monitor(output, script, ranks=1):
    placements = assign_ranks([HostSlots("localhost", ranks)], ranks)
    workers = [Worker(p, [sys.executable, "-c", script], {}, remote=False, output=output)
               for p in placements]
    result = []
    runner = threading.Thread(target=lambda: result.append(
        monitor.monitor(workers, output, grace_seconds=5)), daemon=True)
    try:
        runner.start()
        runner.join(timeout=60)
    finally:
        for worker in workers:
            worker.kill()
    assert result, "the job did not end"
    return result[0]


RANK_TALKS_UNTIL_STOPPED = """
import sys, time
for n in range(3):
    print("out", n, flush=True)
    print("err", n, file=sys.stderr, flush=True)
sys.stdin.readline()  # the spec
sys.stdin.read()      # until the launcher stops the rank (or it ends)
"""

RANK_TALKS = """
import sys
for n in range(3):
    print("out", n, flush=True)
    print("err", n, file=sys.stderr, flush=True)
"""


def test_a_job_whose_stderr_is_full_runs_to_its_end():
    out = io.StringIO()
    output = Output(stdout=out, stderr=_Failing(OSError(errno.ENOSPC, "No space left on device")))
    result = _run_monitor(output, RANK_TALKS)
    assert result.exit_code == 0 and result.interrupted is None, result
    assert result.workers[0].state is WorkerState.SUCCEEDED
    assert out.getvalue().count("hvdlike-run: cannot write to stderr") == 1
    assert [line for line in out.getvalue().splitlines() if line.startswith("[0]")] == [
        "[0]<stdout>:out 0", "[0]<stdout>:out 1", "[0]<stdout>:out 2"]
    assert list(result.workers[0].stderr_tail) == ["err 0", "err 1", "err 2"]


def test_a_job_whose_stdout_reader_went_away_is_stopped():
    err = io.StringIO()
    output = Output(stdout=_Failing(BrokenPipeError(errno.EPIPE, "Broken pipe")), stderr=err)
    result = _run_monitor(output, RANK_TALKS_UNTIL_STOPPED)
    assert result.exit_code == CLOSED_OUTPUT_STATUS
    assert result.interrupted == "the launcher's stdout was closed"
    assert "cannot write to" not in err.getvalue()
