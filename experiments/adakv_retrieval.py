"""Where Ada-KV's lost passkey digits went: the key attention of the heads that copy the key into the answer,
with even head budgets, with Ada-KV's, and with one selection shared by a layer's heads (``per_head=False``).

For each passkey prompt (the evaluation's samples, SmolLM2-135M) that the full cache answers, the full
cache's own greedy answer is appended to the prompt and run densely (teacher forcing). For each row that
predicts one of the answer's key digits, every (layer, KV head) has attention probabilities on the key's
digit tokens in the prompt (the mean over the query heads of its group). Their sum over rows is the head's
*key attention*; the heads that carry most of it are the ones that copy the key (retrieval heads).

Then SnapKV's prompt selection (``compose("snapkv")``'s scores) keeps ``B`` tokens per head (even), Ada-KV's
per-head counts (``compose("snapkv", "adakv")``), or ``B`` tokens by the heads' mean score in every head
(``shared``: ``snapkv(per_head=False)``). Reported per budget (``*_even``, ``*_adakv``, ``*_shared``):

* ``key_attention_kept_*``: the share of all key attention that falls on key tokens the selection keeps
  (summed over heads and rows; 1.0 = every head can still read every digit it read with the full cache);
* ``top_heads_whole_key_*``: the share of each prompt's top-``--top`` heads by key attention that keep all key
  digits;
* ``top_heads_budget_adakv``: the mean Ada-KV budget of those heads, in units of ``B``;
* per prompt, whether even and Ada-KV selections answer correctly (greedy, through ``generate``), so the
  kept key attention can be compared between the prompts Ada-KV loses and the others.

Run: ``python -m experiments.adakv_retrieval --context 1024 --n 24``. One JSON line per budget.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

from experiments.adakv_imbalance import kept, key_span  # the same selection rule and key locator


def key_attention(model, tokens: list[int], rows: list[int], key: list[int]) -> torch.Tensor:
    """``[n_layers, Hkv, len(key)]`` float64: per layer, KV head and key position, the attention probability
    the query rows ``rows`` put on it, summed over rows, averaged over each KV head's query heads."""
    from kvkernels import prefill_attention

    class Recorder:  # receives the dense prefill as a cache would, and keeps each layer's key attention
        def __init__(self) -> None:
            self.mass: list[torch.Tensor] = []

        def prefill_attend(self, l, b, q, k, v, positions, *, scale):
            G = q.shape[1] // k.shape[1]
            logits = torch.einsum("rhd,jhd->hrj", q[rows].double(),
                                  k.double().repeat_interleave(G, dim=1)) * scale  # [Hq, R, L]
            future = torch.arange(q.shape[0])[None, :] > torch.tensor(rows)[:, None]  # [R, L]
            p = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
            self.mass.append(p[:, :, key].sum(dim=1).view(k.shape[1], G, len(key)).mean(dim=1))
            return prefill_attention(q, k, v, scale=scale)[0]

        def observe(self, l, b, h_in, attn_out):
            pass

    rec = Recorder()
    model.prefill(torch.tensor(tokens), rec, 0, last_only=True)
    return torch.stack(rec.mass)


def _mean(values) -> float | None:
    values = list(values)
    return statistics.mean(values) if values else None


