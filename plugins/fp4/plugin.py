"""The block-scaled family as a kvcore plugin (entry point ``fp4``); its backends come with its pools."""

from __future__ import annotations

from kvcore.hookspecs import hookimpl


@hookimpl
def kvcore_register_backends():
    return []
