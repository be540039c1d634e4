"""topk_compact: the reference, the batched torch path (also through the public op on CPU) and the Triton
launcher (interpreter) against a dense oracle written here and against each other, plus the page-accounting
invariants and input errors (docs/contract.md §2.4)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from devices import DEVICE  # noqa: E402

# Imported from the submodule: `from kvkernels import topk_compact` can yield the same-named submodule
# (see the report on kvkernels/__init__.py).
from kvkernels.topk_compact import (
    compaction_plan,
    topk_compact,
    topk_compact_ref,
    topk_compact_torch,
    topk_compact_triton,
)

N_LAYERS = 2  # layer 0 is compacted, layer 1 shares the pool and must stay untouched


@dataclass
class Pool:
    """A pool with ``N_LAYERS`` cache layers whose pages are scattered in random order."""

    k: torch.Tensor  # [P, S, Hkv, D] float, or [P, S, Hkv, W] uint8 packed rows
    v: torch.Tensor
    pos: torch.Tensor  # [P, S, Hkv] int32: the logical index, so kept positions name the kept tokens
    score: torch.Tensor  # [P, S, Hkv] f32
    free: torch.Tensor  # [P + 1] int32
    n_free: torch.Tensor  # [1] int64
    tables: list[torch.Tensor]  # per layer [B, M] int32
    lens: list[torch.Tensor]  # per layer [B] int32
    extra: list[torch.Tensor] = field(default_factory=list)

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    def pool_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.pos, self.score, *self.extra]

    def clone(self, device: torch.device | str | None = None) -> Pool:
        """A copy, on ``device`` (default: where it is)."""
        c = lambda t: t.to(device or t.device, copy=True)  # noqa: E731
        cs = lambda ts: [c(t) for t in ts]  # noqa: E731
        return Pool(c(self.k), c(self.v), c(self.pos), c(self.score), c(self.free), c(self.n_free),
                    cs(self.tables), cs(self.lens), cs(self.extra))

    def dense(self, layer: int, b: int, h: int) -> list[torch.Tensor]:
        """Every pool tensor of sequence b, head h, in logical order: list of [L, ...]."""
        length = int(self.lens[layer][b])
        idx = torch.arange(length)
        pages = self.tables[layer][b, idx // self.page_size].long()
        return [x[pages, idx % self.page_size, h] for x in self.pool_tensors()]


def build_pool(seed: int, lens: list[list[int]], *, page_size: int, n_heads: int, dim: int,
               dtype: torch.dtype, score_kind: str, spare_pages: int, with_extra: bool) -> Pool:
    g = torch.Generator().manual_seed(seed)
    need = [[math.ceil(n / page_size) for n in layer] for layer in lens]
    max_pages = max([1] + [p for layer in need for p in layer]) + 1  # one unused column, like a real cache
    num_pages = sum(map(sum, need)) + spare_pages
    shape = (num_pages, page_size, n_heads)
    if dtype == torch.uint8:  # packed rows (a quantized pool): random bytes, ``dim`` of them per row
        k = torch.randint(0, 256, (*shape, dim), generator=g, dtype=torch.uint8)
        v = torch.randint(0, 256, (*shape, dim), generator=g, dtype=torch.uint8)
    else:
        k = torch.randn(*shape, dim, generator=g).to(dtype)
        v = torch.randn(*shape, dim, generator=g).to(dtype)
    if score_kind == "ties":
        score = torch.randint(0, 3, shape, generator=g).float()
    elif score_kind == "inf":
        values = torch.tensor([float("-inf"), 0.0, 1.0, float("inf")])
        score = values[torch.randint(0, 4, shape, generator=g)]
    else:
        score = torch.randn(shape, generator=g)
    extra = [torch.rand(shape, generator=g), torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)]
    pos = torch.full(shape, -1, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    tables, used = [], 0
    for layer, layer_need in zip(lens, need):
        table = torch.full((len(layer), max_pages), -1, dtype=torch.int32)
        for b, (n, p) in enumerate(zip(layer, layer_need)):
            table[b, :p] = perm[used:used + p]
            used += p
            idx = torch.arange(n)
            pos[table[b, idx // page_size].long(), idx % page_size] = idx.to(torch.int32)[:, None]
        tables.append(table)
    free = torch.full((num_pages + 1,), -7, dtype=torch.int32)
    free[: num_pages - used] = perm[used:]
    return Pool(k, v, pos, score, free, torch.tensor([num_pages - used]), tables,
                [torch.tensor(layer, dtype=torch.int32) for layer in lens], extra if with_extra else [])


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``x``, so equality means bit-identical (NaN payloads and -0.0 included)."""
    return x.contiguous().reshape(-1).view(torch.uint8)


