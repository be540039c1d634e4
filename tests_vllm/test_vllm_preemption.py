"""Requests that fill ``max_model_len`` exactly, and requests preempted after their prompt was compressed.

Regression test for the block-table overflow found by bench/vllm_savings.py: the worker used to keep the
block ids the scheduler freed after compaction in its block table and skip them, so a compressed request
could need ``cdiv(c, bs) - cdiv(c - d, bs) + cdiv(L + G - d, bs)`` columns (``c``: tokens cached at
compaction, ``d``: prompt tokens dropped), one more than the ``cdiv(max_model_len, bs)`` vLLM sizes the
table for when the lengths round badly. Here, with ``max_model_len = L + G`` exactly (256 = 8 blocks of 32,
a multiple of vLLM's 4-block table alignment, so the table has no spare column):

* the 193-token prompt needs 7 - 2 + 4 = 9 columns without any preemption;
* in a 14-block pool a 192-token request is preempted late and recomputed with its generated tokens
  (``c = L + g``, 248 tokens: 8 - 3 + 4 = 9 columns).

Before the fix the engine died with an ``IndexError`` in the builder's slot remapping (vLLM's
``append_row`` assigned the ninth block id to an empty numpy slice past the row's end, which drops it
silently). A recomputed request's generated tokens also used to attend to the whole prompt in the step that
recompressed it, so its later tokens could differ from an uninterrupted run's; now they attend to the kept
tokens only, as in the uninterrupted decode, so every output equals the unpressured engine's and the
transformers reference's (the model under ``generate`` on kvmodels' paged cache).
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import prompts, run_transformers, run_vllm
from kvpolicies import compose
from kvpolicies.vllm import prompt_budget

LENS = [193, 192, 192, 192, 192]
NEW = 63
MAX_LEN = max(LENS) + NEW  # 256: exactly the longest request, no spare block
POOL = 14  # blocks (one is vLLM's null block): the 192-token requests preempt one another late
NEVER = 10**6
#: evict_every past the generation: prompt compression only, so the requests grow while decoding and are
#: preempted late (preemption with decode-time eviction: test_vllm_decode.py).
SPEC = json.dumps({"policies": ["streaming"], "budget": 0.2, "evict_every": NEVER})
#: Whole prefill: a preempted request is recomputed in one step past its prompt; chunks of 64 tokens: the
#: prompt completes at a chunk border and the generated tokens follow in later chunks.
ENGINES = {"whole-prefill": {},
           "chunked-prefill": {"enable_chunked_prefill": True, "max_num_batched_tokens": 64}}


def preempted_after_compression(result: dict) -> dict[str, int]:
    """Request id -> tokens cached just before each preemption that came after the prompt was compressed
    (the largest), read off the per-step records (a preempted request's cached count falls to 0)."""
    seen: dict[str, int] = {}
    found: dict[str, int] = {}
    for step in result["steps"]:
        for rid, (L, computed, _) in step["requests"].items():
            if computed < seen.get(rid, 0) and seen[rid] > L:
                found[rid] = max(found.get(rid, 0), seen[rid])
            seen[rid] = computed
    return found


def assert_blocks_follow_kept_lengths(result: dict, policy) -> None:
    """After every step, a request holds the blocks of its kept plus generated tokens; in the step that
    compresses its prompt (the first past it, a recomputation included) still all its tokens' blocks (the
    scheduler frees them when it next schedules the request)."""
    bs = result["block_size"]
    prev: dict[str, int] = {}
    for step in result["steps"]:
        for rid, (L, computed, held) in step["requests"].items():
            compressing = prev.get(rid, 0) < L <= computed
            dropped = L - prompt_budget(policy, L)[0] if computed > L and not compressing else 0
            assert held == math.ceil((computed - dropped) / bs), (rid, L, computed, held)
            prev[rid] = computed


@pytest.fixture(scope="module")
def unpressured(model_dir, tmp_path_factory):
    """The same requests in vLLM's default pool (room for all): no preemption."""
    result = run_vllm(tmp_path_factory.mktemp("unpressured"), model_dir, prompts(LENS), NEW, SPEC,
                      {"max_model_len": MAX_LEN})
    assert not result["preempted"]
    return result


@pytest.mark.parametrize("mode", list(ENGINES))
def test_requests_at_max_model_len_survive_preemption(mode, unpressured, model_dir, hf_model, tmp_path):
    batch = prompts(LENS)
    policy = compose("streaming", budget=0.2, evict_every=NEVER)
    ours = run_vllm(tmp_path, model_dir, batch, NEW, SPEC,
                    {"num_gpu_blocks_override": POOL, "max_model_len": MAX_LEN} | ENGINES[mode])
    late = preempted_after_compression(ours)
    assert late, ours["preempted"]  # the pool pressure did preempt a compressed request
    bs, width = ours["block_size"], math.ceil(MAX_LEN / ours["block_size"])
    assert width % 4 == 0  # vLLM rounds the table to 128 tokens: no spare column here
    for rid, cached in late.items():  # its old worker table would not have fit
        L = LENS[int(rid.split("-")[0])]
        d = L - prompt_budget(policy, L)[0]
        if mode == "whole-prefill":
            columns = math.ceil(cached / bs) - math.ceil((cached - d) / bs) + math.ceil((L + NEW - d) / bs)
            assert columns > width
    assert [len(t) for t in ours["tokens"]] == [NEW] * len(batch)
    assert ours["tokens"] == unpressured["tokens"]
    assert ours["tokens"] == [run_transformers(hf_model, p, NEW, policy)[0] for p in batch]
    assert_blocks_follow_kept_lengths(ours, policy)
    assert_blocks_follow_kept_lengths(unpressured, policy)
