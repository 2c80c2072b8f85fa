"""The benchmarks' ``--allocator`` setting: glibc thresholds the ranks start with.

``steady`` (the default) fixes glibc's trim and mmap thresholds in the ranks'
environment, so that a freed gradient or activation buffer is reused by the
next step instead of being unmapped and faulted in again. Left adaptive
(``default``), whether a contender pays that depends on the order of its
frees, which differs between contenders and runs (see docs/performance.md,
"Running the benchmark"). Values already in the environment win.
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Tuple

# Freed memory up to 1 GiB stays with the process, and blocks below 32 MiB
# come from the heap instead of a mapping of their own.
STEADY = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
CHOICES = ("steady", "default")


def add_argument(parser) -> None:
    parser.add_argument("--allocator", choices=CHOICES, default="steady",
                        help="steady (default): fix glibc's trim and mmap thresholds in the "
                             "ranks, so no contender maps and faults in its buffers afresh "
                             "every step; default: leave glibc's adaptive thresholds")


def environment(choice: str, base: Optional[Mapping[str, str]] = None,
                **extra: str) -> Tuple[Dict[str, str], str]:
    """(environment for the ranks, a description of their allocator settings)."""
    env = dict(os.environ if base is None else base, **extra)
    if choice == "steady":
        for key, value in STEADY.items():
            env.setdefault(key, value)  # a value the caller set wins
    fixed = [f"{k}={env[k]}" for k in sorted(STEADY) if k in env]
    return env, ("glibc thresholds " + ", ".join(fixed)) if fixed else "default"
