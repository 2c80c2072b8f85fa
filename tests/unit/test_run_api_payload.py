"""hvdlike.run, without starting ranks: outcomes that do not unpickle, the ranks'
PYTHONPATH, a deleted working directory, and lists of HostSlots."""

import os
import pickle
import sys

import cloudpickle
import pytest

import hvdlike
from hvdlike.launcher import api, run_args, task
from hvdlike.launcher.api import RankError
from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.hosts import HostSlots
from hvdlike.launcher.payload import (
    EXCEPTION_PICKLE, VALUE_PICKLE, PayloadError, result_key, result_purpose, seal, unseal,
    verify,
)


class NeedsTwo(Exception):
    def __init__(self, what, code):
        super().__init__(what)
        self.code = code


class BadValue:
    def __reduce__(self):
        return int, ("x",)


class NotAnException(Exception):
    def __reduce__(self):
        return str, ("a str, not an exception",)


class BrokenStr(Exception):
    def __str__(self):
        raise RuntimeError("no text")


def _raise(exc):
    raise exc


# -- the rank side --------------------------------------------------------------------


def test_an_exception_that_does_not_unpickle_travels_as_text_only():
    outcome = task._outcome(_raise, (NeedsTwo("boom on the rank", 2),), {})
    assert outcome["ok"] is False
    assert outcome["type"] == "NeedsTwo" and outcome["message"] == "boom on the rank"
    assert "_raise" in outcome["traceback"] and "boom on the rank" in outcome["traceback"]
    assert EXCEPTION_PICKLE not in outcome
    pickle.loads(cloudpickle.dumps(outcome))  # what the caller gets always unpickles


def test_an_exception_that_round_trips_travels_pickled_too():
    outcome = task._outcome(_raise, (ValueError("shard 1 is corrupt"),), {})
    rebuilt = pickle.loads(outcome[EXCEPTION_PICKLE])
    assert isinstance(rebuilt, ValueError) and str(rebuilt) == "shard 1 is corrupt"


def test_an_exception_that_unpickles_into_something_else_travels_as_text_only():
    assert task._round_trip(NotAnException("x")) is None
    assert task._round_trip(NeedsTwo("x", 1)) is None
    assert task._round_trip(KeyError("k")) is not None


class ExitsWhenRebuilt(Exception):
    def __reduce__(self):
        return sys.exit, (3,)


def test_an_exception_that_exits_when_unpickled_travels_as_text_only():
    outcome = task._outcome(_raise, (ExitsWhenRebuilt("stop"),), {})
    assert outcome["type"] == "ExitsWhenRebuilt" and outcome["message"] == "stop"
    assert EXCEPTION_PICKLE not in outcome


def test_an_exception_whose_str_fails_still_comes_back():
    outcome = task._outcome(_raise, (BrokenStr(),), {})
    assert outcome["type"] == "BrokenStr"
    assert "str() of the exception failed" in outcome["message"]


# -- the caller side ------------------------------------------------------------------


def _data(outcome):
    return cloudpickle.dumps(outcome)


def test_a_value_that_does_not_unpickle_becomes_a_failed_outcome_saying_so():
    opened = api._opened(_data({"ok": True, VALUE_PICKLE: cloudpickle.dumps(BadValue()),
                                "host": "h1"}))
    assert opened["ok"] is False and opened["host"] == "h1"
    assert opened["what"] == ("returned a value that could not be unpickled on the caller's "
                              "side (ValueError: invalid literal for int() with base 10: 'x')")
    with pytest.raises(RankError) as info:
        api.raise_outcome(3, "h1", opened)
    assert str(info.value).startswith("rank 3 (host h1) returned a value that could not be "
                                      "unpickled on the caller's side (ValueError: ")
    assert (info.value.rank, info.value.host) == (3, "h1")
    assert isinstance(info.value.__cause__, ValueError)


def test_a_value_that_exits_when_unpickled_does_not_end_the_caller():
    opened = api._opened(_data({"ok": True, VALUE_PICKLE: cloudpickle.dumps(_Exits())}))
    assert opened["ok"] is False and opened["type"] == "SystemExit"


