"""Elastic jobs through the real hvdlike-run on this machine.

Distinct loopback addresses (127.0.0.1, 127.0.0.2) stand for distinct hosts:
the launcher runs them locally, but blacklists, assigns and reports them as
separate hosts. Every job trains EPOCHS x BATCHES steps of tests/e2e/elastic_train.py
with a commit per step; the assertions are on the sizes each rank trained at,
the committed step count at the end and the final parameters of every rank.
"""

import os
import re
import signal
import sys
import time

from .conftest import ROOT, finish, kill_session, launcher_env, run, start, write_script

TRAIN = os.path.join(ROOT, "tests", "e2e", "elastic_train.py")
EPOCHS, BATCHES = 2, 6


def _env(**extra):
    settings = {"HVDLIKE_GLOO_TIMEOUT_SECONDS": "10", "ELASTIC_EPOCHS": str(EPOCHS),
                "ELASTIC_BATCHES": str(BATCHES), **extra}
    return launcher_env(**settings)


def _done(out):
    """{worker: (rank, size, steps, params)} from the DONE lines."""
    found = {}
    for m in re.finditer(r"DONE worker=(\w+) rank=(\d+) size=(\d+) steps=(\d+) params=(\S+)", out):
        found[m.group(1)] = (int(m.group(2)), int(m.group(3)), int(m.group(4)), m.group(5))
    return found


def _trained_sizes(out, worker):
    return [int(s) for s in re.findall(rf"GEN worker={worker} gen=\d+ rank=\d+ size=(\d+)", out)]


def _assert_generations_agree(out):
    """Within each generation every rank starts from the same steps, parameters
    and optimizer state (the sync after a re-form), and ranks are 0..size-1."""
    starts = {}
    for m in re.finditer(r"GEN worker=\w+ gen=(\d+) rank=(\d+) size=(\d+) steps=(\d+) "
                         r"params=(\S+) optimizer=(\S+)", out):
        gen, rank, size = int(m.group(1)), int(m.group(2)), int(m.group(3))
        starts.setdefault(gen, []).append((rank, size, m.group(4), m.group(5), m.group(6)))
    assert starts, out
    for gen, rows in starts.items():
        size = rows[0][1]
        assert sorted(r for r, _, _, _, _ in rows) == list(range(size)), (gen, rows)
        assert len({row[1:] for row in rows}) == 1, (gen, rows)  # 'at=' is not captured


def _assert_finished(out, workers, size, steps=EPOCHS * BATCHES):
    done = _done(out)
    assert sorted(done) == sorted(workers), out
    assert sorted(rank for rank, _, _, _ in done.values()) == list(range(size))
    assert {s for _, s, _, _ in done.values()} == {size}
    assert {n for _, _, n, _ in done.values()} == {steps}, out
    assert len({params for _, _, _, params in done.values()}) == 1, out
    _assert_generations_agree(out)


def test_rank_raising_shrinks_the_job_from_4_to_2(marker):
    code, out, err, _ = run(
        ["-np", "4", "--min-np", "2", "--max-np", "4", "--reset-limit", "1",
         "-H", "127.0.0.1:2,127.0.0.2:2", sys.executable, TRAIN, str(marker)],
        timeout=180, env=_env(ELASTIC_FAULTS="w3:5:raise", ELASTIC_PROCESS_SETS="0,1;2,3"))
    assert code == 0, err
    _assert_finished(out, ["w0", "w1"], 2)
    assert _trained_sizes(out, "w0") == [4, 2]
    # static process sets: registered again after the re-form with the same id; the set of
    # ranks 2 and 3, which the job of 2 no longer has, is invalid (id None), as in Horovod
    assert re.findall(r"GEN worker=w1 gen=\d+ .* sets=(\S+)", out) == [
        "1:0-1:1,2:2-3:-", "1:0-1:1,None:2-3:-"], out
    assert "sizes 4 -> 2" in err
    assert "lost rank 3 (generation 1) on host 127.0.0.2: exited with code 1" in err
    assert "injected failure of w3 at step 5" in err


