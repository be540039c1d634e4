"""The precision role (issue 36): KIVI, ZipCache and MiKV as policies composed by name beside eviction,
budget, heads and merge; each decides per (KV head, token) how many bits a token costs, checked against a
loop written for clarity; byte accounting agrees with kvkernels.quant's packed rows."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from kvkernels.quant import bytes_per_row
from kvpolicies import available, compose
from kvpolicies.base import NATIVE_BITS, token_bytes
from kvpolicies.precision import Kivi, MiKV, Native, ZipCache


def test_registered_and_composed_by_name():
    assert {r.name for r in available("precision")} == {"native", "kivi", "zipcache", "mikv"}
    p = compose("snapkv", "kivi", budget=0.2)
    assert p.name == "snapkv+kivi" and isinstance(p.precision, Kivi)
    assert compose("kivi", "squeeze", "h2o", budget=0.2).name == "squeeze+h2o+kivi"  # precision last
    assert compose("h2o", budget=0.2).precision == Native() and compose("h2o", budget=0.2).name == "h2o"
    for spec in [("snapkv", "kivi(bits=2, group=32, residual=64)"),
                 ("h2o", "zipcache(high=8, low=4, salient=0.25)"),
                 ("h2o", "mikv(high=8, low=2)"), ("full", "kivi"),
                 ("snapkv", "kivi(bits=2, residual=0, rotate=True)"), ("h2o", "zipcache(rotate=True)"),
                 ("h2o", "zipcache(every=10)"), ("h2o", "zipcache(every=0)")]:
        p = compose(*spec, budget=0.5)
        assert compose(p.spec()) == p and compose(p.to_json()) == p and compose(p.label, budget=0.5) == p
    assert compose("kivi").name == "kivi"  # quantization alone, every token kept


@pytest.mark.parametrize("spec,match", [
    ("kivi(bits=3)", "bits=3 must be one of 2, 4, 8"),
    ("kivi(group=24)", "group=24 must be a power of two"),
    ("kivi(residual=-1)", "residual"),
    ("zipcache(high=2, low=4)", "low=4 must be below high=2"),
    ("zipcache(salient=1.5)", "salient"),
    ("zipcache(every=-1)", "every=-1 is out of range"),
    ("mikv(low=16)", "low=16 must be one of 2, 4, 8"),
    ("mikv(high=5)", "high=5 must be one of 2, 4, 8, 16"),
    ("kivi(rotate=True)", "rotate=True stores rotated rows, but residual=128 .*use residual=0"),
    ("mikv(rotate=True)", "rotate=True stores rotated rows, but high=16 .*use high=8 or 4"),
    ("zipcache(high=16, rotate=True)", "but high=16"),
    ("kivi(residual=0, rotate=True, channel_scale=True)", "rotate=True and channel_scale=True: choose one"),
])
def test_bad_parameters_name_themselves(spec, match):
    with pytest.raises(ValueError, match=match):
        compose("h2o", spec)


def test_refused_compositions_say_what_to_use():
    with pytest.raises(ValueError, match="zipcache.*scores no prompt.*compose\\('h2o', 'zipcache'"):
        compose("streaming", "zipcache", budget=0.2)
    with pytest.raises(ValueError, match="cannot be composed with merge policy 'minicache'"):
        compose("h2o", "minicache", "kivi", budget=0.2)
    with pytest.raises(ValueError, match="both precision policies"):
        compose("kivi", "mikv")
    with pytest.raises(TypeError, match="parameter rotate must be True or False, got 1"):
        compose("kivi(residual=0, rotate=1)")


def assign_loop(policy, kept: torch.Tensor, scores: torch.Tensor | None, window: int = 0) -> torch.Tensor:
    """Per head, per token, as the papers describe it; ``window``: the prompt scores are the votes of the
    last ``window`` queries (0: of every query)."""
    H, L = kept.shape
    out = torch.zeros(H, L, dtype=torch.int64)
    for h in range(H):
        kept_idx = [i for i in range(L) if kept[h, i]]
        if isinstance(policy, Native):
            for i in kept_idx:
                out[h, i] = NATIVE_BITS
        elif isinstance(policy, Kivi):  # the last `residual` tokens the head keeps stay unquantized
            recent = set(kept_idx[-policy.residual:]) if policy.residual else set()
            for i in kept_idx:
                out[h, i] = NATIVE_BITS if i in recent else policy.bits
        elif isinstance(policy, MiKV):
            for i in range(L):
                out[h, i] = policy.high if kept[h, i] else policy.low
        else:  # ZipCache: saliency = score / (scoring queries that see the token); ties to the earlier token
            sal = {i: float(scores[h, i]) / (min(L - i, window) if window else L - i) for i in kept_idx}
            ranked = sorted(kept_idx, key=lambda i: (-sal[i], i))
            n_high = math.ceil(len(kept_idx) * policy.salient - 1e-9)
            for r, i in enumerate(ranked):
                out[h, i] = policy.high if r < n_high else policy.low
    return out


POLICIES = [Native(), Kivi(), Kivi(bits=2, residual=3), Kivi(residual=0), MiKV(), MiKV(high=4, low=2),
            ZipCache(), ZipCache(high=16, low=4, salient=0.25), ZipCache(salient=0.0), ZipCache(salient=1.0)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.name}{p.params()}")
@given(H=st.integers(1, 3), L=st.integers(0, 20), seed=st.integers(0, 2**16), ties=st.booleans(),
       window=st.sampled_from([0, 1, 3, 8]))
def test_assign_equals_the_loop(policy, H, L, seed, ties, window):
    g = torch.Generator().manual_seed(seed)
    kept = torch.rand(H, L, generator=g) < 0.6
    scores = torch.randint(0, 3, (H, L), generator=g).float() if ties else torch.rand(H, L, generator=g)
    voters = (L - torch.arange(L)).clamp(max=window) if window else None
    got = policy.assign(kept, scores, voters=voters)
    assert got.dtype == torch.int64 and got.shape == (H, L)
    assert torch.equal(got, assign_loop(policy, kept, scores, window))
    assert set(got[got > 0].tolist()) <= set(policy.formats())  # each width a cache stores
    if isinstance(policy, ZipCache):  # its high bits: the salient share, what a cache's re-selection keeps
        assert (got == policy.high).sum(-1).tolist() == [policy.high_share(int(n)) for n in kept.sum(-1)]
    if not isinstance(policy, MiKV):
        assert bool((got[~kept] == 0).all())  # only MiKV keeps what eviction drops


def test_token_bytes_match_the_packed_rows():
    D, G = 64, 32
    bits = torch.tensor([[NATIVE_BITS, 4, 2, 0, 2], [8, 8, 0, 0, NATIVE_BITS]])
    want = 2 * (2 * D * 2 + bytes_per_row(D, 4, G) + 2 * bytes_per_row(D, 2, G) + 2 * bytes_per_row(D, 8, G))
    assert token_bytes(bits, D, G, dtype_bytes=2) == want
    # A fifth of the tokens at 4 bits costs about 5% of the fp16 cache (the arithmetic), with params.
    L = 1000
    kept = torch.arange(L)[None] % 5 == 0
    frac = token_bytes(Kivi(bits=4, residual=0).assign(kept, None), 128, 32, 2) / (2 * L * 128 * 2)
    assert 0.05 < frac < 0.07


def test_zipcache_needs_scores_at_assign():
    with pytest.raises(ValueError, match="ranks tokens by their attention scores"):
        ZipCache().assign(torch.ones(1, 4, dtype=torch.bool), None)


def test_the_paged_cache_refuses_what_it_cannot_store_by_name():
    """The paged cache stores one format (kivi, residual 0) with any eviction policy, those that update
    scores while decoding too (the quantized decode kernel fuses the update), and two formats (kivi's
    residual, zipcache, mikv) after a prompt-only compression or with eviction while decoding (Gumbel-scored
    keyformer too: its noise is hashed per logical slot of both regions); the rest is refused up front, each
    naming the fix."""
    from kvmodels.cache import PagedKVCache
    from kvmodels.decoder import Decoder
    from kvmodels.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=31, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, intermediate=32,
                              max_seq_len=64)).eval()
    Decoder(model, compose("h2o", "zipcache(group=8)", budget=0.5))  # re-compressed, low bits evicted
    Decoder(model, compose("h2o", budget=0.5))  # native precision: fine
    Decoder(model, compose("h2o", "kivi(residual=0, group=8)", budget=0.5))  # one format: scores fused
    for spec in ("kivi(residual=0, group=8)", "kivi(group=8)", "zipcache(group=8)", "mikv(group=8)"):
        Decoder(model, compose("snapkv", spec, budget=0.5))  # stored
    Decoder(model, compose("streaming", "kivi(residual=0, group=8)", budget=0.5))  # one format: evicts too
    fit = "does not fit this model: group=32 must be a positive divisor of the head dim 8"
    with pytest.raises(ValueError, match=fit):
        Decoder(model, compose("snapkv", "kivi(residual=0)", budget=0.5))
    wide = Llama(LlamaConfig(vocab_size=31, dim=24, n_layers=1, n_heads=2, n_kv_heads=1, intermediate=32,
                             max_seq_len=64)).eval()  # head dim 12: no Hadamard matrix of that size
    with pytest.raises(ValueError, match="does not fit this model: a Hadamard rotation needs a power-of-two "
                                         "head dim, got 12; use rotate=False"):
        Decoder(wide, compose("snapkv", "kivi(residual=0, group=4, rotate=True)", budget=0.5))

    def cache(*spec, rows="sequences"):
        return PagedKVCache(n_layers=2, n_kv_heads=1, head_dim=8, n_q_heads=2, max_batch=1, max_tokens=16,
                            policy=compose(*spec, budget=0.5), rows=rows)

    for ev in ("h2o", "streaming", "tova"):  # mikv: what they evict while decoding moves to its low bits
        cache(ev, "mikv(group=8)")
    for ev in ("h2o", "tova", "scissorhands", "a2sf"):  # zipcache: they evict its low bits
        cache(ev, "zipcache(group=8)")
    with pytest.raises(ValueError, match="never re-compresses \\(every=0\\), so under eviction 'h2o'"):
        cache("h2o", "zipcache(group=8, every=0)")
    cache("snapkv", "zipcache(group=8, every=0)")  # prompt-only: new tokens stay at the high bits
    for ev in ("streaming", "h2o", "tova", "scissorhands", "a2sf", "knorm"):  # kivi's residual: evicts too
        cache(ev, "kivi(group=8)")
    for spec in ("kivi(group=8)", "zipcache(group=8)", "mikv(group=8)"):  # both regions Gumbel-scored
        cache("keyformer", spec)
    cache("h2o", "kivi(residual=0, group=8)")  # one format: the quantized decode kernel fuses the scores
    cache("keyformer", "kivi(bits=2, residual=0, group=8)")
    with pytest.raises(ValueError, match="two formats, which the paged cache holds for one row per sequence"):
        cache("snapkv", "adakv", "kivi(group=8)", rows="heads")



class _OneDevice(TorchDispatchMode):
    """Fails at the first op that makes a tensor on a device other than ``device``."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device != self.device:
                raise AssertionError(f"{func} made a tensor on {t.device}, not {self.device}")
        return out