def oracle_kept(scores: list[float], budget: int, n_sink: int, n_recent: int) -> list[int]:
    """Kept logical indices, by plain Python sorting on (-score, slot)."""
    length = len(scores)
    if length <= budget:
        return list(range(length))
    forced = {i for i in range(length) if i < n_sink or i >= length - n_recent}
    others = sorted((i for i in range(length) if i not in forced), key=lambda i: (-scores[i], i))
    return sorted(forced | set(others[: budget - len(forced)]))


@st.composite
def scenarios(draw, packed: bool = False):
    """A pool, budgets, sinks and recent windows; ``packed``: K/V as uint8 packed rows of 24 or 40 bytes (head
    dim 64 at 2 or 4 bits, group 32: neither a power of two)."""
    page_size = draw(st.sampled_from([1, 2, 4, 5]))
    n_heads = draw(st.integers(1, 3))
    batch = draw(st.integers(1, 3))
    edge = [0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size, 2 * page_size + 1]
    length = st.one_of(st.sampled_from(edge), st.integers(0, 4 * page_size + 3))
    lens = [[max(0, draw(length)) for _ in range(batch)] for _ in range(N_LAYERS)]
    budgets, n_sink, n_recent = [], [], []
    for n in lens[0]:
        budget = draw(st.one_of(st.integers(1, n + 2), st.sampled_from([1, page_size, page_size + 1])))
        sink = draw(st.integers(0, budget))
        budgets.append(budget)
        n_sink.append(sink)
        n_recent.append(draw(st.integers(0, budget - sink)))
    pool = build_pool(draw(st.integers(0, 2**16)), lens, page_size=page_size, n_heads=n_heads,
                      dim=draw(st.sampled_from([24, 40] if packed else [1, 4, 8])),
                      dtype=torch.uint8 if packed else draw(st.sampled_from([torch.float32, torch.float16])),
                      score_kind=draw(st.sampled_from(["ties", "float", "inf"])),
                      spare_pages=draw(st.integers(0, 3)), with_extra=draw(st.booleans()))
    return pool, budgets, n_sink, n_recent


def run(impl, before: Pool, budgets, n_sink, n_recent) -> Pool:
    """Run ``impl`` on a copy of ``before`` on the device it is tested on; return the result on the CPU.

    The Triton launcher and the public op run on :data:`DEVICE` (CUDA under ``nox -s gpu``, else the CPU
    through the interpreter / the torch path); the reference and the batched torch path are CPU code."""
    device = DEVICE if impl in (topk_compact, topk_compact_triton) else torch.device("cpu")
    pool = before.clone(device)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    impl(pool.k, pool.v, pool.pos, pool.score, pool.tables[0], pool.lens[0], i32(budgets), i32(n_sink),
         i32(n_recent), pool.free, pool.n_free, pool.extra)
    return pool.clone("cpu")


IMPLS = {"op": topk_compact, "ref": topk_compact_ref, "torch": topk_compact_torch,
         "triton": pytest.param(topk_compact_triton, marks=pytest.mark.interpret)}
