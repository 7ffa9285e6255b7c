"""A hybrid linear-attention model on one unified memory (:func:`init_unified_mamba_pools`): full-attention KV
pages on the low side, per-request states on the high side, SGLang's factory keywords.

The pools keep the split pools' interfaces (:class:`~kvcore_mamba.pool.HybridLinearKVPool`,
:class:`~kvcore_unified.states.UnifiedHybridReqToTokenPool`, SGLang's paged allocator); what an engine changes is
what SGLang's unified pool asks of it too: the token and state ids it holds are virtual, and its attention and
linear-attention kernels read the paged views at the physical tokens ``token_to_kv_pool.full_kv_pool.translate_loc``
gives and the state views at the slots ``req_to_token_pool.translate_mamba_indices`` gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from kvcore_mamba.pool import HybridLinearKVPool

from kvcore.errors import ConfigError
from kvcore.pools import check_memory_saver, unsupported
from kvcore_unified.allocator import LOW
from kvcore_unified.bundle import UnifiedPoolBundle
from kvcore_unified.full_pages import UnifiedPagedAllocator, kv_page_bytes, latent_page_bytes
from kvcore_unified.memory import UnifiedMemory
from kvcore_unified.states import UnifiedHybridReqToTokenPool, UnifiedMambaPool, state_envelope

__all__ = ["init_unified_mamba_pools", "unified_hybrid_linear_kv_pool", "unified_token_allocator", "full_page_bytes",
           "UnifiedHybridLinearKVPool"]


def full_page_bytes(*, layers: int, page_size: int, kv_cache_dtype: torch.dtype, use_mla: bool, head_num: int = 0,
                    head_dim: int = 0, kv_lora_rank: int | None = None, qk_rope_head_dim: int | None = None) -> int:  # fmt: skip
    """One page of every full-attention layer, page-major: K and V rows of MHA, or MLA's latent rows."""
    if use_mla:
        return latent_page_bytes(layers, page_size, int(kv_lora_rank) + int(qk_rope_head_dim), kv_cache_dtype)
    return kv_page_bytes(layers, page_size, head_num, head_dim, kv_cache_dtype)