class _Exits:
    def __reduce__(self):
        return sys.exit, (5,)


def test_a_value_that_unpickles_is_returned():
    opened = api._opened(_data({"ok": True, VALUE_PICKLE: cloudpickle.dumps([1, "two"])}))
    assert opened == {"ok": True, "value": [1, "two"]}


def test_an_exception_the_caller_cannot_rebuild_keeps_its_text():
    text = {"ok": False, "type": "NeedsTwo", "message": "boom", "traceback": "Traceback: ..."}
    # Pickled the way a rank would if its round trip had passed.
    opened = api._opened(_data(dict(text, **{EXCEPTION_PICKLE:
                                             cloudpickle.dumps(NeedsTwo("boom", 2))})))
    assert opened == text
    with pytest.raises(RankError, match=r"^rank 1 \(host h\) raised NeedsTwo: boom\n"
                                        r"Traceback: \.\.\.$") as info:
        api.raise_outcome(1, "h", opened)
    assert info.value.__cause__ is None and info.value.remote_traceback == "Traceback: ..."


def test_an_outcome_that_does_not_unpickle_at_all_is_a_failed_outcome():
    opened = api._opened(cloudpickle.dumps({"ok": True, "value": BadValue()}))
    assert opened["ok"] is False
    assert "filed a result that could not be unpickled on the caller's side" in opened["what"]
    opened = api._opened(cloudpickle.dumps(["not", "an", "outcome"]))
    assert opened["ok"] is False and "expected an outcome, got list" in opened["what"]


class _Store:
    def __init__(self):
        self.data = {}

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


class _Job:
    secret = "job-secret"


def test_gather_never_raises_the_unpickling_error_itself():
    store = _Store()
    store.data[result_key(0)] = seal(_Job.secret, result_purpose(0), {
        "ok": True, VALUE_PICKLE: cloudpickle.dumps(BadValue()), "host": "h0"})
    store.data[result_key(1)] = seal(_Job.secret, result_purpose(1), {
        "ok": True, VALUE_PICKLE: cloudpickle.dumps(7), "host": "h1"})
    outcomes = api.gather(_Job(), store, [0, 1, 2], None, lambda rank: f"h{rank}")
    assert sorted(outcomes) == [0, 1]
    assert outcomes[0]["ok"] is False and "could not be unpickled" in outcomes[0]["what"]
    assert outcomes[1]["value"] == 7
    assert api.first_cause(outcomes) == 0


def test_gather_refuses_a_forged_result_without_unpickling_it():
    store = _Store()
    store.data[result_key(0)] = seal("another-secret", result_purpose(0),
                                     {"ok": True, VALUE_PICKLE: cloudpickle.dumps(1)})
    with pytest.raises(RankError, match="rank 0 returned a result that failed authentication"):
        api.gather(_Job(), store, [0], None, lambda rank: "h0")


def test_verify_checks_without_unpickling_and_unseal_still_round_trips():
    blob = seal("s", "result/0", BadValue())
    assert bytes(verify("s", "result/0", blob)) == cloudpickle.dumps(BadValue())
    with pytest.raises(ValueError, match="invalid literal"):
        unseal("s", "result/0", blob)
    with pytest.raises(PayloadError, match="authentication failed"):
        verify("s", "result/1", blob)
    assert unseal("s", "payload", seal("s", "payload", {"a": 1})) == {"a": 1}


# -- the ranks' PYTHONPATH ------------------------------------------------------------


def test_the_callers_directories_come_first_in_its_own_order(tmp_path, monkeypatch):
    script, extra, given, missing = (tmp_path / n for n in ("script", "extra", "given", "gone"))
    for directory in (script, extra, given):
        directory.mkdir()
    interpreter = os.path.join(sys.prefix, "lib")
    monkeypatch.setattr(sys, "path", [str(script), str(given), str(extra), interpreter,
                                      str(script)])
    pythonpath = os.pathsep.join([str(given), str(missing), str(given), ""])
    entries = api._rank_pythonpath(str(tmp_path), pythonpath).split(os.pathsep)
    real = os.path.realpath
    assert entries == [real(script), real(given), real(extra), str(missing)]
    assert real(interpreter) not in entries


