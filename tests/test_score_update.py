"""prefill_scores: the chunked reference against a dense row-by-row oracle, the Triton kernels against the
reference, score-mode properties, the Gumbel noise hash, input checks and torch.compile."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from devices import DEVICE
from kvkernels._modes import SCORE_MODES, update_scores_ref
from kvkernels._noise import gumbel_noise_hash, gumbel_noise_hash_triton, hash_u32
from kvkernels._triton import HAS_TRITON, triton
from kvkernels.score_update import (
    COLUMN_SUM_MODES,
    _prefill_scores_op,
    prefill_attention,
    prefill_attention_scores,
    prefill_scores,
    prefill_scores_ref,
    prefill_scores_torch,
    prefill_scores_triton,
)

# The two pure-torch forms: the clear reference (the oracle) and the fast CPU path the op runs.
TORCH_IMPLS = {"ref": prefill_scores_ref, "torch": prefill_scores_torch}

ON_CUDA = DEVICE.type == "cuda"
EULER_GAMMA = 0.5772156649015329
# Lengths around the 16-row blocks the interpreter uses and around typical page sizes.
LENGTHS = st.one_of(st.integers(0, 40), st.sampled_from([15, 16, 17, 31, 32, 33, 48, 63, 64, 65]))


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)  # the fixed-shape tests draw their data from the global generator


def naive_prefill_scores(q, k, *, scale, mode, window=0, decay=1.0, seed=0, temperature=1.0,
                         alibi_slopes=None):
    """The contract read literally: dense L x L probabilities, then one ``update_scores_ref`` per row."""
    L, Hq, _ = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    i = torch.arange(L, device=q.device)[:, None]
    j = torch.arange(L, device=q.device)[None, :]
    k_per_q_head = k.float().repeat_interleave(G, dim=1)  # [L, Hq, D]
    logits = torch.einsum("ihd,jhd->hij", q.float(), k_per_q_head) * scale  # [Hq, L, L]
    if alibi_slopes is not None:
        logits = logits + alibi_slopes[:, None, None] * (j - i)
    if mode == "gumbel":
        heads = torch.arange(Hq, device=q.device)[:, None, None]
        logits = (logits + gumbel_noise_hash(seed, heads, i, j)) / temperature
    probs = torch.softmax(logits.masked_fill(j > i, float("-inf")), dim=-1)  # [Hq, L, L]
    contrib = probs.view(Hkv, G, L, L).mean(dim=1)  # [Hkv, L, L]
    scores = torch.zeros(Hkv, L, device=q.device)
    for row in range(L - window if window else 0, L):
        seen = slice(0, row + 1)  # only keys that exist at this step are updated
        scores[:, seen] = update_scores_ref(scores[:, seen], contrib[:, row, seen], mode, decay=decay,
                                            n_valid=row + 1)
    return scores


@st.composite
def problems(draw, max_len=None):
    L = draw(LENGTHS if max_len is None else st.integers(0, max_len))
    Hkv = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2, 4]))
    D = draw(st.sampled_from([4, 8, 16, 24]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(L, Hkv * G, D, generator=gen)
    k = torch.randn(L, Hkv, D, generator=gen)
    kwargs = dict(
        scale=D**-0.5 * draw(st.sampled_from([1.0, 3.0])),
        mode=draw(st.sampled_from(SCORE_MODES)),
        window=draw(st.sampled_from([0, 0, 1, L // 2, L])) if L else 0,
        decay=draw(st.sampled_from([1.0, 0.9, 0.5])),
        seed=draw(st.integers(0, 2**40)),
        temperature=draw(st.sampled_from([1.0, 0.5, 2.0])),
        alibi_slopes=torch.rand(Hkv * G, generator=gen) if draw(st.booleans()) else None,
    )
    return q, k, kwargs


def assert_scores_close(actual, expected, mode, *, rtol=1e-5, atol=1e-5):
    if mode == "count_low":  # integer counts: a near-tie flip would be a real difference to look at
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    else:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def to_device(q, k, kwargs, dtype=torch.float32):
    kwargs = dict(kwargs)
    if kwargs["alibi_slopes"] is not None:
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(DEVICE)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), kwargs


# --- the reference ---------------------------------------------------------------------------------

@given(problems(), st.data())
def test_ref_matches_naive(problem, data):
    q, k, kwargs = to_device(*problem)
    L = q.shape[0]
    expected = naive_prefill_scores(q, k, **kwargs)
    assert expected.shape == (k.shape[1], L)
    chunk = data.draw(st.integers(1, L + 3))
    for impl in [prefill_scores, *TORCH_IMPLS.values()]:
        actual = impl(q, k, chunk=chunk, **kwargs)
        assert actual.dtype == torch.float32 and actual.shape == expected.shape
        assert_scores_close(actual, expected, kwargs["mode"])


@pytest.mark.parametrize("mode", SCORE_MODES)
@settings(max_examples=8)
@given(problems(max_len=300), st.integers(1, 300), st.sampled_from([torch.float32, torch.float16]))
def test_torch_path_matches_ref(mode, problem, chunk, dtype):
    """Longer prompts than the naive oracle affords: several 128-row steps of the fast path, ragged ends."""
    q, k, kwargs = to_device(*problem, dtype=dtype)
    kwargs["mode"] = mode
    expected = prefill_scores_ref(q, k, **kwargs)
    actual = prefill_scores_torch(q, k, chunk=chunk, **kwargs)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert_scores_close(actual, expected, kwargs["mode"])


@pytest.mark.parametrize("impl", TORCH_IMPLS)
@pytest.mark.parametrize("mode", SCORE_MODES)
def test_chunking_does_not_change_scores(mode, impl):
    L, D = 13, 8
    q, k = torch.randn(L, 4, D, device=DEVICE), torch.randn(L, 2, D, device=DEVICE)
    run = lambda chunk: TORCH_IMPLS[impl](q, k, scale=0.5, mode=mode, window=11, decay=0.7, seed=1,
                                          chunk=chunk)
    whole = run(256)
    for chunk in range(1, L + 4):
        assert_scores_close(run(chunk), whole, mode, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["accumulate", "gumbel"])
@pytest.mark.parametrize("window", [0, 1, 13, 29])
def test_accumulated_mass_is_one_per_processed_row(mode, window):
    L, Hkv, G, D = 29, 2, 2, 8
    q, k = torch.randn(L, Hkv * G, D, device=DEVICE), torch.randn(L, Hkv, D, device=DEVICE)
    scores = prefill_scores(q, k, scale=D**-0.5, mode=mode, window=window, chunk=5)
    torch.testing.assert_close(scores.sum(dim=1), torch.full((Hkv,), float(window or L), device=DEVICE))
    if window:  # keys no processed row can see get nothing
        assert scores[:, : L - window].ge(0).all() and scores.gt(0).any()


def test_uniform_attention_closed_forms():
    """Zero queries attend uniformly: row i gives every visible key exactly 1 / (i + 1)."""
    L, Hkv, G, D = 21, 2, 4, 8
    q, k = torch.zeros(L, Hkv * G, D, device=DEVICE), torch.randn(L, Hkv, D, device=DEVICE)
    rows = torch.arange(L, dtype=torch.float64, device=DEVICE)
    c = torch.tril((1.0 / (rows[:, None] + 1)).expand(L, L))  # [i, j]
    run = lambda mode, **kw: prefill_scores(q, k, scale=1.0, mode=mode, chunk=4, **kw)
    torch.testing.assert_close(run("accumulate"), c.sum(0).float().expand(Hkv, L))
    weights = 0.75 ** (L - 1 - rows)
    torch.testing.assert_close(run("decay", decay=0.75), (weights[:, None] * c).sum(0).float().expand(Hkv, L))
    torch.testing.assert_close(run("replace"), torch.full((Hkv, L), 1.0 / L, device=DEVICE))
    # contrib == 1 / n_valid exactly is not "low"
    assert run("count_low").eq(0).all()


def test_count_low_counts_only_existing_keys():
    """A key is counted at most once per row that can see it: 0 >= score[j] >= -(rows seeing j)."""
    L, D = 33, 8
    q, k = torch.randn(L, 2, D, device=DEVICE) * 3, torch.randn(L, 1, D, device=DEVICE) * 3
    scores = prefill_scores(q, k, scale=1.0, mode="count_low")
    seen_by = torch.arange(L, 0, -1, device=DEVICE, dtype=torch.float32)  # key j is seen by L - j rows
    # Counting keys a row cannot see (contrib 0 < 1 / n_valid) would break the lower bound.
    assert scores.le(0).all() and scores.ge(-seen_by).all()
    assert scores.lt(0).any()  # peaked attention: some keys are low


def test_gumbel_is_seeded():
    L, Hkv, G, D = 24, 2, 2, 8
    q, k = torch.randn(L, Hkv * G, D, device=DEVICE), torch.randn(L, Hkv, D, device=DEVICE)
    run = lambda seed: prefill_scores(q, k, scale=D**-0.5, mode="gumbel", seed=seed, chunk=7)
    assert torch.equal(run(5), run(5))
    assert not torch.allclose(run(5), run(6))
    assert not torch.allclose(run(5), prefill_scores(q, k, scale=D**-0.5, mode="accumulate"))


def test_gumbel_high_temperature_approaches_uniform_attention():
    L, D = 20, 8
    q, k = torch.randn(L, 4, D, device=DEVICE), torch.randn(L, 2, D, device=DEVICE)
    rows = torch.arange(L, dtype=torch.float64, device=DEVICE)
    uniform = torch.tril((1.0 / (rows[:, None] + 1)).expand(L, L)).sum(0).float().expand(2, L)
    err = lambda t: (prefill_scores(q, k, scale=1.0, mode="gumbel", temperature=t) - uniform).abs().max()
    assert err(1e6) < 1e-4
    assert err(1e6) < err(10.0) < err(1.0)


# --- the Triton kernels ----------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


def _interpreter_refuses_numpy() -> bool:
    """Triton < 3.7's interpreter with numpy >= 2.4 (see ``OLD_INTERPRETER_NEW_NUMPY``)."""
    if not HAS_TRITON or ON_CUDA:
        return False
    import numpy

    major_minor = lambda version: tuple(int(part) for part in version.split(".")[:2])
    return major_minor(triton.__version__) < (3, 7) and major_minor(numpy.__version__) >= (2, 4)


