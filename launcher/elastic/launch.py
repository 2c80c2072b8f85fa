"""Entry of an elastic job from the CLI: first discovery, the job, the driver."""

from __future__ import annotations

import dataclasses
import sys

from ..errors import LaunchError
from ..launch_config import LaunchConfig
from .discovery import FixedDiscovery, LastGood, ScriptDiscovery
from .settings import ElasticSettings


def is_elastic(min_np, max_np, discovery_script) -> bool:
    """Whether the flags ask for an elastic job."""
    return any(v is not None for v in (min_np, max_np, discovery_script))


def settings_from_flags(np, min_np, max_np, discovery_script, slots_per_host, reset_limit,
                        elastic_timeout, cooldown_range) -> ElasticSettings:
    """The elastic settings; ``-np`` defaults to ``--min-np`` (else ``--max-np``),
    ``--min-np`` to ``-np``, ``--max-np`` to unbounded (every usable slot).

    Raises:
        LaunchError: the values disagree (see :func:`.settings.validate`).
    """
    from .settings import validate

    if np is None:
        np = min_np if min_np is not None else max_np
    if np is None:
        raise LaunchError("-np or --min-np is required for an elastic job")
    if min_np is None and max_np is not None and np > max_np:  # --min-np would be -np
        raise LaunchError(f"-np {np} is more than --max-np {max_np}")
    settings = ElasticSettings(
        min_np=min_np if min_np is not None else np,
        max_np=max_np if max_np is not None else sys.maxsize,
        np=np, discovery_script=discovery_script, slots_per_host=slots_per_host,
        reset_limit=reset_limit, cooldown_range=tuple(cooldown_range) if cooldown_range else None,
    )
    if elastic_timeout is not None:
        settings.elastic_timeout = elastic_timeout
    return validate(settings)


def discovery_for(config: LaunchConfig, settings: ElasticSettings, warn):
    """The job's host source, run once, and ``config`` placed on what it found.

    Raises:
        LaunchError: the first discovery failed or found no host.
    """
    if settings.discovery_script:
        source = ScriptDiscovery(settings.discovery_script, settings.slots_per_host)
    else:
        source = FixedDiscovery(config.hosts)
    discovery = LastGood(source, warn=lambda text: warn(text))
    hosts = discovery.find()  # the first run's failure is the launcher's error
    if not hosts:
        raise LaunchError("host discovery found no hosts to start on")
    total = sum(h.slots for h in hosts)
    if total < settings.np:
        warn(f"-np {settings.np}: {total} slot(s) found; starting with {total}, more as "
             f"slots appear")
    return discovery, dataclasses.replace(config, hosts=hosts, np=min(settings.np, total))


def run_elastic(config: LaunchConfig, settings: ElasticSettings, say) -> int:
    """Run an elastic job; return the launcher's exit status.

    Raises:
        LaunchError: the first discovery failed or found no host.
    """
    from ..job import Job
    from .driver import ElasticDriver

    discovery, config = discovery_for(config, settings, say)
    job = Job(config)
    if config.dry_run:
        from ..job import print_dry_run

        job.check_here()  # what a real start would refuse first, a dry run refuses too
        print_dry_run(job)
        return 0
    with job:
        result = ElasticDriver(job, settings, discovery).run()
    if result.exit_code != 0 and result.interrupted is None:
        say("job failed: " + result.summary().replace("\n", "\nhvdlike-run: "))
    elif result.interrupted:
        say(f"job interrupted ({result.interrupted}); every rank was stopped")
    elif result.generations > 1:
        formed = result.sizes[:-1] if result.unformed else result.sizes
        if len(formed) > 1:
            text = (f"job finished after {len(formed) - 1} re-form(s), sizes "
                    f"{' -> '.join(map(str, formed))}")
        else:
            text = f"job finished in generation 1 ({formed[0]} rank(s))"
        if result.unformed:
            text += (f"; generation {result.unformed} ({result.sizes[-1]} rank(s)) was "
                     "completed before it formed")
        say(text + ("\n" + result.summary() if result.lost else "").replace(
            "\n", "\nhvdlike-run: "))
    return result.exit_code
