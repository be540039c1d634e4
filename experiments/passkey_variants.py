"""Passkey retrieval for policy *variants* (parameters the sweep's names cannot carry): TOVA as the paper
describes it (one selection per layer, at every decode step) against the per-KV-head variant and the
prompt-only selection NVIDIA kvpress's ``TOVAPress`` makes, ChunkKV against SnapKV, Ada-KV's head
budgets with other floors, and SnapKV / ChunkKV with one selection per layer (``per_head=False``).

Same samples, prompts, replayed prefills and scoring as ``python -m evals`` (SmolLM2-135M, greedy,
question inside the prompt). One JSON line per (variant, budget), appended to ``--out``; a rerun skips the
lines already there. Run: ``python -m experiments.passkey_variants --context 1024 --n 24``; ``--report``
prints the recorded answers and near misses (the key with one digit left out) per variant and budget instead.

``--task generation`` runs the sweep's generation-agreement task instead (greedy 48-token summaries of
~``--context``-token passages, ROUGE-L F1 against the full cache's summary of the same prompt, which the
script computes first on the same samples) into ``experiments/results/generation-variants.jsonl``: whether a
setting chosen on the passkey keeps what the model writes. ``--report`` prints its ROUGE-L table.
"""

from __future__ import annotations

import argparse
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
    from evals import tasks
    from evals.sweep import Runner, append_record, device_name, read_records
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
    p.add_argument("--task", choices=("passkey", "generation"), default="passkey")
    p.add_argument("--out", default=None, help="JSONL results (default: experiments/results/"
                   "passkey-variants.jsonl; generation-variants.jsonl for --task generation)")
    p.add_argument("--report", action="store_true", help="print correct / near-miss counts (ROUGE-L for "
                   "--task generation) of the recorded lines for --context, --n and --seed and run nothing")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or f"experiments/results/{args.task}-variants.jsonl")
    recorded = read_records(out)
    done = {r["key"] for r in recorded}
    names = list(VARIANTS) if args.variants is None else args.variants.split(";")
    runner = Runner(seed=args.seed)
    tag = f"|seed={args.seed}" if args.seed else ""  # seed 0 keeps the keys of earlier runs
    samples = runner.samples(args.task, args.context, args.n)
    if args.report:
        if args.task == "generation":
            return report_generation(out, args.context, args.n, args.seed)
        return report(out, samples, args.context, args.n, args.seed)
    runner.replay.record([list(s.prompt) for s in samples])
    refs = None
    if args.task == "generation":
        # The full cache's summaries of these samples are the references: from the file, else run first.
        full_key = f"generation|ctx={args.context}|n={args.n}|full|1{tag}"
        found = [r["outputs"] for r in recorded if r["key"] == full_key]
        if found:
            refs = found[-1]
        else:
            names = ["full"] + [n for n in names if n != "full"]
    for budget in [float(b) for b in args.budgets.split(",")]:
        for name in names:
            budget_key = budget if name != "full" else 1.0
            key = f"{args.task}|ctx={args.context}|n={args.n}|{name}|{budget_key:g}{tag}"
            if key in done:
                continue
            done.add(key)
            spec, params = VARIANTS[name]
            policy = compose(*spec, budget=budget_key, seed=runner.seed, **params)
            t0 = time.perf_counter()
            if args.task == "generation":
                res = tasks.run_generation(runner.replay, runner.tokenizer, samples, policy,
                                           None if name == "full" else refs, batch_size=args.batch or args.n)
                if name == "full":
                    refs = res.outputs
            else:
                res = tasks.run_passkey(runner.replay, runner.tokenizer, samples, policy,
                                        batch_size=args.batch or args.n)
            record = {"key": key, "task": args.task, "variant": name, "policy": repr(policy),
                      "budget": budget, "context": args.context, "n": args.n, "seed": args.seed,
                      "seconds": round(time.perf_counter() - t0, 2), "device": device_name(),
                      "torch": torch.__version__, **res.metrics, "outputs": res.outputs}
            append_record(out, record)
            score = (f"ROUGE-L {res.metrics['rouge_l']:.3f}" if args.task == "generation"
                     else f"{res.metrics.get('correct')}/{args.n}")
            print(f"{name:40s} {budget:4.2f} {score} ({record['seconds']} s)", flush=True)
    return 0


def report(out: Path, samples: list, context: int, n: int, seed: int) -> int:
    """Print, per recorded variant and budget, correct answers and near misses out of ``n``."""
    from evals import tasks
    from evals.sweep import read_records

    keys = [s.answer for s in samples]
    rows: dict[str, dict[float, str]] = {}
    full = "not recorded"
    for r in read_records(out):
        if (r["context"], r["n"], r.get("seed", 0)) != (context, n, seed):
            continue
        near = sum(tasks.near_miss(o, k) for o, k in zip(r["outputs"], keys, strict=True))
        if r["variant"] == "full":  # the full cache keeps everything at any budget
            full = f"{r['correct']} ({near})"
            continue
        rows.setdefault(r["variant"], {})[r["budget"]] = f"{r['correct']} ({near})"
    print(f"passkey, ~{context} tokens, {n} samples, seed {seed}: correct (near misses); "
          f"the full cache {full}")
    print_table(rows)
    return 0


def print_table(rows: dict[str, dict[float, str]]) -> None:
    """A markdown table: one row per variant, one column per budget."""
    budgets = sorted({b for cells in rows.values() for b in cells})
    print("| variant | " + " | ".join(f"{b:g}" for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for name, cells in rows.items():
        print(f"| `{name}` | " + " | ".join(cells.get(b, "") for b in budgets) + " |")


def report_generation(out: Path, context: int, n: int, seed: int) -> int:
    """Print, per recorded variant and budget, the mean ROUGE-L F1 against the full cache's summaries with
    its standard error over the samples, and how many summaries are identical to the full cache's."""
    import numpy as np

    from evals.sweep import read_records
    from evals.tasks import rouge_l

    records = [r for r in read_records(out) if (r["context"], r["n"], r.get("seed", 0)) == (context, n, seed)]
    refs = [r["outputs"] for r in records if r["variant"] == "full"]
    if not refs:
        print(f"{out}: no full-cache record for ~{context} tokens, {n} samples, seed {seed}")
        return 1
    rows: dict[str, dict[float, str]] = {}
    for r in records:
        if r["variant"] == "full":
            continue
        scores = np.array([rouge_l(o, ref) for o, ref in zip(r["outputs"], refs[-1], strict=True)])
        se = scores.std(ddof=1) / np.sqrt(len(scores)) if len(scores) > 1 else float("nan")
        exact = sum(o == ref for o, ref in zip(r["outputs"], refs[-1], strict=True))
        rows.setdefault(r["variant"], {})[r["budget"]] = f"{scores.mean():.2f} ± {se:.2f} ({exact})"
    print(f"generation agreement, ~{context} tokens, {n} samples, seed {seed}: mean ROUGE-L F1 against the "
          f"full cache's summary ± its standard error (summaries identical to the full cache's)")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