def test_rank_sigkilled_shrinks_the_job_from_3_to_2(marker):
    code, out, err, _ = run(
        ["-np", "3", "--min-np", "2", "-H", "127.0.0.1:2,127.0.0.2:1",
         sys.executable, TRAIN, str(marker)],
        timeout=180, env=_env(ELASTIC_FAULTS="w2:4:kill"))
    assert code == 0, err
    _assert_finished(out, ["w0", "w1"], 2)
    assert _trained_sizes(out, "w1") == [3, 2]
    assert "lost rank 2 (generation 1) on host 127.0.0.2: was killed by signal 9 (SIGKILL)" in err
    print(f"kill to training resumed: {resume_seconds(out, 2):.1f}s")


def test_a_rank_lost_while_a_generation_forms_is_named_and_the_next_one_forms(marker):
    # w3 raises (its host, alone, is blacklisted): generation 2 forms with w0-w2, and w2
    # dies making its groups. The
    # survivors, waiting for it to arrive, read the launcher's report of its end and give
    # generation 2 up at once, instead of after the 60 s Gloo timeout; generation 3 of
    # w0 and w1 finishes the job.
    code, out, err, _ = run(
        ["-np", "4", "--min-np", "2", "-H", "127.0.0.1:2,127.0.0.2:1,127.0.0.3:1",
         sys.executable, TRAIN, str(marker)],
        timeout=150, env=_env(ELASTIC_FAULTS="w3:3:raise", ELASTIC_DIE_FORMING="w2:2",
                              HVDLIKE_GLOO_TIMEOUT_SECONDS="60"))
    assert code == 0, err
    _assert_finished(out, ["w0", "w1"], 2)
    assert "FAULT worker=w2 kind=die-forming gen=2" in out, out
    formed = re.findall(r"generation 2 did not form \((.*)\); waiting for the next one", err)
    assert len(formed) == 2, err  # both survivors
    for why in formed:
        assert "could not create the control group: rank 2 was killed by signal 9 " \
               "(SIGKILL) (seen by hvdlike-run)" in why, why


def test_ranks_waiting_to_re_form_leave_once_a_rank_completed_the_job(marker):
    # As Horovod's driver stops the other workers once one succeeded: rank 1's last
    # collective fails as rank 0 ends, and it leaves instead of waiting out the
    # elastic timeout (10 minutes by default) for a generation that never comes.
    script = os.path.join(ROOT, "tests", "e2e", "elastic_uneven_end.py")
    code, out, err, seconds = run(["-np", "2", "--min-np", "1", sys.executable, script,
                                   str(marker)],
                                  timeout=120, env=_env())
    assert code == 0, err
    assert re.findall(r"DONE worker=(\w+) steps=(\d+)", out) == [("w0", "3")], out
    assert re.findall(r"STEP worker=w1 step=(\d) sum=(\d)", out) == [
        ("0", "2"), ("1", "2"), ("2", "2")], out  # step 3 failed: rank 0 had shut down
    assert "rank 0 completed; the job ends once rank 1 has ended (no further re-forms)" in err
    assert "elastic worker w1: the job is finishing (worker w0 completed it)" in err
    assert "generation 2" not in err
    print(f"job ended {seconds:.1f}s after start")


