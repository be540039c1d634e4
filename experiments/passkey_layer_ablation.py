"""Which layers' prompt selection loses a passkey answer: one prompt, compressed in every layer but one, and
in one layer only (docs/results.md, "Where the last ~4k answer at 0.5 is lost").

The sample is the evaluation's own (``runner.samples("passkey", context, n)[sample]``, SmolLM2-135M, greedy,
question inside the prompt, replayed prefill). ``LayerAblated`` is the composed policy with some layers'
budgets raised to the whole sequence (prompt + new tokens), so those layers keep everything and the others
keep exactly what the policy keeps (the budgets of the other layers are the policy's own, unchanged).
One JSON line per run: the layers kept whole, the answer, and whether it is the key; appended to ``--out``.

Run: ``python -m experiments.passkey_layer_ablation --context 4096 --seed 2 --sample 5 --budget 0.5 \\
"snapkv(chunk=5, window=16, per_head=False, align='scores')"``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from kvpolicies.compose import ComposedPolicy


@dataclasses.dataclass(frozen=True, repr=False)
class LayerAblated(ComposedPolicy):
    """``ComposedPolicy`` whose layers in ``whole`` keep the whole sequence (budget = capacity)."""

    whole: frozenset[int] = frozenset()

    def layer_budgets(self, budget_tokens: torch.Tensor, n_layers: int, stats=None,
                      capacity: torch.Tensor | None = None) -> torch.Tensor:
        budgets = super().layer_budgets(budget_tokens, n_layers, stats, capacity=capacity)
        if capacity is None:
            raise ValueError("LayerAblated needs the sequence capacity to keep a layer whole")
        budgets = torch.as_tensor(budgets).clone()
        for layer in self.whole:
            budgets[layer] = torch.as_tensor(capacity).to(budgets.dtype)
        return budgets


def ablated(policy: ComposedPolicy, whole: set[int]) -> LayerAblated:
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    return LayerAblated(**fields, whole=frozenset(whole))


def main(argv: list[str] | None = None) -> int:
    from evals import tasks
    from evals.sweep import Runner, append_record, device_name

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("policy", help="the composed policy by name, parameters inside the name")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=int, required=True, help="index of the prompt among the n samples")
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--modes", default="none,all,restore,only",
                   help="none: every layer compressed; all: none compressed; restore: every layer but one "
                        "compressed, for each layer; only: one layer compressed, for each layer")
    p.add_argument("--out", default="experiments/results/passkey-layer-ablation.jsonl")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = Runner(seed=args.seed)
    samples = runner.samples("passkey", args.context, args.n)
    if not 0 <= args.sample < len(samples):
        raise SystemExit(f"--sample must be in [0, {len(samples)}), got {args.sample}")
    sample = samples[args.sample]
    runner.replay.record([list(sample.prompt)])
    policy = runner.policy(args.policy, args.budget)
    n_layers = runner.replay.n_cache_layers
    layers = set(range(n_layers))
    runs: list[set[int]] = []
    for mode in args.modes.split(","):
        if mode == "none":
            runs.append(set())
        elif mode == "all":
            runs.append(set(layers))
        elif mode == "restore":
            runs += [{layer} for layer in range(n_layers)]
        elif mode == "only":
            runs += [layers - {layer} for layer in range(n_layers)]
        else:
            raise SystemExit(f"--modes: unknown mode {mode!r}; use none, all, restore or only")
    out = Path(args.out)
    for whole in runs:
        t0 = time.perf_counter()
        res = tasks.run_passkey(runner.replay, runner.tokenizer, [sample], ablated(policy, whole),
                                batch_size=1)
        record = {"policy": repr(policy), "budget": args.budget, "context": args.context, "n": args.n,
                  "seed": args.seed, "sample": args.sample, "key": sample.answer,
                  "whole_layers": sorted(whole), "compressed_layers": sorted(layers - whole),
                  "output": res.outputs[0], "correct": res.metrics["correct"],
                  "seconds": round(time.perf_counter() - t0, 2), "device": device_name(),
                  "torch": torch.__version__}
        append_record(out, record)
        print(f"layers kept whole {record['whole_layers']}: {res.outputs[0]!r} "
              f"{'ok' if res.metrics['correct'] else 'MISS'} ({record['seconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
