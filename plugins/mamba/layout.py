"""The hybrid linear-attention family's model section, options, state shapes and declared buffers; importing
this needs no kernels.

A hybrid model has full-attention layers, which keep K/V per token, and linear-attention layers (Mamba2, gated
DeltaNet), which keep one fixed-size state per request instead: a short convolution window and a temporal
(SSM) state.  The pool keeps the full layers' K/V in an MHA pool (``tokens`` group) and the states in a
:class:`~kvcore_mamba.pool.MambaPool` of request slots (``requests`` group), which the planner reserves
before the tokens, by SGLang's rules (:class:`~kvcore.layout.RequestStateSizing`).
"""

from __future__ import annotations

import math
from typing import List, Optional

import attrs
import torch

from kvcore.backend import PoolRequest
from kvcore.config import key, parse_dtype, positive
from kvcore.layout import BufferLayout, PoolLayout, RequestStateSizing
from kvcore_mha.layout import mha_layout

KINDS = ("gated_delta_net", "mamba2", "kimi_delta_attention")
EXTRA_BUFFERS = ("off", "overlap", "overlap_lazy", "no_overlap")
#: SGLang's state slots per running request (a finished request's state kept for its prefix, plus ping-pong
#: track buffers with the extra buffer on: 2 with the overlap schedule, 1 lazily or without overlap).
SLOTS_PER_REQUEST = 3
EXTRA_SLOTS = {"off": 0, "overlap": 2, "overlap_lazy": 1, "no_overlap": 1}


def _kind(instance, attribute, value) -> None:
    if value not in KINDS:
        raise ValueError(f"{attribute.name} must be one of {', '.join(KINDS)}, got {value!r}")


def _extra(instance, attribute, value) -> None:
    if value not in EXTRA_BUFFERS:
        raise ValueError(f"{attribute.name} must be one of {', '.join(EXTRA_BUFFERS)}, got {value!r}")


@attrs.define
class LinearAttentionDims:
    """Linear-attention (Mamba2 / gated DeltaNet) dimensions (model.mamba), from the model's config.json."""

    kind: str = key("gated_delta_net", validator=_kind, doc="gated_delta_net (Qwen3-Next), mamba2 (NemotronH, Falcon-H1) or kimi_delta_attention (Kimi-Linear: num_groups = num_heads, state_size = head_dim, the convolution window stored [conv_kernel - 1, channels]): which state layout")
    num_heads: int = key(validator=positive, doc="value heads (config.json linear_num_value_heads / mamba_n_heads)")
    head_dim: int = key(validator=positive, doc="value head width (linear_value_head_dim / mamba_head_dim)")
    state_size: int = key(validator=positive, doc="key head width of a DeltaNet (linear_key_head_dim), the SSM state of Mamba2 (ssm_state_size)")
    num_groups: int = key(validator=positive, doc="key heads of a DeltaNet (linear_num_key_heads), groups of Mamba2 (n_groups)")
    conv_kernel: int = key(validator=positive, doc="short-convolution width (linear_conv_kernel_dim / conv_kernel); the state keeps conv_kernel - 1 inputs")
    full_attention_interval: int = key(validator=positive, doc="layer i (from 0) is full attention when (i + 1) % n == 0 (config.json full_attention_interval; 4 for Qwen3-Next)")
    full_attention_layers: Optional[List[int]] = key(None, doc="the full-attention layers (ids from 0) when no interval says them (Kimi-Linear: linear_attn_config.full_attn_layers, which count from 1); replaces full_attention_interval")
    state_dtype: str = key("float32", doc="dtype of the temporal (SSM) state; the convolution window keeps the model dtype")


@attrs.define
class MambaOptions:
    """kv_cache.options of the mamba backend (SGLang's server arguments of the same names)."""

    max_mamba_cache_size: Optional[int] = key(None, validator=positive, doc="state slots over all data-parallel workers; default: from memory")
    mamba_full_memory_ratio: float = key(0.9, validator=positive, doc="state : KV memory; the states get ratio / (1 + ratio) of the KV budget")
    disable_radix_cache: bool = key(False, doc="no prefix cache keeps finished requests' states: one slot per running request, and memory.max_running_requests slots when it is set")
    mamba_extra_buffer: str = key("off", validator=_extra, doc="ping-pong track buffers per request: off, overlap (2), overlap_lazy (1) or no_overlap (1)")
    speculative_num_draft_tokens: Optional[int] = key(None, validator=positive, doc="speculative decoding's draft tokens: every running request keeps that many intermediate states (needs memory.max_running_requests)")


