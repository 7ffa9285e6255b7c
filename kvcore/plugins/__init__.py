"""The plugin machinery: which backends exist and which one a request gets.

- :mod:`kvcore.plugins.manager`: loads the core's default hook answers and every ``kvcore`` entry point into a
  :class:`Registry` (backends, model sections, block formats, failed plugins);
- :mod:`kvcore.plugins.builtin`: the core's ``trylast`` answers to the layout and build hooks (the request table
  and the token / paged allocators);
- :mod:`kvcore.plugins.selection`: choosing a backend for a request, and explaining the choice;
- :mod:`kvcore.plugins.lazy`: ``lazy_getattr``, how a family package exports its public names without importing
  its kernels until one is used.

May import: :mod:`kvcore.hookspecs`, :mod:`kvcore.backend`, :mod:`kvcore.layout`, :mod:`kvcore.errors`, and (in
the built-in answers, when a pool is built) :mod:`kvcore.pools` and :mod:`kvcore.allocators`.  Nothing here
imports the config, the planner or a family.
"""

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module defining it, imported on first use (``import kvcore.plugins`` imports no torch)
_PUBLIC = {name: "kvcore.plugins.manager" for name in
           ("CORE_PLUGIN_NAME", "ENTRY_POINT_GROUP", "PluginFailure", "Registry", "get_registry", "load_registry")}  # fmt: skip
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC, submodules=True)