def test_a_rank_started_for_a_generation_the_others_never_enter_leaves(marker):
    # A script that is not elastic-aware, in a job that grows: the two first ranks
    # end (status 0) without entering generation 2, whose third rank then waits in
    # init() for them. It leaves once the job is completed instead of waiting out
    # the elastic timeout (10 minutes by default).
    script = write_script(marker, "done_early.py", """
        import os, sys, time
        entering = os.path.join(os.path.dirname(os.path.abspath(__file__)), "entering")
        if os.environ["HVDLIKE_ELASTIC_GENERATION"] == "1":
            # Ends once the launcher has published generation 2 (3 ranks) and its new
            # process is entering init() (at most 60 s: the assertions then say why).
            deadline = time.monotonic() + 60
            while not os.path.exists(entering) and time.monotonic() < deadline:
                time.sleep(0.05)
            print("EARLY", os.environ["HVDLIKE_RANK"], flush=True)
            sys.exit(0)
        import hvdlike.torch as hvd
        open(entering, "w").close()
        hvd.init()
        print("ENTERED", hvd.rank(), hvd.size(), flush=True)
    """)
    code, out, err, seconds = run(["-np", "2", "--min-np", "2", "--max-np", "3",
                                   "-H", "localhost:3", sys.executable, script],
                                  timeout=90, env=_env())
    assert code == 0, err
    assert sorted(re.findall(r"EARLY (\d)", out)) == ["0", "1"], out
    assert "ENTERED" not in out, out
    assert "generation 2: 3 rank(s)" in err, err
    assert "elastic worker w2: the job was completed before generation 2 formed; leaving" \
        in err, err
    # The summary counts generations that formed, not every one published.
    assert "job finished in generation 1 (2 rank(s)); generation 2 (3 rank(s)) was " \
        "completed before it formed" in err, err
    assert "re-form(s)" not in err, err
    print(f"job ended {seconds:.1f}s after start")


def test_ranks_that_join_when_done_let_the_others_finish_and_commit(marker):
    # hvd.join() inside hvd.elastic.run: the joined rank takes part in the others'
    # allreduces with zeros -- their gradients and the commit's agreement on the
    # newest generation alike -- so the job ends with every rank's work done.
    script = os.path.join(ROOT, "tests", "e2e", "elastic_uneven_end.py")
    code, out, err, _ = run(["-np", "2", "--min-np", "1", sys.executable, script, str(marker)],
                            timeout=120, env=_env(ELASTIC_JOIN="1"))
    assert code == 0, err
    assert sorted(re.findall(r"DONE worker=(\w+) steps=(\d+)", out)) == [
        ("w0", "3"), ("w1", "4")], out
    assert re.findall(r"STEP worker=w1 step=(\d) sum=(\d)", out) == [
        ("0", "2"), ("1", "2"), ("2", "2"), ("3", "1")], out  # rank 0 sent zeros
    assert sorted(re.findall(r"JOINED worker=(\w+) last=(\d)", out)) == [
        ("w0", "1"), ("w1", "1")], out
    assert "re-form" not in err.replace("no further re-forms", ""), err


def resume_seconds(out, generation):
    """Seconds from the injected fault to the first rank training in ``generation``."""
    fault = float(re.search(r"FAULT worker=\w+ kind=\w+ at=([\d.]+)", out).group(1))
    starts = [float(t) for t in re.findall(rf"GEN worker=\w+ gen={generation} .* at=([\d.]+)", out)]
    return min(starts) - fault


def test_every_rank_failing_fails_the_job(marker):
    code, out, err, _ = run(
        ["-np", "2", "--min-np", "1", "-H", "127.0.0.1:1,127.0.0.2:1",
         sys.executable, TRAIN, str(marker)],
        timeout=120, env=_env(ELASTIC_FAULTS="w0:2:raise,w1:2:raise"))
    assert code != 0
    assert "every host is blacklisted" in err, err
    # both processes are named: the second may fail in generation 1, or as the only
    # rank (rank 0) of generation 2 if the first one's loss reached it first
    lost = re.findall(r"lost rank \d \(generation \d\) on host (\S+): exited with code 1", err)
    assert sorted(lost) == ["127.0.0.1", "127.0.0.2"], err


