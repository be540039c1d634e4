"""The paged cache with quantized rows (issue 36: ``compose(..., "kivi(bits=..., residual=0)")``).

Side by side with the same cache in float32 on the same random prompts and steps (``FakeRun``): the same
tokens are kept (eviction reads scores from the unquantized prefill, and positions), every kept row is the
quantized row of the original token bit for bit (``decode(encode(x))``, however often eviction moved it),
the decode attention equals dense attention over those dequantized rows, the pool holds packed ``uint8``
rows of the bytes the format claims, and the report compares against an unquantized cache. A compiled decode
step equals the eager one without a recompile.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
import torch._dynamo
from hypothesis import example, given

from devices import DEVICE
from kvkernels import gumbel_noise_keyed
from kvkernels.quant import QuantFormat, dequantize_rows, quantize_rows
from kvpolicies import compose
from test_cache import FakeRun, check_invariants, dense_attention


def round_trip(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return dequantize_rows(quantize_rows(x, fmt), x.shape[-1], fmt, x.dtype)


def assert_rotated_round_trip(got: torch.Tensor, want: torch.Tensor, fmt: QuantFormat, where) -> None:
    """``got [n, D]`` is a row stored rotated (``kvkernels.quant.hadamard_rotation``) and read back: in the
    rotated basis it lies within half a step of each group of ``want``'s rotated row (the quantization bound;
    the step from the group's range, the float16 parameters rounded outward), and rotating back is exact up
    to float32 arithmetic."""
    from kvkernels.quant import hadamard_rotation

    R = hadamard_rotation(want.shape[-1], want.device)
    w, g = want.float() @ R, got.float() @ R
    groups = w.unflatten(-1, (-1, fmt.group))
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    half_step = ((hi - lo) / (2**fmt.bits - 1) / 2 * 1.01 + 2e-3 * lo.abs() + 1e-5).expand_as(groups)
    err = (g - w).unflatten(-1, (-1, fmt.group)).abs()
    assert bool((err <= half_step).all()), (where, float((err - half_step).max()))


def check_contents(native, quant, fmt: QuantFormat) -> None:
    """Same kept tokens (positions, per head); each kept row the round trip of the native one, exactly."""
    for l in range(native.n_layers):
        for b in range(native.n_sequences):
            for h, (want, got) in enumerate(zip(native.head_contents(l, b), quant.head_contents(l, b),
                                                strict=True)):
                assert torch.equal(got["pos"], want["pos"]), (l, b, h)
                for name in ("k", "v"):
                    assert torch.equal(got[name], round_trip(want[name], fmt)), (l, b, h, name)


@st.composite
def cases(draw):
    eviction = draw(st.sampled_from(["full", "snapkv(window=2)", "knorm", "streaming(sinks=1)",
                                     "snapkv(window=2)+adakv"]))  # adakv: one row per KV head
    bits = draw(st.sampled_from([2, 4, 8]))
    D = draw(st.sampled_from([8, 16]))
    group = draw(st.sampled_from([g for g in (4, 8, 16) if D % g == 0]))
    page_size = draw(st.sampled_from([1, 3, 4]))
    lens = draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 9]), min_size=1, max_size=3))
    n_kv, gqa = draw(st.sampled_from([(1, 1), (2, 2), (1, 3)]))
    budget = draw(st.sampled_from([0.5, 0.8, 1.0]))
    return eviction, QuantFormat(bits, group), D, page_size, lens, n_kv, gqa, budget, draw(st.integers(0, 99))


def check_attention_over_held(cache, l: int, q: torch.Tensor, out: torch.Tensor, gqa: int, scale: float):
    """Layer ``l``'s decode attention ``out`` equals dense attention of ``q`` over exactly the rows the cache
    holds (dequantized, as ``head_contents`` reads them), per sequence and KV head."""
    for b in range(cache.n_sequences):
        for h, held in enumerate(cache.head_contents(l, b)):
            qh = q[b, h * gqa:(h + 1) * gqa]  # the query heads of KV head h
            want = dense_attention(qh, held["k"][:, None], held["v"][:, None], scale)
            torch.testing.assert_close(out[b, h * gqa:(h + 1) * gqa], want.to(out.dtype), rtol=1e-4,
                                       atol=1e-4)


def side_by_side(case, *, steps: int, extra: str = ""):
    """A ``FakeRun`` of ``case`` and two caches on it, unquantized and ``kivi(residual=0{extra})`` in the
    case's format: ``(run, rows, native, quant)``."""
    eviction, fmt, D, page_size, lens, n_kv, gqa, budget, seed = case
    run = FakeRun(2, n_kv, gqa, D, lens, steps, seed=seed)
    spec = f"kivi(bits={fmt.bits}, group={fmt.group}, residual=0{extra})"
    rows = "heads" if "adakv" in eviction else "sequences"
    native = run.cache(compose(eviction, budget=budget), page_size=page_size, rows=rows)
    quant = run.cache(compose(eviction, spec, budget=budget), page_size=page_size, rows=rows)
    return run, rows, native, quant


def decode_side_by_side(run, native, quant, gqa: int, check) -> None:
    """Prefill both caches and decode ``run``'s steps through both, calling ``check()`` after the prefill and
    after every step, and checking each of ``quant``'s decode attentions against dense attention over the rows
    it holds."""
    for cache in (native, quant):
        run.prefill(cache)
    check()
    pos = run.step_positions
    for t in range(run.n_steps):
        for cache in (native, quant):
            cache.prepare_decode(t)
            for l, (q, k, v) in enumerate(run.steps[t]):
                cache.append(l, k, v, pos(t))
                out = cache.attend(l, q, pos(t), scale=run.scale)
                if cache is quant:
                    check_attention_over_held(quant, l, q, out, gqa, run.scale)
            cache.after_step(t)
        check()


@given(case=cases())
def test_quantized_cache_keeps_the_same_tokens_as_their_quantized_rows(case):
    eviction, fmt, D, page_size, lens, n_kv, gqa, budget, seed = case
    run, rows, native, quant = side_by_side(case, steps=4)
    W = fmt.row_bytes(D)
    assert quant.k_pages.dtype == torch.uint8 and quant.k_pages.shape[-1] == W
    heads_per_row = 1 if rows == "heads" else n_kv
    assert quant.page_bytes == page_size * heads_per_row * (2 * W + 8)  # packed K and V, position, score

    def check():
        if rows == "sequences":  # (its report's counts are per sequence; head caches: test_head_cache)
            check_invariants(quant)
        check_contents(native, quant, fmt)

    decode_side_by_side(run, native, quant, gqa, check)
    rep, full = quant.report(), native.report()
    assert rep.tokens_per_layer == full.tokens_per_layer and rep.head_tokens == full.head_tokens
    assert rep.full_cache_bytes == full.full_cache_bytes  # the unquantized equivalent, not quantized pages
    assert rep.total_bytes * native.page_bytes == full.total_bytes * quant.page_bytes
    assert f"{fmt.bits}-bit rows, group {fmt.group} ({W} B" in str(rep)


def test_quantized_rows_save_what_they_claim_at_a_model_shape():
    """Head dim 64, 4 bits, group 32: 40 B a K or V row against 128 B in float16 and 256 B in float32."""
    run = FakeRun(1, 2, 2, 64, [40], 1, seed=0)
    quant = run.cache(compose("snapkv", "kivi(bits=4, residual=0)", budget=0.2), page_size=8)
    native = run.cache(compose("snapkv", budget=0.2), page_size=8)
    for cache in (native, quant):
        run.prefill(cache)
    assert quant.storage.row_bytes == 40 and native.storage.row_bytes == 256
    rep = quant.report()
    assert rep.total_bytes == native.report().total_bytes * (2 * 40 + 8) // (2 * 256 + 8)
    assert rep.full_cache_bytes == native.report().full_cache_bytes


@pytest.mark.slow
@pytest.mark.parametrize("spec", [("streaming(sinks=1)", "kivi(bits=4, group=8, residual=0)"),
                                  ("h2o(recent=1)", "kivi(bits=2, group=8, residual=0)"),
                                  ("knorm", "kivi(bits=2, group=8, residual=0, channel_scale=True)"),
                                  ("snapkv(window=2)", "zipcache(high=8, low=2, group=8)"),
                                  ("h2o(recent=1)", "kivi(bits=4, group=4, residual=2)"),
                                  ("h2o(recent=1)", "kivi(bits=4, group=8, residual=0, rotate=True)"),
                                  ("h2o(recent=1)", "mikv(low=4, group=4)"),
                                  ("h2o(recent=0.5)", "zipcache(high=8, low=2, group=8, every=2)")],
                         ids=["one-format", "one-format-scored", "channel-separable", "two-formats",
                              "two-formats-scored", "rotated-scored", "two-formats-demoted",
                              "two-formats-recompressed"])
