"""The two quantization studies of experiments/ at tiny settings: ``kivi_channel_keys`` (per-channel keys
simulated) rounds each channel's group of consecutive tokens to one scale and zero point and touches only
KIVI's quantized slots; ``hf_kivi_perplexity`` (perplexity of a transformers model on the paged cache) gives,
for the full cache, the perplexity of one plain forward over the same tokens."""

from __future__ import annotations

import math

import pytest
import torch

from experiments import kivi_channel_keys as kc
from kvkernels.quant import dequantize, quantize
from kvmodels.decoder import Decoder
from kvpolicies import compose
from test_generate import V, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def test_per_channel_round_trip_shares_a_scale_per_channel_and_group_of_tokens():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(32, 2, 16, generator=g) * torch.linspace(0.1, 8, 16)  # [tokens, heads, channels]
    per_channel = kc.round_trip(k.unflatten(0, (4, 8)), 2, 8, 1).flatten(0, 1)
    for grp in range(4):
        for h in range(2):
            for c in range(16):
                x = k[grp * 8:(grp + 1) * 8, h, c]
                want = dequantize(quantize(x[None], 2, 8), 2, 8)[0]  # one channel's 8 tokens as one row
                assert torch.equal(per_channel[grp * 8:(grp + 1) * 8, h, c], want)
    per_token = kc.round_trip(k, 2, 8, -1)
    assert torch.equal(per_token, dequantize(quantize(k, 2, 8), 2, 8))
    assert not torch.equal(per_token, per_channel)


@pytest.mark.parametrize("keys", ["token", "channel"])
def test_only_kivis_quantized_slots_change(keys):
    model = tiny_llama(n_layers=2, n_heads=4, n_kv_heads=2)
    prompt = torch.randint(0, V, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    dec = Decoder(model, compose("full"))
    dec.extend([prompt])
    cache = dec.cache
    before = [cache.layer_contents(l, 0) for l in range(cache.n_layers)]
    done = kc.quantize_cache(cache, 0, 4, 8, 5, keys)
    assert done == (29 - 5) // 8 * 8  # KIVI's rule: whole groups older than the residual
    for l in range(cache.n_layers):
        after = cache.layer_contents(l, 0)
        for x in ("k", "v"):
            assert torch.equal(after[x][done:], before[l][x][done:])  # the residual untouched
            assert not torch.equal(after[x][:done], before[l][x][:done])
            torch.testing.assert_close(after[x][:done], before[l][x][:done], rtol=0, atol=0.5)


def test_bytes_share_counts_codes_parameters_and_residual():
    # 20 kept tokens, residual 4, group 8, head dim 64: 16 packed at 2 bits (a K or V row: 16 B of codes and
    # 8 float16 scale / zero pairs, 32 B), the other 4 in float16 (256 B a K/V pair)
    share = kc.bytes_share(2, 8, 4, "channel", 20, 64)
    assert share == pytest.approx((16 * 2 * (16 + 32) + 4 * 256) / (20 * 256))
    assert kc.bytes_share(16, 32, 0, "none", 20, 64) == 1.0


def test_transformers_perplexity_of_the_full_cache_is_one_forwards():
    transformers = pytest.importorskip("transformers")
    from experiments.hf_kivi_perplexity import perplexity

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    tokens = torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0]
    nll = -logits[:-1].log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None]).mean()
    got = perplexity(model, tokens, "full", prefill=8)
    assert got["ppl"] == pytest.approx(math.exp(float(nll)), rel=1e-4)
    quantized = perplexity(model, tokens, "full+kivi(bits=2, group=8, residual=4)", prefill=8)
    assert quantized["ppl"] != got["ppl"] and quantized["kv_bytes"] < got["kv_bytes"]
