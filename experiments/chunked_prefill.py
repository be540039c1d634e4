"""Chunked prefill with compression against compressing once at the end: passkey answers and peak KV.

``generate(..., chunk=N)`` prefills a prompt ``N`` tokens at a time and compresses after each chunk, so a
layer holds at most its budget plus one chunk (docs/usage.md, "A long prompt in chunks"); without ``chunk``
the whole prompt is prefilled and then compressed once. This study runs both on the sweep's passkey prompts
(``python -m evals``: same samples, prompt form with the question inside the prompt, greedy 8 tokens, exact
match of the first number), for each policy, budget and chunk size, and records every answer and the cache
report of a single-sequence run (its peak KV bytes: budget + one chunk, against the whole prompt).

Cost. Compressing once replays each prompt's recorded dense prefill (``evals.tasks.PrefillReplay``), so every
policy pays for it once. A chunked prefill cannot be replayed past its first chunk (later chunks attend to
the compressed cache, so their hidden states depend on the policy): the first chunk is replayed (recorded
once per prompt and chunk size; it is the dense prefill of the prompt's first ``N`` tokens) and every later
chunk runs the model (``prefill(start=)``, the extension path). ``--chunk-n`` runs the chunked configs on
a subset of the prompts spread over the needle depths (every ``n / chunk-n``-th sample); the report compares
them with compressing once on the same subset.

One JSON line per (context, policy, budget, chunk) appended to ``--out``; a rerun skips the keys already
there. ``--report`` prints the markdown table of docs/results.md ("Chunked prefill") and runs nothing.

Run: ``python -m experiments.chunked_prefill --contexts 1024,2048 --n 24 --chunk-n 8 --chunks 512,128``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

SETTING = "snapkv(chunk=5, window=16, per_head=False, align='scores')"
PROFILE_SETTING = f"profile+{SETTING}"  # the README's passkey setting, layer budgets from retrieval_profile
POLICIES = ("snapkv", "h2o", "tova", "streaming", PROFILE_SETTING)
OUT = Path("experiments/results/chunked-prefill.jsonl")


def _replay_class() -> Any:
    from evals.tasks import PrefillReplay

    class ChunkReplay(PrefillReplay):
        """:class:`~evals.tasks.PrefillReplay` that also continues sequences: a prefill from position 0 of a
        recorded token list (a whole prompt, or a prompt's first chunk) is replayed; any other prefill (a
        later chunk, ``start > 0``) runs the wrapped model on the compressed cache."""

        def prefill(self, tokens: torch.Tensor, cache: Any, b: int, *, start: int = 0,
                    last_only: bool = False, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
            if start == 0 and tuple(tokens.tolist()) not in self._store:  # a first chunk not recorded
                return self.model.prefill(tokens, cache, b, last_only=last_only, on_layer=on_layer)
            return super().prefill(tokens, cache, b, start=start, last_only=last_only, on_layer=on_layer)

    return ChunkReplay


def spread(n: int, k: int) -> list[int]:
    """``k`` of the sample indices ``0 .. n-1``, evenly spread (the samples' needle depths are
    ``(i + 0.5) / n``, so the subset covers every depth band)."""
    if not 1 <= k <= n:
        raise ValueError(f"--chunk-n={k} must be in [1, n={n}]")
    return sorted({int(i * n / k) for i in range(k)})


def config_key(context: int, n: int, policy: str, budget: float, chunk: int | None, seed: int) -> str:
    return f"passkey|ctx={context}|n={n}|{policy}|{budget:g}|chunk={chunk or 'once'}|seed={seed}"


def make_policy(name: str, budget: float, seed: int, model: Any, profiles: dict[str, Any]) -> Any:
    from kvpolicies import compose

    if name == PROFILE_SETTING:
        if "w" not in profiles:
            from kvmodels.profile import retrieval_profile

            profiles["w"] = retrieval_profile(model, floor=0.25)
        return compose(("profile", {"weights": profiles["w"]}), SETTING, budget=budget, seed=seed)
    return compose(name, budget=budget, seed=seed)


def run_config(replay: Any, tokenizer: Any, samples: Sequence[Any], policy: Any, chunk: int | None,
               batch: int) -> tuple[list[str], dict[str, Any]]:
    """Greedy passkey answers of ``samples``: the first alone (its cache report is the single-sequence
    peak), then ``batch`` at a time. Outputs do not depend on the batch (each sequence has its own pages)."""
    from evals.tasks import PASSKEY_NEW_TOKENS
    from kvmodels.decoder import Decoder
    from kvmodels.generate import generate

    outputs: list[str] = []
    memory: dict[str, Any] = {}
    parts = [samples[:1]] + [samples[i:i + batch] for i in range(1, len(samples), batch)]
    for part in parts:
        prompts = [list(s.prompt) for s in part]
        if chunk is None:
            res = generate(replay, prompts, PASSKEY_NEW_TOKENS, policy, eos_ids=tokenizer.eos_ids)
        else:
            # generate() sizes the page tables for the longest prompt, and the Decoder refuses a chunk
            # whose budget + chunk exceeds that (0.5 of ~1k with chunk=512), although a layer never holds
            # more than the tokens seen: widen them by one chunk. The peak is the pages used, not the width.
            dec = Decoder(replay, policy, max_tokens=max(map(len, prompts)) + PASSKEY_NEW_TOKENS + chunk)
            dec.extend(prompts, chunk=chunk, max_new_tokens=PASSKEY_NEW_TOKENS)
            res = dec.generate(PASSKEY_NEW_TOKENS, eos_ids=tokenizer.eos_ids, final=True)
        outputs += [tokenizer.decode(t, skip_special_tokens=True) for t in res.tokens]
        if not memory:
            rep = res.report
            memory = {"kv_peak_bytes": rep.peak_bytes, "kv_bytes": rep.total_bytes,
                      "kv_bytes_full": rep.full_cache_bytes, "prompt_tokens_first": len(part[0].prompt)}
    return outputs, memory


def main(argv: Sequence[str] | None = None, runner: Any = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.chunked_prefill",
                                description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,2048", help="passkey prompt lengths, comma-separated")
    p.add_argument("--n", type=int, default=24, help="passkey samples per context (the sweep's, seed --seed)")
    p.add_argument("--chunk-n", type=int, default=0, help="samples the chunked configs run on, spread over "
                   "the n (0: all n)")
    p.add_argument("--once-n", type=int, default=0, help="samples compressing once runs on (0: all n; "
                   "otherwise the chunked subset, which the report compares against)")
    p.add_argument("--no-once", action="store_true", help="run only the chunked configs (compressing once "
                   "is cheap, replayed: run it after them)")
    p.add_argument("--policies", default=";".join(POLICIES), help="';'-separated compose names")
    p.add_argument("--budgets", default="0.2,0.5", help="fractions of the prompt, or ints: tokens per layer")
    p.add_argument("--chunks", default="512,128", help="chunk sizes, comma-separated (run in this order)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8, help="sequences per generate call after the first")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--deadline-min", type=float, default=0.0, help="stop starting configs after this many "
                   "minutes (0: none); finished ones are recorded, a rerun continues")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--report", action="store_true", help="print the recorded results and run nothing")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.report:
        print(report(out))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    from evals.sweep import Runner, append_record, device_name, read_records

    t_start = time.perf_counter()
    done = {r["key"] for r in read_records(out)}
    policies = args.policies.split(";")
    budgets = [int(b) if b.isdigit() else float(b) for b in args.budgets.split(",")]  # int: tokens
    chunks = [int(c) for c in args.chunks.split(",") if c]
    runner = runner or Runner(seed=args.seed)
    replay = _replay_class()(runner.model)
    profiles: dict[str, Any] = {}
    for context in [int(c) for c in args.contexts.split(",")]:
        samples = runner.samples("passkey", context, args.n)
        sub = spread(args.n, args.chunk_n or args.n)
        once_idx = list(range(args.n)) if args.once_n == 0 else sub
        plan: list[tuple[str, float, int | None, list[int]]] = \
            [] if args.no_once else [(pol, b, None, once_idx) for b in budgets for pol in policies]
        plan += [(pol, b, c, sub) for c in chunks for b in budgets for pol in policies]
        todo = [cfg for cfg in plan
                if config_key(context, args.n, cfg[0], cfg[1], cfg[2], args.seed) not in done]
        if not todo:
            continue
        # Record each prompt's dense prefill (compress once) and each chunk size's first chunk.
        t0 = time.perf_counter()
        needed: dict[tuple[int, ...], None] = {}
        for _, _, c, idx in todo:
            for i in idx:
                prompt = samples[i].prompt
                needed[prompt if c is None else prompt[:c]] = None
        replay.record([list(k) for k in needed])
        print(f"~{context}: recorded {len(needed)} prefills in {time.perf_counter() - t0:.1f} s", flush=True)
        for pol, budget, chunk, idx in todo:
            if args.deadline_min and time.perf_counter() - t_start > 60 * args.deadline_min:
                print(f"deadline of {args.deadline_min} min reached; rerun to continue", flush=True)
                return 0
            key = config_key(context, args.n, pol, budget, chunk, args.seed)
            t0 = time.perf_counter()
            policy = make_policy(pol, budget, args.seed, runner.model, profiles)
            part = [samples[i] for i in idx]
            outputs, memory = run_config(replay, runner.tokenizer, part, policy, chunk, args.batch)
            from evals.tasks import exact_match

            right = [exact_match(o, s.answer) for o, s in zip(outputs, part, strict=True)]
            record = {"key": key, "task": "passkey", "context": context, "n": args.n, "policy": pol,
                      "budget": budget, "chunk": chunk, "seed": args.seed, "samples": idx,
                      "answers": [s.answer for s in part], "depths": [round(s.depth, 4) for s in part],
                      "outputs": outputs, "right": right, "correct": sum(right), "n_run": len(part),
                      "prompt_tokens": round(sum(len(s.prompt) for s in part) / len(part), 1), **memory,
                      "seconds": round(time.perf_counter() - t0, 2), "device": device_name(),
                      "model": getattr(runner, "model_name", type(runner.model).__name__),
                      "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            append_record(out, record)
            print(f"~{context} {pol} @{budget:g} chunk={chunk or 'once'}: {sum(right)}/{len(part)}, peak "
                  f"{memory['kv_peak_bytes'] / 2**20:.1f} MiB ({record['seconds']} s)", flush=True)
    return 0


def report(out: Path) -> str:
    """Markdown: per context, answers per policy x budget for once (all samples, and the chunked subset)
    and each chunk size; then the single-sequence peak KV per chunk size."""
    from evals.sweep import read_records

    recs = read_records(out)
    lines: list[str] = []
    for context in sorted({r["context"] for r in recs}):
        rows = [r for r in recs if r["context"] == context]
        chunks = sorted({r["chunk"] for r in rows if r["chunk"] is not None}, reverse=True)
        subsets = {tuple(r["samples"]) for r in rows if r["chunk"] is not None}
        sub = sorted(subsets, key=len)[0] if subsets else None
        n = rows[0]["n"]
        whole = any(r["chunk"] is None and r["n_run"] == n for r in rows)  # once on all n samples
        split = sub is not None and len(sub) < n  # chunked on a subset: once on the same samples too
        head = ["policy", "budget"] + ([f"once ({n})"] if whole else [])
        if split:
            head.append(f"once ({len(sub)})")
        head += [f"chunk={c} ({len(sub) if sub else n})" for c in chunks]
        lines += [f"~{context} tokens (prompts of {rows[0]['prompt_tokens']:.0f} tokens on average):", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        cells: dict[tuple[str, float], dict[Any, dict[str, Any]]] = {}
        for r in rows:
            cells.setdefault((r["policy"], r["budget"]), {})[r["chunk"]] = r
        order = {p: i for i, p in enumerate(POLICIES)}
        for (pol, budget), by in sorted(cells.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 99))):
            row = [f"`{pol}`", f"{budget:g}"]
            once = by.get(None)
            if whole:
                row.append(f"{once['correct']}/{once['n_run']}" if once and once["n_run"] == n else "")
            if split:
                if once and set(sub) <= set(once["samples"]):
                    pick = {i: ok for i, ok in zip(once["samples"], once["right"])}
                    row.append(f"{sum(pick[i] for i in sub)}/{len(sub)}")
                else:
                    row.append("")
            for c in chunks:
                r = by.get(c)
                row.append(f"{r['correct']}/{r['n_run']}" if r else "")
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", f"Peak KV of one ~{context}-token prompt (MiB; cache report's peak, full cache "
                  f"{rows[0]['kv_bytes_full'] / 2**20:.1f} MiB):", "",
                  "| policy | budget | held at the end | once | " +
                  " | ".join(f"chunk={c}" for c in chunks) + " |",
                  "|---|---|---|---|" + "---|" * len(chunks)]
        for (pol, budget), by in sorted(cells.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 99))):
            def mib(r: dict[str, Any] | None, field: str = "kv_peak_bytes") -> str:
                return f"{r[field] / 2**20:.1f}" if r else ""
            any_r = next(iter(by.values()))
            lines.append(f"| `{pol}` | {budget:g} | {mib(any_r, 'kv_bytes')} | {mib(by.get(None))} | " +
                         " | ".join(mib(by.get(c)) for c in chunks) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
