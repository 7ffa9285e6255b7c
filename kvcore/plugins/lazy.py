"""Public names of a plugin package, imported on first use.

A family package (``kvcore_mha``, ...) exports its pool classes from modules that import Triton kernels, and
``@triton.jit`` decides between interpreted and compiled kernels when such a module is imported.  So the
package imports none of them itself: it lists each public name with the module that defines it, and a module
``__getattr__`` imports that module when the name is first asked for.  Every family's ``__init__.py`` is::

    from kvcore.plugins.lazy import lazy_getattr

    _PUBLIC = {"MHATokenToKVPool": "kvcore_mha.pool", "mha_layout": "kvcore_mha.layout"}
    __all__ = sorted(_PUBLIC)
    __getattr__ = lazy_getattr(__name__, _PUBLIC)

``__all__`` is what the package makes public: what engines and other families may import from it.

It imports only :mod:`importlib` itself; reaching it loads :mod:`kvcore` and :mod:`kvcore.plugins`, which load no
Triton kernel either.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, public: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: name ``n`` of ``public`` is ``getattr(module, n)`` of the module
    ``public[n]`` names (absolute, or relative to ``package``: ``".pool"``), imported on first use; any other name
    is an :class:`AttributeError`, as for a module without the hook.  Names are not cached in the package, so the
    package always answers what the defining module holds."""
    public = dict(public)

    def __getattr__(name: str) -> Any:
        module = public.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    __getattr__.__qualname__ = f"{package}.__getattr__"
    return __getattr__
