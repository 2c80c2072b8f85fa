"""Exception types raised by hvdlike.

``HvdlikeInternalError`` is what a collective raises when the job itself broke
(a peer died, the runtime shut down underneath it). It is also exported under
Horovod's name, ``HorovodInternalError``, so elastic code written for Horovod
catches the right thing.
"""


class HvdlikeError(RuntimeError):
    """Base class of every error hvdlike raises on purpose."""


class ConfigError(HvdlikeError, ValueError):
    """A setting (environment variable, flag or argument) has a bad value."""


class NotInitializedError(HvdlikeError, ValueError):
    """A function that needs ``hvdlike.init()`` was called without it."""


class HvdlikeInternalError(HvdlikeError):
    """A collective failed because of the job, not the caller: dead peer, shutdown,
    timeout, ranks that disagree or wait on each other."""


HorovodInternalError = HvdlikeInternalError

# How a collective ends when a peer shut the job down under it; the rest of the
# message names the peers (``: rank R on HOST ...``). The launcher reads it (and
# SHUT_DOWN's) in a failed rank's last lines to blame the peer that went first.
SHUT_DOWN_UNDER = "hvdlike was shut down before this collective completed"
# How a call ends that comes after such a shutdown (the same ``: rank R on HOST``
# follows when the peers said why).
SHUT_DOWN = "hvdlike has shut down"


class MismatchError(HvdlikeInternalError, ValueError):
    """Ranks submitted the same tensor name with incompatible requests (or a
    collective that cannot run while some rank has joined).

    Raised by ``synchronize`` on every rank; a ``HorovodInternalError`` as the
    same failure is in Horovod, and a ``ValueError``."""


class UnsupportedOpError(HvdlikeError, ValueError):
    """A collective was asked for a reduction op it cannot perform (reducescatter
    with Adasum, say). A ``RuntimeError`` as in Horovod, and a ``ValueError``."""


class InvalidSplitsError(TypeError, ValueError):
    """Alltoall ``splits`` that are not integers (a float tensor, a string, ...).

    A ``TypeError`` for what it is, and a ``ValueError`` as Horovod raises for a
    splits tensor that is not of 32-bit integers (its own tests catch that).
    """


class DuplicateNameError(HvdlikeError, ValueError):
    """A tensor name was submitted again while the first submission is still in flight."""


def malformed_message(rank: int, problem: str,
                      shared_memory: bool = False) -> HvdlikeInternalError:
    """The job's error when rank ``rank`` sent (``shared_memory``: wrote into the
    shared-memory control block) a negotiation message no hvdlike rank produces;
    ``problem`` says what is wrong with it."""
    did = ("wrote a malformed negotiation message into shared memory" if shared_memory
           else "sent a malformed negotiation message")
    return HvdlikeInternalError(
        f"rank {rank} {did}: {problem}. An hvdlike rank cannot produce it: that process "
        f"is not running hvdlike's code (or its memory is damaged); the job cannot go on "
        f"with it")


class StallError(HvdlikeInternalError):
    """Some ranks waited too long for others to submit a collective."""


class DeadlockError(StallError):
    """Every rank of a group waits on a collective that another of them never
    submitted: their programs diverged, and no rank can proceed."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by ``state.commit()`` / ``check_host_updates()`` when the launcher
    published a new set of ranks (hosts added or removed): every rank raises it
    at the same commit, and the elastic retry loop re-forms the job.

    ``skip_sync`` is True when ranks were only removed: the survivors already
    hold identical committed state, so the broadcast after the re-form is skipped.
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__("the launcher published a new set of ranks")
        self.skip_sync = skip_sync
