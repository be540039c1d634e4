"""Decode attention over quantized pages (kvkernels.quant_attention): the Triton kernel (interpreter on CPU,
compiled under ``nox -s gpu``) and the batched torch path equal the reference -- the plain paged reference on
the dequantized pool -- on ragged batches (lengths 0, 1, page boundaries), GQA ratios, 2/4/8 bits, group
sizes and parameter dtypes; and the quantized result stays within the quantization error of the attention
over the original float K/V."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from devices import DEVICE
from kvkernels import quant_attention
from kvkernels._modes import SCORE_MODES
from kvkernels.paged_attention import ScoreUpdate, paged_decode_attention_ref
from kvkernels.quant import QuantFormat, dequantize_rows, quantize_rows
from kvkernels.quant_attention import (
    Region,
    quant_decode_attention,
    quant_decode_attention_ref,
    quant_decode_attention_torch,
    quant_decode_attention_triton,
)


def prefetching(impl, bits: int = 8):
    """``impl`` with ``quant_attention.PREFETCH_TILES`` at ``bits``: the kernel's loads a tile ahead by hand
    for packed pages of up to ``bits`` bits (8: all; 0: none)."""

    @functools.wraps(impl)
    def run(*args, **kwargs):
        with quant_attention.prefetch_tiles(bits):
            return impl(*args, **kwargs)

    return run


def float32_rows(impl):
    """``impl`` with ``quant_attention.HALF_ROWS`` off: float16 queries' rows dequantized in float32 and
    rounded to float16, where by default (float16 parameters, rows read as words) they are decoded to
    float16 directly; the same rows, so the same reference."""

    @functools.wraps(impl)
    def run(*args, **kwargs):
        with quant_attention.half_rows(False):
            return impl(*args, **kwargs)

    return run


def off_by(pool, offset: int):
    """``pool``'s rows in a pool ``offset`` bytes into a buffer (a view that starts off 4 bytes)."""
    buf = torch.zeros(pool.numel() + 4, dtype=pool.dtype, device=pool.device)
    out = buf[offset:offset + pool.numel()].view(pool.shape)
    out.copy_(pool)
    return out


def pools_off_four(impl):
    """``impl`` on the same K and V pools placed 2 bytes into a buffer (with float16 parameters: float32 ones
    must start on 4 bytes): pools that do not start on 4 bytes, whose packed rows the kernel reads a code
    byte per channel (``quant_attention._loads`` 0) where it otherwise reads int32 words."""

    @functools.wraps(impl)
    def run(q, k_pages, v_pages, *args, **kwargs):
        fp16 = all(f is not None and f.param_dtype == torch.float16
                   for f in (kwargs.get("k_format"), kwargs.get("v_format")))
        if k_pages.dtype == torch.uint8 and fp16:
            k_pages, v_pages = off_by(k_pages, 2), off_by(v_pages, 2)
            assert quant_attention._loads(k_pages, v_pages, QuantFormat(), QuantFormat(), 64) == 0
        return impl(q, k_pages, v_pages, *args, **kwargs)

    return run


# Every implementation: the torch path, the op (Triton on CUDA), the Triton launcher (the interpreter on CPU)
# with one split and with three, with its loads prefetched by hand for every width and for none
# (PREFETCH_TILES; the default prefetches every width), on pools off 4 bytes, and with float32 rows for
# float16 queries (HALF_ROWS off; by default their rows are decoded to float16).
IMPLS = pytest.mark.parametrize("impl,device", [
    (quant_decode_attention_torch, "cpu"),
    (quant_decode_attention, DEVICE),
    pytest.param(quant_decode_attention_triton, DEVICE, marks=pytest.mark.interpret),
    pytest.param(functools.partial(quant_decode_attention_triton, num_splits=3), DEVICE,
                 marks=pytest.mark.interpret),
    pytest.param(prefetching(functools.partial(quant_decode_attention_triton, num_splits=3)), DEVICE,
                 marks=pytest.mark.interpret),
    pytest.param(prefetching(functools.partial(quant_decode_attention_triton, num_splits=3), bits=0), DEVICE,
                 marks=pytest.mark.interpret),
    pytest.param(pools_off_four(quant_decode_attention_triton), DEVICE, marks=pytest.mark.interpret),
    pytest.param(float32_rows(functools.partial(quant_decode_attention_triton, num_splits=3)), DEVICE,
                 marks=pytest.mark.interpret),
], ids=["torch", "op", "triton", "triton-3-splits", "triton-prefetch", "triton-no-prefetch", "triton-bytes",
        "triton-f32-rows"])


