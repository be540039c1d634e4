"""The out-of-tree example package (``examples/kvpolicies-vnorm``) registers ``vnorm`` through the
``kvpolicies.policies`` entry point and defines its rule only through the open score hook
(``EvictionPolicy.token_scores``). Installed as a distribution would be (a ``*.dist-info`` on ``sys.path``
declaring the package's own entry point), it runs through kvmodels' paged cache, where it keeps exactly what a
dense reference keeps, and through a transformers model's ``generate`` on the paged cache (``kvmodels.hf``),
which keeps what kvmodels' own model keeps."""

from __future__ import annotations

import tomllib
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from kvpolicies import compose, get_policy
from reference_policies import kept_by_fixed_scores, recent_count, resolve_budget
from test_cache import FakeRun, check_invariants
from test_registry import _install_plugin

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kvpolicies-vnorm"


@pytest.fixture
def vnorm(tmp_path, monkeypatch, clean_registry):
    """Install the example as a distribution: its pyproject's entry point, its directory on sys.path."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    entry = project["project"]["entry-points"]["kvpolicies.policies"]
    assert entry == {"vnorm": "kvpolicies_vnorm:VNorm"}
    _install_plugin(tmp_path, monkeypatch, "vnorm = kvpolicies_vnorm:VNorm", source=EXAMPLE,
                    dist_name=project["project"]["name"])
    return get_policy("vnorm")


def reference_kept(v_prompt, v_steps, b: int, n_recent: int, evict_every: int) -> list[list[list[int]]]:
    """Dense reference of one sequence: ``[step][head]`` kept positions (after the prompt, then each step).
    Keep the ``n_recent`` newest, then the largest value norms (ties: the earlier token)."""
    L, H = v_prompt.shape[0], v_prompt.shape[1]
    norms = torch.cat([v_prompt, v_steps]).double().norm(dim=-1)  # [L + T, H], row = position

    def keep(ids: list[int], h: int) -> list[int]:
        if len(ids) <= b:
            return ids
        recent = ids[len(ids) - n_recent:] if n_recent else []
        rest = sorted(ids[: len(ids) - n_recent], key=lambda p: (-float(norms[p, h]), p))
        return sorted(rest[: b - n_recent] + recent)

    return kept_by_fixed_scores(keep, H, L, v_steps.shape[0], evict_every)


@st.composite
def cases(draw):
    return dict(n_kv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2])),
                prompt_lens=draw(st.lists(st.integers(1, 14), min_size=1, max_size=3)),
                n_steps=draw(st.integers(0, 6)), page_size=draw(st.sampled_from([1, 3, 4])),
                budget=draw(st.one_of(st.integers(4, 10), st.sampled_from([0.25, 0.5, 1.0]))),
                recent=draw(st.sampled_from([0.0, 0.25, 0.5])), evict_every=draw(st.integers(1, 3)),
                seed=draw(st.integers(0, 2**16)))


def test_vnorm_in_the_paged_cache_keeps_what_the_reference_keeps(vnorm):
    assert vnorm.__module__ == "kvpolicies_vnorm" and vnorm.name == "vnorm" and vnorm.role == "eviction"

    @given(cases())
    def check(c):
        policy = compose("vnorm", budget=c["budget"], evict_every=c["evict_every"],
                         vnorm={"recent": c["recent"]})
        run = FakeRun(1, c["n_kv"], c["group"], 4, c["prompt_lens"], c["n_steps"], c["seed"])
        cache = run.cache(policy, page_size=c["page_size"])
        cache.start(c["prompt_lens"], c["n_steps"])
        for b in range(len(c["prompt_lens"])):
            cache.prefill_layer(0, b, *run.prompt[0][b], run.positions(b), scale=run.scale)
        cache.finish_prefill()
        got = [[cache.layer_contents(0, b)["pos"].t().tolist() for b in range(len(c["prompt_lens"]))]]
        for t in range(c["n_steps"]):
            cache.prepare_decode(t)
            q, k, v = run.steps[t][0]
            cache.append(0, k, v, run.step_positions(t))
            cache.attend(0, q, run.step_positions(t), scale=run.scale)
            cache.after_step(t)
            check_invariants(cache)
            got.append([cache.layer_contents(0, b)["pos"].t().tolist() for b in range(len(c["prompt_lens"]))])
        for b, L in enumerate(c["prompt_lens"]):
            budget = resolve_budget("vnorm", {}, c["budget"], L)
            v_steps = torch.stack([run.steps[t][0][2][b].cpu() for t in range(c["n_steps"])]) \
                if c["n_steps"] else torch.zeros(0, c["n_kv"], 4)
            want = reference_kept(run.prompt[0][b][2].cpu(), v_steps, budget,
                                  recent_count(c["recent"], budget), c["evict_every"])
            assert [step[b] for step in got] == want, f"sequence {b}"

    check()


@pytest.mark.parametrize("kind", ["llama", "gptj"])
def test_vnorm_through_transformers_keeps_what_kvmodels_keeps(vnorm, kind):
    from hf_models import assert_transformers_keeps_what_kvmodels_keeps

    policy = compose("squeeze", "vnorm", budget=0.5, vnorm={"recent": 0.25})
    assert_transformers_keeps_what_kvmodels_keeps(kind, policy)


def test_knorm_and_vnorm_compile_in_the_decode_step(vnorm):
    """An open rule runs inside the compiled decode step: one graph, no break, same tokens as eager."""
    from kvmodels.generate import generate
    from test_generate import tiny_llama

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = tiny_llama()
    for name in ("knorm", "vnorm"):
        policy = compose(name, budget=4)
        eager = generate(model, [[1, 2, 3, 4, 5, 6, 7], [8, 9]], 6, policy)
        compiled = generate(model, [[1, 2, 3, 4, 5, 6, 7], [8, 9]], 6, policy, compile=True)
        assert compiled.tokens == eager.tokens
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0


def test_a_rule_with_a_score_mode_is_refused_when_defined():
    from kvpolicies import EvictionPolicy

    with pytest.raises(TypeError, match="scores tokens one way"):
        class Both(EvictionPolicy):
            score_mode = "accumulate"

            def token_scores(self, new):
                return -new.k.norm(dim=-1)
