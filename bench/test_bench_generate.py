"""Generation throughput and KV bytes: full vs compressed cache, several budgets and batch sizes, and
``transformers`` ``generate`` on the same model, prompts and machine in the same run.

CPU: SmolLM2-135M-Instruct (the bundled GGUF), short prompts. CUDA: a Llama-3.2-1B-shaped model with
random bf16 weights, 4k-token prompts + 512 new tokens. Ratios go to ``extra_info``; nothing is asserted
about speed. Run: ``pytest bench/test_bench_generate.py --benchmark-json out.json``.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvmodels.generate import generate
from kvpolicies import compose

transformers = pytest.importorskip("transformers")

CUDA = torch.cuda.is_available()
if CUDA:
    PROMPT_LEN, NEW_TOKENS, BATCHES, BUDGETS = 4096, 512, [1, 16, 64], [1.0, 0.5, 0.2]
else:
    PROMPT_LEN, NEW_TOKENS, BATCHES, BUDGETS = 128, 16, [1, 4], [1.0, 0.2]
POLICIES = ["full", "streaming", "squeeze+keyformer"] + (["h2o"] if CUDA else [])


@pytest.fixture(scope="module")
def models():
    """(ours, hf) with identical weights."""
    from kvmodels.loading import from_transformers, llama_config_to_hf, load_checkpoint

    if CUDA:
        from kvmodels.llama import LlamaConfig

        config = LlamaConfig.from_name("llama-3.2-1b", max_seq_len=PROMPT_LEN + NEW_TOKENS)
        with torch.device("cuda"):
            hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_to_hf(config)))
        hf = hf.to(torch.bfloat16).eval()
        return from_transformers(hf), hf
    loaded = load_checkpoint()  # the converted GGUF is a Hugging Face directory transformers can read
    hf = transformers.LlamaForCausalLM.from_pretrained(str(loaded.directory), dtype=torch.float32).eval()
    return loaded.model, hf


def prompts(batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab, (batch, PROMPT_LEN), generator=g).tolist()


_hf_decode_tok_s: dict[int, float] = {}


def hf_generate(hf, batch: list[list[int]]) -> dict[str, float]:
    """transformers' greedy generate; prefill timed as a 1-token generate, decode as the remainder."""
    device = next(hf.parameters()).device
    ids = torch.tensor(batch, device=device)
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        t2 = time.perf_counter()
    prefill_s = t1 - t0
    return {"prefill_tok_s": ids.numel() / prefill_s,
            "decode_tok_s": len(batch) * (NEW_TOKENS - 1) / max(t2 - t1 - prefill_s, 1e-9)}


@pytest.mark.parametrize("batch", BATCHES)
def test_bench_transformers_generate(benchmark, models, batch):
    _, hf = models
    data = prompts(batch, hf.config.vocab_size)
    stats = benchmark.pedantic(hf_generate, args=(hf, data), rounds=1, iterations=1)
    _hf_decode_tok_s[batch] = stats["decode_tok_s"]
    benchmark.extra_info.update(stats, batch=batch, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS,
                                device=torch.cuda.get_device_name() if CUDA else "cpu")


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("policy_name", POLICIES)
def test_bench_generate(benchmark, models, policy_name, budget, batch):
    if (policy_name == "full") != (budget == 1.0):
        pytest.skip("full runs only at budget 1.0; compressing policies below it")
    model, hf = models
    policy = compose(policy_name, budget=budget)
    data = prompts(batch, hf.config.vocab_size)
    if CUDA:  # compile (and warm up) outside the timed run
        generate(model, data[:batch], 4, policy, compile=True)
    result = benchmark.pedantic(generate, args=(model, data, NEW_TOKENS, policy),
                                kwargs=dict(compile=CUDA), rounds=1, iterations=1)
    r = result.report
    info = dict(policy=policy.name, budget=budget, batch=batch, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS,
                prefill_tok_s=result.prefill_tok_s, decode_tok_s=result.decode_tok_s,
                kv_bytes_kept=r.total_bytes, kv_bytes_full=r.full_cache_bytes,
                kv_kept_over_full=r.total_bytes / r.full_cache_bytes, kv_peak_bytes=r.peak_bytes,
                device=torch.cuda.get_device_name() if CUDA else "cpu")
    if batch in _hf_decode_tok_s:
        info["decode_speedup_vs_transformers"] = result.decode_tok_s / _hf_decode_tok_s[batch]
    benchmark.extra_info.update(info)
