"""kvzip: the question-agnostic policy that ranks a context by a reconstruction pass (the context fed again
after itself). Kept set == forced slots + top-k of a dense oracle's attention; kept K/V == the full cache's;
the probe stores nothing (lengths, positions, generation unchanged); the vLLM plugin, two
formats, merging and per-head budgets refuse it by name; compose and its spec take it."""

from __future__ import annotations

import pytest
import torch

from devices import DEVICE
from kvkernels import prefill_attention
from kvmodels.decoder import Decoder
from kvpolicies import compose
from test_generate import V, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = tiny_llama(seed=3)


def context(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n,), generator=g).tolist()


def oracle_scores(model, ctx: list[int], prefix: list[int] = ()) -> list[torch.Tensor]:
    """Per layer, ``[Hkv, L]``: the dense causal forward of ``ctx + prefix + ctx``; each first-copy key's
    largest softmax probability from any later query row (the prefix's and the copy's) and any query head of
    its KV group (the reconstruction pass's scores, computed without the cache)."""
    return _pass_scores(model, ctx, list(prefix) + ctx)


def expected_kept(scores: torch.Tensor, budget: int, n_sink: int, n_recent: int) -> list[list[int]]:
    """Per KV head, the kept positions: the forced first / last tokens plus the top of the rest (ties: the
    earlier token)."""
    H, L = scores.shape
    kept = []
    for h in range(H):
        forced = set(range(n_sink)) | set(range(L - n_recent, L))
        rest = [j for j in range(L) if j not in forced]
        rest.sort(key=lambda j: (-float(scores[h, j]), j))
        kept.append(sorted(forced | set(rest[:budget - len(forced)])))
    return kept


@pytest.mark.parametrize("spec", ["kvzip", "kvzip(sinks=1, recent=2)"])
def test_kept_set_is_the_top_of_the_reconstruction_oracle(spec):
    ctx = context(40)
    dec = Decoder(MODEL, compose(spec, budget=0.5))
    dec.extend([ctx])
    cache = dec.cache
    oracle = oracle_scores(MODEL, ctx)
    budgets, n_sink, n_recent = (x[:, 0].tolist() for x in cache.plan.rows)
    for l in range(MODEL.n_cache_layers):
        assert budgets[l] < len(ctx)  # compressed
        got = cache.layer_contents(l, 0)
        assert got["pos"].shape[0] == budgets[l]
        want = expected_kept(oracle[l], budgets[l], n_sink[l], n_recent[l])
        for h, positions in enumerate(want):
            assert got["pos"][:, h].tolist() == positions, (l, h)
            # the stored scores are the probe's, replaced (not added to the prefill's)
            torch.testing.assert_close(got["score"][:, h], oracle[l][h, positions], rtol=1e-4, atol=1e-5)


def test_kept_kv_identical_to_the_full_cache():
    """The kept tokens' K/V are the uncompressed cache's at the same positions: bit for bit against a cache
    that scores its prompt and keeps every token (h2o at budget 1.0: the same prefill attention), and to
    float rounding against ``full``, whose unscored prefill attention rounds differently from layer 1 on."""
    ctx = context(40, seed=1)
    dec = Decoder(MODEL, compose("kvzip", budget=0.3))
    dec.extend([ctx])
    for ref_policy, exact in (("h2o", True), ("full", False)):
        ref_dec = Decoder(MODEL, compose(ref_policy, budget=1.0))
        ref_dec.extend([ctx])
        for l in range(MODEL.n_cache_layers):
            ref, got = ref_dec.cache.layer_contents(l, 0), dec.cache.layer_contents(l, 0)
            assert ref["pos"].shape[0] == len(ctx) > got["pos"].shape[0]
            for h in range(got["pos"].shape[1]):
                pos = got["pos"][:, h].long()
                for name in ("k", "v"):
                    if exact or l == 0:
                        assert torch.equal(got[name][:, h], ref[name][pos, h]), (ref_policy, l, h, name)
                    else:
                        torch.testing.assert_close(got[name][:, h], ref[name][pos, h], rtol=0, atol=1e-5)