@st.composite
def cases(draw):
    S = draw(st.sampled_from([1, 4, 16]))
    n_kv = draw(st.sampled_from([1, 2]))
    gqa = draw(st.sampled_from([1, 2, 3, 4]))
    D = draw(st.sampled_from([16, 32, 48, 64]))  # 48: the kernel's gather path (head dim not a power of 2)
    groups = [g for g in (8, 16, 32) if D % g == 0]
    bits = st.sampled_from([2, 4, 8])
    param_dtype = draw(st.sampled_from([torch.float16, torch.float32]))
    k_fmt, v_fmt = (QuantFormat(draw(bits), draw(st.sampled_from(groups)), param_dtype) for _ in "kv")
    edge = [0, 1, S - 1, S, S + 1, 2 * S + 1]
    lens = draw(st.lists(st.one_of(st.sampled_from(edge), st.integers(0, 3 * S + 2)), min_size=1, max_size=3))
    lens = [max(0, n) for n in lens]
    q_dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    seed = draw(st.integers(0, 2**16))
    return S, n_kv, gqa, D, k_fmt, v_fmt, lens, param_dtype, q_dtype, seed  # param_dtype: in the formats


def build(case, device):
    S, n_kv, gqa, D, k_fmt, v_fmt, lens, _, q_dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(n / S) for n in lens]
    M = max(per_seq + [1]) + 1
    P = sum(per_seq) + 2
    perm = torch.randperm(P, generator=g)
    table = torch.full((len(lens), M), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    k = torch.randn(P, S, n_kv, D, generator=g) * 2
    v = torch.randn(P, S, n_kv, D, generator=g)
    q = torch.randn(len(lens), n_kv * gqa, D, generator=g).to(q_dtype)
    kq, vq = quantize_rows(k, k_fmt).to(device), quantize_rows(v, v_fmt).to(device)  # packed [P, S, Hkv, W]
    return (q.to(device), kq, vq, table.to(device), torch.tensor(lens, dtype=torch.int32,
            device=device), k_fmt, v_fmt, k, v)


def run(impl, case, device):
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, device)
    return impl(q, kq, vq, table, lens, scale=q.shape[-1] ** -0.5, k_format=k_fmt, v_format=v_fmt).cpu()


def runs_triton(impl, device) -> bool:
    """Whether ``impl`` on ``device`` runs the Triton kernel (the launcher always; the op on CUDA)."""
    return impl is not quant_decode_attention_torch and (torch.device(device).type == "cuda" or
                                                          impl is not quant_decode_attention)


def reference(impl, device, q, kq, vq, table, lens, *, scale, k_format, v_format, second=None, scores=None):
    """The reference on the dequantized pool; for the Triton kernel with float16 queries, on the pool as the
    kernel multiplies it: each dequantized row rounded once to float16 (then float32 math)."""
    if q.dtype == torch.float32 or not runs_triton(impl, device):
        return quant_decode_attention_ref(q, kq, vq, table, lens, scale=scale, k_format=k_format,
                                          v_format=v_format, second=second, scores=scores)

    def seen(pool, fmt):
        rows = pool.float() if fmt is None else dequantize_rows(pool, q.shape[-1], fmt)
        return rows.to(q.dtype).float()

    if second is not None:
        second = Region(seen(second.k_pages, second.k_format), seen(second.v_pages, second.v_format),
                        second.page_table, second.seq_lens, score=second.score)
    return quant_decode_attention_ref(q, seen(kq, k_format), seen(vq, v_format), table, lens, scale=scale,
                                      k_format=None, v_format=None, second=second, scores=scores)


# Failing examples the H200 found (bench/results/nvidia-h200-2026-11-28/run1, compiled by Triton 3.6 for
# sm_90; the interpreter passes them): the loop without prefetching ([triton-no-prefetch], and [op] when a
# region took that loop: 8-bit values then) was far off the reference (0.22 and 0.62 absolute) on one or two
# slots of 2-bit keys at head dim 16 in pages of one slot, when it read contiguous code bytes. It reads int32
# words since, as the prefetched loop does, and passed them on the H200 (run 5); pools off 4 bytes gather
# each channel's byte ([triton-bytes]; that gather at power-of-two head dims is not yet run on a GPU).
_GPU_FOUND = (1, 1, 1, 16, QuantFormat(2, 8, torch.float16), QuantFormat(2, 8, torch.float16), [2],
              torch.float16, torch.float16, 0)
