"""GPU-only checks (``nox -s gpu``; skipped without CUDA): bf16 end to end, split-K at 32k context, the
compiled decode step replayed as a CUDA graph, and the quantized pages of issue 36 (the compiled kernel
against its reference, the cache's packed rows and outputs against the CPU path, compiled steps as CUDA
graphs)."""

from __future__ import annotations

import functools

import pytest
import torch

from devices import DEVICE, assert_within
from kvkernels.paged_attention import ScoreUpdate, paged_decode_attention, paged_decode_attention_ref
from kvkernels.quant import QuantFormat, dequantize_rows, quantize_rows
from kvkernels.quant_attention import (
    quant_decode_attention,
    quant_decode_attention_ref,
    quant_decode_attention_triton,
)
from kvmodels.generate import generate
from kvmodels.llama import Llama, LlamaConfig
from kvpolicies import compose

pytestmark = pytest.mark.gpu

# Quantized rows (issue 36): the tiny Llama's head dim is 16, so groups of 16 (kivi's default is 32).
KIVI = "kivi(bits=4, group=16, residual=0)"
POLICIES = ["full", "h2o", "keyformer", "snapkv", "squeeze+tova", "streaming+minicache", f"snapkv+{KIVI}",
            f"streaming+{KIVI}"]


def tiny_llama(dtype: torch.dtype) -> Llama:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=97, dim=128, n_layers=4, n_heads=8, n_kv_heads=2, intermediate=256,
                              max_seq_len=512)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.to(DEVICE, dtype)


def forced_logits(model: Llama, prompts: list[list[int]], forced: list[list[int]], policy, step_fn=None):
    """Decode logits ``[T, B, V]`` (float32, CPU) with the tokens fed at each step forced to ``forced``
    (teacher forcing), so runs that would diverge on a near-tie still see the same inputs."""
    from kvmodels.cache import PagedKVCache

    param = next(iter(model.parameters()))
    layout, B, T = model.cache_layout(), len(prompts), len(forced[0])
    cache = PagedKVCache(n_layers=layout.n_layers, n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
                         n_q_heads=layout.n_q_heads, max_batch=B, max_tokens=max(map(len, prompts)) + T + 1,
                         dtype=param.dtype, device=param.device, policy=policy)
    step_fn = step_fn or model.decode_step
    out = []
    with torch.no_grad():
        cache.start([len(p) for p in prompts], T + 1)
        for b, p in enumerate(prompts):
            model.prefill(torch.tensor(p, device=param.device), cache, b, last_only=True)
        cache.finish_prefill()
        positions = torch.tensor([len(p) for p in prompts], device=param.device)
        for t in range(T):
            cache.prepare_decode(t)
            if param.is_cuda:
                torch.compiler.cudagraph_mark_step_begin()
            tokens = torch.tensor([f[t] for f in forced], device=param.device)
            out.append(step_fn(tokens, positions + t, cache).float().cpu())
            cache.after_step(t)
    return torch.stack(out)


@pytest.mark.parametrize("policy", POLICIES)
def test_bf16_compiled_step_within_twice_eager_error(policy):
    """Every layer of the stack in bf16 on the GPU (compiled kernels, compiled step, compressed cache): the
    compiled step's logits are within twice the error of the eager bf16 step, both against the same model
    in fp32, fed the same tokens."""
    from kvmodels.generate import compile_decode_step

    model = tiny_llama(torch.bfloat16)
    reference = tiny_llama(torch.bfloat16).float()  # the same bf16 weights, computed in fp32
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (200, 37, 129)]
    forced = [torch.randint(0, 97, (16,), generator=gen).tolist() for _ in prompts]
    composed = compose(policy, budget=0.3)
    truth = forced_logits(reference, prompts, forced, composed)
    eager = forced_logits(model, prompts, forced, composed)
    compiled = forced_logits(model, prompts, forced, composed, compile_decode_step(model))
    assert_within(compiled, truth, eager, torch.bfloat16)
    result = generate(model, prompts, 8, composed, compile=True)
    if policy != "full":
        assert result.report.total_bytes < result.report.full_cache_bytes