def test_compiled_decode_step_over_quantized_rows_matches_eager_without_recompiling(spec):
    torch._dynamo.reset()
    run = FakeRun(2, 2, 2, 16, [9, 3, 6], 8, seed=2)
    policy = compose(*spec, budget=4)
    eager, compiled = (run.cache(policy, page_size=4) for _ in range(2))
    for cache in (eager, compiled):
        run.prefill(cache)

    def step(cache, qkv, positions, scale):
        outs = []
        for l, (q, k, v) in enumerate(qkv):
            cache.append(l, k, v, positions)
            outs.append(cache.attend(l, q, positions, scale=scale))
        return torch.stack(outs)

    step_c = torch.compile(step, fullgraph=True, backend="inductor")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(run.n_steps):
            outs = []
            for cache, fn in ((eager, step), (compiled, step_c)):
                cache.prepare_decode(t)
                outs.append(fn(cache, run.steps[t], run.step_positions(t), run.scale))
                cache.after_step(t)
            # Bit for bit: the compiled write keeps quantize's outward rounding (a custom op). Each check
            # names the step and the differing (page, slot, head) rows: the GPU run records the message.
            for name in ("k_pages", "v_pages"):
                a, b = getattr(compiled, name), getattr(eager, name)
                where = (a != b).flatten(3).any(-1).nonzero().tolist() if a.shape == b.shape else "shape"
                assert torch.equal(a, b), f"step {t}: {name} differ at (page, slot, head) {where[:8]}"
            if compiled.side is not None:
                for name in ("k_pages", "v_pages"):
                    a, b = getattr(compiled.side.pool, name), getattr(eager.side.pool, name)
                    assert torch.equal(a, b), f"step {t}: side {name} differ"
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6,
                                       msg=lambda m, t=t: f"step {t}: {m}")
            torch.testing.assert_close(compiled.slot_score, eager.slot_score, rtol=1e-6, atol=1e-6)
            if compiled.side is not None:
                torch.testing.assert_close(compiled.side.pool.slot_score, eager.side.pool.slot_score,
                                           rtol=1e-6, atol=1e-6)
                assert (compiled.side.lens == eager.side.lens).all()
            if compiled.side is None:  # (check_invariants counts one region's pages)
                check_invariants(compiled)


@pytest.mark.parametrize("spec", ["kivi(bits=4, group=8, residual=0)", "kivi(bits=2, group=8, residual=4)",
                                  "zipcache(group=8)", "mikv(group=8)"])
def test_alibi_model_with_quantized_rows_is_refused_before_any_prefill(spec):
    """An ALiBi model (``CacheLayout.alibi``: MPT, kvmodels' own or transformers' wrapped) with a quantizing
    precision is refused where the cache or the Decoder is built, naming the policy, the reason and the fix,
    not at the first decode step after the whole prompt was prefilled; unquantized rows still run, and a RoPE
    model takes the same policy."""
    from kvmodels.decoder import Decoder
    from kvmodels.generate import generate
    from kvmodels.llama import Llama, LlamaConfig
    from kvmodels.mpt import MPT, MPTConfig

    policy = compose("h2o", spec, budget=0.5)
    why = r"policy 'h2o\+\w+': precision .*ALiBi.* use a RoPE model .* or precision 'native'"
    run = FakeRun(1, 1, 2, 8, [3], 1, seed=0, alibi=True)
    with pytest.raises(ValueError, match=why):
        run.cache(policy, alibi=True)
    run.cache(compose("h2o", budget=0.5), alibi=True)  # native rows: ALiBi is read by the native kernel
    torch.manual_seed(0)
    mpt = MPT(MPTConfig(vocab_size=11, n_layers=1, n_heads=2, hidden_size=16, intermediate_size=8,
                        max_seq_len=16)).to(DEVICE)
    assert mpt.cache_layout().alibi
    prefilled = []
    with pytest.raises(ValueError, match=why):
        Decoder(mpt, policy)
    with pytest.raises(ValueError, match=why):
        generate(mpt, [[1, 2, 3]], 2, policy, on_prefill=lambda *a: prefilled.append(a))
    assert not prefilled
    llama = Llama(LlamaConfig(vocab_size=11, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, intermediate=8,
                              max_seq_len=16)).to(DEVICE)
    assert not llama.cache_layout().alibi
    assert len(generate(llama, [[1, 2, 3]], 2, policy).tokens[0]) == 2


def test_alibi_with_quantized_rows_is_refused_by_name():
    """A cache built without ``alibi`` (a model that did not say) still refuses ALiBi slopes at ``attend``."""
    run = FakeRun(1, 1, 2, 8, [3], 1, seed=0, alibi=True)
    cache = run.cache(compose("full", "kivi(bits=4, group=8, residual=0)"))
    run.prefill(cache)
    cache.prepare_decode(0)
    q, k, v = run.steps[0][0]
    cache.append(0, k, v, run.step_positions(0))
    with pytest.raises(ValueError, match="ALiBi.*quantized decode kernel"):
        cache.attend(0, q, run.step_positions(0), scale=run.scale, alibi_slopes=run.alibi)


def test_device_of_the_suite():  # the quantized cache runs where the suite runs (CPU torch path or CUDA)
    run = FakeRun(1, 1, 1, 8, [5], 2, seed=1)
    cache = run.cache(compose("knorm", "kivi(bits=8, group=8, residual=0)", budget=0.6))
    run.prefill(cache)
    assert cache.k_pages.device.type == torch.device(DEVICE).type
    for t in range(2):
        run.decode_step(cache, t)
    check_invariants(cache)


# ----------------------------------------------------------------------------------------------------
# Two formats: a side region (kvmodels.cache.tiers)
# ----------------------------------------------------------------------------------------------------

@st.composite
def two_format_cases(draw):
    eviction = draw(st.sampled_from(["full", "snapkv(window=2)", "knorm(decode=False)"]))
    precision = draw(st.sampled_from(["kivi(bits={b}, group={g}, residual={r})", "mikv(low={b}, group={g})",
                                      "zipcache(high=8, low={b}, salient={s}, group={g})",
                                      "zipcache(high=16, low={b}, salient={s}, group={g})",
                                      "zipcache(high=8, low={b}, salient={s}, group={g}, rotate=True)"]))
    if precision.startswith("zipcache") and eviction != "snapkv(window=2)":
        eviction = "snapkv(window=2)"  # zipcache ranks by the eviction's prompt scores
    spec = precision.format(b=draw(st.sampled_from([2, 4])), g=draw(st.sampled_from([2, 4, 8])),
                            r=draw(st.sampled_from([1, 2, 5])), s=draw(st.sampled_from([0.0, 0.3, 1.0])))
    lens = draw(st.lists(st.sampled_from([1, 2, 3, 5, 9]), min_size=1, max_size=3))
    n_kv, gqa = draw(st.sampled_from([(1, 1), (2, 2)]))
    return eviction, spec, draw(st.sampled_from([1, 4])), lens, n_kv, gqa, \
        draw(st.sampled_from([0.5, 1.0])), draw(st.integers(0, 99))


def tokens_of(cache, l, b):
    """Every token a tiered cache holds for layer ``l``, sequence ``b``, per KV head: position -> (k, v)
    as stored (dequantized), from both regions; and which region held it."""
    out = []
    main = cache.head_contents(l, b)
    side = cache.side.contents(l, b)
    for h in range(len(main)):
        held = {}
        for region, c in (("main", main[h]), ("side", side[h])):
            for i, p in enumerate(c["pos"].tolist()):
                assert p not in held, f"position {p} in both regions"
                held[p] = (c["k"][i], c["v"][i], region)
        out.append(held)
    return out


@given(case=two_format_cases())
@example(case=("snapkv(window=2)", "zipcache(high=8, low=2, salient=0.3, group=4, rotate=True)", 4, [5, 9], 2,
               2, 0.5, 1))  # rotated rows in both regions, whatever the profile draws