_GPU_FOUND_TWO = ((1, 1, 1, 16, QuantFormat(2, 8, torch.float16), QuantFormat(8, 8, torch.float16), [1],
                   torch.float16, torch.float16, 0), [1], None)


@IMPLS
@given(case=cases())
@example(case=_GPU_FOUND)
def test_equals_the_reference_on_the_dequantized_pool(impl, device, case):
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, "cpu")
    want = reference(impl, device, q, kq, vq, table, lens, scale=q.shape[-1] ** -0.5, k_format=k_fmt,
                     v_format=v_fmt).float()
    got = run(impl, case, device).float()
    tol = 2e-3 if case[8] == torch.float16 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    empty = [b for b, n in enumerate(case[6]) if n == 0]
    assert bool((got[empty] == 0).all())  # an empty sequence attends to nothing: zeros


def test_within_the_quantization_error_of_float_attention():
    """8 bits is close to the float attention; more bits, less error (2-bit token-wise keys are far off:
    why KIVI quantizes keys per channel and ZipCache divides them by a per-channel factor first)."""
    errors = {}
    for bits in (2, 4, 8):
        case = (4, 2, 2, 64, QuantFormat(bits, 32), QuantFormat(bits, 32), [37, 5], torch.float32,
                torch.float32, 3)
        q, kq, vq, table, lens, k_fmt, v_fmt, k, v = build(case, "cpu")
        exact = paged_decode_attention_ref(q, k, v, table, lens, scale=64 ** -0.5)
        got = quant_decode_attention(q, kq, vq, table, lens, scale=64 ** -0.5, k_format=k_fmt, v_format=v_fmt)
        errors[bits] = float((got - exact).abs().max())
    assert errors[8] < 0.02 and errors[8] < errors[4] < errors[2], errors


def test_bad_input_names_the_argument():
    case = (4, 2, 2, 32, QuantFormat(4, 16), QuantFormat(4, 16), [5, 3], torch.float16, torch.float32, 0)
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, "cpu")
    with pytest.raises(ValueError, match="k_pages"):  # rows of another width than the format packs
        quant_decode_attention(q, kq, vq, table, lens, scale=1.0, k_format=QuantFormat(2, 16), v_format=v_fmt)
    with pytest.raises(ValueError, match="group=12 must be a positive divisor"):
        quant_decode_attention(q, kq, vq, table, lens, scale=1.0, k_format=QuantFormat(4, 12), v_format=v_fmt)
    with pytest.raises(TypeError, match="k_pages"):
        quant_decode_attention(q, kq.float(), vq, table, lens, scale=1.0, k_format=k_fmt, v_format=v_fmt)
    with pytest.raises(TypeError, match="k_format must be a kvkernels.quant.QuantFormat"):
        quant_decode_attention(q, kq, vq, table, lens, scale=1.0, k_format=(4, 16), v_format=v_fmt)
    with pytest.raises(ValueError, match="not a multiple of the pool's 2 KV heads"):
        quant_decode_attention(q[:, :3], kq, vq, table, lens, scale=1.0, k_format=k_fmt, v_format=v_fmt)
    with pytest.raises(ValueError, match="seq_lens"):
        quant_decode_attention(q, kq, vq, table, lens[:1], scale=1.0, k_format=k_fmt, v_format=v_fmt)


