"""A plugin returning a dict instead of BackendSpec records."""

from kvcore import hookimpl


@hookimpl
def kvcore_register_backends():
    return [{"name": "malformed", "attention": "mha"}]