def test_two_formats_hold_what_the_precision_policy_assigns(case):
    """Each prompt token sits in the region of its assigned format (nothing assigned 0 is held, nothing
    assigned is lost), stored as the round trip of its original K/V through that format, bit for bit (rotated
    rows, ``rotate=True``: within the rotated round trip's bound, both regions in one rotation); decode
    tokens go to the main region; attention is one softmax over both regions' rows (a query rotated once)."""
    eviction, spec, page_size, lens, n_kv, gqa, budget, seed = case
    run = FakeRun(2, n_kv, gqa, 8, lens, 7, seed=seed)
    policy = compose(eviction, spec, budget=budget)
    native = run.cache(compose(eviction, budget=budget), page_size=page_size)
    cache = run.cache(policy, page_size=page_size)
    assert cache.side is not None
    main_fmt = cache.storage.fmt if cache.storage.quantized else None
    side_fmt = cache.side.storage.fmt
    for c in (native, cache):
        run.prefill(c)

    rotated = cache.storage.rotation is not None
    assert cache.side.storage.rotation is cache.storage.rotation  # one basis for the one softmax

    def check_row(got, orig, fmt, where):
        if rotated:
            assert_rotated_round_trip(got[None], orig, fmt, where)
        else:
            assert torch.equal(got, orig[0] if fmt is None else round_trip(orig, fmt)[0]), where

    for l in range(2):
        for b, L in enumerate(lens):
            kept = torch.zeros(n_kv, L, dtype=torch.bool)
            for h, c in enumerate(native.head_contents(l, b)):
                kept[h, c["pos"].long()] = True
            held = tokens_of(cache, l, b)
            k_orig, v_orig = run.prompt[l][b][1], run.prompt[l][b][2]
            for h in range(n_kv):
                if "zipcache" not in spec:  # (zipcache's ranking needs the prompt scores: counts below)
                    bits = policy.precision.assign(kept, None)[h]
                    assert set(held[h]) == {i for i in range(L) if bits[i]}
                    for p, (_, _, region) in held[h].items():
                        assert (bits[p] == (cache.side.main_bits if region == "main" else side_fmt.bits))
                else:
                    assert set(held[h]) == set(kept[h].nonzero()[:, 0].tolist())
                    n_main = sum(r == "main" for *_, r in held[h].values())
                    assert n_main == math.ceil(int(kept[h].sum()) * policy.precision.salient - 1e-9)
                    # ranked by normalized score: the votes over the voting queries that see the token
                    c = native.head_contents(l, b)[h]
                    W = policy.eviction.prefill_window(L) or L
                    sal = {int(x): float(y) / min(W, L - int(x)) for x, y in zip(c["pos"], c["score"])}
                    main_s = [sal[x] for x, (*_, r) in held[h].items() if r == "main"]
                    side_s = [sal[x] for x, (*_, r) in held[h].items() if r == "side"]
                    assert not main_s or not side_s or min(main_s) >= max(side_s), (l, b, h)
                for p, (k, v, region) in held[h].items():
                    fmt = main_fmt if region == "main" else side_fmt
                    check_row(k, k_orig[p:p + 1, h], fmt, (l, b, h, p, region))
                    check_row(v, v_orig[p:p + 1, h], fmt, (l, b, h, p, region))
    pos = run.step_positions
    for t in range(run.n_steps):
        cache.prepare_decode(t)
        for l, (q, k, v) in enumerate(run.steps[t]):
            cache.append(l, k, v, pos(t))
            out = cache.attend(l, q, pos(t), scale=run.scale)
            for b in range(len(lens)):
                held = tokens_of(cache, l, b)
                assert held[0][int(pos(t)[b])][2] == "main"  # the new token
                assert len(held[0]) == len(set(held[0]))
                for h in range(n_kv):
                    ks = torch.stack([x[0] for x in held[h].values()])[:, None]
                    vs = torch.stack([x[1] for x in held[h].values()])[:, None]
                    want = dense_attention(q[b, h * gqa:(h + 1) * gqa], ks, vs, run.scale)
                    torch.testing.assert_close(out[b, h * gqa:(h + 1) * gqa], want.to(out.dtype), rtol=1e-4,
                                               atol=1e-4)
        cache.after_step(t)
        p = policy.precision
        if p.name == "kivi":  # the residual ages into the quantized region a group at a time
            assert (cache.host.lens[:, :len(lens)] <= p.residual + p.group).all()
    # Every token held is the round trip of its original through its region's format (decode steps too).
    for l in range(2):
        for b, L in enumerate(lens):
            for h, held in enumerate(tokens_of(cache, l, b)):
                for p, (k, v, region) in held.items():
                    fmt = main_fmt if region == "main" else side_fmt
                    k0, v0 = (run.prompt[l][b][i][p:p + 1, h] if p < L
                              else run.steps[p - L][l][i][b:b + 1, h] for i in (1, 2))
                    check_row(k, k0, fmt, (l, b, p))
                    check_row(v, v0, fmt, (l, b, p))
    check_two_regions(cache)
    side = cache.side
    for b in range(len(lens)):
        cache.finish_sequence(b)
    assert side.pool.free == side.pool.num_pages and cache.pool.free == cache.pool.num_pages


def check_two_regions(cache) -> None:
    """Pages: every page of each pool owned once or free, free counts and lengths mirrored on the host; the
    report counts both regions' pages and tokens."""
    S, n = cache.page_size, cache.batch_size
    pages = {}
    for name, pool, table, lens in (("main", cache.pool, cache.page_table, cache.host.lens),
                                    ("side", cache.side.pool, cache.side.page_table, cache.side.lens)):
        owned = [p for l in range(cache.n_layers) for b in range(n)
                 for p in table[l, b, :math.ceil(int(lens[l, b]) / S)].tolist()]
        assert sorted(owned + pool.free_pages[:pool.free].tolist()) == list(range(pool.num_pages)), name
        assert int(pool.n_free) == pool.free, name
        pages[name] = len(owned)
    side = cache.side
    assert torch.equal(side.seq_lens.cpu(), torch.from_numpy(side.lens).to(torch.int32))
    rep = cache.report()
    assert rep.total_bytes == pages["main"] * cache.page_bytes + pages["side"] * side.pool.page_bytes
    held = cache.host.lens[:, :n] + side.lens[:, :n]  # the report counts both regions
    assert rep.tokens_per_layer == tuple(tuple(int(x) for x in row) for row in held)


@given(case=two_format_cases(), n_new=st.sampled_from([1, 3, 6]), h2o=st.booleans())
def test_a_tiered_cache_continues_over_both_regions(case, n_new, h2o):
    """A follow-up turn on a two-format cache, after decode steps (``begin_extend`` / ``extend_attend`` /
    ``end_extend``): its tokens attend to every token either region holds, as stored, and causally to each
    other (dense reference); afterwards every token held before is held still, bit for bit (or, aged out of
    KIVI's residual, as the side format's round trip of its stored row), and the new ones are the main
    format's round trip of their K/V; nothing is evicted; KIVI's residual has aged; every page owned once.
    With ``h2o`` (KIVI's residual with eviction while decoding) the follow-up's rows add their attention to
    every held token's score in both regions, as decode steps would (new tokens from 0)."""
    eviction, spec, page_size, lens, n_kv, gqa, budget, seed = case
    spec = spec.replace(", rotate=True", "")  # exact rows here (rotated ones: the session test and the above)
    h2o = h2o and spec.startswith("kivi")
    if h2o:
        eviction = "h2o(recent=1)"
    run = FakeRun(2, n_kv, gqa, 8, lens, 2, seed=seed)
    policy = compose(eviction, spec, budget=budget)
    cache = run.cache(policy, page_size=page_size, max_new=3 + n_new)
    run.prefill(cache)
    for t in range(run.n_steps):
        run.decode_step(cache, t)
    main_fmt = cache.storage.fmt if cache.storage.quantized else None
    side_fmt = cache.side.storage.fmt

    def stored(x, fmt):
        return x if fmt is None else round_trip(x, fmt)

    b = len(lens) - 1
    before = [tokens_of(cache, l, b) for l in range(2)]
    scores_before = [held_with_scores(cache, l, b) for l in range(2)]
    g = torch.Generator().manual_seed(seed + 1)
    new = [tuple(torch.randn(n_new, h, 8, generator=g).to(DEVICE) for h in (n_kv * gqa, n_kv, n_kv))
           for _ in range(2)]
    start = lens[b] + run.n_steps
    positions = torch.arange(start, start + n_new, dtype=torch.int32, device=DEVICE)
    cache.begin_extend(b, n_new)
    for l, (q, k, v) in enumerate(new):
        out = cache.extend_attend(l, b, q, k, v, positions, scale=run.scale)
        for h in range(n_kv):
            ks = torch.stack([x[0] for x in before[l][h].values()])
            vs = torch.stack([x[1] for x in before[l][h].values()])
            gained = torch.zeros(len(ks) + n_new)  # H2O: each row's attention, its group's mean
            for i in range(n_new):
                keys = torch.cat([ks, k[:i + 1, h]])[:, None]
                values = torch.cat([vs, v[:i + 1, h]])[:, None]
                qh = q[i, h * gqa:(h + 1) * gqa]
                want = dense_attention(qh, keys, values, run.scale)
                torch.testing.assert_close(out[i, h * gqa:(h + 1) * gqa], want.to(out.dtype), rtol=1e-4,
                                           atol=1e-4)
                probs = torch.softmax(run.scale * qh.float() @ keys[:, 0].float().t(), dim=-1).mean(0)
                gained[:len(ks) + i + 1] += probs
            if h2o:  # both regions' held tokens, then the new ones (from 0): the rows' attention added
                scores = {**{x: s for x, (*_, s) in scores_before[l][h].items()},
                          **{x: 0.0 for x in positions.tolist()}}
                held = list(before[l][h]) + positions.tolist()
                now = held_with_scores(cache, l, b)[h]
                got = torch.tensor([now[x][3] for x in held])
                want_scores = torch.tensor([scores[x] for x in held]) + gained
                torch.testing.assert_close(got, want_scores, rtol=1e-4, atol=1e-5)
    cache.end_extend(b)
    p = policy.precision
    for l, (_, k, v) in enumerate(new):
        after = tokens_of(cache, l, b)
        for h in range(n_kv):
            assert set(after[h]) == set(before[l][h]) | set(positions.tolist())  # nothing evicted
            rows = {pos: (k0, v0, region) for pos, (k0, v0, region) in before[l][h].items()}
            for i, pos in enumerate(positions.tolist()):
                rows[pos] = (stored(k[i:i + 1, h], main_fmt)[0], stored(v[i:i + 1, h], main_fmt)[0], "main")
            for pos, (k1, v1, region) in after[h].items():
                k0, v0, was = rows[pos]
                if region != was:  # aged out of KIVI's residual: quantized from its stored row
                    assert (was, region, p.name) == ("main", "side", "kivi"), (l, h, pos)
                    k0, v0 = (round_trip(x[None], side_fmt)[0] for x in (k0, v0))
                assert torch.equal(k1, k0) and torch.equal(v1, v0), (l, h, pos, was, region)
    if p.name == "kivi":
        assert (cache.host.lens[:, :len(lens)] <= p.residual + p.group).all()
    check_two_regions(cache)
    cache.restart_decode(1)  # and the next generation decodes over both regions
    run.decode_step(cache, 0, pos=torch.tensor([L + run.n_steps + (n_new if i == b else 0)
                                                for i, L in enumerate(lens)], dtype=torch.int32,
                                               device=DEVICE))
    check_two_regions(cache)


