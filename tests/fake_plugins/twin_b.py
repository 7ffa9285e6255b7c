"""Registers backend 'twin' (so does fake_plugins.twin_a)."""

from kvcore import hookimpl

from fake_plugins._common import spec


@hookimpl
def kvcore_register_backends():
    return [spec("twin", vendors=("twinco",))]
