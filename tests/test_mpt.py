"""MPT against ``transformers.MptForCausalLM`` (ALiBi slopes, prefill, decode), and ALiBi after eviction:
decoding over a compacted cache equals dense attention over the full sequence restricted, per layer and
KV head, to the tokens the cache kept, biased by their original positions."""

from __future__ import annotations

import pytest
import torch

from devices import DEVICE
from test_model_policy_matrix import teacher_forced, widen

transformers = pytest.importorskip("transformers")

from kvmodels.mpt import MPT, MPTConfig, alibi_slopes  # noqa: E402
from kvpolicies import compose  # noqa: E402


def tiny_pair(n_heads: int, clip_qkv=None, seed: int = 0):
    cfg = transformers.MptConfig(vocab_size=61, d_model=4 * n_heads, n_heads=n_heads, n_layers=2,
                                 max_seq_len=64, attn_config={"clip_qkv": clip_qkv})
    torch.manual_seed(seed)
    hf = widen(transformers.MptForCausalLM(cfg), seed=seed)
    return hf, MPT.from_hf(hf).to(DEVICE)


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 8, 12])
def test_slopes_match_transformers(n_heads):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    table = build_mpt_alibi_tensor(n_heads, 2)  # [H, 1, 2] = slope * (k - (L - 1))
    torch.testing.assert_close(alibi_slopes(n_heads), -table[:, 0, 0])


@pytest.mark.parametrize("n_heads, clip", [(3, None), (4, 0.3), (6, None)])
def test_prefill_and_decode_match_transformers(n_heads, clip):
    hf, ours = tiny_pair(n_heads, clip)
    torch.manual_seed(1)
    seqs = [torch.randint(0, 61, (n,)) for n in (12, 3, 8)]
    with torch.no_grad():
        want = [hf(s[None]).logits[0] for s in seqs]
        dense = [ours.prefill(s.to(DEVICE), None, 0).cpu() for s in seqs]
    got = teacher_forced(ours, seqs, [7, 1, 5])
    for w, d, g in zip(want, dense, got):
        torch.testing.assert_close(d, w, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def masked_forward(model: MPT, tokens: torch.Tensor, visible: list[torch.Tensor]) -> torch.Tensor:
    """Dense MPT over ``tokens [L]`` where layer ``l``'s query ``i`` of head ``h`` sees key ``j`` iff
    ``visible[l][h, i, j]``; ALiBi from the true positions. Written for clarity (the oracle); runs on the
    CPU."""
    model = model.cpu()
    c = model.config
    L = tokens.shape[0]
    pos = torch.arange(L)
    x = model.wte(tokens)
    for l, blk in enumerate(model.blocks):
        q, k, v = blk.qkv(x)
        logits = torch.einsum("ihd,jhd->hij", q, k) * model.scale
        logits = logits + model.alibi_slopes[:, None, None] * (pos[None, :] - pos[:, None])[None].float()
        p = torch.softmax(logits.masked_fill(~visible[l], float("-inf")), dim=-1)
        x = x + blk.out_proj(torch.einsum("hij,jhd->ihd", p, v).reshape(L, c.hidden_size))
        x = x + blk.mlp(x)
    return model.lm_head(model.norm_f(x))


@pytest.mark.parametrize("spec", [("streaming",), ("h2o",), ("tova",)])
def test_alibi_after_eviction_equals_full_cache_restricted_to_kept_tokens(spec):
    _, model = tiny_pair(4, seed=3)
    policy = compose(*spec, budget=6, **({"streaming": {"sinks": 2}} if spec[0] == "streaming" else {}))
    torch.manual_seed(4)
    prompt_len, n = 10, 17
    seq = torch.randint(0, 61, (n,))
    L_layers, H = model.config.n_layers, model.config.n_heads
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    visible = [causal[None].repeat(H, 1, 1) for _ in range(L_layers)]

    def before_step(cache, step):
        i = prompt_len + step  # the query's position; it sees the kept tokens and itself
        for l in range(L_layers):
            kept = cache.layer_contents(l, 0)["pos"].long().cpu()  # [n_kept, H] original positions
            row = torch.zeros(H, n, dtype=torch.bool)
            row.scatter_(1, kept.t(), True)
            row[:, i] = True
            visible[l][:, i] = row
    got = teacher_forced(model, [seq], [prompt_len], policy, before_step=before_step)[0]
    evicted = sum(int((~v[:, prompt_len:]).logical_and(causal[prompt_len:]).sum()) for v in visible)
    assert evicted > 0  # the cache really dropped tokens
    with torch.no_grad():
        want = masked_forward(model, seq, visible)
        full = model.prefill(seq, None, 0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got[prompt_len:], full[prompt_len:], atol=1e-3)  # eviction mattered


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="clip_qkv"):
        MPTConfig(clip_qkv=-1.0)
    with pytest.raises(ValueError, match="divisible"):
        MPTConfig(hidden_size=10, n_heads=3)
