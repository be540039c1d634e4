"""Generation throughput and KV bytes: full vs compressed cache, eager vs compiled decode, and
``transformers`` ``generate`` on the same model, prompts and machine in the same run.

CPU: SmolLM2-135M-Instruct (the bundled GGUF) at fp32, batch 1, a 4096-token prompt of the bundled
Moby-Dick text, 32 new tokens. CUDA: a Llama-3.2-1B-shaped model with random bf16 weights, 4k-token
prompts + 512 new tokens. ``h2o+adakv`` measures the per-head pages Ada-KV's budgets need
(``kvmodels.head_cache``) against ``h2o`` on shared pages. Ratios go to ``extra_info``; nothing is asserted
about speed. Compiled runs
report steady-state decode speed (the first step, which compiles, is reported apart). Run:
``pytest bench/test_bench_generate.py --benchmark-json out.json`` (``OMP_NUM_THREADS`` sets threads).
"""

from __future__ import annotations

import gzip
import os
import time
from pathlib import Path

import pytest
import torch

from gpu import StepClock, tiny_llama_config  # bench/gpu.py (pytest puts bench/ on the path)
from kvmodels.generate import generate
from kvpolicies import compose

transformers = pytest.importorskip("transformers")

CUDA = torch.cuda.is_available()
if CUDA:
    PROMPT_LEN, NEW_TOKENS, BATCHES, BUDGETS = 4096, 512, [1, 16, 64], [1.0, 0.5, 0.2]
    POLICIES, COMPILE = ["full", "streaming", "squeeze+keyformer", "h2o", "h2o+adakv"], [True]
else:
    PROMPT_LEN = int(os.environ.get("KVBENCH_PROMPT_LEN", "4096"))
    NEW_TOKENS, BATCHES, BUDGETS = 32, [1], [1.0, 0.2]
    POLICIES, COMPILE = ["full", "streaming", "h2o", "h2o/16", "h2o+adakv"], [False, True]
# tests/test_bench_smoke.py runs every benchmark once at tiny shapes so none rots, on a tiny random Llama
# (random prompts). The compiled body is the same for every policy, so the smoke run compiles one evicting
# policy; every policy's compiled step is tested in tests/, and SmolLM2 with its tokenizer there too.
SMOKE = os.environ.get("KVBENCH_SMOKE") == "1"
#: The evaluation harness's Moby-Dick text (real prose for the CPU prompts).
TEXT = Path(__file__).resolve().parents[1] / "evals" / "data" / "moby_dick_ch1-30.txt.gz"


def device_name() -> str:
    return torch.cuda.get_device_name() if CUDA else f"cpu x{torch.get_num_threads()} threads"


@pytest.fixture(scope="module")
def models():
    """(ours, hf, tokenizer) with identical weights."""
    from kvmodels.loading import from_transformers, llama_config_to_hf, load_checkpoint

    if CUDA or SMOKE:  # random weights: Llama-3.2-1B's shape in bf16 on a GPU, a tiny Llama for the smoke run
        from kvmodels.llama import LlamaConfig

        if CUDA:
            config = LlamaConfig.from_name("llama-3.2-1b", max_seq_len=PROMPT_LEN + NEW_TOKENS)
        else:  # SmolLM2's 30 layers took ~95 s to compile from a cold cache, most of the smoke's time
            config = tiny_llama_config(PROMPT_LEN + NEW_TOKENS)
        torch.manual_seed(0)
        with torch.device("cuda" if CUDA else "cpu"):
            hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_to_hf(config)))
        hf = hf.to(torch.bfloat16 if CUDA else torch.float32).eval()
        return from_transformers(hf), hf, None
    loaded = load_checkpoint()  # the converted GGUF is a Hugging Face directory transformers can read
    hf = transformers.LlamaForCausalLM.from_pretrained(str(loaded.directory), dtype=torch.float32).eval()
    return loaded.model, hf, loaded.tokenizer


