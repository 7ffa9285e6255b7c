"""Declarative buffer layouts: what a pool will allocate, before anything is allocated.

A backend describes its pool as a :class:`PoolLayout`, a tuple of :class:`BufferLayout` records.  The
planner sizes pools from these alone (it never allocates), and the conformance kit checks that a built
pool allocated exactly the bytes its layout declared.

Each buffer is a stack of ``layers`` copies of ``rows x row_shape`` elements.  How many rows a pool of a
given size needs depends on what a row holds:

* one token per row (``tokens_per_row=1``, the common case): ``rows = size + pad_tokens``, where the
  padding is the reserved page 0 (``pad_tokens = page_size``) that padded tokens write into;
* a whole page per row (``tokens_per_row=page_size``, e.g. an indexer page of keys plus scales):
  ``rows = (size + pad_tokens) // tokens_per_row``;
* one request's state per row (``sized_by="requests"``, recurrent state): ``rows = requests + pad``;
* one running request's per-draft-token states per row (``sized_by="running_requests"``, speculative
  decoding of recurrent layers): ``rows = max_running_requests + pad``.

``sized_by`` names the size a buffer scales with: ``"tokens"`` (the main pool), ``"swa_tokens"``
(a sliding-window sub-pool), ``"requests"`` (per-request state slots) or ``"running_requests"`` (state
per running request).  The planner turns a byte budget into
one number per group; family plugins only declare which group each buffer belongs to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import attrs
import torch

from kvcore.kernels.addresses import shared_by_copies

SIZE_GROUPS = ("tokens", "swa_tokens", "requests", "running_requests")


def _as_shape(value) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _check_shape(instance, attribute, value: tuple[int, ...]) -> None:
    if any(v <= 0 for v in value):
        raise ValueError(f"buffer {instance.name!r}: every dimension of row_shape must be positive, got {value}")


def _amount(value: float) -> str:
    """Whole numbers in full (37748736, not 3.77487e+07), fractions as they come."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@attrs.frozen