@st.composite
def prefill_chunk_cases(draw):
    precision = draw(st.sampled_from(["kivi(bits={b}, group={g}, residual={r})", "mikv(low={b}, group={g})",
                                      "zipcache(high=16, low={b}, group={g}, every={r})",
                                      "zipcache(high=8, low=2, group={g}, salient=0.5, every={r})"]))
    evictions = ["snapkv(window=2)", "h2o(recent=1)", "snapkv(window=2, per_head=False)"]
    # ZipCache ranks by the policy's scores (streaming has none); TOVA's last query votes alone
    evictions += ["tova"] if precision.startswith("zipcache") else ["streaming(sinks=1)"]
    eviction = draw(st.sampled_from(evictions))
    spec = precision.format(b=draw(st.sampled_from([2, 4, 8])), g=draw(st.sampled_from([2, 4, 8])),
                            r=draw(st.sampled_from([1, 2, 5])))
    lens = draw(st.lists(st.sampled_from([1, 2, 3, 5, 9]), min_size=1, max_size=3))
    n_kv, gqa = draw(st.sampled_from([(1, 1), (2, 2), (1, 3)]))
    chunks = draw(st.lists(st.sampled_from([1, 2, 4, 7]), min_size=1, max_size=3))
    return (eviction, spec, draw(st.sampled_from([1, 4])), lens, n_kv, gqa, chunks,
            draw(st.sampled_from([0.3, 0.5, 1.0])), draw(st.integers(0, 99)))


@given(case=prefill_chunk_cases())
@example(case=("snapkv(window=2)", "kivi(bits=4, group=2, residual=2)", 1, [9, 5], 2, 2, [7, 4], 0.3, 3))
@example(case=("h2o(recent=1)", "mikv(low=4, group=2)", 4, [5, 3], 1, 3, [4, 7], 0.5, 1))
@example(case=("snapkv(window=2)", "mikv(low=2, group=2)", 1, [5], 1, 1, [2], 0.3, 0))  # regions interleave
@example(case=("snapkv(window=2)", "zipcache(high=16, low=4, group=2, every=5)", 4, [9, 5], 2, 2, [7, 4], 0.5,
               2))  # ZipCache: window votes, over two voters
@example(case=("h2o(recent=1)", "zipcache(high=8, low=2, group=2, salient=0.5, every=1)", 1, [9], 1, 3,
               [4, 7], 0.3, 5))  # ZipCache: accumulated attention, over every query that saw a token
def test_a_prefill_chunk_on_two_formats_is_held_to_its_budget(case):
    """The rest of a prompt prefilled in chunks into a two-format cache (``begin_extend(chunked=True)``,
    what ``Decoder.extend(chunk=)`` does): each chunk attends to both regions' tokens as stored (dense
    reference), its rows give every held token and itself the score the policy's ``extension_scores`` gives
    them in position order (window votes replace, accumulated attention adds), and afterwards the sequence
    holds its budget as decoding holds it: KIVI's residual aged (the newest ``residual`` to ``residual +
    group`` unquantized), then the quantized tokens over the budget evicted lowest-ranked first (the plan's
    sinks and recent window kept; the residual whole), MiKV's high-precision tokens over the budget moved
    to its low bits, nothing lost; ZipCache's high bits chosen again among the main region's tokens (each
    KV head's salient share of the budget, by the chunk's score over the queries behind it: every query at
    or after the token, or the window's), then evicted as KIVI's; every row the round trip of its original
    through its region's format, every page owned once. A budget that holds everything evicts nothing."""
    eviction, spec, page_size, lens, n_kv, gqa, chunks, budget, seed = case
    g = torch.Generator().manual_seed(seed + 7)
    total = [L + sum(chunks) for L in lens]
    run = FakeRun(2, n_kv, gqa, 8, lens, 0, seed=seed)
    policy = compose(eviction, spec, budget=budget)
    ev, p = policy.eviction, policy.precision
    cache = run.cache(policy, page_size=page_size, max_new=sum(chunks) + 1)
    cache.start(lens, 1, budget_lens=total)
    for b in range(len(lens)):
        for l in range(2):
            q, k, v = run.prompt[l][b]
            cache.prefill_layer(l, b, q, k, v, run.positions(b), scale=run.scale)
    cache.finish_prefill()
    main_fmt = cache.storage.fmt if cache.storage.quantized else None
    side_fmt = cache.side.storage.fmt

    def stored(x, fmt):
        return x if fmt is None else round_trip(x, fmt)

    def salient_first(held, window, seen):
        """Positions of ``held`` (position -> (k, v, region, score)), by normalized score (the score over the
        queries behind it: every query at or after the token, at most ``window``), ties to the earlier."""
        def saliency(x):
            voters = max(seen - x, 1) if not window else min(max(seen - x, 1), window)
            return float(torch.tensor(held[x][3]) / torch.tensor(float(voters)))
        return sorted(held, key=lambda x: (-saliency(x), x))

    if p.name == "zipcache":  # a first chunk: the high bits up to their share of the whole prompt's budget
        for i, L in enumerate(lens):
            share = p.high_share(min(int(policy.budget_tokens(torch.tensor([total[i]]))[0]), total[i]))
            window = ev.prefill_window(L) if ev.prefill_mode else 0
            for l in range(2):
                for h, held in enumerate(held_with_scores(cache, l, i)):
                    main = sorted(x for x in held if held[x][2] == "main")
                    assert main == sorted(salient_first(held, window, L)[:min(len(held), share)]), (i, l, h)

    b = len(lens) - 1
    start = lens[b]
    for n in chunks:
        before = [held_with_scores(cache, l, b) for l in range(2)]
        new = [tuple(torch.randn(n, h, 8, generator=g).to(DEVICE) for h in (n_kv * gqa, n_kv, n_kv))
               for _ in range(2)]
        positions = torch.arange(start, start + n, dtype=torch.int32, device=DEVICE)
        cache.begin_extend(b, n, budget_len=total[b], chunked=True)
        want_scores, raw_scores = [], []
        for l, (q, k, v) in enumerate(new):
            out = cache.extend_attend(l, b, q, k, v, positions, scale=run.scale)
            held = [sorted(before[l][h]) for h in range(n_kv)]  # each head's, in position order
            ks = torch.stack([torch.stack([before[l][h][x][0] for x in held[h]]) for h in range(n_kv)], 1)
            vs = torch.stack([torch.stack([before[l][h][x][1] for x in held[h]]) for h in range(n_kv)], 1)
            for h in range(n_kv):
                for i in range(n):
                    keys = torch.cat([ks[:, h], k[:i + 1, h]])[:, None]
                    values = torch.cat([vs[:, h], v[:i + 1, h]])[:, None]
                    want = dense_attention(q[i, h * gqa:(h + 1) * gqa], keys, values, run.scale)
                    torch.testing.assert_close(out[i, h * gqa:(h + 1) * gqa], want.to(out.dtype), rtol=1e-4,
                                               atol=1e-4)
            old = torch.tensor([[before[l][h][x][3] for x in held[h]] for h in range(n_kv)], device=DEVICE)
            kept_pos = torch.tensor(held, dtype=torch.int32, device=DEVICE).t()  # [m, Hkv]
            _, scores = ev.extension_scores(q, k, v, positions, ks, vs, kept_pos, old, scale=run.scale,
                                            seed=cache.prefill_seed(l, b))
            if scores is None:  # a rule without scores (streaming): the held keep theirs, the new ones 0
                scores = torch.cat([old, torch.zeros(n_kv, n, device=DEVICE)], dim=1)
            # per head: position -> its score, and the layer's shared ranking where the heads share one
            rank = ev.eviction_scores(scores, head_dim=0) if ev.heads_share_selection else scores
            want_scores.append([{x: float(rank[h, i]) for i, x in enumerate(held[h] + positions.tolist())}
                                for h in range(n_kv)])
            raw_scores.append([{x: float(scores[h, i]) for i, x in enumerate(held[h] + positions.tolist())}
                               for h in range(n_kv)])
            got = held_with_scores(cache, l, b)  # appended, not yet aged or evicted
            for h in range(n_kv):
                for i, x in enumerate(held[h] + positions.tolist()):
                    assert math.isclose(got[h][x][3], float(scores[h, i]), rel_tol=1e-4,
                                        abs_tol=1e-5), (l, h, x)
        cache.end_extend(b)
        for l, (_, k, v) in enumerate(new):
            budgets, n_sink, n_recent = (int(x[l, b]) for x in cache.plan.rows)
            after = held_with_scores(cache, l, b)
            for h in range(n_kv):
                was = {**{x: r for x, (*_, r, _) in before[l][h].items()}, **dict.fromkeys(positions.tolist(),
                                                                                            "main")}
                now = {x: r for x, (*_, r, _) in after[h].items()}
                main = sorted(x for x, r in now.items() if r == "main")
                if p.name == "zipcache":  # the high bits: the salient share of the budget, chosen again
                    window = ev.prefill_window(n) if ev.prefill_mode else 0
                    was_main = {x: (None, None, "main", raw_scores[l][h][x]) for x in was if was[x] == "main"}
                    n_high = min(len(was_main), p.high_share(min(budgets, total[b])))
                    assert main == sorted(salient_first(was_main, window, start + n)[:n_high]), (l, h)
                if p.name in ("kivi", "zipcache"):  # KIVI: the residual (the newest), aged a group or more
                    if p.name == "kivi":
                        assert main == sorted(was)[-len(main):] and len(main) <= p.residual + p.group
                    side_before = [x for x in was if was[x] == "side" or x not in main]  # + the aged ones
                    if len(was) <= budgets:
                        assert set(now) == set(was), "nothing over the budget: nothing evicted"
                    else:
                        assert len(now) == max(budgets, len(main)), (l, h, len(now), budgets)
                        gone = set(side_before) - set(now)
                        kept = sorted(x for x in side_before if x in now)
                        sink = min(n_sink, len(kept))
                        forced = set(kept[:sink])
                        waiting = len(main) if p.name == "kivi" else 0  # ZipCache's high bits are settled
                        recent = max(0, min(n_recent - waiting, len(kept) - sink))
                        forced |= set(kept[len(kept) - recent:]) if recent else set()
                        free = [x for x in kept if x not in forced]
                        if gone and free:  # the lowest-ranked went (by the chunk's scores)
                            s = want_scores[l][h]
                            assert max(s[x] for x in gone) <= min(s[x] for x in free) + 1e-6, (l, h, kept)
                else:  # MiKV: nothing leaves; the main region held at the budget
                    assert set(now) == set(was)
                    assert len(main) == min(budgets, sum(r == "main" for r in was.values()))
                # every row as stored: new ones through their region's format, aged ones re-encoded
                for x, (k1, v1, region, _) in after[h].items():
                    if x in before[l][h]:
                        k0, v0, r0 = before[l][h][x][:3]
                    else:
                        i = x - start
                        k0, v0, r0 = (stored(k[i:i + 1, h], main_fmt)[0], stored(v[i:i + 1, h], main_fmt)[0],
                                      "main")
                    if region != r0:
                        assert (r0, region) == ("main", "side"), (l, h, x)
                        k0, v0 = (round_trip(y[None], side_fmt)[0] for y in (k0, v0))
                    assert torch.equal(k1, k0) and torch.equal(v1, v0), (l, h, x, r0, region)
        check_two_regions(cache)
        start += n
    cache.restart_decode(1)  # and the sequence decodes over both regions
    check_two_regions(cache)


