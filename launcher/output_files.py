"""Opening the files ``--output-filename`` writes, safely in a shared folder.

``DIR/rank.N/{stdout,stderr}`` are opened without following a symbolic link
and without blocking, and must be regular files: a link planted in a folder
others can write would otherwise make the launcher overwrite the file it points
to, and a FIFO would block the launcher before any rank starts.
"""

from __future__ import annotations

import errno
import os
import stat


def open_output_file(path: str, truncate: bool = True) -> int:
    """A descriptor open for writing on the regular file ``path`` (created if missing).

    ``truncate``: empty it (the rank's output starts afresh), else append.

    Raises:
        OSError: naming ``path``, also when it is a symbolic link or not a regular file.
    """
    flags = (os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
             | (os.O_TRUNC if truncate else os.O_APPEND))
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link; refusing to follow it",
                          path) from None
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads
            raise OSError(errno.ENXIO, "is a FIFO, not a regular file", path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "is not a regular file", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
