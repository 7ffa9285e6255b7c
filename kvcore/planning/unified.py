"""The figures of a unified memory (``memory.unified=true``): one byte range shared by a hybrid model's
full-attention KV pages and its other kind of state (per-request recurrent state, or sliding-window pages), each
growing from one end, so the split between them follows the workload.

Nothing here allocates: from a layout with two kinds of per-unit buffers and the KV budget, :func:`unified_figures`
says what the one range holds at each extreme (all of it full-attention tokens, or all of it the other kind) and
at the split pools' sizes the rest of the plan computed.  The range is the split pools' bytes (their pages of
full-attention tokens and their state slots or window pages); buffers kept per running request (speculative
decoding's per-draft-token states) stay outside it, reserved as the split plan reserves them.
"""

from __future__ import annotations

import math

import attrs

from kvcore.errors import PlanningError
from kvcore.layout import PoolLayout

__all__ = ["UnifiedFigures", "unified_figures", "ALIGN"]

#: the byte boundary the shared range ends on and each block of a state envelope starts on (the unified memory's)
ALIGN = 16

#: the second kind of a hybrid layout, with what its unit is called
_OTHER = {"requests": "state slot", "swa_tokens": "window page"}


@attrs.frozen
class UnifiedFigures:
    """What one shared range of ``budget_bytes`` holds.

    :param token_page_bytes: one page of full-attention KV, every full layer (an envelope).
    :param other: the other kind's size group: ``requests`` (state slots) or ``swa_tokens`` (window tokens).
    :param other_unit_bytes: one of its units: a request's state, every linear layer, or a window page, every
        window layer.
    :param max_tokens: full-attention tokens when the range holds nothing else.
    :param max_other: state slots (or window tokens) when it holds nothing else.
    :param split_tokens: / ``split_other``: the split pools' sizes of the same budget, for comparison.
    """

    budget_bytes: int
    page_size: int
    token_page_bytes: int
    other: str
    other_unit_bytes: int
    max_tokens: int
    max_other: int
    split_tokens: int
    split_other: int

    @property
    def memory_bytes(self) -> int:
        """The bytes the unified memory allocates: a padding unit of each kind around the range, whose end is kept
        on an :data:`ALIGN`-byte boundary."""
        return (self.token_page_bytes + self.budget_bytes) // ALIGN * ALIGN + self.other_unit_bytes

    @property
    def other_unit(self) -> str:
        return _OTHER[self.other]

    @property
    def other_counted(self) -> str:
        """What :attr:`max_other` counts: state slots, or window tokens."""
        return "state slots" if self.other == "requests" else "window tokens"

    def describe(self) -> list[str]:
        """Lines for ``kvcore plan``."""
        unit = self.other_counted
        return [
            f"unified   one range of {self.budget_bytes / 2**30:.2f} GiB for both kinds, each from one end: full-attention "
            f"pages of {self.token_page_bytes} B ({self.page_size} token{'s' if self.page_size != 1 else ''}, every full "
            f"layer), {self.other_unit}s of "
            f"{self.other_unit_bytes} B",
            f"          at most {self.max_tokens} full-attention tokens (no {unit}), or {self.max_other} {unit} "
            f"(no tokens); the split pools hold {self.split_tokens} tokens and {self.split_other} {unit}, and the "
            "range holds any mix in between",
        ]


def unified_figures(layout: PoolLayout, page_size: int, sizes: dict[str, int],
                    key: str = "memory.unified") -> UnifiedFigures:  # fmt: skip
    """The figures of ``layout``'s two kinds in one range of the split pools' bytes at ``sizes`` (their full-attention
    pages and their state slots or window pages: what the unified memory is built with), beside those sizes.

    :raises PlanningError: naming ``key`` when the layout has no second kind to share the range with.
    """
    others = [g for g in _OTHER if g in layout.groups]
    if "tokens" not in layout.groups or not others:
        raise PlanningError(
            f"{key}=true shares one memory between a hybrid model's full-attention tokens and its per-request "
            f"state or sliding-window tokens, and backend {layout.backend!r} keeps only {list(layout.groups)}: set "
            f"{key}=false for this model"
        )
    other = others[0]
    token_page = math.ceil(layout.bytes_per_unit("tokens") * page_size)
    pages = -(-sizes["tokens"] // page_size)
    if other == "requests":  # one slot's envelope: each state buffer's layers in a block on a 16-byte boundary
        unit = sum(-(-math.ceil(b.layers * b.row_bytes) // ALIGN) * ALIGN for b in layout.group("requests"))
        split_other = sizes.get("requests", 0)
        budget = pages * token_page + split_other * unit
        max_other = budget // unit
    else:
        unit = math.ceil(layout.bytes_per_unit("swa_tokens") * page_size)
        split_other = sizes.get("swa_tokens", 0)
        budget = pages * token_page + -(-split_other // page_size) * unit
        max_other = budget // unit * page_size
    return UnifiedFigures(budget_bytes=budget, page_size=page_size, token_page_bytes=token_page, other=other,
                          other_unit_bytes=unit, max_tokens=budget // token_page * page_size, max_other=max_other,
                          split_tokens=sizes["tokens"], split_other=split_other)  # fmt: skip
