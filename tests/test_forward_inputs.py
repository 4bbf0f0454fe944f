"""Which rows of a forward the bank takes as verified (forward_watch -> bank/inputs.py rows_ok).

The rule, as the bank has always applied it: a row's ids are verified when its attention-mask
row is all ones and its positions continue the bank's length; a mask or positions of another
rank or length leave every row unverified; a mask or positions covering fewer rows than the ids
(a one-row position tensor counts for every row) make the forward's ids prove nothing. The rows
are now computed as one tensor on the ids' device (no host sync on a GPU): checked here against
the rule written out row by row, over every shape combination.
"""
from __future__ import annotations

import itertools

import torch

from tiered_kv.bank.inputs import rows_ok

SEQ_LEN, NUM_NEW = 5, 3


def rule(num_rows, attention_mask, position_ids):
    verified = [True] * num_rows
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            verified = [False] * num_rows
        else:
            verified = [a and b for a, b in zip(verified, attention_mask.bool().all(dim=1).tolist())]
    if position_ids is not None:
        expected = torch.arange(SEQ_LEN, SEQ_LEN + NUM_NEW)
        if position_ids.dim() != 2 or position_ids.shape[-1] != NUM_NEW:
            verified = [False] * num_rows
        else:
            rows_ok = (position_ids == expected).all(dim=1).tolist()
            verified = [a and b for a, b in zip(verified, rows_ok * (num_rows if len(rows_ok) == 1 else 1))]
    return verified if len(verified) == num_rows else None


def masks(rows):
    yield None
    yield torch.ones(NUM_NEW)  # rank 1
    for n in range(1, rows + 2):
        full = torch.ones(n, SEQ_LEN + NUM_NEW, dtype=torch.long)
        yield full
        holed = full.clone()
        holed[0, 0] = 0
        yield holed


def positions(rows):
    yield None
    good = torch.arange(SEQ_LEN, SEQ_LEN + NUM_NEW)
    yield good  # rank 1
    yield torch.arange(SEQ_LEN, SEQ_LEN + NUM_NEW + 1)[None]  # other length
    for n in range(1, rows + 2):
        yield good.expand(n, -1).clone()
        off = good.expand(n, -1).clone()
        off[-1, -1] += 1
        yield off


def test_rows_ok_keeps_the_rule_for_every_shape():
    checked = 0
    for rows in (1, 2, 3):
        ids = torch.zeros(rows, NUM_NEW, dtype=torch.long)
        for mask, pos in itertools.product(list(masks(rows)), list(positions(rows))):
            got = rows_ok(ids, mask, pos, SEQ_LEN)  # (SEQ_LEN: what the rule compares positions with)
            want = rule(rows, mask, pos)
            assert (None if got is None else got.tolist()) == want, (rows, mask, pos)
            checked += 1
    assert checked > 200