@pytest.mark.parametrize("family,precision,row_bytes", [
    ("llama", "kivi(bits=8, group=2, residual=0)", 18),  # head dim 6: 6 code bytes + 3 fp16 scales and zeros
    ("llama", "kivi(bits=8, group=2, residual=0, channel_scale=True)", 18),
    ("gptj", "kivi(bits=8, group=4, residual=0, rotate=True)", 16),  # head dim 8 (a power of two): 8 + 8
], ids=["token-wise", "channel-separable", "rotated"])
def test_a_session_continues_over_quantized_rows(family, precision, row_bytes):
    """``Decoder``: prompts, a generation, a follow-up extension and another generation over one-format
    quantized rows (the extension's attention reads the dequantized kept rows and appends quantized ones;
    with channel-separable keys, over each row's factors; rotated rows, read back in the model's basis). The
    prompts' logits are the unquantized cache's (the prompt attends to its own float K/V); the follow-up's
    stay within 8-bit rounding of them."""
    from kvmodels.decoder import Decoder
    from test_model_policy_matrix import PROMPTS, tiny_model

    model = tiny_model(family)
    outs = {}
    for name, spec in (("native", ()), ("quant", (precision,))):
        dec = Decoder(model, compose("snapkv(window=2)", *spec, budget=0.5), max_tokens=48)
        first = dec.extend(PROMPTS[:2])
        gen = dec.generate(3)
        second = dec.extend([[5, 6, 7], [8]])
        outs[name] = (first, gen.tokens, second, dec.cache)
    (f_n, t_n, s_n, c_n), (f_q, t_q, s_q, c_q) = outs["native"], outs["quant"]
    for a, b in zip(f_n, f_q, strict=True):
        assert torch.equal(a, b)
    assert c_q.report().quantized and not c_n.report().quantized
    assert c_q.storage.row_bytes == row_bytes and ("rotate" in precision) == ("Hadamard" in str(c_q.report()))
    native_row = c_n.storage.row_bytes  # float32 rows; + the 8 B of position and score per slot and head
    assert c_q.report().total_bytes * (2 * native_row + 8) == c_n.report().total_bytes * (2 * row_bytes + 8)
    assert t_n == t_q  # 8 bits: the same greedy tokens on this model, so the follow-ups see the same text
    for a, b in zip(s_n, s_q, strict=True):  # and their logits differ by the rounding only
        torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("precision", ["kivi(bits=8, group=2, residual=2)", "mikv(low=8, group=2)",
                                       "zipcache(high=16, low=8, group=2, every=2)"])
def test_a_session_continues_over_two_formats(precision):
    """``Decoder`` over a cache holding tokens in two formats: prompts, a generation, a follow-up extension
    and another generation, against the unquantized cache under the same eviction (snapkv at 0.5, whose
    follow-up re-selects the unquantized cache's tokens while the two-format cache keeps all it holds, so
    the follow-up's attention is checked against the dense reference by the cache test above): the same
    prompt logits (and, for KIVI, first generation), every token held before the follow-up held after it
    plus the follow-up's, and a generation after it. A chunked prefill holds the budget (MiKV: its high
    bits; ZipCache: its high bits the salient share of it) after every chunk, and generates."""
    from kvmodels.decoder import Decoder
    from test_model_policy_matrix import PROMPTS, tiny_model

    model = tiny_model("llama")
    outs = {}
    for name, spec in (("native", ()), ("quant", (precision,))):
        dec = Decoder(model, compose("snapkv(window=2)", *spec, budget=0.5), max_tokens=48)
        first = dec.extend(PROMPTS[:2])
        gen = dec.generate(3)
        held = (dec.cache.host.lens[:, :2] + (dec.cache.side.lens[:, :2] if spec else 0)).copy()
        held += [3 + (dec.pending[0] is not None), 1 + (dec.pending[1] is not None)]  # + the last token
        second = dec.extend([[5, 6, 7], [8]])
        outs[name] = (first, gen.tokens, second, dec)
    (f_n, t_n, s_n, _), (f_q, t_q, s_q, dec) = outs["native"], outs["quant"]
    for a, b in zip(f_n, f_q, strict=True):
        assert torch.equal(a, b)
    if precision.startswith("kivi"):  # (mikv also holds, at 8 bits, the tokens snapkv evicted: other tokens)
        assert t_n == t_q
    assert all(torch.isfinite(x).all() for x in s_q) and [x.shape for x in s_q] == [x.shape for x in s_n]
    cache = dec.cache
    assert (cache.host.lens[:, :2] + cache.side.lens[:, :2] == held).all()  # nothing evicted
    assert cache.side.lens[:, :2].all()  # both formats in use
    assert len(dec.generate(2).tokens) == 2
    chunked = Decoder(model, compose("snapkv(window=2)", precision, budget=0.5), max_tokens=48)
    chunked.extend([list(range(1, 13))], chunk=4)
    main, side = chunked.cache.host.lens[:, 0], chunked.cache.side.lens[:, 0]
    if precision.startswith("mikv"):  # every token kept, the budget's at the high bits
        assert ((main == 6) & (side == 6)).all()
    else:  # the budget of 6 over both formats; ZipCache's high bits its salient share (ceil(0.4 * 6))
        assert (main + side == 6).all() and (precision.startswith("kivi") or (main == 3).all())
    assert len(chunked.generate(2).tokens[0]) == 2


