"""Head budgets in the transformers bridge (kvpolicies.hf): ``adakv``, ``pooled``, ``duo`` give each
(sequence, KV head) its own token count.

Checked on the tiny models of tests/test_hf_bridge.py (Llama, SmolLM2-shaped, GPT-J, MPT):
* the bridge keeps, per (sequence, layer, KV head), the positions kvmodels' ``HeadPagedKVCache`` keeps and
  generates the same tokens (prompt compression by ``snapkv``, decode-time eviction by ``h2o``, Keyformer's
  noise), with head counts that really differ, and reports the same per-head counts;
* a left-padded ragged batch keeps and generates what each sequence does alone;
* a layer is one ``[B, Hkv, longest head, D]`` tensor, smaller than the full cache;
* the attention over a per-head-compacted layer (the per-query-head mask) equals a dense reference that
  attends to each head's kept tokens only, and differs from one that ignores the per-head mask;
* what kvmodels refuses is refused: a forward of several tokens after the prompt with a split that reads the
  prompt's scores (``adakv``), a layer's contents as one tensor.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from devices import DEVICE  # noqa: E402
from kvpolicies import compose  # noqa: E402
from kvpolicies.hf.layer import Step  # noqa: E402
from test_hf_bridge import _IN_HOUSE, NEW, model_of, prompts, run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["llama", "smollm2", "gptj", "mpt"]
#: Retrieval scores per cache layer and KV head for ``duo`` (Llama: 3 x 2, SmolLM2: 2 x 2, GPT-J/MPT: 3 x 4).
DUO = {"llama": ((1.0, 0.0), (0.0, 0.5), (0.2, 0.1)), "smollm2": ((1.0, 0.0), (0.0, 0.5)),
       "gptj": ((1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.5, 0.0), (0.0, 0.3, 0.0, 0.0)),
       "mpt": ((1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.5, 0.0), (0.0, 0.3, 0.0, 0.0))}
SPECS = {
    "snapkv+adakv": lambda kind: compose("snapkv(window=4)", "adakv", budget=0.4),
    "snapkv+pooled": lambda kind: compose("snapkv(window=4)", "pooled", budget=0.4),
    "snapkv+duo": lambda kind: compose("snapkv(window=4)", ("duo", {"weights": DUO[kind], "fraction": 0.34}),
                                       budget=0.4),
    # decode-time eviction holding each head at its own budget
    "h2o+adakv": lambda kind: compose("h2o(recent=0.2)", "adakv", budget=0.4, evict_every=2),
    "tova+adakv": lambda kind: compose("tova(per_head=True)", "adakv(alpha=0.0)", budget=0.3, evict_every=2),
    "keyformer+adakv": lambda kind: compose("keyformer", "adakv", budget=0.5, seed=3),  # the same noise
}
BATCH = [24, 15]
#: H2O's accumulated prompt scores rank every KV head of these random models alike, so Ada-KV's split is even
#: there (a valid run, and still compared with kvmodels); under MPT's ALiBi it is not. ``tova+adakv`` covers
#: uneven decode-time eviction on every model.
EVEN_SPLIT = {("h2o+adakv", kind) for kind in ("llama", "smollm2", "gptj")}


def model(kind: str) -> torch.nn.Module:
    return model_of(kind, "sdpa" if kind in ("llama", "smollm2") else "eager")


def head_kept(cache, b: int) -> list[list[list[int]]]:
    """[layer][KV head] -> sorted original positions sequence ``b`` keeps."""
    return [[sorted(d["pos"].tolist()) for d in cache.head_contents(l, b)] for l in range(len(cache.layers))]


def in_house_heads(hf_model, batch, policy, monkeypatch, new: int = NEW):
    """kvmodels (eager, ``HeadPagedKVCache`` through ``paged_cache``) on the same weights: (tokens, kept
    [b][layer][head] sorted positions, report)."""
    import kvmodels.cache as kcache
    from kvmodels.generate import generate
    from kvmodels.gptj import GPTJ
    from kvmodels.loading import from_transformers
    from kvmodels.mpt import MPT

    snap: dict[int, list[list[list[int]]]] = {}

    class Recording(kcache.HeadPagedKVCache):
        def finish_sequence(self, b: int) -> None:  # before the pages go back to the pool
            snap[b] = [[sorted(d["pos"].tolist()) for d in self.head_contents(l, b)]
                       for l in range(self.n_layers)]
            super().finish_sequence(b)

    monkeypatch.setattr(kcache, "HeadPagedKVCache", Recording)
    if id(hf_model) not in _IN_HOUSE:  # one conversion per model, shared with test_hf_bridge
        build = {"GPTJForCausalLM": GPTJ.from_hf, "MptForCausalLM": MPT.from_hf}.get(
            type(hf_model).__name__, from_transformers)
        _IN_HOUSE[id(hf_model)] = build(hf_model)
    res = generate(_IN_HOUSE[id(hf_model)], batch, new, policy)
    return res.tokens, [snap[b] for b in range(len(batch))], res.report


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", list(SPECS))
def test_head_budgets_keep_what_kvmodels_keeps(kind, spec, monkeypatch):
    policy, hf_model = SPECS[spec](kind), model(kind)
    batch = prompts(BATCH, seed=7)
    tokens, cache = run(hf_model, batch, policy)
    ref_tokens, ref_kept, ref_report = in_house_heads(hf_model, batch, policy, monkeypatch)
    assert tokens == ref_tokens
    for b in range(len(batch)):
        assert head_kept(cache, b) == ref_kept[b], f"sequence {b}"
    rep = cache.report()
    assert rep.head_tokens.tolist() == [[list(h) for h in row] for row in ref_report.head_tokens]
    assert rep.tokens_per_layer.tolist() == [list(row) for row in ref_report.tokens_per_layer]
    # Not vacuous: the plan split some layer unevenly, and the heads really hold different counts.
    split = cache.plan.head_budgets
    uneven = (spec, kind) not in EVEN_SPLIT
    assert bool((split != split[..., :1]).any()) == uneven, split.tolist()
    assert bool((rep.head_tokens != rep.head_tokens[..., :1]).any()) == uneven
    assert rep.tokens_per_layer.dtype == torch.float64
    assert torch.allclose(rep.tokens_per_layer, rep.head_tokens.double().mean(-1))
    assert rep.head_budgets.tolist() == split.tolist() and len(str(rep).splitlines()) == len(cache.layers) + 2


@pytest.mark.parametrize("kind", ["llama", "mpt"])
@pytest.mark.parametrize("spec", ["snapkv+pooled", "h2o+adakv"])
def test_ragged_batch_equals_each_sequence_alone(kind, spec):
    policy, hf_model = SPECS[spec](kind), model(kind)
    batch = prompts([22, 9, 16], seed=5)
    tokens, cache = run(hf_model, batch, policy)
    for b, p in enumerate(batch):
        alone_tokens, alone = run(hf_model, [p], policy)
        assert tokens[b] == alone_tokens[0], f"sequence {b}"
        assert head_kept(cache, b) == head_kept(alone, 0), f"sequence {b}"
        assert cache.report().head_tokens[:, b].tolist() == alone.report().head_tokens[:, 0].tolist()


def test_layers_hold_each_heads_own_tokens_between_forwards_and_pad_only_for_one():
    """Between forwards a layer holds its heads' kept K/V ragged (each head its own count, no padding);
    a forward pads a layer to its longest head for transformers' attention, one layer at a time, which the
    peak counts."""
    hf_model = model("gptj")  # 4 KV heads
    batch = prompts(BATCH, seed=7)
    _, cache = run(hf_model, batch, SPECS["snapkv+pooled"]("gptj"))
    rep = cache.report()
    for l, layer in enumerate(cache.layers):
        keys, values = layer.dense()  # the padded view a forward reads
        B, H, n, D = keys.shape
        assert (B, H) == (2, 4) and layer.valid.shape == (B, H, n)
        assert n == int(rep.head_tokens[l].max())  # the longest head of the layer, no wider
        assert layer.keys.shape[2] == 0  # held ragged: no padded tensor kept
        kept = int(rep.head_tokens[l].sum())
        assert rep.bytes_per_layer[l] == 2 * kept * D * keys.element_size()
    # Every head holds its split share plus the NEW - 1 decoded tokens (snapkv evicts only the prompt).
    assert rep.head_tokens.tolist() == (cache.plan.head_budgets + NEW - 1).tolist()
    assert rep.total_bytes < rep.full_cache_bytes
    # One more decode step from here: while the last layer attends, the others hold their tokens ragged and it
    # is padded, which the peak counts (the prompt's peak, larger, is set aside).
    cache.peak_bytes = 0
    ids = torch.tensor([[5], [7]], device=DEVICE)
    mask = torch.ones(2, cache.get_seq_length() + 1, dtype=torch.int64, device=DEVICE)
    with torch.no_grad():
        hf_model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    rep = cache.report()
    padded = [2 * x.dense()[0].numel() * x.dense()[0].element_size() for x in cache.layers]
    extra = [p - int(b) for p, b in zip(padded, rep.bytes_per_layer, strict=True)]  # each layer's padding
    assert extra[-1] > 0  # the last layer's heads are uneven
    # At least the last layer's moment (each layer holding its new token); one layer padded at a time at most.
    assert rep.total_bytes + extra[-1] <= rep.peak_bytes <= rep.total_bytes + max(extra)


@pytest.mark.parametrize("kind", ["smollm2", "mpt"])
def test_attention_over_per_head_rows_attends_to_each_heads_tokens_only(kind):
    """One new query over a per-head-compacted layer through the bridge's mask (sdpa's bool mask, eager's
    additive one, MPT's "masked out" one) equals a dense loop over each KV head's kept tokens; a mask shared
    by the heads (the longest head's slots for every head) reads the shorter heads' stale padding slots and
    gives something else."""
    hf_model = model(kind)
    _, cache = run(hf_model, prompts(BATCH, seed=7), SPECS["snapkv+pooled"](kind))
    fam = cache._family
    G = fam.n_q_heads // fam.n_kv_heads
    counts = cache.report().head_tokens
    l = int(((counts != counts[..., :1]).any(-1).any(-1)).nonzero()[0])  # a layer whose heads differ
    layer = cache.layers[l]
    held_k, held_v = layer.dense()  # padded to the longest head, as a forward reads the layer
    B, H, N, D = held_k.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, 1, D, generator=g).to(DEVICE) for h in (fam.n_q_heads, H, H))
    cache.step = Step(torch.ones(B, 1, dtype=torch.bool, device=DEVICE),
                      torch.full((B, 1), 100, dtype=torch.int64, device=DEVICE))
    keys = torch.cat([held_k, k], dim=2).repeat_interleave(G, dim=1)  # [B, Hq, N + 1, D]
    values = torch.cat([held_v, v], dim=2).repeat_interleave(G, dim=1)
    logits = q @ keys.transpose(-1, -2) / math.sqrt(D)  # [B, Hq, 1, N + 1]

    def attend(allowed: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1) @ values

    outs = {"sdpa": attend(cache.layer_mask(layer, 1, "sdpa", q.dtype)),
            "mpt": attend(~cache.layer_mask(layer, 1, "mpt", q.dtype)),
            "eager": torch.softmax(logits + cache.layer_mask(layer, 1, "eager", q.dtype), -1) @ values}
    ref = torch.empty(B, fam.n_q_heads, 1, D, device=DEVICE)
    for b in range(B):
        for h, held in enumerate(cache.head_contents(l, b)):
            kk, vv = torch.cat([held["k"], k[b, h]]), torch.cat([held["v"], v[b, h]])  # [n_h + 1, D]
            for j in range(h * G, (h + 1) * G):
                ref[b, j] = torch.softmax(q[b, j] @ kk.t() / math.sqrt(D), dim=-1) @ vv
    for name, out in outs.items():
        torch.testing.assert_close(out, ref, msg=name)
    shared = torch.cat([layer.head_valid().any(1), torch.ones(B, 1, dtype=torch.bool, device=DEVICE)], -1)
    assert not torch.allclose(attend(shared[:, None, None, :]), ref)


def test_a_split_of_the_prompts_scores_refuses_a_second_forward_as_kvmodels_does():
    """adakv splits by the prompt's scores, which evicted tokens lose: a question after the context (a
    forward of several tokens after the prompt) is refused, as kvmodels.Decoder refuses extending; a single
    decode step goes on."""
    from kvmodels.decoder import Decoder
    from kvmodels.loading import from_transformers

    hf_model = model("llama")
    policy = SPECS["snapkv+adakv"]("llama")
    ctx, question = prompts([20, 4], seed=3)
    cache = policy.hf_cache(hf_model, max_new_tokens=4)
    ids = torch.tensor([ctx], device=DEVICE)
    with torch.no_grad():
        hf_model(input_ids=ids, past_key_values=cache, use_cache=True)
        with pytest.raises(NotImplementedError, match="several tokens after the prompt.*kvmodels.Decoder"):
            hf_model(input_ids=torch.tensor([question], device=DEVICE), past_key_values=cache, use_cache=True)
        hf_model(input_ids=torch.tensor([question[:1]], device=DEVICE), past_key_values=cache, use_cache=True)
    dec = Decoder(from_transformers(hf_model), policy)
    dec.extend([ctx])
    with pytest.raises(NotImplementedError, match="adakv"):
        dec.extend([question])
    # duo's split does not read the scores: the question goes through, as an extension (test_hf_extend.py):
    # re-planned from every token seen, each head compacted to its new budget
    duo = SPECS["snapkv+duo"]("llama").hf_cache(hf_model, max_new_tokens=4)
    with torch.no_grad():
        hf_model(input_ids=ids, past_key_values=duo, use_cache=True)
        before = duo.report().head_tokens[:, 0]
        hf_model(input_ids=torch.tensor([question], device=DEVICE), past_key_values=duo, use_cache=True)
    after = torch.minimum(duo.plan.head_budgets[:, 0], before + len(question))
    assert duo.report().head_tokens[:, 0].tolist() == after.tolist()


def test_a_layers_contents_as_one_tensor_are_refused_per_head():
    _, cache = run(model("llama"), prompts(BATCH, seed=7), SPECS["snapkv+adakv"]("llama"))
    for call in (cache.kept_positions, cache.layer_contents):
        with pytest.raises(TypeError, match="head_contents"):
            call(0, 0)
