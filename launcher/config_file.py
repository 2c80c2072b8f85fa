"""``hvdlike-run --config-file FILE``: a YAML file of launcher settings.

The file uses the layout of ``horovodrun --config-file``::

    controller: gloo            # or mpi
    params:
      fusion_threshold_mb: 32
      cycle_time_ms: 10
      hierarchical_allreduce: false
    autotune:
      enabled: true
      warmup_samples: 5
    timeline: {filename: timeline.json, mark_cycles: true}
    stall_check: {enabled: true, warning_time_seconds: 120}
    library_options: {gloo_timeout_seconds: 60}
    logging: {level: info, hide_timestamp: true}

:func:`to_flags` turns it into the equivalent ``hvdlike-run`` command-line
tokens. The CLI puts them *before* the user's own flags and parses the whole
list, so a flag typed on the command line wins over the file (argparse keeps
the last value), wherever ``--config-file`` itself appears.

Only the shape and the types are checked here (plus ``>= 0`` for numbers, as
Horovod does); the CLI validates the values again as it does for typed flags.
A ``null`` value, or an empty or ``null`` section, means "not set" and yields
no token. Every problem raises :class:`LaunchError` with a one-line message
naming the file and the key.

Untrusted input: only regular files are read (a FIFO or a device is refused
before it is opened, so nothing blocks); files above :data:`MAX_BYTES` are
refused before parsing; YAML is read with PyYAML's safe loader (no Python
objects) and values are never expanded or printed whole, so alias "bombs"
stay cheap; duplicate keys and nesting deeper than :data:`MAX_DEPTH` are errors.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Dict, List, Optional, Tuple

from hvdlike.core import config as core_config

from . import small_file
from .errors import LaunchError
from .launch_config import knob_environment

MAX_BYTES = 64 * 1024
"""The largest config file read (64 KiB). A real one is well under 2 KiB; the cap
keeps PyYAML's pure-Python parser within about 2 s on the worst input (a 1 MiB
file can take it half a minute)."""

MAX_DEPTH = 10
"""The deepest nesting of YAML collections accepted; a real config file uses 2."""

_BOOLEAN = "boolean"
_NUMBER = "number"      # int or float, >= 0
_INTEGER = "integer"    # int, >= 0
_STRING = "string"
_CORES = "cores"        # an integer >= 0 (Horovod) or hvdlike's "0,1,..." list, as a string
_NUMERIC = {_NUMBER: "a number", _INTEGER: "a whole number",
            _CORES: "a core id or a string of comma-separated core ids"}


@dataclasses.dataclass(frozen=True)
class _Key:
    """One key of a section and the flag it becomes.

    ``flag`` takes the value (numbers, strings) or, for a boolean, is the
    token for ``true``; ``off_flag`` is the token for ``false``.
    """

    name: str
    kind: str
    flag: str
    off_flag: Optional[str] = None


_SECTIONS: Dict[str, Tuple[_Key, ...]] = {
    "params": (
        _Key("fusion_threshold_mb", _NUMBER, "--fusion-threshold-mb"),
        _Key("cycle_time_ms", _NUMBER, "--cycle-time-ms"),
        _Key("cache_capacity", _INTEGER, "--cache-capacity"),
        _Key("hierarchical_allreduce", _BOOLEAN, "--hierarchical-allreduce",
             "--no-hierarchical-allreduce"),
        _Key("hierarchical_allgather", _BOOLEAN, "--hierarchical-allgather",
             "--no-hierarchical-allgather"),
        _Key("torus_allreduce", _BOOLEAN, "--torus-allreduce", "--no-torus-allreduce"),
    ),
    "autotune": (
        _Key("enabled", _BOOLEAN, "--autotune", "--no-autotune"),
        _Key("log_file", _STRING, "--autotune-log-file"),
        _Key("warmup_samples", _INTEGER, "--autotune-warmup-samples"),
        _Key("steps_per_sample", _INTEGER, "--autotune-steps-per-sample"),
        _Key("bayes_opt_max_samples", _INTEGER, "--autotune-bayes-opt-max-samples"),
        _Key("gaussian_process_noise", _NUMBER, "--autotune-gaussian-process-noise"),
    ),
    "timeline": (
        _Key("filename", _STRING, "--timeline-filename"),
        _Key("mark_cycles", _BOOLEAN, "--timeline-mark-cycles", "--no-timeline-mark-cycles"),
    ),
    "stall_check": (
        _Key("enabled", _BOOLEAN, "--stall-check", "--no-stall-check"),
        _Key("warning_time_seconds", _NUMBER, "--stall-check-warning-time-seconds"),
        _Key("shutdown_time_seconds", _NUMBER, "--stall-check-shutdown-time-seconds"),
    ),
    "library_options": (
        _Key("mpi_threads_disable", _BOOLEAN, "--mpi-threads-disable",
             "--no-mpi-threads-disable"),
        _Key("num_nccl_streams", _INTEGER, "--num-nccl-streams"),
        _Key("thread_affinity", _CORES, "--thread-affinity"),
        _Key("gloo_timeout_seconds", _NUMBER, "--gloo-timeout-seconds"),
    ),
    "logging": (
        _Key("level", _STRING, "--log-level"),
        # Horovod's example files spell it hide_timestamp; its parser reads with_timestamp.
        _Key("hide_timestamp", _BOOLEAN, "--log-hide-timestamp", "--log-with-timestamp"),
        _Key("with_timestamp", _BOOLEAN, "--log-with-timestamp", "--log-hide-timestamp"),
    ),
}

_CONTROLLERS = {"gloo": "--gloo", "mpi": "--mpi"}
_TOP_LEVEL = ("controller",) + tuple(_SECTIONS)
_SNIPPET = 60  # longest piece of a value or key quoted in a message
_HUGE = 10 ** 40  # integers from here on are refused, not printed


def to_flags(path: str) -> List[str]:
    """Read the YAML config file at ``path`` and return ``hvdlike-run`` tokens.

    The tokens come in a fixed order (controller, params, autotune, timeline,
    stall_check, library_options, logging; keys in the order of the table
    above), one flag per key that is set. A value starting with ``-`` is
    emitted as ``--flag=VALUE`` so argparse cannot mistake it for a flag.

    Raises:
        LaunchError: the file cannot be read, is not valid YAML, has an
            unknown section or key, or a value of the wrong type.
    """
    where = f"--config-file {path}"
    text = _read(path, where)
    config = _parse(text, where)
    return _flags(config, where)


# -- reading -------------------------------------------------------------------------------


def _read(path: str, where: str) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise LaunchError("--config-file needs a file name")
    return small_file.read_text(path, where, MAX_BYTES, "a config file")


# -- parsing -------------------------------------------------------------------------------


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _loader_class(yaml: Any) -> Any:
    """PyYAML's safe loader, refusing a key given twice in one mapping and nesting
    deeper than :data:`MAX_DEPTH` (which would otherwise make the pure-Python
    scanner slow, then overflow the composer's recursion)."""
    merge_tag = "tag:yaml.org,2002:merge"

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.depth >= MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_DEPTH} levels deep",
                    self.peek_event().start_mark)
            self.depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == merge_tag:
                        continue
                    key = self.construct_object(key_node)
                    try:
                        duplicate = key in seen
                    except TypeError:  # unhashable: the base class reports it
                        continue
                    if duplicate:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"the key {_snippet(key)} is given twice",
                            key_node.start_mark)
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return Loader