def main(argv: list[str] | None = None) -> int:
    from evals.sweep import Runner, device_name
    from evals.tasks import exact_match
    from kvkernels import prefill_attention, prefill_scores
    from kvmodels.generate import generate
    from kvpolicies import compose

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--budgets", default="0.2,0.5")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="experiments/results/adakv-retrieval.jsonl")
    args = p.parse_args(argv)
    runner = Runner(seed=args.seed)
    model, tok = runner.model, runner.tokenizer
    samples = runner.samples("passkey", args.context, args.n)
    snap = compose("snapkv", budget=0.2).eviction
    shared = compose("snapkv(per_head=False)").eviction  # ranks by the heads' mean of snap's scores
    ada = compose("snapkv", "adakv")

    class SnapScorer:  # receives the dense prefill as a cache would; keeps SnapKV's prompt scores per layer
        def __init__(self) -> None:
            self.layers: list[torch.Tensor] = []  # [Hkv, L]

        def prefill_attend(self, l, b, q, k, v, positions, *, scale):
            sc = prefill_scores(q, k, scale=scale, mode="accumulate", window=snap.prefill_window(q.shape[0]))
            self.layers.append(snap.postprocess_prefill_scores(sc))
            return prefill_attention(q, k, v, scale=scale)[0]

        def observe(self, l, b, h_in, attn_out):
            pass

    def answers(policy) -> list[list[int]]:
        out = []
        for i in range(0, len(samples), 8):
            out += generate(model, [list(s.prompt) for s in samples[i:i + 8]], 8, policy,
                            eos_ids=tok.eos_ids).tokens
        return out

    with torch.no_grad():
        full = answers(compose("full"))
        # (L, SnapKV scores per layer, key positions, key attention [layers, Hkv, digits], sample)
        per_prompt = []
        for s, ans in zip(samples, full, strict=True):
            if not exact_match(tok.decode(ans, skip_special_tokens=True), s.answer):
                continue
            prompt = list(s.prompt)
            key = key_span(tok, prompt, s.answer)
            digits = [prompt[j] for j in key]
            start = next(i for i in range(len(ans)) if ans[i:i + len(digits)] == digits)
            rows = [len(prompt) + start + d - 1 for d in range(len(digits))]  # each predicts one digit
            mass = key_attention(model, prompt + ans, rows, key)

            scorer = SnapScorer()
            model.prefill(torch.tensor(prompt), scorer, 0, last_only=True)
            per_prompt.append((len(prompt), scorer.layers, key, mass, s))
        for budget in [float(b) for b in args.budgets.split(",")]:
            right = {name: [exact_match(tok.decode(a, skip_special_tokens=True), s.answer)
                            for a, s in zip(answers(compose(name, budget=budget)), samples, strict=True)]
                     for name in ("snapkv", "snapkv+adakv", "snapkv(per_head=False)")}
            answered = {id(s): i for i, s in enumerate(samples)}
            kept_even, kept_ada, kept_shared, top_even, top_ada, top_shared = [], [], [], [], [], []
            top_budget, rows_out = [], []
            for L, layers, key, mass, s in per_prompt:
                B = math.ceil(budget * L)
                window = min(snap.prefill_window(L), B)
                share = {"even": 0.0, "adakv": 0.0, "shared": 0.0}
                whole = {"even": [], "adakv": [], "shared": []}  # per (layer, head): keeps every key digit
                budgets = []
                for l, sc in enumerate(layers):
                    n = ada.head_budgets(sc, B, 0, window)
                    budgets += (n.double() / B).tolist()
                    mean = shared.eviction_scores(sc, head_dim=0)  # what per_head=False ranks by
                    for name, counts, by in (("even", torch.full_like(n, B), sc), ("adakv", n, sc),
                                             ("shared", torch.full_like(n, B), mean)):
                        keep = kept(by, counts, window)[:, key]  # [Hkv, digits]
                        whole[name] += keep.all(1).tolist()
                        share[name] += float((mass[l] * keep.double()).sum())  # on the digits it keeps
                total = float(mass.sum())
                flat = mass.sum(dim=2).flatten()  # [layers * Hkv]: each head's key attention
                top = flat.argsort(descending=True)[:args.top].tolist()
                kept_even.append(share["even"] / total)
                kept_ada.append(share["adakv"] / total)
                kept_shared.append(share["shared"] / total)
                top_even.append(statistics.mean(whole["even"][h] for h in top))
                top_ada.append(statistics.mean(whole["adakv"][h] for h in top))
                top_shared.append(statistics.mean(whole["shared"][h] for h in top))
                top_budget.append(statistics.mean(budgets[h] for h in top))
                i = answered[id(s)]
                rows_out.append({"even_right": right["snapkv"][i], "adakv_right": right["snapkv+adakv"][i],
                                 "shared_right": right["snapkv(per_head=False)"][i],
                                 "key_attention_kept_shared": round(kept_shared[-1], 4),
                                 "key_attention_kept_even": round(kept_even[-1], 4),
                                 "key_attention_kept_adakv": round(kept_ada[-1], 4),
                                 "top_head_share_of_key_attention": round(float(flat[top].sum()) / total, 4)})
            lost = [r for r in rows_out if r["even_right"] and not r["adakv_right"]]
            record = {"context": args.context, "n": args.n, "seed": args.seed, "budget": budget,
                      "top": args.top, "prompts_full_cache_answers": len(per_prompt),
                      "key_attention_kept_even": statistics.mean(kept_even),
                      "key_attention_kept_adakv": statistics.mean(kept_ada),
                      "key_attention_kept_shared": statistics.mean(kept_shared),
                      "top_heads_whole_key_even": statistics.mean(top_even),
                      "top_heads_whole_key_adakv": statistics.mean(top_ada),
                      "top_heads_whole_key_shared": statistics.mean(top_shared),
                      "top_heads_budget_adakv": statistics.mean(top_budget),
                      "prompts_adakv_loses": len(lost),
                      "lost_key_attention_kept_even": _mean(r["key_attention_kept_even"] for r in lost),
                      "lost_key_attention_kept_adakv": _mean(r["key_attention_kept_adakv"] for r in lost),
                      "prompts": rows_out, "device": device_name(), "torch": torch.__version__}
            print(json.dumps({k: v for k, v in record.items() if k != "prompts"}), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
