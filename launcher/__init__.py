"""hvdlike-run: the launcher. See :mod:`hvdlike.launcher.cli` for the manual."""