# Triton < 3.7's interpreter holds every scalar (each int argument, so every loop bound) as a 1-element
# array and gives `range` its int(), which numpy >= 2.4 refuses (triton-lang/triton#9171, fixed in 3.7):
# every launch of the scorer's loops fails there, at any length (the paged attention kernels' too). The
# interpreter's limitation, not the kernels': with numpy < 2.4 Triton 3.6 interprets them correctly and
# compiles them (L = 1 included) in .ci/oldest-triton, which pins numpy < 2.4 for this reason.
OLD_INTERPRETER_NEW_NUMPY = pytest.mark.skipif(
    _interpreter_refuses_numpy(), reason="Triton < 3.7's interpreter cannot run kernel loops with numpy "
    ">= 2.4 (triton-lang/triton#9171); run Triton 3.6 with numpy < 2.4, as .ci/oldest-triton does")


def fixed_problem(L, Hkv, G, mode, *, window=0, alibi=False, D=8):
    """One input of ``problems`` chosen by hand, for ``@example``."""
    gen = torch.Generator().manual_seed(100 * L + 10 * Hkv + G)
    q = torch.randn(L, Hkv * G, D, generator=gen)
    k = torch.randn(L, Hkv, D, generator=gen)
    kwargs = dict(scale=D**-0.5, mode=mode, window=window, decay=0.9, seed=5, temperature=0.5,
                  alibi_slopes=torch.rand(Hkv * G, generator=gen) if alibi else None)
    return q, k, kwargs


