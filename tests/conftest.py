import os
import re
import sys

import pytest

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


_SHARED_SCOPE = re.compile(r"scope=[\"'](module|package)[\"']")


def _worker_group(path: str, sources: dict):
    """The xdist group of the tests of ``path``, or None to hand them out one by one.

    A file that defines a module- or package-scoped fixture (a jax job, the
    one-host Slurm cluster: set up once, and the cluster cannot run twice at a
    time) keeps one worker; every Ray test shares one (one local Ray cluster per
    test package). Other files' tests spread over the workers, so a long file
    does not become one worker's long tail.
    """
    if "/ray/" in path or "ray" in path.rsplit("/", 1)[-1]:
        return "ray"
    if path not in sources:
        try:
            with open(os.path.join(ROOT, path)) as handle:
                sources[path] = bool(_SHARED_SCOPE.search(handle.read()))
        except OSError:
            sources[path] = True
    return path if sources[path] else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup`` (the README's command), keep the
    tests that share an expensive or exclusive fixture on one worker
    (``_worker_group``); the rest are handed out test by test.

    Runs before xdist's own hook of the same name, which reads the groups
    (as a suffix of each test's id) on the workers: marked after it, they
    would be ignored.
    """
    if not config.pluginmanager.hasplugin("xdist"):
        return
    sources: dict = {}
    for item in items:
        group = _worker_group(item.nodeid.split("::", 1)[0], sources)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