@attrs.frozen
class StateShape:
    """Per-slot shapes of one linear layer's state (SGLang's ``cache_params.shape``)."""

    conv: list[tuple[int, ...]]
    temporal: tuple[int, ...]


@attrs.frozen
class StateDtype:
    conv: torch.dtype
    temporal: torch.dtype


@attrs.frozen
class LinearStateParams:
    """What SGLang's ``MambaPool`` reads from ``cache_params``: this rank's linear layers, per-slot shapes
    and dtypes; and the bytes one request's state takes over those layers (``mamba_cache_per_req``)."""

    layers: list[int]
    shape: StateShape
    dtype: StateDtype

    @property
    def mamba_cache_per_req(self) -> int:
        one = sum(math.prod(s) for s in self.shape.conv) * self.dtype.conv.itemsize
        return len(self.layers) * (one + math.prod(self.shape.temporal) * self.dtype.temporal.itemsize)


def _split(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what}={total} is not divisible by parallel.tp_size={tp}; use a divisor of {total}")
    return total // tp


def layer_kinds(num_layers: int, full_attention_interval: int,
                full_attention_layers: list[int] | None = None) -> tuple[list[int], list[int]]:  # fmt: skip
    """``(full_attention_layer_ids, linear_layer_ids)`` of a model, global ids in order: ``full_attention_layers``
    when given, else every ``full_attention_interval``-th layer."""
    if full_attention_layers is not None:
        listed = set(full_attention_layers)
        return [i for i in range(num_layers) if i in listed], [i for i in range(num_layers) if i not in listed]
    n = full_attention_interval
    full = [i for i in range(num_layers) if (i + 1) % n == 0]
    return full, [i for i in range(num_layers) if (i + 1) % n != 0]


def state_params(dims: LinearAttentionDims, model_dtype: torch.dtype, tp_size: int, layers: list[int]) -> LinearStateParams:
    """The state of ``layers`` on one tensor-parallel rank (heads and the convolution channels split over tp).

    Convolution channels: ``num_heads x head_dim + 2 x num_groups x state_size`` (values, keys and queries of
    a DeltaNet or of Kimi Delta Attention; x, B and C of Mamba2), ``conv_kernel - 1`` inputs each, the window
    stored ``[channels, conv_kernel - 1]`` (``[conv_kernel - 1, channels]`` for Kimi Delta Attention, as SGLang's
    KimiLinearStateShape keeps it).  Temporal state per head: ``[state_size, head_dim]`` for a DeltaNet and Kimi
    Delta Attention (keys x values), ``[head_dim, state_size]`` for Mamba2."""
    channels = dims.num_heads * dims.head_dim + 2 * dims.num_groups * dims.state_size
    conv = (_split(channels, tp_size, "model.mamba conv channels"), dims.conv_kernel - 1)
    heads = _split(dims.num_heads, tp_size, "model.mamba.num_heads")
    if dims.kind == "kimi_delta_attention":  # SGLang's KimiLinearStateShape: [conv_kernel - 1, q + k + v channels]
        conv = conv[::-1]
    if dims.kind in ("gated_delta_net", "kimi_delta_attention"):
        temporal = (heads, dims.state_size, dims.head_dim)
    else:
        temporal = (heads, dims.head_dim, dims.state_size)
    temporal_dtype = parse_dtype(dims.state_dtype, "model.mamba.state_dtype")
    return LinearStateParams(layers=list(layers), shape=StateShape(conv=[conv], temporal=temporal),
                             dtype=StateDtype(conv=model_dtype, temporal=temporal_dtype))  # fmt: skip


def rank_layers(request: PoolRequest) -> tuple[list[int], list[int]]:
    """This rank's ``(full-attention, linear)`` global layer ids."""
    dims: LinearAttentionDims = request.section("mamba")
    full, linear = layer_kinds(request.end_layer + 1, dims.full_attention_interval, dims.full_attention_layers)
    mine = range(request.start_layer, request.end_layer + 1)
    return [i for i in full if i in mine], [i for i in linear if i in mine]