def _parse(text: str, where: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise LaunchError(f"{where}: reading it needs PyYAML (pip install pyyaml)") from None
    try:
        # Not yaml.load with a full loader: tags such as !!python/object are refused.
        return yaml.load(text, Loader=_loader_class(yaml))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        detail = ", ".join(part for part in (exc.context, exc.problem) if part)
        raise LaunchError(f"{where}: invalid YAML{at}: {_one_line(detail)}") from None
    except yaml.reader.ReaderError as exc:
        line = text[:exc.position].count("\n") + 1
        char = exc.character  # a code point (int) for text input
        code = ord(char) if isinstance(char, str) and len(char) == 1 else char
        shown = f"U+{code:04X}" if isinstance(code, int) else repr(code)
        raise LaunchError(f"{where}: invalid YAML at line {line}: the character {shown} "
                          f"is not allowed") from None
    except yaml.YAMLError as exc:
        raise LaunchError(f"{where}: invalid YAML: {_one_line(exc)}") from None
    except RecursionError:
        raise LaunchError(f"{where}: invalid YAML: nested too deeply") from None
    except Exception as exc:  # e.g. ValueError from a scalar such as 2024-13-45
        raise LaunchError(f"{where}: invalid YAML: a value cannot be read: "
                          f"{_one_line(exc)}") from None


# -- mapping -------------------------------------------------------------------------------


def _snippet(value: Any) -> str:
    """A short description of ``value``; containers are never printed (they may be huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value) if abs(value) < _HUGE else "a very large integer"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= _SNIPPET else value[:_SNIPPET] + "...")
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__} value"


def _name(key: str) -> str:
    """A key as written in a message: bare when it looks like a key, else quoted."""
    return key if key.isidentifier() and len(key) <= _SNIPPET else _snippet(key)


def _did_you_mean(key: str, valid: Tuple[str, ...], prefix: str = "") -> str:
    close = difflib.get_close_matches(key[:_SNIPPET], valid, n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _check_keys(mapping: Dict[Any, Any], owner: str, where: str) -> None:
    for key in mapping:
        if not isinstance(key, str):
            scalar = key is None or isinstance(key, (bool, int, float))
            hint = " (put it in quotes)" if scalar else ""
            raise LaunchError(f"{where}: {owner} has a key that is not a string: "
                              f"{_snippet(key)}{hint}")


def _value_tokens(spec: _Key, value: Any, name: str, where: str) -> List[str]:
    tokens = _typed_tokens(spec, value, name, where)
    if spec.kind != _BOOLEAN:
        _check_range(spec, value, name, where)
    return tokens


def _check_range(spec: _Key, value: Any, name: str, where: str) -> None:
    """The knob's own check of the value, named by file and key (not by the flag the
    key becomes, which the user never typed)."""
    knob = next((k for k in core_config.KNOBS if k.flag == spec.flag), None)
    if knob is None:
        return
    try:
        knob_environment({knob.field: value})
    except LaunchError as exc:
        reason = str(exc).partition(" is not valid: ")[2] or str(exc)
        raise LaunchError(f"{where}: {name} {_snippet(value)} is not valid: {reason}") from None


def _typed_tokens(spec: _Key, value: Any, name: str, where: str) -> List[str]:
    if spec.kind == _BOOLEAN:
        if not isinstance(value, bool):
            raise LaunchError(f"{where}: {name} must be true or false, got {_snippet(value)}")
        return [spec.flag if value else spec.off_flag]
    if spec.kind == _CORES and isinstance(value, str):
        return _string_tokens(spec, value, name, where)
    if spec.kind in _NUMERIC:
        allowed = (int, float) if spec.kind == _NUMBER else int
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise LaunchError(f"{where}: {name} must be {_NUMERIC[spec.kind]}, "
                              f"got {_snippet(value)}{_text_hint(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise LaunchError(f"{where}: {name} must be a finite number, got {_snippet(value)}")
        if value < 0:
            raise LaunchError(f"{where}: {name} must be >= 0, got {_snippet(value)}")
        if isinstance(value, int) and value >= _HUGE:
            raise LaunchError(f"{where}: {name} is too large")
        return [spec.flag, repr(value) if isinstance(value, float) else str(value)]
    return _string_tokens(spec, value, name, where)


def _text_hint(value: Any) -> str:
    """Why a number-looking value is text: it was quoted, or is YAML 1.1's ``1e3``."""
    if isinstance(value, str) and len(value) <= _SNIPPET:
        try:
            float(value)
        except ValueError:
            return ""
        return " (text, not a number: drop the quotes; write 1e3 as 1.0e+3)"
    return ""