def test_h2o_over_zipcache_holds_its_budget_while_generating():
    """``compose("h2o", "zipcache", budget=...)`` through ``Decoder``: after every generation each layer of
    each sequence holds the budget over both formats, the high bits at most the salient share of it plus the
    tokens waiting for the next re-compression, and both formats hold tokens."""
    from kvmodels.decoder import Decoder
    from test_model_policy_matrix import tiny_model

    policy = compose("h2o", "zipcache(high=16, low=8, group=2, every=3)", budget=10)
    dec = Decoder(tiny_model("llama"), policy, max_tokens=64)
    dec.extend([list(range(1, 25)), list(range(3, 20))])
    cache = dec.cache
    for _ in range(4):
        dec.generate(5)
        main, side = cache.host.lens[:, :2], cache.side.lens[:, :2]
        assert (main + side == 10).all(), (main, side)
        assert (main <= math.ceil(0.4 * 10) + 3).all() and side.all()


@st.composite
def scored_cases(draw):
    eviction = draw(st.sampled_from(["h2o(recent=1)", "a2sf", "tova", "scissorhands"]))
    bits = draw(st.sampled_from([2, 4, 8]))
    D, group = draw(st.sampled_from([(8, 4), (8, 8), (16, 8)]))
    page_size = draw(st.sampled_from([1, 3, 4]))
    lens = draw(st.lists(st.sampled_from([1, 2, 3, 5, 9]), min_size=1, max_size=3))
    n_kv, gqa = draw(st.sampled_from([(1, 1), (2, 2), (1, 3)]))
    budget = draw(st.sampled_from([0.5, 0.8]))
    return eviction, QuantFormat(bits, group), D, page_size, lens, n_kv, gqa, budget, draw(st.integers(0, 99))


@given(case=scored_cases())
def test_scoring_eviction_over_quantized_rows_scores_what_it_attends(case):
    """Eviction that scores while decoding (h2o's accumulated attention, a2sf's decayed one, tova's latest,
    scissorhands' low-attention count) over one quantized format: at every step and layer the attention
    equals dense attention over the rows held (dequantized), and every held token's score moves by exactly
    what that attention gave it (the native update rule on those probabilities, the group's mean); rows are
    never re-encoded (each kept row stays what was written) and the cache keeps to its budget."""
    from kvkernels._modes import update_scores_ref

    eviction, fmt, D, page_size, lens, n_kv, gqa, budget, seed = case
    run = FakeRun(2, n_kv, gqa, D, lens, 4, seed=seed)
    cache = run.cache(compose(eviction, f"kivi(bits={fmt.bits}, group={fmt.group}, residual=0)",
                              budget=budget), page_size=page_size)
    run.prefill(cache)
    mode, decay, pos = cache.score_mode, cache.decay, run.step_positions
    written = {}  # (layer, sequence, head, position) -> the dequantized row held for it
    for t in range(run.n_steps):
        cache.prepare_decode(t)
        for l, (q, k, v) in enumerate(run.steps[t]):
            cache.append(l, k, v, pos(t))
            before = [cache.head_contents(l, b) for b in range(len(lens))]
            out = cache.attend(l, q, pos(t), scale=run.scale)
            for b, heads in enumerate(before):
                after = cache.head_contents(l, b)
                for h, (held, now) in enumerate(zip(heads, after, strict=True)):
                    qh = q[b, h * gqa:(h + 1) * gqa].float()  # the query heads of KV head h
                    p = torch.softmax(run.scale * qh @ held["k"].float().T, dim=-1)  # [G, n]
                    torch.testing.assert_close(out[b, h * gqa:(h + 1) * gqa].float(), p @ held["v"].float(),
                                               rtol=1e-4, atol=1e-4)
                    want = update_scores_ref(held["score"], p.mean(0), mode, decay=decay, n_valid=p.shape[1])
                    assert torch.equal(now["pos"], held["pos"])
                    torch.testing.assert_close(now["score"], want, rtol=1e-4, atol=1e-5)
                    for i, position in enumerate(held["pos"].tolist()):
                        row = torch.stack([held["k"][i], held["v"][i]])
                        assert torch.equal(written.setdefault((l, b, h, position), row), row)
        cache.after_step(t)
        check_invariants(cache)


@given(case=cases())
def test_channel_separable_keys_store_each_key_over_its_row_factor(case):
    """ZipCache's channel-separable keys (``channel_scale=True``): the same tokens are kept as without
    (scores come from the float prompt); every kept K row is the round trip of ``k / c`` times ``c``, with
    ``c = key_channel_scale`` of that row's prompt keys (per layer, sequence and KV head; a power of two),
    the V rows as without; decode attention equals dense attention over those rows."""
    from kvkernels.quant import key_channel_scale

    eviction, fmt, D, page_size, lens, n_kv, gqa, budget, seed = case
    run, rows, native, quant = side_by_side(case, steps=3, extra=", channel_scale=True")

    def check():
        for l in range(run.n_layers):
            for b in range(len(lens)):
                c = key_channel_scale(run.prompt[l][b][1])  # [Hkv, D]
                assert bool(((c.log2() % 1) == 0).all())  # powers of two
                for h, (want, got) in enumerate(zip(native.head_contents(l, b), quant.head_contents(l, b),
                                                    strict=True)):
                    assert torch.equal(got["pos"], want["pos"])
                    assert torch.equal(got["k"], round_trip(want["k"] / c[h], fmt) * c[h]), (l, b, h)
                    assert torch.equal(got["v"], round_trip(want["v"], fmt)), (l, b, h)

    decode_side_by_side(run, native, quant, gqa, check)


def test_channel_separable_keys_come_back_exactly_from_float_rows():
    """With KIVI's float residual the unquantized region holds ``k / c`` too (one softmax over both regions
    needs one scaling); ``c`` being a power of two, those keys read back bit for bit, and the quantized ones
    are the round trip of ``k / c`` times ``c``."""
    from kvkernels.quant import key_channel_scale

    fmt = QuantFormat(2, 8)
    run = FakeRun(2, 2, 2, 16, [9, 5], 4, seed=3)
    spec = f"kivi(bits={fmt.bits}, group={fmt.group}, residual=2, channel_scale=True)"
    native = run.cache(compose("snapkv(window=2)", budget=0.8))
    quant = run.cache(compose("snapkv(window=2)", spec, budget=0.8))
    for cache in (native, quant):
        run.prefill(cache)
    for t in range(run.n_steps):
        for cache in (native, quant):
            cache.prepare_decode(t)
            for l, (q, k, v) in enumerate(run.steps[t]):
                cache.append(l, k, v, run.step_positions(t))
                cache.attend(l, q, run.step_positions(t), scale=run.scale)
            cache.after_step(t)
    seen = {"main": 0, "side": 0}
    for l in range(2):
        for b in range(2):
            c = key_channel_scale(run.prompt[l][b][1])
            main, side = quant.head_contents(l, b), quant.side.contents(l, b, key_scale=quant.key_scale[l, b])
            for h, want in enumerate(native.head_contents(l, b)):
                orig = {p: want["k"][i] for i, p in enumerate(want["pos"].tolist())}
                for i, p in enumerate(main[h]["pos"].tolist()):
                    assert torch.equal(main[h]["k"][i], orig[p])  # float rows: exact
                    seen["main"] += 1
                for i, p in enumerate(side[h]["pos"].tolist()):
                    assert torch.equal(side[h]["k"][i], round_trip(orig[p][None] / c[h], fmt)[0] * c[h])
                    seen["side"] += 1
    assert seen["main"] and seen["side"], seen


