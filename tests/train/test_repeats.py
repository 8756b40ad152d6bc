"""Which tokens repeat earlier text (the n tokens ending with them occurred before in the same row)."""

import torch

from eyas.train.repeats import repeat_mask, token_weights


def reference(row: list[int], n: int) -> list[bool]:
    seen, out = set(), []
    for p in range(len(row)):
        key = tuple(row[p - n + 1: p + 1]) if p >= n - 1 else None
        out.append(key is not None and key in seen)
        if key is not None:
            seen.add(key)
    return out


def test_repeat_mask_matches_a_direct_search():
    g = torch.Generator().manual_seed(0)
    loop = torch.randint(0, 50, (7,), generator=g)
    rows = [torch.cat([torch.randint(0, 50, (20,), generator=g), loop, loop, loop, torch.randint(0, 50, (9,), generator=g)]),
            torch.randint(0, 3, (50,), generator=g)]  # a tiny alphabet: many chance repeats
    ids = torch.stack(rows)
    for n in (1, 4, 8):
        got = repeat_mask(ids, n)
        assert got.tolist() == [reference(r.tolist(), n) for r in rows]
    m = repeat_mask(ids, 4)[0]
    assert not m[:27].any() and m[30:41].all()  # the loop's second and third turns repeat, its first does not


def test_rows_are_independent_and_short_rows_never_repeat():
    ids = torch.tensor([[1, 2, 3, 1, 2, 3], [4, 5, 6, 7, 8, 9]])
    assert repeat_mask(ids, 3).tolist() == [[False] * 5 + [True], [False] * 6]
    assert not repeat_mask(ids, 7).any()


def test_token_weights():
    ids = torch.tensor([[1, 2, 1, 2]])
    assert token_weights(ids, 2, 0.25).tolist() == [[1.0, 1.0, 1.0, 0.25]]