class BufferLayout:
    """One named buffer of a pool: ``layers`` stacked copies of ``[rows, *row_shape]`` of ``dtype``.

    :param name: stable name, also used to match the allocated tensor (``"k"``, ``"v"``, ``"kv"``, ...).
    :param layers: how many layer copies (the layers this rank owns that use this buffer).
    :param row_shape: the shape of one row (e.g. ``(head_num, head_dim)``).
    :param dtype: the *storage* dtype (fp8 caches are stored as ``torch.uint8``).
    :param sized_by: the size group the row count follows (see module docstring).
    :param tokens_per_row: tokens held by one row (1, or the page size for page-granular buffers).
    :param pad_tokens: tokens' worth of rows added to the size before dividing (the padding page).
    :param size_multiple: tokens the buffer covers per token of its size group (1; HiSparse's indexer covers every
        token its host keeps, ``host_to_device_ratio`` per device slot): rows are those of ``size x size_multiple``.
    :param size_divisor: tokens of its size group per token the buffer covers (1; DeepSeek-V4's HiSparse keeps the
        ratio-4 latents of ``1 / host_to_device_ratio`` of the full pages on the device): rows are those of
        ``size x size_multiple // size_divisor``.
    :param fixed_rows: a row count that does not grow with the size (per-layer constants such as a global
        scale); the buffer then adds no bytes per token.
    """

    name: str
    layers: int = attrs.field(validator=attrs.validators.ge(0))
    row_shape: tuple[int, ...] = attrs.field(converter=_as_shape, validator=_check_shape)
    dtype: torch.dtype = attrs.field(validator=attrs.validators.instance_of(torch.dtype))
    sized_by: str = attrs.field(default="tokens", validator=attrs.validators.in_(SIZE_GROUPS))
    tokens_per_row: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    pad_tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    fixed_rows: int | None = attrs.field(default=None)
    size_multiple: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    size_divisor: int = attrs.field(default=1, validator=attrs.validators.ge(1))

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of one layer."""
        return math.prod(self.row_shape) * self.dtype.itemsize

    def rows(self, size: int) -> int:
        """Rows of one layer for a pool of ``size`` tokens (or requests)."""
        if self.fixed_rows is not None:
            return self.fixed_rows
        return (size * self.size_multiple // self.size_divisor + self.pad_tokens) // self.tokens_per_row

    def shape(self, size: int) -> tuple[int, ...]:
        """The stacked tensor shape ``(layers, rows, *row_shape)`` for a pool of ``size``."""
        return (self.layers, self.rows(size), *self.row_shape)

    def total_bytes(self, size: int) -> int:
        """Bytes this buffer allocates, all layers, for a pool of ``size``."""
        return self.layers * self.rows(size) * self.row_bytes

    @property
    def bytes_per_unit(self) -> float:
        """Marginal bytes per token (or per request) across all layers; fractional for page rows."""
        if self.fixed_rows is not None:
            return 0.0
        return self.layers * self.row_bytes * self.size_multiple / self.tokens_per_row / self.size_divisor

    def describe(self) -> str:
        """One line for reports, from the declaration alone: ``kv [1, 656] uint8 per token x 61 layers
        = 40016 B/token``."""
        if self.fixed_rows is not None:
            dtype = str(self.dtype).removeprefix("torch.")
            return f"{self.name} {list(self.row_shape)} {dtype} x {self.fixed_rows} rows x {self.layers} layers (fixed)"
        unit = "request" if self.sized_by in ("requests", "running_requests") else "token"
        per = f"per {self.tokens_per_row} {unit}s" if self.tokens_per_row > 1 else f"per {unit}"
        if self.size_multiple > 1:
            per += f" (x {self.size_multiple} {'rows' if unit == 'request' else 'tokens'} each)"
        if self.size_divisor > 1:
            per += f" (1 {unit} in {self.size_divisor})"
        group = "" if self.sized_by in ("tokens", "requests") else f" ({self.sized_by})"
        return (
            f"{self.name} {list(self.row_shape)} {str(self.dtype).removeprefix('torch.')} {per} x {self.layers} "
            f"layer{'s' if self.layers != 1 else ''}"
            f" = {_amount(self.bytes_per_unit)} B/{unit}{group}"
        )


@attrs.frozen
class RequestStateSizing:
    """How the planner sizes a layout's ``requests`` group: per-request state (recurrent / linear-attention
    state) reserved before the token groups, by SGLang's rules for hybrid Mamba models.

    :param slots: an explicit number of state slots (whole over data-parallel workers; the planner divides),
        or None to size them from memory.
    :param from_running_requests: with ``slots`` None and ``memory.max_running_requests`` set, use that many
        slots (what SGLang does when no prefix cache keeps states of finished requests).
    :param memory_ratio: otherwise the state gets ``memory_ratio / (1 + memory_ratio)`` of the KV budget.
    :param slots_per_request: state slots one running request may hold (kept prefixes, ping-pong buffers);
        ``max_running_requests`` is capped at ``slots // slots_per_request``.
    :param draft_tokens: speculative decoding's draft tokens: each running request also keeps as many
        intermediate states (the ``running_requests`` buffers), reserved with the slots (SGLang's joint solve:
        ``slots x (1 + draft_tokens / slots_per_request)`` states from the share; ``memory.max_running_requests``
        must be set).
    :param keys: the config keys behind ``slots``, ``memory_ratio`` and ``draft_tokens``, for error messages.
    :param per_request_table_row: the slots are the request table's rows instead: one per running request plus the
        table's padding row (SGLang's ``num_req_slots = max_running_requests + 1``, plus a decode worker's
        pre-allocated rows), from ``memory.max_running_requests`` or, unset, SGLang's estimate of it from the
        tokens that fit beside no state (an over-estimate, as SGLang's DeepSeek-V4 sizing takes it).
    """

    slots: int | None = None
    from_running_requests: bool = False
    memory_ratio: float = 0.9
    slots_per_request: int = 1
    draft_tokens: int = 0
    keys: tuple[str, ...] = ("", "", "")
    per_request_table_row: bool = False

    @property
    def spare_slots(self) -> int:
        """Slots kept beyond ``slots_per_request`` per running request (the request table's padding row)."""
        return 1 if self.per_request_table_row else 0


#: SGLang's ``swa_full_tokens_ratio`` default, for families that set no other (:attr:`PoolLayout.swa_full_tokens_ratio`)
DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8


@attrs.frozen
class PoolLayout:
    """Everything one backend allocates for one rank, as buffers; no tensors.

    :param backend: the backend that declared it.
    :param buffers: the buffers, in allocation order.
    :param notes: short human-readable facts for plan reports (e.g. ``"fp8 stored as uint8"``).
    :param min_sizes: the least size of a group that can serve one request, with why (e.g. a sliding window
        plus a page: ``{"swa_tokens": (1088, "model.swa.sliding_window=1024 plus a page of 64")}``); the
        planner refuses a plan below it and says which setting would reach it.
    :param swa_full_tokens_ratio: window tokens per full token when ``memory.swa_full_tokens_ratio`` is not set
        (SGLang's 0.8; DeepSeek-V4's window pool is sized at 0.1).
    :param derived_sizes: sizes the family's pools derive from a size group, by SGLang's name, for reports:
        ``{"c4_max_total_num_tokens": ("tokens", 4)}`` is the ``tokens`` group's size divided by 4.
    """

    __deepcopy__ = shared_by_copies

    backend: str
    buffers: tuple[BufferLayout, ...] = attrs.field(converter=tuple)
    notes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    min_sizes: Mapping[str, tuple[int, str]] = attrs.field(factory=dict, converter=lambda m: MappingProxyType(dict(m)))
    request_state: RequestStateSizing | None = None
    swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO
    derived_sizes: Mapping[str, tuple[str, int]] = attrs.field(factory=dict, converter=lambda m: MappingProxyType(dict(m)))

    def without(self, sized_by: str) -> PoolLayout:
        """This layout less the buffers of one size group (the planner sizes the token groups apart from the
        per-request state)."""
        return attrs.evolve(self, buffers=[b for b in self.buffers if b.sized_by != sized_by])

    def __attrs_post_init__(self) -> None:
        names = [b.name for b in self.buffers]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"backend {self.backend!r} declared buffer names twice: {duplicates}")

    def group(self, sized_by: str) -> tuple[BufferLayout, ...]:
        """The buffers that follow one size group."""
        return tuple(b for b in self.buffers if b.sized_by == sized_by)

    @property
    def groups(self) -> tuple[str, ...]:
        """Size groups present in this layout, in :data:`SIZE_GROUPS` order."""
        present = {b.sized_by for b in self.buffers}
        return tuple(g for g in SIZE_GROUPS if g in present)

    def bytes_per_unit(self, sized_by: str = "tokens") -> float:
        """Marginal bytes per token (or request) of one size group, all its buffers and layers."""
        return sum(b.bytes_per_unit for b in self.group(sized_by))

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token of the main token group, rounded up to whole bytes."""
        return math.ceil(self.bytes_per_unit("tokens"))

    def total_bytes(self, sizes: Mapping[str, int]) -> int:
        """Exact bytes allocated for the given sizes (one entry per size group present)."""
        missing = [g for g in self.groups if g not in sizes]
        if missing:
            raise KeyError(f"backend {self.backend!r}: no size given for group(s) {missing}")
        return sum(b.total_bytes(sizes[b.sized_by]) for b in self.buffers)

    def fixed_bytes(self, sized_by: str = "tokens") -> int:
        """Bytes one size group allocates at size 0 (padding rows)."""
        return sum(b.total_bytes(0) for b in self.group(sized_by))

    def by_name(self) -> dict[str, BufferLayout]:
        return {b.name: b for b in self.buffers}
