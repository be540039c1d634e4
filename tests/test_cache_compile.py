"""A compiled decode step (append + attend over three layers, two of them a MiniCache pair, plus a read-only
attend) through many steps of eviction, sequences finishing and the Keyformer noise/temperature buffers:
one compile, no graph break, no recompile, and the same results as eager."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from kvpolicies import compose
from test_cache import FakeRun, check_invariants

N_STEPS = 12


def _step(cache, run, t, step_fn):
    cache.prepare_decode(t)
    out = step_fn(cache, run.steps[t], run.step_positions(t), run.scale)
    cache.after_step(t)
    return out


def decode_step(cache, qkv, positions, scale):
    """What a model's compiled decode step does to the cache: append then attend, per layer, and (like an
    LCKV layer) one read of the last layer without a score update."""
    outs = []
    for l, (q, k, v) in enumerate(qkv):
        cache.append(l, k, v, positions)
        outs.append(cache.attend(l, q, positions, scale=scale))
    outs.append(cache.attend(len(qkv) - 1, qkv[0][0], positions, scale=scale, update_scores=False))
    return torch.stack(outs)  # [Lc + 1, B, Hq, D]


@pytest.mark.slow
@pytest.mark.parametrize("policy", [compose("keyformer", "minicache", budget=6, evict_every=3)],
                         ids=lambda p: p.name)
def test_compiled_decode_step_matches_eager_without_recompiling(policy):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    run = FakeRun(3, 2, 2, 8, [9, 3, 14], N_STEPS, seed=5)
    finish = {4: 1, 8: 0}  # step -> sequence that stops before it
    caches = [run.cache(policy, page_size=4, seed=11) for _ in range(2)]
    assert caches[0].merged_pairs == [(1, 2)]
    for cache in caches:
        run.prefill(cache)
    eager, compiled = caches
    step_c = torch.compile(decode_step, fullgraph=True, backend="inductor")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(N_STEPS):
            for cache in caches:
                if t in finish:
                    cache.finish_sequence(finish[t])
            want = _step(eager, run, t, decode_step)
            got = _step(compiled, run, t, step_c)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            check_invariants(compiled)
            for name in ("seq_lens", "page_table", "slot_pos", "slot_score", "free_pages", "n_free", "k_mag",
                         "v_mag", "slot_mask"):
                a, b = getattr(eager, name), getattr(compiled, name)
                assert torch.equal(a, b) if name != "slot_score" else torch.allclose(a, b, atol=1e-6), name
            for l, limit in ((0, 6 + 3 - 1), (1, 2 * 6 + 2 * (3 - 1))):  # a layer; the pair's region
                assert int(compiled.seq_lens[l].max()) <= limit
    counters = torch._dynamo.utils.counters
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # The compiled cache really evicted: lengths stayed near the budget while 12 tokens were added.
    # Sequence 2 (14 prompt tokens + 12) ends right after an eviction: exactly the budgets.
    assert compiled.seq_lens[:, 2].tolist() == [6, 2 * 6, 0]


def _mutated_inputs(step_fn, *args) -> list[tuple[str, bool]]:
    """Compile ``step_fn`` and return ``(input name, has a static address)`` for every input the graph
    mutates: the condition inductor's CUDA graph trees check before capturing (a mutated input without a
    static address makes them skip capture with 'mutated inputs')."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._guards import TracingContext

    found: list[tuple[str, bool]] = []
    names: list[str] = []  # dynamo's input names (e.g. L_cache_seq_lens), in AOT's input order

    def forward_compiler(gm, example_inputs):
        meta = TracingContext.get().fw_metadata
        found.extend((names[i], i in meta.static_input_indices)
                     for i, info in enumerate(meta.input_info) if info.mutates_data)
        return gm

    def backend(gm, example_inputs):
        names.extend(n.name for n in gm.graph.nodes if n.op == "placeholder")
        return aot_autograd(fw_compiler=forward_compiler)(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(step_fn, fullgraph=True, backend=backend)(*args)
    return found


@pytest.mark.parametrize("policy", [compose("full"), compose("h2o", budget=6),
                                    compose("keyformer", "minicache", budget=6)], ids=lambda p: p.name)
def test_decode_step_mutates_only_static_buffers(policy):
    """Graph-safe cache state: everything the compiled step writes has a static address, so the step can be
    replayed as one CUDA graph (tests/test_gpu.py checks the capture itself on a GPU)."""
    run = FakeRun(3, 2, 2, 8, [9, 3, 14], N_STEPS, seed=5)
    cache = run.cache(policy, page_size=4, seed=11)
    run.prefill(cache)
    cache.prepare_decode(0)
    mutated = _mutated_inputs(decode_step, cache, run.steps[0], run.step_positions(0), run.scale)
    names = [name for name, _ in mutated]
    assert any("k_pages" in n for n in names) and any("seq_lens" in n for n in names), names
    assert all(static for _, static in mutated), [name for name, static in mutated if not static]


def test_model_decode_step_mutates_only_static_buffers():
    """The same for a model's whole decode step (weights and RoPE tables are module state, static already)."""
    from kvmodels.cache import PagedKVCache
    from test_generate import tiny_llama

    model = tiny_llama()
    layout = model.cache_layout()
    cache = PagedKVCache(n_layers=layout.n_layers, n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
                         n_q_heads=layout.n_q_heads, max_batch=2, max_tokens=16, page_size=4,
                         dtype=torch.float32, device="cpu", policy=compose("h2o", budget=6))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9]]
    with torch.no_grad():
        cache.start([len(p) for p in prompts], 4)
        for b, p in enumerate(prompts):
            model.prefill(torch.tensor(p), cache, b, last_only=True)
        cache.finish_prefill()
    cache.prepare_decode(0)
    mutated = _mutated_inputs(model.decode_step, torch.tensor([1, 2]), torch.tensor([7, 2]), cache)
    assert len(mutated) >= 5 and all(static for _, static in mutated), mutated
