"""A plugin that misspells the hook name (missing the final 's')."""

from kvcore import hookimpl

from fake_plugins._common import spec


@hookimpl
def kvcore_register_backend():
    return [spec("misspelt")]
