"""bench/vllm_savings.py --smoke: the savings benchmark runs end to end on vLLM's CPU build and reports what
vLLM did: with ``streaming`` at 0.2 each request holds the blocks of its kept tokens after prefill (fewer
than plain vLLM's, which holds its whole prompt), and in the same pool the scheduler runs more requests at
once. Two engines side by side, about 30 s on 2 cores."""

from __future__ import annotations

import json
import math

from conftest import run_bench_smoke
from kvpolicies import compose
from kvpolicies.vllm import prompt_budget


def test_smoke_run_reports_fewer_blocks_and_more_concurrency(tmp_path):
    run_bench_smoke("vllm_savings.py", tmp_path, timeout=300)
    report = json.loads((tmp_path / "vllm-savings.json").read_text())
    table = (tmp_path / "vllm-savings.md").read_text()
    s = report["setting"]
    assert set(report["engines"]) == {"plain", "streaming 0.2"}
    plain, ours = report["engines"]["plain"], report["engines"]["streaming 0.2"]
    assert plain["manager"] == "FullAttentionManager" and ours["manager"] == "CompressingManager"
    assert plain["usable_blocks"] == ours["usable_blocks"] == s["pool"]  # the same fixed pool

    # Blocks after prefill: every request holds its prompt plus the first generated token (plain), or its
    # kept tokens plus that token (the plugin); the pool's count is their sum.
    L, bs = s["L"], s["block_size"]
    kept = prompt_budget(compose("streaming", budget=0.2), L)[0]
    for result, slots in ((plain, L + 1), (ours, kept + 1)):
        after = result["prefill"]["after_prefill"]
        assert after["per_request"] == [math.ceil(slots / bs)] * s["K"]
        assert after["used"] == s["K"] * math.ceil(slots / bs)
    assert ours["prefill"]["after_prefill"]["used"] < plain["prefill"]["after_prefill"]["used"]

    # The oversubscribed batch: all of it done, and more requests running at once in the same pool.
    for b in s["batches"]:
        for result in (plain, ours):
            o = result[b["name"]]
            assert o["generated_tokens"] == b["M"] * b["G"] and o["wall_seconds"] > 0
            assert len(o["series"]["running"]) == o["engine_steps"] and max(o["series"]["used"]) <= s["pool"]
            assert max(o["series"]["running"]) == o["max_running"] >= o["max_decoding"] > 0
        assert plain[b["name"]]["max_running"] <= s["pool"] // math.ceil(L / bs)  # whole prompts in the pool
        assert ours[b["name"]]["max_running"] > plain[b["name"]]["max_running"], b["name"]
    assert "| plain |" in table and "| streaming 0.2 |" in table
