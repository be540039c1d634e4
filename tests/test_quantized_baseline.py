"""experiments/quantized_baseline.py (transformers' QuantizedCache baseline of issue 36) on a tiny random
Llama: the report table, argument errors, a recorded prefill written into a fresh cache decodes as
``generate`` does, perplexity does not depend on the chunking, and bytes are counted from the cache's
tensors. The QuantizedCache tests run only where the quanto backend (optimum-quanto) is importable; the
dev venv has no backend, so there they are skipped and the rest still runs."""

from __future__ import annotations

import pytest
import torch

from experiments import quantized_baseline as qb

pytestmark = pytest.mark.usefixtures("one_thread")

RECORDS = [
    {"config": "full", "task": "passkey", "context": 1024, "correct": 22, "n": 24,
     "cache": "DynamicCache (fp32)", "bytes_per_token": 46080.0, "vs_fp16": 2.0},
    {"config": "q4-g64", "task": "passkey", "context": 1024, "correct": 21, "n": 24,
     "cache": "QuantizedCache(4)", "bytes_per_token": 7200.0, "vs_fp16": 0.3125},
    {"config": "full", "task": "perplexity", "context": 4096, "ppl": 52.5612, "cache": "DynamicCache (fp32)",
     "bytes_per_token": 46080.0, "vs_fp16": 2.0},
]


def test_table_and_report(tmp_path, capsys):
    text = qb.table(RECORDS)
    lines = text.splitlines()
    assert lines[0] == "| config | cache | bytes/token | vs fp16 | passkey ~1024 | ppl 4096 |"
    assert lines[2] == "| full | DynamicCache (fp32) | 46080 | 2.000 | 22/24 | 52.56 |"
    assert lines[3] == "| q4-g64 | QuantizedCache(4) | 7200 | 0.312 | 21/24 | — |"
    assert qb.table([]) == "(no records)"
    from evals.sweep import append_record

    out = tmp_path / "r.jsonl"
    for r in RECORDS:
        append_record(out, r)
    assert qb.main(["--report", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == text


@pytest.mark.parametrize("argv, message", [
    (["--configs", "full,q3"], "--configs: unknown"),
    (["--tasks", "rouge"], "--tasks: unknown"),
    (["--length", "1k"], "--length"),
    (["--length", "10"], ">= 64"),
    (["--n", "0"], "--n"),
    (["--ppl-tokens", "100", "--ppl-prefill", "200"], "--ppl-prefill"),
    (["--ppl-chunk", "0"], "--ppl-chunk"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        qb.main([*argv, "--configs", "full"] if "--configs" not in argv else argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_backend_is_named_with_its_install(monkeypatch, capsys):
    monkeypatch.setitem(qb.BACKENDS, "quanto", ("no_such_quant_backend", "optimum-quanto"))
    with pytest.raises(SystemExit):
        qb.main(["--configs", "full,q4-g64"])
    assert "pip install optimum-quanto" in capsys.readouterr().err
    # the full cache alone needs no backend: parsing passes (nothing runs here)
    assert qb.parse(["--configs", "full"]).config_list == ["full"]


@pytest.fixture(scope="module")
def tiny():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval()


TOKENS = torch.randint(0, 97, (120,), generator=torch.Generator().manual_seed(1)).tolist()


def _generate(hf, cache, ids, new):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          **qb._cache_kw(hf, cache))
    return out[0, len(ids):].tolist()


def test_full_cache_replay_decodes_as_generate(tiny):
    prompt = TOKENS[:50]
    logits, kv = qb.prefill(tiny, prompt)
    cache = qb.fill(qb.make_cache("full", tiny.config), kv)
    assert qb.greedy(tiny, cache, logits, 6) == _generate(tiny, qb.make_cache("full", tiny.config), prompt, 6)
    b = qb.bytes_record(qb.fill(qb.make_cache("full", tiny.config), kv), tiny.config)
    assert b["cached_tokens"] == 50 and b["fp16_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert b["bytes_per_token"] == b["fp32_bytes_per_token"] and b["vs_fp16"] == 2.0


def test_full_cache_perplexity_does_not_depend_on_chunks(tiny):
    dense = qb.perplexity(tiny, TOKENS, qb.make_cache("full", tiny.config), len(TOKENS), 1)
    chunked = qb.perplexity(tiny, TOKENS, qb.make_cache("full", tiny.config), 20, 7)
    assert dense["forwards"] == 1 and chunked["forwards"] == 1 + -(-100 // 7)
    assert chunked["nll"] == pytest.approx(dense["nll"], abs=1e-4)
    with pytest.raises(ValueError, match="prefill"):
        qb.perplexity(tiny, TOKENS, qb.make_cache("full", tiny.config), 0, 8)


@pytest.fixture
def small_quant(monkeypatch):
    """A QuantizedCache config sized for the tiny model (head_dim 16): 2 bits, groups of 16, residual 32."""
    pytest.importorskip("optimum.quanto")
    monkeypatch.setitem(qb.CONFIGS, "t", {"nbits": 2, "q_group_size": 16, "residual_length": 32})
    return "t"


def test_quantized_replay_decodes_as_generate(tiny, small_quant):
    prompt = TOKENS[:50]
    logits, kv = qb.prefill(tiny, prompt)
    cache = qb.fill(qb.make_cache(small_quant, tiny.config), kv)
    # 40 new tokens: the residual (32) flushes once on the way
    want = _generate(tiny, qb.make_cache(small_quant, tiny.config), prompt, 40)
    assert qb.greedy(tiny, cache, logits, 40) == want


def test_quantized_perplexity_chunk_of_the_residual_equals_decode(tiny, small_quant):
    one = qb.perplexity(tiny, TOKENS, qb.make_cache(small_quant, tiny.config), 24, 1)
    resid = qb.perplexity(tiny, TOKENS, qb.make_cache(small_quant, tiny.config), 24, 32)
    assert resid["nll"] == pytest.approx(one["nll"], abs=1e-4)
    assert resid["forwards"] == 1 + -(-96 // 32)


def test_quantized_bytes_are_counted_from_the_tensors(tiny, small_quant):
    _, kv = qb.prefill(tiny, TOKENS[:64])
    cache = qb.fill(qb.make_cache(small_quant, tiny.config), kv)
    b = qb.cache_bytes(cache)
    values = 2 * 2 * 2 * 64 * 16  # (K, V) x layers x kv heads x tokens x head_dim
    assert b["tokens"] == 64 and b["residual"] == 0
    assert b["data"] == values * 2 // 8  # 2 bits, packed four to a byte
    assert b["params"] == (values // 16) * 2 * 4  # a scale and a shift (fp32) per group of 16
    rec = qb.bytes_record(cache, tiny.config)
    assert rec["bytes_per_token"] == pytest.approx((b["data"] + b["params"]) / 64, abs=0.1)