def test_below_min_np_past_the_timeout_fails_the_job(marker):
    code, out, err, took = run(
        ["-np", "2", "--min-np", "2", "--elastic-timeout", "1", "--blacklist-cooldown-range",
         "300", "400", "-H", "127.0.0.1:1,127.0.0.2:1", sys.executable, TRAIN, str(marker)],
        timeout=120, env=_env(ELASTIC_FAULTS="w1:3:raise"))
    assert code != 0
    assert "fewer than --min-np 2 slots usable (1) for more than --elastic-timeout 1s" in err, err
    assert "lost rank 1 (generation 1) on host 127.0.0.2" in err


def test_reset_limit_exceeded_fails_the_job(marker):
    code, out, err, _ = run(
        ["-np", "2", "--min-np", "1", "--reset-limit", "0", "-H", "127.0.0.1:1,127.0.0.2:1",
         sys.executable, TRAIN, str(marker)],
        timeout=120, env=_env(ELASTIC_FAULTS="w1:3:raise"))
    assert code != 0
    assert "the job would re-form more than --reset-limit 0 time(s)" in err, err


def test_blacklisted_host_comes_back_after_its_cooldown(marker):
    code, out, err, _ = run(
        ["-np", "2", "--min-np", "1", "--max-np", "2", "--blacklist-cooldown-range", "2", "3",
         "-H", "127.0.0.1:1,127.0.0.2:1", sys.executable, TRAIN, str(marker)],
        # Generation 2 (w0 alone) steps slowly: 21 steps of 0.5 s for 127.0.0.2 to come
        # back after its 2-3 s cooldown; generations 1 and 3 need no time to wait for.
        timeout=180, env=_env(ELASTIC_FAULTS="w1:3:raise", ELASTIC_STEP_SECONDS="0.5",
                              ELASTIC_SLOW_GENERATIONS="2", ELASTIC_EPOCHS="3",
                              ELASTIC_BATCHES="8"))
    assert code == 0, err
    _assert_finished(out, ["w0", "w2"], 2, steps=3 * 8)
    assert _trained_sizes(out, "w0") == [2, 1, 2], out
    assert "host 127.0.0.2 blacklisted for " in err
    assert "sizes 2 -> 1 -> 2" in err


def test_hosts_added_then_removed_grow_and_shrink_the_job(marker):
    hosts = marker / "hosts.txt"
    hosts.write_text("127.0.0.1:2\n")
    script = marker / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    progress = marker / "progress"
    # Generations 1 (2 ranks) and 2 (4 ranks) step slowly while the hosts change under
    # them; generation 3, once shrunk, has nothing left to wait for.
    proc = start(["-np", "2", "--min-np", "2", "--max-np", "4", "--host-discovery-script",
                  str(script), sys.executable, TRAIN, str(marker)],
                 env=_env(ELASTIC_STEP_SECONDS="0.25", ELASTIC_SLOW_GENERATIONS="1,2",
                          ELASTIC_EPOCHS="3", ELASTIC_BATCHES="10",
                          ELASTIC_PROGRESS=str(progress)))
    try:
        _wait_progress(progress, lambda steps, size: steps >= 3, proc)
        hosts.write_text("127.0.0.1:2\n127.0.0.2:2\n")
        _wait_progress(progress, lambda steps, size: size == 4 and steps >= 14, proc)
        hosts.write_text("127.0.0.1:2\n")
        code, out, err = finish(proc, timeout=180)
    finally:
        kill_session(proc.pid)
    assert code == 0, err
    done = _done(out)
    assert sorted(done) == ["w0", "w1"], out
    assert {steps for _, _, steps, _ in done.values()} == {3 * 10}, out
    assert len({params for _, _, _, params in done.values()}) == 1
    _assert_generations_agree(out)
    assert _trained_sizes(out, "w0") == [2, 4, 2], out
    assert _trained_sizes(out, "w2") == [4] and _trained_sizes(out, "w3") == [4], out
    assert "sizes 2 -> 4 -> 2" in err


