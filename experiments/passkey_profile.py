"""Passkey retrieval with layer budgets from the model's retrieval profile (``profile`` budget policy, weights
from ``kvmodels.profile.retrieval_profile``) against the same eviction with uniform layer budgets.

The eviction is the passkey setting of docs/results.md, ``snapkv(chunk=5, window=16, per_head=False,
align='scores')``. Its confident misses at budget 0.2 are lost in layers 7 and 8 ("Where the confident misses
are lost"), which on SmolLM2-135M are two of its echo-head layers; the profile, measured on random tokens
once, moves budget towards such layers and away from layers without retrieval heads.

Same samples, prompts, replayed prefills and scoring as ``python -m evals``. The prompts are
prefilled and replayed ``--batch`` at a time (a third of the memory of recording all 24 at ~4k; each batch
is generated exactly as one ``generate`` call of the sweep), and a config's record is written when all its
batches are done. One JSON line per (variant, budget, context, seed), appended to ``--out``; a rerun skips
the lines already there. ``--report`` prints, per context, how many of the full cache's answers (recorded in
``experiments/results/passkey-variants.jsonl``) each variant keeps, per seed and pooled.

Run: ``python -m experiments.passkey_profile --context 2048 --seeds 0,1,2,3,4 --budgets 0.2,0.5``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

SETTING = "snapkv(chunk=5, window=16, per_head=False, align='scores')"
# variant name -> the profile's floor (None: uniform layer budgets; "full": the full cache)
VARIANTS: dict[str, float | str | None] = {
    "full": "full",
    "uniform": None,
    "profile floor=0.25": 0.25,
    "profile floor=0.1": 0.1,
}
FULL_RECORDS = Path("experiments/results/passkey-variants.jsonl")  # the full cache's answers, seeds 0-4


def main(argv: list[str] | None = None) -> int:
    from evals import tasks
    from evals.sweep import Runner, append_record, device_name, read_records
    from kvmodels.profile import retrieval_profile
    from kvpolicies import compose

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--seeds", default="0")
    p.add_argument("--budgets", default="0.2,0.5")
    p.add_argument("--variants", default="uniform;profile floor=0.25", help="';'-separated names of VARIANTS")
    p.add_argument("--evictions", default=SETTING, help="';'-separated eviction policies the variants set "
                   "the layer budgets of (default: the passkey setting)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--batch", type=int, default=8, help="prompts recorded and generated at a time")
    p.add_argument("--out", default="experiments/results/passkey-profile.jsonl")
    p.add_argument("--report", action="store_true", help="print the recorded results and run nothing")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.report:
        return report(out)
    done = {r["key"] for r in read_records(out)}
    names = args.variants.split(";")
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {name!r}; known: {list(VARIANTS)}")
    budgets = [float(b) for b in args.budgets.split(",")]
    for seed in [int(s) for s in args.seeds.split(",")]:
        runner = Runner(seed=seed)
        configs = {}
        for eviction in args.evictions.split(";"):
            tag = "" if eviction == SETTING else f"|eviction={eviction}"  # the setting keeps its first keys
            for name in names:
                full = VARIANTS[name] == "full"
                for budget in budgets if not full else [1.0]:
                    key = (f"passkey|ctx={args.context}|n={args.n}|{name}|{budget:g}|seed={seed}"
                           f"{'' if full else tag}")
                    if key not in done:
                        configs[key] = (name, budget, "full" if full else eviction)
        if not configs:
            continue
        policies = {}
        profiles: dict[float, tuple[float, ...]] = {}  # measured once per floor (deterministic)
        for key, (name, budget, eviction) in configs.items():
            floor = VARIANTS[name]
            if floor == "full":
                policies[key] = compose("full", seed=runner.seed)
            elif floor is None:
                policies[key] = compose(eviction, budget=budget, seed=runner.seed)
            else:
                floor = float(floor)
                if floor not in profiles:
                    profiles[floor] = retrieval_profile(runner.model, floor=floor)
                policies[key] = compose(("profile", {"weights": profiles[floor]}), eviction,
                                        budget=budget, seed=runner.seed)
        samples = runner.samples("passkey", args.context, args.n)
        outputs: dict[str, list[str]] = {key: [] for key in configs}
        seconds = dict.fromkeys(configs, 0.0)
        for start in range(0, len(samples), args.batch):
            part = samples[start:start + args.batch]
            runner.replay.record([list(s.prompt) for s in part])
            for key, policy in policies.items():
                t0 = time.perf_counter()
                res = tasks.run_passkey(runner.replay, runner.tokenizer, part, policy, batch_size=args.batch)
                seconds[key] += time.perf_counter() - t0
                outputs[key] += res.outputs
        for key, (name, budget, eviction) in configs.items():
            correct = sum(tasks.exact_match(o, s.answer) for o, s in zip(outputs[key], samples, strict=True))
            record = {"key": key, "task": "passkey", "variant": name, "eviction": eviction,
                      "policy": repr(policies[key]),
                      "budget": budget, "context": args.context, "n": args.n, "seed": seed,
                      "correct": correct, "answers": [s.answer for s in samples], "outputs": outputs[key],
                      "seconds": round(seconds[key], 2), "device": device_name(), "torch": torch.__version__}
            append_record(out, record)
            print(f"seed {seed} {eviction} {name:20s} {budget:4.2f} {correct}/{args.n} "
                  f"({record['seconds']} s)", flush=True)
    return 0


def report(out: Path) -> int:
    """Per context and budget: of the answers the full cache gets right, how many each variant keeps (per
    seed, then pooled), and the answers it gets that the full cache does not."""
    from evals.sweep import read_records
    from evals.tasks import exact_match, kept_answers

    records = read_records(out)
    full = {(r["context"], r["n"], r.get("seed", 0)): r["outputs"] for r in read_records(FULL_RECORDS)
            if r["variant"] == "full"}
    full.update({(r["context"], r["n"], r["seed"]): r["outputs"] for r in records if r["variant"] == "full"})
    rows: dict[tuple[int, str, float, str], list[tuple[int, str]]] = {}  # cell -> (seed, its count)
    pooled: dict[tuple[int, str, float, str], list[int]] = {}
    for r in records:
        if r["variant"] == "full":
            continue
        ref = full.get((r["context"], r["n"], r["seed"]))
        if ref is None:
            print(f"{r['key']}: no full-cache record; run the variant 'full' for this seed")
            continue
        right_full = [exact_match(o, a) for o, a in zip(ref, r["answers"], strict=True)]
        right = [exact_match(o, a) for o, a in zip(r["outputs"], r["answers"], strict=True)]
        kept, extra = kept_answers(right_full, right)
        cell = (r["context"], r.get("eviction", SETTING), r["budget"], r["variant"])
        plus = f" +{extra}" if extra else ""
        rows.setdefault(cell, []).append((r["seed"], f"seed {r['seed']}: {kept}/{sum(right_full)}{plus}"))
        tally = pooled.setdefault(cell, [0, 0, 0])
        tally[0] += kept
        tally[1] += sum(right_full)
        tally[2] += extra
    print("| context | eviction | budget | layer budgets | full cache's answers kept, pooled "
          "| per seed (+ answers the full cache misses) |")
    print("|---|---|---|---|---|---|")
    for cell in sorted(rows):
        kept, total, extra = pooled[cell]
        per_seed = [text for _, text in sorted(rows[cell])]
        print(f"| ~{cell[0]} | `{cell[1]}` | {cell[2]:g} | `{cell[3]}` | {kept} of {total} "
              f"({kept / total:.0%}){f' +{extra}' if extra else ''} | {'; '.join(per_seed)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
