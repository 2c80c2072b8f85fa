"""Errors the launcher reports to its user."""


class LaunchError(Exception):
    """Bad input or a failed pre-condition; its message is one line shown to the user."""
