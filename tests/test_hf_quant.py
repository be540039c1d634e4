"""Quantized rows in the transformers bridge: ``kivi(residual=0)`` stores every kept token as a packed
``kvkernels.quant`` row (kvpolicies/hf/rows.py).

On the tiny models of tests/test_hf_bridge.py (head dim 16, so ``group`` 8 or 16):
* the bridge keeps the same positions per (sequence, layer, KV head) and generates the same tokens as
  ``kvmodels.decoder.Decoder`` for h2o / snapkv (2 and 4 bits), rotated rows, channel-scaled keys, per-head
  budgets (``pooled``) and kvzip's reconstruction pass, and the kept K/V it reads back are kvmodels';
* the stored rows are ``quantize_rows`` of the original K/V (rotated, or keys over their channel factors),
  bit for bit, before and after compaction, and read back within the format's bound;
* a decode step attends over its own token as stored, a prompt over its exact K/V (as kvmodels);
* the report counts the packed rows' bytes (codes, scales, zero points), about a third of fp16's at 4 bits;
* a left-padded ragged batch keeps and generates what each sequence does alone;
* what the bridge cannot hold (two packed formats, ALiBi, a group that does not divide the head dim) is
  refused by name with the fix (KIVI's residual: tests/test_hf_two_parts.py).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvkernels.quant import (  # noqa: E402  # noqa: E402
    QuantFormat,
    dequantize_rows,
    hadamard_rotation,
    key_channel_scale,
    quantize_rows,
    unpack,
)
from kvmodels.decoder import Decoder  # noqa: E402
from kvpolicies import compose  # noqa: E402
from test_hf_bridge import NEW, left_pad, model_of, prompts, run  # noqa: E402
from test_hf_kvzip import in_house, kept  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = [
    "h2o+kivi(bits=4, residual=0, group=8)",
    "snapkv+kivi(bits=2, residual=0, group=16)",
    "h2o+kivi(bits=2, residual=0, group=8, rotate=True)",
    "snapkv+pooled+kivi(bits=4, residual=0, group=8, channel_scale=True)",
    "kvzip(sinks=1, recent=2)+pooled+kivi(bits=4, residual=0, group=16)",
]
KINDS = ["llama", "smollm2", "gptj"]  # MPT (ALiBi) is refused, as kvmodels refuses it


def policy_of(spec: str, budget: float = 0.5):
    first, *rest = spec.split("+")
    return compose(first, *rest, budget=budget)


def model(kind: str) -> torch.nn.Module:
    return model_of(kind, "sdpa" if kind in ("llama", "smollm2") else "eager")


def prefill(hf_model, cache, batch: list[list[int]]) -> None:
    ids, mask = left_pad(batch)
    with torch.no_grad():
        hf_model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                 position_ids=(mask.cumsum(-1) - 1).clamp_min(0))


def ask_after_context(hf_model, policy, contexts: list[list[int]], questions: list[list[int]], new: int):
    """A forward on the (left-padded) contexts, then ``generate`` with the questions after them, through the
    bridge; kvmodels extends twice and generates; the two generations must be equal. Returns both caches
    (the bridge's, the ``Decoder``)."""
    (ctx_ids, ctx_mask), (q_ids, q_mask) = left_pad(contexts), left_pad(questions)
    cache = policy.hf_cache(hf_model)
    prefill(hf_model, cache, contexts)
    ids, mask = torch.cat([ctx_ids, q_ids], 1), torch.cat([ctx_mask, q_mask], 1)
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                past_key_values=cache, pad_token_id=0, use_cache=True)
    dec = Decoder(in_house(hf_model), policy)
    dec.extend(contexts)
    dec.extend(questions, max_new_tokens=new)
    assert out[:, ids.shape[1]:].tolist() == dec.generate(new).tokens
    return cache, dec


# --- the same as kvmodels ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", SPECS)
def test_keeps_and_generates_what_kvmodels_does(kind, spec):
    policy, hf_model, batch = policy_of(spec), model(kind), prompts([14, 9], seed=7)
    tokens, cache = run(hf_model, batch, policy)
    dec = Decoder(in_house(hf_model), policy)
    dec.extend(batch)
    assert tokens == dec.generate(NEW).tokens
    for b, p in enumerate(batch):
        assert kept(cache, b) == kept(dec.cache, b), f"sequence {b}"
        assert max(len(h) for layer in kept(cache, b) for h in layer) < len(p) + NEW - 1  # evicted
        for l in range(len(cache.layers)):  # the kept K/V read back: kvmodels' dequantized rows
            for ours, ref in zip(cache.head_contents(l, b), dec.cache.head_contents(l, b), strict=True):
                order = torch.argsort(ref["pos"])
                assert ours["pos"].tolist() == ref["pos"][order].tolist()
                prompt = ours["pos"] < len(p)
                for x in ("k", "v"):
                    # The prompt's rows bit for bit. A decoded token's K/V come from hidden states that the
                    # two attentions (transformers' sdpa / eager, kvmodels' kernel) round differently, so
                    # its rows may differ by a parameter's ulp (in principle a code at a rounding boundary).
                    assert torch.equal(ours[x][prompt], ref[x][order][prompt]), (l, b, x)
                    torch.testing.assert_close(ours[x], ref[x][order], rtol=0, atol=1e-2)
    assert cache.report().quantized