def init_unified_mamba_pools(
    *,
    device: str,
    kv_cache_dtype: torch.dtype,
    head_num: int,
    head_dim: int,
    page_size: int,
    start_layer: int,
    end_layer: int,
    is_draft_worker: bool,
    use_mla_backend: bool,
    mamba_layer_ids: Sequence[int],
    full_attention_layer_ids: Sequence[int],
    mamba2_cache_params: Any,
    model_context_len: int,
    extra_max_context_len: int,
    max_total_num_tokens: int,
    max_mamba_cache_size: int,
    max_num_reqs: int,
    enable_memory_saver: bool = False,
    enable_mamba_extra_buffer: bool = False,
    enable_mamba_extra_buffer_lazy: bool = False,
    speculative_num_draft_tokens: Optional[int] = None,
    disable_overlap_schedule: bool = False,
    need_sort: bool = False,
    mamba_full_memory_ratio: Optional[float] = None,
    forward_stream: Any = None,
    lazy_compaction: bool = True,
    v_head_dim: Optional[int] = None,
    kv_lora_rank: Optional[int] = None,
    qk_rope_head_dim: Optional[int] = None,
    fused_draft: Any = None,
    decode_pre_alloc_size: int = 0,
    unified_total_bytes: Optional[int] = None,
    kernels: str = "auto",
) -> UnifiedPoolBundle:
    """The pools of a hybrid linear-attention model over one memory of the split pools' bytes:
    ``max_total_num_tokens`` full-attention tokens' pages plus ``max_mamba_cache_size`` state slots (or
    ``unified_total_bytes`` for the tokens' part), which either kind may then fill.

    SGLang's keywords, with its meaning; ``use_mla_backend`` needs ``kv_lora_rank`` and ``qk_rope_head_dim`` (a
    Kimi-Linear-shaped model).  ``mamba_full_memory_ratio`` only sized the budget (informational, as in SGLang);
    ``lazy_compaction`` (SGLang's default, True): a side compacts only when the other needs the bytes its frees left
    (False: at every free; :class:`~kvcore_unified.memory.UnifiedMemory`).  ``forward_stream`` is accepted: moves run
    on the current stream, after the work queued before them.  ``need_sort`` is accepted: freed pages go straight
    back to the shared range.

    ``decode_pre_alloc_size`` (a disaggregated decode worker's rows for requests whose KV is still arriving) makes the
    request table SGLang's ``HybridMambaDecodeReqToTokenPool`` over the same unified state pool.

    :raises ConfigError: for a draft worker's pools (``is_draft_worker``, ``fused_draft``), the memory saver, or a
        budget that holds not even one request (a page and its state slots), naming what to change.
    """
    owner = "init_unified_mamba_pools"
    check_memory_saver(enable_memory_saver)
    refused = {"is_draft_worker": (is_draft_worker, False), "fused_draft": (fused_draft, None)}
    for keyword, (value, default) in refused.items():
        if value is not default and value != default:
            raise unsupported(owner, keyword, value, "a draft worker's unified pools",
                              f"pass {keyword}={default!r}, or build the split pools (memory.unified=false)")  # fmt: skip
    full_ids = [int(i) for i in full_attention_layer_ids]
    layer_ids = [int(i) for i in mamba_layer_ids]
    if use_mla_backend and (kv_lora_rank is None or qk_rope_head_dim is None):
        raise ConfigError(f"{owner}(use_mla_backend=True) needs kv_lora_rank and qk_rope_head_dim")
    page_bytes = full_page_bytes(layers=len(full_ids), page_size=page_size, kv_cache_dtype=kv_cache_dtype,
                                 use_mla=use_mla_backend, head_num=head_num, head_dim=head_dim, kv_lora_rank=kv_lora_rank,
                                 qk_rope_head_dim=qk_rope_head_dim)  # fmt: skip
    envelope = state_envelope(mamba2_cache_params, len(layer_ids))
    token_bytes = unified_total_bytes if unified_total_bytes is not None else -(-max_total_num_tokens // page_size) * page_bytes
    budget = token_bytes + max_mamba_cache_size * envelope.unit_bytes
    one_request = 1 + (0 if not enable_mamba_extra_buffer else 1 if enable_mamba_extra_buffer_lazy else
                       1 if disable_overlap_schedule else 2)  # fmt: skip
    floor = page_bytes + one_request * envelope.unit_bytes
    if budget < floor:
        raise ConfigError(f"{owner}: a unified memory of {budget} bytes holds not even one request ({page_bytes} bytes "
                          f"of a page of every full-attention layer and {one_request} state slots of "
                          f"{envelope.unit_bytes}): raise the memory budget (max_total_num_tokens / "
                          f"max_mamba_cache_size) or lower the model's dimensions")  # fmt: skip
    spec_rows = max_num_reqs if speculative_num_draft_tokens is not None else 0
    token_to_kv_pool = unified_hybrid_linear_kv_pool(
        budget_bytes=budget, device=device, kv_cache_dtype=kv_cache_dtype, head_num=head_num, head_dim=head_dim,
        v_head_dim=v_head_dim, page_size=page_size, start_layer=start_layer, end_layer=end_layer,
        full_attention_layer_ids=full_ids, mamba_layer_ids=layer_ids, cache_params=mamba2_cache_params,
        use_mla=use_mla_backend, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
        spec_state_size=spec_rows, speculative_num_draft_tokens=speculative_num_draft_tokens, kernels=kernels,
        lazy_compaction=lazy_compaction,
    )  # fmt: skip
    states = token_to_kv_pool.mamba_pool
    table = dict(mamba_pool=states, size=max_num_reqs, max_context_len=model_context_len + extra_max_context_len,
                 device=device, cache_params=mamba2_cache_params, mamba_layer_ids=layer_ids,
                 enable_mamba_extra_buffer=enable_mamba_extra_buffer,
                 speculative_num_draft_tokens=speculative_num_draft_tokens,
                 enable_overlap_schedule=not disable_overlap_schedule, start_layer=start_layer, kernels=kernels)  # fmt: skip
    if decode_pre_alloc_size:
        from kvcore_mamba.decode import HybridMambaDecodeReqToTokenPool

        req_to_token_pool = HybridMambaDecodeReqToTokenPool(mamba_size=states.size, pre_alloc_size=decode_pre_alloc_size,
                                                            **table)  # fmt: skip
    else:
        req_to_token_pool = UnifiedHybridReqToTokenPool(mamba_spec_state_size=spec_rows,
                                                        enable_mamba_extra_buffer_lazy=enable_mamba_extra_buffer_lazy,
                                                        **table)  # fmt: skip
    allocator = unified_token_allocator(token_to_kv_pool, need_sort=need_sort, kernels=kernels)
    return UnifiedPoolBundle(states.memory, token_to_kv_pool, allocator, req_to_token_pool)


def unified_hybrid_linear_kv_pool(*, budget_bytes: int, device: str, kv_cache_dtype: torch.dtype, head_num: int,
                                  head_dim: int, v_head_dim: Optional[int], page_size: int, start_layer: int,
                                  end_layer: int, full_attention_layer_ids: Sequence[int],
                                  mamba_layer_ids: Sequence[int], cache_params: Any, use_mla: bool = False,
                                  kv_lora_rank: Optional[int] = None, qk_rope_head_dim: Optional[int] = None,
                                  spec_state_size: int = 0, speculative_num_draft_tokens: Optional[int] = None,
                                  kernels: str = "auto", lazy_compaction: bool = True
                                  ) -> "UnifiedHybridLinearKVPool":  # fmt: skip
    """A :class:`UnifiedHybridLinearKVPool` over a new unified memory of ``budget_bytes``: its
    ``full_kv_pool`` a page-major pool over the low side (virtual pages), its ``mamba_pool`` a
    :class:`~kvcore_unified.states.UnifiedMambaPool` over the high side (``mamba_pool.memory`` is the memory).
    The tokens' allocator comes from :func:`unified_token_allocator`."""
    full_ids = [int(i) for i in full_attention_layer_ids]
    page_bytes = full_page_bytes(layers=len(full_ids), page_size=page_size, kv_cache_dtype=kv_cache_dtype,
                                 use_mla=use_mla, head_num=head_num, head_dim=head_dim, kv_lora_rank=kv_lora_rank,
                                 qk_rope_head_dim=qk_rope_head_dim)  # fmt: skip
    envelope = state_envelope(cache_params, len(mamba_layer_ids))
    memory = UnifiedMemory(budget_bytes, page_bytes, envelope.unit_bytes, device, lazy_compaction=lazy_compaction)
    pages = memory.allocator.ids(LOW)
    common = dict(size=pages * page_size, page_size=page_size, dtype=kv_cache_dtype, layer_num=len(full_ids),
                  device=device, kernels=kernels, memory=memory.low_memory(), virtual_pages=pages)  # fmt: skip
    if use_mla:
        from kvcore_mla import PageMajorMLATokenToKVPool

        full_pool = PageMajorMLATokenToKVPool(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, **common)
    else:
        from kvcore_mha import PageMajorMHATokenToKVPool

        full_pool = PageMajorMHATokenToKVPool(head_num=head_num, head_dim=head_dim, v_head_dim=v_head_dim, **common)
    states = UnifiedMambaPool(memory=memory, cache_params=cache_params, device=device, spec_state_size=spec_state_size,
                              speculative_num_draft_tokens=speculative_num_draft_tokens,
                              mamba_layer_ids=mamba_layer_ids, kernels=kernels)  # fmt: skip
    return UnifiedHybridLinearKVPool(
        size=pages * page_size, dtype=kv_cache_dtype, page_size=page_size, head_num=head_num, head_dim=head_dim,
        full_attention_layer_ids=full_ids, device=device, mamba_pool=states, v_head_dim=v_head_dim,
        start_layer=start_layer, end_layer=end_layer, kernels=kernels, use_mla=use_mla, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim, full_kv_pool=full_pool,
    )  # fmt: skip


class UnifiedHybridLinearKVPool(HybridLinearKVPool):
    """:class:`~kvcore_mamba.pool.HybridLinearKVPool` over a unified memory (SGLang's name for it): its buffers
    are the memory itself (named ``unified``; the K/V and state views overlay it) and the per-running-request
    draft states kept outside it.  Its tokens and state slots are virtual: :meth:`translate_loc` and
    :meth:`translate_state_slots` give their physical places (what a transfer addresses)."""

    @property
    def memory(self) -> UnifiedMemory:
        """The unified memory both sides lie in."""
        return self.mamba_pool.memory

    def translate_loc(self, loc: torch.Tensor) -> torch.Tensor:
        """The physical tokens (int64) of tokens ``loc``: the full-attention pages' places in the paged views and in
        :meth:`get_contiguous_buf_infos` (page ``t // page_size``)."""
        return self.full_kv_pool.translate_loc(loc)

    def translate_state_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The items of :meth:`get_state_buf_infos` (pages of the high memory) of virtual state slots ``slots``."""
        return self.mamba_pool.translate(slots)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"unified": self.mamba_pool.memory.buffer, **self.request_state_buffers()}

    def request_state_buffers(self) -> dict[str, torch.Tensor]:
        """The draft states kept per running request (outside the memory); the slots' states are in it."""
        slots = self.mamba_pool.slot_buffers()
        return {name: t for name, t in self.mamba_pool.buffers().items() if name not in slots}

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The high memory, one envelope per physical state slot (:meth:`UnifiedMambaPool.get_contiguous_buf_infos`)."""
        return self.mamba_pool.get_contiguous_buf_infos()


def unified_token_allocator(pool: HybridLinearKVPool, *, need_sort: bool = False,
                            kernels: str = "auto") -> UnifiedPagedAllocator:  # fmt: skip
    """SGLang's paged allocator over the low side of the memory of ``pool`` (a
    :func:`unified_hybrid_linear_kv_pool`), mapping pages in its ``full_kv_pool``."""
    return UnifiedPagedAllocator(pool.mamba_pool.memory, pool, pool.page_size, pool.dtype, pool.device,
                                 need_sort=need_sort, kernels=kernels, page_pool=pool.full_kv_pool)  # fmt: skip