def test_probe_stores_nothing_and_generation_continues():
    ctx, question = context(30, seed=2), context(5, seed=9)
    dec = Decoder(MODEL, compose("kvzip", budget=0.4))
    dec.extend([ctx])
    assert dec.lengths == [len(ctx)]
    assert int(dec.cache.host.seen[0]) == len(ctx)
    budget = int(dec.cache.plan.rows.budgets[0, 0])
    assert int(dec.cache.seq_lens[0, 0]) == budget
    assert int(dec.cache.layer_contents(0, 0)["pos"].max()) <= len(ctx) - 1  # no probe token stored
    answer = dec.generate(4)
    assert len(answer.tokens[0]) == 4
    dec.extend([question])  # the pending token, then the question, at the positions after the context
    pos = dec.cache.layer_contents(0, 0)["pos"][:, 0]
    new = len(question) + 1 + 3  # three decoded tokens cached, the pending one, the question
    assert pos[-new:].tolist() == list(range(len(ctx), len(ctx) + new))
    assert len(dec.generate(3).tokens[0]) == 3


def test_full_budget_generates_as_the_full_cache():
    """At budget 1.0 the probe keeps everything: the tokens are the full cache's (nothing of the probe
    leaks into the positions, the lengths or the logits the first token is sampled from)."""
    ctxs = [context(20, seed=4), context(13, seed=5)]
    ref = Decoder(MODEL, compose("full"))
    ref.extend(ctxs)
    dec = Decoder(MODEL, compose("kvzip", budget=1.0))
    dec.extend(ctxs)
    assert dec.generate(6).tokens == ref.generate(6).tokens


def test_batch_compresses_each_sequence():
    ctxs = [context(36, seed=6), context(24, seed=7)]
    dec = Decoder(MODEL, compose("kvzip", budget=0.5))
    dec.extend(ctxs)
    for b, ctx in enumerate(ctxs):
        assert int(dec.cache.seq_lens[0, b]) == int(dec.cache.plan.rows.budgets[0, b]) < len(ctx)
        assert dec.lengths[b] == len(ctx)


def test_compose_and_spec():
    p = compose("kvzip", budget=0.2)
    assert p.name == "kvzip" and p.eviction.probe and not p.eviction.prefill_compress
    assert compose(p.spec()) == p
    assert compose(p.to_json()) == p
    q = compose("kvzip(sinks=2, recent=0)", budget=0.2)
    assert compose(q.spec()) == q and q.eviction.params() == {"sinks": 2, "recent": 0}
    assert int(p.budget_tokens(torch.tensor([100]))[0]) == 20  # compresses (not full's whole prompt)
    assert int(compose("full", budget=0.2).budget_tokens(torch.tensor([100]))[0]) == 100
    with pytest.raises(ValueError, match="kvzip: parameter sinks"):
        compose("kvzip(sinks=-1)")


def test_merge_refused():
    policy = compose("kvzip", "minicache", budget=0.5)  # composes (a plan may list it); the Decoder refuses
    dec = Decoder(tiny_llama(seed=3, n_layers=4), policy)
    with pytest.raises(NotImplementedError, match="'kvzip\\+minicache'.*reconstruction pass.*minicache"):
        dec.extend([context(20)])


MODEL4 = tiny_llama(seed=5, n_layers=4)


@pytest.mark.parametrize("heads", ["adakv", "pooled", "pooled(alpha=0.3)",
                                   "duo(weights=((1.0, 0.0), (0.0, 0.5), (0.2, 0.1), (0.9, 0.3)))"])
