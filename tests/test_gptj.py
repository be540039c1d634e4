"""GPT-J against ``transformers.GPTJForCausalLM``: prefill logits (dense and through the paged cache) and
teacher-forced decoding of batched ragged sequences, for several rotary_dim / head counts."""

from __future__ import annotations

import pytest
import torch

from devices import DEVICE
from test_model_policy_matrix import teacher_forced, widen

transformers = pytest.importorskip("transformers")

from kvmodels.gptj import GPTJ, GPTJConfig, rotary_interleaved  # noqa: E402

CASES = [(2, 4, 8), (4, 2, 16), (3, 8, 8), (1, 6, 6)]  # (n_heads, rotary_dim, head_dim)


def tiny_pair(n_heads: int, rotary_dim: int, head_dim: int, seed: int = 0):
    cfg = transformers.GPTJConfig(vocab_size=61, n_positions=64, n_embd=n_heads * head_dim, n_layer=2,
                                  n_head=n_heads, rotary_dim=rotary_dim, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    hf = widen(transformers.GPTJForCausalLM(cfg), seed=seed)
    return hf, GPTJ.from_hf(hf).to(DEVICE)


@pytest.mark.parametrize("case", CASES)
def test_prefill_and_decode_match_transformers(case):
    hf, ours = tiny_pair(*case)
    torch.manual_seed(1)
    seqs = [torch.randint(0, 61, (n,)) for n in (11, 4, 7)]
    with torch.no_grad():
        want = [hf(s[None]).logits[0] for s in seqs]
        dense = [ours.prefill(s.to(DEVICE), None, 0).cpu() for s in seqs]
    got = teacher_forced(ours, seqs, [6, 1, 7])
    for w, d, g in zip(want, dense, got):
        torch.testing.assert_close(d, w, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_rotary_is_interleaved_and_partial():
    x = torch.randn(3, 2, 8)
    out = rotary_interleaved(x, torch.tensor([0, 1, 5]), 4)
    torch.testing.assert_close(out[0], x[0])                 # position 0: identity
    torch.testing.assert_close(out[..., 4:], x[..., 4:])     # dims past rotary_dim pass through
    # pair (0, 1) at position 1 rotates by angle 1 (inv_freq[0] = 1)
    c, s = torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0))
    torch.testing.assert_close(out[1, :, 0], x[1, :, 0] * c - x[1, :, 1] * s)
    torch.testing.assert_close(out[1, :, 1], x[1, :, 1] * c + x[1, :, 0] * s)


def test_from_pretrained_directory(tmp_path):
    hf, ours = tiny_pair(2, 4, 8)
    hf.save_pretrained(tmp_path)
    loaded = GPTJ.from_pretrained(str(tmp_path))
    t = torch.randint(0, 61, (9,))
    with torch.no_grad():
        torch.testing.assert_close(loaded.prefill(t, None, 0), ours.cpu().prefill(t, None, 0))


@pytest.mark.parametrize("kwargs, match", [(dict(rotary_dim=3), "rotary_dim"),
                                           (dict(rotary_dim=32), "rotary_dim"),
                                           (dict(n_heads=5), "divisible")])
def test_config_errors_name_the_field(kwargs, match):
    base = dict(vocab_size=10, n_layers=1, n_heads=2, hidden_size=16, rotary_dim=4, intermediate_size=8)
    with pytest.raises(ValueError, match=match):
        GPTJConfig(**{**base, **kwargs})
