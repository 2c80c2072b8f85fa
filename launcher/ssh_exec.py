"""Starting a rank on another machine: the rank helper over OpenSSH.

The remote command line names only the interpreter and the helper module; the
rank's command, working directory and environment (with the job secret) follow
on ssh's stdin. ssh runs non-interactively (``BatchMode``) with a connect
timeout, and keep-alives so a vanished host ends the connection.
"""

from __future__ import annotations

import shlex
from typing import List, Optional, Sequence

from .launch_config import SshOptions

# sshd refuses new connections at random once ``MaxStartups`` (default 10:30:100)
# are still authenticating; ranks beyond the first SSH_BURST of a host start
# SSH_PACE_SECONDS apart so a many-slot host is not flooded.
SSH_BURST = 8
SSH_PACE_SECONDS = 0.1


def start_delay(index_on_host: int) -> float:
    """Seconds to wait before opening the ssh connection of the host's n-th rank."""
    return max(0, index_on_host - SSH_BURST + 1) * SSH_PACE_SECONDS
from .local_exec import helper_command


def ssh_command(host: str, ssh: SshOptions, remote_argv: Sequence[str]) -> List[str]:
    """The local ``ssh`` invocation that runs ``remote_argv`` on ``host``.

    Args:
        host: host name or address, optionally ``user@host``.
        ssh: port, identity file, timeouts and extra options.
        remote_argv: the command to run remotely; every word is shell-quoted.

    Example:
        >>> ssh_command("h1", SshOptions(port=2222), ["python", "-m", "x"])[-2:]
        ['h1', 'python -m x']
    """
    return ["ssh"] + ssh_options(ssh) + [host, " ".join(shlex.quote(word) for word in remote_argv)]


def ssh_options(ssh: SshOptions) -> List[str]:
    """The ssh arguments before the host name (shared with the mpirun launcher)."""
    argv: List[str] = []
    for option in ssh.options:  # first value wins in ssh, so user options go first
        argv += ["-o", option]
    argv += [
        "-o", "BatchMode=yes",
        "-o", f"ConnectTimeout={max(1, int(ssh.connect_timeout))}",
        "-o", "StrictHostKeyChecking=accept-new",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=3",
        "-T", "-x",
    ]
    if ssh.port:
        argv += ["-p", str(ssh.port)]
    if ssh.identity_file:
        argv += ["-i", ssh.identity_file]
    return argv


def remote_helper_command(host: str, ssh: SshOptions, python: str,
                          script: Optional[str] = None) -> List[str]:
    """``ssh ... host <python> <script>`` (or ``-m hvdlike.launcher.remote`` without a script)."""
    return ssh_command(host, ssh, helper_command(python, script))
