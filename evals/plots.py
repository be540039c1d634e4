"""Figures and tables from a quality-sweep results file.

    python -m evals.plots evals/results/quality-full.jsonl [--outdir docs/figures]

writes ``passkey-<context>.png``, ``perplexity.png`` and ``generation.png`` (quality vs budget, one panel per
layer-budget policy, the full cache as a dashed line, like the H2O / SqueezeAttention figures) and prints
the markdown tables of docs/results.md.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evals.sweep import read_records

# (metric, label, higher is better) per task.
METRICS = {"passkey": ("accuracy", "passkey accuracy (exact match)", True),
           "perplexity": ("ppl", "perplexity", False),
           "generation": ("rouge_l", "ROUGE-L F1 vs full-cache output", True)}
PANELS = ("uniform", "squeeze", "pyramid", "minicache", "adakv", "squeeze+adakv", "pyramid+adakv")


def latest_ok(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The last ``"ok"`` record of every config key (perplexity rows get ``kv_fraction`` from their token
    counts when they lack it)."""
    out = {}
    for r in records:
        if r.get("status") != "ok":
            continue
        if "kv_fraction" not in r and r.get("kv_tokens_full"):
            r = {**r, "kv_fraction": round(r["kv_tokens"] / r["kv_tokens_full"], 4)}
        out[r["key"]] = r
    return out


def panel_of(policy: str) -> str:
    """Which figure panel a policy belongs to: its layer-budget policy, ``minicache``, or ``uniform``; with
    ``adakv`` head budgets, ``adakv`` after its layer-budget policy (``"squeeze+snapkv+adakv"`` ->
    ``"squeeze+adakv"``)."""
    parts = policy.split("+")
    panel = next((p for p in ("squeeze", "pyramid", "minicache") if p in parts), "uniform")
    if "adakv" in parts:
        return "adakv" if panel == "uniform" else f"{panel}+adakv"
    return panel


def eviction_of(policy: str) -> str:
    """The eviction part of a canonical policy name (``"squeeze+h2o+adakv"`` -> ``"h2o"``)."""
    rest = [p for p in policy.split("+")
            if p not in ("squeeze", "pyramid", "minicache", "uniform", "adakv")]
    return rest[0] if rest else "full"


def sample_counts(records: Sequence[dict[str, Any]], task: str, context: int) -> list[int]:
    """The sample counts ``n`` of one task and context's policy rows, the most used first (a sweep rerun
    with more samples is a different set of prompts, so each count gets its own table)."""
    ns = Counter(int(r.get("n", 1)) for r in latest_ok(records).values()
                 if r["task"] == task and r["context"] == context and r["policy"] != "full")
    return [n for n, _ in sorted(ns.items(), key=lambda kv: (-kv[1], -kv[0]))]


def series(records: Sequence[dict[str, Any]], task: str, context: int,
           n: int | None = None) -> tuple[float | None, dict[str, dict[float, dict[str, Any]]]]:
    """``(full-cache value, {policy: {budget: record}})`` for one task, context and sample count.

    ``n`` defaults to the policies' most used sample count; rows run on other counts (other prompts) are
    left out, so one table never mixes sample sets. When the full cache ran at several sample counts (a
    larger run for a tighter interval), the one compared against is the run on ``n`` samples."""
    metric = METRICS[task][0]
    if n is None:
        counts = sample_counts(records, task, context)
        n = counts[0] if counts else None
    fulls: dict[int, float] = {}
    out: dict[str, dict[float, dict[str, Any]]] = defaultdict(dict)
    for r in latest_ok(records).values():
        if r["task"] != task or r["context"] != context:
            continue
        if r["policy"] == "full":
            fulls[int(r.get("n", 1))] = float(r[metric])
        elif int(r.get("n", 1)) == n:
            out[r["policy"]][float(r["budget"])] = r
    if not fulls:
        return None, dict(out)
    return fulls.get(n if n is not None else max(fulls), fulls[max(fulls)]), dict(out)


def full_cache_table(records: Sequence[dict[str, Any]]) -> str:
    """Passkey accuracy of the full cache per context and sample count, with its 95% Wilson interval."""
    rows = sorted((int(r["context"]), int(r["n"]), r) for r in latest_ok(records).values()
                  if r["task"] == "passkey" and r["policy"] == "full")
    lines = ["| context | samples | accuracy | correct | 95% interval (Wilson) |", "|---|---|---|---|---|"]
    for ctx, n, r in rows:
        lo, hi = r.get("ci95", (float("nan"), float("nan")))
        lines.append(f"| ~{ctx} | {n} | {r['accuracy']:.2f} | {r['correct']}/{n} | [{lo:.2f}, {hi:.2f}] |")
    return "\n".join(lines)


def contexts(records: Sequence[dict[str, Any]], task: str) -> list[int]:
    return sorted({int(r["context"]) for r in latest_ok(records).values() if r["task"] == task})


