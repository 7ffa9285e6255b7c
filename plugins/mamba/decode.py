"""The request table of a hybrid model on a decode worker (prefill/decode disaggregation):
:class:`HybridMambaDecodeReqToTokenPool`, SGLang's class of that name, with the keywords its KV-cache configurator
passes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

from kvcore.pools import unsupported
from kvcore_mamba.pool import HybridReqToTokenPool, MambaPool

__all__ = ["HybridMambaDecodeReqToTokenPool"]

logger = logging.getLogger(__name__)


class HybridMambaDecodeReqToTokenPool(HybridReqToTokenPool):
    """A :class:`~kvcore_mamba.pool.HybridReqToTokenPool` with ``pre_alloc_size`` request rows beyond ``size``, for
    requests whose KV and states are still arriving from a prefill worker (as
    :class:`kvcore.pools.DecodeReqToTokenPool` adds them to the plain table): rows ``1 .. size + pre_alloc_size``
    are handed out, and each needs its state slots.

    State slots: with ``mamba_pool`` given (kvcore's planner reserved them: ``(size + pre_alloc_size)`` requests'
    worth in decode mode), that pool; otherwise a :class:`~kvcore_mamba.pool.MambaPool` of ``mamba_size`` slots,
    raised to ``(size + pre_alloc_size) x`` the slots one request holds (one, plus its ping-pong track slots with
    ``enable_mamba_extra_buffer``) when smaller, with a warning, as SGLang does.  Per-draft-token states (under
    speculative decoding) are kept for ``size`` running requests.

    SGLang's keywords for features kvcore does not have are refused with a one-line ``ConfigError`` when they ask
    for them: ``enable_linear_replayssm_spec=True``, ``short_conv_layer_ids`` (short-convolution states),
    ``ngram_context_len > 0`` (n-gram speculative context); ``short_conv_state_shape`` and ``ngram_eos_token_id``
    belong to those and are otherwise unused.  The rest are :class:`~kvcore_mamba.pool.HybridReqToTokenPool`'s.
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: str,
        enable_memory_saver: bool = False,
        cache_params: Any = None,
        mamba_layer_ids: Optional[Sequence[int]] = None,
        speculative_num_draft_tokens: Optional[int] = None,
        enable_mamba_extra_buffer: bool = False,
        pre_alloc_size: int = 0,
        enable_overlap_schedule: Optional[bool] = None,
        mamba_size: Optional[int] = None,
        start_layer: Optional[int] = None,
        speculative_eagle_topk: Optional[int] = None,
        linear_replayssm_cache_len: int = 16,
        mamba_envelope_layout: bool = False,
        enable_linear_replayssm_spec: bool = False,
        short_conv_layer_ids: Optional[Sequence[int]] = None,
        short_conv_state_shape: Optional[tuple[int, int]] = None,
        ngram_context_len: int = 0,
        ngram_eos_token_id: int = 0,
        mamba_pool: MambaPool | None = None,
        kernels: str = "auto",
    ):
        owner = "HybridMambaDecodeReqToTokenPool"
        if enable_linear_replayssm_spec:
            raise unsupported(owner, "enable_linear_replayssm_spec", enable_linear_replayssm_spec,
                              "ReplaySSM for speculative decoding", "pass enable_linear_replayssm_spec=False")  # fmt: skip
        if short_conv_layer_ids:
            raise unsupported(owner, "short_conv_layer_ids", list(short_conv_layer_ids),
                              "short-convolution states beside the linear-attention ones",
                              "pass short_conv_layer_ids=None")  # fmt: skip
        if ngram_context_len:
            raise unsupported(owner, "ngram_context_len", ngram_context_len,
                              "the n-gram speculative context kept per request", "pass ngram_context_len=0")  # fmt: skip
        if pre_alloc_size < 0:
            raise ValueError(f"{owner}: pre_alloc_size must be 0 or more, got {pre_alloc_size}")
        if cache_params is None:
            raise TypeError(f"{owner} needs cache_params (the linear layers' state shapes)")
        rows = size + pre_alloc_size
        track = 0
        if enable_mamba_extra_buffer:
            track = 1 if enable_overlap_schedule is False else 2
        needed = rows * (1 + track)
        if mamba_pool is None and (mamba_size is None or mamba_size < needed):
            if mamba_size is not None:
                logger.warning("%s: mamba_size=%d is less than the %d state slots %d requests (%d running, %d "
                               "pre-allocated) x %d slots need; using %d", owner, mamba_size, needed, rows, size,
                               pre_alloc_size, 1 + track, needed)  # fmt: skip
            mamba_size = needed
        super().__init__(
            size=rows, mamba_size=mamba_size or needed, mamba_spec_state_size=size, max_context_len=max_context_len,
            device=device, enable_memory_saver=enable_memory_saver, cache_params=cache_params,
            mamba_layer_ids=mamba_layer_ids, enable_mamba_extra_buffer=enable_mamba_extra_buffer,
            speculative_num_draft_tokens=speculative_num_draft_tokens, speculative_eagle_topk=speculative_eagle_topk,
            enable_overlap_schedule=enable_overlap_schedule, start_layer=start_layer,
            linear_replayssm_cache_len=linear_replayssm_cache_len, mamba_envelope_layout=mamba_envelope_layout,
            mamba_pool=mamba_pool, kernels=kernels,
        )  # fmt: skip
        self.size = size  # the running requests; the table holds size + pre_alloc_size rows past the padding one
        self.pre_alloc_size = pre_alloc_size
