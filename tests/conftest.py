import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    """A SIGTERM (a CI timeout, ``kill``) stops the run like Ctrl-C.

    pytest then still runs its teardown: rank processes are killed by the
    harness and the network-namespace hosts are removed, so a terminated run
    leaves nothing behind.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"terminated by signal {signum}")

    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, interrupt)


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup`` (the README's command), keep each
    test file on one worker, so its module-scoped fixtures (a jax job, the
    Slurm cluster) run once, and every Ray test on the same worker, since they
    share one local Ray cluster per test package."""
    import pytest

    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = "ray" if "/ray/" in path or "ray" in path.rsplit("/", 1)[-1] else path
        item.add_marker(pytest.mark.xdist_group(group))
