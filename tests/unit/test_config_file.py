"""``--config-file``: a horovodrun-style YAML file becomes hvdlike-run flags."""

import argparse
import os
import textwrap

import pytest

from hvdlike.launcher import config_file
from hvdlike.launcher.config_file import MAX_BYTES, to_flags
from hvdlike.launcher.errors import LaunchError

# The layout of horovodrun's own example config file, every key set.
FULL = """\
controller: gloo

params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: false
  torus_allreduce: false

autotune:
  enabled: true
  log_file: 'autotune_log.csv'
  warmup_samples: 5
  steps_per_sample: 20
  bayes_opt_max_samples: 50
  gaussian_process_noise: 0.9

timeline:
  filename: 'timeline.json'
  mark_cycles: true

stall_check:
  enabled: true
  warning_time_seconds: 120
  shutdown_time_seconds: 240

library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  thread_affinity: 1
  gloo_timeout_seconds: 60

logging:
  level: INFO
  hide_timestamp: true
"""

FULL_FLAGS = [
    "--gloo",
    "--fusion-threshold-mb", "32",
    "--cycle-time-ms", "10",
    "--cache-capacity", "2048",
    "--hierarchical-allreduce",
    "--no-hierarchical-allgather",
    "--no-torus-allreduce",
    "--autotune",
    "--autotune-log-file", "autotune_log.csv",
    "--autotune-warmup-samples", "5",
    "--autotune-steps-per-sample", "20",
    "--autotune-bayes-opt-max-samples", "50",
    "--autotune-gaussian-process-noise", "0.9",
    "--timeline-filename", "timeline.json",
    "--timeline-mark-cycles",
    "--stall-check",
    "--stall-check-warning-time-seconds", "120",
    "--stall-check-shutdown-time-seconds", "240",
    "--mpi-threads-disable",
    "--num-nccl-streams", "2",
    "--thread-affinity", "1",
    "--gloo-timeout-seconds", "60",
    "--log-level", "INFO",
    "--log-hide-timestamp",
]


