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

It imports only :mod:`importlib` itself, and reaching it loads :mod:`kvcore` and :mod:`kvcore.plugins`, which use
it the same way: they import nothing (torch included) until one of their names is used, so ``kvcore --help``
does not wait for torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, public: Mapping[str, str], submodules: bool = False) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: name ``n`` of ``public`` is ``getattr(module, n)`` of the module
    ``public[n]`` names (absolute, or relative to ``package``: ``".pool"``), imported on first use; with
    ``submodules``, any other name is the package's submodule of that name when it has one (``kvcore.plugins.manager``
    without importing it first, as an eager package would have); anything else is an :class:`AttributeError`, as
    for a module without the hook.  Names are not cached in the package, so the package always answers what the
    defining module holds."""
    public = dict(public)

    def __getattr__(name: str) -> Any:
        module = public.get(name)
        if module is not None:
            return getattr(importlib.import_module(module, package), name)
        if submodules and not name.startswith("__"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    __getattr__.__qualname__ = f"{package}.__getattr__"
    return __getattr__