def _wait_progress(path, condition, proc, timeout=150):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early: {proc.communicate()}")
        try:
            steps, size = map(int, path.read_text().split())
        except (OSError, ValueError):
            steps, size = 0, 0
        if condition(steps, size):
            return
        time.sleep(0.1)
    raise AssertionError("the job made no progress in time")


def test_failing_discovery_script_is_a_one_line_error(marker):
    script = marker / "discover.sh"
    script.write_text("#!/bin/sh\necho 'cannot reach the scheduler' >&2\nexit 4\n")
    script.chmod(0o755)
    code, out, err, _ = run(["-np", "2", "--host-discovery-script", str(script),
                             sys.executable, TRAIN, str(marker)], timeout=30, env=_env())
    assert code == 2
    assert err.strip().splitlines() == [
        f"hvdlike-run: error: host discovery script '{script}' exited with code 4: "
        f"cannot reach the scheduler"]


def test_ctrl_c_stops_an_elastic_job(marker):
    progress = marker / "progress"
    proc = start(["-np", "2", "--min-np", "1", "-H", "127.0.0.1:1,127.0.0.2:1",
                  sys.executable, TRAIN, str(marker)],
                 env=_env(ELASTIC_STEP_SECONDS="0.5", ELASTIC_PROGRESS=str(progress)))
    try:
        _wait_progress(progress, lambda steps, size: steps >= 2, proc)
        proc.send_signal(signal.SIGINT)
        code, out, err = finish(proc, timeout=60)
    finally:
        kill_session(proc.pid)
    assert code == 130, err
    assert "received SIGINT; stopping 2 rank(s)" in err
    assert "job interrupted (SIGINT); every rank was stopped" in err
    assert "re-form" not in err  # stopping is not a failure to recover from


REGROW = """
    import os, signal, sys, time
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd
    here = os.path.dirname(os.path.abspath(__file__))
    a, b = hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 2])
    hvd.init(process_sets=[a, b])

    @hvd.elastic.run
    def train(state):
        while state.steps < 24:
            hvd.allreduce(torch.ones(1), name=f"g{state.steps}")
            if a.included():  # a stays registered through every generation
                got = hvd.allreduce(torch.ones(1), op=hvd.Sum, name=f"a{state.steps}",
                                    process_set=a).item()
                assert got == 2.0, got
            killed = os.path.join(here, "killed")
            if hvd.rank() == 2 and hvd.size() == 3 and state.steps == 3 \\
                    and not os.path.exists(killed):
                open(killed, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if hvd.rank() == 0 and hvd.size() == 2 and state.steps == 6:
                open(os.path.join(here, "grow"), "w").close()
            state.steps += 1
            if hvd.size() == 2:  # paced while the job waits to grow back
                time.sleep(0.1)
            state.commit()

    state = hvd.elastic.TorchState(model=torch.nn.Linear(2, 1), steps=0)
    train(state)
    print(f"END rank={hvd.rank()} size={hvd.size()} steps={state.steps} a={a.process_set_id} "
          f"b={b.process_set_id}", flush=True)
    hvd.shutdown()
"""


def test_a_job_with_process_sets_shrinks_and_grows_back(marker):
    # Survivors pass the sets they carried (the one naming a lost rank dropped);
    # the process started for the grown generation passes its script's init(): the
    # lists differ and every rank refused the generation. Rank 0's sets win now.
    script = write_script(marker, "regrow.py", REGROW)
    discover = marker / "discover.sh"
    discover.write_text(f"#!/bin/bash\necho 127.0.0.1:2\n[ -f {marker}/killed ] || echo 127.0.0.2:1\n"
                        f"[ -f {marker}/grow ] && echo 127.0.0.3:1\nexit 0\n")
    discover.chmod(0o755)
    code, out, err, _ = run(["-np", "3", "--min-np", "2", "--max-np", "3",
                             "--host-discovery-script", str(discover), sys.executable, script],
                            timeout=150, env=_env())
    assert code == 0, err[-4000:]
    assert "sizes 3 -> 2 -> 3" in err, err[-4000:]
    ends = re.findall(r"END rank=(\d) size=3 steps=24 a=(\S+) b=(\S+)", out)
    assert sorted(r for r, _, _ in ends) == ["0", "1", "2"], out
    assert {(x, y) for _, x, y in ends} == {("1", "None")}, out  # b is gone on every rank
    assert "is not registered in this elastic generation" in err, err[-4000:]


