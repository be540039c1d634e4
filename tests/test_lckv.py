"""LCKV (papers/lckv.txt): Theorem 1 (n parallel iterations over n tokens == token-by-token decoding
through the paged cache), KV convergence trace, the layer -> cache-layer map, initialisation from a Llama
(Appendix C.1), policies on its cache layers, and a short training run on real English text."""

from __future__ import annotations

import gzip

import pytest
import torch

from devices import DEVICE
from evals.tasks import TEXT_PATH
from kvmodels.generate import generate
from kvmodels.lckv import LCKV, LCKVConfig, train_step
from kvmodels.llama import Llama, LlamaConfig
from kvpolicies import compose
from test_model_policy_matrix import teacher_forced, widen

WARMUPS = [(1, 1), (0, 0), (1, 0), (0, 2), (2, 1)]


def tiny(warmup_bottom: int, warmup_top: int, n_layers: int = 4, seed: int = 0, vocab: int = 50) -> LCKV:
    lc = LlamaConfig(vocab_size=vocab, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, intermediate=48,
                     max_seq_len=128)
    torch.manual_seed(seed)
    model = LCKV(LCKVConfig(lc, warmup_bottom=warmup_bottom, warmup_top=warmup_top))
    return widen(model, seed=seed).to(DEVICE)


@pytest.mark.parametrize("warmup", WARMUPS)
def test_theorem1_parallel_iterations_equal_sequential_decoding(warmup):
    model = tiny(*warmup)
    n = 9
    seq = torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        parallel = model.prefill(seq.to(DEVICE), None, 0, iterations=n).cpu()
        short = model.prefill(seq.to(DEVICE), None, 0, iterations=2).cpu()
    # Sequential: the first token alone (one pass is exact for it), then one decode step per token.
    sequential = teacher_forced(model, [seq], [1])[0]
    torch.testing.assert_close(parallel, sequential, atol=1e-4, rtol=1e-4)
    # Too few iterations is visibly different (the equality above is not vacuous).
    assert (short - sequential).abs().max() > 1e-3


def test_kv_convergence_is_traced():
    model = tiny(1, 1)
    seq = torch.randint(0, 50, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, changes = model.iterate(seq.to(DEVICE), 12, trace=True)
    assert len(changes) == 11
    assert changes[0] > 1e-3 and changes[-1] < 1e-6 * changes[0]


def test_layer_to_cache_map():
    model = tiny(1, 1, n_layers=5)
    assert model.n_cache_layers == 2 and model.cache_layer_of == [0, 1, 1, 1, 1]
    assert not hasattr(model.layers[2], "wqkv")  # condensed layers have no K/V weights
    model = tiny(1, 0, n_layers=4)  # condensed top layer still computes the KV everybody reads
    assert model.n_cache_layers == 2 and model.cache_layer_of == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="warmup"):
        LCKVConfig(LlamaConfig(n_layers=2), warmup_bottom=2, warmup_top=1)


def test_init_from_llama_checkpoint():
    transformers = pytest.importorskip("transformers")
    from kvmodels.loading import from_transformers, llama_config_to_hf

    lc = LlamaConfig(vocab_size=50, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=48,
                     max_seq_len=64)
    torch.manual_seed(0)
    hf = widen(transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_to_hf(lc))))
    llama: Llama = from_transformers(hf).to(DEVICE)
    seq = torch.randint(0, 50, (10,), device=DEVICE)
    # All layers warmup: LCKV is exactly the Llama it came from (the weight map is right).
    same = LCKV.from_llama(llama, warmup_bottom=2, warmup_top=2)
    with torch.no_grad():
        torch.testing.assert_close(same.prefill(seq, None, 0, iterations=1), llama.prefill(seq, None, 0))
    # Sandwich: condensed layers drop their K/V weights and the model runs end to end.
    lckv = LCKV.from_llama(llama, warmup_bottom=1, warmup_top=1)
    n_params = sum(p.numel() for p in lckv.parameters())
    dropped = 2 * 2 * lc.n_kv_heads * lc.head_dim * lc.dim  # K and V of the two condensed layers
    assert n_params == sum(p.numel() for p in llama.parameters()) - dropped
    res = generate(lckv, [seq.tolist(), [1, 2]], 4)
    assert [len(t) for t in res.tokens] == [4, 4]


@pytest.mark.parametrize("spec", [("streaming",), ("squeeze", "h2o")])
def test_policies_on_lckv_cache_layers(spec):
    model = tiny(1, 1, n_layers=5)
    policy = compose(*spec, budget=0.5, **({"streaming": {"sinks": 1}} if spec == ("streaming",) else {}))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [2, 7, 1, 8, 2], [4]]
    res = generate(model, prompts, 5, policy)
    assert len(res.report.bytes_per_layer) == 2
    budgets = torch.tensor(res.report.layer_budgets)  # [Lc, B]
    assert torch.equal(budgets.sum(0), 2 * torch.tensor([max(policy.floor, -(-len(p) // 2))
                                                         for p in prompts]))


def moby_dick_bytes(n: int) -> torch.Tensor:
    """The first ``n`` bytes of Moby-Dick ch. 1 (public domain; ``evals/data``)."""
    raw = gzip.decompress(TEXT_PATH.read_bytes())
    return torch.tensor(list(raw[:n]), dtype=torch.int64)


@pytest.mark.slow
def test_training_on_english_text_lowers_the_loss():
    torch.manual_seed(0)
    lc = LlamaConfig(vocab_size=256, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=64,
                     max_seq_len=64)
    model = LCKV(LCKVConfig(lc, warmup_bottom=1, warmup_top=1, forward_iterations=3, backward_iterations=2))
    data = moby_dick_bytes(8 * 64 * 8).view(-1, 64)  # [64, 64] byte sequences
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.no_grad():
        before = float(model.loss(data[:8]))
    for step in range(40):
        train_step(model, opt, data[8 + (step % 7) * 8: 16 + (step % 7) * 8])
    with torch.no_grad():
        after = float(model.eval().loss(data[:8]))
    assert after < before - 1.0, (before, after)