def test_per_head_budgets_split_the_reconstruction_scores(heads):
    """With per-head rows, each (layer, KV head) keeps its forced tokens and the top of the reconstruction
    oracle, at the budgets the head policy gives those oracle scores (``pooled``: over every layer at
    once; ``adakv``: within each layer); kept K/V bit-identical to the prompt's."""
    from test_pooled_heads import reference_pooled

    ctx = context(44, seed=12)
    policy = compose(f"kvzip+{heads}", budget=0.4)
    dec = Decoder(MODEL4, policy)
    dec.extend([ctx])
    cache = dec.cache
    oracle = oracle_scores(MODEL4, ctx)
    budgets, n_sink, n_recent = (x[:, 0].tolist() for x in cache.plan.layers)
    forced = list(zip(n_sink, n_recent))
    if policy.heads.pools_layers:
        want = reference_pooled([o.tolist() for o in oracle], budgets, policy.heads.alpha, forced)
    else:
        want = [policy.head_budgets(oracle[l], budgets[l], *forced[l], layer=l).tolist()
                for l in range(MODEL4.n_cache_layers)]
    got = [list(x[0]) for x in cache.report().head_tokens]
    assert got == want
    assert sum(map(sum, got)) == sum(budgets) * len(got[0])  # the layer budgets' total
    full = Decoder(MODEL4, compose("h2o", budget=1.0))
    full.extend([ctx])
    for l in range(MODEL4.n_cache_layers):
        ref = full.cache.layer_contents(l, 0)
        for h, head in enumerate(cache.head_contents(l, 0)):
            assert head["pos"].tolist() == expected_kept(oracle[l][h:h + 1], want[l][h], *forced[l])[0]
            pos = head["pos"].long()
            assert torch.equal(head["k"], ref["k"][pos, h]) and torch.equal(head["v"], ref["v"][pos, h])


def test_per_head_budgets_take_a_question_after_the_probe():
    """The probe splits once over the whole context; a question and a generation follow (nothing is
    evicted afterwards: every head keeps what it kept, plus the new tokens)."""
    ctx, question = context(40, seed=13), context(5, seed=14)
    dec = Decoder(MODEL4, compose("kvzip", "pooled", budget=0.3))
    dec.extend([ctx])
    kept = dec.cache.report().head_tokens
    budgets_after_probe = dec.cache.plan.rows.budgets.clone()  # [Lc, Hkv]: each head's budget
    dec.extend([question])
    res = dec.generate(4)
    assert len(res.tokens[0]) == 4
    after = dec.cache.report().head_tokens
    grew = len(question) + 4  # the question and the four generated tokens, the last still pending
    assert all(a - k == grew - 1 for ka, aa in zip(kept, after) for k, a in zip(ka[0], aa[0]))
    # the probe's split stays the sequence's head budgets (the question evicted nothing, so no new split)
    assert torch.equal(dec.cache.plan.rows.budgets, budgets_after_probe)
    with pytest.raises(NotImplementedError, match="'snapkv\\+pooled'.*token scores"):
        Decoder(MODEL4, compose("snapkv", "pooled", budget=0.5)).extend([ctx], chunk=16)


def test_two_formats_refused():
    dec = Decoder(MODEL, compose("kvzip", "kivi(group=8)", budget=0.5))
    with pytest.raises(NotImplementedError, match="kvzip.*two formats"):
        dec.extend([context(20)])


