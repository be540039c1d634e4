"""The plugin where vLLM serves: the engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``,
vLLM's default, which the other tests turn off to read the scheduler) and the OpenAI-compatible HTTP server
(``vllm serve``, which runs it that way), with a server policy and requests naming their own in
``vllm_xargs``. Each generates token for token what the in-process engine generates under the same
policies, which the other tests check against the transformers reference; a bad request spec is the
request's HTTP 400 with the plugin's message, and the server keeps serving."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from conftest import ENV, HERE, prompts, run_vllm
from kvpolicies import compose

NEW = 24
LENS = [70, 130, 45, 96]
SERVER = compose("snapkv", budget=0.3).to_json()
OWN = [None,  # the server's policy
       {"kvpolicies": compose("streaming", budget=0.2).to_json()},  # JSON text
       {"kvpolicies": {"policies": ["h2o"], "budget": 0.2}},  # a compose() spec (sent as JSON text)
       {"kvpolicies": "full"}]  # a name: the whole cache


@pytest.fixture(scope="module")
def in_process(model_dir, tmp_path_factory) -> tuple[list[list[int]], list[list[int]]]:
    """The in-process engine's tokens under the server's and the requests' policies, and plain vLLM's."""
    batch = prompts(LENS, seed=3)
    tmp = tmp_path_factory.mktemp("in-process")
    ours = run_vllm(tmp / "ours", model_dir, batch, NEW, SERVER, request_policies=OWN)["tokens"]
    plain = run_vllm(tmp / "plain", model_dir, batch, NEW, None)["tokens"]
    # the policies matter here: every compressed request generates other tokens than plain vLLM
    assert ours[3] == plain[3] and all(ours[i] != plain[i] for i in range(3)), (ours, plain)
    return ours, plain


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_in_its_own_process(model_dir, in_process, tmp_path):
    """``LLM.generate`` with the engine core in a second process: each request's policy reaches the
    scheduler and the workers there."""
    batch = prompts(LENS, seed=3)
    job, out = tmp_path / "job.json", tmp_path / "out.json"
    job.write_text(json.dumps({"model": model_dir, "prompts": batch, "max_tokens": NEW, "engine": {},
                               "request_policies": OWN, "generate": True}))
    env = {k: v for k, v in os.environ.items() if k != "KVPOLICIES_VLLM_POLICY"} | ENV | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "KVPOLICIES_VLLM_POLICY": SERVER}
    proc = subprocess.run([sys.executable, str(HERE / "vllm_job.py"), str(job), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(out.read_text())["tokens"] == in_process[0]


def _post(port: int, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_vllm_serve_with_request_policies(model_dir, in_process, tmp_path):
    """``vllm serve`` (its API server and engine core processes) with the server's policy; each request's
    own, as JSON text or a name in ``vllm_xargs`` (whose values are strings); a bad one is a 400."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "KVPOLICIES_VLLM_POLICY"} | ENV | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "KVPOLICIES_VLLM_POLICY": SERVER}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host",
           "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32",
           "--block-size", "32", "--no-enable-prefix-caching", "--max-model-len", "512", "--seed", "0"]
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        server = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert server.poll() is None and time.time() < deadline, log.read_text()[-4000:]
                time.sleep(1)
        got = []
        for ids, own in zip(prompts(LENS, seed=3), OWN):
            body = {"model": model_dir, "prompt": ids, "max_tokens": NEW, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            if own is not None:
                spec = own["kvpolicies"]
                body["vllm_xargs"] = {"kvpolicies": spec if isinstance(spec, str) else json.dumps(spec)}
            status, answer = _post(port, body)
            assert status == 200, answer
            got.append(answer["choices"][0]["token_ids"])
        assert got == in_process[0]
        status, answer = _post(port, {"model": model_dir, "prompt": ids, "max_tokens": 4,
                                      "vllm_xargs": {"kvpolicies": "no_such_policy"}})
        assert status == 400, answer
        assert answer["error"]["type"] == "BadRequestError"
        assert 'extra_args["kvpolicies"]' in answer["error"]["message"], answer
        assert "no_such_policy" in answer["error"]["message"], answer
        # still serving after the refused request: the first request again, under the server's policy
        status, answer = _post(port, {"model": model_dir, "prompt": prompts(LENS, seed=3)[0],
                                      "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                                      "return_token_ids": True})
        assert status == 200 and answer["choices"][0]["token_ids"] == in_process[0][0], answer
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
