"""topk_evict (eviction in place, docs/contract.md §2.4): it keeps exactly the tokens topk_compact keeps on
the row in position order, whatever order the slots are in, moves only kept slots from past the budget into
evicted slots below it, and its batched torch path (also through the public op, on the suite's device)
equals the reference bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from devices import DEVICE
from kvkernels.topk_compact import (
    _evict_excess,
    topk_compact_ref,
    topk_evict,
    topk_evict_ref,
    topk_evict_torch,
    topk_evict_triton,
)
from test_topk_compact import Pool, as_float_view, assert_same_bytes, bits, run, scenarios


def shuffled(pool: Pool, seed: int) -> Pool:
    """The pool with each (layer-0 sequence, head) row's slots permuted at random, every pool tensor alike:
    the state decode-time eviction in place leaves behind. The first slot of a row stays (a sink)."""
    out = pool.clone()
    g = torch.Generator().manual_seed(seed)
    S = pool.page_size
    for b in range(len(pool.lens[0])):
        n = int(pool.lens[0][b])
        idx = torch.arange(n)
        pages = pool.tables[0][b, idx // S].long()
        for h in range(pool.k.shape[2]):
            perm = torch.cat([idx[:1], 1 + torch.randperm(max(n - 1, 0), generator=g)])[:n]
            for x_in, x_out in zip(pool.pool_tensors(), out.pool_tensors()):
                x_out[pages, idx % S, h] = x_in[pages[perm], idx[perm] % S, h]
    return out


def run_evict(impl, before: Pool, budgets, n_sink, n_recent) -> Pool:
    device = DEVICE if impl in (topk_evict, topk_evict_triton) else torch.device("cpu")
    pool = before.clone(device)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    impl(pool.k, pool.v, pool.pos, pool.score, pool.tables[0], pool.lens[0], i32(budgets), i32(n_sink),
         i32(n_recent), pool.free, pool.n_free, pool.extra)
    return pool.clone("cpu")


def kept_rows(pool: Pool, b: int, h: int) -> dict[int, list[torch.Tensor]]:
    """Position -> every pool tensor's value (as raw bytes) of sequence b, head h."""
    values = pool.dense(0, b, h)
    return {int(p): [bits(x[i]) for x in values] for i, p in enumerate(values[2].tolist())}


@given(case=scenarios(), seed=st.integers(0, 2**16), shuffle=st.booleans())
def test_keeps_what_topk_compact_keeps_in_position_order(case, seed, shuffle):
    before, budgets, n_sink, n_recent = case
    ordered = run(topk_compact_ref, before, budgets, n_sink, n_recent)  # slots in position order
    start = shuffled(before, seed) if shuffle else before
    got = run_evict(topk_evict_ref, start, budgets, n_sink, n_recent)
    S = before.page_size
    for b, budget in enumerate(budgets):
        length = int(before.lens[0][b])
        assert int(got.lens[0][b]) == min(length, budget)
        for h in range(before.k.shape[2]):
            want, have = kept_rows(ordered, b, h), kept_rows(got, b, h)
            assert want.keys() == have.keys()
            for p in want:
                assert all(torch.equal(x, y) for x, y in zip(want[p], have[p])), f"position {p}"
            # Only slots past the budget moved: a kept slot below it is where it was.
            moved_in = [d for d in range(min(length, budget))
                        if not torch.equal(bits(start.dense(0, b, h)[2][d]), bits(got.dense(0, b, h)[2][d]))]
            assert len(moved_in) <= max(0, length - budget)
        pages = math.ceil(min(length, budget) / S)
        assert torch.equal(got.tables[0][b, :pages], ordered.tables[0][b, :pages])
    # Pages released: the same ones, in the same order, as topk_compact releases.
    assert torch.equal(got.tables[0], ordered.tables[0]) and int(got.n_free) == int(ordered.n_free)
    assert torch.equal(got.free[: int(got.n_free)], ordered.free[: int(ordered.n_free)])
    assert torch.equal(got.tables[1], before.tables[1]) and torch.equal(got.lens[1], before.lens[1])


@pytest.mark.parametrize("impl", [topk_evict_torch, topk_evict,
                                  pytest.param(topk_evict_triton, marks=pytest.mark.interpret)],
                         ids=["torch", "op", "triton"])
@given(case=scenarios(), seed=st.integers(0, 2**16))
def test_fast_paths_equal_reference_bit_for_bit(impl, case, seed):
    before, budgets, n_sink, n_recent = case
    start = shuffled(before, seed)
    ref = run_evict(topk_evict_ref, start, budgets, n_sink, n_recent)
    got = run_evict(impl, start, budgets, n_sink, n_recent)
    for x, y in zip(ref.pool_tensors(), got.pool_tensors()):
        assert torch.equal(bits(x), bits(y))
    assert all(torch.equal(x, y) for x, y in zip(ref.tables + ref.lens, got.tables + got.lens))
    assert int(ref.n_free) == int(got.n_free)
    assert torch.equal(ref.free[: int(ref.n_free)], got.free[: int(got.n_free)])


EVICT_IMPLS = {"ref": topk_evict_ref, "torch": topk_evict_torch, "op": topk_evict,
               "triton": pytest.param(topk_evict_triton, marks=pytest.mark.interpret)}


