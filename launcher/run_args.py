"""The arguments of ``hvdlike.run`` -- hvdlike's own and ``horovod.run``'s -- as one
:class:`~.launch_config.LaunchConfig`.

``horovod.run(func, args, kwargs, num_proc, min_num_proc, max_num_proc, slots,
reset_limit, cooldown_range, hosts, hostfile, host_discovery_script, start_timeout,
ssh_port, ssh_identity_file, disable_cache, output_filename, verbose, use_gloo,
use_mpi, mpi_args, network_interface(s), executable, np, min_np, max_np)`` calls
run unchanged: each argument means what the ``hvdlike-run`` flag of the same name
means (see :mod:`.cli`), and the same combinations are refused.
"""

from __future__ import annotations

import contextlib
import numbers
import operator
import re
import shlex
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from hvdlike.core import config as core_config

from .errors import LaunchError
from .hosts import (
    MAX_RANKS, HostSlots, checked_name, no_repeats, parse_hosts, read_hostfile,
)


# The hvdlike-run flags checks shared with the command line name, and the argument
# of ``run`` each one is.
_ARGUMENT_OF_FLAG = {
    "-H/--hosts": "hosts", "--hostfile": "hostfile", "-np": "np", "--min-np": "min_np",
    "--max-np": "max_np", "--slots-per-host": "slots", "--reset-limit": "reset_limit",
    "--elastic-timeout": "elastic_timeout", "--blacklist-cooldown-range": "cooldown_range",
    "--host-discovery-script": "host_discovery_script", "--output-filename": "output_filename",
    "--network-interface": "network_interface", "-i/--ssh-identity-file": "ssh_identity_file",
}
_FLAG = re.compile(r"(?<![\w/-])(" + "|".join(
    re.escape(f) for f in sorted(_ARGUMENT_OF_FLAG, key=len, reverse=True)) + r")(?![\w/-])")
PREFIX = "hvdlike.run: "


def in_api_terms(message: str) -> str:
    """A launcher error as ``hvdlike.run`` says it: prefixed, naming its arguments
    where the shared check named ``hvdlike-run``'s flags."""
    if message.startswith(PREFIX):
        return message
    return PREFIX + _FLAG.sub(lambda m: _ARGUMENT_OF_FLAG[m.group(1)], message)


@contextlib.contextmanager
def api_terms() -> Iterator[None]:
    """Re-raise a :class:`LaunchError` from the checks inside in API terms."""
    try:
        yield
    except LaunchError as exc:
        raise LaunchError(in_api_terms(str(exc))) from None


def count_arg(value: Any, name: str, minimum: int = 1) -> Optional[int]:
    """``value`` as an int of at least ``minimum`` (None stays None)."""
    if value is None:
        return None
    try:
        count = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        count = None
    if count is None:
        raise LaunchError(f"hvdlike.run: {name} must be an int, got {value!r} "
                          f"({type(value).__name__})")
    if count < minimum:
        raise LaunchError(f"hvdlike.run: {name} {count} is not valid: expected at least "
                          f"{minimum}")
    return count


def _one_of(name: str, value: Any, alias: str, other: Any) -> Any:
    """``value`` or its older name's ``other``; both given must agree."""
    if value is not None and other is not None and value != other:
        raise LaunchError(f"hvdlike.run: {name}={value!r} and {alias}={other!r} disagree; "
                          f"pass one of them")
    return value if value is not None else other