@st.composite
def residual_eviction_cases(draw):
    eviction = draw(st.sampled_from(["h2o(recent=1)", "a2sf", "scissorhands", "tova(per_head=True)", "tova",
                                     "streaming", "knorm", "keyformer"]))
    bits, group = draw(st.sampled_from([(4, 2), (8, 4), (2, 2)]))
    residual = draw(st.sampled_from([1, 2, 4]))
    high, salient = 16 if bits == 8 else 8, draw(st.sampled_from([0.3, 0.5]))
    every = draw(st.sampled_from([1, 2, 3, 5]))
    spec = draw(st.sampled_from([f"kivi(bits={bits}, group={group}, residual={residual})",
                                 f"mikv(low={bits}, group={group})",
                                 f"zipcache(high={high}, low={bits}, group={group}, salient={salient}, "
                                 f"every={every})"]))
    if spec.startswith("zipcache") and (eviction == "streaming" or draw(st.booleans())):
        # zipcache ranks by prompt scores (streaming has none); snapkv scores nothing while decoding
        eviction = draw(st.sampled_from(["h2o(recent=1)", "snapkv(window=2)"]))
    page_size = draw(st.sampled_from([1, 3, 4]))
    lens = draw(st.lists(st.sampled_from([1, 2, 5, 9, 12]), min_size=1, max_size=3))
    n_kv, gqa = draw(st.sampled_from([(1, 1), (2, 2), (1, 3)]))
    budget = draw(st.sampled_from([0.3, 0.5, 0.8]))
    return eviction, spec, page_size, lens, n_kv, gqa, budget, draw(st.integers(0, 99))


def logical_slots(cache, l, b) -> list[dict[int, int]]:
    """Per KV head: position -> the slot the decode kernel gives it in the sequence's one softmax (the side
    region's slots first, in slot order, then the main region's): the slot Gumbel's noise is hashed with."""
    side_pos = cache.side.held(l, b)[2]  # [n1, Hkv], slot order
    s, S = cache.layout.storage[l], cache.page_size
    n = int(cache.seq_lens[s, b])
    pages = cache.page_table[s, b, :math.ceil(n / S)].long()
    main_pos = cache.slot_pos[pages].flatten(0, 1)[:n]  # [n, Hkv], slot order
    return [{**{int(x): i for i, x in enumerate(side_pos[:, h].tolist())},
             **{int(x): len(side_pos) + i for i, x in enumerate(main_pos[:, h].tolist())}}
            for h in range(side_pos.shape[1])]


def held_with_scores(cache, l, b):
    """Per KV head: position -> (k, v, region, score) over both regions (dequantized, as stored)."""
    out = []
    main = cache.head_contents(l, b)
    side_k, side_v, side_pos = cache.side.held(l, b)
    page, off = cache.side.slots(l, b)
    side_score = cache.side.pool.slot_score[page, off]
    for h in range(len(main)):
        held = {}
        for i, p in enumerate(main[h]["pos"].tolist()):
            held[p] = (main[h]["k"][i], main[h]["v"][i], "main", float(main[h]["score"][i]))
        for i, p in enumerate(side_pos[:, h].tolist()):
            assert p not in held, f"position {p} in both regions"
            held[p] = (side_k[i, h], side_v[i, h], "side", float(side_score[i, h]))
        out.append(held)
    return out


@given(case=residual_eviction_cases())
@example(case=("h2o(recent=1)", "mikv(low=4, group=2)", 3, [9, 5], 2, 2, 0.3, 0))  # MiKV, whatever is drawn
@example(case=("h2o(recent=1)", "zipcache(high=8, low=2, group=2, salient=0.5, every=5)", 3, [9, 5], 2, 2,
               0.3, 0))  # ZipCache under eviction (re-compressing early: the high bits reach the budget)
@example(case=("snapkv(window=2)", "zipcache(high=16, low=4, group=2, salient=0.3, every=3)", 1, [12, 5], 1,
               3, 0.5, 1))  # ZipCache re-compressing without eviction
@example(case=("a2sf", "zipcache(high=8, low=4, group=2, salient=0.3, every=1)", 1, [1], 1, 1, 0.3, 0))
@example(case=("keyformer", "kivi(bits=4, group=2, residual=2)", 3, [9, 5], 2, 2, 0.3, 0))  # Gumbel: both
@example(case=("keyformer", "mikv(low=4, group=2)", 4, [12, 2], 1, 3, 0.5, 1))  # regions' noise, its slots
@example(case=("keyformer", "zipcache(high=8, low=2, group=2, salient=0.5, every=2)", 3, [9, 5], 2, 2, 0.3,
               2))
def test_two_formats_with_eviction_while_decoding(case):
    """Two formats under a policy that evicts while decoding. Each step attends to both regions in one
    softmax (dense reference) and updates both regions' scores by the policy's rule; tokens move between
    regions with their scores; every held row stays its original's round trip through its region's format,
    bit for bit.

    - KIVI's unquantized residual (H2O + KIVI): the eviction takes quantized tokens only, the lowest-ranked
      first (sinks and the recent window kept), down to the plan's budget (the residual, at most
      residual + group tokens, stays whole).
    - MiKV (H2O + MiKV): nothing leaves the cache; the main region keeps the plan's budget, and the tokens the
      policy evicts from it (each head's lowest-ranked past the sinks and the recent window; one selection for
      a layer's heads where the policy shares it) move to the low bits.
    - Keyformer over any of them: the same, its scores Gumbel's, the noise of each token hashed with the
      slot the kernel gives it in the one softmax (the side region's slots first, then the main region's).
    - ZipCache (H2O + ZipCache; SnapKV, which scores nothing while decoding, gets accumulated attention):
      every ``every`` waiting tokens (or sooner, under eviction, when the high bits alone exceed the budget)
      the high bits keep the settled tokens and the salient share of the waiting ones, by normalized score
      (at most the salient share of the budget under eviction, then chosen among all); the others move to
      the low bits; the eviction then takes the lowest-ranked low-bit tokens, as with KIVI's residual."""
    from kvkernels._modes import update_scores_ref

    eviction, spec, page_size, lens, n_kv, gqa, budget, seed = case
    n_steps = 6
    run = FakeRun(2, n_kv, gqa, 8, lens, n_steps, seed=seed)
    policy = compose(eviction, spec, budget=budget)
    cache = run.cache(policy, page_size=page_size)
    assert cache.side is not None
    side_fmt, p = cache.side.storage.fmt, policy.precision
    ev = policy.eviction
    run.prefill(cache)
    B = len(lens)
    settled = cache.host.lens[:, :B].copy()  # zipcache: the split settles the main region's tokens
    if p.name == "zipcache":  # it ranks decoded tokens by their scores: snapkv's steps accumulate them too
        assert cache.score_mode == (ev.score_mode if ev.score_mode != "none" else "accumulate")
    for t in range(n_steps):
        cache.prepare_decode(t)
        pos_t = run.step_positions(t)
        for l, (q, k, v) in enumerate(run.steps[t]):
            cache.append(l, k, v, pos_t)
            before = [held_with_scores(cache, l, b) for b in range(B)]
            slot_of = [logical_slots(cache, l, b) for b in range(B)]
            out = cache.attend(l, q, pos_t, scale=run.scale)
            after = [held_with_scores(cache, l, b) for b in range(B)]
            for b in range(B):
                for h in range(n_kv):
                    held = before[b][h]
                    positions = sorted(held)
                    ks = torch.stack([held[x][0] for x in positions])[:, None]
                    vs = torch.stack([held[x][1] for x in positions])[:, None]
                    qh = q[b, h * gqa:(h + 1) * gqa]
                    want = dense_attention(qh, ks, vs, run.scale)
                    torch.testing.assert_close(out[b, h * gqa:(h + 1) * gqa], want.to(out.dtype), rtol=1e-4,
                                               atol=1e-4)
                    if cache.score_mode == "none":  # (knorm's scores are its own tokens'; streaming: none)
                        assert all(after[b][h][x][3] == held[x][3] for x in positions)
                        continue
                    logits = run.scale * qh.float().cpu() @ ks[:, 0].float().cpu().t()  # [G, n]
                    if cache.score_mode == "gumbel":  # Keyformer: the noise of each token's slot, tempered
                        keys = cache.gumbel_keys[l, b, h * gqa:(h + 1) * gqa].cpu()
                        slots = torch.tensor([slot_of[b][h][x] for x in positions])
                        noise = gumbel_noise_keyed(keys, int(slots.max()) + 1)[:, slots]
                        logits = (logits + noise) / float(cache.temperature)
                    probs = torch.softmax(logits, dim=-1)
                    old = torch.tensor([[held[x][3] for x in positions]])
                    new = update_scores_ref(old, probs.mean(dim=0, keepdim=True), cache.score_mode,
                                            decay=cache.decay,
                                            n_valid=torch.tensor([[len(positions)]]))[0]
                    got = torch.tensor([after[b][h][x][3] for x in positions])
                    torch.testing.assert_close(got, new, rtol=1e-4, atol=1e-5)
        scores_before = [[held_with_scores(cache, l, b) for b in range(B)] for l in range(2)]
        cache.after_step(t)
        budgets = cache.plan.rows.budgets
        for l in range(2):
            for b in range(B):
                now = held_with_scores(cache, l, b)
                main_len = int(cache.host.lens[l, b])
                if p.name == "mikv":
                    check_demoted(cache, scores_before[l][b], now, l, b, main_len)
                    continue
                if p.name == "zipcache":
                    settled[l, b] = check_recompressed(cache, scores_before[l][b], now, l, b,
                                                       int(settled[l, b]))
                    continue
                assert main_len <= p.residual + p.group
                for h in range(n_kv):
                    old, new = scores_before[l][b][h], now[h]
                    assert set(new) <= set(old)
                    for x, (_, _, region, score) in new.items():  # tokens move with their scores
                        assert score == old[x][3] or ev.heads_share_selection, (l, b, h, x)
                        assert region == old[x][2] or (old[x][2], region) == ("main", "side")
                    gone = set(old) - set(new)
                    residual = [x for x in new if new[x][2] == "main"]  # the newest tokens, never evicted:
                    assert residual == sorted(new)[len(new) - main_len:]  # only quantized (aged) ones go
                    assert not gone or max(gone) < min(residual, default=1 << 30)
                    if gone:
                        assert len(new) == max(int(budgets[l, b]), main_len)
                        if not ev.heads_share_selection:  # ranked by score past the forced slots
                            rows = cache.plan.rows
                            n_sink, n_recent = int(rows.n_sink[l, b]), int(rows.n_recent[l, b])
                            side_kept = sorted(x for x in new if new[x][2] == "side")
                            forced = set(side_kept[:n_sink]) | set(sorted(new)[len(new) - n_recent:])
                            free = [new[x][3] for x in side_kept if x not in forced]
                            assert not free or max(old[x][3] for x in gone) <= min(free)
    main_fmt = getattr(cache.storage, "fmt", None)  # zipcache(high=8): the main region quantized too
    for l in range(2):  # every held row is its original's round trip through its region's format(s)
        for b, L in enumerate(lens):
            for h, held in enumerate(held_with_scores(cache, l, b)):
                for x, (k, v, region, _) in held.items():
                    k0, v0 = (run.prompt[l][b][i][x:x + 1, h] if x < L
                              else run.steps[x - L][l][i][b:b + 1, h] for i in (1, 2))
                    ways = [(k0, v0)]
                    if main_fmt is not None:  # stored at the high bits (decoded tokens: always first)
                        ways = [(round_trip(k0, main_fmt), round_trip(v0, main_fmt))] + ways[:int(x < L)]
                    if region == "main":
                        ways = ways[:1]
                    else:  # the side format's round trip of the row it was written from
                        ways = [(round_trip(a, side_fmt), round_trip(c, side_fmt)) for a, c in ways]
                    assert any(torch.equal(k, a[0]) and torch.equal(v, c[0]) for a, c in ways), \
                        (l, b, h, x, region)
    check_two_regions(cache)


