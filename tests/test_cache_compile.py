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
