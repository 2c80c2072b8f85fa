"""The ``hvdlike-run`` console script.

It imports the launcher itself, so that a Ctrl-C while the launcher is still
loading (before :func:`hvdlike.launcher.cli.main` handles interrupts) ends it
with the usual one line and status 130, not a traceback of the import.
"""

import sys


def main() -> int:
    try:
        from .interrupts import deferred

        with deferred():
            from .cli import main as launch
    except KeyboardInterrupt:
        sys.stderr.write("hvdlike-run: interrupted\n")
        return 130
    return launch()


if __name__ == "__main__":
    sys.exit(main())
