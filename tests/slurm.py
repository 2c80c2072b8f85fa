"""A throwaway one-host Slurm cluster: munged, slurmctld and slurmd started as root.

Everything lives in a temporary directory: the munge key and socket, the
configuration (``slurm.conf``), state, spool and logs. Clients reach this
cluster through ``SLURM_CONF`` (see :meth:`Cluster.env`); the system's own
Slurm configuration, if any, is never read or touched. The node claims
:data:`CPUS` CPUs whatever the machine has (``SlurmdParameters=config_overrides``)
so a test can start 4 tasks on a 2-core machine. :meth:`Cluster.teardown` stops
the daemons by the pids it started and removes the directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

CPUS = 4
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "sinfo", "squeue", "scancel")


class Unavailable(Exception):
    """The machine cannot run the cluster (not root, Slurm missing, a daemon did not start)."""


def _find(name: str) -> Optional[str]:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None)


def why_unavailable() -> Optional[str]:
    """A reason the cluster cannot be started here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (slurmd and munged run as root)"
    for name in DAEMONS + CLIENTS:
        if _find(name) is None:
            return f"needs {name!r} (apt-get install -y slurm-wlm munge)"
    return None


def _free_ports(count: int) -> List[int]:
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


class Cluster:
    """One Slurm node (this host) with one partition, ``debug``."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="hvdlike-slurm-")
        self.node = socket.gethostname()
        self.conf = os.path.join(self.folder, "slurm.conf")
        self.munge_socket = os.path.join(self.folder, "munge.socket")
        self.procs: Dict[str, subprocess.Popen] = {}

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """An environment whose Slurm commands talk to this cluster."""
        env = dict(os.environ if base is None else base)
        for name in [k for k in env if k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))]:
            del env[name]
        env["SLURM_CONF"] = self.conf
        return env

    def _path(self, *parts: str) -> str:
        return os.path.join(self.folder, *parts)

    def _write_config(self) -> None:
        ctld_port, slurmd_port = _free_ports(2)
        for sub in ("state", "spool"):
            os.makedirs(self._path(sub), exist_ok=True)
        lines = [
            "ClusterName=hvdliketest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "KillWait=5",
            "InactiveLimit=0",
            f"StateSaveLocation={self._path('state')}",
            f"SlurmdSpoolDir={self._path('spool')}",
            f"SlurmctldPidFile={self._path('slurmctld.pid')}",
            f"SlurmdPidFile={self._path('slurmd.pid')}",
            f"SlurmctldLogFile={self._path('slurmctld.log')}",
            f"SlurmdLogFile={self._path('slurmd.log')}",
            f"PlugStackConfig={self._path('plugstack.conf')}",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self.conf, "w") as handle:
            handle.write("\n".join(lines) + "\n")
        open(self._path("plugstack.conf"), "w").close()

    def _start_munge(self) -> None:
        key = self._path("munge.key")
        with open(key, "wb") as handle:
            handle.write(os.urandom(1024))
        os.chmod(key, 0o400)
        argv = [_find("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={key}", f"--pid-file={self._path('munged.pid')}",
                f"--log-file={self._path('munged.log')}",
                f"--seed-file={self._path('munged.seed')}"]
        self._spawn("munged", argv)
        self._wait(lambda: os.path.exists(self.munge_socket), "munged", 20)

    def _spawn(self, name: str, argv: List[str]) -> None:
        # A daemon gets SIGTERM when the test process dies without tearing the
        # cluster down (a worker killed mid-fixture): it does not outlive the run.
        from hvdlike.launcher.mpi_exec import _parent_death_signal

        log = open(self._path(f"{name}.out"), "w")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env(), start_new_session=True,
                                            preexec_fn=_parent_death_signal())
        log.close()

    def _log(self, name: str) -> str:
        text = ""
        for suffix in (".out", ".log"):
            try:
                with open(self._path(name + suffix)) as handle:
                    text += handle.read()[-1500:]
            except OSError:
                pass
        return text.strip()

    def _wait(self, ready, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise Unavailable(f"{name} exited with {proc.returncode}: {self._log(name)}")
            if time.monotonic() > deadline:
                raise Unavailable(f"{name} not ready within {timeout:g}s: {self._log(name)}")
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        proc = subprocess.run([_find("sinfo"), "-h", "-N", "-o", "%T"], capture_output=True,
                              text=True, env=self.env(), timeout=20)
        return proc.returncode == 0 and proc.stdout.strip() in ("idle", "mixed", "allocated")

    def setup(self) -> "Cluster":
        """Start the daemons and wait for the node to be usable.

        Raises:
            Unavailable: a daemon failed (its log tail is in the message).
        """
        try:
            self._write_config()
            self._start_munge()
            self._spawn("slurmctld", [_find("slurmctld"), "-D", "-i", "-f", self.conf])
            self._spawn("slurmd", [_find("slurmd"), "-D", "-f", self.conf])
            self._wait(self._node_idle, "slurmd", 60)
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> None:
        """Stop the daemons this cluster started and delete its files."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.procs.clear()
        shutil.rmtree(self.folder, ignore_errors=True)
