"""Pieces of the vLLM plugin tested without an engine: the policy spec and its one-line errors, a request's
own policy, and the compaction of one request in a CPU KV cache laid out by vLLM's own kernel
(bit-identical kept tokens)."""

from __future__ import annotations

import json

import pytest
import torch

from kvpolicies import compose
from kvpolicies.vllm import PolicySpecError, parse, prompt_budget, request_policy


@pytest.mark.parametrize("raw,part", [
    ("keyfromer", "unknown policy 'keyfromer'; did you mean 'keyformer'?"),
    ('{"policies": ["snapkv"], "budget": 1.5}', "budget"),
    ("{not json", "Expecting property name"),
    ("squeeze+snapkv", "layer budgets 'squeeze' (only 'uniform')"),
    ("adakv+snapkv", "head budgets 'adakv'"),
    ("minicache", "layer merging 'minicache'"),
    ("chunkkv(reuse=2)", "reuses an earlier layer's scores"),
    ("snapkv+kivi", "quantized storage 'kivi'"),
])
def test_bad_spec_is_one_line(raw, part):
    with pytest.raises(PolicySpecError) as err:
        parse(raw)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"KVPOLICIES_VLLM_POLICY={raw!r}: ") and part in msg, msg


@pytest.mark.parametrize("raw", ["full", "streaming", "knorm", "window", "snapkv(window=8)", "chunkkv",
                                 "h2o", "tova", "a2sf", "scissorhands", "tova(decode=False)", "keyformer",
                                 '{"policies": ["streaming"], "budget": 0.2}'])
def test_supported_specs_parse(raw):
    assert parse(raw) == (compose(raw) if not raw.startswith("{") else compose(eval(raw)))


class Params:
    """What ``request_policy`` reads of vLLM's ``SamplingParams``."""

    def __init__(self, extra_args: dict | None) -> None:
        self.extra_args = extra_args


def test_request_policy_names_the_requests_own():
    server = compose("streaming", budget=0.2)
    assert request_policy(Params(None), server) is server  # no extra_args: the server's
    assert request_policy(Params({"other": 1}), server) is server
    assert request_policy(None, None) is None
    spec = {"policies": ["h2o"], "budget": 0.3, "evict_every": 2}
    assert request_policy(Params({"kvpolicies": spec}), server) == compose(spec)
    assert request_policy(Params({"kvpolicies": json.dumps(spec)}), server) == compose(spec)
    assert request_policy(Params({"kvpolicies": "snapkv(window=8)"}), server) == compose("snapkv(window=8)")
    assert request_policy(Params({"kvpolicies": compose("knorm").spec()}), server) == compose("knorm")
    for whole in (None, "full"):
        assert request_policy(Params({"kvpolicies": whole}), server) == compose("full")
    # parsed once per spec: every call for the same spec is the same object (the workers group by it)
    again = request_policy(Params({"kvpolicies": dict(spec)}), None)
    assert again is request_policy(Params({"kvpolicies": spec}), server)


@pytest.mark.parametrize("own,part", [
    ({"policies": ["squeeze", "snapkv"], "budget": 0.2}, "layer budgets 'squeeze'"),
    ("keyfromer", "did you mean 'keyformer'?"),
    ({"policies": ["snapkv"], "budget": 2.5}, "budget"),
    (3, "name a policy as a compose() spec"),
    ({"policies": ["h2o"], "budget": float("nan")}, "budget"),
])
def test_bad_request_policy_is_one_line(own, part):
    with pytest.raises(PolicySpecError) as err:
        request_policy(Params({"kvpolicies": own}), compose("full"))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith('extra_args["kvpolicies"]=') and part in msg, msg


def test_prompt_budget_reads_the_plan():
    policy = compose("streaming", budget=0.2)
    assert prompt_budget(policy, 130) == (26, 4, 22)
    assert prompt_budget(policy, 3) == (3, 2, 1)  # the floor (4 tokens) exceeds the prompt: keep it whole
    assert prompt_budget(compose("full"), 130)[0] == 130
    assert prompt_budget(compose("streaming", budget=64), 200)[0] == 64  # an int budget: tokens per layer


@pytest.mark.parametrize("name", ["streaming", "knorm", "snapkv"])
def test_compaction_in_vllm_cache_is_bit_identical(name):
    """Write a request's K/V with vLLM's CPU kernel into scattered blocks, compact it, and read it back
    through the kernel's layout: the kept tokens (the library's selection on the same K/V) are at slots
    [0, kept) with the same bits, and the tokens after the prompt follow them."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvpolicies.vllm import backend

    torch.manual_seed(0)
    nb, H, Hq, bs, D, L, extra = 8, 2, 4, 32, 32, 70, 3
    isa = _get_attn_isa(torch.float32, bs, D, "auto")
    kv_cache = torch.zeros(nb, H, bs, 2 * D)
    k_cache, v_cache = kv_cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
    blocks = torch.tensor([5, 1, 6])
    total = L + extra
    k, v, q = torch.randn(total, H, D), torch.randn(total, H, D), torch.randn(total, Hq, D)
    slots = blocks[torch.arange(total) // bs] * bs + torch.arange(total) % bs
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    policy = compose(name, budget=0.2, **({"snapkv": {"window": 8}} if name == "snapkv" else {}))
    kept, n_sink, n_recent = prompt_budget(policy, L)
    job = backend.Compaction("r", 0, 0, total, L, kept, n_sink, n_recent, blocks)
    positions, kept_scores = backend.compact(policy, job, q, kv_cache, 0.125, isa)
    scores = backend.prompt_scores(policy, k[:L], v[:L], q[:L], 0.125)
    want_k, want_v, want_pos = backend.select(k[:L], v[:L], scores, kept, n_sink, n_recent)
    assert torch.equal(positions, want_pos)
    assert torch.equal(kept_scores, scores.gather(1, want_pos))  # select leaves the caller's scores alone
    offsets = backend.slot_layout(isa, torch.float32, bs, D)
    n = kept + extra
    got = []
    for part in range(2):
        flat = kv_cache.view(nb, H, 2 * bs * D)
        got.append(torch.stack([flat[blocks[j // bs], :, part * bs * D + offsets[part, j % bs]]
                                for j in range(n)]))
    assert torch.equal(got[0], torch.cat([want_k, k[L:]])) and torch.equal(got[1], torch.cat([want_v, v[L:]]))
    for h in range(H):  # kept tokens are the originals, in order
        assert torch.equal(want_k[:, h], k[want_pos[h], h])
    if name == "streaming":
        assert want_pos[0].tolist() == list(range(n_sink)) + list(range(L - n_recent, L))
