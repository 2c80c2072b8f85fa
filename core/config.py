"""Every tuning knob of hvdlike, parsed in exactly one place.

Each knob is an environment variable ``HVDLIKE_<NAME>``; the Horovod spelling
``HOROVOD_<NAME>`` is honoured as a fallback so existing job scripts keep
working. :func:`load` turns an environment mapping into a frozen :class:`Config`;
a bad value raises :class:`ConfigError` naming the variable, the value and what
was expected. The launcher maps its command-line flags onto the same variables
through :data:`KNOBS` (see ``Knob.flag``), so a setting is declared once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Any, Callable, Mapping, Optional

from .errors import ConfigError

PREFIX = "HVDLIKE_"
FALLBACK_PREFIX = "HOROVOD_"

LOG_LEVELS = {
    "trace": 5,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
}


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    if _INT_TEXT.fullmatch(low):  # Horovod reads its switches as numbers: > 0 is on
        return int(low) > 0
    raise ValueError("a boolean (1/0, true/false, yes/no, on/off)")


MAX_SECONDS = 1e8
"""The longest duration a time knob accepts (about three years): timeouts beyond it
overflow the clocks of the engines underneath (Python's locks, Gloo, TCPStore)."""


MAX_INT = 2**63 - 1
"""The largest value an integer knob accepts: Horovod reads them as 64-bit integers,
and hvdlike packs some into 64-bit fields (the autotuner's decision carries the
fusion threshold to every rank as one)."""


_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def strict_int(text: str) -> int:
    """``int(text)`` for ASCII digits only: Python's own ``int`` also takes ``2_0``
    (20) and other scripts' digits, which a setting must not silently accept."""
    if not _INT_TEXT.fullmatch(text.strip()):
        raise ValueError(f"invalid integer: {text!r}")
    return int(text)


def strict_float(text: str) -> float:
    """``float(text)`` for plain decimal numbers only (no ``1_0``, ``inf``, ``nan``)."""
    if not _FLOAT_TEXT.fullmatch(text.strip()):
        raise ValueError(f"invalid number: {text!r}")
    return float(text)


_STRICT = {int: strict_int, float: strict_float}


def _non_negative(kind: Callable[[str], Any], what: str,
                  most: Optional[float] = None) -> Callable[[str], Any]:
    integer = kind is int and most is None
    kind = _STRICT.get(kind, kind)

    def parse(text: str) -> Any:
        try:
            value = kind(text.strip())
        except ValueError:
            raise ValueError(what) from None
        if integer and value > MAX_INT:
            raise ValueError(f"{what}, at most {MAX_INT} (2**63 - 1)")
        # nan compares false with everything: check it is a finite number in range.
        if not (0 <= value < math.inf) or (most is not None and value > most):
            raise ValueError(what)
        return value

    return parse


MAX_CYCLE_TIME_MS = 60_000.0
"""The longest cycle time: every collective waits up to a cycle, so beyond a minute
a job would only seem to hang (and outlast its own collective timeout)."""


def _duration(what: str, positive: bool, most: float = MAX_SECONDS) -> Callable[[str], float]:
    """A finite non-negative time, at most ``most``."""
    what = f"{what}, at most {most:g}"
    parse = _non_negative(float, what, most)
    if not positive:
        return parse
    parse = _positive_value(parse, what)

    def at_least_a_millisecond(text: str) -> float:
        value = parse(text)
        if value < 0.001:  # timeouts become milliseconds: this would be 0
            raise ValueError(f"{what} (and at least 0.001)")
        return value

    return at_least_a_millisecond


def _positive_value(inner: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = inner(text)
        if value == 0:
            raise ValueError(what)
        return value

    return parse


def _positive(kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    return _positive_value(_non_negative(kind, what), what)


def _at_least(low: int, what: str) -> Callable[[str], int]:
    inner = _non_negative(int, what)

    def parse(text: str) -> int:
        value = inner(text)
        if value < low:
            raise ValueError(what)
        return value

    return parse


def _log_level(text: str) -> str:
    low = text.strip().lower()
    if low not in LOG_LEVELS:
        raise ValueError("one of " + ", ".join(LOG_LEVELS))
    return low


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        low = text.strip().lower()
        if low not in allowed:
            raise ValueError("one of " + ", ".join(allowed))
        return low

    return parse


def auto_bool(text: str) -> Optional[bool]:
    """``auto`` (or empty) -> None, else a boolean."""
    if text.strip().lower() in ("auto", ""):
        return None
    try:
        return _parse_bool(text)
    except ValueError:
        raise ValueError("auto or a boolean (1/0, true/false, yes/no, on/off)") from None


def _file_path(text: str) -> str:
    """A file a rank writes; empty: none (a blank value is refused by :func:`load`)."""
    return text


def _affinity(text: str) -> str:
    """Comma-separated core ids (empty: no pinning); kept as written, checked here."""
    if not text.strip():
        return ""
    for item in text.split(","):
        try:
            core = strict_int(item)
        except ValueError:
            core = -1
        if not 0 <= core <= MAX_INT:
            raise ValueError("comma-separated core ids >= 0, one per local rank")
    return ",".join(item.strip() for item in text.split(","))


def _timeline_path(text: str) -> str:
    """A timeline file (``DYNAMIC``: none until ``start_timeline()``)."""
    from .timeline import configured_path

    return configured_path(text)


_PATHS = (_file_path, _timeline_path)
BLANK_PATH = "a file path (empty for none), not only white space"


@dataclasses.dataclass(frozen=True)
class Knob:
    """One tuning knob.

    Attributes:
        field: attribute name on :class:`Config`; the variable is ``HVDLIKE_`` + upper-case.
        default: value used when the variable is unset.
        parse: turns the variable's text into a value; raises ``ValueError(expected)``.
        help: one line for documentation and launcher ``--help``.
        flag: launcher flag that sets this knob (``None``: no flag).
        flag_scale: the flag's value is multiplied by this before it becomes the
            variable (``--fusion-threshold-mb 64`` -> ``HVDLIKE_FUSION_THRESHOLD=67108864``).
        env_name: variable suffix when it differs from ``field.upper()``.
    """

    field: str
    default: Any
    parse: Callable[[str], Any]
    help: str
    flag: Optional[str] = None
    flag_scale: Optional[float] = None
    env_name: Optional[str] = None

    @property
    def env(self) -> str:
        return PREFIX + (self.env_name or self.field.upper())

    @property
    def on_off(self) -> bool:
        """Whether the knob is a switch (``1``/``0``, or automatic when unset)."""
        return self.parse in (_parse_bool, auto_bool)

    @property
    def fallback_env(self) -> str:
        return FALLBACK_PREFIX + (self.env_name or self.field.upper())

    @property
    def is_path(self) -> bool:
        """Whether the knob names a file a rank writes (timeline, autotune log)."""
        return self.parse in _PATHS


MIB = 1024 * 1024

KNOBS = (
    Knob("fusion_threshold", 128 * MIB, _non_negative(int, "a byte count >= 0 (0 disables fusion)"),
         "fusion buffer size in bytes; 0 disables tensor fusion",
         flag="--fusion-threshold-mb", flag_scale=MIB),
    Knob("cycle_time", 1.0, _duration("milliseconds >= 0 (float)", positive=False,
                                      most=MAX_CYCLE_TIME_MS),
         "milliseconds between background negotiation cycles",
         flag="--cycle-time-ms"),
    Knob("cache_capacity", 1024, _non_negative(int, "an integer >= 0 (0 disables the response cache)"),
         "number of negotiated collectives remembered by the response cache",
         flag="--cache-capacity"),
    Knob("log_level", "warning", _log_level,
         "runtime log level: trace, debug, info, warning, error, fatal",
         flag="--log-level"),
    Knob("log_hide_time", False, _parse_bool,
         "leave the time out of hvdlike's log lines",
         flag="--log-hide-timestamp"),
    Knob("timeline", "", _timeline_path,
         "write a Chrome-trace timeline of every collective to this file (DYNAMIC: none "
         "until start_timeline())",
         flag="--timeline-filename", env_name="TIMELINE"),
    Knob("timeline_mark_cycles", False, _parse_bool,
         "mark background cycles in the timeline",
         flag="--timeline-mark-cycles"),
    Knob("timeline_max_bytes", 1024 * MIB, _at_least(4096, "a byte count >= 4096"),
         "the timeline file stops growing at this size (a TIMELINE_TRUNCATED mark ends it)",
         flag="--timeline-max-mb", flag_scale=MIB),
    Knob("autotune", False, _parse_bool,
         "tune fusion threshold and cycle time while training",
         flag="--autotune"),
    Knob("autotune_log", "", _file_path,
         "CSV file rank 0 writes every autotune sample to",
         flag="--autotune-log-file"),
    Knob("autotune_warmup_samples", 3, _non_negative(int, "an integer >= 0"),
         "autotune samples discarded before scoring starts",
         flag="--autotune-warmup-samples"),
    Knob("autotune_steps_per_sample", 10, _positive(int, "an integer > 0"),
         "training steps per autotune sample",
         flag="--autotune-steps-per-sample"),
    Knob("autotune_bayes_opt_max_samples", None, _positive(int, "an integer > 0"),
         "autotune settles on the best setting so far after this many scored samples "
         "(default: the whole grid search)",
         flag="--autotune-bayes-opt-max-samples"),
    Knob("autotune_gaussian_process_noise", 0.8,
         _non_negative(float, "a number from 0 to 1", most=1.0),
         "accepted for Horovod compatibility; hvdlike's grid search has no Gaussian "
         "process, so it changes nothing",
         flag="--autotune-gaussian-process-noise"),
    Knob("stall_check_disable", False, _parse_bool,
         "disable the stall inspector",
         flag="--no-stall-check"),
    Knob("stall_check_time_seconds", 60.0, _duration("seconds > 0", positive=True),
         "warn when some ranks wait this long for others to submit a tensor",
         flag="--stall-check-warning-time-seconds"),
    Knob("stall_shutdown_time_seconds", 0.0, _duration("seconds >= 0 (0 = never)", positive=False),
         "raise on every rank after a stall this long (0 = never; as in Horovod, a time below "
         "HVDLIKE_STALL_CHECK_TIME_SECONDS also means never, with a warning)",
         flag="--stall-check-shutdown-time-seconds"),
    Knob("deadlock_time_seconds", 30.0, _duration("seconds >= 0 (0 = never)", positive=False),
         "raise on every rank when every rank of a group has waited this long on collectives "
         "that cannot complete (the ranks' programs diverged; 0 = never)",
         flag="--deadlock-time-seconds"),
    Knob("gloo_timeout_seconds", 30.0, _duration("seconds > 0", positive=True),
         "timeout of every data-plane collective and of dead-peer detection",
         flag="--gloo-timeout-seconds"),
    Knob("start_timeout", 60.0, _duration("seconds > 0", positive=True),
         "seconds init() waits for every rank to reach the rendezvous",
         flag="--start-timeout"),
    Knob("dynamic_process_sets", False, _parse_bool,
         "allow add_process_set/remove_process_set after init()",
         flag="--dynamic-process-sets"),
    Knob("controller", "auto", _choice("auto", "gloo", "mpi"),
         "engine of the negotiation: auto (MPI when started by mpirun), gloo or mpi",
         flag="--controller"),
    Knob("cpu_operations", "auto", _choice("auto", "gloo", "mpi"),
         "engine of CPU tensor collectives: auto (MPI when started by mpirun), gloo or mpi",
         flag="--cpu-operations"),
    Knob("shm", True, _parse_bool,
         "move CPU tensors between ranks of one host through shared memory (0: Gloo's TCP)",
         flag="--no-shm"),
    Knob("hierarchical_allreduce", None, auto_bool,
         "allreduce of a process set spanning hosts: inside each host on shared memory, "
         "across hosts between one rank per host (auto: when some host has several members)",
         flag="--hierarchical-allreduce"),
    Knob("hierarchical_allgather", None, auto_bool,
         "allgather of a process set spanning hosts in the same three phases "
         "(auto: when some host has several members)",
         flag="--hierarchical-allgather"),
    Knob("adasum_hierarchical", None, auto_bool,
         "Adasum as an average inside each host, then Adasum across hosts (Horovod's GPU "
         "Adasum); auto: CUDA tensors hierarchical, CPU tensors flat, as in Horovod",
         flag="--adasum-hierarchical"),
    Knob("disable_group_fusion", False, _parse_bool,
         "do not fuse the members of grouped collectives with other tensors",
         flag="--disable-group-fusion"),
    Knob("torus_allreduce", False, _parse_bool,
         "Horovod's two-level GPU allreduce; here it selects the hierarchical allreduce "
         "(inside each host, then across hosts) unless HVDLIKE_HIERARCHICAL_ALLREDUCE says "
         "otherwise",
         flag="--torus-allreduce"),
    Knob("mpi_threads_disable", False, _parse_bool,
         "initialize MPI without thread support (MPI_THREAD_SINGLE); negotiation and CPU "
         "tensors then stay on Gloo",
         flag="--mpi-threads-disable"),
    Knob("thread_affinity", "", _affinity,
         "pin each rank's background thread to a core: comma-separated core ids, one per "
         "local rank",
         flag="--thread-affinity"),
    Knob("num_nccl_streams", 1, _positive(int, "an integer > 0"),
         "accepted for Horovod compatibility; CUDA collectives of a process set run in order "
         "on one NCCL communicator (torch's process group), so it changes nothing",
         flag="--num-nccl-streams"),
    Knob("cpu_overlap", None, auto_bool,
         "DistributedOptimizer starts reducing each CPU gradient during backward (1) or all "
         "of them at step() (0); auto: during backward while this rank's compute threads "
         "leave a core idle",
         flag="--cpu-overlap"),
)

KNOBS_BY_FIELD = {knob.field: knob for knob in KNOBS}


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings in effect for one ``init()``; immutable once built."""

    fusion_threshold: int = 128 * MIB
    cycle_time: float = 1.0
    cache_capacity: int = 1024
    log_level: str = "warning"
    timeline: str = ""
    timeline_mark_cycles: bool = False
    timeline_max_bytes: int = 1024 * MIB
    autotune: bool = False
    autotune_log: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    stall_check_disable: bool = False
    stall_check_time_seconds: float = 60.0
    stall_shutdown_time_seconds: float = 0.0
    deadlock_time_seconds: float = 30.0
    gloo_timeout_seconds: float = 30.0
    start_timeout: float = 60.0
    dynamic_process_sets: bool = False
    controller: str = "auto"
    cpu_operations: str = "auto"
    disable_group_fusion: bool = False
    shm: bool = True
    hierarchical_allreduce: Optional[bool] = None  # None: auto
    hierarchical_allgather: Optional[bool] = None
    cpu_overlap: Optional[bool] = None  # None: auto
    adasum_hierarchical: Optional[bool] = None  # None: auto (CUDA tensors)
    autotune_bayes_opt_max_samples: Optional[int] = None  # None: the whole search
    autotune_gaussian_process_noise: float = 0.8
    log_hide_time: bool = False
    torus_allreduce: bool = False
    mpi_threads_disable: bool = False
    thread_affinity: str = ""
    num_nccl_streams: int = 1

    @property
    def log_level_number(self) -> int:
        return LOG_LEVELS[self.log_level]

    def describe(self) -> str:
        """Multi-line ``NAME = value`` listing of every knob, for logs."""
        return "\n".join(
            f"  {knob.env} = {getattr(self, knob.field)!r}" for knob in KNOBS
        )


def lookup(environ: Mapping[str, str], knob: Knob) -> Optional[tuple]:
    """Return ``(variable, text)`` for the variable that sets ``knob``, or None."""
    for name in (knob.env, knob.fallback_env):
        if name in environ:
            return name, environ[name]
    return None


def variable_of(cfg: Config, field: str, environ: Mapping[str, str]) -> str:
    """The variable that gave ``cfg`` its ``field`` as the user spelled it
    (``HOROVOD_*`` when that one did), else the ``HVDLIKE_*`` name."""
    return spelled(field, getattr(cfg, field), environ)


def spelled(field: str, value: Any, environ: Mapping[str, str]) -> str:
    """The variable of ``environ`` that set ``field`` to ``value`` (``HOROVOD_*``
    when that one did), else the ``HVDLIKE_*`` name: for messages."""
    knob = KNOBS_BY_FIELD[field]
    found = lookup(environ, knob)
    if found is not None:
        try:
            if knob.parse(found[1]) == value:
                return found[0]
        except ValueError:
            pass
    return knob.env


def _check_override(knob: Knob, value: Any) -> None:
    """An ``init()`` argument: integers and paths get their variable's checks."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            knob.parse(str(value))
        except ValueError as exc:
            raise ConfigError(f"init: {knob.field}={value!r} is not valid: expected {exc}") \
                from None
    if knob.is_path and isinstance(value, str) and value and not value.strip():
        raise ConfigError(f"init: {knob.field}={value!r} is not valid: expected {BLANK_PATH}")


def load(environ: Mapping[str, str], **overrides: Any) -> Config:
    """Build a :class:`Config` from ``environ`` (HVDLIKE_* first, then HOROVOD_*).

    Args:
        environ: the environment mapping, usually ``os.environ``.
        **overrides: already-typed values that win over the environment.

    Raises:
        ConfigError: a variable holds a value its knob cannot accept.
    """
    values = {}
    for knob in KNOBS:
        found = lookup(environ, knob)
        if found is None:
            continue
        name, text = found
        try:
            if knob.is_path and text and not text.strip():
                # Not a file named " ": a slip (an empty value means none).
                raise ValueError(BLANK_PATH)
            values[knob.field] = knob.parse(text)
        except ValueError as exc:
            raise ConfigError(
                f"{name}={text!r} is not valid: expected {exc}"
            ) from None
    unknown = set(overrides) - set(KNOBS_BY_FIELD)
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    for field, value in overrides.items():
        _check_override(KNOBS_BY_FIELD[field], value)
    values.update(overrides)
    return Config(**values)