@pytest.mark.interpret
def test_a_pool_off_its_parameters_size_names_the_pool():
    """The kernel reads float16/float32 parameters where they lie: a pool starting off their size is refused
    before the launch (on the GPU a misaligned read ends the CUDA context); off 4 bytes but on 2, float16
    parameters are read by the per-channel gather ([triton-bytes])."""
    case = (4, 2, 2, 32, QuantFormat(4, 16), QuantFormat(4, 16, torch.float32), [5, 3], torch.float16,
            torch.float16, 0)
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, DEVICE)
    kw = dict(scale=1.0, k_format=k_fmt, v_format=v_fmt)
    with pytest.raises(ValueError, match="k_pages starts at address .* not a multiple of the 2-byte"):
        quant_decode_attention_triton(q, off_by(kq, 1), vq, table, lens, **kw)
    with pytest.raises(ValueError, match="v_pages starts at address .* 4-byte torch.float32"):
        quant_decode_attention_triton(q, kq, off_by(vq, 2), table, lens, **kw)
    second = Region(off_by(kq, 1), vq, table, lens, k_fmt, v_fmt)
    with pytest.raises(ValueError, match="second.k_pages starts at address"):
        quant_decode_attention_triton(q, kq, vq, table, lens, second=second, **kw)
    torch.testing.assert_close(quant_decode_attention_triton(q, off_by(kq, 2), vq, table, lens, **kw),
                               quant_decode_attention_triton(q, kq, vq, table, lens, **kw))


def test_compiles_fullgraph():
    case = (4, 2, 2, 32, QuantFormat(4, 16), QuantFormat(2, 8), [9, 0, 4], torch.float16, torch.float32, 1)
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, DEVICE)

    def step(q):
        return quant_decode_attention(q, kq, vq, table, lens, scale=0.2, k_format=k_fmt, v_format=v_fmt,
                                      validate=False)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q), step(q))


