"""A plugin declaring the core's plugin API version (kvcore.hookspecs.API_VERSION): loads."""

from kvcore import hookimpl
from kvcore.hookspecs import API_VERSION

from fake_plugins._common import spec

KVCORE_API_VERSION = API_VERSION


@hookimpl
def kvcore_register_backends():
    return [spec("current_api", priority=-1)]