@pytest.mark.parametrize("kind", ["llama", "gptj"])
@pytest.mark.parametrize("spec", [SPECS[4], "kvzip(sinks=1, recent=2)+kivi(bits=2, residual=0, group=8, "
                                            "rotate=True)"])
def test_question_after_context_keeps_what_kvmodels_does(kind, spec):
    """A forward on the contexts, then ``generate`` with questions after them (kvmodels: ``extend`` twice):
    the reconstruction pass and the question's forward attend over the kept context dequantized and their
    own exact K/V, as kvmodels' extension does. (kvzip, as tests/test_hf_kvzip.py: the bridge's question
    path is checked against kvmodels for a reconstruction pass.)"""
    policy, hf_model = policy_of(spec, budget=0.3), model(kind)
    contexts, questions = prompts([20, 13], seed=7), prompts([4, 6], seed=8)
    cache, dec = ask_after_context(hf_model, policy, contexts, questions, NEW)
    for b in range(len(contexts)):
        assert kept(cache, b) == kept(dec.cache, b), f"sequence {b}"


# --- stored rows ---------------------------------------------------------------------------------
ROW_SPECS = [
    "kivi(bits=4, residual=0, group=8)",
    "kivi(bits=2, residual=0, group=16, rotate=True)",
    "kivi(bits=8, residual=0, group=16, channel_scale=True)",
]


def assert_within_bound(rows: torch.Tensor, x: torch.Tensor, fmt: QuantFormat) -> None:
    """Dequantized ``rows`` are within half a step of their group (plus float32 arithmetic) of ``x``."""
    D = x.shape[-1]
    step = unpack(rows, D, fmt).scale.float().repeat_interleave(fmt.group, -1)  # [..., D]
    err = (dequantize_rows(rows, D, fmt) - x.float()).abs()
    assert bool((err <= step / 2 + 1e-6 * (1 + x.float().abs())).all()), float((err - step / 2).amax())


@pytest.mark.parametrize("spec", ROW_SPECS)
def test_stored_rows_are_quantize_rows_of_the_original_kv(spec):
    """A prompt without eviction (``full``), then compressed by snapkv: each stored row is ``quantize_rows``
    of the token's exact K/V (from a native cache on the same prompt: a prompt attends over exact K/V, so
    both compute the same), rotated first or keys over their channel factors, as kvmodels writes it, the
    kept rows unchanged by the compaction; dequantized within the format's bound, and read back (rotated
    back, times the factors) as kvmodels reads them."""
    hf_model, batch = model("llama"), prompts([13, 7], seed=3)
    prec = compose(spec).precision
    fmt, D = QuantFormat(prec.bits, prec.group), 16
    R = hadamard_rotation(D)
    native = compose("full").hf_cache(hf_model)
    prefill(hf_model, native, batch)
    for budget, ev in ((1.0, "full"), (0.5, "snapkv")):
        cache = compose(ev, spec, budget=budget).hf_cache(hf_model)
        prefill(hf_model, cache, batch)
        cache.report()  # compresses the prompt (snapkv)
        for l, layer in enumerate(cache.layers):
            assert layer.keys.dtype == torch.uint8 and layer.keys.shape[-1] == fmt.row_bytes(D)
            for b in range(len(batch)):
                exact = native.layer_contents(l, b)  # every prompt token in position order, [L, Hkv, D]
                ok = layer.valid[b]
                pos = layer.positions[b][:, ok]  # [Hkv, n]
                assert ok.sum() < exact["k"].shape[0] if ev == "snapkv" else ok.sum() == exact["k"].shape[0]
                k, v = (exact[x].transpose(0, 1).gather(1, pos[..., None].expand(-1, -1, D)) for x in "kv")
                c = key_channel_scale(exact["k"])[:, None]  # [Hkv, 1, D] the sequence's whole prompt's
                to_k, to_v = (k / c if prec.channel_scale else k), v
                if prec.rotate:
                    to_k, to_v = k.float() @ R, v.float() @ R
                stored_k, stored_v = layer.keys[b][:, ok], layer.values[b][:, ok]  # [Hkv, n, W]
                assert torch.equal(stored_k, quantize_rows(to_k, fmt)), (budget, l, b)
                assert torch.equal(stored_v, quantize_rows(to_v, fmt)), (budget, l, b)
                assert_within_bound(stored_k, to_k, fmt)
                assert_within_bound(stored_v, to_v, fmt)
                back = cache.layer_contents(l, b)
                deq_k, deq_v = (dequantize_rows(x, D, fmt) for x in (stored_k, stored_v))
                if prec.rotate:
                    deq_k, deq_v = deq_k @ R.t(), deq_v @ R.t()
                if prec.channel_scale:
                    deq_k = deq_k * c
                assert torch.equal(back["k"].transpose(0, 1), deq_k.to(k.dtype))
                assert torch.equal(back["v"].transpose(0, 1), deq_v.to(v.dtype))


