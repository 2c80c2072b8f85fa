"""The rank side of ``hvdlike.run``: ``python -m hvdlike.launcher.task``.

Reads the sealed ``(fn, args, kwargs)`` from the job's store, refuses it unless
its HMAC matches the job secret, runs it, and stores the sealed outcome under
this rank's result key. Exit status 0 when ``fn`` returned, 1 when it raised
(the caller gets the exception), 3 when the payload was refused. A refusal is also
recorded in the store (:func:`~.payload.refusal_key`, sealed like a result): that
record, not the exit status (which ``fn`` can produce too), is what the caller
reports as a refusal.

The outcome holds the return value pickled on its own, and for an exception its
type name, message and traceback as text, plus the exception pickled on its own
when it unpickles again here: the caller can always read the text, and reports a
value or exception it cannot rebuild without losing the rest.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback

from hvdlike.core.topology import (
    ENV_HOSTNAME, ENV_JOB_SECRET, ENV_RANK, ENV_SIZE, ENV_STORE_ADDR, ENV_STORE_PORT,
)

from .payload import (
    EXCEPTION_PICKLE, MAX_BLOB_BYTES, PAYLOAD_KEY, VALUE_PICKLE, PayloadError, get, put,
    refusal_key, refusal_purpose, result_key, result_purpose, seal, unseal,
)

REFUSED = 3
LOADING_ENV = "HVDLIKE_RUN_LOADING"  # set while this rank unpickles its function
# Under ``hvdlike.run(..., use_mpi=True)`` mpirun starts the ranks: the launcher's
# store is named by these (not the job's own variables, which would make the
# runtime inside ``fn`` think hvdlike-run started it); both are removed from the
# environment before ``fn`` runs.
RUN_STORE_ENV = "HVDLIKE_RUN_STORE"
RUN_SECRET_ENV = "HVDLIKE_RUN_SECRET"


def _store(addr: str, port: int, size: int, secret: str, timeout_seconds: float):
    from hvdlike.core.job_store import client
    from hvdlike.core.store_auth import AuthenticatedStore

    store = client(addr, port, size, datetime.timedelta(seconds=timeout_seconds))
    return AuthenticatedStore(store, secret, MAX_BLOB_BYTES)


def _placement():
    """``(secret, rank, store address, port, size)`` of this rank, from hvdlike-run's
    variables or, under mpirun, from MPI's and the launcher's ``HVDLIKE_RUN_*``."""
    via = os.environ.pop(RUN_STORE_ENV, None)
    if via is None:
        return (os.environ.get(ENV_JOB_SECRET, ""), int(os.environ.get(ENV_RANK, "0")),
                os.environ.get(ENV_STORE_ADDR, ""), int(os.environ.get(ENV_STORE_PORT, "0")),
                int(os.environ.get(ENV_SIZE, "1")))
    from hvdlike.core.mpi_bootstrap import MPI_FLAVOURS

    secret = os.environ.pop(RUN_SECRET_ENV, "")
    addr, _, port = via.rpartition(":")
    for _name, rank_var, size_var in MPI_FLAVOURS:
        if rank_var in os.environ:
            return (secret, int(os.environ[rank_var]), addr, int(port),
                    int(os.environ.get(size_var, "1")))
    return secret, 0, addr, int(port), 1


def _result_place(rank: int):
    """``(rank, generation)`` to file the outcome under: in an elastic job the
    rank of the generation this process ended in (re-forms renumber ranks)."""
    from hvdlike.core.elastic.protocol import ENV_GENERATION

    generation = os.environ.get(ENV_GENERATION)
    if not generation:
        return rank, None
    return int(os.environ.get(ENV_RANK, rank)), int(generation)


def _outcome(fn, args, kwargs):
    try:
        return {"ok": True, "value": fn(*args, **(kwargs or {}))}
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return {"ok": False, "type": "SystemExit", "traceback": traceback.format_exc(),
                    "message": f"fn called sys.exit({exc.code!r})"}
        # Status 0: this process left the job (an elastic rank with no seat in the
        # newest generation, or a script's own sys.exit()): no result, no failure.
        return {"ok": False, "left": True, "type": "SystemExit", "traceback": "",
                "message": "fn ended with sys.exit(0) (the process left the job) "
                           "without returning a result"}
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        outcome = {"ok": False, "type": type(exc).__name__, "message": _text_of(exc),
                   "traceback": traceback.format_exc()}
        pickled = _round_trip(exc)
        if pickled is not None:  # otherwise it travels as text only
            outcome[EXCEPTION_PICKLE] = pickled
        return outcome


def _text_of(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as failure:  # noqa: BLE001 - a broken __str__ must not lose the error
        return f"<str() of the exception failed: {type(failure).__name__}>"


def _round_trip(exc: BaseException):
    """``exc`` pickled, when those bytes also unpickle into an exception here; else
    None. An exception can pickle and still not unpickle: a class whose
    ``__init__`` takes arguments its ``args`` do not give back, a ``__reduce__``
    that fails when called."""
    import pickle

    import cloudpickle

    try:
        data = cloudpickle.dumps(exc)
        return data if isinstance(pickle.loads(data), BaseException) else None
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: BLE001 - whatever fails (sys.exit too), the text goes back
        return None


def _record_refusal(store, secret: str, rank: int, reason: str) -> None:
    """Tell the caller this rank refused its payload (best effort: the exit status
    and the line on stderr remain when the store cannot take it)."""
    rank, generation = _result_place(rank)
    try:
        put(store, refusal_key(rank, generation),
            seal(secret, refusal_purpose(rank, generation), reason[:2000]))
    except Exception as exc:  # noqa: BLE001 - the refusal itself must still end the rank
        sys.stderr.write(f"hvdlike.run: rank {rank} could not record its refusal: {exc}\n")


def main() -> int:
    try:
        secret, rank, addr, port, size = _placement()
    except ValueError as exc:  # started by hand, or with its variables mangled
        sys.stderr.write(f"hvdlike.run: this rank's launch variables are malformed ({exc}); "
                         "refusing to run\n")
        return REFUSED
    from hvdlike.core import config

    from hvdlike.core.job_secret import StoreTamperedError

    if not secret:
        sys.stderr.write(f"hvdlike.run: rank {rank} has no job secret; refusing to run\n")
        return REFUSED
    try:
        store = _store(addr, port, size, secret, config.load(os.environ).start_timeout)
    except (OSError, RuntimeError) as exc:  # DistNetworkError is a RuntimeError
        sys.stderr.write(f"hvdlike.run: rank {rank} could not reach the launcher's store at "
                         f"{addr}:{port}: {exc}\n")
        return REFUSED
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
        _record_refusal(store, secret, rank, str(exc))
        return REFUSED
    except Exception as exc:  # authentic, but this rank cannot rebuild it (a missing module)
        outcome = {"ok": False, "type": type(exc).__name__,
                   "message": f"rank {rank} could not unpickle the function or its arguments "
                              f"({exc}); modules they come from must be importable on every "
                              f"rank", "traceback": traceback.format_exc()}
    else:
        outcome = _outcome(fn, args, kwargs)
    rank, generation = _result_place(rank)
    outcome["host"] = os.environ.get(ENV_HOSTNAME) or socket.gethostname()
    purpose = result_purpose(rank, generation)
    try:
        if "value" in outcome:  # pickled on its own (see payload.VALUE_PICKLE)
            import cloudpickle

            outcome[VALUE_PICKLE] = cloudpickle.dumps(outcome.pop("value"))
        blob = seal(secret, purpose, outcome)
        if len(blob) > MAX_BLOB_BYTES:
            raise PayloadError(f"it pickles to {len(blob)} bytes, more than the "
                               f"{MAX_BLOB_BYTES} bytes hvdlike.run carries")
    except Exception as exc:  # the return value cannot be pickled, or is too big
        what = "is too big" if isinstance(exc, PayloadError) else "cannot be pickled"
        outcome = {"ok": False, "type": type(exc).__name__,
                   "message": f"the return value of rank {rank} {what}: {exc}",
                   "traceback": ""}
        blob = seal(secret, purpose, outcome)
    put(store, result_key(rank, generation), blob)
    return 0 if outcome["ok"] or outcome.get("left") else 1


if __name__ == "__main__":
    sys.exit(main())
