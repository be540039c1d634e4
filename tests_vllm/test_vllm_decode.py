"""Decode-time eviction under vLLM (``streaming``, ``window``, ``knorm``; ``h2o``, ``tova``, ``a2sf``,
``scissorhands`` and ``keyformer``, scored by each decode query's attention) on the tiny random Llama: greedy
outputs equal the transformers reference's with the same policy (which evicts every ``evict_every`` decode
steps, as kvmodels does), over generations long enough for many evictions; blocks held follow the kept
lengths, and blocks emptied while decoding go back to the pool; a request preempted after several evictions
and recomputed (in one step, or in chunks) generates what the uninterrupted run generates."""

from __future__ import annotations

import pytest

from conftest import assert_blocks_follow_kept_lengths, prompts, run_transformers, run_vllm
from kvpolicies import compose

NEW = 40
LENS = [45, 130, 20, 96, 71]
NEVER = 10**6
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 32}
CASES = {
    # 0.2 of 130 = 26 slots held between 26 and 33: the 130-token request frees its second block each cycle
    "streaming-0.2-every8-chunked": ("streaming", 0.2, 8, CHUNKED),
    "streaming-0.2-every1": ("streaming", 0.2, 1, {}),
    "window-40-every3": ("window", 40, 3, {}),  # an int budget: the 20-token prompt grows to 40, then held
    "knorm-0.2-every1": ("knorm", 0.2, 1, {}),
    # scored by each decode query's attention (the workers keep per-slot scores)
    "h2o-0.2-every1": ("h2o", 0.2, 1, {}),
    "h2o-0.2-every4-chunked": ("h2o", 0.2, 4, CHUNKED),  # every prompt query scores: kept across chunks
    "tova-0.2-every1": ("tova", 0.2, 1, {}),
    "a2sf-0.3-every2": ("a2sf", 0.3, 2, {}),
    "scissorhands-0.2-every3-chunked": ("scissorhands", 0.2, 3, CHUNKED),
    "keyformer-0.2-every1": ("keyformer", 0.2, 1, {}),  # kvmodels' noise of a batch's first row
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_eviction_equals_transformers(case, model_dir, hf_model, tmp_path):
    name, budget, every, engine = CASES[case]
    policy = compose(name, budget=budget, evict_every=every)
    batch = prompts(LENS)
    ours = run_vllm(tmp_path, model_dir, batch, NEW, policy.to_json(), engine)
    assert [len(t) for t in ours["tokens"]] == [NEW] * len(batch)
    want = [run_transformers(hf_model, p, NEW, policy)[0] for p in batch]
    assert ours["tokens"] == want
    prompt_only = compose(name, budget=budget, evict_every=NEVER)
    assert want != [run_transformers(hf_model, p, NEW, prompt_only)[0] for p in batch]  # evictions mattered
    shrank = assert_blocks_follow_kept_lengths(ours, policy)
    if case.startswith("streaming-0.2-every8"):
        assert shrank >= 3, shrank  # blocks came back to the pool while decoding


@pytest.mark.parametrize("name,engine", [("streaming", {}), ("streaming", CHUNKED), ("h2o", {}),
                                         ("h2o", CHUNKED)],
                         ids=["whole-recompute", "chunked-recompute", "h2o-whole", "h2o-chunked"])
def test_preempted_after_evictions_recomputes_the_same(name, engine, model_dir, hf_model, tmp_path):
    """Requests 1 (130 tokens) and 3 (96) are preempted after 27 and 30 decode steps (3 evictions at every
    8 steps behind them) and recomputed: in one step (the compaction, then 3 pieces of generated tokens
    between evictions, each attending again to the held slots; with h2o each piece's queries update the
    scores row by row, as the decode steps did), or in 32-token chunks (pieces in chunks past the prompt
    too). Their outputs equal the reference's, as do the others'."""
    policy = compose(name, budget=0.2, evict_every=8)
    batch = prompts(LENS)
    ours = run_vllm(tmp_path, model_dir, batch, NEW, policy.to_json(), engine,
                    preempt={1: LENS[1] + 27, 3: LENS[3] + 30})
    assert set(r.split("-")[0] for r in ours["preempted"]) == {"1", "3"}, ours["preempted"]
    assert ours["tokens"] == [run_transformers(hf_model, p, NEW, policy)[0] for p in batch]
    assert_blocks_follow_kept_lengths(ours, policy)
