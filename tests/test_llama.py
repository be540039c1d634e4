"""The in-house Llama against ``transformers.LlamaForCausalLM`` (the oracle), prefill and decode.

Random tiny configs drawn by Hypothesis: GQA ratios, odd head counts, RoPE scaling variants, tied and
untied embeddings. Decoding goes through a plain dense reference cache written here for clarity (the
protocol's oracle) and through the product ``PagedKVCache`` with the ``full`` policy. transformers runs
on the CPU (the oracle); the in-house model and its caches run on the suite's device.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from devices import DEVICE  # noqa: E402
from kvmodels.llama import Llama, LlamaConfig, rope_inv_freq  # noqa: E402
from kvmodels.loading import from_transformers, llama_config_to_hf  # noqa: E402
from kvpolicies.base import residual_cos_sim  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ROPE_SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
]


class DenseCache:
    """Reference cache: keeps every token of every sequence in a Python list (``full`` policy only)."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.cos_sim: dict[tuple[int, int], float] = {}

    def start(self, prompt_lens, max_new_tokens):
        self.k = [[None] * len(prompt_lens) for _ in range(self.n_layers)]
        self.v = [[None] * len(prompt_lens) for _ in range(self.n_layers)]

    def prefill_layer(self, l, b, q, k, v, positions, *, scale, alibi_slopes=None, lse=None):
        assert torch.equal(positions.cpu(), torch.arange(len(positions)))
        self.k[l][b], self.v[l][b] = k.clone(), v.clone()

    def prefill_attend(self, l, b, q, k, v, positions, *, scale):  # plain causal softmax attention
        self.prefill_layer(l, b, q, k, v, positions, scale=scale)
        L, g = q.shape[0], q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [L, Hq, D]
        logits = torch.einsum("ihd,jhd->hij", q, k) * scale
        future = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
        return torch.einsum("hij,jhd->ihd", torch.softmax(logits.masked_fill(future, float("-inf")), -1), v)

    def observe(self, l, b, h_in, attn_out):  # what squeeze reads from the observation point
        self.cos_sim[l, b] = float(residual_cos_sim(h_in, attn_out).mean())

    def finish_prefill(self):
        pass

    def append(self, l, k, v, positions, q=None):  # q: for open score rules, which this cache has none of
        for b in range(k.shape[0]):
            self.k[l][b] = torch.cat([self.k[l][b], k[b : b + 1]])
            self.v[l][b] = torch.cat([self.v[l][b], v[b : b + 1]])

    def attend(self, l, q, q_positions, *, scale, alibi_slopes=None):
        out = []
        for b in range(q.shape[0]):
            k, v = self.k[l][b], self.v[l][b]  # [T, Hkv, D]
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [T, Hq, D]
            p = torch.softmax(torch.einsum("hd,thd->ht", q[b], k) * scale, dim=-1)
            out.append(torch.einsum("ht,thd->hd", p, v))
        return torch.stack(out)  # [B, Hq, D]


def tiny_pair(seed: int, n_kv_heads: int, group: int, head_dim: int, n_layers: int, rope_scaling, tie: bool):
    """A random ``LlamaForCausalLM`` and the in-house model with its weights."""
    n_heads = n_kv_heads * group  # transformers needs dim % n_heads == 0
    config = LlamaConfig(vocab_size=61, dim=6 * n_heads, n_layers=n_layers, n_heads=n_heads,
                         n_kv_heads=n_kv_heads, head_dim=head_dim, intermediate=40, rope_theta=1000.0,
                         rope_scaling=rope_scaling, tie_embeddings=tie, max_seq_len=64)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_to_hf(config))).eval()
    # Default init gives near-uniform logits; widen the weights so differences would show.
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    ours = from_transformers(hf)
    assert ours.config == config
    return hf, ours.to(DEVICE)


configs = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16),
    "n_kv_heads": st.integers(1, 3),
    "group": st.sampled_from([1, 2, 3]),
    "head_dim": st.sampled_from([2, 4, 6, 8]),
    "n_layers": st.integers(1, 2),
    "rope_scaling": st.sampled_from(ROPE_SCALINGS),
    "tie": st.booleans(),
})


def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(tokens[None]).logits[0]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.cpu(), want, atol=2e-5 * want.abs().max().item() + 1e-6, rtol=1e-4)


@given(cfg=configs, length=st.integers(1, 40))
def test_prefill_logits_match_transformers(cfg, length):
    hf, ours = tiny_pair(**cfg)
    tokens = torch.randint(0, 61, (length,), generator=torch.Generator().manual_seed(cfg["seed"]))
    with torch.no_grad():
        got = ours.prefill(tokens.to(DEVICE), None, 0)
        last = ours.prefill(tokens.to(DEVICE), None, 0, last_only=True)
    want = hf_logits(hf, tokens)
    assert got.shape == (length, 61)
    assert_close(got, want)
    torch.testing.assert_close(last, got[-1:])


