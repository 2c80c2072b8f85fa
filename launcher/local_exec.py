"""Starting a rank on this machine: the rank helper run by the launcher's Python."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from . import remote

HELPER_MODULE = "hvdlike.launcher.remote"
# The helper is run as a plain script when its path is known: it needs only the
# standard library, and skipping the package import keeps each rank's start cheap.
HELPER_SCRIPT = os.path.abspath(remote.__file__)


def helper_command(python: str = sys.executable, script: Optional[str] = HELPER_SCRIPT) -> List[str]:
    """The command that runs the rank helper (see :mod:`.remote`) with ``python``.

    Args:
        python: interpreter to use.
        script: path of ``remote.py`` on the target host; None runs it as a module
            (``-m hvdlike.launcher.remote``), which also proves hvdlike imports.
    """
    if script:
        return [python, script]
    return [python, "-m", HELPER_MODULE]