def keeps_quality(value: float, full: float, higher_better: bool, frac: float = 0.95) -> bool:
    """Whether ``value`` keeps at least ``frac`` of the full cache's quality.

    For perplexity (lower is better) "keeping 95% of quality" is read as ``ppl <= full / 0.95``.
    """
    return value >= frac * full if higher_better else value <= full / frac


def smallest_budget(records: Sequence[dict[str, Any]], context: int, task: str = "passkey",
                    frac: float = 0.95, n: int | None = None) -> dict[str, tuple[float, float | None]]:
    """Per policy: the smallest measured budget at which it keeps ``frac`` of the full cache's quality on
    ``task`` at ``context`` (on ``n`` samples, see :func:`series`), with the KV fraction measured there;
    policies that never do are left out."""
    metric, _, higher = METRICS[task]
    full, by_policy = series(records, task, context, n)
    if full is None:
        return {}
    out: dict[str, tuple[float, float | None]] = {}
    for policy, rows in by_policy.items():
        for b in sorted(rows):
            if keeps_quality(float(rows[b][metric]), full, higher):
                out[policy] = (b, rows[b].get("kv_fraction"))
                break
    return out


# --- tables ----------------------------------------------------------------------------------------------

def _fmt(task: str, value: float) -> str:
    return f"{value:.2f}"


