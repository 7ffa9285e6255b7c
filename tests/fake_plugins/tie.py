"""A second acme-vendor backend, equally ranked with fake_plugins.acme's."""

from kvcore import hookimpl

from fake_plugins._common import spec


@hookimpl
def kvcore_register_backends():
    yield spec("acme-tie", vendors=("acme",))
