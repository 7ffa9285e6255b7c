"""A vendor plugin: backend 'acme' serves only hardware.vendor=acme."""

from kvcore import hookimpl

from fake_plugins._common import spec


@hookimpl
def kvcore_register_backends():
    return [spec("acme", vendors=("acme",), description="acme vendor pool")]
