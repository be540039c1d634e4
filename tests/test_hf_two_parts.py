"""Two parts per layer in the transformers bridge (packed rows beside tokens in the cache's dtype), as
kvmodels' two-format cache holds them (``SideRegion``): KIVI's residual (``kivi(residual=R)``: each
sequence's newest tokens as they came, the older packed; the split after the prompt, then ``age`` after each
step and extension) and MiKV (``mikv(high=16)``: the kept tokens as they came, the ones the eviction drops
packed at ``low`` bits, at the prompt's compression and, demoted, while decoding).

On the tiny models of tests/test_hf_bridge.py (head dim 16), against ``kvmodels.decoder.Decoder`` on the same
weights, with generations long enough for the residual to age:
* the same generated tokens, the same positions in each part (packed / in the cache's dtype) per sequence,
  layer and KV head; the first layer's packed prompt rows bit for bit, every packed row read back within one
  step of the format (deeper layers' and decoded tokens' K/V come from two attentions that round differently);
* under eviction while decoding KIVI's packed part gives up tokens, its residual stays whole; MiKV loses none;
* a question after the context (an extension) is kept whole and ages, as kvmodels' ``end_extend``;
* the report counts both parts' bytes; what the bridge does not combine with two parts is refused by name.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvkernels.quant import unpack  # noqa: E402
from kvmodels.decoder import Decoder  # noqa: E402
from kvpolicies import compose  # noqa: E402
from test_hf_bridge import model_of, prompts, run  # noqa: E402
from test_hf_kvzip import in_house  # noqa: E402
from test_hf_quant import ask_after_context  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 20  # more decode steps than a group (16): the residual ages at least once
SPECS = [
    ("full+kivi(bits=4, group=8, residual=2)", 1.0),
    ("snapkv(window=3)+kivi(bits=2, group=16, residual=3)", 0.5),
    ("snapkv(window=3, per_head=False)+kivi(bits=4, group=8, residual=5, channel_scale=True)", 0.6),
    ("chunkkv(window=3, chunk=2)+kivi(bits=8, group=16, residual=4)", 0.5),
    # eviction while decoding: the packed part gives up tokens, the residual stays whole (SideRegion.evict)
    ("h2o+kivi(bits=4, group=8, residual=2)", 0.5),
    ("tova(per_head=False)+kivi(bits=2, group=16, residual=3)", 0.5),
    ("streaming(sinks=2)+kivi(bits=4, group=8, residual=3)", 0.5),
    ("a2sf(decay=0.9)+kivi(bits=8, group=8, residual=2)", 0.4),
]
KINDS = ["llama", "smollm2", "gptj"]


def policy_of(spec: str, budget: float):
    first, *rest = spec.split("+")
    return compose(first, *rest, budget=budget)


def model(kind: str) -> torch.nn.Module:
    return model_of(kind, "sdpa" if kind in ("llama", "smollm2") else "eager")


def parts(cache, l: int, b: int) -> tuple[list[list[int]], list[list[int]], torch.Tensor, torch.Tensor]:
    """The bridge's layer ``l``, sequence ``b``: per KV head the packed tokens' positions and the others',
    and the packed K/V rows ``[H, n, W]``, each part in position order (MiKV's packed part takes tokens as
    they are evicted)."""
    layer = cache.layers[l]
    nq = layer.low_k.shape[2]
    valid = layer.head_valid()[b]  # [H, N]
    low, rest = valid[:, :nq], valid[:, nq:]
    pos = layer.positions[b]
    H = pos.shape[0]
    packed = torch.stack([pos[h, :nq][low[h]] for h in range(H)])  # [H, n], slot order
    order = packed.argsort(dim=-1)
    others = [sorted(pos[h, nq:][rest[h]].tolist()) for h in range(H)]
    rows = (torch.stack([x[b, h][low[h]] for h in range(H)]) for x in (layer.low_k, layer.low_v))
    rows_k, rows_v = (x.gather(1, order[..., None].expand_as(x)) for x in rows)
    return packed.gather(1, order).tolist(), others, rows_k, rows_v


def in_house_parts(dec: Decoder, l: int, b: int):
    """kvmodels' layer ``l``, sequence ``b``: the side region's positions per KV head and its packed rows
    ``[H, n, W]`` in position order (decode-time eviction fills holes, so its slots may be out of order), and
    the main region's positions."""
    cache = dec.cache
    page, off = cache.side.slots(l, b)
    side_pos = cache.side.pool.slot_pos[page, off].t().long()  # [H, n] slot order
    order = side_pos.argsort(dim=-1)
    main = [sorted(d["pos"].tolist()) for d in cache.head_contents(l, b)]
    pool = cache.side.pool
    rows = (pool.k_pages[page, off].transpose(0, 1), pool.v_pages[page, off].transpose(0, 1))
    rows_k, rows_v = (x.gather(1, order[..., None].expand_as(x)) for x in rows)
    return side_pos.gather(1, order).tolist(), main, rows_k, rows_v


def check_same_parts(cache, dec: Decoder, batch: list[list[int]]) -> None:
    for b, p in enumerate(batch):
        for l in range(len(cache.layers)):
            packed, others, ours_k, ours_v = parts(cache, l, b)
            side, main, ref_k, ref_v = in_house_parts(dec, l, b)
            assert packed == side, (l, b)
            assert others == main, (l, b)
            for ours, ref in ((ours_k, ref_k), (ours_v, ref_v)):
                if l == 0:  # the prompt's first-layer K/V come from the embeddings alone: the same bytes
                    prompt = torch.tensor(side[0]) < len(p)
                    assert torch.equal(ours[:, prompt], ref[:, prompt]), (l, b)
                # Past the first layer (and for decoded tokens) the K/V come from hidden states that the two
                # attentions (transformers', kvmodels') round differently: a parameter may differ by an ulp
                # and a code at a rounding boundary by one level. Read back, within one step of the format.
                got, want = (cache.rows.decode(x, torch.float32) for x in (ours, ref))
                step = unpack(ref, cache.rows.head_dim, cache.rows.fmt).scale.float()
                step = step.repeat_interleave(cache.rows.fmt.group, dim=-1)  # [H, n, D]
                assert bool(((got - want).abs() <= 1.01 * step + 1e-4).all()), (l, b)