def text_arg(value: Any, name: str) -> Optional[str]:
    """``value`` as a non-empty str (None stays None); a LaunchError naming ``name`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise LaunchError(f"hvdlike.run: {name} must be a str, got {type(value).__name__}")
    if not value.strip():
        raise LaunchError(f"hvdlike.run: {name} is empty")
    return value


def interfaces(network_interface: Any, network_interfaces: Any) -> List[str]:
    """The interfaces ``network_interface`` (a name, or Horovod's older
    comma-separated list) and ``network_interfaces`` (a list) name together, each
    once, in the order given (empty: neither given)."""
    return _unique(_interface_list(network_interface, None)
                   + _interface_list(None, network_interfaces))


def _unique(names: List[str]) -> List[str]:
    return list(dict.fromkeys(names))


def _interface_list(network_interface: Any, network_interfaces: Any) -> List[str]:
    if network_interfaces:
        if isinstance(network_interfaces, str):
            names = network_interfaces.split(",")
        else:
            try:
                names = list(network_interfaces)
            except TypeError:
                raise LaunchError("hvdlike.run: network_interfaces must be a list of interface "
                                  f"names, got {type(network_interfaces).__name__}") from None
        if not all(isinstance(n, str) for n in names):
            raise LaunchError("hvdlike.run: network_interfaces must be a list of interface "
                              f"names, got {names!r}")
    elif network_interface:
        if not isinstance(network_interface, str):
            raise LaunchError("hvdlike.run: network_interface must be a str, got "
                              f"{type(network_interface).__name__}")
        names = network_interface.split(",")
    else:
        return []
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise LaunchError("hvdlike.run: network_interfaces names no interface")
    return names


def host_list(hosts: Union[None, str, Sequence[HostSlots]], hostfile: Any,
              np: Optional[int]) -> List[HostSlots]:
    """Hosts from ``hosts`` (``"h1:2,h2:2"`` or :class:`HostSlots`) or ``hostfile``;
    ``localhost:np`` when neither is given."""
    if hosts is not None and hostfile is not None:
        raise LaunchError("hvdlike.run: pass hosts or hostfile, not both")
    if hostfile is not None:
        path = text_arg(hostfile, "hostfile")
        with api_terms():
            return read_hostfile(path)
    if hosts is None:
        return [HostSlots("localhost", np if np is not None else 1)]
    if isinstance(hosts, str):
        with api_terms():
            return parse_hosts(hosts)
    listed = list(hosts) if isinstance(hosts, (list, tuple)) else [hosts]
    if not listed or not all(isinstance(h, HostSlots) for h in listed):
        raise LaunchError("hvdlike.run: hosts must be a 'host:slots,...' string or a list of "
                          "HostSlots")
    return no_repeats([_checked_slots(i, entry) for i, entry in enumerate(listed)],
                       "hvdlike.run: hosts")


def _checked_slots(index: int, entry: HostSlots) -> HostSlots:
    """``hosts[index]`` checked as ``parse_hosts`` checks an entry of the string form:
    a ``[user@]host`` name ssh cannot take as an option, slots from 1 to MAX_RANKS."""
    where = f"hvdlike.run: hosts[{index}]"
    host = checked_name(entry.host, where)
    slots = count_arg(entry.slots, f"hosts[{index}].slots")
    if slots > MAX_RANKS:
        raise LaunchError(f"{where}: slots {slots} is more than the limit of {MAX_RANKS}")
    return HostSlots(host, slots)


def port_arg(value: Any, name: str) -> Optional[int]:
    """A TCP port, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not 1 <= value <= 65535:
        raise LaunchError(f"hvdlike.run: {name}={value!r} is not a TCP port (1-65535)")
    return int(value)


