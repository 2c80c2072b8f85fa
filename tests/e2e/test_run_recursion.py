"""hvdlike.run from a module without a __main__ guard does not start jobs recursively.

Each rank imports the module its function comes from to unpickle it; a module that
calls hvdlike.run when imported would, without a guard, make every rank start a job
of its own, and so on until the machine runs out of memory.
"""

import subprocess
import sys
import textwrap

from .conftest import kill_session, launcher_env

JOBS = """
    import hvdlike

    def work():
        return 7

    print("jobs.py imported", flush=True)
    RESULT = hvdlike.run(work, np=2)  # no __main__ guard
"""

MAIN = """
    try:
        import jobs
        print("result", jobs.RESULT)
    except Exception as exc:
        print("raised", type(exc).__name__, str(exc).replace("\\n", " "))
"""


def test_a_module_calling_run_at_import_fails_the_job_instead_of_recursing(marker):
    (marker / "jobs.py").write_text(textwrap.dedent(JOBS))
    (marker / "main.py").write_text(textwrap.dedent(MAIN))
    proc = subprocess.Popen([sys.executable, str(marker / "main.py")], cwd=str(marker),
                            env=launcher_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_session(proc.pid)
    # Imported by the caller and once by each of the two ranks: nobody went deeper.
    assert out.count("jobs.py imported") == 3, out
    raised = [line for line in out.splitlines() if line.startswith("raised ")]
    assert len(raised) == 1, out
    assert raised[0].startswith("raised RankError rank "), out
    assert ("hvdlike.run was called while a rank of another hvdlike.run job was loading its "
            "function: the module that defines the function calls hvdlike.run when it is "
            'imported; put that call under `if __name__ == "__main__":`') in raised[0], out