def markdown_table(records: Sequence[dict[str, Any]], task: str, context: int, n: int | None = None) -> str:
    """Policies × budgets of one task, context and sample count, the full-cache figure beside every row."""
    metric = METRICS[task][0]
    full, by_policy = series(records, task, context, n)
    budgets = sorted({b for rows in by_policy.values() for b in rows})
    head = ["policy", "full cache", *(f"{b:g}" for b in budgets)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = sorted(by_policy, key=lambda p: (PANELS.index(panel_of(p)), eviction_of(p)))
    full_s = "—" if full is None else _fmt(task, full)
    for p in order:
        cells = []
        for b in budgets:
            r = by_policy[p].get(b)
            if r is None:
                cells.append("")
                continue
            cell = _fmt(task, float(r[metric]))
            if task == "passkey":
                cell += f" ({r['correct']}/{r['n']})"
            cells.append(cell)
        lines.append("| " + " | ".join([p, full_s, *cells]) + " |")
    return "\n".join(lines)


def memory_table(records: Sequence[dict[str, Any]], task: str, context: int, n: int | None = None) -> str:
    """Measured KV bytes (fraction of the full cache's, at the longest point of the run) per budget."""
    _, by_policy = series(records, task, context, n)
    budgets = sorted({b for rows in by_policy.values() for b in rows})
    head = ["policy", *(f"{b:g}" for b in budgets)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in sorted(by_policy, key=lambda p: (PANELS.index(panel_of(p)), eviction_of(p))):
        cells = []
        for b in budgets:
            r = by_policy[p].get(b)
            cells.append("" if r is None or r.get("kv_fraction") is None else f"{r['kv_fraction']:.3f}")
        lines.append("| " + " | ".join([p, *cells]) + " |")
    return "\n".join(lines)


def head_budget_table(records: Sequence[dict[str, Any]], context: int, n: int | None = None) -> str:
    """Passkey answers of every ``...+adakv`` policy against the same policy with even head budgets, per
    budget, on the same ``n`` samples: how many pairs ``adakv`` makes better, worse or leaves, the correct
    answers summed over the pairs, and the best policy of each kind (``""`` if no pair was measured)."""
    _, by_policy = series(records, "passkey", context, n)
    rows = []
    for b in sorted({b for r in by_policy.values() for b in r}):
        pairs = []  # (even-head policy, its correct, +adakv policy, its correct)
        for p, rows_p in by_policy.items():
            even = p.removesuffix("+adakv")
            if even != p and b in rows_p and b in by_policy.get(even, {}):
                pairs.append((even, by_policy[even][b]["correct"], p, rows_p[b]["correct"]))
        if not pairs:
            continue
        better = sum(a > e for _, e, _, a in pairs)
        worse = sum(a < e for _, e, _, a in pairs)
        even_best = max(pairs, key=lambda t: (t[1], t[0]))
        ada_best = max(pairs, key=lambda t: (t[3], t[2]))
        rows.append(f"| {b:g} | {len(pairs)} | {better} / {worse} / {len(pairs) - better - worse} | "
                    f"{sum(t[1] for t in pairs)} -> {sum(t[3] for t in pairs)} | "
                    f"{even_best[0]} {even_best[1]} | {ada_best[2]} {ada_best[3]} |")
    if not rows:
        return ""
    head = ["| budget | pairs | `+adakv` better / worse / same | correct, summed: even -> `+adakv` | "
            "best of the even | best `+adakv` |", "|---|---|---|---|---|---|"]
    return "\n".join(head + rows)


def tables(records: Sequence[dict[str, Any]]) -> str:
    """All tables of a results file as markdown."""
    out = []
    for task in METRICS:
        for ctx in contexts(records, task):
            for n in sample_counts(records, task, ctx):
                label = METRICS[task][1]
                what = (f"{ctx} tokens of text" if task == "perplexity"
                        else f"~{ctx}-token prompts, {n} samples")
                out.append(f"### {task}: {label} — {what}\n\n" + markdown_table(records, task, ctx, n))
                if task == "passkey":
                    out.append(f"KV bytes kept (fraction of the full cache, measured) — passkey {ctx}, {n} "
                               "samples:\n\n" + memory_table(records, task, ctx, n))
    for ctx in contexts(records, "passkey"):
        counts = sample_counts(records, "passkey", ctx)
        paired = head_budget_table(records, ctx, counts[0] if counts else None)
        if paired:
            out.append(f"### Head budgets: `+adakv` against even heads — passkey, ~{ctx}-token prompts, "
                       f"{counts[0]} samples\n\n" + paired)
    if any(r["task"] == "passkey" and r["policy"] == "full" for r in latest_ok(records).values()):
        out.append("### Full-cache passkey accuracy\n\n" + full_cache_table(records))
    for task in ("passkey", "perplexity"):
        for ctx in contexts(records, task):
            counts = sample_counts(records, task, ctx)
            best = smallest_budget(records, ctx, task, n=counts[0] if counts else None)
            if not best:
                continue
            kept = "accuracy >= 0.95 x full" if task == "passkey" else "perplexity <= full / 0.95"
            lines = [f"| policy | smallest budget with {kept} | KV kept (measured) |", "|---|---|---|"]
            for p, (b, kv) in sorted(best.items(), key=lambda kv: (kv[1][0], kv[1][1] or 1.0, kv[0])):
                lines.append(f"| {p} | {b:g} | {'' if kv is None else f'{kv:.3f}'} |")
            out.append(f"### Smallest budget keeping 95% of full-cache quality — {task}, {ctx} tokens\n\n"
                       + "\n".join(lines))
    return "\n\n".join(out) + "\n"


# --- figures ---------------------------------------------------------------------------------------------

def plot_task(records: Sequence[dict[str, Any]], task: str, context: int, path: str | Path) -> Path | None:
    """One PNG: quality vs budget, a panel per layer-budget policy, a line per eviction policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, label, _ = METRICS[task]
    full, by_policy = series(records, task, context)
    if not by_policy:
        return None
    panels = [p for p in PANELS if any(panel_of(q) == p for q in by_policy)]
    evictions = sorted({eviction_of(p) for p in by_policy})
    colors = {e: plt.get_cmap("tab10")(i % 10) for i, e in enumerate(evictions)}
    cols = min(4, len(panels))  # at most four panels a row
    rows = -(-len(panels) // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), sharey=True, squeeze=False)
    axes = grid.reshape(1, -1)
    for ax in axes[0][len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes[0], panels):
        for p in sorted(q for q in by_policy if panel_of(q) == panel):
            pts = sorted(by_policy[p].items())
            ax.plot([b for b, _ in pts], [float(r[metric]) for _, r in pts], marker="o", ms=3,
                    color=colors[eviction_of(p)], label=eviction_of(p))
        if full is not None:
            ax.axhline(full, color="black", ls="--", lw=1, label="full cache")
        ax.set_title(panel if panel != "uniform" else "uniform (eviction alone)")
        ax.set_xlabel("KV budget (fraction)")
        ax.set_xlim(0, 1.05)
        if task == "perplexity":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for row in grid:
        row[0].set_ylabel(label)
    legend: dict[str, Any] = {}  # one entry per line label over all panels
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    fig.legend(list(legend.values()), list(legend), loc="center right", fontsize=8, frameon=False)
    what = f"{context}-token text" if task == "perplexity" else f"~{context}-token prompts"
    fig.suptitle(f"SmolLM2-135M-Instruct: {task}, {what}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.87, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_all(records: Sequence[dict[str, Any]], outdir: str | Path) -> list[Path]:
    """Every figure of a results file into ``outdir``; returns the paths written."""
    written = []
    for task in METRICS:
        ctxs = contexts(records, task)
        for ctx in ctxs:
            name = f"{task}-{ctx}.png" if task == "passkey" or len(ctxs) > 1 else f"{task}.png"
            p = plot_task(records, task, ctx, Path(outdir) / name)
            if p is not None:
                written.append(p)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals.plots", description=__doc__.splitlines()[0])
    ap.add_argument("results", help="JSONL results file from python -m evals")
    ap.add_argument("--outdir", default="docs/figures")
    ap.add_argument("--no-tables", action="store_true", help="only write the figures")
    args = ap.parse_args(argv)
    records = read_records(args.results)
    if not records:
        print(f"{args.results}: no records", file=sys.stderr)
        return 1
    for p in plot_all(records, args.outdir):
        print(f"wrote {p}", file=sys.stderr)
    if not args.no_tables:
        print(tables(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())