FAST_IMPLS = {k: v for k, v in IMPLS.items() if k in ("torch", "triton")}  # compared to the reference


@pytest.mark.parametrize("impl", list(IMPLS.values()), ids=list(IMPLS))
@given(case=scenarios())
def test_matches_dense_oracle_and_keeps_pages_consistent(impl, case):
    before, budgets, n_sink, n_recent = case
    pool = run(impl, before, budgets, n_sink, n_recent)
    S = pool.page_size
    n_heads = pool.k.shape[2]

    expected_free = before.free[: int(before.n_free)].tolist()
    for b, (budget, sink, recent) in enumerate(zip(budgets, n_sink, n_recent)):
        length = int(before.lens[0][b])
        new_len = min(length, budget)
        assert int(pool.lens[0][b]) == new_len
        for h in range(n_heads):
            old = before.dense(0, b, h)
            kept = oracle_kept(old[3].tolist(), budget, sink, recent)
            new = pool.dense(0, b, h)
            for x_old, x_new in zip(old, new):  # K, V, pos, score, extras: bit-identical kept slots
                assert torch.equal(bits(x_new), bits(x_old[kept]))
            positions = new[2].tolist()
            assert positions == kept  # pos holds the logical index
            if length > budget:
                assert set(range(sink)) | set(range(length - recent, length)) <= set(positions)
        old_pages, new_pages = math.ceil(length / S), math.ceil(new_len / S)
        assert torch.equal(pool.tables[0][b, :new_pages], before.tables[0][b, :new_pages])
        assert (pool.tables[0][b, new_pages:old_pages] == -1).all()
        assert torch.equal(pool.tables[0][b, old_pages:], before.tables[0][b, old_pages:])
        expected_free += before.tables[0][b, new_pages:old_pages].tolist()

    # The free stack gains exactly the released pages, in (sequence, column) order.
    assert int(pool.n_free) == len(expected_free)
    assert pool.free[: len(expected_free)].tolist() == expected_free
    # Every page is either in use by some layer or free, exactly once.
    used = [int(p) for layer in range(N_LAYERS) for b in range(len(budgets))
            for p in pool.tables[layer][b, : math.ceil(int(pool.lens[layer][b]) / S)]]
    assert sorted(used + expected_free) == list(range(pool.k.shape[0]))
    # The other layer is untouched: table, lengths and every byte of its pages.
    assert torch.equal(pool.tables[1], before.tables[1]) and torch.equal(pool.lens[1], before.lens[1])
    layer1_pages = torch.cat([before.tables[1][b, : math.ceil(int(before.lens[1][b]) / S)]
                              for b in range(len(budgets))]).long()
    for x_old, x_new in zip(before.pool_tensors(), pool.pool_tensors()):
        assert torch.equal(bits(x_new[layer1_pages]), bits(x_old[layer1_pages]))


@pytest.mark.parametrize("impl", list(FAST_IMPLS.values()), ids=list(FAST_IMPLS))
@given(case=scenarios())
def test_fast_paths_equal_reference_everywhere(impl, case):
    """Beyond the oracle's view: the whole pool, tables and stack agree (the stack's sink entry aside)."""
    before, budgets, n_sink, n_recent = case
    ref = run(topk_compact_ref, before, budgets, n_sink, n_recent)
    tri = run(impl, before, budgets, n_sink, n_recent)
    for x_ref, x_tri in zip(ref.pool_tensors() + ref.tables + ref.lens + [ref.n_free, ref.free[:-1]],
                            tri.pool_tensors() + tri.tables + tri.lens + [tri.n_free, tri.free[:-1]]):
        assert torch.equal(bits(x_ref), bits(x_tri))


def as_float_view(pool: Pool) -> Pool:
    """The pool with its uint8 packed K/V rows seen as float16 (two bytes each): the same bytes, the float
    payload the ops moved before pools held packed rows."""
    out = pool.clone()
    out.k, out.v = out.k.view(torch.float16), out.v.view(torch.float16)
    return out


