"""Passkey retrieval for policy *variants* (parameters the sweep's names cannot carry): TOVA as the paper
describes it (one selection per layer, at every decode step) against the per-KV-head variant and the
prompt-only selection NVIDIA kvpress's ``TOVAPress`` makes, ChunkKV against SnapKV, Ada-KV's head
budgets with other floors, and SnapKV / ChunkKV with one selection per layer (``per_head=False``).

Same samples, prompts, replayed prefills and scoring as ``python -m kvmodels.eval`` (SmolLM2-135M, greedy,
question inside the prompt). One JSON line per (variant, budget), appended to ``--out``; a rerun skips the
lines already there. Run: ``python bench/passkey_variants.py --context 1024 --n 24``; ``--report`` prints
the recorded answers and near misses (the key with one digit left out) per variant and budget instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

VARIANTS: dict[str, tuple[tuple[str, ...], dict]] = {
    "full": (("full",), {}),
    "h2o": (("h2o",), {}),
    "snapkv": (("snapkv",), {}),
    "snapkv chunk=10": (("snapkv",), {"snapkv": {"chunk": 10}}),
    "chunkkv": (("chunkkv",), {}),
    "tova (paper: per layer, every step)": (("tova",), {}),
    "tova per_head": (("tova",), {"tova": {"per_head": True}}),
    "tova decode=False (kvpress's)": (("tova",), {"tova": {"decode": False}}),
    "keyformer": (("keyformer",), {}),
    "squeeze+snapkv": (("squeeze", "snapkv"), {}),
    "squeeze p=0.8+snapkv": (("squeeze", "snapkv"), {"squeeze": {"p": 0.8}}),
    "pyramid+snapkv": (("pyramid", "snapkv"), {}),
    "squeeze+keyformer": (("squeeze", "keyformer"), {}),
    "squeeze+h2o": (("squeeze", "h2o"), {}),
    "snapkv chunk=5": (("snapkv",), {"snapkv": {"chunk": 5}}),
    "knorm": (("knorm",), {}),
    "knorm decode=False": (("knorm",), {"knorm": {"decode": False}}),
    "snapkv chunk=20": (("snapkv",), {"snapkv": {"chunk": 20}}),
    "chunkkv chunk=20": (("chunkkv",), {"chunkkv": {"chunk": 20}}),
    "chunkkv reuse=2": (("chunkkv",), {"chunkkv": {"reuse": 2}}),
    "pyramid+snapkv chunk=10": (("pyramid", "snapkv"), {"snapkv": {"chunk": 10}}),
    "squeeze p=0.8+snapkv chunk=10": (("squeeze", "snapkv"),
                                      {"squeeze": {"p": 0.8}, "snapkv": {"chunk": 10}}),
    # Ada-KV head budgets (docs/design-adakv.md): the paper's floor (alpha=0.2), a larger one, and on chunks.
    "snapkv+adakv": (("snapkv", "adakv"), {}),
    "snapkv+adakv alpha=0.5": (("snapkv", "adakv"), {"adakv": {"alpha": 0.5}}),
    "snapkv chunk=10+adakv": (("snapkv", "adakv"), {"snapkv": {"chunk": 10}}),
    "chunkkv+adakv": (("chunkkv", "adakv"), {}),
    "h2o+adakv": (("h2o", "adakv"), {}),
    # One selection per layer (every KV head keeps the tokens of the heads' mean score), as TOVA's paper does.
    "snapkv per_head=False": (("snapkv",), {"snapkv": {"per_head": False}}),
    "snapkv chunk=5 per_head=False": (("snapkv",), {"snapkv": {"chunk": 5, "per_head": False}}),
    "snapkv chunk=10 per_head=False": (("snapkv",), {"snapkv": {"chunk": 10, "per_head": False}}),
    "chunkkv per_head=False": (("chunkkv",), {"chunkkv": {"per_head": False}}),
    # ... and a shorter observation window (16 queries: the question and the answer prefix, less prose).
    "snapkv chunk=10 window=16": (("snapkv",), {"snapkv": {"chunk": 10, "window": 16}}),
    "snapkv chunk=10 window=16 per_head=False": (("snapkv",),
                                                 {"snapkv": {"chunk": 10, "window": 16, "per_head": False}}),
    "snapkv chunk=5 window=16 per_head=False": (("snapkv",),
                                                {"snapkv": {"chunk": 5, "window": 16, "per_head": False}}),
    # ... with the chunks placed on the scores instead of a grid from the first token (a boundary no longer
    # cuts the key in two).
    "snapkv chunk=10 window=16 per_head=False align=scores": (
        ("snapkv",), {"snapkv": {"chunk": 10, "window": 16, "per_head": False, "align": "scores"}}),
    "snapkv chunk=5 window=16 per_head=False align=scores": (
        ("snapkv",), {"snapkv": {"chunk": 5, "window": 16, "per_head": False, "align": "scores"}}),
    "squeeze+chunkkv per_head=False": (("squeeze", "chunkkv"), {"chunkkv": {"per_head": False}}),
    "pyramid+chunkkv per_head=False": (("pyramid", "chunkkv"), {"chunkkv": {"per_head": False}}),
}


def main(argv: list[str] | None = None) -> int:
    from kvmodels.eval import tasks
    from kvmodels.eval.sweep import Runner, device_name
    from kvpolicies import compose

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--budgets", default="0.2,0.5")
    p.add_argument("--variants", default=None, help="';'-separated subset of the variant names")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--batch", type=int, default=0, help="sequences per generate call (default: all n; "
                   "lower it to bound the cache's memory at long contexts)")
    p.add_argument("--seed", type=int, default=0, help="sample seed: another seed draws other keys and "
                   "passages (a held-out check of variants chosen on seed 0)")
    p.add_argument("--out", default="bench/results/passkey-variants.jsonl")
    p.add_argument("--report", action="store_true", help="print correct / near-miss counts of the recorded "
                   "lines for --context, --n and --seed (rebuilding the samples' keys) and run nothing")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    done = set()
    if out.exists():
        done = {json.loads(line)["key"] for line in out.read_text().splitlines() if line.strip()}
    names = list(VARIANTS) if args.variants is None else args.variants.split(";")
    runner = Runner(seed=args.seed)
    tag = f"|seed={args.seed}" if args.seed else ""  # seed 0 keeps the keys of earlier runs
    samples = runner.samples("passkey", args.context, args.n)
    if args.report:
        return report(out, samples, args.context, args.n, args.seed)
    runner.replay.record([list(s.prompt) for s in samples])
    for budget in [float(b) for b in args.budgets.split(",")]:
        for name in names:
            key = f"passkey|ctx={args.context}|n={args.n}|{name}|{budget if name != 'full' else 1.0:g}{tag}"
            if key in done:
                continue
            done.add(key)
            spec, params = VARIANTS[name]
            policy = compose(*spec, budget=budget if name != "full" else 1.0, seed=runner.seed, **params)
            t0 = time.perf_counter()
            res = tasks.run_passkey(runner.replay, runner.tokenizer, samples, policy,
                                    batch_size=args.batch or args.n)
            record = {"key": key, "variant": name, "policy": repr(policy), "budget": budget,
                      "context": args.context, "n": args.n, "seed": args.seed,
                      "seconds": round(time.perf_counter() - t0, 2), "device": device_name(),
                      "torch": torch.__version__, **res.metrics, "outputs": res.outputs}
            with out.open("a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
            print(f"{name:40s} {budget:4.2f} {res.metrics.get('correct')}/{args.n} ({record['seconds']} s)",
                  flush=True)
    return 0


def report(out: Path, samples: list, context: int, n: int, seed: int) -> int:
    """Print, per recorded variant and budget, correct answers and near misses out of ``n``."""
    from kvmodels.eval import tasks

    keys = [s.answer for s in samples]
    rows: dict[str, dict[float, str]] = {}
    full = "not recorded"
    for line in out.read_text().splitlines():
        r = json.loads(line)
        if (r["context"], r["n"], r.get("seed", 0)) != (context, n, seed):
            continue
        near = sum(tasks.near_miss(o, k) for o, k in zip(r["outputs"], keys, strict=True))
        if r["variant"] == "full":  # the full cache keeps everything at any budget
            full = f"{r['correct']} ({near})"
            continue
        rows.setdefault(r["variant"], {})[r["budget"]] = f"{r['correct']} ({near})"
    budgets = sorted({b for cells in rows.values() for b in cells})
    print(f"passkey, ~{context} tokens, {n} samples, seed {seed}: correct (near misses); "
          f"the full cache {full}")
    print("| variant | " + " | ".join(f"{b:g}" for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for name, cells in rows.items():
        print(f"| `{name}` | " + " | ".join(cells.get(b, "") for b in budgets) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
