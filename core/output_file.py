"""Opening the files a job writes, safely in a shared folder.

``--output-filename``'s ``DIR/rank.N/{stdout,stderr}``, the timeline and the
autotune log are opened without following a symbolic link and without
blocking, and must be regular files: a link planted in a folder others can
write (``/tmp``) would otherwise make the job overwrite the file it points to,
and a FIFO would block whoever opens it.

``O_NOFOLLOW`` protects the last component only, so the folders on the way are
walked one at a time, each opened relative to the one before without following
a link (``O_NOFOLLOW | O_DIRECTORY``) and created there when asked
(``mkdir`` relative to its parent), never by their textual path. On the way:

* a symbolic link is followed only where the kernel's ``fs.protected_symlinks``
  rule would follow it: not one in a sticky, world-writable folder (``/tmp``)
  owned by neither that folder's owner nor the current (effective) user -- what
  the kernel refuses when the rule is on, refused here when it is off;
* the names hvdlike picks itself (``rank.N``, the file) are never followed when
  they are links, whoever made them.

Refusals are :class:`UnsafeOutputPath` (an ``OSError``) naming the component and
why. What stays open: see docs/security.md ("Files the job writes").
"""

from __future__ import annotations

import errno
import os
import stat
from typing import List, Optional, Tuple

