"""Decode-time eviction's arithmetic without an engine: the kept lengths the scheduler frees blocks by and
the pieces / evictions the workers run, against a token-by-token simulation of the library's schedule
(``EvictionSchedule.evicts_after``), and one eviction in a CPU KV cache laid out by vLLM's own kernel."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
import torch

from kvpolicies import compose
from kvpolicies.vllm import decode_evicts, kept_lengths, prompt_budget
from kvpolicies.vllm.config import step_pieces


def held_tokens(kv_cache: torch.Tensor, blocks: torch.Tensor, n: int, part: int, isa: str) -> torch.Tensor:
    """The keys (``part`` 0) or values (1) of a request's first ``n`` slots, ``[n, Hkv, D]``, read one
    element at a time through the layout vLLM's kernel was measured to write (``slot_layout``), not through
    the plugin's own addressing."""
    from kvpolicies.vllm import backend

    nb, H, bs, two_d = kv_cache.shape
    D = two_d // 2
    offsets = backend.slot_layout(isa, kv_cache.dtype, bs, D)
    flat = kv_cache.view(nb, H, 2 * bs * D)
    return torch.stack([flat[blocks[j // bs], :, part * bs * D + offsets[part, j % bs]] for j in range(n)]
                       ) if n else kv_cache.new_zeros(0, H, D)


def library_positions(policy, L: int, T: int) -> list[list[int]]:
    """Positions held after each number of tokens processed ``t`` in ``[L, T]`` (index ``t - L``), token by
    token as the library's caches do for a selection with no scores: the prompt compressed to its plan's
    budget with the forced counts, then each decode step appends and, when ``evicts_after(step)``, every
    layer over its budget keeps its ``n_sink`` first and ``n_recent`` last tokens."""
    plan = policy.plan(torch.tensor([L]), 1, max_new_tokens=T - L)
    b, s, r = (int(x[0]) for x in plan.storage.row(0))
    held = list(range(L))
    if len(held) > b:
        held = held[:s] + held[len(held) - r:]
    out = [list(held)]
    for step, t in enumerate(range(L, T)):
        held.append(t)
        if plan.evicts_after(step) and len(held) > b:
            held = held[:s] + held[len(held) - r:]
        out.append(list(held))
    return out


SPECS = [("streaming", 0.2, 1), ("streaming", 0.2, 3), ("window", 0.3, 1), ("streaming", 40, 1),
         ("streaming", 40, 4), ("window", 33, 2), ("streaming", 0.5, 5)]


@pytest.mark.parametrize("name,budget,every", SPECS)
def test_kept_lengths_follow_the_library(name, budget, every):
    """For ragged prompts (shorter than the budget, at and around block borders), every step's held count
    equals the library's; blocks held (``cdiv(stored, 32)``) are what the scheduler keeps."""
    policy = compose(name, budget=budget, evict_every=every)
    assert decode_evicts(policy)
    for L in [1, 5, 20, 31, 32, 33, 40, 41, 64, 95, 130, 193]:
        lengths = kept_lengths(policy, L)
        assert (lengths.kept, lengths.n_sink, lengths.n_recent) == prompt_budget(policy, L)
        want = library_positions(policy, L, L + 90)
        for t in range(L, L + 91):
            assert lengths.stored(t) == len(want[t - L]), (L, t)
            assert lengths.dropped(t) == t - len(want[t - L])
            if t > L:
                assert lengths.evicted_at(t) == len(want[t - L - 1]) + 1 - len(want[t - L])
        assert max(lengths.stored(t) for t in range(L + 1, L + 91)) <= max(L, lengths.budget + every - 1)


def simulate_worker(lengths, L: int, steps: list[int]) -> list[list[int]]:
    """The positions in a request's slots after each of ``steps`` (tokens per step) as the worker moves
    them: the prompt's compaction, then per piece its tokens behind the held slots and its eviction (the
    first ``dec_sink`` and last ``dec_recent`` of the held slots kept, the step's pending tokens behind)."""
    slots: list[int] = []
    c = 0
    after = []
    for q in steps:
        end = c + q
        slots.extend(range(c, end))  # the batch's pass writes the step's tokens behind the held slots
        if c < L <= end and lengths.kept < L:
            prompt = slots[:L]
            slots = prompt[:lengths.n_sink] + prompt[L - lengths.n_recent:] + slots[L:]
        for piece in step_pieces(lengths, c, q):
            n = piece.stored + piece.end - piece.start
            assert slots[piece.stored:n] == list(range(piece.start, piece.end))  # its tokens, in order
            assert len(slots) == n + piece.pending
            if piece.evicted:
                kept = slots[:lengths.dec_sink] + slots[n - lengths.dec_recent:n]
                assert len(kept) == lengths.budget == n - piece.evicted
                slots = kept + slots[n:]
        c = end
        after.append(list(slots))
    return after


@pytest.mark.parametrize("name,budget,every", SPECS)
def test_worker_pieces_agree_with_the_scheduler(name, budget, every):
    """Whole prefill then decode, chunked prefill, and recomputation of a preempted request (the prompt and
    many generated tokens in one or a few steps): after every step the worker holds ``stored(c)`` slots
    (the scheduler's count, so both free the same blocks) with the library's positions, in order."""
    policy = compose(name, budget=budget, evict_every=every)
    rng = random.Random(0)
    for L in [5, 31, 32, 33, 70, 130]:
        lengths = kept_lengths(policy, L)
        total = L + 60
        want = library_positions(policy, L, total)
        splits = [[L] + [1] * 60, [total], [L + 17, 43], [20] * (total // 20) + [total % 20]]
        splits.append([rng.randint(1, 40) for _ in range(total)])
        for steps in splits:
            steps = [q for q in steps if q]
            while sum(steps) > total:
                steps[-1] -= sum(steps) - total
                steps = [q for q in steps if q > 0]
            if sum(steps) < total:
                steps.append(total - sum(steps))
            c = 0
            for q, slots in zip(steps, simulate_worker(lengths, L, steps)):
                c += q
                if c >= L:
                    assert slots == want[c - L], (L, steps, c)
                    assert len(slots) == lengths.stored(c)
                    assert math.ceil(len(slots) / 32) == math.ceil((c - lengths.dropped(c)) / 32)


def test_no_decode_eviction_for_prompt_only_rules():
    for spec in ["snapkv", "chunkkv", "full", "knorm(decode=False)"]:
        policy = compose(spec, budget=0.2)
        assert not decode_evicts(policy)
        lengths = kept_lengths(policy, 130)
        assert lengths.budget == 0 and lengths.stored(200) == lengths.kept + 70
    assert decode_evicts(compose("knorm", budget=0.2))


@pytest.mark.parametrize("name", ["streaming", "window", "knorm"])
def test_eviction_in_vllm_cache_is_bit_identical(name):
    """Write a request's K/V with vLLM's CPU kernel into scattered blocks, evict (budget + 3 held, 2 pending
    tokens behind), and read it back through the kernel's layout: the kept tokens (sinks and the most recent,
    or knorm's lowest key norms per KV head) at slots [0, budget) with the same bits, the pending behind."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvpolicies.vllm import backend

    torch.manual_seed(0)
    nb, H, bs, D = 8, 2, 32, 32
    isa = _get_attn_isa(torch.float32, bs, D, "auto")
    kv_cache = torch.zeros(nb, H, bs, 2 * D)
    k_cache, v_cache = kv_cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
    blocks = torch.tensor([5, 1, 6])
    policy = compose(name, budget=40)
    lengths = kept_lengths(policy, 40)
    held, pending = lengths.budget + 3, 2
    total = held + pending
    k, v = torch.randn(total, H, D), torch.randn(total, H, D)
    slots = blocks[torch.arange(total) // bs] * bs + torch.arange(total) % bs
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    e = backend.Eviction("r", blocks, held, lengths.budget, lengths.dec_sink, lengths.dec_recent, pending)
    backend.evict_many(policy, [e], kv_cache, isa)
    if name == "knorm":
        scores = backend.prompt_scores(policy, k[:held], v[:held], None, 0.0)
        want_k, want_v, pos = backend.select(k[:held], v[:held], scores, lengths.budget, 0, 0)
        assert not torch.equal(pos[0], torch.arange(lengths.budget))
    else:
        keep = list(range(lengths.dec_sink)) + list(range(held - lengths.dec_recent, held))
        want_k, want_v = k[keep], v[keep]
    got = [held_tokens(kv_cache, blocks, lengths.budget + pending, part, isa) for part in range(2)]
    assert torch.equal(got[0], torch.cat([want_k, k[held:]]))
    assert torch.equal(got[1], torch.cat([want_v, v[held:]]))


SCORED = [("h2o", 0.2, 1), ("h2o", 0.25, 3), ("a2sf", 0.2, 2), ("tova", 0.2, 1),
          ("tova(per_head=True)", 0.3, 2), ("scissorhands", 0.2, 1), ("h2o", 12, 4), ("keyformer", 0.2, 1),
          ("keyformer(recent=0.5)", 0.3, 3)]


def test_scored_policies_evict_while_decoding():
    """h2o, a2sf, tova, scissorhands and keyformer evict while decoding in the plugin (scores updated by
    each decode query); prompt-only TOVA does not."""
    from kvpolicies.vllm import decode_scores

    for spec in ["h2o", "a2sf", "tova", "scissorhands", "tova(per_head=True)", "keyformer"]:
        policy = compose(spec, budget=0.2)
        assert decode_evicts(policy) and decode_scores(policy), spec
        assert kept_lengths(policy, 130).budget == 26
    for spec in ["tova(decode=False)", "h2o(recent=0.5)"]:
        policy = compose(spec, budget=0.2, evict_every=1)
        assert decode_scores(policy) == (spec != "tova(decode=False)")


def _reference_module():
    import importlib
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    return importlib.import_module("reference_policies")


@pytest.mark.parametrize("spec,budget,every", SCORED)
def test_scored_eviction_in_vllm_cache_follows_the_reference(spec, budget, every):
    """The worker's scored decode eviction, step by step as ``CompressingImpl.forward`` runs it, in a CPU
    KV cache written by vLLM's own kernel (scattered blocks), against the dense reference of the papers
    (tests/reference_policies.py, float64): after every step each KV head holds the reference's tokens, in
    order, bit for bit, with its scores. Steps of one token, several tokens at once (a recomputed
    request: several pieces and evictions in one step) and a step that ends the prompt and runs on.
    Keyformer's reference draws the noise the plugin's seeds name (kvmodels' for a batch's first row, at
    layer 3 here), its temperature rising over the ``T`` new tokens."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvpolicies.vllm import backend

    ref = _reference_module()
    from kvkernels import decode_keys, gumbel_noise_keyed, prefill_seed

    name = spec.split("(")[0]
    params = {"per_head": True} if "per_head=True" in spec else None
    params = {"recent": 0.5} if "recent=0.5" in spec else params
    torch.manual_seed(1)
    nb, H, G, bs, D = 8, 2, 2, 32, 32
    L, T = 40, 36
    scale = D ** -0.5
    isa = _get_attn_isa(torch.float32, bs, D, "auto")
    q_all, k_all, v_all = torch.randn(L + T, H * G, D), torch.randn(L + T, H, D), torch.randn(L + T, H, D)
    policy = compose(spec, budget=budget, evict_every=every)
    layer, ns = 3, backend.request_noise_seed(policy)
    noise = {}
    if name == "keyformer":
        def decode_noise(t: int, n: int) -> torch.Tensor:  # [Hq, n] of decode step t
            return gumbel_noise_keyed(decode_keys(ns, t, layer + 1, 1, H * G)[layer], n)[0]

        noise = dict(prefill_noise=ref.default_prefill_noise(prefill_seed(ns, layer, 0), H * G, L),
                     decode_noise=decode_noise)
    want = ref.simulate(name, params, q_all[:L], k_all[:L], q_all[L:], k_all[L:], budget,
                        evict_every=every, max_new_tokens=T, **noise)
    lengths = kept_lengths(policy, L)
    rng = random.Random(0)
    for steps in ([L] + [1] * T, [L] + [5, 1, 9, 3, 1, 17], [L + 6] + [rng.randint(1, 6) for _ in range(12)]):
        cuts = sorted({min(x, L + T) for x in itertools.accumulate(steps)} | {L + T})
        steps = [b - a for a, b in zip([0] + cuts, cuts)]  # the same steps, cut at the last token
        kv_cache = torch.zeros(nb, H, bs, 2 * D)
        k_cache, v_cache = kv_cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
        blocks = torch.tensor([5, 1, 6, 0, 3])
        state = None
        c = 0
        for q in steps:
            end = c + q
            first = c if c >= L else 0  # the batch pass writes the step's tokens behind the held slots
            logical = torch.arange(q) + lengths.stored(c) if c >= L else torch.arange(c, end)
            slots = blocks[logical // bs] * bs + logical % bs
            ops.cpu_attn_reshape_and_cache(k_all[c:end].contiguous(), v_all[c:end].contiguous(), k_cache,
                                           v_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype="auto")
            query = q_all[first if c < L else c:end]  # the step's queries (the whole prompt at once here)
            if c < L <= end:
                job = backend.Compaction("r", 0, 0, end, L, lengths.kept, lengths.n_sink, lengths.n_recent,
                                         blocks)
                _, state = backend.compact(policy, job, query, kv_cache, scale, isa, layer=layer)
            row0 = 0 if c < L else c
            for piece in step_pieces(lengths, c, q):
                p = backend.Scored("r", blocks, piece.start - row0, piece.end - piece.start, piece.stored,
                                   piece.start - L, T)
                state = backend.score_pieces(policy, [p], [state], query, kv_cache, scale, isa, layer)[0]
                if piece.evicted:
                    e = backend.Eviction("r", blocks, piece.stored + p.count, lengths.budget,
                                         lengths.dec_sink, lengths.dec_recent, piece.pending)
                    state = backend.evict_many(policy, [e], kv_cache, isa, [state])[0]
            c = end
            if c < L:
                continue
            step = want[c - L]
            held = lengths.stored(c)
            assert held == step.kept.shape[1] and state.shape == (H, held), (steps, c)
            got_k, got_v = (held_tokens(kv_cache, blocks, held, part, isa) for part in range(2))
            for h in range(H):
                ids = step.kept[h]
                assert torch.equal(got_k[:, h], k_all[ids, h]), (spec, steps, c, h)
                assert torch.equal(got_v[:, h], v_all[ids, h])
            where = f"{spec} steps={steps} after {c} tokens"
            torch.testing.assert_close(state.double(), step.scores, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, where=where: f"{m} ({where})")


def test_keyformer_plumbing():
    """What a worker hands Keyformer's update: the model's layer index from vLLM's layer name, the request's
    ``max_tokens`` (1 when unknown), kvmodels' noise seed of a cache seeded 0."""
    from types import SimpleNamespace

    from kvkernels import noise_seed
    from kvpolicies.vllm import backend

    assert backend._layer_index("model.layers.3.self_attn.attn") == 3
    assert backend._max_tokens(SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=40))) == 40
    assert backend._max_tokens(None) == backend._max_tokens(SimpleNamespace(sampling_params=None)) == 1
    policy = compose("keyformer", budget=0.2, seed=7)
    seed = backend.request_noise_seed
    assert seed(policy) == noise_seed(7, 0) != seed(compose("keyformer"))


@pytest.mark.parametrize("spec", ["h2o", "keyformer", "a2sf", "scissorhands"])
def test_score_pieces_batched_equal_one_at_a_time(spec):
    """One call for several requests' pieces (different held counts, piece lengths, decode steps: Keyformer
    at different temperatures) updates each request's scores exactly as the call for that piece alone."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvpolicies.vllm import backend

    torch.manual_seed(2)
    nb, H, bs, D, Hq = 16, 2, 32, 32, 4
    isa = _get_attn_isa(torch.float32, bs, D, "auto")
    kv_cache = torch.zeros(nb, H, bs, 2 * D)
    k_cache, v_cache = kv_cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
    policy = compose(spec, budget=0.2)
    query = torch.randn(12, Hq, D)
    pieces, states = [], []
    for r, (blocks, stored, count, row, step) in enumerate([([3, 7], 40, 1, 0, 5), ([1], 9, 3, 1, 0),
                                                            ([8, 2, 11], 70, 2, 4, 9), ([5], 0, 1, 6, 0)]):
        blocks = torch.tensor(blocks)
        n = stored + count
        slots = blocks[torch.arange(n) // bs] * bs + torch.arange(n) % bs
        ops.cpu_attn_reshape_and_cache(torch.randn(n, H, D), torch.randn(n, H, D), k_cache, v_cache, slots,
                                       isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        pieces.append(backend.Scored(str(r), blocks, row, count, stored, step, 40))
        states.append(torch.rand(H, stored))
    together = backend.score_pieces(policy, pieces, states, query, kv_cache, 0.2, isa, 1)
    for p, state, got in zip(pieces, states, together):
        alone = backend.score_pieces(policy, [p], [state], query, kv_cache, 0.2, isa, 1)[0]
        assert got.shape == (H, p.stored + p.count)
        torch.testing.assert_close(got, alone, rtol=1e-6, atol=1e-7)
        assert p.stored == 0 or not torch.equal(got[:, :p.stored], state) or spec == "scissorhands"


@pytest.mark.parametrize("spec", ["h2o", "tova", "keyformer", "streaming", "knorm"])
def test_evict_many_batched_equal_one_at_a_time(spec):
    """One selection for several requests' evictions (different held counts, budgets, forced counts,
    pending tokens) leaves each request's slots and scores as its eviction alone does."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvpolicies.vllm import backend

    torch.manual_seed(3)
    nb, H, bs, D = 16, 2, 32, 32
    isa = _get_attn_isa(torch.float32, bs, D, "auto")
    policy = compose(spec, budget=0.2)
    caches = [torch.zeros(nb, H, bs, 2 * D) for _ in range(2)]
    evs, states = [], []
    cases = [([3, 7], 41, 20, 0, 10, 0), ([1], 9, 8, 0, 4, 0), ([8, 2, 11], 70, 33, 2, 6, 3),
             ([5], 2, 1, 0, 0, 1)]  # (blocks, held, budget, n_sink, n_recent, pending)
    for r, (blocks, held, budget, sink, recent, pending) in enumerate(cases):
        blocks = torch.tensor(blocks)
        n = held + pending
        slots = blocks[torch.arange(n) // bs] * bs + torch.arange(n) % bs
        k, v = torch.randn(n, H, D), torch.randn(n, H, D)
        for kv_cache in caches:
            k_cache, v_cache = kv_cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                           kv_cache_dtype="auto")
        evs.append(backend.Eviction(str(r), blocks, held, budget, sink, recent, pending))
        states.append(torch.rand(H, held))
    scored = spec not in ("streaming", "knorm")
    if spec == "streaming":  # streaming's evictions keep their forced slots only
        evs = [dataclasses.replace(e, n_sink=min(4, e.budget), n_recent=e.budget - min(4, e.budget))
               for e in evs]
    together = backend.evict_many(policy, evs, caches[0], isa, states if scored else None)
    alone = [backend.evict_many(policy, [e], caches[1], isa, [sc] if scored else None)
             for e, sc in zip(evs, states)]
    assert torch.equal(caches[0], caches[1])
    if scored:
        for got, want, e in zip(together, alone, evs):
            assert got.shape == (H, e.budget) and torch.equal(got, want[0])
    else:
        assert together is None


def test_strided_and_element_index_addressing_agree(monkeypatch):
    """The worker reads and writes slots through a strided view of the keys and of the values where the
    ISA's in-block layout is affine (``vec``), else through an element index built from the measured layout
    (``slot_layout``): on the same cache, written by vLLM's kernel, both read every (block, head, slot) as
    the measured layout names it, and a write through either leaves the same bytes."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvpolicies.vllm import backend

    torch.manual_seed(4)
    nb, H, bs, D = 6, 3, 32, 64
    isa = _get_attn_isa(torch.float32, bs, D, "auto")
    assert backend.slot_strides(isa, torch.float32, bs, D) is not None  # vec: the strided path is taken
    kv_cache = torch.zeros(nb, H, bs, 2 * D)
    k_cache, v_cache = kv_cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
    k, v = torch.randn(nb * bs, H, D), torch.randn(nb * bs, H, D)
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, torch.arange(nb * bs), isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")
    blocks = torch.tensor([4, 0, 5, 2])
    n = blocks.numel() * bs
    want = [held_tokens(kv_cache, blocks, n, part, isa) for part in range(2)]
    requests = [(blocks, torch.arange(n))]
    strided = [backend.read_requests(kv_cache, isa, part, requests) for part in range(2)]
    values = torch.randn(2, 50, H, D)
    dest = [(blocks, torch.randperm(n)[:50])]
    written = kv_cache.clone()
    for part in range(2):
        backend.write_requests(written, isa, part, dest, values[part])
    monkeypatch.setattr(backend, "slot_strides", lambda *args: None)  # force the element-index path
    elements = [backend.read_requests(kv_cache, isa, part, requests) for part in range(2)]
    again = kv_cache.clone()
    for part in range(2):
        backend.write_requests(again, isa, part, dest, values[part])
    for part in range(2):
        assert torch.equal(strided[part], want[part]) and torch.equal(elements[part], want[part])
    assert torch.equal(written, again) and not torch.equal(written, kv_cache)
