"""How unequal Ada-KV's head-adaptive budgets are on a real model, and what they would cost in today's
paged layout (docs/design-adakv.md).

For each passkey prompt (the evaluation's samples, SmolLM2-135M) and each layer: SnapKV's prompt scores per
KV head (observation window 32, max-pooling 7, as ``compose("snapkv")`` computes them), then Ada-KV's
selection: the layer keeps ``Hkv * B`` tokens chosen by one top-k over all heads' scores (after a floor of
``alpha * B`` tokens per head, the observation window forced in every head), instead of ``B`` per head. The
per-head counts ``n_h`` are reported as ``max_h n_h / B``: in today's layout, where a page holds every KV
head of ``S`` slots and a layer's length is one number per sequence, the layer would need ``max_h n_h``
slots for every head (the rest empty), i.e. that factor more pages than uniform budgets. Also reported: how
many of the uniform top-``B`` tokens Ada-KV moves between heads. Writes one JSON line per (budget, alpha).
Run: ``python bench/adakv_imbalance.py --context 1024 --n 24``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch


def adakv_counts(scores: torch.Tensor, budget: int, forced_recent: int, alpha: float) -> torch.Tensor:
    """``[Hkv]`` tokens each head keeps: the last ``forced_recent`` in every head, a floor of
    ``floor(alpha * budget)`` best per head, the rest of ``Hkv * budget`` by one top-k across heads."""
    H, L = scores.shape
    if budget >= L:
        return torch.full((H,), L)
    keep = torch.zeros(H, L, dtype=torch.bool)
    keep[:, L - forced_recent:] = True
    floor = max(int(alpha * budget), forced_recent)
    s = scores.masked_fill(keep, float("inf"))
    top = s.topk(floor, dim=1).indices
    keep.scatter_(1, top, True)
    rest = H * budget - int(keep.sum())
    if rest > 0:
        flat = scores.masked_fill(keep, float("-inf")).flatten()
        keep.view(-1)[flat.topk(rest).indices] = True
    return keep.sum(1)


def main(argv: list[str] | None = None) -> int:
    from kvkernels import prefill_scores
    from kvmodels.eval.sweep import Runner, device_name
    from kvpolicies import compose

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--budgets", default="0.1,0.2,0.5")
    p.add_argument("--alphas", default="0.2,0.5")
    p.add_argument("--out", default="bench/results/adakv-imbalance.jsonl")
    args = p.parse_args(argv)
    runner = Runner()
    samples = runner.samples("passkey", args.context, args.n)
    runner.replay.record([list(s.prompt) for s in samples])
    snap = compose("snapkv", budget=0.2).eviction
    class Scorer:  # receives a replayed prefill as a cache would, and keeps SnapKV's prompt scores
        def __init__(self) -> None:
            self.layers: list[torch.Tensor] = []  # [Hkv, L] per layer

        def prefill_layer(self, l, b, q, k, v, positions, *, scale, alibi_slopes=None, lse=None):
            window = snap.prefill_window(q.shape[0])
            sc = prefill_scores(q, k, scale=scale, mode="accumulate", window=window, lse=lse)
            self.layers.append(snap.postprocess_prefill_scores(sc))

        def record_cos_sim(self, l, b, value):
            pass

    per_prompt = []  # [(L, [layer scores [Hkv, L]])]
    for s in samples:
        scorer = Scorer()
        runner.replay.prefill(torch.tensor(list(s.prompt)), scorer, 0, last_only=True)
        per_prompt.append((len(s.prompt), scorer.layers))
    for budget in [float(b) for b in args.budgets.split(",")]:
        for alpha in [float(a) for a in args.alphas.split(",")]:
            factors, moved = [], []
            for L, layers in per_prompt:
                B = math.ceil(budget * L)
                window = min(snap.prefill_window(L), B)
                for sc in layers:
                    n = adakv_counts(sc, B, window, alpha)
                    factors.append(float(n.max()) / B)
                    moved.append(float((n - B).abs().sum()) / 2 / (sc.shape[0] * B))
            record = {"context": args.context, "n": args.n, "budget": budget, "alpha": alpha,
                      "max_over_uniform_mean": statistics.mean(factors),
                      "max_over_uniform_p90": sorted(factors)[int(0.9 * len(factors))],
                      "max_over_uniform_max": max(factors), "moved_fraction_mean": statistics.mean(moved),
                      "device": device_name(), "torch": torch.__version__}
            print(json.dumps(record), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
