"""Configuration: what an engine config may say and how it is read.

- :mod:`kvcore.config.schema`: the attrs schema of every section, ``key()`` (a documented field), dtype names,
  the cross-field checks, a backend's ``kv_cache.options`` validated into its options class;
- :mod:`kvcore.config.loading`: config groups, the engine YAML, dotlist overrides, merged over the schema;
- :mod:`kvcore.config.hf`: ``model=hf:PATH``, a Hugging Face ``config.json`` read into a model section;
- :mod:`kvcore.config.keys`: every key described, for ``kvcore config`` and docs/configuration.md;
- :mod:`kvcore.config.files`: the groups and where their files are (file system only: no torch).

May import: :mod:`kvcore.errors` and :mod:`kvcore.kernels.kernel_mode` (the kernel modes a key accepts), and
:mod:`kvcore.plugins.lazy` (the package's names are imported on first use, so reaching :mod:`kvcore.config.files`
imports no torch).  It imports no other plugin machinery: the plugins' model sections and block formats come from the registry its caller
passes (:func:`kvcore.load_config` passes the installed plugins').
"""

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module defining it, imported on first use
_PUBLIC = {
    **dict.fromkeys(("KeyDoc", "all_keys", "describe_keys", "keys_markdown"), "kvcore.config.keys"),
    **dict.fromkeys(("GROUPS", "available_options", "packaged_configs"), "kvcore.config.files"),
    **dict.fromkeys(("load_config", "load_model", "to_yaml"), "kvcore.config.loading"),
    **dict.fromkeys(("DTYPE_ALIASES", "EngineConfig", "HardwareConfig", "KVCacheConfig", "MemoryConfig", "ModelConfig",
                     "ParallelConfig", "SpeculativeConfig", "DisaggregationConfig", "engine_schema", "key", "parse_dtype", "positive", "structured_options",
                     "validate"), "kvcore.config.schema"),
}  # fmt: skip
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC, submodules=True)