@pytest.mark.parametrize("policy", [Kivi(residual=2), MiKV(), ZipCache(), Native()], ids=lambda p: p.name)
def test_assign_stays_on_the_device_of_its_inputs(policy):
    """Every tensor ``assign`` makes lives on its inputs' device (``meta`` here, standing in for CUDA: run 10
    on an H200 found ZipCache ranking with a CPU ``arange``, which only a GPU run had caught)."""
    kept = torch.ones(2, 7, dtype=torch.bool, device="meta")
    scores = torch.rand(2, 7, device="meta")
    with _OneDevice("meta"):
        bits = policy.assign(kept, scores)
    assert bits.device.type == "meta" and bits.shape == (2, 7) and bits.dtype == torch.int64


def test_kivi_ages_its_residual_a_group_or_more_at_a_time():
    """``Kivi.aging(n)``: none of ``n`` waiting tokens until more than ``residual + group`` wait, then all but
    the newest ``residual``; the same for ints, numpy arrays and tensors (both caches ask it)."""
    import numpy as np

    k = Kivi(bits=4, group=8, residual=4)
    want = [0 if n <= 12 else n - 4 for n in range(30)]
    assert [int(k.aging(n)) for n in range(30)] == want
    assert k.aging(np.arange(30)).tolist() == want
    assert k.aging(torch.arange(30)).tolist() == want
    # what a cache sizes its unquantized pool by; the other precisions age nothing
    assert k.held_unquantized() == 12 and Kivi(residual=0).held_unquantized() == 0
    for p in (Kivi(residual=0), MiKV(), ZipCache(), Native()):
        assert p.held_unquantized() == 0 and p.aging(np.arange(30)).tolist() == [0] * 30
    assert [p.reselects for p in (k, MiKV(), ZipCache(), Native())] == [False, False, True, False]


@given(total=st.integers(1, 12), keep=st.integers(0, 12), sink=st.integers(0, 4), recent=st.integers(0, 4),
       heads=st.integers(1, 3), seed=st.integers(0, 2**16), ties=st.booleans())
def test_mikv_demotes_each_heads_lowest_ranked_but_the_forced_ties_to_the_older(total, keep, sink, recent,
                                                                                heads, seed, ties):
    """``MiKV.demoted`` (both caches ask it): per KV head the ``total - keep`` lowest-ranked tokens, the first
    ``sink`` and last ``recent`` never, the older first among equal ranks; against a loop over the tokens."""
    keep = min(keep, total)
    sink = min(sink, keep)
    recent = min(recent, keep - sink)
    g = torch.Generator().manual_seed(seed)
    rank = torch.randint(0, 3, (total, heads), generator=g).float() if ties else torch.rand(total, heads,
                                                                                            generator=g)
    got = MiKV().demoted(rank, keep, sink, recent)
    assert got.shape == (total - keep, heads)
    for h in range(heads):
        free = [i for i in range(total) if sink <= i < total - recent]
        want = sorted(sorted(free, key=lambda i: (float(rank[i, h]), i))[:total - keep])
        assert got[:, h].tolist() == want