def test_decode_step_reads_its_own_token_as_stored():
    """A prompt's forward attends over its exact K/V, a decode step over its own token quantized (kvmodels:
    the token is written, then its kernel reads it back)."""
    hf_model, batch = model("llama"), prompts([9], seed=4)
    cache = policy_of("h2o+kivi(bits=2, residual=0, group=16)", budget=1.0).hf_cache(hf_model,
                                                                                      max_new_tokens=2)
    layer = cache.layers[0]
    seen = []
    original = layer.append

    def spy(k, v, *args, **kwargs):
        out = original(k, v, *args, **kwargs)
        seen.append((k.clone(), out[0][:, :, -k.shape[2]:].clone()))
        return out

    layer.append = spy
    ids, mask = left_pad(batch)
    with torch.no_grad():
        hf_model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        hf_model(input_ids=ids[:, -1:], attention_mask=torch.ones(1, 10, dtype=torch.int64),
                 past_key_values=cache, use_cache=True)
    (k0, got0), (k1, got1) = seen
    assert torch.equal(got0, k0)  # the prompt: exact
    assert not torch.equal(got1, k1)  # the decode step: as stored
    assert torch.equal(got1, cache.layers[0].dense()[0][:, :, -1:])


# --- bytes ---------------------------------------------------------------------------------------
def test_report_counts_the_packed_rows():
    hf_model, batch = model("llama"), prompts([14, 9], seed=7)
    _, native = run(hf_model, batch, policy_of("snapkv"))
    for spec, row in (("snapkv+kivi(bits=4, residual=0, group=16)", 8 + 4),
                      ("snapkv+kivi(bits=2, residual=0, group=8, channel_scale=True)", 4 + 8)):
        _, cache = run(hf_model, batch, policy_of(spec))
        rep, ref = cache.report(), native.report()
        assert rep.quantized and not ref.quantized and f"group {policy_of(spec).precision.group}" in rep.rows
        for l, layer in enumerate(cache.layers):
            held = layer.keys.numel() + layer.values.numel()  # uint8: codes, scales and zero points
            assert layer.keys.shape[-1] == row
            if layer.key_scale is not None:
                held += layer.key_scale.numel() * 4
            assert int(rep.bytes_per_layer[l]) == held
            # the same slots as the native cache, each K or V row `row` bytes instead of 16 float32s
            assert layer.keys.shape[:3] == native.layers[l].keys.shape[:3]
        assert rep.total_bytes == sum(int(x) for x in rep.bytes_per_layer) < ref.total_bytes
        assert rep.tokens_per_layer.tolist() == ref.tokens_per_layer.tolist()
        assert rep.full_cache_bytes == ref.full_cache_bytes  # the unquantized cache's
    # 4-bit, group 16: 12 bytes a row, 0.375 of float16's 32 (the fp16 cache's bytes are half this fp32's)
    rep = run(hf_model, batch, policy_of("snapkv+kivi(bits=4, residual=0, group=16)"))[1].report()
    assert rep.total_bytes / (native.report().total_bytes / 2) == pytest.approx(12 / 32, abs=0.02)


# --- ragged batches ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [SPECS[0], SPECS[3]])
def test_ragged_batch_equals_each_alone(spec):
    policy, hf_model, batch = policy_of(spec), model("smollm2"), prompts([13, 7, 10], seed=5)
    tokens, cache = run(hf_model, batch, policy)
    for b, p in enumerate(batch):
        alone_tokens, alone = run(hf_model, [p], policy)
        assert tokens[b] == alone_tokens[0], f"sequence {b}"
        assert kept(cache, b) == kept(alone, 0), f"sequence {b}"
        for ours, ref in zip(cache.head_contents(0, b), alone.head_contents(0, 0), strict=True):
            assert torch.equal(ours["k"], ref["k"]) and torch.equal(ours["v"], ref["v"])


# --- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,kind,words", [
    ("keyformer+kivi(bits=4, group=8)", "llama", ["'kivi'", "residual", "Gumbel", "use kivi(", "residual=0"]),
    ("h2o+zipcache(group=8)", "llama", ["'zipcache'", "two packed formats", "use kivi(", "kvmodels"]),
    ("h2o+mikv(high=8, group=8)", "llama", ["'mikv'", "two packed formats", "use kivi(", "kvmodels"]),
    ("h2o+kivi(bits=4, residual=0, group=8)", "mpt", ["'kivi'", "ALiBi", "RoPE model"]),
    ("h2o+kivi(bits=4, residual=0, group=32)", "llama", ["'kivi'", "does not fit", "head dim 16"]),
])
def test_refusals_name_the_policy_and_the_fix(spec, kind, words):
    policy = policy_of(spec)
    with pytest.raises(ValueError) as err:
        policy.hf_cache(model(kind))
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_minicache_with_quantization_is_refused_by_compose():
    with pytest.raises(ValueError, match="kivi.*minicache|minicache.*kivi"):
        compose("h2o", "minicache", "kivi(residual=0, group=8)", budget=0.5)
