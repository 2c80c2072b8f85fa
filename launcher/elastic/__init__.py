"""Elastic jobs in the launcher: host discovery, blacklist, rank assignment, the driver.

Layers, as for static jobs: :mod:`.settings` (flags as a dataclass),
:mod:`.discovery` (where hosts come from), :mod:`.host_table` (which are usable
now), :mod:`.assignment` (who is which rank in the next generation; pure),
:mod:`.driver` (processes, generations, failure).
"""
