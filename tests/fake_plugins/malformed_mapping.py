"""A plugin whose hook returns a dict (not an iterable of records)."""

from kvcore import hookimpl


@hookimpl
def kvcore_register_backends():
    return {"name": "malformed", "attention": "mha"}
