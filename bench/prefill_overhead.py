"""Prefill cost of scoring policies against the plain prefill, interleaved in one process so that a shared
machine's load hits both alike: SmolLM2-135M (the bundled GGUF) at fp32 on CPU, batch 1, the first
``--tokens`` tokens of the Moby-Dick text (``evals/data``), ``generate(max_new_tokens=1)`` (prefill + prompt
compression, no decode). Prints each run and the median ratio per policy; ``--out`` appends JSON lines.
Run: ``OMP_NUM_THREADS=1 python bench/prefill_overhead.py --policies h2o,snapkv,squeeze+keyformer``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parents[1] / "evals" / "data" / "moby_dick_ch1-30.txt.gz"


def main(argv: list[str] | None = None) -> int:
    from kvmodels.generate import generate
    from kvmodels.loading import load_checkpoint
    from kvpolicies import compose

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--policies", default="h2o,snapkv")
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    loaded = load_checkpoint()
    with gzip.open(TEXT, "rt", encoding="utf-8") as f:
        ids = loaded.tokenizer.encode(f.read())[: args.tokens]
    names = ["full", *args.policies.split(",")]
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        for r in range(args.rounds):
            for name in names:
                policy = compose(name, budget=1.0 if name == "full" else args.budget)
                s = generate(loaded.model, [ids], 1, policy).prefill_s
                times[name].append(s)
                print(f"round {r} {name:20s} {s:6.2f} s", flush=True)
    full = statistics.median(times["full"])
    device = f"cpu x{torch.get_num_threads()} threads"
    for name in names:
        med = statistics.median(times[name])
        print(f"{name:20s} median {med:6.2f} s  ratio {med / full:.2f}")
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"policy": name, "budget": args.budget, "tokens": args.tokens,
                                    "prefill_s": times[name], "median_s": med, "ratio_vs_full": med / full,
                                    "device": device, "torch": torch.__version__}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
