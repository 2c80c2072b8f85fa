"""The rank side of ``hvdlike.run``: ``python -m hvdlike.launcher.task``.

Reads the sealed ``(fn, args, kwargs)`` from the job's store, refuses it unless
its HMAC matches the job secret, runs it, and stores the sealed outcome under
this rank's result key. Exit status 0 when ``fn`` returned, 1 when it raised
(the caller gets the exception), 3 when the payload was refused.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

from hvdlike.core.topology import (
    ENV_JOB_SECRET, ENV_RANK, ENV_SIZE, ENV_STORE_ADDR, ENV_STORE_PORT,
)

from .payload import (
    MAX_BLOB_BYTES, PAYLOAD_KEY, PayloadError, get, put, result_key, seal, unseal,
)

REFUSED = 3
LOADING_ENV = "HVDLIKE_RUN_LOADING"  # set while this rank unpickles its function


def _store(timeout_seconds: float):
    import torch.distributed as dist

    from hvdlike.core.store_auth import AuthenticatedStore

    store = dist.TCPStore(
        os.environ[ENV_STORE_ADDR], int(os.environ[ENV_STORE_PORT]),
        int(os.environ[ENV_SIZE]), False,
        timeout=datetime.timedelta(seconds=timeout_seconds),
    )
    return AuthenticatedStore(store, os.environ[ENV_JOB_SECRET], MAX_BLOB_BYTES)


def _outcome(fn, args, kwargs):
    try:
        return {"ok": True, "value": fn(*args, **(kwargs or {}))}
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                   "traceback": traceback.format_exc()}
        try:
            import cloudpickle

            cloudpickle.dumps(exc)
            outcome["exception"] = exc
        except Exception:  # unpicklable exceptions travel as text only
            pass
        return outcome


def main() -> int:
    secret = os.environ.get(ENV_JOB_SECRET, "")
    rank = int(os.environ.get(ENV_RANK, "0"))
    from hvdlike.core import config

    from hvdlike.core.job_secret import StoreTamperedError

    if not secret:
        sys.stderr.write(f"hvdlike.run: rank {rank} has no job secret; refusing to run\n")
        return REFUSED
    store = _store(config.load(os.environ).start_timeout)
    try:
        # Unpickling imports the modules fn and its arguments come from; one that
        # calls hvdlike.run at import time (no __main__ guard) must not start a
        # job of its own from here, and so on down (see launcher/api.py: run).
        os.environ[LOADING_ENV] = "1"
        try:
            fn, args, kwargs = unseal(secret, "payload", get(store, PAYLOAD_KEY))
        finally:
            os.environ.pop(LOADING_ENV, None)
    except (PayloadError, StoreTamperedError) as exc:
        sys.stderr.write(f"hvdlike.run: rank {rank} refused its payload: {exc}\n")
        return REFUSED
    except Exception as exc:  # authentic, but this rank cannot rebuild it (a missing module)
        outcome = {"ok": False, "type": type(exc).__name__,
                   "message": f"rank {rank} could not unpickle the function or its arguments "
                              f"({exc}); modules they come from must be importable on every "
                              f"rank", "traceback": traceback.format_exc()}
    else:
        outcome = _outcome(fn, args, kwargs)
    try:
        blob = seal(secret, f"result/{rank}", outcome)
        if len(blob) > MAX_BLOB_BYTES:
            raise PayloadError(f"it pickles to {len(blob)} bytes, more than the "
                               f"{MAX_BLOB_BYTES} bytes hvdlike.run carries")
    except Exception as exc:  # the return value cannot be pickled, or is too big
        what = "is too big" if isinstance(exc, PayloadError) else "cannot be pickled"
        outcome = {"ok": False, "type": type(exc).__name__,
                   "message": f"the return value of rank {rank} {what}: {exc}",
                   "traceback": ""}
        blob = seal(secret, f"result/{rank}", outcome)
    put(store, result_key(rank), blob)
    return 0 if outcome["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
