"""Reading a small text file a user names on the command line (config file, hostfile)."""

from __future__ import annotations

import os
import stat

from .errors import LaunchError


_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _check_regular(mode: int, where: str) -> None:
    if stat.S_ISDIR(mode):
        raise LaunchError(f"{where}: is a directory, not a file")
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "a special file")
        raise LaunchError(f"{where}: is {kind}, not a regular file")


def _check_size(size: int, where: str, max_bytes: int, what: str) -> None:
    if size > max_bytes:
        kib = f" ({max_bytes // 1024} KiB)" if max_bytes % 1024 == 0 else ""
        raise LaunchError(f"{where}: is larger than {max_bytes} bytes{kib}, "
                          f"the most {what} may hold")


def _os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def read_text(path, where: str, max_bytes: int, what: str) -> str:
    """The UTF-8 text of the regular file at ``path``, at most ``max_bytes`` long.

    ``where`` starts every error (the flag and the path); ``what`` names the file's
    kind in the size error ("the most a config file may hold").

    Raises:
        LaunchError: missing, not a regular file (a FIFO or a device is refused
            before it is opened, so nothing blocks), unreadable, too large, or
            not UTF-8.
    """
    try:
        # stat first: a FIFO or device is refused without being opened.
        _check_regular(os.stat(path).st_mode, where)
        # O_NONBLOCK: should the path be swapped for a FIFO now, open() still returns.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise LaunchError(f"{where}: no such file") from None
    except ValueError:  # e.g. a NUL byte in the name
        raise LaunchError(f"{where}: is not a valid file name") from None
    except OSError as exc:
        raise LaunchError(f"{where}: cannot be read: {_os_reason(exc)}") from None
    try:
        info = os.fstat(fd)
        _check_regular(info.st_mode, where)
        _check_size(info.st_size, where, max_bytes, what)
        chunks = []
        total = 0
        while total <= max_bytes:  # the file may grow after fstat: never read past the cap
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        _check_size(total, where, max_bytes, what)
    except OSError as exc:
        raise LaunchError(f"{where}: cannot be read: {_os_reason(exc)}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise LaunchError(f"{where}: is not UTF-8 text (invalid byte at line {line})") from None
