"""A throwaway two-host cluster on one machine: network namespaces running sshd.

Layout (``<t>`` is a per-run tag)::

    root namespace: bridge hvbr<t> 10.x.y.1/24   <- hvdlike-run runs here
      |- veth hvv<t>1 == eth0 in namespace hvns<t>-1: 10.x.y.11, sshd on :22
      |- veth hvv<t>2 == eth0 in namespace hvns<t>-2: 10.x.y.12, sshd on :22

Each namespace is a host with its own address; processes share the file system,
so the same Python and checkout are "installed" on both. A throwaway key pair
and host key live in a temporary directory. :meth:`Cluster.teardown` kills every
process in the namespaces and deletes them, the bridge and the files.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import List, Optional


class Unavailable(Exception):
    """The machine cannot host the cluster (not root, no ip, no sshd...)."""


def _run(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc


def find_sshd() -> Optional[str]:
    return shutil.which("sshd") or next(
        (p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.access(p, os.X_OK)), None)


def why_unavailable() -> Optional[str]:
    """A reason the cluster cannot be built here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command"
    if find_sshd() is None:
        return "needs sshd (apt-get install -y openssh-server)"
    return None


def _free_subnet(seed: int) -> str:
    """A 10.x.y /24 (as "10.x.y") that no local address or route uses yet.

    Seeded by the pid so concurrent test sessions pick different ones.
    """
    used = _run("ip", "-4", "addr", check=False).stdout + _run("ip", "-4", "route", check=False).stdout
    for attempt in range(64):
        n = (seed + attempt * 7919) % 32000
        prefix = f"10.{128 + n // 250}.{n % 250}"
        if prefix + "." not in used:
            return prefix
    raise Unavailable("no free 10.x.y.0/24 subnet for the test network")


class Cluster:
    """Two namespace hosts reachable over ssh from the root namespace."""

    def __init__(self, hosts: int = 2):
        self.tag = f"{os.getpid() % 100000}"
        self.subnet = _free_subnet(os.getpid())
        self.bridge = f"hvbr{self.tag}"
        self.bridge_ip = f"{self.subnet}.1"
        self.namespaces = [f"hvns{self.tag}-{i}" for i in range(1, hosts + 1)]
        self.ips = [f"{self.subnet}.{10 + i}" for i in range(1, hosts + 1)]
        self.unused_ip = f"{self.subnet}.99"
        self.folder = tempfile.mkdtemp(prefix="hvdlike-netns-")
        self.key = os.path.join(self.folder, "id_ed25519")
        self._sshd: List[subprocess.Popen] = []

    # -- building -----------------------------------------------------------------

    def setup(self) -> "Cluster":
        try:
            self._keys()
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for index, (ns, ip) in enumerate(zip(self.namespaces, self.ips), start=1):
                outer = f"hvv{self.tag}{index}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _run("ip", "link", "set", outer, "master", self.bridge)
                _run("ip", "link", "set", outer, "up")
                self.ns_exec(ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
                self.ns_exec(ns, "ip", "link", "set", "eth0", "up")
                self.ns_exec(ns, "ip", "link", "set", "lo", "up")
                self._start_sshd(index, ns, ip)
            for ip in self.ips:
                self._wait_for_ssh(ip)
        except Exception:
            self.teardown()
            raise
        return self

    def ns_exec(self, ns: str, *argv: str) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", ns, *argv)

    def _keys(self) -> None:
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
             os.path.join(self.folder, "host_ed25519"))
        shutil.copy(self.key + ".pub", os.path.join(self.folder, "authorized_keys"))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir

    def _start_sshd(self, index: int, ns: str, ip: str) -> None:
        config = os.path.join(self.folder, f"sshd_config.{index}")
        with open(config, "w") as handle:
            handle.write(
                f"ListenAddress {ip}:22\n"
                f"HostKey {self.folder}/host_ed25519\n"
                f"AuthorizedKeysFile {self.folder}/authorized_keys\n"
                f"PidFile {self.folder}/sshd.{index}.pid\n"
                "PermitRootLogin prohibit-password\n"
                "PubkeyAuthentication yes\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                "PrintMotd no\nX11Forwarding no\nMaxStartups 100\nMaxSessions 100\n"
                "LogLevel ERROR\n"
            )
        log = open(os.path.join(self.folder, f"sshd.{index}.log"), "w")
        self._sshd.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, find_sshd(), "-D", "-e", "-f", config],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    # Throwaway hosts: do not check or record their host keys.
    SSH_OPTIONS = ("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR")

    def ssh_options(self) -> List[str]:
        """hvdlike-run flags that reach the namespace hosts with the throwaway key."""
        flags = ["-i", self.key]
        for option in self.SSH_OPTIONS:
            flags += ["--ssh-option", option]
        return flags

    def _wait_for_ssh(self, ip: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        argv = ["ssh", "-i", self.key, "-o", "StrictHostKeyChecking=no", "-o",
                "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "ConnectTimeout=2",
                "-o", "LogLevel=ERROR", ip, "true"]
        while True:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            if proc.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {ip} did not answer: {proc.stderr.strip()}")
            time.sleep(0.3)

    # -- inspecting ---------------------------------------------------------------

    def pids(self, ns: str) -> List[int]:
        """Processes running in ``ns`` (sshd included)."""
        proc = _run("ip", "netns", "pids", ns, check=False)
        return [int(p) for p in proc.stdout.split()]

    def daemon_pids(self) -> List[int]:
        """The listening sshd of each namespace."""
        found = []
        for index in range(1, len(self.namespaces) + 1):
            try:
                with open(os.path.join(self.folder, f"sshd.{index}.pid")) as handle:
                    found.append(int(handle.read().strip()))
            except (OSError, ValueError):
                pass
        return found + [p.pid for p in self._sshd]

    def stray_pids(self) -> List[int]:
        """Processes in any namespace other than the sshd daemons."""
        daemons = set(self.daemon_pids())
        return [pid for ns in self.namespaces for pid in self.pids(ns) if pid not in daemons]

    def wait_until_clean(self, timeout: float = 20) -> List[int]:
        """Wait for every non-daemon process in the namespaces to end; return survivors."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.stray_pids()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    # -- tearing down ---------------------------------------------------------------

    def teardown(self) -> None:
        for ns in self.namespaces:
            for pid in self.pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._sshd:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait(timeout=10)
        # Deleting a veth's outer end removes both ends at once; a namespace may
        # outlive its name for a while (the kernel frees it once its last sockets
        # are gone), and its cable must not linger with it.
        for index in range(1, len(self.namespaces) + 1):
            _run("ip", "link", "del", f"hvv{self.tag}{index}", check=False)
        for ns in self.namespaces:
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.folder, ignore_errors=True)
