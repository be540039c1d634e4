"""Run one vLLM engine on token-id prompts and write what the tests compare: greedy tokens and the block
accounting after every engine step. One process per engine: vLLM loads its plugins once per process, so a
policy (``KVPOLICIES_VLLM_POLICY``) is fixed for the process's life.

    python tests_vllm/vllm_job.py JOB.json OUT.json

``JOB.json``: ``{"model": DIR, "prompts": [[ids], ...], "max_tokens": n, "engine": {LLM kwargs}}``.
``OUT.json``: ``{"tokens": [[ids], ...], "steps": [...], "block_size": bs, "num_blocks": n, "seconds": t}``;
each step lists the free blocks and, per running request, ``[prompt_len, num_computed_tokens, blocks held]``;
``"preempted"``: how many times each preempted request was preempted. ``"request_policies"``: per prompt,
the ``extra_args`` of its ``SamplingParams`` (``{"kvpolicies": spec}``: its own policy) or None.
``"generate": true``: only the tokens, through ``LLM.generate`` (the engine core may then run in its own
process, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``). ``"preempt": {"i": n}`` in the job preempts request ``i``
once, between steps, as soon as it has ``n`` tokens cached (vLLM's own ``Scheduler._preempt_request``: its
blocks are freed and it is recomputed from its first token).
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    engine_kwargs = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32,
                         enable_prefix_caching=False, max_model_len=512, seed=0)
    engine_kwargs.update(job.get("engine", {}))
    llm = LLM(model=job["model"], **engine_kwargs)
    boot = time.perf_counter() - started
    own = job.get("request_policies") or [None] * len(job["prompts"])  # {"kvpolicies": spec} or None
    if job.get("generate"):  # tokens only, through LLM.generate: the engine core may run in its own process
        params = [SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True,
                                 extra_args=extra) for extra in own]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
        with open(out_path, "w") as f:
            json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outs], "boot_seconds": boot}, f)
        return
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    kv = scheduler.kv_cache_manager
    manager = kv.coordinator.single_type_managers[0]
    for i, (ids, extra) in enumerate(zip(job["prompts"], own)):
        params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True,
                                extra_args=extra)
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    tokens: dict[str, list[int]] = {}
    steps = []
    preempted: dict[str, int] = {}  # request id -> times preempted
    force = {str(i): int(n) for i, n in job.get("preempt", {}).items()}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        for req in list(scheduler.running):
            at = force.get(req.request_id.split("-")[0])
            if at is not None and req.num_computed_tokens >= at:
                del force[req.request_id.split("-")[0]]
                scheduler.running.remove(req)
                scheduler._preempt_request(req, time.monotonic())
        held = {rid: [req.num_prompt_tokens, req.num_computed_tokens, len(manager.req_to_blocks.get(rid, []))]
                for rid, req in scheduler.requests.items()}
        for rid, req in scheduler.requests.items():
            if req.num_preemptions:
                preempted[rid] = max(preempted.get(rid, 0), req.num_preemptions)
        steps.append({"free": kv.block_pool.get_num_free_blocks(), "requests": held})
    result = {
        "tokens": [tokens[str(i)] for i in range(len(job["prompts"]))],
        "steps": steps,
        "preempted": preempted,
        "block_size": manager.block_size,
        "num_blocks": kv.block_pool.num_gpu_blocks,
        "manager": type(manager).__name__,
        "boot_seconds": boot,
        "generate_seconds": time.perf_counter() - t0,
    }
    from kvpolicies.vllm import backend

    result["kept"] = {f"{rid}|{layer}": pos.tolist() for (rid, layer), pos in backend.KEPT.items()}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
