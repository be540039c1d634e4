"""Every eviction x budget x merge policy on every model family (Llama, GPT-J, MPT, LCKV).

Tiny random models, batched ragged prompts, a few decode steps through ``kvmodels.generate``. Each run
checks that the cache really holds what the policy allows (contract §4: a layer never holds more than
its budget + evict_every - 1 tokens, budgets conserved per sequence) and that the ``full`` policy gives
the same tokens as the dense forward pass. Each family also gets one compiled decode step
(``generate.compile_decode_step``): no graph break and no recompile across evicting steps.

Also holds the helpers the per-model test files share (tiny models, teacher-forced cache runs).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from devices import DEVICE
from kvmodels.cache import PagedKVCache
from kvmodels.generate import compile_decode_step, generate
from kvmodels.gptj import GPTJ, GPTJConfig
from kvmodels.lckv import LCKV, LCKVConfig
from kvmodels.llama import Llama, LlamaConfig
from kvmodels.mpt import MPT, MPTConfig
from kvpolicies import available, compose, get_policy

VOCAB = 53


def widen(model: torch.nn.Module, std: float = 0.3, seed: int = 0) -> torch.nn.Module:
    """Re-draw matrix weights wider than the default init, so attention is far from uniform."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model.eval()


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A 4-layer random model of ``family`` (``llama``, ``gptj``, ``mpt``, ``lckv``).

    Four layers, so that ``minicache`` (pairs from the middle layer on) really merges a pair.
    """
    llama = LlamaConfig(vocab_size=VOCAB, dim=24, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=32,
                        max_seq_len=64)
    torch.manual_seed(seed)
    if family == "llama":
        model = Llama(llama)
    elif family == "gptj":
        model = GPTJ(GPTJConfig(vocab_size=VOCAB, n_layers=4, n_heads=3, hidden_size=24, rotary_dim=4,
                                intermediate_size=32, max_seq_len=64))
    elif family == "mpt":
        model = MPT(MPTConfig(vocab_size=VOCAB, n_layers=4, n_heads=3, hidden_size=24, intermediate_size=32,
                              max_seq_len=64))
    elif family == "lckv":
        model = LCKV(LCKVConfig(LlamaConfig(**{**llama.to_dict(), "n_layers": 4}), warmup_bottom=1,
                                warmup_top=1, forward_iterations=3, backward_iterations=1))
    else:
        raise ValueError(family)
    return widen(model, seed=seed).to(DEVICE)


def teacher_forced(model, seqs: list[torch.Tensor], prompt_lens: list[int], policy=None, *,
                   page_size: int = 4, before_step=None) -> list[torch.Tensor]:
    """Logits ``[len(seq), V]`` per sequence: prompt by ``prefill``, then the rest fed one token per decode
    step (all sequences batched, shortest ones finishing early). ``before_step(cache, step)`` runs after
    ``prepare_decode`` (to inspect what each layer holds). Runs on the model's device; the logits come
    back on the CPU."""
    policy = policy or compose("full")
    device = next(model.parameters()).device
    seqs = [s.to(device) for s in seqs]
    n_new = max(len(s) - L for s, L in zip(seqs, prompt_lens))
    cache = PagedKVCache(**vars(model.cache_layout()), max_batch=len(seqs),
                         max_tokens=max(prompt_lens) + n_new, page_size=page_size, policy=policy)
    cache.start(prompt_lens, n_new)
    out = []
    with torch.no_grad():
        for b, (s, L) in enumerate(zip(seqs, prompt_lens)):
            out.append([model.prefill(s[:L], cache, b)])
        cache.finish_prefill()
        for step in range(n_new):
            for b, (s, L) in enumerate(zip(seqs, prompt_lens)):
                if L + step == len(s) and cache.host.active[b]:
                    cache.finish_sequence(b)
            cache.prepare_decode(step)
            if before_step is not None:
                before_step(cache, step)
            pos = torch.tensor([min(L + step, len(s) - 1) for s, L in zip(seqs, prompt_lens)], device=device)
            tok = torch.stack([s[p] for s, p in zip(seqs, pos)])
            logits = model.decode_step(tok, pos, cache)
            cache.after_step(step)
            for b, (s, L) in enumerate(zip(seqs, prompt_lens)):
                if L + step < len(s):
                    out[b].append(logits[b : b + 1])
    return [torch.cat(o).cpu() for o in out]


FAMILIES = ["llama", "gptj", "mpt", "lckv"]
EVICTIONS = [p.name for p in available(role="eviction")]
BUDGETS = [p.name for p in available(role="budget")]
MERGES = [p.name for p in available(role="merge")]
PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2], [2, 7, 1, 8, 2, 8], [1]]
N_NEW = 4


@pytest.fixture(scope="module")
def models():
    return {f: tiny_model(f) for f in FAMILIES}


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("budget_policy", BUDGETS)
@pytest.mark.parametrize("eviction", EVICTIONS)
def test_every_policy_runs_on_every_model(models, eviction, budget_policy, merge):
    if eviction == "full" and budget_policy != "uniform":
        # Rejected at compose time, by name: 'full' keeps everything, so there is no budget to move.
        with pytest.raises(ValueError, match=budget_policy):
            compose(eviction, budget_policy, merge, budget=0.5)
        return
    probe = get_policy(eviction).probe  # a reconstruction pass (kvzip) continues each prompt
    policy = compose(eviction, budget_policy, merge, budget=0.5, evict_every=2)
    for family, model in models.items():
        try:
            res = generate(model, PROMPTS, N_NEW, policy)
        except NotImplementedError as e:
            # Rejected up front, by name, before any token: the only acceptable way to not support it.
            continues = merge != "none" or (probe and not getattr(model, "can_extend", False))
            assert continues and policy.name in str(e), (family, str(e))
            continue
        assert [len(t) for t in res.tokens] == [N_NEW] * len(PROMPTS), family
        assert all(0 <= t < VOCAB for seq in res.tokens for t in seq)
        rep = res.report
        assert len(rep.bytes_per_layer) == model.n_cache_layers
        # The report is the cache at its longest (taken before the first sequence finishes).
        assert 0 < rep.total_bytes <= rep.full_cache_bytes, family
        if merge != "none" and model.n_cache_layers >= 4:
            assert rep.merged_pairs, (family, policy.name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", [("h2o", "squeeze"), ("streaming",), ("snapkv", "pyramid"),
                                  ("keyformer",), ("tova",)])
def test_cache_holds_at_most_budget_plus_evict_every(models, family, spec):
    model = models[family]
    evict_every = 3
    policy = compose(*spec, budget=0.5, evict_every=evict_every)
    torch.manual_seed(1)
    lens = [13, 6, 9]
    seqs = [torch.randint(0, VOCAB, (L + 6,)) for L in lens]
    held = []

    def before_step(cache, step):
        n = cache.batch_size
        held.append((cache.seq_lens[:, :n].cpu(), cache.budgets[:, :n].cpu(), cache.active[:n].cpu()))

    teacher_forced(model, seqs, lens, policy, before_step=before_step)
    for seq_lens, budgets, active in held:
        if not policy.eviction.decode_evict:  # prompt-only compression (SnapKV): the cache grows
            break
        # Before this step's append a layer holds at most budget + evict_every - 1 tokens.
        assert bool((seq_lens[:, active] <= budgets[:, active] + evict_every - 1).all())
    budgets = held[0][1].to(torch.int64)
    per_layer = torch.tensor([max(policy.floor, -(-L // 2)) for L in lens])
    if spec[0] != "full":
        assert torch.equal(budgets.sum(0), model.n_cache_layers * per_layer)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_policy_equals_dense_forward(models, family):
    """With ``full`` the paged cache changes nothing: teacher-forced logits equal the dense pass."""
    model = models[family]
    torch.manual_seed(2)
    # Prompts no longer than LCKV's 4 prompt iterations, so its prompt encoding is exact (Theorem 1).
    lens = [4, 1, 3]
    seqs = [torch.randint(0, VOCAB, (L + n,)) for L, n in zip(lens, [4, 6, 2])]
    got = teacher_forced(model, seqs, lens)
    for s, g in zip(seqs, got):
        if family == "lckv":
            # Decoding is sequential; the dense equivalent is the parallel form with one pass per token.
            want = model.prefill(s.to(DEVICE), None, 0, iterations=len(s)).cpu()
        else:
            want = model.prefill(s.to(DEVICE), None, 0).cpu()
        torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_decode_step_no_graph_break_no_recompile(models, family):
    model = models[family]
    policy = compose("h2o", "squeeze", budget=0.5, evict_every=2)
    eager = generate(model, PROMPTS, 6, policy)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(model, PROMPTS, 6, policy, compile=True)
    counters = torch._dynamo.utils.counters
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert compiled.tokens == eager.tokens
    assert compile_decode_step is not None  # the path generate(compile=True) uses
