"""mpirun command building for Open MPI and MPICH."""

import pytest

from hvdlike.launcher.errors import LaunchError
from hvdlike.launcher.hosts import HostSlots
from hvdlike.launcher.mpi_exec import MPICH, OPEN_MPI, flavour_of, mpirun_command

HOSTS = [HostSlots("h1", 2), HostSlots("h2", 2)]


@pytest.mark.parametrize("text, flavour", [
    ("mpirun (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/", OPEN_MPI),
    ("HYDRA build details:\n    Version: 4.1.2", MPICH),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.6", MPICH),
    ("something else", None),
])
def test_flavour_of(text, flavour):
    assert flavour_of(text) == flavour


def test_open_mpi_command():
    argv = mpirun_command(OPEN_MPI, 4, HOSTS, ["python", "train.py"], ["PATH", "HVDLIKE_CYCLE_TIME"],
                          ssh_args=["-p", "2222", "-i", "/k ey"], extra=["--oversubscribe"],
                          as_root=True)
    assert argv[:2] == ["mpirun", "--allow-run-as-root"]
    assert argv[argv.index("-np") + 1] == "4"
    assert argv[argv.index("-H") + 1] == "h1:2,h2:2"
    assert argv[argv.index("plm_rsh_args") + 1] == "-p 2222 -i '/k ey'"
    assert ["-x", "PATH"] == argv[argv.index("PATH") - 1:argv.index("PATH") + 1]
    assert "--tag-output" in argv and "--bind-to" in argv
    assert argv[-3:] == ["--oversubscribe", "python", "train.py"]


def test_open_mpi_forwards_names_not_values():
    argv = mpirun_command(OPEN_MPI, 2, HOSTS, ["python"], ["HVDLIKE_SECRET_LIKE"])
    assert "HVDLIKE_SECRET_LIKE" in argv
    assert not any("=" in word for word in argv)
    assert "--allow-run-as-root" not in argv


def test_mpich_command():
    argv = mpirun_command(MPICH, 4, HOSTS, ["python", "train.py"], ["PATH"],
                          ssh_wrapper="/tmp/x/ssh", extra=["-v"])
    assert argv[argv.index("-hosts") + 1] == "h1:2,h2:2"
    assert argv[argv.index("-np") + 1] == "4"
    assert "-genvall" in argv and "-x" not in argv and "-H" not in argv
    assert argv[argv.index("-launcher-exec") + 1] == "/tmp/x/ssh"
    assert argv[-3:] == ["-v", "python", "train.py"]


def test_mpich_without_ssh_options_uses_default_launcher():
    argv = mpirun_command(MPICH, 2, [HostSlots("localhost", 2)], ["python"], [])
    assert "-launcher-exec" not in argv


def test_unknown_flavour():
    with pytest.raises(LaunchError):
        mpirun_command("lam", 2, HOSTS, ["python"], [])


def test_allow_run_as_root_not_repeated_when_user_gave_it():
    argv = mpirun_command(OPEN_MPI, 2, HOSTS, ["python"], [], extra=["--allow-run-as-root"],
                          as_root=True)
    assert argv.count("--allow-run-as-root") == 1


def test_output_filename_becomes_hydras_file_patterns():
    argv = mpirun_command(MPICH, 2, [HostSlots("localhost", 2)], ["python"], [],
                          output_dir="/logs/run1")
    at = argv.index("-outfile-pattern")
    assert argv[at:at + 4] == ["-outfile-pattern", "/logs/run1/rank.%r/stdout",
                               "-errfile-pattern", "/logs/run1/rank.%r/stderr"]
    assert argv.index("-errfile-pattern") < argv.index("python")
    assert "-outfile-pattern" not in mpirun_command(OPEN_MPI, 2, [HostSlots("localhost", 2)],
                                                    ["python"], [], output_dir="/logs")


@pytest.mark.parametrize("extra, kept", [
    (["--bind-to", "core"], ["--map-by"]),
    (["-map-by", "node"], ["--bind-to"]),
    (["--map-by=ppr:1:node", "--bind-to=socket"], []),
    (["--oversubscribe"], ["--bind-to", "--map-by"]),
])
def test_the_users_binding_or_mapping_replaces_the_default(extra, kept):
    # Open MPI 5 refuses --bind-to or --map-by given twice: --binding-args and
    # --mpi-args must replace the launcher's defaults, as under horovodrun.
    argv = mpirun_command(OPEN_MPI, 2, HOSTS, ["python", "t.py"], [], extra=extra)
    assert argv[-len(extra) - 2:] == extra + ["python", "t.py"]
    defaults = argv[:-len(extra) - 2]
    for option in ("--bind-to", "--map-by"):
        assert (option in defaults) == (option in kept)
        assert sum(a.lstrip("-").split("=")[0] == option.lstrip("-") for a in argv) == 1