def test_an_interpreter_directory_named_in_pythonpath_keeps_its_place(tmp_path, monkeypatch):
    script = tmp_path / "script"
    script.mkdir()
    interpreter = os.path.realpath(os.path.dirname(os.__file__))
    monkeypatch.setattr(sys, "path", [str(script), interpreter])
    entries = api._rank_pythonpath(str(tmp_path), interpreter).split(os.pathsep)
    assert entries == [os.path.realpath(script), interpreter]


def test_relative_entries_are_the_callers_working_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", ["", "sub"])
    (tmp_path / "sub").mkdir()
    entries = api._rank_pythonpath(str(tmp_path), "").split(os.pathsep)
    assert entries == [os.path.realpath(tmp_path), os.path.realpath(tmp_path / "sub")]


# -- a deleted working directory ------------------------------------------------------


def test_a_deleted_working_directory_is_a_launch_error(tmp_path):
    here = os.getcwd()
    gone = tmp_path / "gone"
    gone.mkdir()
    os.chdir(gone)
    try:
        gone.rmdir()
        with pytest.raises(LaunchError, match="the current directory no longer exists"):
            hvdlike.run(lambda: 1, np=1)
    finally:
        os.chdir(here)


# -- hosts as HostSlots ----------------------------------------------------------------


@pytest.mark.parametrize("hosts, message", [
    ([HostSlots("localhost", -5)], r"hosts\[0\]\.slots -5 is not valid: expected at least 1"),
    ([HostSlots("localhost", 0)], r"hosts\[0\]\.slots 0 is not valid"),
    ([HostSlots("localhost", "2")], r"hosts\[0\]\.slots must be an int, got '2' \(str\)"),
    ([HostSlots("localhost", 2.0)], r"hosts\[0\]\.slots must be an int"),
    ([HostSlots("localhost", True)], r"hosts\[0\]\.slots must be an int"),
    ([HostSlots("a", 1), HostSlots("localhost", 10 ** 6)],
     r"hosts\[1\]: slots 1000000 is more than the limit of 65536"),
    ([HostSlots("a", 1), HostSlots("b", 1), HostSlots("a", 2)], r"names host 'a' twice"),
    ([HostSlots("[::1]", 1), HostSlots("::1", 1)], r"names host '::1' twice"),
    ([HostSlots("-oProxyCommand=x", 1)], r"hosts\[0\]: host '-oProxyCommand=x' is not valid"),
    ([HostSlots("-host", 1)], r"cannot start with '-'"),
    ([HostSlots("-u@host", 1)], r"cannot start with '-'"),
    ([HostSlots("host:2", 2)], r"host 'host:2' is not valid: a host name has no ':'"),
    ([HostSlots("a..b", 1)], r"empty part between dots"),
    ([HostSlots("host\n", 1)], r"host 'host\\n' is not valid"),
    ([HostSlots("", 1)], r"host '' is not valid"),
    ([HostSlots(b"host", 1)], r"host must be a str, got bytes"),
])
def test_host_slots_get_the_checks_of_the_string_form(hosts, message):
    with pytest.raises(LaunchError, match=message):
        run_args.host_list(hosts, None, None)


def test_valid_host_slots_are_kept_as_the_string_form_gives_them():
    assert run_args.host_list([HostSlots("a", 2), HostSlots("u@b.example", 1),
                               HostSlots("[fe80::1]", 3), HostSlots("::2", 1)], None, None) == \
        run_args.host_list("a:2,u@b.example:1,[fe80::1]:3,[::2]", None, None)
    assert run_args.host_list(HostSlots("a", 2), None, None) == [HostSlots("a", 2)]


def test_run_refuses_bad_host_slots_before_anything_starts():
    with pytest.raises(LaunchError, match=r"hosts\[0\]\.slots -5 is not valid"):
        hvdlike.run(lambda: 1, np=2, hosts=[HostSlots("localhost", -5)])
