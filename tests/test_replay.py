"""Decode-time eviction replayed as a graph (kvmodels.replay): a CUDA graph replays the launches it recorded,
with the host values of the call it was captured in. The fake graph below does the same on CPU (``replay``
re-runs the function *captured*, not the one passed now), so a key that leaves out something the launches
depend on (the table columns in use, the budget rows, the batch) makes the replayed decode diverge from the
eager one. tests/test_gpu.py runs the real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from kvmodels.cache import PagedKVCache
from kvmodels.llama import Llama, LlamaConfig
from kvmodels.replay import Replays
from kvpolicies import compose

pytestmark = pytest.mark.usefixtures("one_thread")


class RecordedCall:
    """Stands in for a CUDA graph: keeps the function seen at capture, runs it on replay."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()

    def pool(self):
        return "pool"


class FakeGraphs:
    def __init__(self):
        self.pools = []

    def capturing(self):
        return False

    def capture(self, fn, pool):
        self.pools.append(pool)
        return RecordedCall(fn)


def test_replays_run_eager_then_capture_then_replay():
    calls = []
    r = Replays(enabled=True, limit=2, graph_factory=FakeGraphs())
    r.run("a", lambda: calls.append("a1"))  # first sight: eager
    r.run("a", lambda: calls.append("a2"))  # second: captured (the fake records a2) and replayed
    r.run("a", lambda: calls.append("a3"))  # replay runs the captured function, not this one
    assert calls == ["a1", "a2", "a2"]
    assert (r.captures, r.replays) == (1, 2)
    for key in "bbcc":  # a second graph fits the limit, a third key stays eager
        r.run(key, lambda key=key: calls.append(key))
    assert calls[3:] == ["b", "b", "c", "c"] and r.captures == 2
    assert r._factory.pools == [None, "pool"]  # later graphs share the first one's pool
    r.clear()
    r.run("a", lambda: calls.append("a4"))
    assert calls[-1] == "a4" and r.captures == 0
    off = Replays(enabled=False)
    for i in range(3):
        off.run("a", lambda i=i: calls.append(i))
    assert calls[-3:] == [0, 1, 2] and off.captures == 0


def test_a_capture_that_fails_falls_back_to_eager_once(monkeypatch):
    class Broken(FakeGraphs):
        def capture(self, fn, pool):
            raise RuntimeError("operation not permitted when stream is capturing")

    calls = []
    r = Replays(enabled=True, graph_factory=Broken())
    r.run("a", lambda: calls.append(1))
    with pytest.warns(RuntimeWarning, match="runs eagerly"):
        r.run("a", lambda: calls.append(2))
    r.run("a", lambda: calls.append(3))
    assert calls == [1, 2, 3] and not r.enabled and "not permitted" in r.failure
    monkeypatch.setenv("KVPOLICIES_EVICTION_GRAPHS", "0")
    assert not Replays(enabled=True).enabled


def decode_with_eviction(policy: str, replays: Replays | None, steps: int = 24, device: str = "cpu"):
    """Logits per decode step and the kept tokens afterwards; ``replays``: the cache's (None: its own)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=61, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=64,
                              max_seq_len=256)).eval().to(device)
    layout = model.cache_layout()
    # Ragged: one prompt over its budget from the start, one that passes it while decoding (the width, in
    # table columns, changes under it: new keys), pages of 4 so the columns change often.
    prompts = [list(range(1, 60)), list(range(3, 12))]
    cache = PagedKVCache(n_layers=layout.n_layers, n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
                         n_q_heads=layout.n_q_heads, max_batch=2, max_tokens=128, dtype=torch.float32,
                         page_size=4, device=device, policy=compose(policy, budget=0.3, min_tokens=4))
    if replays is not None:
        cache._replays = replays
    logits = []
    with torch.no_grad():
        cache.start([len(p) for p in prompts], steps)
        for b, p in enumerate(prompts):
            model.prefill(torch.tensor(p, device=device), cache, b, last_only=True)
        cache.finish_prefill()
        positions = torch.tensor([len(p) for p in prompts], device=device)
        token = torch.tensor([5, 6], device=device)
        for t in range(steps):
            cache.prepare_decode(t)
            out = model.decode_step(token, positions + t, cache)
            logits.append(out)
            token = out.argmax(-1)
            cache.after_step(t)
    contents = [cache.layer_contents(l, b) for l in range(layout.n_layers) if cache.layout.width[l]
                for b in range(2)]
    return logits, contents, cache._replays


@pytest.mark.parametrize("policy", ["h2o", "streaming", "keyformer", "squeeze+tova", "streaming+minicache"])
def test_replayed_eviction_decodes_as_eager_eviction(policy):
    eager_logits, eager_contents, _ = decode_with_eviction(policy, Replays(enabled=False))
    replaying = Replays(enabled=True, graph_factory=FakeGraphs())
    logits, contents, replays = decode_with_eviction(policy, replaying)
    assert replays.captures >= 1 and replays.replays >= 5  # the steady width replays
    for a, b in zip(logits, eager_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(contents, eager_contents):
        for name in ("k", "v", "pos", "score"):
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