@pytest.mark.parametrize("impl", list(EVICT_IMPLS.values()), ids=list(EVICT_IMPLS))
@given(case=scenarios(packed=True), seed=st.integers(0, 2**16))
def test_packed_uint8_rows_move_as_their_bytes_as_floats_do(impl, case, seed):
    """uint8 packed K/V rows (random bytes, 24 or 40 wide) on shuffled rows end up exactly where the same
    bytes end up as float16 rows, and where the reference puts them."""
    before, budgets, n_sink, n_recent = case
    start = shuffled(before, seed)
    got = run_evict(impl, start, budgets, n_sink, n_recent)
    assert got.k.dtype == torch.uint8 and got.k.shape == before.k.shape
    assert_same_bytes(got, run_evict(impl, as_float_view(start), budgets, n_sink, n_recent))
    if impl is not topk_evict_ref:
        assert_same_bytes(got, run_evict(topk_evict_ref, start, budgets, n_sink, n_recent))


def test_errors_are_those_of_topk_compact():
    k = torch.zeros(2, 4, 1, 2)
    args = [k, k.clone(), torch.zeros(2, 4, 1, dtype=torch.int32), torch.zeros(2, 4, 1),
            torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)]
    free, n_free = torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match="n_sink \\+ n_recent must be <= budgets"):
        topk_evict(*args, one, one, one, free, n_free)
    args[0] = torch.zeros(2, 4, 1, 40, dtype=torch.uint8)  # packed K, float V
    with pytest.raises(TypeError, match="v_pages has dtype float32 but k_pages has dtype uint8"):
        topk_evict(*args, 2 * one, one, one, free, n_free)


def _without_extra(pool: Pool) -> Pool:
    out = pool.clone()
    out.extra = []
    return out


def run_excess(before: Pool, budgets, n_sink, n_recent, max_excess: int | None) -> Pool:
    """The selection kernel for rows a few tokens over budget: ``max_excess=None`` launches it directly
    (whatever the excess), an int goes through the Triton launcher's choice."""
    pool = before.clone(DEVICE)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    args = (pool.k, pool.v, pool.pos, pool.score, pool.tables[0], pool.lens[0], i32(budgets), i32(n_sink),
            i32(n_recent), pool.free, pool.n_free)
    if max_excess is None:
        _evict_excess(*args)
    else:
        topk_evict_triton(*args, [], max_excess)
    return pool.clone("cpu")


@pytest.mark.interpret
@given(case=scenarios(), seed=st.integers(0, 2**16), direct=st.booleans())
def test_selection_kernel_equals_reference_bit_for_bit(case, seed, direct):
    """The kernel that selects the evicted tokens (decode-time eviction, a few tokens over budget) leaves
    every pool tensor, table, length and the free stack as the reference does, whatever the excess (direct
    launch) and through the launcher given the excess as its bound; ties, infinities, NaN-free scores,
    shuffled slots, sinks and windows from the scenarios."""
    before, budgets, n_sink, n_recent = case
    start = _without_extra(shuffled(before, seed))
    ref = run_evict(topk_evict_ref, start, budgets, n_sink, n_recent)
    excess = max([int(n) - b for n, b in zip(start.lens[0].tolist(), budgets)] + [1])
    got = run_excess(start, budgets, n_sink, n_recent, None if direct else excess)
    for x, y in zip(ref.pool_tensors(), got.pool_tensors()):
        assert torch.equal(bits(x), bits(y))
    assert all(torch.equal(x, y) for x, y in zip(ref.tables + ref.lens, got.tables + got.lens))
    assert int(ref.n_free) == int(got.n_free)
    assert torch.equal(ref.free[: int(ref.n_free)], got.free[: int(got.n_free)])


@pytest.mark.interpret
@given(case=scenarios(packed=True), seed=st.integers(0, 2**16), direct=st.booleans())
def test_selection_kernel_moves_packed_uint8_rows_as_the_reference(case, seed, direct):
    """The selection kernel with uint8 packed K/V rows (24 or 40 bytes: a masked, non-power-of-two row)."""
    before, budgets, n_sink, n_recent = case
    start = _without_extra(shuffled(before, seed))
    ref = run_evict(topk_evict_ref, start, budgets, n_sink, n_recent)
    excess = max([int(n) - b for n, b in zip(start.lens[0].tolist(), budgets)] + [1])
    assert_same_bytes(ref, run_excess(start, budgets, n_sink, n_recent, None if direct else excess))


@pytest.mark.interpret
def test_selection_kernel_ranks_nan_lowest_and_keeps_it_raw():
    """A NaN score is evicted first (ranks lowest); a kept NaN moves as the same bits."""
    before, budgets, n_sink, n_recent = _one_row_pool()
    before.score.view(-1)[3] = float("nan")
    ref = run_evict(topk_evict_ref, before, budgets, n_sink, n_recent)
    got = run_excess(before, budgets, n_sink, n_recent, None)
    for x, y in zip(ref.pool_tensors(), got.pool_tensors()):
        assert torch.equal(bits(x), bits(y))


def _one_row_pool():
    from test_topk_compact import build_pool

    pool = build_pool(3, [[9], [0]], page_size=4, n_heads=1, dim=4, dtype=torch.float32, score_kind="float",
                      spare_pages=1, with_extra=False)
    return pool, [7], [1], [2]


def test_max_excess_is_checked():
    before, budgets, n_sink, n_recent = _one_row_pool()
    pool = before.clone()
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    args = (pool.k, pool.v, pool.pos, pool.score, pool.tables[0], pool.lens[0], i32(budgets), i32(n_sink),
            i32(n_recent), pool.free, pool.n_free)
    with pytest.raises(ValueError, match="max_excess=1 but a row is 2 tokens over"):
        topk_evict(*args, max_excess=1)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_excess must be a positive int"):
            topk_evict(*args, max_excess=bad)
    topk_evict(*args, max_excess=2)
    assert pool.lens[0].tolist() == [7]
