"""Configuration: what an engine config may say and how it is read.

- :mod:`kvcore.config.schema`: the attrs schema of every section, ``key()`` (a documented field), dtype names,
  the cross-field checks, a backend's ``kv_cache.options`` validated into its options class;
- :mod:`kvcore.config.loading`: config groups, the engine YAML, dotlist overrides, merged over the schema;
- :mod:`kvcore.config.hf`: ``model=hf:PATH``, a Hugging Face ``config.json`` read into a model section;
- :mod:`kvcore.config.keys`: every key described, for ``kvcore config`` and docs/configuration.md.

May import: :mod:`kvcore.errors` and :mod:`kvcore.kernels.kernel_mode` (the kernel modes a key accepts).  It
imports no plugin machinery: the plugins' model sections and block formats come from the registry its caller
passes (:func:`kvcore.load_config` passes the installed plugins').
"""

from kvcore.config.keys import KeyDoc, all_keys, describe_keys, keys_markdown
from kvcore.config.loading import GROUPS, available_options, load_config, packaged_configs, to_yaml
from kvcore.config.schema import (
    DTYPE_ALIASES,
    EngineConfig,
    HardwareConfig,
    KVCacheConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    engine_schema,
    key,
    parse_dtype,
    positive,
    structured_options,
    validate,
)

__all__ = [
    "DTYPE_ALIASES",
    "EngineConfig",
    "GROUPS",
    "HardwareConfig",
    "KVCacheConfig",
    "KeyDoc",
    "MemoryConfig",
    "ModelConfig",
    "ParallelConfig",
    "all_keys",
    "available_options",
    "describe_keys",
    "engine_schema",
    "key",
    "keys_markdown",
    "load_config",
    "packaged_configs",
    "parse_dtype",
    "positive",
    "structured_options",
    "to_yaml",
    "validate",
]
