"""bench/vllm_passkey.py --smoke: on the real bundled model (SmolLM2-135M-Instruct, converted from its GGUF),
vLLM with the plugin answers four ~512-token passkey prompts token for token as kvmodels' ``generate`` does
with the same policy (the library's best uniform retrieval setting, and ``h2o`` evicting by score while
decoding), plain vLLM as kvmodels' full cache does, and each compressed request holds the blocks of its kept
tokens. Three engines one after the other, about a minute on 2 cores."""

from __future__ import annotations

import json
import math

from conftest import run_bench_smoke
from kvpolicies import compose
from kvpolicies.vllm import kept_lengths


def test_real_model_answers_equal_kvmodels(tmp_path):
    run_bench_smoke("vllm_passkey.py", tmp_path, timeout=600)
    report = json.loads((tmp_path / "vllm-passkey.json").read_text())
    s = report["setting"]
    budget = s["budget"]
    assert list(report["engines"]) == ["plain"] + [f"{p} {budget}" for p in s["policies"]]
    bs = s["block_size"]
    for name, engine in report["engines"].items():
        assert engine["manager"] == ("FullAttentionManager" if name == "plain" else "CompressingManager")
        policy = compose("full") if name == "plain" else compose(name.rsplit(" ", 1)[0], budget=budget)
        for context in s["contexts"]:
            x = engine["contexts"][str(context)]
            assert len(x["tokens"]) == s["n"] and all(len(t) == s["new_tokens"] for t in x["tokens"])
            assert x["same_as_kvmodels"] == s["n"], (name, x["answers"])
            assert x["correct"] == x["kvmodels_correct"]
            # the first step past the prompt caches token L + 1; the blocks the scheduler gave that step
            for L, held in zip(x["prompt_lengths"], x["blocks"]):
                dropped = 0 if name == "plain" else kept_lengths(policy, L).dropped(L)
                assert held == math.ceil((L + 1 - dropped) / bs), (name, L, held)
                assert name == "plain" or dropped > 0
    # the setting keeps answers the full cache gives: not a run where every engine is wrong
    assert report["engines"]["plain"]["contexts"][str(s["contexts"][0])]["correct"] >= s["n"] - 1
