"""Shared-memory segment names in /dev/shm, for the cleanup checks of several test tiers."""

import os


def created_by(pids):
    """Segments in /dev/shm created by one of ``pids`` (a set's member 0 creates them).

    Names end ``-<creator pid>-<n>-<random>``. Counting only a test's own
    ranks keeps the check true while tests running alongside create and
    drop segments of their own.
    """
    pids = {str(p) for p in pids}
    names = set()
    for name in os.listdir("/dev/shm"):
        parts = name.rsplit("-", 3)
        if name.startswith("hvdlike-") and len(parts) == 4 and parts[1] in pids:
            names.add(name)
    return names
