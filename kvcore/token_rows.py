"""Where a stacked buffer keeps each token's row (:class:`TokenRows`), for moves, CPU offload and checks."""

from __future__ import annotations

import torch

__all__ = ["TokenRows", "select_rows"]


def select_rows(stacked: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``stacked[:, rows]`` (rows along dim 1 of every layer), as a new tensor.  ``index_select`` of a
    non-contiguous stack (a page-major buffer's overlapping row views) first copies all of it on the CPU;
    indexing then reads only the rows taken."""
    return stacked.index_select(1, rows) if stacked.is_contiguous() else stacked[:, rows]


class TokenRows:
    """Where one stacked buffer keeps each token's row: what moves, CPU offload and checks address.

    ``rows`` is ``[layer_num, R, ...]`` with rows along dim 1.  Token ``t`` is row ``t`` itself, or, for a
    page-indexed buffer whose pages are ``rows_per_page`` rows long and keep the rows of their
    ``tokens_per_page`` tokens from row ``first_row`` on (the other rows of a page holding other fields)::

        row(t) = (t // tokens_per_page) * rows_per_page + first_row + t % tokens_per_page

    For example a DSA indexer page of 64 keys of 128 bytes followed by 64 float32 scales is, viewed as
    128-byte rows, 66 rows long with the keys from row 0; viewed as 4-byte rows, 2112 rows long with the
    scales from row 2048.

    ``index_map`` (a 1-D int tensor) puts a translation before that: the buffer's own slot of token ``t`` is
    ``index_map[t]`` (a sliding-window sub-pool keeps the tokens of full-pool locations in its own slots).
    """

    __slots__ = ("rows", "tokens_per_page", "rows_per_page", "first_row", "index_map")

    def __init__(self, rows: torch.Tensor, tokens_per_page: int = 1, rows_per_page: int = 1, first_row: int = 0,
                 index_map: torch.Tensor | None = None):  # fmt: skip
        if rows.dim() < 2:
            raise ValueError(f"token rows need a stacked [layers, rows, ...] tensor, got {tuple(rows.shape)}")
        if tokens_per_page < 1 or rows_per_page < tokens_per_page + first_row or first_row < 0:
            raise ValueError(
                f"a page of {rows_per_page} rows cannot hold {tokens_per_page} token rows from row {first_row}"
            )
        self.rows = rows
        self.tokens_per_page = tokens_per_page
        self.rows_per_page = rows_per_page
        self.first_row = first_row
        self.index_map = index_map

    @property
    def is_identity(self) -> bool:
        return self.tokens_per_page == self.rows_per_page and self.first_row == 0 and self.index_map is None

    def row_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows of ``tokens`` (a few elementwise device ops; no host sync, so graph-safe)."""
        if self.is_identity:
            return tokens
        t = tokens.long() if self.index_map is None else self.index_map[tokens.long()].long()
        if self.tokens_per_page == self.rows_per_page and self.first_row == 0:
            return t
        pages = torch.div(t, self.tokens_per_page, rounding_mode="floor")
        return t + pages * (self.rows_per_page - self.tokens_per_page) + self.first_row

    def take(self, tokens: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """A copy of the tokens' rows: ``[layer_num, len(tokens), ...]``, or ``[len(tokens), ...]`` of one
        (0-based, local) ``layer``."""
        rows = self.row_of(tokens).to(self.rows.device)
        if layer is None:
            return select_rows(self.rows, rows)
        return self.rows[layer].index_select(0, rows)