def prompts(batch: int, vocab: int, tokenizer) -> list[list[int]]:
    """Real text on CPU (the first PROMPT_LEN tokens of Moby-Dick), random ids for the random models."""
    if tokenizer is not None:
        with gzip.open(TEXT, "rt", encoding="utf-8") as f:
            ids = tokenizer.encode(f.read())[:PROMPT_LEN]
        assert len(ids) == PROMPT_LEN
        return [ids] * batch
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab, (batch, PROMPT_LEN), generator=g).tolist()


def hf_generate(hf, batch: list[list[int]]) -> dict[str, float]:
    """transformers' greedy generate (DynamicCache), prefill and decode timed within one call."""
    device = next(hf.parameters()).device
    ids = torch.tensor(batch, device=device)
    clock = StepClock()
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                    logits_processor=transformers.LogitsProcessorList([clock]))
        t1 = time.perf_counter()
    prefill_s, decode_s = clock.times[0] - t0, t1 - clock.times[0]
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_bytes = (2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * hf.dtype.itemsize
                * (PROMPT_LEN + NEW_TOKENS) * len(batch))  # DynamicCache holds every token of every layer
    return {"prefill_s": prefill_s, "prefill_tok_s": ids.numel() / prefill_s,
            "decode_tok_s": len(batch) * (NEW_TOKENS - 1) / decode_s, "kv_bytes": kv_bytes}


_hf_decode_tok_s: dict[int, float] = {}


@pytest.mark.parametrize("batch", BATCHES)
def test_bench_transformers_generate(benchmark, models, batch):
    _, hf, tokenizer = models
    data = prompts(batch, hf.config.vocab_size, tokenizer)
    stats = benchmark.pedantic(hf_generate, args=(hf, data), rounds=1, iterations=1)
    _hf_decode_tok_s[batch] = stats["decode_tok_s"]
    benchmark.extra_info.update(stats, impl="transformers", policy="full", batch=batch, prompt_len=PROMPT_LEN,
                                new_tokens=NEW_TOKENS, device=device_name())


@pytest.mark.parametrize("compiled", COMPILE, ids=lambda c: "compiled" if c else "eager")
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("policy_name", POLICIES)
def test_bench_generate(benchmark, models, policy_name, budget, batch, compiled):
    if (policy_name == "full") != (budget == 1.0):
        pytest.skip("full runs only at budget 1.0; compressing policies below it")
    if SMOKE and compiled and policy_name != "h2o":
        pytest.skip("smoke run: one compiled policy (h2o) keeps the compiled body from rotting")
    model, hf, tokenizer = models
    # "name/k": evict every k decode steps (amortised compaction; a layer holds up to budget + k - 1 tokens)
    name, _, every = policy_name.partition("/")
    policy = compose(name, budget=budget, evict_every=int(every or 1))
    data = prompts(batch, hf.config.vocab_size, tokenizer)
    if CUDA:  # compile (and warm up) outside the timed run
        generate(model, data[:batch], 4, policy, compile=True)
    result = benchmark.pedantic(generate, args=(model, data, NEW_TOKENS, policy),
                                kwargs=dict(compile=compiled), rounds=1, iterations=1)
    r = result.report
    first_step_s = result.extra["first_step_s"]
    # Steady state: the first step (which compiles when compiled) is left out, for every run alike.
    decode_tok_s = (result.decode_tokens - batch) / (result.decode_s - first_step_s)
    info = dict(impl="kvmodels-compiled" if compiled else "kvmodels-eager", policy=policy.name, budget=budget,
                evict_every=policy.evict_every,
                batch=batch, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, prefill_s=result.prefill_s,
                prefill_tok_s=result.prefill_tok_s, decode_tok_s=decode_tok_s, first_step_s=first_step_s,
                kv_bytes=r.total_bytes, kv_bytes_full=r.full_cache_bytes,
                kv_kept_over_full=r.total_bytes / r.full_cache_bytes, kv_peak_bytes=r.peak_bytes,
                device=device_name())
    if batch in _hf_decode_tok_s:
        info["decode_speedup_vs_transformers"] = decode_tok_s / _hf_decode_tok_s[batch]
    benchmark.extra_info.update(info)