def _paged_cache(ours: Llama, n_seqs: int, max_tokens: int):
    from kvmodels.cache import PagedKVCache
    from kvpolicies import compose

    lay = ours.cache_layout()
    return PagedKVCache(n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads, head_dim=lay.head_dim,
                        n_q_heads=lay.n_q_heads, max_batch=n_seqs, max_tokens=max_tokens, page_size=4,
                        policy=compose("full"))


@pytest.mark.parametrize("cache_kind", ["dense", "paged"])
@given(cfg=configs, lens=st.lists(st.integers(1, 9), min_size=1, max_size=3), n_new=st.integers(1, 6))
def test_decode_through_cache_matches_transformers(cache_kind, cfg, lens, n_new):
    """Prefill ragged prompts, then decode teacher-forced tokens in one batch; each step's logits equal
    the full-sequence logits of transformers at that position."""
    hf, ours = tiny_pair(**cfg)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    seqs = [torch.randint(0, 61, (n + n_new,), generator=gen) for n in lens]
    cache = DenseCache(ours.n_cache_layers) if cache_kind == "dense" else _paged_cache(
        ours, len(lens), max(lens) + n_new)
    cache.start(lens, n_new)
    with torch.no_grad():
        for b, (seq, n) in enumerate(zip(seqs, lens)):
            got = ours.prefill(seq[:n].to(DEVICE), cache, b, last_only=True)
            assert_close(got, hf_logits(hf, seq[:n])[-1:])
        cache.finish_prefill()
        wants = [hf_logits(hf, seq) for seq in seqs]
        for step in range(n_new):
            if cache_kind == "paged":
                cache.prepare_decode(step)
            tokens = torch.stack([seq[n + step] for seq, n in zip(seqs, lens)]).to(DEVICE)
            positions = torch.tensor(lens, device=DEVICE) + step
            logits = ours.decode_step(tokens, positions, cache)
            if cache_kind == "paged":
                cache.after_step(step)
            for b, n in enumerate(lens):
                assert_close(logits[b], wants[b][n + step])


@given(cfg=configs, length=st.integers(1, 12))
def test_cos_sim_statistic_matches_transformers_hidden_states(cfg, length):
    """SqueezeAttention's statistic, recomputed from transformers' residual stream and attention output."""
    hf, ours = tiny_pair(**cfg)
    tokens = torch.randint(0, 61, (length,), generator=torch.Generator().manual_seed(cfg["seed"]))
    captured = {}  # forward hooks must return None, or they replace the module's output

    def keep_input(l):
        def hook(module, args, kwargs):
            captured["in", l] = kwargs["hidden_states"][0] if "hidden_states" in kwargs else args[0][0]
        return hook

    def keep_output(l):
        def hook(module, args, kwargs, output):
            captured["attn", l] = output[0][0]
        return hook

    for l, layer in enumerate(hf.model.layers):
        layer.register_forward_pre_hook(keep_input(l), with_kwargs=True)
        layer.self_attn.register_forward_hook(keep_output(l), with_kwargs=True)
    hf_logits(hf, tokens)
    cache = DenseCache(ours.n_cache_layers)
    cache.start([length], 1)
    with torch.no_grad():
        ours.prefill(tokens.to(DEVICE), cache, 0)
    for l in range(ours.n_cache_layers):
        h_in, attn = captured["in", l], captured["attn", l]
        want = torch.nn.functional.cosine_similarity(h_in, h_in + attn, dim=-1).mean().item()
        assert cache.cos_sim[l, 0] == pytest.approx(want, abs=1e-5)


def test_llama3_rope_scaling_bands():
    """High frequencies untouched, low frequencies divided by the factor, the band between in between."""
    base = LlamaConfig(vocab_size=8, dim=64, n_layers=1, n_heads=1, head_dim=64, intermediate=8,
                       rope_theta=500000.0)
    llama31 = {**ROPE_SCALINGS[2], "original_max_position_embeddings": 8192}  # Llama 3.1's values
    scaled = LlamaConfig(**{**base.to_dict(), "rope_scaling": llama31})
    f0, f1 = rope_inv_freq(base), rope_inv_freq(scaled)
    ratio = f0 / f1
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(8.0)
    assert bool(((ratio >= 1.0) & (ratio <= 8.0 + 1e-5)).all())
    assert bool((ratio[1:] >= ratio[:-1] - 1e-6).all())  # monotone in wavelength
    assert bool(((ratio > 1.0 + 1e-4) & (ratio < 8.0 - 1e-4)).any())  # a smooth band exists
    linear = LlamaConfig(**{**base.to_dict(), "rope_scaling": ROPE_SCALINGS[1]})
    torch.testing.assert_close(rope_inv_freq(linear), f0 / 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(n_heads=2, head_dim=3), "even"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_type 'yarn'"),
    (dict(dim=0), "dim"),
])
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{"vocab_size": 8, "dim": 8, "n_layers": 1, "n_heads": 2, "intermediate": 8, **kwargs})


def test_config_table():
    c = LlamaConfig.from_name("smollm2-135m")
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.tie_embeddings) == (9, 3, 64, True)
    assert LlamaConfig.from_name("llama-3.2-1b", n_layers=2).n_layers == 2
    with pytest.raises(ValueError, match="known: "):
        LlamaConfig.from_name("gpt-5")