@st.composite
def two_region_cases(draw):
    """The first region as ``cases``; a second region of its own lengths (0 too), float rows or packed."""
    case = draw(cases())
    S, n_kv, gqa, D, k_fmt, v_fmt, lens, _, q_dtype, seed = case
    lens2 = [draw(st.sampled_from([0, 1, S - 1, S, S + 2])) for _ in lens]
    fmt2 = draw(st.sampled_from([None, QuantFormat(4, D // 2), QuantFormat(8, D)]))
    return case, lens2, fmt2


def build_second(case, lens2, fmt2, device):
    S, n_kv, gqa, D, *_, seed = case
    g = torch.Generator().manual_seed(seed + 1)
    per_seq = [math.ceil(n / S) for n in lens2]
    M, P = max(per_seq + [1]) + 1, sum(per_seq) + 1
    table = torch.full((len(lens2), M), -1, dtype=torch.int32)
    perm, i = torch.randperm(P, generator=g), 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    k, v = torch.randn(P, S, n_kv, D, generator=g), torch.randn(P, S, n_kv, D, generator=g)
    if fmt2 is not None:
        k, v = quantize_rows(k, fmt2), quantize_rows(v, fmt2)
    return Region(k.to(device), v.to(device), table.to(device),
                  torch.tensor(lens2, dtype=torch.int32, device=device), fmt2, fmt2)


@IMPLS
@given(two=two_region_cases())
@example(two=_GPU_FOUND_TWO)
def test_two_regions_are_one_softmax(impl, device, two):
    """Slots in a second pool (float rows, or packed in another format) join the same softmax: equal to the
    reference, which lays each sequence's rows of both regions end to end."""
    case, lens2, fmt2 = two
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, "cpu")
    second = build_second(case, lens2, fmt2, "cpu")
    want = reference(impl, device, q, kq, vq, table, lens, scale=0.3, k_format=k_fmt, v_format=v_fmt,
                     second=second).float()
    move = [t.to(device) for t in (q, kq, vq, table, lens)]
    second_dev = Region(*(t.to(device) for t in second[:4]), fmt2, fmt2)
    got = impl(*move, scale=0.3, k_format=k_fmt, v_format=v_fmt, second=second_dev).cpu().float()
    tol = 2e-3 if case[8] == torch.float16 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    empty = [b for b, (n, m) in enumerate(zip(case[6], lens2, strict=True)) if n == 0 and m == 0]
    assert bool((got[empty] == 0).all())


def test_the_reference_of_two_regions_is_attention_over_all_their_rows():
    """The reference itself: two regions == one region holding the same rows (the second's float rows
    quantized at 8 bits into the first format would differ, so the second is packed in the first's format)."""
    fmt = QuantFormat(4, 16)
    case = (4, 2, 2, 32, fmt, fmt, [5, 0], torch.float32, torch.float32, 3)
    q, kq, vq, table, lens, *_ = build(case, "cpu")
    second = build_second(case, [3, 4], fmt, "cpu")
    both = quant_decode_attention_ref(q, kq, vq, table, lens, scale=0.3, k_format=fmt, v_format=fmt,
                                      second=second)
    # One pool: the first region's pages, then the second's, one table per sequence laid end to end.
    P1 = kq.shape[0]
    k_all, v_all = torch.cat([kq, second.k_pages]), torch.cat([vq, second.v_pages])
    S = 4
    rows = []
    for b in range(2):
        slots = [(int(table[b, j // S]), j % S) for j in range(int(lens[b]))]
        slots += [(P1 + int(second.page_table[b, j // S]), j % S) for j in range(int(second.seq_lens[b]))]
        rows.append(slots)
    n = max(len(r) for r in rows)
    flat_k = torch.zeros(2, n, 2, fmt.row_bytes(32), dtype=torch.uint8)
    flat_v = torch.zeros_like(flat_k)
    for b, slots in enumerate(rows):
        for j, (p, o) in enumerate(slots):
            flat_k[b, j], flat_v[b, j] = k_all[p, o], v_all[p, o]
    one_table = torch.arange(2, dtype=torch.int32)[:, None]  # one page of n slots per sequence
    one = quant_decode_attention_ref(q, flat_k, flat_v, one_table,
                                     torch.tensor([len(r) for r in rows], dtype=torch.int32), scale=0.3,
                                     k_format=fmt, v_format=fmt)
    torch.testing.assert_close(both, one)


@IMPLS
@given(case=cases(), mode=st.sampled_from([m for m in SCORE_MODES if m != "none"]),
       tau=st.sampled_from([None, 0.5]))
def test_the_score_update_is_fused_as_on_native_pages(impl, device, case, mode, tau):
    """Every score mode (H2O's accumulated attention, Keyformer's Gumbel score with and without a
    temperature, decayed, replaced, count_low) on quantized pages: the output and the scores updated in
    place equal the native reference on the dequantized pool; slots of no sequence keep their scores."""
    if mode == "count_low" and case[8] != torch.float32:
        case = (*case[:8], torch.float32, case[9])  # a threshold compare: float16 rounding may flip it
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, "cpu")
    g = torch.Generator().manual_seed(case[9] + 7)
    score = torch.rand(*kq.shape[:3], generator=g)
    key = torch.randint(-2**31, 2**31 - 1, q.shape[:2], generator=g, dtype=torch.int32)  # gumbel's noise
    temperature = None if tau is None else torch.tensor([tau])

    def bundle(score, dev):
        return ScoreUpdate(score, mode, 0.9, key.to(dev) if mode == "gumbel" else None,
                           None if temperature is None else temperature.to(dev))

    want_score = score.clone()
    want = reference(impl, device, q, kq, vq, table, lens, scale=0.4, k_format=k_fmt, v_format=v_fmt,
                     scores=bundle(want_score, "cpu")).float()
    got_score = score.clone().to(device)
    got = impl(*(t.to(device) for t in (q, kq, vq, table, lens)), scale=0.4, k_format=k_fmt, v_format=v_fmt,
               scores=bundle(got_score, device)).cpu().float()
    tol = 2e-3 if case[8] == torch.float16 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_score.cpu(), want_score, rtol=tol, atol=tol)
    if mode in ("accumulate", "gumbel", "decay"):
        assert not torch.equal(want_score, score) or not any(case[6])  # the update ran (something was seen)


@pytest.mark.interpret
@given(two=two_region_cases(), mode=st.sampled_from(["none", "accumulate", "gumbel"]),
       splits=st.sampled_from([1, 3]))
def test_prefetching_tiles_changes_no_bit(two, mode, splits):
    """The kernel with its loads a tile ahead (``PREFETCH_TILES``) computes what the kernel without does, bit
    for bit in the interpreter: outputs and updated scores (of both regions), one or two regions, one split
    or three. Compiled
    for sm_90 the 4-bit outputs differed in their last bits (bench/results/nvidia-h200-2026-11-27, run 10):
    on CUDA, within float rounding."""
    case, lens2, fmt2 = two
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, DEVICE)
    second = build_second(case, lens2, fmt2, DEVICE)
    g = torch.Generator().manual_seed(case[9] + 3)
    score = torch.rand(*kq.shape[:3], generator=g).to(DEVICE)
    key = torch.randint(-2**31, 2**31 - 1, q.shape[:2], generator=g, dtype=torch.int32).to(DEVICE)
    score2 = torch.rand(*second.k_pages.shape[:3], generator=g).to(DEVICE)
    outs = []
    for bits in (0, 8):  # off, then on for every width
        impl = prefetching(quant_decode_attention_triton, bits)
        s, s2 = score.clone(), score2.clone()
        bundle = None if mode == "none" else ScoreUpdate(s, mode, 1.0, key if mode == "gumbel" else None)
        out = impl(q, kq, vq, table, lens, scale=0.3, k_format=k_fmt, v_format=v_fmt,
                   second=second._replace(score=s2), scores=bundle, num_splits=splits)
        outs.append((out.cpu(), s.cpu(), s2.cpu()))
    if DEVICE.type == "cpu":
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert torch.equal(outs[0][2], outs[1][2])
    else:
        tol = 2e-3 if case[8] == torch.float16 else 2e-5
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=tol, atol=tol)
        torch.testing.assert_close(outs[1][1], outs[0][1], rtol=tol, atol=tol)
        torch.testing.assert_close(outs[1][2], outs[0][2], rtol=tol, atol=tol)


TWO_REGION_MODES = ["accumulate", "gumbel", "decay", "replace", "count_low"]


def scored(score: torch.Tensor, mode: str, q: torch.Tensor, seed: int) -> ScoreUpdate:
    """A score update of ``mode`` (gumbel: random noise keys per query head and a temperature of 1.3)."""
    if mode != "gumbel":
        return ScoreUpdate(score, mode, 0.9)
    g = torch.Generator().manual_seed(seed)
    key = torch.randint(-2**31, 2**31 - 1, q.shape[:2], generator=g, dtype=torch.int32)
    return ScoreUpdate(score, mode, 0.9, key.to(score.device), torch.tensor([1.3], device=score.device))


@IMPLS
@given(two=two_region_cases(), mode=st.sampled_from(TWO_REGION_MODES))
def test_the_score_update_covers_both_regions(impl, device, two, mode):
    """A cache in two formats (KIVI: older tokens packed, the newest as float rows) scores the tokens of both
    regions from the one softmax over both: the output and both score tensors, updated in place, equal the
    reference (the native reference over each sequence's rows of both regions laid end to end; Gumbel's noise
    by those slots: the second region's slot j at the sequence's len1 + j); count_low's threshold counts both
    regions' slots; slots of no sequence keep their scores."""
    case, lens2, fmt2 = two
    if mode == "count_low" and case[8] != torch.float32:
        case = (*case[:8], torch.float32, case[9])  # a threshold compare: float16 rounding may flip it
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, "cpu")
    second = build_second(case, lens2, fmt2, "cpu")
    g = torch.Generator().manual_seed(case[9] + 11)
    score, score2 = torch.rand(*kq.shape[:3], generator=g), torch.rand(*second.k_pages.shape[:3], generator=g)
    want_score, want_score2 = score.clone(), score2.clone()
    want = reference(impl, device, q, kq, vq, table, lens, scale=0.3, k_format=k_fmt, v_format=v_fmt,
                     second=second._replace(score=want_score2),
                     scores=scored(want_score, mode, q, case[9])).float()
    got_score, got_score2 = score.clone().to(device), score2.clone().to(device)
    second_dev = Region(*(t.to(device) for t in second[:4]), fmt2, fmt2, got_score2)
    got = impl(*(t.to(device) for t in (q, kq, vq, table, lens)), scale=0.3, k_format=k_fmt, v_format=v_fmt,
               second=second_dev, scores=scored(got_score, mode, q, case[9])).cpu().float()
    tol = 2e-3 if case[8] == torch.float16 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_score.cpu(), want_score, rtol=tol, atol=tol)
    torch.testing.assert_close(got_score2.cpu(), want_score2, rtol=tol, atol=tol)
    for old, new, region in ((score, got_score, (table, lens)), (score2, got_score2, second[2:4])):
        used = torch.zeros(old.shape[:2], dtype=torch.bool)  # [P, S]: the slots of some sequence
        S = old.shape[1]
        for b, n in enumerate(region[1].tolist()):
            for j in range(n):
                used[int(region[0][b, j // S]), j % S] = True
        assert torch.equal(new.cpu()[~used], old[~used])  # slots of no sequence: untouched
    if mode != "count_low":
        assert torch.equal(want_score2, score2) == (sum(lens2) == 0)  # the second region's slots scored


def test_the_reference_of_two_scored_regions_is_one_scored_region_over_all_their_rows():
    """The reference itself: the score update over two regions == the one-region score update over the same
    rows laid end to end (one page per sequence), its scores scattered back to both regions."""
    fmt = QuantFormat(4, 16)
    case = (4, 2, 2, 32, fmt, fmt, [5, 0, 2], torch.float32, torch.float32, 5)
    q, kq, vq, table, lens, *_ = build(case, "cpu")
    second = build_second(case, [3, 4, 0], fmt, "cpu")
    S, P1 = 4, kq.shape[0]
    rows = []  # per sequence: (region, page, offset) of each slot, the first region's then the second's
    for b in range(3):
        rows.append([(0, int(table[b, j // S]), j % S) for j in range(int(lens[b]))]
                    + [(1, int(second.page_table[b, j // S]), j % S) for j in range(int(second.seq_lens[b]))])
    n = max(len(r) for r in rows)
    for mode in TWO_REGION_MODES:
        g = torch.Generator().manual_seed(1)
        scores = [torch.rand(P1, S, 2, generator=g), torch.rand(second.k_pages.shape[:3], generator=g)]
        pools = [(kq, vq), (second.k_pages, second.v_pages)]
        flat_k = torch.zeros(3, n, 2, fmt.row_bytes(32), dtype=torch.uint8)
        flat_v = torch.zeros_like(flat_k)
        flat_score = torch.full((3, n, 2), 7.0)
        for b, slots in enumerate(rows):
            for j, (r, p, o) in enumerate(slots):
                flat_k[b, j], flat_v[b, j] = pools[r][0][p, o], pools[r][1][p, o]
                flat_score[b, j] = scores[r][p, o]
        both = [s.clone() for s in scores]
        out = quant_decode_attention_ref(q, kq, vq, table, lens, scale=0.3, k_format=fmt, v_format=fmt,
                                         second=second._replace(score=both[1]),
                                         scores=scored(both[0], mode, q, 2))
        one_table = torch.arange(3, dtype=torch.int32)[:, None]  # one page of n slots per sequence
        one_lens = torch.tensor([len(r) for r in rows], dtype=torch.int32)
        one = quant_decode_attention_ref(q, flat_k, flat_v, one_table, one_lens, scale=0.3, k_format=fmt,
                                         v_format=fmt, scores=scored(flat_score, mode, q, 2))
        torch.testing.assert_close(out, one)
        want = [s.clone() for s in scores]
        for b, slots in enumerate(rows):
            for j, (r, p, o) in enumerate(slots):
                want[r][p, o] = flat_score[b, j]
        torch.testing.assert_close(both[0], want[0])
        torch.testing.assert_close(both[1], want[1])
        assert not torch.equal(both[1], scores[1]) or mode == "count_low"


def test_a_score_update_over_two_regions_needs_both_scores():
    case = (4, 2, 2, 32, QuantFormat(4, 16), QuantFormat(4, 16), [5, 3], torch.float16, torch.float32, 0)
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, "cpu")
    second = build_second(case, [1, 2], None, "cpu")
    score, score2 = torch.zeros(kq.shape[:3]), torch.zeros(second.k_pages.shape[:3])

    def call(second, scores):
        return quant_decode_attention(q, kq, vq, table, lens, scale=1.0, k_format=k_fmt, v_format=v_fmt,
                                      second=second, scores=scores)

    with pytest.raises(ValueError, match="second.score"):  # the second region's scores are missing
        call(second, ScoreUpdate(score, "accumulate"))
    with pytest.raises(ValueError, match="second.score"):  # gumbel scores both regions too
        call(second, ScoreUpdate(score, "gumbel", gumbel_key=torch.zeros(2, 4, dtype=torch.int32)))
    with pytest.raises(ValueError, match="second.score"):
        call(second._replace(score=torch.zeros(score2.shape[0] + 1, 4, 2)), ScoreUpdate(score, "accumulate"))
    with pytest.raises(TypeError, match="second.score"):
        call(second._replace(score=score2.double()), ScoreUpdate(score, "accumulate"))
    with pytest.raises(ValueError, match="scores.score"):
        call(second._replace(score=score2), ScoreUpdate(torch.zeros(3, 4, 2), "accumulate"))
    assert not score.any() and not score2.any()  # nothing written before raising
    call(second, ScoreUpdate(score, "none"))  # mode "none": a read-only call, no second.score needed
    call(second._replace(score=score2), ScoreUpdate(score, "none"))
    assert not score.any() and not score2.any()
    call(second._replace(score=score2), ScoreUpdate(score, "accumulate"))
    assert score.any() and score2.any()
    with pytest.raises(ValueError, match="scores.score"):  # one region, as before
        quant_decode_attention(q, kq, vq, table, lens, scale=1.0, k_format=k_fmt, v_format=v_fmt,
                               scores=ScoreUpdate(torch.zeros(3, 4, 2), "accumulate"))


def test_compiles_fullgraph_with_scores_over_two_regions():
    """torch.compile(fullgraph=True) traces the two-region scored call
    (``kvkernels::quant_decode_attention_scored_two``): outputs and both regions' scores as eager."""
    case = (4, 2, 2, 32, QuantFormat(4, 16), QuantFormat(2, 8), [9, 0, 4], torch.float16, torch.float32, 1)
    q, kq, vq, table, lens, k_fmt, v_fmt, *_ = build(case, DEVICE)
    second = build_second(case, [2, 3, 0], None, DEVICE)
    g = torch.Generator().manual_seed(2)
    score, score2 = torch.rand(kq.shape[:3], generator=g), torch.rand(second.k_pages.shape[:3], generator=g)

    def step(q, score, score2):
        return quant_decode_attention(q, kq, vq, table, lens, scale=0.2, k_format=k_fmt, v_format=v_fmt,
                                      second=second._replace(score=score2),
                                      scores=ScoreUpdate(score, "accumulate"), validate=False)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager = (score.clone().to(DEVICE), score2.clone().to(DEVICE))
    traced = (score.clone().to(DEVICE), score2.clone().to(DEVICE))
    torch.testing.assert_close(compiled(q, *traced), step(q, *eager))
    torch.testing.assert_close(traced, eager)
    assert not torch.equal(eager[1].cpu(), score2)  # the second region's slots were scored


def test_max_registers_sets_the_launch_ceiling_inside_the_block_only():
    """``quant_attention.max_registers`` (``bench/gpu.py``'s occupancy probe): the launcher's ``maxnreg``
    inside the block, the default after it (also after an error), scaled up for programs of fewer than 4
    warps (the same registers per program), and bad values refused by name."""
    from kvkernels._triton import record_launches

    meta = torch.device("meta")
    fmt = QuantFormat(4, 32)
    q = torch.empty(2, 8, 64, dtype=torch.bfloat16, device=meta)
    pool = torch.empty(4, 16, 2, fmt.row_bytes(64), dtype=torch.uint8, device=meta)
    table, lens = (torch.empty(*s, dtype=torch.int32, device=meta) for s in ((2, 2), (2,)))

    def ceiling() -> int:
        with record_launches() as launches:
            quant_decode_attention_triton(q, pool, pool, table, lens, scale=0.125, k_format=fmt, v_format=fmt,
                                          num_splits=2)
        return launches[0].maxnreg

    default = quant_attention.MAX_REGISTERS
    assert ceiling() == default == 128
    with quant_attention.max_registers(64):
        assert ceiling() == 64
    assert ceiling() == default
    with pytest.raises(RuntimeError, match="inside"), quant_attention.max_registers(80):
        raise RuntimeError("inside")
    assert quant_attention.MAX_REGISTERS == default
    # under 4 warps a program keeps the same registers: each thread holds more of the tile
    from kvkernels.tuning import LaunchConfig, override

    with override(quant_decode=LaunchConfig(32, 2, 3)):
        assert ceiling() == 255
        with quant_attention.max_registers(64):
            assert ceiling() == 128
    with override(quant_decode=LaunchConfig(32, 8, 3)):
        assert ceiling() == default
    for bad in (16, 256, 96.0, True, "64"):
        with pytest.raises(ValueError, match="n=.* registers per thread"), quant_attention.max_registers(bad):
            pass
    assert quant_attention.MAX_REGISTERS == default