MAX_LINKS = 40  # the kernel's limit on symbolic links followed in one lookup
# O_PATH: a folder only searchable (mode --x) can still be walked through.
_FOLDER = (getattr(os, "O_PATH", 0) or os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW \
    | os.O_CLOEXEC
_STICKY_SHARED = stat.S_ISVTX | stat.S_IWOTH


class UnsafeOutputPath(PermissionError):
    """A component of an output path that another user controls; ``component``
    is its path, ``strerror`` the whole explanation (it starts with the path)."""

    def __init__(self, component: str, why: str):
        super().__init__(errno.EACCES, f"{component} {why}")
        self.component = component

    def __str__(self) -> str:
        return self.strerror


def _who(uid: int) -> str:
    try:
        import pwd

        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _check_link(parent_fd: int, parent_shown: str, link: os.stat_result, shown: str) -> None:
    """Refuse a symbolic link the kernel's ``fs.protected_symlinks`` rule would not follow."""
    if link.st_uid == os.geteuid():
        return  # the user's own link
    parent = os.fstat(parent_fd)
    if parent.st_mode & _STICKY_SHARED != _STICKY_SHARED or link.st_uid == parent.st_uid:
        return
    raise UnsafeOutputPath(
        shown, f"is a symbolic link owned by {_who(link.st_uid)} in {parent_shown}, a sticky "
               f"world-writable folder owned by {_who(parent.st_uid)}: another user's link "
               "there could point anywhere; refusing to follow it (as the kernel does "
               "with fs.protected_symlinks on)")


def _check_planted(parent: os.stat_result, parent_shown: str, found: os.stat_result,
                   shown: str) -> None:
    """Refuse a regular file another user may have put at an output name: one
    with more than one name (a hard link, made to another file while the
    kernel's ``fs.protected_hardlinks`` rule is off) in a folder others can
    write, and another user's file in a sticky world-writable folder (what the
    ``fs.protected_regular`` rule refuses when it is on)."""
    me = os.geteuid()
    shared = parent.st_uid != me or parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if found.st_nlink > 1 and shared:
        raise UnsafeOutputPath(
            shown, f"has {found.st_nlink} names (hard links) and is in {parent_shown}, a "
                   f"folder other users can write: it may be another file under a second "
                   f"name; refusing to write it")
    if parent.st_mode & _STICKY_SHARED == _STICKY_SHARED \
            and found.st_uid not in (me, parent.st_uid):
        raise UnsafeOutputPath(
            shown, f"is a file owned by {_who(found.st_uid)} in {parent_shown}, a sticky "
                   f"world-writable folder owned by {_who(parent.st_uid)}: another user's "
                   f"file there; refusing to write it")


def _join(shown: str, name: str) -> str:
    return os.path.join(shown, name) if shown else name


def _components(path: str) -> List[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _walk(path: str, make: bool, own_names: int) -> Tuple[int, str]:
    """A descriptor on the folder ``path`` (``O_PATH``) and its path as shown in errors.

    ``make``: create missing folders (one at a time, each in the folder opened
    before it). ``own_names``: how many trailing components hvdlike named itself
    (``rank.N``): never followed as links. Raises ``OSError`` naming the component that failed.
    """
    parts = _components(path)
    guarded_from = len(parts) - own_names
    # (name, index in ``parts``; None for a component of a link's target)
    pending: List[Tuple[str, Optional[int]]] = list(zip(parts, range(len(parts))))
    shown = "/" if path.startswith("/") else ""
    fd = os.open("/" if path.startswith("/") else ".", _FOLDER)
    links = 0
    try:
        while pending:
            name, index = pending.pop(0)
            here = _join(shown, name)
            guarded = index is not None and index >= guarded_from
            try:
                try:
                    found = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    if not make or index is None:
                        raise
                    try:
                        os.mkdir(name, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass  # made meanwhile: looked at below like any other
                    found = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(found.st_mode):
                    if guarded:
                        raise UnsafeOutputPath(here, "is a symbolic link; refusing to follow it")
                    _check_link(fd, shown or ".", found, here)
                    links += 1
                    if links > MAX_LINKS:
                        raise OSError(errno.ELOOP, "too many levels of symbolic links")
                    target = os.readlink(name, dir_fd=fd)
                    pending[:0] = [(part, None) for part in _components(target)]
                    if target.startswith("/"):
                        os.close(fd)
                        fd = -1
                        fd = os.open("/", _FOLDER)
                        shown = "/"
                    continue
                try:
                    child = os.open(name, _FOLDER, dir_fd=fd)
                except OSError as exc:
                    if exc.errno != errno.ELOOP:
                        raise
                    # Swapped for a link since it was looked at: look again.
                    links += 1
                    if links > MAX_LINKS:
                        raise
                    pending.insert(0, (name, index))
                    continue
            except UnsafeOutputPath:
                raise
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, here) from None
            os.close(fd)
            fd, shown = child, here
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    return fd, shown or "."


def output_folder(path: str, make: bool = False, own_names: int = 0) -> None:
    """Check (``make``: create) the folder ``path`` that hvdlike will write files
    into, as :func:`open_output_file` walks to it; ``own_names``: how many of its
    trailing components hvdlike named itself (``rank.N``: 1).

    Raises:
        UnsafeOutputPath: a link on the way another user controls.
        OSError: naming the component, when it is missing (``make`` off) or not
            a folder.
    """
    fd, _ = _walk(path, make, own_names)
    os.close(fd)


def open_output_file(path: str, truncate: bool = True, create: bool = True,
                     read: bool = False, make_folders: bool = False, own_names: int = 1) -> int:
    """A descriptor open for writing on the regular file ``path``.

    ``truncate``: empty it (a fresh file), else append to it; ``create``: make
    it when missing (else a missing file is ``FileNotFoundError``); ``read``:
    open it for reading and writing at its start instead (neither truncated
    nor appended: the caller seeks); ``make_folders``: create the missing
    folders on the way; ``own_names``: how many trailing components of ``path``
    hvdlike named itself (the file: 1; ``rank.N/stdout``: 2) -- see the module
    docstring.

    Raises:
        UnsafeOutputPath: a link on the way another user controls.
        OSError: naming ``path`` (or the folder on the way that failed), also
            when it is a symbolic link or not a regular file.
    """
    folder, name = os.path.split(path)
    if not name:
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    flags = ((os.O_RDWR if read else os.O_WRONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
             | os.O_CLOEXEC | (os.O_CREAT if create else 0))
    if not read and not truncate:
        flags |= os.O_APPEND
    dir_fd, folder_shown = _walk(folder, make_folders, max(own_names - 1, 0))
    try:
        parent = os.fstat(dir_fd)
        fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
    except UnsafeOutputPath:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link; refusing to follow it",
                          path) from None
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads
            raise OSError(errno.ENXIO, "is a FIFO, not a regular file", path) from None
        raise OSError(exc.errno, exc.strerror, path) from None
    finally:
        os.close(dir_fd)
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, "is not a regular file", path)
        _check_planted(parent, folder_shown or ".", found, path)
        if truncate and not read:  # only once it is known to be ours to empty
            os.ftruncate(fd, 0)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
