"""A request names its own policy, ``SamplingParams(extra_args={"kvpolicies": spec})``, beside the server's
(``KVPOLICIES_VLLM_POLICY``), on the tiny random Llama: in one batch, requests under the server's
``streaming``, their own ``h2o``, ``knorm`` and ``tova`` (each evicting while decoding) and the full cache
generate what the transformers reference generates with each request's policy, and hold the blocks of each
one's kept lengths; a spec the plugin cannot apply fails that request at submission with one line, and so
does a request that names a policy while the plugin is off."""

from __future__ import annotations

import pytest

from conftest import VllmFailed, assert_blocks_follow_kept_lengths, prompts, run_transformers, run_vllm
from kvpolicies import compose

NEW = 40
LENS = [45, 130, 20, 96, 71]
SERVER = compose("streaming", budget=0.2)
OWN = [
    None,  # no key: the server's policy
    {"kvpolicies": {"policies": ["h2o"], "budget": 0.3}},  # a compose() spec as a dict
    {"kvpolicies": None},  # the full cache
    {"kvpolicies": compose("knorm", budget=0.2).to_json()},  # ... or as JSON text
    {"kvpolicies": {"policies": ["tova"], "budget": 0.25, "evict_every": 2}},
]
POLICIES = [SERVER, compose("h2o", budget=0.3), compose("full"), compose("knorm", budget=0.2),
            compose("tova", budget=0.25, evict_every=2)]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_each_request_runs_its_own_policy(chunked, model_dir, hf_model, tmp_path):
    engine = {"enable_chunked_prefill": True, "max_num_batched_tokens": 32} if chunked else {}
    batch = prompts(LENS)
    ours = run_vllm(tmp_path, model_dir, batch, NEW, SERVER.to_json(), engine, request_policies=OWN)
    want = [run_transformers(hf_model, p, NEW, policy)[0] for p, policy in zip(batch, POLICIES)]
    assert ours["tokens"] == want
    # each request's own policy mattered: the server's gives other tokens for most of them
    server = [run_transformers(hf_model, p, NEW, SERVER)[0] for p in batch[1:]]
    assert sum(a != b for a, b in zip(want[1:], server)) >= 3
    assert_blocks_follow_kept_lengths(ours, POLICIES)


@pytest.mark.parametrize("server,own,message", [
    (SERVER.to_json(), {"policies": ["pyramid", "snapkv"], "budget": 0.2}, "layer budgets 'pyramid'"),
    (SERVER.to_json(), {"policies": ["no_such_policy"]}, "no_such_policy"),
    (SERVER.to_json(), 7, "name a policy as a compose() spec"),
    (None, {"policies": ["h2o"], "budget": 0.2}, "KVPOLICIES_VLLM_POLICY=full"),
], ids=["unsupported", "unknown", "not-a-spec", "plugin-off"])
def test_bad_request_policy_fails_the_request(server, own, message, model_dir, tmp_path):
    with pytest.raises(VllmFailed) as err:
        run_vllm(tmp_path, model_dir, prompts([20]), 4, server, request_policies=[{"kvpolicies": own}])
    last = [line for line in str(err.value).splitlines() if "PolicySpecError" in line][-1]
    assert 'extra_args["kvpolicies"]' in last and message in last, last