def assert_same_bytes(a: Pool, b: Pool) -> None:
    """Every pool tensor, table and length, and the free stack, bit-identical (the stack's sink aside)."""
    for x, y in zip(a.pool_tensors() + a.tables + a.lens + [a.n_free, a.free[:-1]],
                    b.pool_tensors() + b.tables + b.lens + [b.n_free, b.free[:-1]]):
        assert torch.equal(bits(x), bits(y))


@pytest.mark.parametrize("impl", list(IMPLS.values()), ids=list(IMPLS))
@given(case=scenarios(packed=True))
def test_packed_uint8_rows_move_as_their_bytes_as_floats_do(impl, case):
    """uint8 packed K/V rows (random bytes, 24 or 40 wide) end up exactly where the same bytes end up when
    the pool holds them as float16 rows, and as the reference moves them; ragged lengths from 0, page
    boundaries, ties, extras."""
    before, budgets, n_sink, n_recent = case
    got = run(impl, before, budgets, n_sink, n_recent)
    assert got.k.dtype == torch.uint8 and got.k.shape == before.k.shape
    assert_same_bytes(got, run(impl, as_float_view(before), budgets, n_sink, n_recent))
    if impl is not topk_compact_ref:
        assert_same_bytes(got, run(topk_compact_ref, before, budgets, n_sink, n_recent))


@given(case=scenarios())
def test_compaction_plan_names_the_oracles_kept_slots(case):
    """``compaction_plan`` (the selection for callers with their own layout, the vLLM plugin) over each
    sequence's scores as ``[B, Hkv, M]``: slot ``d < n_move`` receives the oracle's ``d``-th kept slot, and
    ``n_move`` is the budget exactly where a sequence is over it. NaN ranks lowest, as in the op."""
    before, budgets, n_sink, n_recent = case
    lens = before.lens[0].tolist()
    H, width = before.k.shape[2], max(lens + [1])
    scores = torch.full((len(lens), H, width), float("nan"))  # past a length: anything, never read
    for b, n in enumerate(lens):
        for h in range(H):
            scores[b, h, :n] = before.dense(0, b, h)[3]
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    src, n_move = compaction_plan(scores, i64(lens), i64(budgets), i64(n_sink), i64(n_recent))
    assert src.shape == (len(lens), H, width) and src.dtype == n_move.dtype == torch.int64
    for b, n in enumerate(lens):
        assert int(n_move[b]) == (budgets[b] if n > budgets[b] else 0)
        for h in range(H):
            ranked = [float("-inf") if math.isnan(x) else x for x in scores[b, h, :n].tolist()]
            want = oracle_kept(ranked, budgets[b], n_sink[b], n_recent[b])
            assert src[b, h, :int(n_move[b])].tolist() == (want if n > budgets[b] else [])


def test_nan_scores_rank_lowest():
    pool = build_pool(0, [[6], [0]], page_size=4, n_heads=1, dim=2, dtype=torch.float32, score_kind="float",
                      spare_pages=0, with_extra=False)
    pool.score[...] = float("nan")
    page0 = int(pool.tables[0][0, 0])
    pool.score[page0, 2, 0] = -1e30  # the only real score: it must win over every NaN
    results = [run(impl, pool, [2], [1], [0])
               for impl in (topk_compact_ref, topk_compact_torch, topk_compact_triton, topk_compact)]
    for p in results:
        assert p.dense(0, 0, 0)[2].tolist() == [0, 2]


def _small_args(batch: int = 2):
    pool = build_pool(1, [[7, 3][:batch], [0] * batch], page_size=4, n_heads=2, dim=4, dtype=torch.float32,
                      score_kind="float", spare_pages=1, with_extra=False).clone(DEVICE)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    args = dict(k_pages=pool.k, v_pages=pool.v, slot_pos=pool.pos, slot_score=pool.score,
                page_table=pool.tables[0], seq_lens=pool.lens[0], budgets=i32([4] * batch),
                n_sink=i32([1] * batch), n_recent=i32([1] * batch), free_pages=pool.free, n_free=pool.n_free)
    return args


