"""SGLang's state-pool keywords as kvcore checks them (:func:`check_state_features`, :func:`state_layer_ids`), and
the keys an error names when state slots run out (:data:`MORE_SLOTS`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from kvcore.errors import ConfigError
from kvcore.pools import unsupported

__all__ = ["MORE_SLOTS", "check_state_features", "state_layer_ids"]

#: the keys that give a hybrid model more state slots, for the errors that say so.
MORE_SLOTS = ("raise kv_cache.options.max_mamba_cache_size (or kv_cache.options.mamba_full_memory_ratio), or lower "
              "memory.max_running_requests")  # fmt: skip


def check_state_features(owner: str, *, speculative_eagle_topk: Optional[int] = None,
                         enable_linear_replayssm: bool = False, linear_replayssm_cache_len: int = 16,
                         envelope_keyword: str = "envelope_layout", envelope_layout: bool = False) -> None:  # fmt: skip
    """SGLang's state-pool keywords for features kvcore does not have: their default (off) values pass, any other
    is a one-line :class:`~kvcore.errors.ConfigError` naming the keyword."""
    if enable_linear_replayssm:
        raise unsupported(owner, "enable_linear_replayssm", enable_linear_replayssm,
                          "ReplaySSM (a ring of recent recurrent updates kept beside each temporal state)",
                          "kvcore keeps the temporal state alone: pass enable_linear_replayssm=False")  # fmt: skip
    if envelope_layout:
        raise unsupported(owner, envelope_keyword, envelope_layout,
                          "the page-major envelope of the linear-attention states (every layer of a slot in one block)",
                          f"kvcore stacks each state tensor per layer: pass {envelope_keyword}=False (the KV pools "
                          f"may still be page-major)")  # fmt: skip
    if not isinstance(linear_replayssm_cache_len, int) or linear_replayssm_cache_len <= 0:
        raise ConfigError(f"{owner}(linear_replayssm_cache_len={linear_replayssm_cache_len!r}): must be a positive int "
                          f"(SGLang's default is 16)")  # fmt: skip
    if speculative_eagle_topk is not None and (not isinstance(speculative_eagle_topk, int) or speculative_eagle_topk < 1):
        raise ConfigError(f"{owner}(speculative_eagle_topk={speculative_eagle_topk!r}): must be None or a positive int")


def state_layer_ids(owner: str, cache_params: Any, mamba_layer_ids: Optional[Sequence[int]]) -> list[int]:
    """The global ids of the linear layers whose states a pool keeps: ``mamba_layer_ids`` (SGLang's configurator
    passes this rank's share of ``cache_params.layers``), checked to be distinct layers of ``cache_params``; all of
    ``cache_params.layers`` when None."""
    known = [int(i) for i in cache_params.layers]
    if mamba_layer_ids is None:
        return known
    ids = [int(i) for i in mamba_layer_ids]
    unknown = [i for i in ids if i not in set(known)]
    if unknown or len(set(ids)) != len(ids):
        what = f"layers {unknown} are not" if unknown else "layers repeat; they must be distinct"
        raise ConfigError(f"{owner}(mamba_layer_ids={ids}): {what} linear-attention layers of cache_params.layers "
                          f"{known}; pass this rank's linear layers, a subset of cache_params.layers")  # fmt: skip
    return ids