def pin_tiny_prompts(test):
    """``@example`` one- and two-token prompts in every mode (``L = 1`` with ``Hq`` 1 or 4, ``L = 2`` with
    ``Hq = 1``: the failures random draws shrank to under Triton 3.6's interpreter with numpy 2.4), so every
    profile runs them. A one-token prompt is a real input (``kvgen "Hi"``), and on a GPU ``L = 1`` and
    ``n_rows = 1`` (a window of 1) are specialised to constants: kernel variants of their own."""
    for mode in SCORE_MODES:
        for L, Hkv, G, window, alibi in ((1, 1, 1, 0, False), (1, 1, 4, 1, True), (2, 1, 1, 1, False)):
            test = example(problem=fixed_problem(L, Hkv, G, mode, window=window, alibi=alibi))(test)
    return test


@pytest.mark.interpret
@OLD_INTERPRETER_NEW_NUMPY
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=8)
@pin_tiny_prompts
@given(problem=problems(max_len=40))
def test_triton_matches_ref(dtype, problem):
    q, k, kwargs = to_device(*problem, dtype=dtype)
    expected = prefill_scores_ref(q, k, **kwargs)
    actual = prefill_scores_triton(q, k, **kwargs)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    # Both upcast to fp32 before the dot, so only summation order differs even for half inputs.
    assert_scores_close(actual, expected, kwargs["mode"], rtol=1e-4, atol=1e-5)


@pytest.mark.interpret
@OLD_INTERPRETER_NEW_NUMPY
@pytest.mark.parametrize("window", [0, 27])
@pytest.mark.parametrize("alibi", [True, False], ids=["alibi", "no-alibi"])
@pytest.mark.parametrize("mode", SCORE_MODES)
def test_triton_multi_block_gqa(mode, alibi, window):
    """Several query and key blocks, a window not aligned to a block (or none), GQA, D not a power of 2;
    with ALiBi, and without, where the column pass's terms are one multiply-add and one ``exp2`` and only
    each key block's first query tile is masked (gumbel at temperature 1.0 and 1.3)."""
    L, Hkv, G, D = 40, 2, 2, 40
    gen = torch.Generator().manual_seed(11)
    q, k = torch.randn(L, Hkv * G, D, generator=gen), torch.randn(L, Hkv, D, generator=gen)
    for temperature in (1.3, 1.0) if mode == "gumbel" else (1.3,):
        kwargs = dict(scale=D**-0.5, mode=mode, window=window, decay=0.8, seed=11, temperature=temperature,
                      alibi_slopes=torch.rand(Hkv * G, generator=gen) if alibi else None)
        expected = prefill_scores_ref(q, k, **kwargs)
        kwargs["alibi_slopes"] = kwargs["alibi_slopes"].to(DEVICE) if alibi else None
        assert_scores_close(prefill_scores_triton(q.to(DEVICE), k.to(DEVICE), **kwargs).cpu(), expected,
                            mode, rtol=1e-4)