HANG_BEFORE_INIT = """
    import os, sys, time
    if os.environ["HVDLIKE_ELASTIC_WORKER"] == os.environ["HANG_WORKER"]:
        print("HANGING", os.environ["HVDLIKE_ELASTIC_WORKER"], flush=True)
        time.sleep(100)  # alive, but never reaches init()
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd
    began = time.monotonic()
    hvd.init()
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after").item()
    print(f"INIT worker={os.environ['HVDLIKE_ELASTIC_WORKER']} rank={hvd.rank()} "
          f"size={hvd.size()} sum={total:g} waited={time.monotonic() - began:.1f}", flush=True)
    hvd.shutdown()
"""


def test_a_member_that_never_reaches_init_is_dropped_not_the_one_waiting_for_it(marker):
    # w1 sleeps before init(). w0 waits for it for the start timeout (not the elastic
    # timeout plus a minute), reports it, and the launcher stops w1 and blacklists
    # its host -- not w0's, which goes on alone in generation 2.
    script = write_script(marker, "hang_init.py", HANG_BEFORE_INIT)
    code, out, err, seconds = run(
        ["-np", "2", "--min-np", "1", "--start-timeout", "3", "-H", "127.0.0.1:1,127.0.0.2:1",
         sys.executable, script], timeout=90, env=_env(HANG_WORKER="w1"))
    assert code == 0, err
    assert re.findall(r"INIT worker=(\w+) rank=(\d) size=(\d) sum=(\S+)", out) == [
        ("w0", "0", "1", "1")], out
    assert "member w1 (rank 1) on 127.0.0.2 did not arrive for generation 1 within 3s " \
           "(reported by w0); stopping it; host 127.0.0.2 blacklisted for the rest of the " \
           "job; re-forming" in err, err
    assert "host 127.0.0.1 blacklisted" not in err, err
    assert "generation 2: 1 rank(s) on 127.0.0.1:1" in err, err
    assert "lost rank 1 (generation 1) on host 127.0.0.2: did not arrive for generation 1 " \
           "within 3s" in err, err
    assert "exited with code" not in err, err
    print(f"job ended {seconds:.1f}s after start")


def test_a_late_member_on_a_host_shared_with_arrived_ones_loses_only_its_slot(marker):
    # One host: blacklisting it would stop the members that arrived as well. The start
    # timeout comes from the environment here (HVDLIKE_START_TIMEOUT), long enough for
    # w0 and w2 to arrive within it of each other on a loaded machine.
    script = write_script(marker, "hang_init.py", HANG_BEFORE_INIT)
    code, out, err, _ = run(
        ["-np", "3", "--min-np", "2", "-H", "localhost:3", sys.executable, script],
        timeout=90, env=_env(HANG_WORKER="w1", HVDLIKE_START_TIMEOUT="8"))
    assert code == 0, err
    assert sorted(re.findall(r"INIT worker=(\w+) rank=(\d) size=(\d) sum=(\S+)", out)) == [
        ("w0", "0", "2", "2"), ("w2", "1", "2", "2")], out
    assert "member w1 (rank 1) on localhost did not arrive for generation 1 within 8s" in err
    assert "its slot dropped (host localhost stays: members that arrived run there)" in err
    assert "blacklisted" not in err, err
    assert "generation 2: 2 rank(s) on localhost:2" in err, err
    assert "generation 3" not in err, err  # the dropped slot is not filled again
