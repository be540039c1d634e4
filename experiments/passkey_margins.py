"""How sure the full cache is of each passkey answer: the probability of every digit of the key,
teacher-forced, with the runner-up token's (docs/results.md, "Where the last ~4k answer at 0.5 is lost").

For each sample of the evaluation's passkey task (SmolLM2-135M, question inside the prompt, answer prefix
"The pass key is"), the prompt followed by the key's tokens (" 68669.") is prefilled densely once; the record
holds, for each answer position, the probability of the key's token and of the most likely other token. The
weakest digit (smallest margin) says how close the full cache itself came to a wrong answer; a compressed
cache perturbs every logit a little, so prompts with a thin margin are the first it loses. One JSON line per
sample, appended to ``--out``; a rerun skips the samples already there.

Run: ``python -m experiments.passkey_margins --context 4096 --n 24 --seed 2``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


class _Dense:
    """The cache a dense prefill needs: attention over the whole sequence, nothing kept."""

    def prefill_attend(self, l, b, q, k, v, positions, *, scale):
        from kvkernels import prefill_attention

        return prefill_attention(q, k, v, scale=scale)[0]

    def observe(self, l, b, h_in, attn_out):
        pass


def teacher_forced(model, prompt: list[int], answer: list[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                          torch.Tensor]:
    """The full cache's probabilities of ``answer`` after ``prompt``, teacher-forced (one dense prefill).

    Returns ``(p_key, p_other, other)``, each ``[len(answer)]``: the probability of each answer token given
    the prompt and the answer tokens before it, and the most likely *other* token and its probability.
    ``p_key > p_other`` at every position iff greedy decoding of ``prompt`` produces ``answer``.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([*prompt, *answer], device=device)
    with torch.no_grad():
        logits = model.prefill(ids, _Dense(), 0, last_only=False)
    # logits[t] predicts token t + 1: the answer's tokens are predicted by the rows before them.
    probs = torch.softmax(logits[len(prompt) - 1:-1].float(), dim=-1)  # [len(answer), V]
    target = torch.tensor(answer, device=device)
    p_key = probs.gather(1, target[:, None])[:, 0]
    p_other, other = probs.scatter(1, target[:, None], 0.0).max(dim=1)
    return p_key, p_other, other


def main(argv: list[str] | None = None) -> int:
    from evals.sweep import Runner, append_record, device_name, read_records

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated sample indices (default: all)")
    p.add_argument("--out", default="experiments/results/passkey-margins.jsonl")
    p.add_argument("--report", metavar="VARIANT", help="run nothing; print, for VARIANT's records in "
                   "--variants-file, the full cache's weakest margin on each prompt the variant misses and "
                   "the full cache answers, against the margins of the prompts it keeps")
    p.add_argument("--variants-file", default="experiments/results/passkey-variants.jsonl")
    args = p.parse_args(argv)
    if args.report:
        return report(Path(args.out), Path(args.variants_file), args.report)
    if args.threads:
        torch.set_num_threads(args.threads)
    only = {int(i) for i in args.only.split(",") if i}
    out = Path(args.out)
    done = {(r["context"], r["n"], r["seed"], r["sample"]) for r in read_records(out)}
    runner = Runner(seed=args.seed)
    tok = runner.tokenizer
    with torch.no_grad():
        for i, s in enumerate(runner.samples("passkey", args.context, args.n)):
            if (only and i not in only) or (args.context, args.n, args.seed, i) in done:
                continue
            t0 = time.perf_counter()
            answer = tok.encode(f" {s.answer}.", add_special_tokens=False)  # " ", digits, "." (one each)
            p_key, p_other, other = teacher_forced(runner.model, list(s.prompt), answer)
            margin = p_key - p_other
            digits = [j for j, t in enumerate(answer) if tok.decode([t]).isdigit()]
            weakest = min(digits, key=lambda j: float(margin[j]))
            last = answer[-1] if margin[-1] > 0 else int(other[-1])  # greedy's token at the "." position
            record = {"context": args.context, "n": args.n, "seed": args.seed, "sample": i, "key": s.answer,
                      "depth": s.depth, "prompt_tokens": len(s.prompt),
                      "tokens": [tok.decode([t]) for t in answer],
                      "p_key": [round(float(x), 4) for x in p_key],
                      "runner_up": [tok.decode([int(t)]) for t in other],
                      "p_runner_up": [round(float(x), 4) for x in p_other],
                      "weakest_digit": digits.index(weakest),
                      "weakest_margin": round(float(margin[weakest]), 4),
                      # greedy decoding gives the key iff every digit (and the space before it) is the
                      # argmax and no digit follows the last one
                      "full_answers": bool((margin[:-1] > 0).all())
                      and not tok.decode([last]).strip().isdigit(),
                      "seconds": round(time.perf_counter() - t0, 2), "device": device_name(),
                      "torch": torch.__version__}
            append_record(out, record)
            print(f"{i:3d} {s.answer} weakest digit {record['weakest_digit']}: p {float(p_key[weakest]):.3f} "
                  f"vs {record['runner_up'][weakest]!r} {float(p_other[weakest]):.3f}", flush=True)
    return 0