@pytest.fixture
def write(tmp_path):
    def write(text, name="cfg.yaml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


def error_of(path):
    with pytest.raises(LaunchError) as info:
        to_flags(path)
    message = str(info.value)
    assert message.startswith(f"--config-file {path}: ")
    assert "\n" not in message
    return message


# -- the mapping ---------------------------------------------------------------------------


def test_full_horovod_file(write):
    assert to_flags(write(FULL)) == FULL_FLAGS


def test_file_order_does_not_matter(write):
    reordered = "logging: {level: debug}\nparams: {cycle_time_ms: 2.5}\ncontroller: MPI\n"
    assert to_flags(write(reordered)) == ["--mpi", "--cycle-time-ms", "2.5", "--log-level", "debug"]


@pytest.mark.parametrize("section, key, on, off", [
    ("params", "hierarchical_allreduce", "--hierarchical-allreduce", "--no-hierarchical-allreduce"),
    ("params", "hierarchical_allgather", "--hierarchical-allgather", "--no-hierarchical-allgather"),
    ("params", "torus_allreduce", "--torus-allreduce", "--no-torus-allreduce"),
    ("autotune", "enabled", "--autotune", "--no-autotune"),
    ("timeline", "mark_cycles", "--timeline-mark-cycles", "--no-timeline-mark-cycles"),
    ("stall_check", "enabled", "--stall-check", "--no-stall-check"),
    ("library_options", "mpi_threads_disable", "--mpi-threads-disable", "--no-mpi-threads-disable"),
    ("logging", "hide_timestamp", "--log-hide-timestamp", "--log-with-timestamp"),
    ("logging", "with_timestamp", "--log-with-timestamp", "--log-hide-timestamp"),
])
def test_each_boolean_both_ways(write, section, key, on, off):
    assert to_flags(write(f"{section}:\n  {key}: true\n")) == [on]
    assert to_flags(write(f"{section}:\n  {key}: false\n")) == [off]
    # YAML 1.1 spellings of booleans are booleans too
    assert to_flags(write(f"{section}:\n  {key}: yes\n")) == [on]
    assert to_flags(write(f"{section}:\n  {key}: off\n")) == [off]


@pytest.mark.parametrize("section, key, flag, low", [
    ("params", "fusion_threshold_mb", "--fusion-threshold-mb", 0),
    ("params", "cycle_time_ms", "--cycle-time-ms", 0),
    ("autotune", "gaussian_process_noise", "--autotune-gaussian-process-noise", 0),
    ("stall_check", "warning_time_seconds", "--stall-check-warning-time-seconds", 1),
    ("stall_check", "shutdown_time_seconds", "--stall-check-shutdown-time-seconds", 0),
    ("library_options", "gloo_timeout_seconds", "--gloo-timeout-seconds", 1),
])
def test_each_number(write, section, key, flag, low):
    assert to_flags(write(f"{section}: {{{key}: {low}}}\n")) == [flag, str(low)]
    assert to_flags(write(f"{section}: {{{key}: 0.25}}\n")) == [flag, "0.25"]
    if key == "gaussian_process_noise":  # Horovod's range: 0 to 1
        assert error_of(write(f"{section}: {{{key}: 1.0e+3}}\n")).endswith(
            f": {section}.{key} 1000.0 is not valid: expected a number from 0 to 1")
    else:
        assert to_flags(write(f"{section}: {{{key}: 1.0e+3}}\n")) == [flag, "1000.0"]
    # YAML 1.1 reads 1e3 (no dot) as text, as it does a quoted number: say so
    message = error_of(write(f"{section}: {{{key}: 1e3}}\n"))
    assert message.endswith(f": {section}.{key} must be a number, got '1e3' (text, not a "
                            "number: drop the quotes; write 1e3 as 1.0e+3)")
    message = error_of(write(f"{section}: {{{key}: abc}}\n"))
    assert message.endswith(f": {section}.{key} must be a number, got 'abc'")


@pytest.mark.parametrize("section, key, flag, low", [
    ("params", "cache_capacity", "--cache-capacity", 0),
    ("autotune", "warmup_samples", "--autotune-warmup-samples", 0),
    ("autotune", "steps_per_sample", "--autotune-steps-per-sample", 1),
    ("autotune", "bayes_opt_max_samples", "--autotune-bayes-opt-max-samples", 1),
    ("library_options", "num_nccl_streams", "--num-nccl-streams", 1),
])
def test_each_whole_number(write, section, key, flag, low):
    assert to_flags(write(f"{section}: {{{key}: {low}}}\n")) == [flag, str(low)]
    assert to_flags(write(f"{section}: {{{key}: 0x10}}\n")) == [flag, "16"]
    for bad, shown in (("2.5", "2.5"), ("abc", "'abc'")):
        message = error_of(write(f"{section}: {{{key}: {bad}}}\n"))
        assert message.endswith(f": {section}.{key} must be a whole number, got {shown}")


def test_thread_affinity(write):
    # Horovod's form (one integer) and hvdlike's (a core id per local rank)
    assert to_flags(write("library_options: {thread_affinity: 1}\n")) == ["--thread-affinity", "1"]
    assert to_flags(write("library_options: {thread_affinity: '0,2,4'}\n")) == [
        "--thread-affinity", "0,2,4"]
    assert to_flags(write("library_options:\n  thread_affinity: 0,2\n")) == [
        "--thread-affinity", "0,2"]
    assert error_of(write("library_options: {thread_affinity: 1.5}\n")).endswith(
        ": library_options.thread_affinity must be a core id or a string of comma-separated "
        "core ids, got 1.5")
    assert error_of(write("library_options: {thread_affinity: -1}\n")).endswith(
        ": library_options.thread_affinity must be >= 0, got -1")


@pytest.mark.parametrize("section, key, flag, value, dashed", [
    ("autotune", "log_file", "--autotune-log-file", "some value", "-x"),
    ("timeline", "filename", "--timeline-filename", "some value", "-x"),
    ("logging", "level", "--log-level", "debug", None),
])
def test_each_string(write, section, key, flag, value, dashed):
    assert to_flags(write(f"{section}: {{{key}: {value}}}\n")) == [flag, value]
    if dashed:  # a value that looks like a flag stays attached to its own flag
        assert to_flags(write(f"{section}: {{{key}: '{dashed}'}}\n")) == [f"{flag}={dashed}"]
    message = error_of(write(f"{section}: {{{key}: ''}}\n"))
    assert message.endswith(f": {section}.{key} must be a non-empty string, got ''")
    message = error_of(write(f"{section}: {{{key}: 5}}\n"))
    assert message.endswith(f": {section}.{key} must be a non-empty string, got 5")


@pytest.mark.parametrize("text, ending", [
    ("library_options: {gloo_timeout_seconds: 0}",
     "library_options.gloo_timeout_seconds 0 is not valid: expected seconds > 0, at most 1e+08"),
    ("logging: {level: loud}", "logging.level 'loud' is not valid: expected one of trace, "
     "debug, info, warning, error, fatal"),
    ("params: {cycle_time_ms: 100000}", "params.cycle_time_ms 100000 is not valid: expected "
     "milliseconds >= 0 (float), at most 60000"),
    ("autotune: {steps_per_sample: 0}", "autotune.steps_per_sample 0 is not valid: expected "
     "an integer > 0"),
    ("library_options: {thread_affinity: 'a,b'}", "library_options.thread_affinity 'a,b' is "
     "not valid: expected comma-separated core ids >= 0, one per local rank"),
])
def test_values_out_of_range_are_named_by_file_and_key(write, text, ending):
    # They were named by the flag each key becomes, which the user never typed.
    message = error_of(write(text + "\n"))
    assert message.endswith(": " + ending), message
    assert "--" not in message.split(": ", 1)[1], message


def test_controller(write):
    assert to_flags(write("controller: gloo\n")) == ["--gloo"]
    assert to_flags(write("controller: Mpi\n")) == ["--mpi"]
    assert error_of(write("controller: nccl\n")).endswith(
        ": controller must be gloo or mpi, got 'nccl'")
    assert error_of(write("controller: [gloo]\n")).endswith(
        ": controller must be gloo or mpi, got a list")


def test_null_means_not_set(write):
    text = """\
        controller: null
        params:
          fusion_threshold_mb: ~
          cycle_time_ms: 5
        autotune:
        timeline: {}
        stall_check: {enabled: null}
        logging: {hide_timestamp: null, with_timestamp: null}
    """
    assert to_flags(write(text)) == ["--cycle-time-ms", "5"]


def test_empty_file_sets_nothing(write):
    assert to_flags(write("")) == []
    assert to_flags(write("# only a comment\n---\n")) == []


def test_both_timestamp_spellings(write):
    agree = "logging: {hide_timestamp: true, with_timestamp: false}\n"
    assert to_flags(write(agree)) == ["--log-hide-timestamp"]
    message = error_of(write("logging: {hide_timestamp: true, with_timestamp: true}\n"))
    assert message.endswith(": logging.hide_timestamp and logging.with_timestamp contradict "
                            "each other; give only one of them")


def test_utf8_bom_and_crlf(write, tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbfparams:\r\n  cache_capacity: 7\r\n")
    assert to_flags(str(path)) == ["--cache-capacity", "7"]


# -- the command line wins -------------------------------------------------------------------


def stand_in_parser():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--gloo", action="store_true")
    parser.add_argument("--fusion-threshold-mb")
    parser.add_argument("--cycle-time-ms")
    parser.add_argument("--timeline-filename")
    parser.add_argument("--hierarchical-allreduce", dest="hier", action="store_const", const="1")
    parser.add_argument("--no-hierarchical-allreduce", dest="hier", action="store_const", const="0")
    parser.add_argument("--autotune", action="store_true", default=None)
    parser.add_argument("--no-autotune", dest="autotune", action="store_false")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def test_command_line_overrides_file(write):
    path = write("""\
        controller: gloo
        params: {fusion_threshold_mb: 32, cycle_time_ms: 10, hierarchical_allreduce: true}
        autotune: {enabled: true}
        timeline: {filename: '-from-file.json'}
    """)
    argv = ["--cycle-time-ms", "20", "--no-hierarchical-allreduce", "--no-autotune",
            "python", "train.py", "--cycle-time-ms", "99"]
    args = stand_in_parser().parse_args(to_flags(path) + argv)
    assert args.fusion_threshold_mb == "32"       # only in the file: the file's value
    assert args.timeline_filename == "-from-file.json"
    assert args.gloo is True
    assert args.cycle_time_ms == "20"             # store: the command line wins
    assert args.hier == "0"                       # store_const: the command line wins
    assert args.autotune is False                 # store_true/false pair: the command line wins
    assert args.command == ["python", "train.py", "--cycle-time-ms", "99"]

    # and without command-line flags, every setting of the file applies
    args = stand_in_parser().parse_args(to_flags(path) + ["python", "train.py"])
    assert (args.cycle_time_ms, args.hier, args.autotune) == ("10", "1", True)


# -- errors ----------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    assert error_of(path) == f"--config-file {path}: no such file"


def test_empty_name():
    with pytest.raises(LaunchError, match="^--config-file needs a file name$"):
        to_flags("")


def test_directory(tmp_path):
    assert error_of(str(tmp_path)) == f"--config-file {tmp_path}: is a directory, not a file"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_is_refused_without_blocking(tmp_path):
    path = str(tmp_path / "fifo")
    os.mkfifo(path)
    assert error_of(path) == f"--config-file {path}: is a FIFO, not a regular file"


def test_unreadable(write, monkeypatch):
    path = write("params: {}\n")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(config_file.os, "open", refuse)
    assert error_of(path) == f"--config-file {path}: cannot be read: Permission denied"


def test_too_large_is_refused_before_parsing(write, monkeypatch):
    path = write("#" * MAX_BYTES + "\n")
    monkeypatch.setattr(config_file, "_parse", lambda *a: pytest.fail("parsed"))
    assert error_of(path) == (f"--config-file {path}: is larger than {MAX_BYTES} bytes (64 KiB), "
                              f"the most a config file may hold")


def test_at_the_cap_is_read(write, monkeypatch):
    monkeypatch.setattr(config_file, "MAX_BYTES", 64)
    text = "params: {cache_capacity: 1}\n".ljust(63, "#") + "\n"
    assert len(text) == 64
    assert to_flags(write(text)) == ["--cache-capacity", "1"]
    assert "is larger than 64 bytes" in error_of(write(text + "\n"))


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"params:\n  cache_capacity: 1\n# caf\xe9\n")
    assert error_of(str(path)) == (f"--config-file {path}: is not UTF-8 text "
                                   f"(invalid byte at line 3)")


@pytest.mark.parametrize("text, expected", [
    ("params:\n  cycle_time_ms: 1\n cache_capacity: 2\n", "invalid YAML at line 3, column 2: "),
    ("params: {cycle_time_ms: 1\n", "invalid YAML at line 2, column 1: "),
    ("params: {}\n---\nparams: {}\n", "invalid YAML at line 2, column 1: "),
    ("a: \x00\n", "invalid YAML at line 1: the character U+0000 is not allowed"),
    ("params: !!python/object:os.system {}\n", "invalid YAML at line 1, column 9: "),
    ("params:\n  cycle_time_ms: 1\n  cycle_time_ms: 2\n",
     "invalid YAML at line 3, column 3: the key 'cycle_time_ms' is given twice"),
    ("params: {}\nparams: {cache_capacity: 1}\n",
     "invalid YAML at line 2, column 1: the key 'params' is given twice"),
    ("timeline: {filename: 2024-13-45}\n", "invalid YAML: a value cannot be read: "),
    ("[" * 3000 + "]" * 3000 + "\n",
     "invalid YAML at line 1, column 11: nested more than 10 levels deep"),
    ("params:\n" + "".join("  " * n + f"k{n}:\n" for n in range(1, 40)),
     "invalid YAML at line 10, column 19: nested more than 10 levels deep"),
], ids=["indent", "unclosed", "two-documents", "nul", "python-tag", "duplicate-key",
        "duplicate-section", "bad-date", "deep-flow", "deep-block"])
def test_invalid_yaml(write, text, expected):
    message = error_of(write(text))
    assert message.split(": ", 1)[1].startswith(expected), message


@pytest.mark.parametrize("text, shown", [
    ("- params\n", "a list"),
    ("params\n", "'params'"),
    ("42\n", "42"),
])
def test_top_level_not_a_mapping(write, text, shown):
    assert error_of(write(text)).endswith(
        ": the top level must be a mapping of sections (controller, params, autotune, timeline, "
        f"stall_check, library_options, logging), got {shown}")


def test_unknown_section(write):
    assert error_of(write("parms: {cycle_time_ms: 1}\n")).endswith(
        ": unknown section parms (did you mean params?); valid sections: controller, params, "
        "autotune, timeline, stall_check, library_options, logging")
    assert error_of(write("elastic: {}\n")).endswith(
        ": unknown section elastic; valid sections: controller, params, autotune, timeline, "
        "stall_check, library_options, logging")


def test_unknown_key(write):
    assert error_of(write("params: {fusion_treshold_mb: 32}\n")).endswith(
        ": unknown key params.fusion_treshold_mb (did you mean params.fusion_threshold_mb?); "
        "valid keys in params: fusion_threshold_mb, cycle_time_ms, cache_capacity, "
        "hierarchical_allreduce, hierarchical_allgather, torus_allreduce")
    # a null value for an unknown key is still a mistake
    assert ": unknown key logging.levle (did you mean logging.level?)" in error_of(
        write("logging: {levle: null}\n"))
    assert ": unknown key library_options.'tcp flag'; valid keys in library_options: " in error_of(
        write("library_options: {'tcp flag': true}\n"))


def test_non_string_keys(write):
    assert error_of(write("1: 2\n")).endswith(
        ": the top level has a key that is not a string: 1 (put it in quotes)")
    assert error_of(write("params: {on: true}\n")).endswith(
        ": params has a key that is not a string: true (put it in quotes)")
    assert error_of(write("params: {? [a]\n  : 1}\n")).split(": ", 1)[1].startswith(
        "invalid YAML at line 1")


def test_section_not_a_mapping(write):
    assert error_of(write("params: [1, 2]\n")).endswith(
        ": params must be a mapping of keys, got a list")
    assert error_of(write("autotune: true\n")).endswith(
        ": autotune must be a mapping of keys, got true")


@pytest.mark.parametrize("value, shown", [
    ("'32'", "'32' (text, not a number: drop the quotes; write 1e3 as 1.0e+3)"),
    ("true", "true"),
    ("[32]", "a list"),
    ("{mb: 32}", "a mapping"),
    ("2024-01-01", "a date value"),
])
def test_number_of_wrong_type(write, value, shown):
    assert error_of(write(f"params: {{fusion_threshold_mb: {value}}}\n")).endswith(
        f": params.fusion_threshold_mb must be a number, got {shown}")


def test_numbers_out_of_range(write):
    assert error_of(write("params: {cycle_time_ms: -1}\n")).endswith(
        ": params.cycle_time_ms must be >= 0, got -1")
    assert error_of(write("params: {cycle_time_ms: .nan}\n")).endswith(
        ": params.cycle_time_ms must be a finite number, got nan")
    assert error_of(write("params: {cycle_time_ms: .inf}\n")).endswith(
        ": params.cycle_time_ms must be a finite number, got inf")
    assert error_of(write("params: {cache_capacity: " + "9" * 60 + "}\n")).endswith(
        ": params.cache_capacity is too large")


@pytest.mark.parametrize("value, shown", [
    ("'true'", "'true'"),
    ("1", "1"),
    ("{}", "a mapping"),
])
def test_boolean_of_wrong_type(write, value, shown):
    assert error_of(write(f"stall_check: {{enabled: {value}}}\n")).endswith(
        f": stall_check.enabled must be true or false, got {shown}")


def test_string_with_nul(write):
    assert error_of(write('timeline: {filename: "a\\0b"}\n')).endswith(
        ": timeline.filename must not contain a NUL character")


def test_long_values_are_shortened(write):
    message = error_of(write("params: {cycle_time_ms: '" + "x" * 5000 + "'}\n"))
    assert message.endswith("got '" + "x" * 60 + "...'")


def _bomb(levels=10):
    """A YAML list that expands to 10**levels leaves, written in a few hundred bytes."""
    parts = ["&a0 [" + ", ".join(["x"] * 10) + "]"]
    parts += [f"&a{n} [" + ", ".join([f"*a{n - 1}"] * 10) + "]" for n in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def test_alias_bomb_as_a_value_is_never_expanded(write):
    for key in ("level", "with_timestamp"):
        message = error_of(write(f"logging:\n  {key}: {_bomb()}\n"))
        assert message.endswith(" got a list"), message
    assert error_of(write(f"params: {_bomb()}\n")).endswith(
        ": params must be a mapping of keys, got a list")


def test_alias_bomb_in_an_unknown_section(write):
    text = f"anchors: {_bomb()}\nparams: {{cycle_time_ms: 1}}\n"
    assert error_of(write(text)).endswith(
        ": unknown section anchors; valid sections: controller, params, autotune, timeline, "
        "stall_check, library_options, logging")