@pytest.mark.parametrize("num_splits", [0, 1, 16, 40])
def test_split_k_at_32k_context_bf16(num_splits):
    """One 32k-token sequence (and a short one beside it): the split-K reduction stays within twice the error
    of plain bf16 torch against a float64 reference; the fused h2o update adds one unit of mass per head."""
    gen = torch.Generator().manual_seed(5)
    S, Hkv, G, D = 16, 8, 4, 128
    lens = [32768, 100]
    pages_per_seq = [-(-n // S) for n in lens]
    P = sum(pages_per_seq)
    k_pages = torch.randn(P, S, Hkv, D, generator=gen).to(torch.bfloat16)
    v_pages = torch.randn(P, S, Hkv, D, generator=gen).to(torch.bfloat16)
    table = torch.full((2, max(pages_per_seq)), -1, dtype=torch.int32)
    perm = torch.randperm(P, generator=gen).to(torch.int32)
    table[0, :pages_per_seq[0]] = perm[:pages_per_seq[0]]
    table[1, :pages_per_seq[1]] = perm[pages_per_seq[0]:]
    q = torch.randn(2, Hkv * G, D, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, k_pages, v_pages, table, seq_lens)
    scale = D ** -0.5
    exact = (a.double() if a.is_floating_point() else a for a in args)
    truth = paged_decode_attention_ref(*exact, scale=scale)
    plain = paged_decode_attention_ref(*args, scale=scale)  # torch at bf16 inputs, fp32 math
    score = torch.zeros(P, S, Hkv, device=DEVICE)
    out = paged_decode_attention(*(a.to(DEVICE) for a in args), scale=scale,
                                 scores=ScoreUpdate(score, "accumulate"), num_splits=num_splits)
    assert_within(out, truth, plain, torch.bfloat16)
    mass = [score.cpu()[table[b, :pages_per_seq[b]].long()].flatten(0, 1)[:lens[b]].sum(0) for b in range(2)]
    for m in mass:  # [Hkv]
        torch.testing.assert_close(m, torch.ones(Hkv), atol=1e-3, rtol=0)


def test_compiled_decode_step_is_captured_as_a_cuda_graph():
    """Fails if inductor skips CUDA graph capture of the compiled decode step (reduce-overhead). The cache's
    buffers have static addresses (``PagedKVCache.static_buffers``); on CPU,
    ``test_cache_compile.py::test_*_mutates_only_static_buffers`` checks the condition inductor applies."""
    from torch._dynamo.utils import counters

    model = tiny_llama(torch.bfloat16)
    counters.clear()
    result = generate(model, [[1, 2, 3, 4, 5], [6, 7]], 8, compose("h2o", budget=4), compile=True)
    assert len(result.tokens[0]) == 8
    skips = counters["inductor"].get("cudagraph_skips", 0)
    assert skips == 0, f"inductor skipped CUDA graph capture {skips} time(s)"


@pytest.mark.parametrize("policy", ["h2o", "streaming", "keyformer", "squeeze+tova", "streaming+minicache",
                                    f"streaming+{KIVI}"])
def test_decode_step_bookkeeping_never_waits_for_the_device(policy):
    """prepare_decode and after_step (page allocation, decode-time eviction in place or by compaction) run
    every step between compiled CUDA-graph steps: a host sync there (a ``.item()``, a length read back, an
    upload from pageable memory) stalls the pipeline. ``set_sync_debug_mode("error")`` turns one into an
    error. The first steps may upload the cached index rows; steps past them must not sync."""
    from kvmodels.cache import PagedKVCache

    model = tiny_llama(torch.bfloat16)
    layout = model.cache_layout()
    prompts = [list(range(1, 90)), list(range(3, 40))]
    cache = PagedKVCache(n_layers=layout.n_layers, n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
                         n_q_heads=layout.n_q_heads, max_batch=2, max_tokens=128, dtype=torch.bfloat16,
                         device=DEVICE, policy=compose(policy, budget=0.3))
    with torch.no_grad():
        cache.start([len(p) for p in prompts], 12)
        for b, p in enumerate(prompts):
            model.prefill(torch.tensor(p, device=DEVICE), cache, b, last_only=True)
        cache.finish_prefill()
        positions = torch.tensor([len(p) for p in prompts], device=DEVICE)
        tokens = torch.tensor([5, 6], device=DEVICE)
        for t in range(10):
            mode = "error" if t >= 3 else "default"
            torch.cuda.set_sync_debug_mode(mode)
            try:
                cache.prepare_decode(t)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            model.decode_step(tokens, positions + t, cache)
            torch.cuda.set_sync_debug_mode(mode)
            try:
                cache.after_step(t)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert int(cache.seq_lens.max()) <= 128


@pytest.mark.parametrize("policy", ["full", "h2o"])  # h2o: the fused score update, eviction every step
def test_decode_loop_waits_for_the_device_only_to_read_tokens(policy):
    """``Decoder.generate`` without eos ids, compiled (CUDA graphs): past its first steps (the compile, the
    graphs' warm-up and recording, the first uploads of index rows) a step (the cache's bookkeeping, the
    graph's replay, the sampling, decode-time eviction) never waits for the device; the loop's one wait, the
    read of the previous step's tokens, comes after it. A sync inside a step
    (``set_sync_debug_mode("error")``) is an error: it would leave the device idle while the host works."""
    from kvmodels.decoder import Decoder

    model = tiny_llama(torch.bfloat16)
    dec = Decoder(model, compose(policy) if policy == "full" else compose(policy, budget=0.3), compile=True,
                  max_tokens=160)
    dec.extend([list(range(1, 90)), list(range(3, 40))], max_new_tokens=14)
    begin, end, checked = dec.begin_step, dec.end_step, []

    def begin_step():
        if dec.step >= 4:
            torch.cuda.set_sync_debug_mode("error")
            checked.append(dec.step)
        return begin()

    def end_step(stepping):
        try:
            end(stepping)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    dec.begin_step, dec.end_step = begin_step, end_step
    try:
        result = dec.generate(14)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(t) == 14 for t in result.tokens) and checked == list(range(4, 13))


@pytest.mark.parametrize("policy", ["h2o", "streaming", "keyformer", "squeeze+tova", "streaming+minicache",
                                    "streaming+kivi(bits=4, group=8, residual=0)"])  # that model: head dim 8
def test_eviction_replayed_as_cuda_graphs_decodes_as_eager(policy):
    """Decode-time eviction captured as CUDA graphs (kvmodels.replay) keeps exactly the tokens, and gives
    exactly the logits, of the same eviction launched eagerly (tests/test_replay.py checks the keys on
    CPU)."""
    from kvmodels.replay import Replays
    from test_replay import decode_with_eviction

    eager_logits, eager_contents, _ = decode_with_eviction(policy, Replays(enabled=False), device=DEVICE)
    logits, contents, replays = decode_with_eviction(policy, None, device=DEVICE)  # the cache's own: on
    assert replays.captures >= 1 and replays.replays >= 5
    for a, b in zip(logits, eager_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(contents, eager_contents):
        for name in ("k", "v", "pos", "score"):
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------
# Quantized pages (issue 36)
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("params", ["float16", "mixed"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quant_decode_attention_triton_equals_reference(bits, q_dtype, params):
    """The compiled kernel (and the op, which picks it for CUDA tensors; one split and four) against the
    reference on the dequantized pool: GQA 4, K and V in different groups, ragged lengths 0, 1, page
    boundaries and one long sequence, pages shuffled. With float16 parameters in both formats
    (``params="float16"``, the cache's default) the kernel decodes each row to float16 and multiplies in
    float16 (``quant_attention.HALF_ROWS``): the reference's pool is rounded to float16 then, and the
    probabilities are rounded to float16; with float32 parameters for V (``"mixed"``) it dequantizes in
    float32 and rounds each row to ``q_dtype`` for the tensor cores, and the reference's pool is rounded the
    same way. Then within the rounding of the probabilities and of the output to ``q_dtype`` (half an ulp
    each), plus summation order; and within twice that of the unrounded pool. An empty sequence gives
    zeros. Both paths also agree with each other (``half_rows(False)``) within that."""
    from kvkernels.quant_attention import half_rows

    gen = torch.Generator().manual_seed(bits)
    S, Hkv, G, D = 16, 2, 4, 64
    lens = [0, 1, 15, 16, 17, 33, 1000]
    per_seq = [-(-n // S) for n in lens]
    P = sum(per_seq) + 3
    table = torch.full((len(lens), max(per_seq) + 1), -1, dtype=torch.int32)
    perm = torch.randperm(P, generator=gen).to(torch.int32)
    i = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[i:i + n]
        i += n
    v_params = torch.float16 if params == "float16" else torch.float32
    k_fmt, v_fmt = QuantFormat(bits, 32), QuantFormat(bits, 16, v_params)
    kq = quantize_rows(torch.randn(P, S, Hkv, D, generator=gen) * 2, k_fmt)  # packed on the CPU
    vq = quantize_rows(torch.randn(P, S, Hkv, D, generator=gen), v_fmt)
    q = torch.randn(len(lens), Hkv * G, D, generator=gen).to(q_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    kw = dict(scale=D ** -0.5, k_format=k_fmt, v_format=v_fmt)
    exact = quant_decode_attention_ref(q.float(), kq, vq, table, seq_lens, **kw)  # float32 math and output
    seen = torch.float16 if params == "float16" else q_dtype  # what the kernel rounds each row to
    k_rows, v_rows = (dequantize_rows(x, D, f).to(seen).float() for x, f in ((kq, k_fmt), (vq, v_fmt)))
    want = paged_decode_attention_ref(q.float(), k_rows, v_rows, table, seq_lens, scale=D ** -0.5)
    args = [x.to(DEVICE) for x in (q, kq, vq, table, seq_lens)]
    tol = torch.finfo(q_dtype).eps
    four = functools.partial(quant_decode_attention_triton, num_splits=4)
    for impl in (quant_decode_attention_triton, four, quant_decode_attention):
        got = impl(*args, **kw)
        assert got.dtype == q_dtype and got.device.type == DEVICE.type
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(got.float().cpu(), exact, rtol=2 * tol, atol=2 * tol)
        assert bool((got[0] == 0).all())
    with half_rows(False):
        f32_rows = quant_decode_attention_triton(*args, **kw)
    torch.testing.assert_close(got.float().cpu(), f32_rows.float().cpu(), rtol=2 * tol, atol=2 * tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_cache_on_cuda_keeps_quantized_rows_and_matches_cpu(dtype):
    """tests/test_cache_quantized.py on CUDA: ``streaming`` with 4-bit rows (group 16) beside the same cache
    unquantized, both on CUDA, and the quantized cache on the CPU (the torch path), fed the same prompts
    and steps (evicting every step, pages of 4). On CUDA each kept row is ``quantize_rows`` of the
    unquantized cache's row bit for bit; the decode attention equals dense attention over the rows held and
    the CPU cache's attention; both devices keep the same positions."""
    from test_cache import FakeRun, check_invariants, dense_attention
    from test_cache_quantized import check_contents

    fmt = QuantFormat(4, 16)
    quant_policy = compose("streaming(sinks=1)", f"kivi(bits={fmt.bits}, group={fmt.group}, residual=0)",
                           budget=6)
    run = FakeRun(2, 2, 2, 32, [9, 3, 14], 6, seed=4, dtype=dtype)  # drawn on the CPU, held on CUDA
    cpu = torch.device("cpu")
    caches = {"native": (run.cache(compose("streaming(sinks=1)", budget=6), page_size=4), DEVICE),
              "quant": (run.cache(quant_policy, page_size=4), DEVICE),
              "cpu": (run.cache(quant_policy, page_size=4, device=cpu), cpu)}
    pool = caches["quant"][0].k_pages
    assert pool.dtype == torch.uint8 and pool.device.type == DEVICE.type
    for cache, dev in caches.values():
        cache.start(run.prompt_lens, run.n_steps)
        for b, L in enumerate(run.prompt_lens):
            for l in range(run.n_layers):
                q, k, v = (x.to(dev) for x in run.prompt[l][b])
                cache.prefill_layer(l, b, q, k, v, torch.arange(L, dtype=torch.int32, device=dev),
                                    scale=run.scale)
        cache.finish_prefill()
    native, quant, on_cpu = (c for c, _ in caches.values())
    check_contents(native, quant, fmt)
    tol = 1e-4 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    for t in range(run.n_steps):
        outs = {}
        for name, (cache, dev) in caches.items():
            cache.prepare_decode(t)
            pos = run.step_positions(t).to(dev)
            outs[name] = []
            for l, (q, k, v) in enumerate(run.steps[t]):
                cache.append(l, k.to(dev), v.to(dev), pos)
                out = cache.attend(l, q.to(dev), pos, scale=run.scale)
                outs[name].append(out.float().cpu())
                if name == "quant":  # attention over exactly the rows the cache holds (before eviction)
                    for b in range(len(run.prompt_lens)):
                        for h, held in enumerate(cache.head_contents(l, b)):
                            qh = q[b, h * 2:(h + 1) * 2]  # the query heads of KV head h (GQA 2)
                            want = dense_attention(qh, held["k"][:, None], held["v"][:, None], run.scale)
                            torch.testing.assert_close(out[b, h * 2:(h + 1) * 2].float(), want.float(),
                                                       rtol=tol, atol=tol)
            cache.after_step(t)
        for a, b in zip(outs["quant"], outs["cpu"], strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        check_invariants(quant)
        check_contents(native, quant, fmt)
        for l in range(run.n_layers):
            for b in range(len(run.prompt_lens)):
                for gpu, host in zip(quant.head_contents(l, b), on_cpu.head_contents(l, b), strict=True):
                    assert torch.equal(gpu["pos"].cpu(), host["pos"]), (t, l, b)


def test_quantized_compiled_decode_step_is_captured_as_a_cuda_graph():
    """The compiled decode step over 4-bit pages (quantize_rows writing, the quantized kernel reading, both
    custom ops) is captured as a CUDA graph, and its decode-time eviction (streaming) replays too; its
    forced logits agree with the eager step's (both bf16) as closely as the float cache's do."""
    from torch._dynamo.utils import counters

    from kvmodels.generate import compile_decode_step

    model = tiny_llama(torch.bfloat16)
    counters.clear()
    policy = compose("streaming", KIVI, budget=4)
    result = generate(model, [[1, 2, 3, 4, 5], [6, 7]], 8, policy, compile=True)
    assert len(result.tokens[0]) == 8
    assert result.report.total_bytes < result.report.full_cache_bytes
    skips = counters["inductor"].get("cudagraph_skips", 0)
    assert skips == 0, f"inductor skipped CUDA graph capture {skips} time(s)"
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (60, 9)]
    forced = [torch.randint(0, 97, (10,), generator=gen).tolist() for _ in prompts]
    policy = compose("streaming", KIVI, budget=16)
    truth = forced_logits(tiny_llama(torch.bfloat16).float(), prompts, forced, policy)  # fp32 math
    eager = forced_logits(model, prompts, forced, policy)
    compiled = forced_logits(model, prompts, forced, policy, compile_decode_step(model))
    assert_within(compiled, truth, eager, torch.bfloat16)


@pytest.mark.parametrize("heads,dtype", [((32, 8), torch.bfloat16), ((8, 8), torch.float16)])
@pytest.mark.parametrize("kernels", [("cudnn", "flash"), ("flash",)], ids=["default", "flash"])
def test_prefill_attention_returns_a_kernels_lse(heads, dtype, kernels, monkeypatch):
    """On CUDA, ``prefill_attention(need_lse=True)`` runs a kernel that returns the row log-sum-exp
    (``LSE_KERNELS``: cuDNN's attention where SDPA prefers it, else torch's flash kernel; each alone here),
    which spares the scorer its normaliser pass: the output is SDPA's within the dtype's rounding, the lse
    the float64 rows' within 1e-3, and H2O's prompt scores from it equal the scorer's own two passes' within
    2e-3 (GQA 4 at the bench's head dim, and plain heads)."""
    from kvkernels import score_update
    from kvkernels.score_update import prefill_attention, prefill_scores

    Hq, Hkv = heads
    L, D, scale = 300, 128, 128 ** -0.5
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(L, h, D, generator=gen).to(DEVICE, dtype) for h in (Hq, Hkv, Hkv))
    monkeypatch.setattr(score_update, "LSE_KERNELS", kernels)
    out, lse = prefill_attention(q, k, v, scale=scale, need_lse=True)
    assert lse is not None and lse.shape == (Hq, L) and lse.dtype == torch.float32
    want = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=scale, enable_gqa=Hq != Hkv)
    tol = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), want[0].transpose(0, 1).float(), rtol=tol, atol=tol)
    i, j = torch.arange(L, device=DEVICE)[:, None], torch.arange(L, device=DEVICE)[None, :]
    logits = torch.einsum("ihd,jhd->hij", q.double(), k.double().repeat_interleave(Hq // Hkv, dim=1)) * scale
    truth = torch.logsumexp(logits.masked_fill(j > i, float("-inf")), dim=-1).float()
    torch.testing.assert_close(lse, truth, rtol=1e-3, atol=1e-3)
    own = prefill_scores(q, k, scale=scale, mode="accumulate")
    torch.testing.assert_close(prefill_scores(q, k, scale=scale, mode="accumulate", lse=lse), own, rtol=2e-3,
                               atol=1e-3)
