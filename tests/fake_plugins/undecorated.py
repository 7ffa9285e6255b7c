"""A plugin whose misspelt hook also lacks the @kvcore.hookimpl decorator."""

from fake_plugins._common import spec


def kvcore_register_backend():
    return [spec("undecorated")]