@pytest.mark.interpret
@OLD_INTERPRETER_NEW_NUMPY
@pytest.mark.parametrize("temperature", [1.0, 1.2])
@pytest.mark.parametrize("mode", [m for m in SCORE_MODES if m != "none"])
def test_column_pass_loop_orders_agree(mode, temperature):
    """The column pass with the group's heads outside the query-block loop (the default) and inside it (the
    earlier order, kept for the GPU bench; count_low always takes it) give the same scores up to float32
    summation order, and the reference's: several key and query blocks, GQA 3, ALiBi, a window; gumbel at
    temperature 1 (the noise as a factor exp(G) = 1 / E, one log per logit) and not."""
    L, Hkv, G, D = 45, 2, 3, 24
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(L, Hkv * G, D, generator=gen).to(DEVICE)
    k = torch.randn(L, Hkv, D, generator=gen).to(DEVICE)
    kwargs = dict(scale=D**-0.5, mode=mode, window=30, decay=0.85, seed=4, temperature=temperature,
                  alibi_slopes=torch.rand(Hkv * G, generator=gen).to(DEVICE))
    outer = prefill_scores_triton(q, k, **kwargs)
    inner = prefill_scores_triton(q, k, heads_outer=False, **kwargs)
    assert_scores_close(outer, inner, mode, rtol=1e-5)
    assert_scores_close(outer, prefill_scores_ref(q, k, **kwargs), mode, rtol=1e-4)


# --- a known row log-sum-exp (the model's attention returns it) ----------------------------------------