def report(margins_file: Path, variants_file: Path, variant: str, thin: float = 0.3) -> int:
    """Misses of ``variant`` among the prompts the full cache answers, with the full cache's margins; then,
    per budget, the answers it keeps among the prompts whose weakest margin is below ``thin``, and above."""
    from evals.sweep import read_records
    from evals.tasks import exact_match

    margins = {(r["context"], r["seed"], r["sample"]): r for r in read_records(margins_file)}
    variants = read_records(variants_file)
    agree = total = 0  # the teacher-forced verdict against the full cache's recorded greedy answers
    for r in variants:
        if r["variant"] == "full":
            for i, out in enumerate(r["outputs"]):
                m = margins.get((r["context"], r.get("seed", 0), i))
                if m is not None and r["n"] == m["n"]:
                    total += 1
                    agree += exact_match(out, m["key"]) == m["full_answers"]
    print(f"full_answers agrees with the full cache's recorded greedy answer on {agree} of {total} prompts")
    print(f"`{variant}`: prompts the full cache answers; its weakest digit's margin (p(key) - p(runner-up))")
    print("| context | budget | seeds | kept: n, median margin, smallest | lost: key -> answer (margin) |")
    print("|---|---|---|---|---|")
    rows: dict[tuple[int, float], list] = {}
    for r in variants:
        if r["variant"] != variant or r["n"] != 24:
            continue
        rows.setdefault((r["context"], r["budget"]), []).append(r)
    buckets: dict[float, dict[bool, list[int]]] = {}  # budget -> thin? -> [kept, of]
    for (context, budget), records in sorted(rows.items()):
        kept, lost, seeds = [], [], []
        for r in sorted(records, key=lambda r: r.get("seed", 0)):
            seed = r.get("seed", 0)
            keys = [(context, seed, i) for i in range(r["n"])]
            if not all(k in margins for k in keys):
                continue  # margins not measured for every prompt of this seed
            found = [margins[k] for k in keys]
            seeds.append(seed)
            for m, out in zip(found, r["outputs"], strict=True):
                if not m["full_answers"]:
                    continue
                cell = buckets.setdefault(budget, {True: [0, 0], False: [0, 0]})[m["weakest_margin"] < thin]
                cell[0] += exact_match(out, m["key"])
                cell[1] += 1
                if exact_match(out, m["key"]):
                    kept.append(m["weakest_margin"])
                else:
                    answer = out.strip().split(".")[0][:8]
                    lost.append(f"seed {seed}: {m['key']} -> {answer} ({m['weakest_margin']:.2f})")
        if not seeds:
            continue
        kept.sort()
        median = kept[len(kept) // 2] if kept else float("nan")
        print(f"| ~{context} | {budget:g} | {', '.join(map(str, seeds))} | {len(kept)}, {median:.2f}, "
              f"{kept[0] if kept else float('nan'):.2f} | {'; '.join(lost) or '-'} |")
    for budget, cells in sorted(buckets.items()):
        print(f"budget {budget:g}, all lengths: margin < {thin:g}: {cells[True][0]} of {cells[True][1]} "
              f"kept; >= {thin:g}: {cells[False][0]} of {cells[False][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
