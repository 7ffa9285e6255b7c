"""A plugin written for the plugin API before this one (it declares the previous major): refused when it loads."""

from kvcore import hookimpl
from kvcore.hookspecs import API_VERSION

from fake_plugins._common import spec

KVCORE_API_VERSION = str(int(API_VERSION.split(".")[0]) - 1)


@hookimpl
def kvcore_register_backends():
    return [spec("old_api", priority=-1)]