@pytest.mark.parametrize("change, error, match", [
    (dict(budgets=torch.tensor([0, 4], dtype=torch.int32)), ValueError, "budgets must be >= 1"),
    (dict(n_sink=torch.tensor([4, 1], dtype=torch.int32)), ValueError, "n_sink \\+ n_recent must be <="),
    (dict(n_recent=torch.tensor([-1, 1], dtype=torch.int32)), ValueError, ">= 0"),
    (dict(budgets=torch.tensor([4.0, 4.0])), TypeError, "budgets has dtype float32"),
    (dict(budgets=torch.tensor([4], dtype=torch.int32)), ValueError, "budgets must have shape \\[2\\]"),
    (dict(slot_pos=torch.zeros(1, 1, 1, dtype=torch.int32)), ValueError, "slot_pos must have shape"),
    (dict(slot_score=torch.zeros(4, 4, 2, dtype=torch.float16)), TypeError, "slot_score has dtype float16"),
    (dict(v_pages=torch.zeros(4, 4, 2, 4, device="meta")), ValueError, "v_pages is on meta"),
    (dict(v_pages=torch.zeros(4, 4, 2, 16, dtype=torch.uint8)), TypeError,
     "v_pages has dtype uint8 but k_pages has dtype float32"),
    (dict(k_pages=torch.zeros(4, 4, 2, 16, dtype=torch.uint8)), TypeError,
     "v_pages has dtype float32 but k_pages has dtype uint8"),
    (dict(k_pages=torch.zeros(4, 4, 2, 4, dtype=torch.int32)), TypeError, "k_pages has dtype int32.*uint8"),
    (dict(k_pages=torch.zeros(4, 4, 4, 2).transpose(2, 3)), ValueError, "k_pages must be contiguous"),
    (dict(free_pages=torch.zeros(4, dtype=torch.int32)), ValueError, "free_pages must have shape"),
    (dict(n_free=torch.zeros(1, dtype=torch.int32)), TypeError, "n_free has dtype int32"),
    (dict(seq_lens=torch.tensor([9, 3], dtype=torch.int32)), ValueError, "page_table\\[0, 2\\]"),
    (dict(extra=[torch.zeros(4, 4, 1)]), ValueError, "extra\\[0\\] must have shape"),
])
def test_bad_input_raises_before_writing(change, error, match):
    args = _small_args()
    snapshot = {k: v.clone() for k, v in args.items()}
    # On the suite's device, except the argument whose device is the error.
    args.update({k: v if isinstance(v, list) or v.device.type == "meta" else v.to(DEVICE)
                 for k, v in change.items()})
    if "extra" in change:
        args["extra"] = [t.to(DEVICE) for t in change["extra"]]
    with pytest.raises(error, match=match):
        topk_compact(**args)
    for name, value in snapshot.items():
        if name not in change:
            assert torch.equal(args[name], value), f"{name} was written before the error"


def test_packed_k_and_v_of_different_widths_are_refused():
    args = _small_args()
    args["k_pages"] = torch.zeros(4, 4, 2, 40, dtype=torch.uint8, device=DEVICE)
    args["v_pages"] = torch.zeros(4, 4, 2, 24, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="v_pages must have shape \\[4, 4, 2, 40\\] \\(same as k_pages\\)"):
        topk_compact(**args)


def test_compiles_without_graph_breaks():
    """The op is opaque to torch.compile: fullgraph tracing works and gives the eager result."""
    eager, compiled = _small_args(), _small_args()
    topk_compact(**eager)
    torch.compile(lambda a: topk_compact(**a), fullgraph=True, backend="aot_eager")(compiled)
    for name in eager:
        assert torch.equal(eager[name], compiled[name]), name
