"""kvcore_mamba: hybrid Mamba / linear-attention pools (Qwen3-Next's gated DeltaNet, Mamba2), plugin ``mamba``,
and a *base family* (see ``kvcore_mha``'s docstring): ``kvcore_unified`` lays its pools over a unified memory.
Public for composition: ``MambaPool`` (a subclass lays the slot states elsewhere through ``_slot_states``),
``HybridReqToTokenPool``, ``HybridLinearKVPool`` (``full_kv_pool=`` takes a pool built by the caller),
``state_layer_ids``, and the layout pieces ``LinearAttentionDims``, ``LinearStateParams``, ``StateShape``,
``StateDtype``, ``rank_layers``, ``rank_state_params``, ``draft_tokens``.

Builds on the base families ``kvcore_mha`` and ``kvcore_mla``: the full-attention layers of a ``mamba`` pool are
an ``MHATokenToKVPool`` (or ``PageMajorMHATokenToKVPool``; ``NoOpMHATokenToKVPool`` is refused), declared with
``mha_layout``; those of a ``mamba_mla`` pool an ``MLATokenToKVPool``, declared with ``mla_layout``, and the
``mamba_mla`` backend reads ``model.mla`` (``MLADims``).
"""

from __future__ import annotations

from kvcore.plugins.lazy import lazy_getattr

#: public name -> the module that defines it (imported on first use: importing the package stays light,
#: so a test kit can choose interpreted or compiled Triton kernels before any kernel module loads)
_PUBLIC = {
    "MambaPool": "kvcore_mamba.pool",
    "HybridReqToTokenPool": "kvcore_mamba.pool",
    "HybridLinearKVPool": "kvcore_mamba.pool",
    "HybridMambaDecodeReqToTokenPool": "kvcore_mamba.decode",
    "LinearAttentionDims": "kvcore_mamba.layout",
    "LinearStateParams": "kvcore_mamba.layout",
    "StateShape": "kvcore_mamba.layout",
    "StateDtype": "kvcore_mamba.layout",
    "rank_layers": "kvcore_mamba.layout",
    "rank_state_params": "kvcore_mamba.layout",
    "draft_tokens": "kvcore_mamba.layout",
    "state_layer_ids": "kvcore_mamba.keywords",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_getattr(__name__, _PUBLIC)
