"""hvdlike-run on localhost: a real job with collectives, output handling, dry run."""

import os

from .conftest import run, write_script

ALLREDUCE = """
    import sys
    import torch
    torch.set_num_threads(1)
    import hvdlike.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    print(f"rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
          f"cross={hvd.cross_rank()}/{hvd.cross_size()} sum={total.item():g}")
    print(f"note from {hvd.rank()}", file=sys.stderr)
    hvd.shutdown()
"""


def test_two_ranks_allreduce_with_prefixed_separate_streams(marker):
    script = write_script(marker, "job.py", ALLREDUCE)
    code, out, err, _ = run(["-np", "2", "python", script], timeout=90)
    assert code == 0, err
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:rank={rank} size=2 local={rank}/2 cross=0/1 sum=3" in out
        assert f"[{rank}]<stderr>:note from {rank}" in err
        assert f"note from {rank}" not in out
        assert f"rank={rank}" not in err


def test_output_filename_writes_one_log_per_rank(marker):
    script = write_script(marker, "job.py", """
        import os, sys
        print("out", os.environ["HVDLIKE_RANK"])
        print("err", os.environ["HVDLIKE_RANK"], file=sys.stderr)
    """)
    logs = marker / "logs"
    code, out, err, _ = run(["-np", "2", "--output-filename", str(logs), "python", script])
    assert code == 0, err
    for rank in (0, 1):
        assert (logs / f"rank.{rank}" / "stdout").read_text() == f"out {rank}\n"
        assert (logs / f"rank.{rank}" / "stderr").read_text() == f"err {rank}\n"



def test_output_files_keep_the_ranks_bytes(marker):
    # Not UTF-8, no newline at the end: the file holds what the rank wrote; the
    # terminal shows it with replacement characters.
    script = write_script(marker, "job.py", """
        import sys
        sys.stdout.buffer.write(b"caf\\xe9 \\xff\\xfe\\nlast")
    """)
    logs = marker / "logs"
    code, out, err, _ = run(["-np", "1", "--output-filename", str(logs), "python", script])
    assert code == 0, err
    assert (logs / "rank.0" / "stdout").read_bytes() == b"caf\xe9 \xff\xfe\nlast"
    assert "[0]<stdout>:last" in out


def test_knob_flags_and_environment_reach_ranks(marker):
    script = write_script(marker, "job.py", """
        import os
        keys = ["HVDLIKE_CYCLE_TIME", "HVDLIKE_FUSION_THRESHOLD", "MY_VAR", "HVDLIKE_STORE_ADDR",
                "HVDLIKE_GLOO_IFACE"]
        print(" ".join(os.environ.get(k, "-") for k in keys), os.getcwd())
    """)
    env = dict(os.environ, MY_VAR="kept value")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    code, out, err, _ = run(["-np", "1", "--cycle-time-ms", "3", "--fusion-threshold-mb", "1",
                             "--network-interface", "lo", "python", script], cwd=str(marker), env=env)
    assert code == 0, err
    assert f"[0]<stdout>:3 1048576 kept value 127.0.0.1 lo {marker}" in out


def test_dry_run_starts_nothing_and_hides_the_secret(marker):
    script = write_script(marker, "never.py", "open('ran', 'w').close()\n")
    code, out, err, _ = run(["-np", "2", "--dry-run", "python", script], cwd=str(marker))
    assert code == 0, err
    assert "rank 1 on localhost" in out and "HVDLIKE_JOB_SECRET=<hidden>" in out
    assert not (marker / "ran").exists()


def test_verbose_shows_commands_but_not_the_secret(marker):
    script = write_script(marker, "job.py", "import os; print(os.environ['HVDLIKE_JOB_SECRET'])\n")
    code, out, err, _ = run(["-np", "1", "--verbose", "python", script])
    assert code == 0, err
    secret = out.split("[0]<stdout>:", 1)[1].split()[0]
    assert len(secret) >= 32
    assert "launcher" in err and "remote.py" in err
    assert secret not in err


def test_check_build(marker):
    code, out, err, _ = run(["--check-build"])
    assert code == 0, err
    assert "[X] PyTorch" in out and "[X] Gloo" in out
    import importlib.metadata
    import importlib.util
    import shutil

    # Each engine is listed, and marked available exactly when it is there.
    def mark(ok):
        return "[X]" if ok else "[ ]"

    ray_here = importlib.util.find_spec("ray") is not None
    ray_line = next(line for line in out.splitlines() if "] Ray (" in line)
    assert ray_line.startswith(f"    {mark(ray_here)} Ray ("), out
    if ray_here:
        assert f"ray {importlib.metadata.version('ray')}" in ray_line
    srun = shutil.which("srun")
    assert f"{mark(srun)} Slurm ({srun or 'no srun on PATH'}" in out, out
    ssh = shutil.which("ssh")
    assert f"{mark(ssh)} ssh ({ssh or 'no ssh client on PATH'})" in out, out
    if os.environ.get("HVDLIKE_SHM") is None:
        shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        assert f"{mark(shm)} shared memory (" in out, out
    mpi_lines = [line for line in out.splitlines() if "] MPICH (" in line or "] Open MPI (" in line]
    mpi = importlib.util.find_spec("mpi4py") is not None and shutil.which("mpirun") is not None
    assert len(mpi_lines) == 2 and sum("[X]" in line for line in mpi_lines) == int(mpi), out
    train_line = next(line for line in out.splitlines() if "] Ray Train (" in line)
    # ray.train imports only with its extra's packages (importing it here would take seconds).
    train_deps = ray_here and all(importlib.util.find_spec(m) is not None
                                  for m in ("pandas", "pyarrow", "tensorboardX"))
    assert train_line.startswith(f"    {mark(train_deps)} Ray Train ("), train_line
    if not train_deps:
        assert "hvdlike[ray-train]" in train_line, train_line
