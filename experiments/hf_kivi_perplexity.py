"""4096-token perplexity of a ``transformers`` model with quantized rows in its cache (issue 36): ``kivi``
with KIVI's residual against every token quantized and the unquantized cache, on SmolLM2-135M-Instruct (CPU,
float32).

The protocol of ``evals.tasks.run_perplexity`` (the kvmodels table in docs/results.md), driven through
``transformers``' ``LlamaForCausalLM`` with a ``kvmodels.hf.paged_cache``: the first ``--prefill`` tokens in
one forward (their own attention exact: a plain forward gives their predictions, a second stores them), then
one forward per token, teacher-forced, each reading the cache as stored (the paged cache's packed rows, read
by its decode attention); the mean negative log-likelihood of the ``T - 1`` next-token predictions. Nothing is
evicted (``full``): quantization alone. (The records before 2026-11-28's retirement of ``kvpolicies.hf`` ran
the same protocol through that bridge's cache: keys without ``|paged``.)

Run: ``python -m experiments.hf_kivi_perplexity --out experiments/results/hf-kivi-perplexity.jsonl``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

CONFIGS = ["full", "full+kivi", "full+kivi(residual=0)", "full+kivi(bits=2)"]


def perplexity(hf_model, tokens: list[int], spec: str, prefill: int) -> dict:
    from kvmodels.hf import paged_cache
    from kvpolicies import compose

    first, *rest = spec.split("+")
    policy = compose(first, *rest, budget=1.0)
    T = len(tokens)
    ids = torch.tensor([tokens])
    cache = paged_cache(hf_model, policy, max_new_tokens=T - prefill)
    nll = 0.0
    t0 = time.perf_counter()
    with torch.no_grad():
        logp = hf_model(input_ids=ids[:, :prefill]).logits[0].float().log_softmax(-1)  # [prefill, V]
        nll -= float(logp[torch.arange(prefill), ids[0, 1:prefill + 1]].sum())
        hf_model(input_ids=ids[:, :prefill], past_key_values=cache)  # the prompt, stored
        for t in range(prefill, T - 1):  # the cache gives each step its position
            out = hf_model(input_ids=ids[:, t:t + 1], past_key_values=cache)
            nll -= float(out.logits[0, -1].float().log_softmax(-1)[ids[0, t + 1]])
    seconds = time.perf_counter() - t0
    rep = cache.report()
    return {"ppl": math.exp(nll / (T - 1)), "nll": nll / (T - 1), "rows": rep.rows,
            "kv_bytes": rep.total_bytes, "kv_bytes_full": rep.full_cache_bytes, "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results/hf-kivi-perplexity.jsonl")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", help="'|'-separated configs")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    from evals.sweep import Runner, append_record, device_name, read_records
    from kvmodels.loading import _cached_conversion, default_model_path

    runner = Runner(None)
    tokens = runner.text_tokens(args.tokens)
    directory, _ = _cached_conversion(default_model_path())
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()
    out = Path(args.out)
    done = {r["key"] for r in read_records(out)}
    for spec in CONFIGS if not args.only else args.only.split("|"):
        key = f"hf-kivi-ppl|paged|{runner.model_name}|{args.tokens}|prefill={args.prefill}|{spec}"
        if key in done:
            continue
        res = perplexity(hf_model, tokens, spec, args.prefill)
        rec = {"key": key, "policy": spec, "tokens": args.tokens, "prefill": args.prefill,
               "device": device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **res}
        append_record(out, rec)
        print(f"{spec}: ppl {res['ppl']:.2f} ({res['seconds']} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
