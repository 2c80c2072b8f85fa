"""Opening the files a job writes, safely in a shared folder.

``--output-filename``'s ``DIR/rank.N/{stdout,stderr}``, the timeline and the
autotune log are opened without following a symbolic link and without
blocking, and must be regular files: a link planted in a folder others can
write (``/tmp``) would otherwise make the job overwrite the file it points to,
and a FIFO would block whoever opens it.
"""

from __future__ import annotations

import errno
import os
import stat


def open_output_file(path: str, truncate: bool = True, create: bool = True,
                     read: bool = False) -> int:
    """A descriptor open for writing on the regular file ``path``.

    ``truncate``: empty it (a fresh file), else append to it; ``create``: make
    it when missing (else a missing file is ``FileNotFoundError``); ``read``:
    open it for reading and writing at its start instead (neither truncated
    nor appended: the caller seeks).

    Raises:
        OSError: naming ``path``, also when it is a symbolic link or not a regular file.
    """
    flags = ((os.O_RDWR if read else os.O_WRONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
             | os.O_CLOEXEC | (os.O_CREAT if create else 0))
    if not read:
        flags |= os.O_TRUNC if truncate else os.O_APPEND
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