def check_recompressed(cache, before: list[dict], now: list[dict], l: int, b: int, settled: int) -> int:
    """ZipCache's decode step (one row of one layer), the main region's first ``settled`` tokens placed by
    the last compression: the high bits (main region) keep what the rule says, ranked by normalized score;
    nothing comes back from the low bits; then, under eviction, the two regions hold the budget, the low bits
    giving up their lowest-ranked tokens past the sinks and the recent window. Returns the settled count
    after the step."""
    p, ev, rows = cache.policy.precision, cache.eviction, cache.plan.rows
    budget, capped = int(rows.budgets[l, b]), ev.decode_evict
    for old, new in zip(before, now, strict=True):
        seen = max(old) + 1  # the newest token (just appended) is held
        main_old = sorted(x for x in old if old[x][2] == "main")
        main_new = sorted(x for x in new if new[x][2] == "main")
        waiting = len(main_old) - settled
        n_high = len(main_old)
        candidates = set(main_old[settled:])
        settled_after = settled
        if waiting >= p.every or (capped and len(main_old) > budget and waiting > 0):
            n_high = settled_after = settled + math.ceil(p.salient * waiting - 1e-9)
            if capped and n_high > math.ceil(p.salient * budget):
                n_high = settled_after = math.ceil(p.salient * budget)
                candidates = set(main_old)
        assert len(main_new) == n_high, (l, b, len(main_old), settled, n_high)
        assert set(main_new) <= set(main_old)
        assert set(main_old) - candidates <= set(main_new)  # the settled ones stay (unless re-chosen)
        # scores come along (a shared selection writes the heads' common ranking into the low bits' scores)
        assert all(new[x][3] == old[x][3] or (ev.heads_share_selection and new[x][2] == "side") for x in new)
        saliency = {x: old[x][3] / (seen - x) for x in candidates}
        moved = candidates - set(main_new)
        if moved and candidates & set(main_new):
            assert max(saliency[x] for x in moved) <= min(saliency[x] for x in candidates & set(main_new))
        assert not [x for x in new if (old[x][2], new[x][2]) == ("side", "main")]
        side_before = {x for x in old if old[x][2] == "side"} | moved  # what the eviction chose from
        gone = set(old) - set(new)
        assert gone <= side_before
        if not capped:
            assert not gone
            continue
        if gone:
            assert len(new) == max(budget, n_high)
        else:
            assert len(new) <= max(budget, n_high) or len(new) == len(old)
        if gone and not ev.heads_share_selection:  # ranked by score past the forced slots
            side_kept = sorted(x for x in new if new[x][2] == "side")
            n_sink = int(rows.n_sink[l, b])
            n_recent = max(int(rows.n_recent[l, b]) - (n_high - settled_after), 0)
            forced = set(side_kept[:n_sink]) | set(side_kept[max(len(side_kept) - n_recent, 0):] if n_recent
                                                    else ())
            pool = sorted(side_before)  # the eviction kept the sinks and the recent window among them
            n_sink, n_recent = min(n_sink, len(side_kept)), min(n_recent, len(side_kept) - n_sink)
            assert set(pool[:n_sink]) | set(pool[len(pool) - n_recent:] if n_recent else ()) <= set(side_kept)
            free = [new[x][3] for x in side_kept if x not in forced]
            assert not free or max(old[x][3] for x in gone) <= min(free)
    return settled_after


def check_demoted(cache, before: list[dict], now: list[dict], l: int, b: int, main_len: int) -> None:
    """MiKV's decode step: per KV head, every token held before is held still, with its score; the main
    region is down to the plan's budget; what left it went to the side region, never the other way, and
    is what the policy would have evicted (past the sinks and the recent window, no kept token ranked
    lower; the same tokens for every head where the policy shares one selection)."""
    ev, rows = cache.eviction, cache.plan.rows
    keep = int(rows.budgets[l, b])
    moved_sets = []
    for old, new in zip(before, now, strict=True):
        assert set(new) == set(old)
        assert all(new[x][3] == old[x][3] for x in new)  # scores come along
        main_old = sorted(x for x in old if old[x][2] == "main")
        assert main_len == min(keep, len(main_old))
        assert not [x for x in new if (old[x][2], new[x][2]) == ("side", "main")]
        moved = {x for x in new if (old[x][2], new[x][2]) == ("main", "side")}
        assert len(moved) == len(main_old) - main_len
        moved_sets.append(moved)
        sink = min(int(rows.n_sink[l, b]), keep)
        recent = min(int(rows.n_recent[l, b]), keep - sink)
        forced = set(main_old[:sink]) | set(main_old[len(main_old) - recent:] if recent else ())
        assert not moved & forced, (l, b, sorted(moved), sorted(forced))
        stay = [old[x][3] for x in main_old if x not in forced | moved]
        if moved and stay and not ev.heads_share_selection:
            assert max(old[x][3] for x in moved) <= min(stay), (l, b)
    if ev.heads_share_selection:
        assert all(m == moved_sets[0] for m in moved_sets)


@given(case=cases())
def test_rotated_rows_hold_each_token_within_its_rotated_round_trip(case):
    """``rotate=True``: every row is stored as the quantized row of ``x R`` (a fixed randomized Hadamard
    matrix); the same tokens are kept as without (eviction reads the float prompt and positions); each row
    read back lies within the rotated round trip's bound of the original; the decode attention (``q R``
    against the rotated rows, its output rotated back) equals dense attention of ``q`` over the rows read
    back; the report says the rows are rotated and counts the same bytes as unrotated rows."""
    eviction, fmt, D, page_size, lens, n_kv, gqa, budget, seed = case
    run, rows, native, quant = side_by_side(case, steps=3, extra=", rotate=True")

    def check():
        for l in range(run.n_layers):
            for b in range(len(lens)):
                for h, (want, got) in enumerate(zip(native.head_contents(l, b), quant.head_contents(l, b),
                                                    strict=True)):
                    assert torch.equal(got["pos"], want["pos"])
                    for name in ("k", "v"):
                        assert_rotated_round_trip(got[name], want[name], fmt, (l, b, h, name))

    decode_side_by_side(run, native, quant, gqa, check)
    assert "Hadamard-rotated" in str(quant.report())
    assert quant.page_bytes == quant.page_size * (1 if rows == "heads" else n_kv) * (2 * fmt.row_bytes(D) + 8)
