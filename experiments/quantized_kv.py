"""Quantized KV rows in the paged cache (issue 36), measured on SmolLM2-135M-Instruct (CPU).

Every kept token is stored as a packed ``kvkernels.quant`` row (``kivi(bits, group, residual=0)``: codes plus
a float16 scale and zero point per ``group`` channels, token-wise for keys and values) and the decode steps
attend over the dequantized rows; the prompt's own attention runs on the unquantized K/V (as KIVI does).

Tasks (one JSON line per (task, config, budget), appended to ``--out``; a rerun skips lines already there):

* ``passkey``: the evaluation harness's passkey prompts (``evals.tasks.passkey_samples``, ~``--context``
  tokens, ``--n`` samples), **question inside the compressed prompt**, greedy, exact match of the first
  number; ``bytes_per_token``: the K/V bytes the cache holds after the prompt over the tokens it holds,
  beside an unquantized float16 cache's (the pages' position and score bytes included in both).
* ``perplexity``: ``evals.tasks.run_perplexity`` over the first ``--ppl-tokens`` tokens of the harness's
  text: the first ``--ppl-prefill`` tokens prefilled (unquantized attention, quantized storage), the rest
  teacher-forced one decode step each, every step reading the quantized rows. With ``full`` nothing is
  evicted (quantization alone); with ``streaming`` each layer keeps ``budget * ppl-tokens`` tokens, evicting
  while it decodes; with ``h2o`` each layer keeps the tokens of most accumulated attention, its scores updated
  by every decode step's attention over the quantized rows (the score update fused into the quantized decode).

Run: ``python -m experiments.quantized_kv --out experiments/results/quantized-kv.jsonl``;
``--report`` prints the tables and runs nothing.

Issue 36's table, one run per prompt length, beside transformers' ``QuantizedCache`` on the same prompts::

    python -m experiments.quantized_kv --set table --tasks passkey --context 2048 \
        --out experiments/results/quantized-kv-table.jsonl
    python -m experiments.quantized_baseline --length 2048 --tasks passkey   # in the backend's venv
    python -m experiments.quantized_kv --set table --report --context 2048 \
        --out experiments/results/quantized-kv-table.jsonl
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

SNAPKV = "snapkv(chunk=5, window=16, per_head=False, align='scores')"  # the README's passkey setting
SCORER = "snapkv(window=1024)"  # every prompt query votes: accumulated attention for zipcache, no eviction
KIVI2 = "kivi(bits=2, group=16, residual=0)"
PASSKEY = [("full", 1.0), ("full+kivi(bits=4, residual=0)", 1.0), (f"full+{KIVI2}", 1.0), ("full+kivi", 1.0),
           ("full+kivi(bits=2)", 1.0), (f"{SCORER}+zipcache", 1.0),
           (f"{SCORER}+zipcache(high=4, low=2, salient=0.2, group=16)", 1.0)]
# ZipCache's channel-separable keys (kvkernels.quant.key_channel_scale) on the 2-bit settings above
PASSKEY += [(f"full+{KIVI2[:-1]}, channel_scale=True)", 1.0), ("full+kivi(bits=2, channel_scale=True)", 1.0),
            (f"{SCORER}+zipcache(channel_scale=True)", 1.0)]
PASSKEY += [(p, b) for b in (0.2, 0.5)
            for p in (SNAPKV, f"{SNAPKV}+kivi(bits=4, residual=0)", f"{SNAPKV}+mikv")]
# One scale and zero point per 64 channels (a whole head of SmolLM2) instead of 32: 4.5 bits per value
PASSKEY += [(f"{SNAPKV}+kivi(bits=4, group=64, residual=0)", b) for b in (0.2, 0.5)]
# Hadamard-rotated rows (rotate=True, kvkernels.quant.hadamard_rotation: RotateKV's / QuaRot's fix for outlier
# channels, row-wise so eviction still moves each token alone)
ROT2 = "kivi(bits=2, residual=0, rotate=True)"
PASSKEY += [(f"full+{KIVI2[:-1]}, rotate=True)", 1.0), (f"full+{ROT2}", 1.0),
            (f"{SCORER}+zipcache(rotate=True)", 1.0)]
PASSKEY += [(f"{SNAPKV}+{ROT2}", b) for b in (0.2, 0.5)]
PASSKEY += [(f"{SNAPKV}+kivi(bits=4, group=64, residual=0, rotate=True)", b) for b in (0.2, 0.5)]
# ZipCache's mixed 4 / 2 bits under the passkey setting's eviction, plain and rotated (2.8 bits a value)
PASSKEY += [(f"{SNAPKV}+zipcache{z}", b) for z in ("", "(rotate=True)") for b in (0.2, 0.5)]
PASSKEY += [(f"{SNAPKV}+zipcache(group=64, rotate=True)", 0.2)]
# MiKV while decoding: what H2O evicts moves to the low bits (SideRegion.demote)
PASSKEY += [("h2o", 0.2), ("h2o+mikv(low=4)", 0.2), ("h2o+mikv", 0.2)]
# ZipCache while decoding: re-compressed every 100 tokens, H2O evicting its low bits (SideRegion.recompress)
PASSKEY += [("h2o+zipcache", 0.2), ("h2o+zipcache(rotate=True)", 0.2)]
# Issue 36's table in one run per prompt length (``--set table``): each format alone and composed with the
# passkey setting at 0.2 and 0.5, the most telling rows first (a run cut short keeps them). "Alone": KIVI with
# its residual of 128 float tokens and without one, its best 2-bit row (rotated, group 16), ZipCache over
# every prompt query's votes, MiKV over H2O (its paper's eviction, the dropped tokens at 2 bits).
ROT2G16 = f"{KIVI2[:-1]}, rotate=True)"
TABLE = [("full", 1.0), (SNAPKV, 0.2), (f"{SNAPKV}+kivi(bits=4, residual=0)", 0.2),
         (f"{SNAPKV}+zipcache(rotate=True)", 0.2), ("full+kivi", 1.0), ("full+kivi(bits=4, residual=0)", 1.0),
         ("full+kivi(bits=2)", 1.0), (f"full+{ROT2G16}", 1.0), (f"{SCORER}+zipcache(rotate=True)", 1.0),
         ("h2o", 0.2), ("h2o+mikv", 0.2), (f"{SNAPKV}+mikv", 0.2), (f"{SNAPKV}+{ROT2G16}", 0.2)]
TABLE += [(p, 0.5) for p in (SNAPKV, f"{SNAPKV}+kivi(bits=4, residual=0)", f"{SNAPKV}+zipcache(rotate=True)",
                             f"{SNAPKV}+mikv", f"{SNAPKV}+{ROT2G16}")]
SETS = {"all": PASSKEY, "table": TABLE}
PERPLEXITY = [("full", 1.0), ("full+kivi(bits=4, residual=0)", 1.0), ("full+kivi", 1.0),
              (f"full+{KIVI2}", 1.0), ("streaming", 0.2), ("streaming+kivi(bits=4, residual=0)", 0.2),
              ("h2o", 0.2), ("h2o+kivi(bits=4, residual=0)", 0.2),  # h2o: scores fused over packed rows
              ("full+kivi(bits=4, residual=0, rotate=True)", 1.0), (f"full+{KIVI2[:-1]}, rotate=True)", 1.0),
              ("h2o+mikv(low=4)", 0.2), ("h2o+zipcache", 0.2), ("h2o+zipcache(rotate=True)", 0.2),
              ("h2o+zipcache(every=10)", 0.2), (f"{SCORER}+zipcache", 1.0),
              (f"{SCORER}+zipcache(rotate=True)", 1.0)]
# QuantizedCache's settings, as the library stores them (keys per token in both; float16 parameters here,
# float32 there): its defaults (4 bits, group 64, residual 128) and 2 bits at groups 32 and 64; MiKV at 2 bits
PERPLEXITY += [("full+kivi(group=64)", 1.0), ("full+kivi(bits=2)", 1.0), ("full+kivi(bits=2, group=64)", 1.0),
               ("h2o+mikv", 0.2)]


def fp16_share(rep, model) -> dict:
    """A cache report's bytes per (token, layer) slot (K and V of every KV head plus the int32 position and
    float32 score per head), and the held bytes as a share of the same cache's unquantized: at the model's
    dtype (``held_vs_full_same_dtype``; an unquantized cache's share at any dtype) and at float16
    (``held_vs_fp16``). Page rounding included in both."""
    layout = model.cache_layout()
    elt = next(iter(model.parameters())).element_size()
    fp16_slot = layout.n_kv_heads * (2 * 2 * layout.head_dim + 8)
    native_slot = layout.n_kv_heads * (2 * layout.head_dim * elt + 8)  # the full cache's slots
    fp16_full = rep.full_cache_bytes / native_slot * fp16_slot
    return {"slot_bytes": rep.page_bytes / rep.page_size, "fp16_slot_bytes": fp16_slot, "rows": rep.rows,
            "held_vs_full_same_dtype": rep.total_bytes / rep.full_cache_bytes,
            "held_vs_fp16": rep.total_bytes / fp16_full}


def run_passkey(runner, name: str, budget: float, context: int, n: int) -> dict:
    """Answers kept, and the bytes of the first batch's cache after its prompts: per (token, layer) slot
    (K and V of every KV head plus the int32 position and float32 score per head), the held share of an
    unquantized float16 cache's bytes (page rounding included in both)."""
    from evals.tasks import exact_match
    from kvmodels.generate import generate
    from kvpolicies import compose

    policy = compose(name, budget=budget)
    samples = runner.samples("passkey", context, n)
    correct, outputs, mem = 0, [], {}
    for i in range(0, n, 8):
        chunk = samples[i:i + 8]
        res = generate(runner.model, [list(s.prompt) for s in chunk], 8, policy,
                       eos_ids=runner.tokenizer.eos_ids)
        for toks, s in zip(res.tokens, chunk, strict=True):
            text = runner.tokenizer.decode(toks, skip_special_tokens=True)
            outputs.append(text)
            correct += exact_match(text, s.answer)
        if not mem:
            mem = fp16_share(res.report, runner.model)
    return {"correct": correct, "n": n, **mem, "outputs": outputs}


def run_ppl(runner, name: str, budget: float, T: int, prefill: int) -> dict:
    from evals.tasks import run_perplexity
    from kvpolicies import compose

    policy = compose(name, budget=1.0)
    keep = T if budget >= 1.0 else max(prefill, round(budget * T))
    if not policy.eviction.decode_evict:
        # full (and a prompt-only scorer at budget 1) never evicts: prefill `prefill` tokens, decode the
        # rest, all kept (zipcache re-compressing them every `every`)
        keep = prefill
    tokens = runner.text_tokens(T)
    (row,) = run_perplexity(runner.model, tokens, policy, [keep])
    return {**row, "prefill_tokens": keep}


def table(records: list[dict]) -> str:
    lines = ["| task | policy | budget | result | bytes per token and layer (fp16 cache) |",
             "|---|---|---|---|---|"]
    for r in records:
        if r["task"] == "passkey":
            res = f"{r['correct']} of {r['n']}"
            b = (f"{r['slot_bytes']:.0f} ({r['fp16_slot_bytes']:.0f}); held "
                 f"{100 * r['held_vs_fp16']:.1f}% of fp16")
        else:
            res = f"ppl {r['ppl']:.2f}"
            b = "-"
        lines.append(f"| {r['task']} {r['context']} | `{r['policy']}` | {r['budget']:g} | {res} | {b} |")
    return "\n".join(lines)


def side_by_side(records: list[dict], baseline: list[dict], context: int, seed: int = 0) -> str:
    """Issue 36's table at one prompt length: the library's ``TABLE`` rows and transformers'
    ``QuantizedCache`` rows (``experiments/quantized_baseline.py``'s records) on the same passkey prompts,
    each with how many of its own full cache's answers it keeps. The prompts' answers come from the
    baseline's records (the same harness prompts: ``passkey_samples`` at the same seed and length); every
    library count is checked against them, so a record of other prompts is refused rather than compared."""
    from evals.tasks import exact_match, kept_answers
    from experiments.quantized_baseline import CONFIGS

    base = {r["config"]: r for r in baseline if r.get("task") == "passkey" and r["context"] == context
            and r.get("seed", 0) == seed}
    if "full" not in base:
        raise ValueError(f"no QuantizedCache baseline record at context {context}: run "
                         f"experiments.quantized_baseline --length {context} --tasks passkey first")
    answers = base["full"]["answers"]
    ours = {(r["policy"], r["budget"]): r for r in records
            if r.get("task") == "passkey" and r["context"] == context and r.get("status") == "ok"
            and f"|seed={seed}|" in r["key"] and r["n"] == len(answers)}

    def right(outputs: list[str]) -> list[bool]:
        return [exact_match(o, a) for o, a in zip(outputs, answers, strict=True)]

    for r in ours.values():
        if sum(right(r["outputs"])) != r["correct"]:
            raise ValueError(f"{r['policy']!r} at {context}: its outputs do not score {r['correct']} against "
                             "the baseline's answers; the two runs drew different prompts")
    lines = [f"| cache | budget | passkey ~{context} (of {len(answers)}) | of its full cache's answers | "
             "held vs fp16 |", "|---|---|---|---|---|"]

    def kept(mine: list[bool], full: list[bool]) -> str:
        n, extra = kept_answers(full, mine)
        return f"{n} of {sum(full)}" + (f" (+{extra})" if extra else "")

    full = right(ours[("full", 1.0)]["outputs"]) if ("full", 1.0) in ours else None
    for name, budget in TABLE:
        r = ours.get((name, budget))
        if r is None:
            lines.append(f"| `{name}` | {budget:g} | not run | | |")
            continue
        k = kept(right(r["outputs"]), full) if full else "-"
        lines.append(f"| `{name}` | {budget:g} | {r['correct']} | {k} | {100 * r['held_vs_fp16']:.1f}% |")
    qfull = base["full"]["right"]
    for name in CONFIGS:
        r = base.get(name)
        if r is None:
            continue
        label = "QuantizedCache " + ("off (`DynamicCache`, fp32)" if name == "full" else
                                     f"{r['nbits']} bits, group {r['q_group_size']}, residual "
                                     f"{r['residual_length']}")
        lines.append(f"| {label} | 1 | {r['correct']} | {kept(r['right'], qfull)} | "
                     f"{100 * r['vs_fp16']:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results/quantized-kv.jsonl")
    p.add_argument("--context", type=int, default=1024)  # the harness's ~1k: the baseline's prompts
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--ppl-prefill", type=int, default=128)
    p.add_argument("--tasks", default="passkey,perplexity")
    p.add_argument("--set", default="all", choices=sorted(SETS),
                   help="passkey configs: every one recorded so far, or issue 36's table (one run a length)")
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--reverse", action="store_true", help="run the configs last to first (a second process)")
    p.add_argument("--only", help="run only the configs whose policy text is one of these ('|'-separated)")
    p.add_argument("--report", action="store_true", help="print the recorded table and run nothing (with "
                   "--set table: beside QuantizedCache's records at --context)")
    p.add_argument("--baseline", help="QuantizedCache's records for --set table's report (default: "
                   "experiments/results/quantized-baseline.jsonl)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from evals.sweep import append_record, device_name, read_records

    out = Path(args.out)
    if args.report:
        records = [r for r in read_records(out) if r.get("status") == "ok"]
        if args.set == "table":
            from experiments.quantized_baseline import DEFAULT_OUT

            print(side_by_side(records, read_records(args.baseline or DEFAULT_OUT), args.context, args.seed))
        else:
            print(table(records))
        return 0
    from evals.sweep import Runner

    runner = Runner(args.model, seed=args.seed)
    done = {r["key"] for r in read_records(out)}
    todo = []
    if "passkey" in args.tasks:
        todo += [("passkey", args.context, name, b) for name, b in SETS[args.set]]
    if "perplexity" in args.tasks:
        todo += [("perplexity", args.ppl_tokens, name, b) for name, b in PERPLEXITY]
    if args.only:
        todo = [t for t in todo if t[2] in args.only.split("|")]
    for task, context, name, budget in (todo[::-1] if args.reverse else todo):
        key = (f"quantized-kv|{runner.model_name}|{task}|{context}|n={args.n}|seed={args.seed}|{name}|"
               f"{budget:g}")
        if key in done:
            continue
        t0 = time.perf_counter()
        base = {"key": key, "task": task, "context": context, "policy": name, "budget": budget,
                "device": device_name(), "torch": torch.__version__,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            if task == "passkey":
                res = run_passkey(runner, name, budget, context, args.n)
            else:
                res = run_ppl(runner, name, budget, context, args.ppl_prefill)
            rec = {**base, "status": "ok", **res}
        except (ValueError, RuntimeError) as e:
            rec = {**base, "status": "error", "error": f"{type(e).__name__}: {e}"}
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        append_record(out, rec)
        summary = rec.get("correct", rec.get("ppl", rec.get("error")))
        print(f"{task} {name} {budget:g}: {summary} ({rec['seconds']} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