def generate_as_kvmodels(hf_model, policy, batch: list[list[int]]):
    """Greedy generate through the bridge and with kvmodels: the same tokens, the same parts; the cache."""
    tokens, cache = run(hf_model, batch, policy, new=NEW)
    dec = Decoder(in_house(hf_model), policy)
    dec.extend(batch)
    assert tokens == dec.generate(NEW).tokens
    check_same_parts(cache, dec, batch)
    return cache


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec,budget", SPECS)
def test_splits_ages_and_generates_as_kvmodels(kind, spec, budget):
    policy, batch = policy_of(spec, budget), prompts([14, 9], seed=5)
    cache = generate_as_kvmodels(model(kind), policy, batch)
    residual = policy.precision.residual
    for layer in cache.layers:  # the residual aged: at most residual + group wait, and some were packed late
        waiting = layer.head_valid()[..., layer.low_k.shape[2]:].sum(-1)
        assert int(waiting.max()) <= residual + policy.precision.group
        assert int(layer.positions[..., :layer.low_k.shape[2]].amax()) >= len(batch[0])  # a decoded token
    rep = cache.report()
    assert rep.quantized and f"newest {residual} to {residual + policy.precision.group} tokens" in rep.rows


def test_the_report_counts_both_parts():
    policy, hf_model = policy_of(*SPECS[0]), model("llama")
    _, cache = run(hf_model, prompts([14, 9], seed=5), policy, new=NEW)
    rep = cache.report()
    for l, layer in enumerate(cache.layers):
        want = sum(t.numel() * t.element_size() for t in (layer.low_k, layer.low_v, layer.keys, layer.values))
        assert int(rep.bytes_per_layer[l]) == want
        assert layer.low_k.dtype == torch.uint8 and layer.keys.dtype == torch.float32
    fp32 = 2 * 16 * 4  # a K and a V row of head dim 16 in float32
    tokens = int(rep.tokens_per_layer.sum())
    assert rep.total_bytes < 0.5 * tokens * fp32 * cache._family.n_kv_heads  # mostly 4-bit rows


MIKV_SPECS = [
    ("snapkv(window=3)+mikv(group=8)", 0.4),  # the prompt's evicted tokens at 2 bits
    ("h2o+mikv(low=4, group=8)", 0.5),  # and what it evicts while decoding
    ("tova(per_head=False)+mikv(group=16, low=8)", 0.5),
    ("streaming(sinks=2)+mikv(group=8, channel_scale=True)", 0.4),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec,budget", MIKV_SPECS)
def test_mikv_keeps_what_it_evicts_packed_as_kvmodels(kind, spec, budget):
    """MiKV (``high=16``): the tokens the eviction keeps in the cache's dtype, the ones it drops (at the
    prompt's compression, then while decoding) packed at ``low`` bits instead: the same tokens in each part as
    kvmodels' two regions, none lost."""
    policy, batch = policy_of(spec, budget), prompts([14, 9], seed=5)
    cache = generate_as_kvmodels(model(kind), policy, batch)
    for b, p in enumerate(batch):  # nothing left the cache: every token is in one part or the other
        for l in range(len(cache.layers)):
            packed, others, _, _ = parts(cache, l, b)
            for h in range(len(packed)):
                assert sorted(packed[h] + others[h]) == list(range(len(p) + NEW - 1))
    assert "evicted ones as" in cache.report().rows


@pytest.mark.parametrize("kind", ["llama", "gptj"])
@pytest.mark.parametrize("spec,budget", [SPECS[1], SPECS[4], MIKV_SPECS[1]])
def test_question_after_context_is_kept_whole_and_ages_as_kvmodels(kind, spec, budget):
    policy, hf_model = policy_of(spec, budget), model(kind)
    contexts, questions = prompts([20, 13], seed=7), prompts([12, 6], seed=8)
    cache, dec = ask_after_context(hf_model, policy, contexts, questions, NEW)
    check_same_parts(cache, dec, [c + q for c, q in zip(contexts, questions, strict=True)])


@pytest.mark.parametrize("spec,names", [
    ("keyformer+kivi(group=8, residual=4)", ["'keyformer'", "Gumbel noise", "residual=0"]),
    ("kvzip+kivi(group=8, residual=4)", ["'kvzip'", "reconstruction pass", "residual=0"]),
    ("snapkv+pooled+kivi(group=8, residual=4)", ["'pooled'", "own budget", "residual=0"]),
    ("snapkv+zipcache(group=8)", ["'zipcache'", "two packed formats", "kvmodels"]),
    ("snapkv+mikv(high=4, group=8)", ["'mikv'", "two packed formats", "mikv(high=16)", "kvmodels"]),
    ("kvzip+mikv(group=8)", ["'kvzip'", "reconstruction pass", "kivi(bits=...)"]),
])
def test_what_the_bridge_does_not_combine_with_a_residual_is_refused_by_name(spec, names):
    policy = policy_of(spec, 0.5)
    with pytest.raises(ValueError) as e:
        policy.hf_cache(model("llama"))
    for name in names:
        assert name in str(e.value)