def _string_tokens(spec: _Key, value: Any, name: str, where: str) -> List[str]:
    if not isinstance(value, str) or not value.strip():
        raise LaunchError(f"{where}: {name} must be a non-empty string, got {_snippet(value)}")
    if "\x00" in value:
        raise LaunchError(f"{where}: {name} must not contain a NUL character")
    if value.startswith("-"):
        return [f"{spec.flag}={value}"]
    return [spec.flag, value]


def _controller_tokens(value: Any, where: str) -> List[str]:
    if not isinstance(value, str) or value.strip().lower() not in _CONTROLLERS:
        raise LaunchError(f"{where}: controller must be gloo or mpi, got {_snippet(value)}")
    return [_CONTROLLERS[value.strip().lower()]]


def _section_tokens(section: str, body: Any, where: str) -> List[str]:
    if not isinstance(body, dict):
        raise LaunchError(f"{where}: {section} must be a mapping of keys, got {_snippet(body)}")
    _check_keys(body, section, where)
    specs = _SECTIONS[section]
    names = tuple(spec.name for spec in specs)
    for key in body:
        if key not in names:
            raise LaunchError(f"{where}: unknown key {section}.{_name(key)}"
                              f"{_did_you_mean(key, names, section + '.')}; "
                              f"valid keys in {section}: {', '.join(names)}")
    tokens: List[str] = []
    chosen: Dict[frozenset, Tuple[str, str]] = {}  # a boolean's flag pair -> (key, token)
    for spec in specs:
        value = body.get(spec.name)
        if value is None:
            continue
        produced = _value_tokens(spec, value, f"{section}.{spec.name}", where)
        if spec.kind == _BOOLEAN:
            pair = frozenset((spec.flag, spec.off_flag))
            if pair in chosen:  # hide_timestamp and with_timestamp: two names, one setting
                earlier, token = chosen[pair]
                if token != produced[0]:
                    raise LaunchError(f"{where}: {section}.{earlier} and {section}.{spec.name} "
                                      f"contradict each other; give only one of them")
                continue
            chosen[pair] = (spec.name, produced[0])
        tokens.extend(produced)
    return tokens


def _flags(config: Any, where: str) -> List[str]:
    if config is None:  # an empty file, or only comments
        return []
    if not isinstance(config, dict):
        raise LaunchError(f"{where}: the top level must be a mapping of sections "
                          f"({', '.join(_TOP_LEVEL)}), got {_snippet(config)}")
    _check_keys(config, "the top level", where)
    for key in config:
        if key not in _TOP_LEVEL:
            raise LaunchError(f"{where}: unknown section {_name(key)}"
                              f"{_did_you_mean(key, _TOP_LEVEL)}; "
                              f"valid sections: {', '.join(_TOP_LEVEL)}")
    tokens: List[str] = []
    if config.get("controller") is not None:
        tokens.extend(_controller_tokens(config["controller"], where))
    for section in _SECTIONS:
        body = config.get(section)
        if body is not None:
            tokens.extend(_section_tokens(section, body, where))
    return tokens
