"""A well-behaved generic plugin registering backend 'plain' (never wins over mha: lower priority)."""

from kvcore import hookimpl

from fake_plugins._common import spec


@hookimpl
def kvcore_register_backends():
    return [spec("plain", priority=-1)]
