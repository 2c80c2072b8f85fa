"""Which engine carries negotiation and CPU tensors (no processes, no MPI job)."""

import pytest

from hvdlike.core import config, mpi_plane
from hvdlike.core.errors import ConfigError


def test_auto_is_gloo_when_not_started_by_mpirun():
    assert mpi_plane.choose("auto", "auto", "torchrun", 0, 2, {}) == ("gloo", "gloo")
    assert mpi_plane.choose("gloo", "auto", "hvdlike-run", 1, 4, {}) == ("gloo", "gloo")


def test_a_single_process_stays_on_gloo_even_under_mpirun():
    assert mpi_plane.choose("auto", "auto", "mpirun (MPICH)", 0, 1, {"PMI_RANK": "0"}) == (
        "gloo", "gloo")


@pytest.mark.parametrize("controller,cpu,knob", [
    ("mpi", "auto", "HVDLIKE_CONTROLLER=mpi"),
    ("auto", "mpi", "HVDLIKE_CPU_OPERATIONS=mpi"),
])
def test_explicit_mpi_without_mpirun_is_a_clear_error(controller, cpu, knob):
    with pytest.raises(ConfigError) as info:
        mpi_plane.choose(controller, cpu, "torchrun", 0, 2, {})
    message = str(info.value)
    assert knob in message and "torchrun" in message and "mpirun" in message


def test_mpirun_variables_count_even_when_torchrun_variables_won_the_bootstrap(monkeypatch):
    # A script under mpirun that also exports RANK/MASTER_ADDR bootstraps as
    # torchrun, yet MPI is there: auto still asks MPI (here: a world of one
    # process, so the job's 2 ranks do not match and auto falls back).
    pytest.importorskip("mpi4py")
    assert mpi_plane.choose("auto", "auto", "torchrun", 0, 2, {"PMI_RANK": "0"}) == (
        "gloo", "gloo")
    with pytest.raises(ConfigError, match="COMM_WORLD has rank 0 of 1 where the job has rank 0 of 2"):
        mpi_plane.choose("mpi", "auto", "torchrun", 0, 2, {"PMI_RANK": "0"})


@pytest.mark.parametrize("var", ["HVDLIKE_CONTROLLER", "HOROVOD_CPU_OPERATIONS"])
def test_engine_knobs_reject_unknown_engines(var):
    with pytest.raises(ConfigError) as info:
        config.load({var: "ccl"})
    assert var in str(info.value) and "'ccl'" in str(info.value) and "auto, gloo, mpi" in str(
        info.value)


def test_engine_knobs_accept_any_case():
    cfg = config.load({"HOROVOD_CONTROLLER": "MPI", "HVDLIKE_CPU_OPERATIONS": "Gloo"})
    assert (cfg.controller, cfg.cpu_operations) == ("mpi", "gloo")