def seconds_arg(value: Any, name: str) -> float:
    """A number of seconds as the knob of field ``name`` takes it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise LaunchError(f"hvdlike.run: {name}={value!r} is not a number of seconds")
    try:
        return float(core_config.KNOBS_BY_FIELD[name].parse(str(float(value))))
    except ValueError as exc:
        raise LaunchError(f"hvdlike.run: {name}={value!r} is not valid: expected {exc}") \
            from None


def ssh_option_list(options: Any) -> List[str]:
    """``KEY=VALUE`` ssh options from a list of strings (one string is refused:
    taken as a list it would be its characters)."""
    if isinstance(options, (str, bytes)) or not isinstance(options, (list, tuple)):
        raise LaunchError(f"hvdlike.run: ssh_options must be a list of 'KEY=VALUE' strings, "
                          f"got {type(options).__name__} {options!r:.60}")
    for option in options:
        if not isinstance(option, str):
            raise LaunchError(f"hvdlike.run: ssh_options entries must be strings, got "
                              f"{type(option).__name__} {option!r:.60}")
        check_ssh_option(option, "hvdlike.run: ssh_options entry")
    return list(options)


def check_discovery_script(script: Optional[str], what: str) -> None:
    """A host discovery script given by path must not be a directory (running it
    would only say "Permission denied")."""
    import os

    if script and os.sep in script and os.path.isdir(os.path.expanduser(script)):
        raise LaunchError(f"{what} {script}: is a directory, not an executable script")


def check_ssh_option(option: str, what: str) -> None:
    key = option.partition("=")[0]
    if "=" not in option or not key.strip() or any(c.isspace() for c in key):
        raise LaunchError(f"{what} {option!r} is not valid: expected KEY=VALUE")


def mpi_arguments(mpi_args: Any) -> List[str]:
    """``mpi_args`` as mpirun arguments: one string (as in Horovod) or a list."""
    if mpi_args is None:
        return []
    if isinstance(mpi_args, str):
        try:
            return shlex.split(mpi_args)
        except ValueError as exc:
            raise LaunchError(f"hvdlike.run: mpi_args {mpi_args!r} is not valid: {exc}") from None
    if isinstance(mpi_args, (list, tuple)) and all(isinstance(a, str) for a in mpi_args):
        return list(mpi_args)
    raise LaunchError(f"hvdlike.run: mpi_args must be a str or a list of str, got "
                      f"{type(mpi_args).__name__}")


def elastic_settings(np: Optional[int], min_np: Optional[int], max_np: Optional[int],
                     discovery_script: Optional[str], slots: Optional[int],
                     reset_limit: Optional[int], cooldown_range: Any,
                     elastic_timeout: Optional[float]):
    """The elastic settings when any elastic argument is given, else None (and then
    none of the elastic-only arguments may be)."""
    from .elastic.launch import is_elastic, settings_from_flags

    if not is_elastic(min_np, max_np, discovery_script):
        for name, value in (("slots", slots), ("reset_limit", reset_limit),
                            ("cooldown_range", cooldown_range),
                            ("elastic_timeout", elastic_timeout)):
            if value is not None:
                raise LaunchError(f"hvdlike.run: {name} needs an elastic job (min_num_proc, "
                                  f"max_num_proc or host_discovery_script)")
        return None
    if cooldown_range is not None:
        try:
            lo, hi = (float(v) for v in cooldown_range)
        except (TypeError, ValueError):
            raise LaunchError(f"hvdlike.run: cooldown_range must be (min seconds, max "
                              f"seconds), got {cooldown_range!r}") from None
        cooldown_range = (lo, hi)
    if elastic_timeout is not None:
        try:
            elastic_timeout = float(elastic_timeout)
        except (TypeError, ValueError):
            raise LaunchError(f"hvdlike.run: elastic_timeout must be seconds, got "
                              f"{elastic_timeout!r}") from None
    reset_limit = count_arg(reset_limit, "reset_limit", 0)
    with api_terms():
        return settings_from_flags(np, min_np, max_np, discovery_script, slots, reset_limit,
                                   elastic_timeout, cooldown_range)


def horovod_arguments(num_proc, np, min_num_proc, min_np, max_num_proc, max_np,
                      executable, python) -> Dict[str, Any]:
    """Horovod's names and their older aliases (``np``, ``min_np``, ``max_np``) reconciled."""
    if executable is not None and python is not None and executable != python:
        raise LaunchError(f"hvdlike.run: executable={executable!r} and python={python!r} "
                          f"disagree; pass one of them")
    def either(name, value, alias, other):  # checked under the name the caller used
        return count_arg(_one_of(name, value, alias, other), name if value is not None else alias)

    return {
        "np": either("num_proc", num_proc, "np", np),
        "min_np": either("min_num_proc", min_num_proc, "min_np", min_np),
        "max_np": either("max_num_proc", max_num_proc, "max_np", max_np),
        "python": text_arg(executable if executable is not None else python,
                        "executable" if executable is not None else "python"),
    }


def engine(use_gloo: Any, use_mpi: Any) -> bool:
    """Whether the ranks start under mpirun (``use_mpi``); Gloo is the default."""
    if use_gloo and use_mpi:
        raise LaunchError("hvdlike.run: use_gloo and use_mpi cannot both be set")
    return bool(use_mpi)


def slots_total(hosts: Sequence[HostSlots]) -> int:
    return sum(h.slots for h in hosts)


def checked_knobs(knobs: Optional[Mapping[str, Any]], disable_cache: Any) -> Dict[str, Any]:
    """``knobs``, checked to be a mapping. Horovod's ``disable_cache`` is accepted and
    changes nothing, as ``--disable-cache``: in Horovod it turns off the launcher's
    cache of host checks, which hvdlike does not keep (the response cache is the
    ``cache_capacity`` knob)."""
    del disable_cache
    merged: Dict[str, Any] = dict(knobs) if isinstance(knobs, Mapping) else {}
    if knobs is not None and not isinstance(knobs, Mapping):
        raise TypeError(f"hvdlike.run: knobs must be a mapping of knob field to value, got "
                        f"{type(knobs).__name__}")
    return merged
