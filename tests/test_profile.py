"""``kvmodels.profile``: the echo and induction scores against a naive reference, a model whose attention is
uniform (known scores), and the weights the ``profile`` budget policy takes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from devices import DEVICE
from kvkernels import prefill_attention
from kvmodels.mpt import MPT, MPTConfig
from kvmodels.profile import retrieval_profile, retrieval_scores
from kvpolicies import compose
from test_generate import V, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


class NaiveProbs:
    """A cache stand-in keeping every layer's full causal attention probabilities ``[Hq, N, N]``."""

    def __init__(self) -> None:
        self.probs: list[torch.Tensor] = []

    def prefill_attend(self, l, b, q, k, v, positions, *, scale):
        N, Hq, _ = q.shape
        group = Hq // k.shape[1]
        p = torch.zeros(Hq, N, N, dtype=torch.float64)
        for h in range(Hq):
            kh = k[:, h // group].double().cpu()
            for i in range(N):
                p[h, i, : i + 1] = torch.softmax(q[i, h].double().cpu() @ kh[: i + 1].T * scale, dim=0)
        self.probs.append(p)
        return prefill_attention(q, k, v, scale=scale)[0]

    def observe(self, l, b, h_in, attn_out):
        pass


def naive_scores(model, tokens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Echo and induction ``[L, Hq]`` by the definition: mean over second-copy queries ``i`` (after its first
    token) of the attention on key ``i - T`` (echo) and ``i - T + 1`` (induction)."""
    rec = NaiveProbs()
    with torch.no_grad():
        model.prefill(tokens.to(DEVICE), rec, 0)
    echo = torch.zeros(len(rec.probs), rec.probs[0].shape[0], dtype=torch.float64)
    induction = torch.zeros_like(echo)
    for l, p in enumerate(rec.probs):
        for i in range(T + 1, 2 * T):
            echo[l] += p[:, i, i - T] / (T - 1)
            induction[l] += p[:, i, i - T + 1] / (T - 1)
    return echo, induction


@settings(max_examples=8, deadline=None)
@given(heads=st.sampled_from([(4, 4), (4, 2), (8, 2), (4, 1)]), T=st.integers(2, 40), seed=st.integers(0, 99))
def test_scores_match_the_naive_definition(heads, T, seed):
    model = tiny_llama(seed=seed % 3, n_heads=heads[0], n_kv_heads=heads[1])
    echo, induction = retrieval_scores(model, length=T, trials=1, seed=seed)
    # The prompt retrieval_scores drew: T distinct tokens from the upper 90% of the vocabulary, twice.
    g = torch.Generator().manual_seed(seed)
    first = V // 10 + torch.randperm(V - V // 10, generator=g)[:T]
    ref_echo, ref_induction = naive_scores(model, torch.cat([first, first]), T)
    assert echo.shape == induction.shape == (2, heads[0])
    torch.testing.assert_close(echo.double(), ref_echo, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(induction.double(), ref_induction, atol=1e-5, rtol=1e-4)


def test_uniform_attention_scores_one_over_position():
    model = tiny_llama(n_layers=3)
    with torch.no_grad():  # no query: every query attends to all the keys it sees equally
        for block in model.blocks:
            block.wqkv.weight[: block.n_heads * block.head_dim] = 0
    T = 30
    echo, induction = retrieval_scores(model, length=T, trials=2)
    expected = sum(1 / (i + 1) for i in range(T + 1, 2 * T)) / (T - 1)
    torch.testing.assert_close(echo, torch.full_like(echo, expected))
    torch.testing.assert_close(induction, torch.full_like(induction, expected))


def test_profile_is_floor_plus_strongest_head_and_composes():
    model = tiny_llama(n_layers=3)
    echo, induction = retrieval_scores(model, length=20, trials=2, seed=5)
    w = retrieval_profile(model, floor=0.3, length=20, trials=2, seed=5)
    expected = 0.3 + torch.maximum(echo, induction).amax(dim=1)
    assert len(w) == 3 and torch.allclose(torch.tensor(w, dtype=torch.float64), expected.double(), atol=1e-4)
    policy = compose(("profile", {"weights": w}), "snapkv", budget=0.3)
    budgets = policy.layer_budgets(torch.tensor([10]), 3)[:, 0]
    assert int(budgets.sum()) == 30 and budgets[int(torch.argmax(expected))] == budgets.max()


def test_errors():
    model = tiny_llama()
    with pytest.raises(ValueError, match="max_seq_len"):
        retrieval_scores(model, length=49)
    with pytest.raises(ValueError, match="length"):
        retrieval_scores(model, length=1)
    with pytest.raises(ValueError, match="trials"):
        retrieval_scores(model, length=10, trials=0)
    with pytest.raises(ValueError, match="vocab"):
        retrieval_scores(model, length=10, vocab=(0, 5))
    with pytest.raises(ValueError, match="floor"):
        retrieval_profile(model, floor=0)
    mpt = MPT(MPTConfig(vocab_size=61, n_layers=2, n_heads=2, hidden_size=8, intermediate_size=16,
                        max_seq_len=64)).to(DEVICE)
    with pytest.raises(ValueError, match="prefill_attend"):
        retrieval_scores(mpt, length=10)
