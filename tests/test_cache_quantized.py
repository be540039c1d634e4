"""The paged cache with quantized rows (issue 36: ``compose(..., "kivi(bits=..., residual=0)")``).

Side by side with the same cache in float32 on the same random prompts and steps (``FakeRun``): the same
tokens are kept (eviction reads scores from the unquantized prefill, and positions), every kept row is the
quantized row of the original token bit for bit (``decode(encode(x))``, however often eviction moved it),
the decode attention equals dense attention over those dequantized rows, the pool holds packed ``uint8``
rows of the bytes the format claims, and the report compares against an unquantized cache. A compiled decode
step equals the eager one without a recompile.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
import torch._dynamo
from hypothesis import given

from devices import DEVICE
from kvkernels.quant import QuantFormat, dequantize_rows, quantize_rows
from kvpolicies import compose
from test_cache import FakeRun, check_invariants, dense_attention


def round_trip(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return dequantize_rows(quantize_rows(x, fmt), x.shape[-1], fmt, x.dtype)


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


@given(case=cases())
def test_quantized_cache_keeps_the_same_tokens_as_their_quantized_rows(case):
    eviction, fmt, D, page_size, lens, n_kv, gqa, budget, seed = case
    run = FakeRun(2, n_kv, gqa, D, lens, 4, seed=seed)
    spec = f"kivi(bits={fmt.bits}, group={fmt.group}, residual=0)"
    rows = "heads" if "adakv" in eviction else "sequences"
    native = run.cache(compose(eviction, budget=budget), page_size=page_size, rows=rows)
    quant = run.cache(compose(eviction, spec, budget=budget), page_size=page_size, rows=rows)
    W = fmt.row_bytes(D)
    assert quant.k_pages.dtype == torch.uint8 and quant.k_pages.shape[-1] == W
    heads_per_row = 1 if rows == "heads" else n_kv
    assert quant.page_bytes == page_size * heads_per_row * (2 * W + 8)  # packed K and V, position, score
    for cache in (native, quant):
        run.prefill(cache)
    check_contents(native, quant, fmt)
    pos = run.step_positions
    for t in range(run.n_steps):
        for cache in (native, quant):
            cache.prepare_decode(t)
            for l, (q, k, v) in enumerate(run.steps[t]):
                cache.append(l, k, v, pos(t))
                if cache is quant:  # attention over exactly the rows the cache holds (before eviction)
                    out = cache.attend(l, q, pos(t), scale=run.scale)
                    for b in range(len(lens)):
                        for h, held in enumerate(quant.head_contents(l, b)):
                            qh = q[b, h * gqa:(h + 1) * gqa]  # the query heads of KV head h
                            want = dense_attention(qh, held["k"][:, None], held["v"][:, None], run.scale)
                            torch.testing.assert_close(out[b, h * gqa:(h + 1) * gqa], want.to(out.dtype),
                                                       rtol=1e-4, atol=1e-4)
                else:
                    cache.attend(l, q, pos(t), scale=run.scale)
            cache.after_step(t)
        if rows == "sequences":  # (its report's counts are per sequence; head caches: test_head_cache)
            check_invariants(quant)
        check_contents(native, quant, fmt)
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
def test_compiled_decode_step_over_quantized_rows_matches_eager_without_recompiling():
    torch._dynamo.reset()
    run = FakeRun(2, 2, 2, 16, [9, 3, 6], 8, seed=2)
    policy = compose("streaming(sinks=1)", "kivi(bits=4, group=8, residual=0)", budget=4)
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
            # Bit for bit: the compiled write keeps quantize's outward rounding (a custom op).
            assert torch.equal(compiled.k_pages, eager.k_pages)
            assert torch.equal(compiled.v_pages, eager.v_pages)
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
            check_invariants(compiled)


def test_alibi_with_quantized_rows_is_refused_by_name():
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
