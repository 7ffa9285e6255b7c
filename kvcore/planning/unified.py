"""The figures of a unified memory (``memory.unified=true``): one byte range shared by a hybrid model's
full-attention KV pages and its other kind of state (per-request recurrent state, or sliding-window pages), each
growing from one end, so the split between them follows the workload.

Nothing here allocates: from a layout with two kinds of per-unit buffers and the KV budget, :func:`unified_figures`
says what the one range holds at each extreme (all of it full-attention tokens, or all of it the other kind) and
at the split pools' sizes the rest of the plan computed.  Buffers kept per running request (speculative decoding's
per-draft-token states) stay outside the shared range, reserved as the split plan reserves them.
"""

from __future__ import annotations

import math

import attrs

from kvcore.errors import PlanningError
from kvcore.layout import PoolLayout

__all__ = ["UnifiedFigures", "unified_figures"]

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
    def other_unit(self) -> str:
        return _OTHER[self.other]

    def describe(self) -> list[str]:
        """Lines for ``kvcore plan``."""
        unit = "state slots" if self.other == "requests" else "window tokens"
        return [
            f"unified   one range of {self.budget_bytes / 2**30:.2f} GiB for both kinds, each from one end: full-attention "
            f"pages of {self.token_page_bytes} B ({self.page_size} token{'s' if self.page_size != 1 else ''}, every full "
            f"layer), {self.other_unit}s of "
            f"{self.other_unit_bytes} B",
            f"          at most {self.max_tokens} full-attention tokens (no {unit}), or {self.max_other} {unit} "
            f"(no tokens); the split pools hold {self.split_tokens} tokens and {self.split_other} {unit}, and the "
            "range holds any mix in between",
        ]


def unified_figures(layout: PoolLayout, budget_bytes: int, page_size: int, sizes: dict[str, int],
                    key: str = "memory.unified") -> UnifiedFigures:  # fmt: skip
    """The figures of ``layout``'s two kinds in one range of ``budget_bytes`` (less what the layout keeps per running
    request, at ``sizes``), beside the split pools' ``sizes``.

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
    budget = budget_bytes - sum(b.total_bytes(sizes.get("running_requests", 0)) for b in layout.group("running_requests"))
    token_page = math.ceil(layout.bytes_per_unit("tokens") * page_size)
    if other == "requests":
        unit = math.ceil(layout.bytes_per_unit("requests"))
        max_other, split_other = budget // unit, sizes.get("requests", 0)
    else:
        unit = math.ceil(layout.bytes_per_unit("swa_tokens") * page_size)
        max_other, split_other = budget // unit * page_size, sizes.get("swa_tokens", 0)
    return UnifiedFigures(budget_bytes=budget, page_size=page_size, token_page_bytes=token_page, other=other,
                          other_unit_bytes=unit, max_tokens=budget // token_page * page_size, max_other=max_other,
                          split_tokens=sizes["tokens"], split_other=split_other)  # fmt: skip