def true_lse(q, k, scale, alibi_slopes=None):
    """``[Hq, L]`` float32 log-sum-exp of each row's visible logits, from float64 dense logits."""
    L, Hq, _ = q.shape
    i = torch.arange(L, device=q.device)[:, None]
    j = torch.arange(L, device=q.device)[None, :]
    k_per_q_head = k.double().repeat_interleave(Hq // k.shape[1], dim=1)
    logits = torch.einsum("ihd,jhd->hij", q.double(), k_per_q_head) * scale  # [Hq, L, L]
    if alibi_slopes is not None:
        logits = logits + alibi_slopes.double()[:, None, None] * (j - i)
    return torch.logsumexp(logits.masked_fill(j > i, float("-inf")), dim=-1).float()


@given(problems(max_len=300), st.integers(1, 300), st.sampled_from([torch.float32, torch.float16]))
@settings(max_examples=30)
def test_scores_from_a_given_lse_match_ref(problem, chunk, dtype):
    """With the row normaliser given, the single-pass tiled path (and the Triton launcher without its
    row-stats pass) equal the reference; modes that must not use it ignore it."""
    q, k, kwargs = to_device(*problem, dtype=dtype)
    lse = true_lse(q, k, kwargs["scale"], kwargs["alibi_slopes"])
    expected = prefill_scores_ref(q, k, **kwargs)
    impls = [prefill_scores_torch] if not ON_CUDA else [prefill_scores_triton]
    for impl in [prefill_scores, *impls]:
        actual = impl(q, k, chunk=chunk, lse=lse, **kwargs)
        assert actual.dtype == torch.float32 and actual.shape == expected.shape
        assert_scores_close(actual, expected, kwargs["mode"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", COLUMN_SUM_MODES)
def test_a_given_lse_is_used(mode):
    """The normaliser really comes from ``lse`` in the modes that take it: shifting it by log 2 halves
    every probability, hence every score (the test fails if ``lse`` were ignored)."""
    L, D = 70, 8
    q, k = torch.randn(L, 4, D, device=DEVICE), torch.randn(L, 2, D, device=DEVICE)
    lse = true_lse(q, k, 0.5)
    run = lambda lse: prefill_scores(q, k, scale=0.5, mode=mode, window=33, decay=0.9, lse=lse)
    torch.testing.assert_close(run(lse + math.log(2.0)), run(None) / 2, rtol=1e-4, atol=1e-6)


@pytest.mark.interpret
@OLD_INTERPRETER_NEW_NUMPY
@pytest.mark.parametrize("mode", COLUMN_SUM_MODES)
def test_triton_with_lse_matches_ref(mode):
    L, Hkv, G, D = 40, 2, 2, 40
    q, k = torch.randn(L, Hkv * G, D, device=DEVICE), torch.randn(L, Hkv, D, device=DEVICE)
    slopes = torch.rand(Hkv * G, device=DEVICE)
    kwargs = dict(scale=D**-0.5, mode=mode, window=27, decay=0.8, alibi_slopes=slopes)
    actual = prefill_scores_triton(q, k, lse=true_lse(q, k, D**-0.5, slopes), **kwargs)
    assert_scores_close(actual, prefill_scores_ref(q, k, **kwargs), mode, rtol=1e-4)


def test_prefill_attention_of_an_empty_prompt_is_empty():
    """L = 0 returns empty tensors (torch's CPU flash kernel would divide by zero and kill the process)."""
    q = torch.zeros(0, 4, 8, device=DEVICE)
    k = v = torch.zeros(0, 2, 8, device=DEVICE)
    out, lse = prefill_attention(q, k, v, scale=0.3)
    assert out.shape == (0, 4, 8)
    assert lse is None if ON_CUDA else lse.shape == (4, 0)


@given(st.integers(1, 70), st.sampled_from([(4, 2), (3, 3), (9, 3)]),
       st.sampled_from([torch.float32, torch.bfloat16]))
@settings(max_examples=10)
def test_prefill_attention_is_sdpa_with_its_lse(L, heads, dtype):
    """Output equals F.scaled_dot_product_attention's; on CPU the returned lse is the rows' log-sum-exp."""
    Hq, Hkv = heads
    D = 16
    q, k, v = (torch.randn(L, h, D, device=DEVICE, dtype=dtype) for h in (Hq, Hkv, Hkv))
    out, lse = prefill_attention(q, k, v, scale=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=0.3, enable_gqa=Hq != Hkv)
    torch.testing.assert_close(out, want[0].transpose(0, 1), rtol=0, atol=0)
    if DEVICE.type == "cpu":
        torch.testing.assert_close(lse, true_lse(q, k, 0.3), rtol=1e-4, atol=1e-4)
    else:
        assert lse is None
    # need_lse: on CUDA a kernel that returns the lse where one takes the inputs (float16 / bfloat16:
    # cuDNN's attention or the flash kernel, LSE_KERNELS); on CPU the same call as without.
    out2, lse2 = prefill_attention(q, k, v, scale=0.3, need_lse=True)
    if DEVICE.type == "cpu":
        assert torch.equal(out2, out) and torch.equal(lse2, lse)
    elif dtype == torch.float32:
        assert torch.equal(out2, out) and lse2 is None  # those kernels take half precision only
    else:
        tol = 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(out2.float(), want[0].transpose(0, 1).float(), rtol=tol, atol=tol)
        torch.testing.assert_close(lse2, true_lse(q, k, 0.3), rtol=1e-3, atol=1e-3)


def _cpu_attention(qt, kt, vt, scale):
    """``(out [1, Hq, L, D], lse [1, Hq, L])``: a stand-in for a CUDA kernel, on CPU tensors."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, True, scale=scale)
    return out, lse.float()


@pytest.fixture
def lse_kernels(monkeypatch):
    """``_attention_with_lse`` with nothing refused or checked yet, cuDNN's kernel offered (as on an H200),
    and a stand-in for the flash kernel that logs ``"flash"`` in the returned list at each call."""
    from kvkernels import score_update

    calls: list = []

    def flash(q, k, v, dropout, causal, debug, *, scale):
        calls.append("flash")
        return (*_cpu_attention(q, k, v, scale), None, None, q.shape[2], k.shape[2], None, None, None)

    monkeypatch.setattr(score_update, "_LSE_REFUSED", set())
    monkeypatch.setattr(score_update, "_LSE_CHECKED", set())
    monkeypatch.setattr(score_update, "_cudnn_prefers", lambda device: True)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", flash)
    return calls


def test_lse_kernel_refusals_are_remembered_but_out_of_memory_is_not(monkeypatch, lse_kernels):
    """``_attention_with_lse`` (the kernels of ``need_lse`` on CUDA, ``LSE_KERNELS``): inputs a kernel refuses
    go to the next one and are not offered to it again; running out of memory is raised, never remembered
    as a refusal; float32 inputs ask no kernel. The ops are replaced by stand-ins, so this runs anywhere."""
    from kvkernels import score_update

    qt = torch.randn(1, 4, 5, 16).to(torch.bfloat16)
    kt = torch.randn(1, 2, 5, 16).to(torch.bfloat16)
    calls = lse_kernels

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no such kernel here")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        score_update._attention_with_lse(qt, kt, kt, 0.3)
    assert not score_update._LSE_REFUSED
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", refuse)
    for _ in range(2):
        out, lse, name = score_update._attention_with_lse(qt, kt, kt, 0.3)
        assert name == "flash"
        torch.testing.assert_close(lse, _cpu_attention(qt, kt, kt, 0.3)[1])
    assert calls == [1, "flash", "flash"]  # cuDNN refused once, remembered
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", refuse)
    monkeypatch.setattr(score_update, "_LSE_REFUSED", set())
    monkeypatch.setattr(score_update, "_LSE_CHECKED", set())
    assert score_update._attention_with_lse(qt, kt, kt, 0.3) is None  # every kernel refused
    fp32 = (x.float() for x in (qt, kt, kt))
    assert score_update._attention_with_lse(*fp32, 0.3) is None  # float32: no kernel asked
    assert calls == [1, "flash", "flash", 1, 1]


def test_an_lse_that_fails_its_first_use_check_is_never_used(monkeypatch, lse_kernels):
    """cuDNN's kernel answers ``[B, H, L, 1]``: read as ``[B, H, L]`` and checked once against rows computed
    by hand. A kernel whose lse is off (here: in base 2) is refused for good and the next one answers."""
    from kvkernels import score_update

    qt = torch.randn(1, 8, 37, 16).to(torch.bfloat16)
    kt = torch.randn(1, 2, 37, 16).to(torch.bfloat16)
    calls = lse_kernels

    def cudnn(q, k, v, bias, lse, dropout, causal, debug, *, scale, log2=False):
        calls.append("cudnn")
        out, lse = _cpu_attention(q, k, v, scale)
        lse = lse / math.log(2) if log2 else lse
        return (out, lse[..., None], None, None, 37, 37, None, None, None)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", cudnn)
    out, lse, name = score_update._attention_with_lse(qt, kt, kt, 0.3)
    assert name == "cudnn" and lse.shape == (1, 8, 37)
    torch.testing.assert_close(lse, _cpu_attention(qt, kt, kt, 0.3)[1])
    monkeypatch.setattr(score_update, "_LSE_CHECKED", set())
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention",
                        functools.partial(cudnn, log2=True))
    for _ in range(2):
        assert score_update._attention_with_lse(qt, kt, kt, 0.3)[2] == "flash"
    assert calls == ["cudnn", "cudnn", "flash", "flash"]  # the failed check: cuDNN never asked again


@given(problems(), st.sampled_from(COLUMN_SUM_MODES), st.integers(1, 40),
       st.sampled_from([torch.float32, torch.bfloat16]))
@settings(max_examples=40)
def test_prefill_attention_scores_is_attention_and_scores(problem, mode, chunk, dtype):
    """One computation of the probabilities gives both: the output equals a dense causal softmax attention
    (and prefill_attention's) and the scores equal the row-by-row oracle's, across chunk boundaries."""
    q, k, kwargs = problem
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    gen = torch.Generator().manual_seed(L)
    v = torch.randn(L, Hkv, D, generator=gen)
    q, k, v = (x.to(DEVICE, dtype) for x in (q, k, v))
    args = dict(scale=kwargs["scale"], mode=mode, window=kwargs["window"], decay=kwargs["decay"])
    out, scores = prefill_attention_scores(q, k, v, chunk=chunk, **args)
    assert out.shape == (L, Hq, D) and out.dtype == dtype
    assert_scores_close(scores, naive_prefill_scores(q, k, **args), mode, rtol=1e-4, atol=1e-5)
    if L == 0:
        return
    # Dense causal attention in float64 from the same (rounded) inputs.
    i = torch.arange(L, device=DEVICE)[:, None]
    logits = torch.einsum("ihd,jhd->hij", q.double(), k.double().repeat_interleave(Hq // Hkv, dim=1))
    probs = torch.softmax((logits * args["scale"]).masked_fill(i.T > i, float("-inf")), dim=-1)
    want = torch.einsum("hij,jhd->ihd", probs, v.double().repeat_interleave(Hq // Hkv, dim=1))
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(out, prefill_attention(q, k, v, scale=args["scale"])[0], rtol=2 * tol,
                               atol=2 * tol)


def test_prefill_attention_scores_refuses_other_modes_and_bad_v():
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    for mode in ("gumbel", "count_low", "none"):
        with pytest.raises(ValueError, match="prefill_scores"):
            prefill_attention_scores(q, k, v, scale=0.3, mode=mode)
    with pytest.raises(ValueError, match="v"):
        prefill_attention_scores(q, k, v[:4], scale=0.3, mode="accumulate")
    with pytest.raises(ValueError, match="window"):
        prefill_attention_scores(q, k, v, scale=0.3, mode="accumulate", window=6)


# --- the noise hash --------------------------------------------------------------------------------

def _absorb_python(h, v):
    """The documented ``absorb`` with Python big ints (no 16-bit split), as an independent oracle."""
    h = ((h ^ v) + 0x9E3779B9) % 2**32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2**32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2**32
    return h ^ (h >> 16)


def _seed_key_python(seed):
    s = seed % 2**64
    return _absorb_python(_absorb_python(0x243F6A88, s % 2**32), s >> 32)


def _hash_python(seed, head, q_idx, k_idx):
    h = _seed_key_python(seed)
    for v in (head, q_idx, k_idx):
        h = _absorb_python(h, v)
    return h


@given(st.integers(0, 2**64 - 1), st.integers(0, 63), st.integers(0, 2**31 - 1), st.integers(0, 2**31 - 1))
def test_hash_matches_python_oracle(seed, head, q_idx, k_idx):
    bits = hash_u32(seed, head, torch.tensor([q_idx]), torch.tensor([k_idx]))
    assert int(bits[0]) == _hash_python(seed, head, q_idx, k_idx)


def test_hash_of_many_counters_matches_python_oracle():
    """Thousands of counters in one call (the vectorised int32 kernels, whose multiply must wrap), with
    values near 2**31 and heads from a broadcast tensor."""
    gen = torch.Generator().manual_seed(1)
    q_idx = torch.cat([torch.randint(0, 2**31 - 1, (1500,), generator=gen), torch.arange(2**31 - 500, 2**31)])
    k_idx = torch.cat([torch.arange(1000), torch.randint(0, 2**31 - 1, (1000,), generator=gen)])
    heads = torch.tensor([0, 7, 63]).view(3, 1)
    for seed in (0, 2**40 + 3, 2**64 - 1):
        bits = hash_u32(seed, heads, q_idx, k_idx)  # [3, 2000]
        for h, head in enumerate((0, 7, 63)):
            want = [_hash_python(seed, head, int(a), int(b)) for a, b in zip(q_idx, k_idx, strict=True)]
            assert bits[h].tolist() == want


def test_noise_is_deterministic_and_gumbel_distributed():
    heads = torch.arange(4).view(4, 1, 1)
    q_idx, k_idx = torch.arange(256).view(256, 1), torch.arange(256)
    g = gumbel_noise_hash(7, heads, q_idx, k_idx)  # [4, 256, 256]: 262k draws
    assert g.shape == (4, 256, 256) and g.dtype == torch.float32
    assert torch.equal(g, gumbel_noise_hash(7, heads, q_idx, k_idx))
    assert torch.isfinite(g).all()
    # Gumbel(0, 1): mean = Euler-Mascheroni, variance = pi^2 / 6; standard errors ~2.5e-3 and ~9e-3.
    assert abs(g.mean().item() - EULER_GAMMA) < 0.01
    assert abs(g.var().item() - math.pi**2 / 6) < 0.03
    # P(G <= 0) = exp(-1)
    assert abs(g.le(0).float().mean().item() - math.exp(-1)) < 0.005
    # neighbouring counters are not correlated
    assert abs(torch.corrcoef(torch.stack([g[:, :, :-1].flatten(), g[:, :, 1:].flatten()]))[0, 1]) < 0.01
    assert not torch.equal(g, gumbel_noise_hash(8, heads, q_idx, k_idx))
    assert not torch.equal(g[0], g[1])


def _keyed_gumbel_python(key: int, slot: int) -> float:
    """``gumbel_noise_keyed``'s value from exact Python ints (``key`` unsigned), in float64."""
    u = ((_absorb_python(key, slot) >> 9) + 0.5) / 2**23
    return -math.log(-math.log(u))


def test_keyed_noise_and_decode_keys_match_python_oracle():
    """The decode kernels' noise (``gumbel_noise_keyed``) and the cache's per-step keys (``decode_keys``)
    against exact Python ints: keys near both ends of int32, slots across the grid."""
    from kvkernels import decode_keys, gumbel_noise_keyed

    keys = torch.tensor([[0, 1, -1], [2**31 - 1, -2**31, 123456789]], dtype=torch.int32)
    g = gumbel_noise_keyed(keys, 300)  # [2, 3, 300]
    assert g.shape == (2, 3, 300) and g.dtype == torch.float32
    for b, h in [(b, h) for b in range(2) for h in range(3)]:
        key = int(keys[b, h])
        want = [_keyed_gumbel_python(key & 0xFFFFFFFF, j) for j in range(300)]
        torch.testing.assert_close(g[b, h].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6,
                                   atol=1e-6)
    for seed, step in ((0, 0), (2**62 - 1, 7), (12345, 2**32 + 5)):
        base = _absorb_python(_seed_key_python(seed), step % 2**32)
        want = [[[_absorb_python(_absorb_python(_absorb_python(base, l), b), h) for h in range(2)]
                 for b in range(3)] for l in range(4)]
        assert (decode_keys(seed, step, 4, 3, 2).long() & 0xFFFFFFFF).tolist() == want
    with pytest.raises(ValueError, match="step=-1"):
        decode_keys(0, -1, 1, 1, 1)


def test_keyed_noise_is_gumbel_distributed_and_fresh_per_key():
    """One step's noise over every (layer, row, head) key and slot, and the next step's: Gumbel(0, 1)
    moments, no correlation between neighbouring slots, neighbouring heads or one step and the next."""
    from kvkernels import decode_keys, gumbel_noise_keyed

    g = gumbel_noise_keyed(decode_keys(3, 0, 8, 16, 8), 512)  # [8, 16, 8, 512]: 524k draws
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - EULER_GAMMA) < 0.01
    assert abs(g.var().item() - math.pi**2 / 6) < 0.03
    assert abs(g.le(0).float().mean().item() - math.exp(-1)) < 0.005
    corr = lambda a, b: torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].abs().item()
    assert corr(g[..., :-1], g[..., 1:]) < 0.01 and corr(g[:, :, :-1], g[:, :, 1:]) < 0.01
    assert corr(g, gumbel_noise_keyed(decode_keys(3, 1, 8, 16, 8), 512)) < 0.01


if HAS_TRITON:
    import triton.language as tl

    from kvkernels._noise import log_positive_tl

    @triton.jit
    def _log_positive_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(y_ptr + offs, log_positive_tl(tl.load(x_ptr + offs, mask=ok, other=1.0)), mask=ok)


def _ulps_off_log(x: torch.Tensor) -> torch.Tensor:
    """How far the kernels' ``log_positive_tl`` of float32 ``x`` is from the exact ``log(x)``, in ulps of
    the float32 result."""
    from kvkernels._triton import launch

    x = x.to(DEVICE).contiguous()
    y = torch.empty_like(x)
    block = 1 << 18
    launch(_log_positive_kernel, (triton.cdiv(x.numel(), block),), x, y, x.numel(), BLOCK=block)
    exact = x.double().cpu().log()
    ulp = (exact.abs().float().nextafter(torch.tensor(math.inf)) - exact.abs().float()).double()
    return (y.double().cpu() - exact).abs() / ulp


@pytest.mark.interpret
def test_the_kernels_log_is_within_its_bound_on_every_argument_of_the_noise():
    """``log_positive_tl`` (the noise's ``log``, in place of libdevice's) on every one of the 2**23 values
    ``u`` takes, and on ``-log(u)`` of each (the outer ``log`` of ``G``): within the 1.35 ulp its docstring
    states (without fused multiply-adds, as the interpreter runs it; a GPU fuses them)."""
    u = (torch.arange(1 << 23, dtype=torch.float64) + 0.5).mul(2.0**-23).float()  # exact in float32
    assert _ulps_off_log(u).max().item() <= 1.35
    assert _ulps_off_log(-u.double().log().float()).max().item() <= 1.35
    # Other positive normal arguments: its range reduction holds over every binade.
    x = torch.logspace(-37.5, 38.3, 200_001, dtype=torch.float64).float()
    assert _ulps_off_log(x).max().item() <= 1.35


@pytest.mark.interpret
def test_triton_hash_reproduces_torch_bits():
    gen = torch.Generator().manual_seed(0)
    q_idx = torch.randint(0, 2**31 - 1, (3000,), generator=gen).to(DEVICE)
    k_idx = torch.cat([torch.arange(1000), torch.randint(0, 2**31 - 1, (2000,), generator=gen)]).to(DEVICE)
    for seed, head in [(0, 0), (1, 1), (2**40 + 3, 17), (2**64 - 1, 5)]:
        bits, noise = gumbel_noise_hash_triton(seed, head, q_idx, k_idx)
        assert torch.equal(bits, hash_u32(seed, head, q_idx, k_idx))
        torch.testing.assert_close(noise, gumbel_noise_hash(seed, head, q_idx, k_idx), rtol=1e-6, atol=1e-6)


# --- input checks, the op --------------------------------------------------------------------------

def _good():
    return dict(q=torch.randn(6, 4, 8), k=torch.randn(6, 2, 8), scale=0.3, mode="accumulate")


@pytest.mark.parametrize("change, error, names", [
    (dict(q=torch.randn(6, 4)), ValueError, "q"),
    (dict(q=torch.randn(6, 4, 8).int()), TypeError, "q"),
    (dict(k=torch.randn(6, 2, 8).double()), TypeError, "k"),
    (dict(k=torch.randn(5, 2, 8)), ValueError, "k"),
    (dict(k=torch.randn(6, 2, 7)), ValueError, "k"),
    (dict(k=torch.randn(6, 3, 8)), ValueError, "Hkv"),
    (dict(mode="h2o"), ValueError, "mode"),
    (dict(window=7), ValueError, "window"),
    (dict(window=-1), ValueError, "window"),
    (dict(window=2.0), TypeError, "window"),
    (dict(chunk=0), ValueError, "chunk"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(decay=0.0), ValueError, "decay"),
    (dict(decay=1.5), ValueError, "decay"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale="0.3"), TypeError, "scale"),
    (dict(alibi_slopes=torch.rand(2)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.rand(4).double()), TypeError, "alibi_slopes"),
    (dict(lse=torch.randn(2, 6)), ValueError, "lse"),
    (dict(lse=torch.randn(4, 6).double()), TypeError, "lse"),
])
def test_bad_input_names_the_argument(change, error, names):
    args = _good() | change
    with pytest.raises(error, match=names):
        prefill_scores(args.pop("q"), args.pop("k"), **args)


def test_op_schema_and_fake():
    q, k = torch.randn(9, 4, 8), torch.randn(9, 2, 8)
    op = _prefill_scores_op
    torch.library.opcheck(op, (q, k, 0.3, "count_low", 4, 0.9, 3, 1.0, torch.rand(4), 4, None))
    torch.library.opcheck(op, (q, k, 0.3, "gumbel", 0, 1.0, 3, 2.0, None, 256, None))
    torch.library.opcheck(op, (q, k, 0.3, "decay", 2, 0.9, 3, 1.0, None, 4, true_lse(q, k, 0.3)))


@pytest.mark.slow
def test_compiles_fullgraph():
    def score(q, k):
        return prefill_scores(q * 2.0, k, scale=0.25, mode="decay", decay=0.9, chunk=8).softmax(-1)

    q, k = torch.randn(20, 4, 8), torch.randn(20, 2, 8)
    compiled = torch.compile(score, fullgraph=True)
    torch.testing.assert_close(compiled(q, k), score(q, k))
