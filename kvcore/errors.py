"""kvcore's exception types.  Every message says what was wrong, where, and what to do instead."""


class KVCoreError(Exception):
    """Base class of kvcore's errors."""


class ConfigError(KVCoreError, ValueError):
    """A config value is missing, mistyped or inconsistent; the message names the full key path."""


class PluginError(KVCoreError):
    """A plugin failed to load, or the selected backend is unavailable."""


class SelectionError(KVCoreError):
    """No registered backend (or more than one, equally ranked) serves the request.  The message says what to do;
    ``details`` holds one line per registered backend saying why it does not serve the request (``--explain``
    prints them)."""

    def __init__(self, message: str, details: tuple[str, ...] = ()):
        super().__init__(message)
        self.details = tuple(details)


class PlanningError(KVCoreError, ValueError):
    """The memory budget does not fit the request; the message says which key to change and to what."""
