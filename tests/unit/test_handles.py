"""Handles: completion, waiting from other threads, batches, errors (threads, no processes)."""

import threading

import pytest

from hvdlike.core.errors import HvdlikeInternalError
from hvdlike.core.handles import Handle, finish_many


def _waiter(handle, out, **kwargs):
    def body():
        try:
            out.append(("ok", handle.wait(**kwargs)))
        except BaseException as exc:  # recorded for the assertion
            out.append(("error", exc))
    thread = threading.Thread(target=body)
    thread.start()
    return thread


def test_result_and_error_reach_a_thread_already_waiting():
    ok, bad = Handle("ok"), Handle("bad")
    got_ok, got_bad = [], []
    threads = [_waiter(ok, got_ok), _waiter(bad, got_bad)]
    ok.set_result(41)
    bad.set_error(ValueError("broken"))
    for t in threads:
        t.join(10)
    assert got_ok == [("ok", 41)]
    assert got_bad[0][0] == "error" and str(got_bad[0][1]) == "broken"
    assert ok.done() and bad.done()


def test_completed_handle_returns_without_blocking_and_completes_once():
    handle = Handle("x")
    handle.set_result("first")
    handle.set_result("second")
    handle.set_error(RuntimeError("late"))
    assert handle.wait() == "first"
    assert "done" in repr(handle)


def test_finish_many_completes_each_handle_with_its_own_outcome():
    lock = threading.Lock()  # a runtime's handles share one
    handles = [Handle(f"h{i}", lock) for i in range(4)]
    handles[3].set_result("already")
    waited = []
    thread = _waiter(handles[1], waited)
    error = KeyError("no")
    finish_many(handles, [0, 1, None, "ignored"], {2: error})
    thread.join(10)
    assert waited == [("ok", 1)]
    assert handles[0].wait() == 0
    with pytest.raises(KeyError):
        handles[2].wait()
    assert handles[3].wait() == "already"


def test_wait_turns_a_dead_runtime_into_an_error_and_honours_timeout():
    handle = Handle("stuck")
    with pytest.raises(HvdlikeInternalError, match="'stuck' cannot complete: gone"):
        handle.wait(alive=lambda: RuntimeError("gone"))
    with pytest.raises(TimeoutError, match="'stuck' did not complete"):
        handle.wait(timeout=0.1)
    assert "pending" in repr(handle)
    handle.set_result(5)  # a waiter made by the calls above is reused and set
    assert handle.wait() == 5
