"""TokenRows: which row of a stacked buffer holds each token's state."""

from __future__ import annotations

import pytest
import torch

from kvcore.token_rows import TokenRows


def test_identity_rows_are_the_tokens_themselves():
    rows = TokenRows(torch.zeros(2, 10, 3))
    tokens = torch.tensor([0, 9, 4], dtype=torch.int32)
    assert rows.is_identity and rows.row_of(tokens) is tokens


@pytest.mark.parametrize("tokens_per_page, rows_per_page, first_row", [(4, 6, 0), (4, 7, 2), (64, 66, 0), (64, 2112, 2048)])
def test_paged_rows_enumerate_each_page_in_order(tokens_per_page, rows_per_page, first_row):
    pages = 5
    rows = TokenRows(torch.zeros(1, pages * rows_per_page), tokens_per_page, rows_per_page, first_row)
    # Walk the pages: page p keeps its tokens' rows contiguously from row p * rows_per_page + first_row.
    want = [p * rows_per_page + first_row + s for p in range(pages) for s in range(tokens_per_page)]
    tokens = torch.arange(pages * tokens_per_page)
    assert rows.row_of(tokens).tolist() == want
    assert rows.row_of(tokens.flip(0)).tolist() == want[::-1]


def test_take_copies_every_layer_rows():
    buf = torch.arange(2 * 12).reshape(2, 12)  # pages of 6 rows: token rows at 1..4
    rows = TokenRows(buf, tokens_per_page=4, rows_per_page=6, first_row=1)
    got = rows.take(torch.tensor([0, 5]))  # token 5 is page 1, slot 1 -> row 8
    assert got.tolist() == [[1, 8], [13, 20]]
    got[0, 0] = -1
    assert buf[0, 1] == 1, "take returns a copy"


def test_rejects_pages_too_small_for_their_tokens():
    with pytest.raises(ValueError, match="cannot hold"):
        TokenRows(torch.zeros(1, 8), tokens_per_page=4, rows_per_page=4, first_row=1)
    with pytest.raises(ValueError, match="stacked"):
        TokenRows(torch.zeros(8))