def test_prompt_must_fit_twice():
    dec = Decoder(MODEL, compose("kvzip", budget=0.5))
    with pytest.raises(ValueError, match="'kvzip'.*reconstruction pass"):
        dec.extend([context(MODEL.max_seq_len // 2 + 1)])


def test_probe_refused_for_other_policies():
    dec = Decoder(MODEL, compose("h2o", budget=0.5))
    dec.extend([context(10)])
    with pytest.raises(ValueError, match="'h2o'.*probe is False"):
        dec.cache.begin_extend(0, 3, probe=True)


def test_vllm_refuses_kvzip():
    from kvpolicies.vllm.config import PolicySpecError, check_supported

    with pytest.raises(PolicySpecError, match="'kvzip'.*reconstruction pass"):
        check_supported(compose("kvzip", budget=0.2))


def test_generate_runs_the_probe():
    from kvmodels.generate import generate

    ctxs = [context(24, seed=8), context(17, seed=10)]
    kept = generate(MODEL, ctxs, 5, compose("kvzip", budget=1.0)).tokens
    assert kept == generate(MODEL, ctxs, 5, compose("full")).tokens
    res = generate(MODEL, ctxs, 5, compose("kvzip", budget=0.3))
    assert [len(t) for t in res.tokens] == [5, 5]
    assert res.report.total_bytes < res.report.full_cache_bytes


@pytest.mark.parametrize("spec", ["kvzip", "kvzip+pooled"])
def test_chunked_prompt_is_probed_whole(spec):
    ctx = context(40, seed=11)
    dec = Decoder(MODEL, compose(spec, budget=0.4))
    dec.extend([ctx], chunk=16)
    assert dec.lengths == [len(ctx)] and int(dec.cache.host.seen[0]) == len(ctx)
    lens, budgets = dec.cache.host.lens[:, :dec.cache.rows.per_sequence], dec.cache.plan.rows.budgets
    assert (lens == budgets.numpy()).all() and (lens < len(ctx)).all()
    whole = Decoder(MODEL, compose(spec, budget=0.4))
    whole.extend([ctx])  # the same kept counts per row as compressing once (the probe saw the same tokens)
    assert (whole.cache.host.lens[:, :whole.cache.rows.per_sequence] == lens).all()
    assert len(dec.generate(3).tokens[0]) == 3


def test_probe_prefix_rows_score_the_context_too():
    """``probe_prefix`` (KVzip's instruction) is fed before the copy: the kept set is the top of the oracle
    over ``ctx + prefix + ctx``; nothing of it is stored; it is checked up front."""
    ctx, prefix = context(36, seed=15), context(6, seed=16)
    dec = Decoder(MODEL, compose("kvzip", budget=0.5), probe_prefix=prefix)
    dec.extend([ctx])
    oracle = oracle_scores(MODEL, ctx, prefix)
    budgets, n_sink, n_recent = (x[:, 0].tolist() for x in dec.cache.plan.rows)
    for l in range(MODEL.n_cache_layers):
        got = dec.cache.layer_contents(l, 0)
        want = expected_kept(oracle[l], budgets[l], n_sink[l], n_recent[l])
        assert [got["pos"][:, h].tolist() for h in range(len(want))] == want
    assert dec.lengths == [len(ctx)] and int(dec.cache.host.seen[0]) == len(ctx)
    bare = Decoder(MODEL, compose("kvzip", budget=0.5))
    bare.extend([ctx])
    assert not torch.equal(bare.cache.layer_contents(0, 0)["pos"], dec.cache.layer_contents(0, 0)["pos"])
    with pytest.raises(ValueError, match="probe_prefix.*'h2o' runs none"):
        Decoder(MODEL, compose("h2o", budget=0.5), probe_prefix=prefix)
    with pytest.raises(ValueError, match="probe_prefix must be a list of token ids"):
        Decoder(MODEL, compose("kvzip", budget=0.5), probe_prefix="Repeat")
    with pytest.raises(ValueError, match="after the 30 tokens of probe_prefix.*past the model's context"):
        Decoder(MODEL, compose("kvzip", budget=0.5), probe_prefix=context(30)).extend([context(40)])


def span_oracle(model, ctx: list[int], span: int, prefix: list[int] = ()) -> list[torch.Tensor]:
    """Per layer, ``[Hkv, L]``: KVzip's chunked reconstruction computed densely, one forward per pass: pass
    ``s`` (every ``span`` tokens) is ``ctx + prefix + ctx[s - OVERLAP : s + span]`` and gives the context
    tokens ``[s, s + span)`` their scores (the largest probability from any of its rows after the context)."""
    from kvpolicies.eviction.kvzip import OVERLAP

    out = None
    for s in range(0, len(ctx), span):
        scores = _pass_scores(model, ctx, list(prefix) + ctx[max(0, s - OVERLAP):s + span])
        out = [torch.zeros_like(x) for x in scores] if out is None else out
        for l, x in enumerate(scores):
            out[l][:, s:s + span] = x[:, s:s + span]
    return out


def _pass_scores(model, ctx: list[int], rows: list[int],
                 skip: tuple[int, int] | None = None) -> list[torch.Tensor]:
    """Per layer ``[Hkv, L]``: each context key's largest probability from the rows fed after it; with
    ``skip = (lo, hi)`` each row's probabilities renormalised without context keys ``[lo, hi)``, which score
    0 (kvzip(skip=))."""
    L = len(ctx)
    tokens = torch.tensor(ctx + rows, device=DEVICE)
    T = tokens.shape[0]
    positions = torch.arange(T, device=DEVICE)
    out = []
    with torch.no_grad():
        x = model.tok_embeddings(tokens)
        cos, sin = model._rope(positions, x.dtype)
        for layer in model.blocks:
            q, k, v = layer.qkv(x, cos, sin)
            Hq, Hkv = q.shape[1], k.shape[1]
            logits = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(Hq // Hkv, dim=1))
            causal = torch.ones(T, T, dtype=torch.bool, device=DEVICE).triu(1)
            probs = (logits * layer.scale).masked_fill(causal, float("-inf")).softmax(-1)
            if skip is not None:
                probs[:, :, skip[0]:skip[1]] = 0
                probs = probs / probs.sum(-1, keepdim=True)
            out.append(probs[:, L:, :L].amax(1).view(Hkv, Hq // Hkv, L).amax(1))
            attn, _ = prefill_attention(q, k, v, scale=layer.scale)
            x = x + layer.wo(attn.reshape(T, -1))
            x = x + layer.mlp(x)
    return out


def assert_top_of_oracle(dec, oracle: list[torch.Tensor]) -> None:
    """Every layer of sequence 0 keeps, per KV head, its forced slots plus the top of ``oracle``'s scores,
    and stores those scores."""
    budgets, n_sink, n_recent = (x[:, 0].tolist() for x in dec.cache.plan.rows)
    for l in range(MODEL.n_cache_layers):
        got = dec.cache.layer_contents(l, 0)
        want = expected_kept(oracle[l], budgets[l], n_sink[l], n_recent[l])
        assert [got["pos"][:, h].tolist() for h in range(len(want))] == want, l
        torch.testing.assert_close(got["score"], torch.stack([oracle[l][h, got["pos"][:, h].long()]
                                                              for h in range(len(want))], 1),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("span,prefix_len", [(16, 0), (10, 3), (7, 0)])
def test_span_reconstructs_in_parts(span, prefix_len):
    """``kvzip(span=N)``: one pass per span, each scoring its own span's tokens, the kept set the top of the
    dense per-pass oracle; a context too long to fit twice in the positions runs with a span (not without)."""
    ctx, prefix = context(60, seed=17), context(prefix_len, seed=18)
    with pytest.raises(ValueError, match=r"past the model's context of 96.*kvzip\(span=N\)"):
        Decoder(MODEL, compose("kvzip", budget=0.3), probe_prefix=prefix).extend([ctx])
    dec = Decoder(MODEL, compose(f"kvzip(span={span})", budget=0.3), probe_prefix=prefix)
    dec.extend([ctx])
    oracle = span_oracle(MODEL, ctx, span, prefix)
    assert_top_of_oracle(dec, oracle)
    assert dec.lengths == [len(ctx)] and int(dec.cache.host.seen[0]) == len(ctx)
    assert len(dec.generate(3).tokens[0]) == 3


def test_span_covering_the_context_is_one_pass():
    ctx = context(40, seed=19)
    one, spanned = Decoder(MODEL, compose("kvzip", budget=0.4)), Decoder(MODEL, compose("kvzip(span=40)",
                                                                                         budget=0.4))
    one.extend([ctx])
    spanned.extend([ctx])
    for l in range(MODEL.n_cache_layers):
        assert torch.equal(one.cache.layer_contents(l, 0)["pos"], spanned.cache.layer_contents(l, 0)["pos"])
    p = compose("kvzip(span=512)+pooled", budget=0.2)
    assert compose(p.spec()) == p and p.eviction.span == 512
    with pytest.raises(ValueError, match="kvzip: parameter span"):
        compose("kvzip(span=0)")


def test_span_with_pooled_head_budgets_and_bad_probe_argument():
    ctx = context(60, seed=20)
    dec = Decoder(MODEL4, compose("kvzip(span=20)+pooled", budget=0.3))
    dec.extend([ctx])
    budgets = dec.cache.plan.layers.budgets[:, 0]
    assert sum(map(sum, (x[0] for x in dec.cache.report().head_tokens))) == int(budgets.sum()) * 2  # Hkv 2
    with pytest.raises(TypeError, match="probe must be True, False or a ProbeSpan"):
        dec.cache.begin_extend(0, 3, probe="yes")


def skip_oracle(model, ctx: list[int], skip: int, sinks: int, span: int | None,
                prefix: list[int] = ()) -> list[torch.Tensor]:
    """Per layer ``[Hkv, L]``: kvzip(skip=) computed densely. The copy starts at ``skip``; every pass's rows
    are renormalised without keys ``[min(sinks, skip), skip)``, which score 0; the first pass scores every
    context position, a later one (``span``) its own span."""
    from kvpolicies.eviction.kvzip import OVERLAP

    hidden = (min(sinks, skip), skip)
    starts = [skip] if span is None else list(range(skip, len(ctx), span))
    out = None
    for s in starts:
        stop = len(ctx) if span is None else s + span
        scores = _pass_scores(model, ctx, list(prefix) + ctx[max(skip, s - OVERLAP):stop], hidden)
        out = [torch.zeros_like(x) for x in scores] if out is None else out
        lo = 0 if s == skip else s
        for l, x in enumerate(scores):
            out[l][:, lo:stop] = x[:, lo:stop]
    return out


@pytest.mark.parametrize("spec,skip,sinks,span,prefix_len", [
    ("kvzip(skip=6)", 6, 4, None, 0),
    ("kvzip(skip=6, sinks=2, recent=3)", 6, 2, None, 3),
    ("kvzip(skip=3)", 3, 4, None, 0),  # sinks past the opening: nothing is hidden, the copy still starts at 3
    ("kvzip(skip=6, span=12)", 6, 4, 12, 2),
])
def test_skip_leaves_the_template_opening_out(spec, skip, sinks, span, prefix_len):
    """``kvzip(skip=N)`` (kvpress's KVzip treats the chat template's opening so): the copy starts after the
    first N tokens, those past the sinks score 0 and are out of each row's normalisation; the kept set is the
    top of that dense oracle, with its scores stored."""
    ctx, prefix = context(44, seed=23), context(prefix_len, seed=24)
    dec = Decoder(MODEL, compose(spec, budget=0.3), probe_prefix=prefix)
    dec.extend([ctx])
    oracle = skip_oracle(MODEL, ctx, skip, sinks, span, prefix)
    assert_top_of_oracle(dec, oracle)
    for l in range(MODEL.n_cache_layers):
        assert bool((oracle[l][:, min(sinks, skip):skip] == 0).all())
        got = dec.cache.layer_contents(l, 0)
        if sinks < skip:  # the opening past the sinks is evicted first
            assert not bool(((got["pos"] >= sinks) & (got["pos"] < skip)).any()), l
    assert len(dec.generate(2).tokens[0]) == 2


def test_skip_with_pooled_budgets_and_bad_input():
    ctx = context(40, seed=25)
    dec = Decoder(MODEL4, compose("kvzip(skip=8)+pooled", budget=0.3))
    dec.extend([ctx])
    for l in range(MODEL4.n_cache_layers):
        for head in dec.cache.head_contents(l, 0):
            pos = head["pos"].tolist()
            assert pos[:4] == [0, 1, 2, 3] and not any(4 <= p < 8 for p in pos), (l, pos)
    p = compose("kvzip(skip=24, recent=0)+pooled", budget=0.2)
    assert compose(p.spec()) == p and p.eviction.probe_skip == (4, 24)
    assert compose("kvzip").eviction.probe_skip is None
    with pytest.raises(ValueError, match="kvzip: parameter skip"):
        compose("kvzip(skip=-1)")
    with pytest.raises(ValueError, match=r"tokens\[0\].*copies the prompt from token 8 on.*lower skip"):
        Decoder(MODEL, compose("kvzip(skip=8)", budget=0.5)).extend([context(8)])