def rank_state_params(request: PoolRequest) -> LinearStateParams:
    return state_params(request.section("mamba"), request.model_dtype, request.tp_size, rank_layers(request)[1])


def draft_tokens(request: PoolRequest) -> int:
    """Speculative decoding's draft tokens per running request: ``kv_cache.options.speculative_num_draft_tokens``
    when set, else ``speculative.num_draft_tokens`` of a target worker under speculative decoding (a draft
    worker keeps no states of its own), else 0."""
    options = request.options if isinstance(request.options, MambaOptions) else None
    if options is not None and options.speculative_num_draft_tokens:
        return options.speculative_num_draft_tokens
    mode = request.mode
    return 0 if mode.is_draft_worker else mode.num_draft_tokens


def request_state_sizing(options: MambaOptions | None, draft: int = 0) -> RequestStateSizing:
    """SGLang's rules for the state slots, from the backend's options and the draft tokens
    (:func:`draft_tokens`)."""
    options = options or MambaOptions()
    per_request = 1 if options.disable_radix_cache else SLOTS_PER_REQUEST + EXTRA_SLOTS[options.mamba_extra_buffer]
    return RequestStateSizing(
        slots=options.max_mamba_cache_size, from_running_requests=options.disable_radix_cache,
        memory_ratio=options.mamba_full_memory_ratio, slots_per_request=per_request,
        draft_tokens=draft,
        keys=("kv_cache.options.max_mamba_cache_size", "kv_cache.options.mamba_full_memory_ratio",
              "speculative.num_draft_tokens" if draft and not options.speculative_num_draft_tokens
              else "kv_cache.options.speculative_num_draft_tokens"),
    )  # fmt: skip


def mamba_layout(*, backend: str, request: PoolRequest) -> PoolLayout:
    """The full-attention layers' ``k`` / ``v`` (``tokens``), the linear layers' ``conv`` / ``temporal``
    states (``requests``: ``[linear layers, slots + 1, ...]``, slot 0 padding) and, under speculative
    decoding, their ``intermediate_conv`` / ``intermediate_ssm`` states per draft token (``running_requests``:
    ``[linear layers, max_running_requests + 1, draft tokens, ...]``)."""
    full, linear = rank_layers(request)
    params = rank_state_params(request)
    options = request.options if isinstance(request.options, MambaOptions) else None
    draft = draft_tokens(request)
    buffers, notes = [], []
    if full:
        common = dict(backend=backend, page_size=request.page_size, dtype=request.kv_dtype, layer_num=len(full))
        if "mla" in request.sections:  # the mamba_mla backend: latent rows for the full-attention layers
            from kvcore_mla.layout import mla_layout

            mla = request.section("mla")
            kv = mla_layout(kv_lora_rank=mla.kv_lora_rank, qk_rope_head_dim=mla.qk_rope_head_dim, **common)
        else:
            kv = mha_layout(head_num=request.head_num, head_dim=request.head_dim, v_head_dim=request.v_head_dim, **common)
        buffers += kv.buffers
        notes += kv.notes
    if linear:
        common = dict(layers=len(linear), sized_by="requests", pad_tokens=1)
        buffers += [BufferLayout(name=f"conv{i}" if i else "conv", row_shape=shape, dtype=params.dtype.conv, **common)
                    for i, shape in enumerate(params.shape.conv)]  # fmt: skip
        buffers.append(BufferLayout(name="temporal", row_shape=params.shape.temporal, dtype=params.dtype.temporal, **common))
        if draft:
            common = dict(layers=len(linear), sized_by="running_requests", pad_tokens=1)
            buffers += [BufferLayout(name=f"intermediate_conv{i}" if i else "intermediate_conv", row_shape=(draft, *shape),
                                     dtype=params.dtype.conv, **common) for i, shape in enumerate(params.shape.conv)]  # fmt: skip
            buffers.append(BufferLayout(name="intermediate_ssm", row_shape=(draft, *params.shape.temporal),
                                        dtype=params.dtype.temporal, **common))  # fmt: skip
    notes.append(f"{len(full)} full-attention and {len(linear)} linear-attention layers; "
                 f"{params.mamba_cache_per_req / 2**20:.2f} MiB of state per request")  # fmt: skip
    return PoolLayout(backend=backend, buffers=buffers, notes=notes,
                      request_state=request_state_sizing(options, draft) if linear else None)  # fmt: skip
