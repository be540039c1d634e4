"""The generation loop: greedy tokens against a no-cache oracle, batched ragged == one by one, eos,
sampling, streaming, errors, and the compiled decode step (== eager, no recompiles)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from devices import DEVICE
from kvmodels.generate import CausalLM, GenerationResult, generate
from kvmodels.llama import Llama, LlamaConfig
from kvpolicies import compose

pytestmark = pytest.mark.usefixtures("one_thread")

V = 53


def tiny_llama(seed: int = 0, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2) -> Llama:
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(vocab_size=V, dim=32, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                              intermediate=48, max_seq_len=96)).eval()
    with torch.no_grad():  # spread the logits so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.to(DEVICE)


MODEL = tiny_llama()


def greedy_oracle(model: Llama, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence without any cache, one token at a time."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model.prefill(torch.tensor(seq, device=DEVICE), None, 0)[-1].argmax()))
    return seq[len(prompt):]


def prompts_strategy(max_batch: int = 3):
    return st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=20), min_size=1, max_size=max_batch)


def test_model_follows_protocol():
    assert isinstance(MODEL, CausalLM)


@given(prompts=prompts_strategy(), n_new=st.integers(1, 8), page_size=st.sampled_from([1, 3, 4, 16]))
def test_full_policy_greedy_equals_no_cache_oracle(prompts, n_new, page_size):
    result = generate(MODEL, prompts, n_new, page_size=page_size)
    assert isinstance(result, GenerationResult)
    assert result.tokens == [greedy_oracle(MODEL, p, n_new) for p in prompts]
    assert result.prefill_tokens == sum(map(len, prompts))
    assert result.decode_tokens == len(prompts) * (n_new - 1)


POLICIES = [compose("full"), compose("streaming", budget=0.5), compose("h2o", budget=6),
            compose("snapkv", budget=0.6), compose("pyramid", "tova", budget=5)]


@given(prompts=prompts_strategy(), n_new=st.integers(1, 10), policy=st.sampled_from(POLICIES),
       page_size=st.sampled_from([2, 4, 5]))
def test_batched_ragged_equals_one_by_one(prompts, n_new, policy, page_size):
    """Budgets, scores and eviction are per sequence, so batching must not change any sequence."""
    batched = generate(MODEL, prompts, n_new, policy, page_size=page_size)
    alone = [generate(MODEL, [p], n_new, policy, page_size=page_size).tokens[0] for p in prompts]
    assert batched.tokens == alone


def test_eos_stops_a_sequence_and_returns_its_pages():
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]
    free = generate(MODEL, prompts, 12)
    eos = free.tokens[0][3]  # the 4th token of sequence 0 becomes its stop token
    stopped = generate(MODEL, prompts, 12, eos_ids=[eos])
    for b in range(2):
        ref = free.tokens[b]
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert stopped.tokens[b] == ref[:cut]
        assert stopped.finished_on_eos[b] == (eos in ref)
    assert stopped.finished_on_eos[0]
    assert stopped.decode_tokens < free.decode_tokens


def test_sampling_is_seeded():
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    a = generate(MODEL, prompts, 15, temperature=1.0, seed=7)
    b = generate(MODEL, prompts, 15, temperature=1.0, seed=7)
    c = generate(MODEL, prompts, 15, temperature=1.0, seed=8)
    greedy = generate(MODEL, prompts, 15)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens and a.tokens != greedy.tokens


def test_stream_and_progress_callbacks():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    streamed: list[list[int]] = [[], []]
    progress = []
    result = generate(MODEL, prompts, 6, stream=lambda b, t: streamed[b].append(t),
                      on_prefill=lambda b, done, total: progress.append((b, done, total)))
    assert streamed == result.tokens
    n = MODEL.n_cache_layers
    assert progress == [(b, l, n) for b in range(2) for l in range(1, n + 1)]


@pytest.mark.parametrize("policy", [compose("full"), compose("h2o", budget=6)], ids=["full", "h2o"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_without_eos_each_steps_tokens_are_read_after_the_next_step_is_launched(policy, compile):
    """Without eos ids nothing but max_new_tokens stops a sequence, so from the second step on a step's tokens
    are read (the host's one wait on the device per step) after the next step is launched; with eos ids
    (here one that never comes) each step is read before the next. The same tokens and stream calls either
    way; what differs is only when the host reads them."""
    from kvmodels.decoder import Decoder

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    n_new = 7

    def run(eos):
        events: list[tuple] = []
        dec = Decoder(MODEL, policy, compile=compile, max_tokens=40)
        dec.extend(prompts, max_new_tokens=n_new)
        begin = dec.begin_step

        def begin_step():
            events.append(("step", dec.step))
            return begin()

        dec.begin_step = begin_step
        res = dec.generate(n_new, eos_ids=eos, stream=lambda b, t: events.append(("token", b, t)))
        return res, events

    lagged, lag_events = run(None)
    never = next(t for t in range(V) if all(t not in toks for toks in lagged.tokens))
    synced, sync_events = run([never])  # an eos id no generated token equals
    assert lagged.tokens == synced.tokens and len(lagged.tokens[0]) == n_new
    tokens = [e for e in lag_events if e[0] == "token"]
    assert tokens == [e for e in sync_events if e[0] == "token"]

    def reads_before_each_step(events):  # tokens read before step s is launched, per step
        counts, n = [], 0
        for e in events:
            if e[0] == "step":
                counts.append(n)
            else:
                n += 1
        return counts

    B = len(prompts)
    # Synchronous: before step s, the prefill's tokens and those of steps 0..s-1. Lagged: step s-1's are read
    # after step s is launched (from step 2 on; the first step is read at once, for first_step_s).
    assert reads_before_each_step(sync_events) == [B * (s + 1) for s in range(n_new - 1)]
    assert reads_before_each_step(lag_events) == [B * (s + 1) if s < 2 else B * s for s in range(n_new - 1)]


def test_report_shows_compression():
    prompts = [list(range(40)), list(range(30))]
    full = generate(MODEL, prompts, 4, page_size=4).report
    small = generate(MODEL, prompts, 4, compose("streaming", budget=0.25), page_size=4).report
    assert small.full_cache_bytes == full.full_cache_bytes == full.total_bytes
    assert small.total_bytes < full.total_bytes / 2
    assert small.tokens_per_layer[0] == (10, 8)  # evict_every=1: exactly the budget after each step


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[]), "non-empty"),
    (dict(prompts="hello"), "tokenize"),
    (dict(prompts=[[1], []]), r"prompts\[1\] is empty"),
    (dict(prompts=[[1] * 90]), "context of 96"),
    (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=torch.tensor([[1, 2]])), r"prompts is a torch.Tensor; .*prompts.tolist\(\)"),
    (dict(prompts=[[1, 2], [3, V]]), rf"prompts\[1\]\[1\]={V} is outside the model's vocabulary \({V} ids"),
    (dict(prompts=[[-1]]), r"prompts\[0\]\[0\]=-1 is outside"),
    (dict(prompts=[[1, 2.0]]), r"prompts\[0\]\[1\]=2.0 is not a token id"),
    (dict(prompts=[[True]]), r"prompts\[0\]\[0\]=True is not a token id"),
    (dict(temperature=-0.5), r"temperature=-0.5 must be a finite number >= 0"),
    (dict(temperature=float("inf")), r"temperature=inf must be"),
])
def test_bad_input(kwargs, match):
    """Each refused before anything runs, with the argument named: before these checks an id past the
    vocabulary raised the embedding's bare IndexError, a float id was truncated, and a negative temperature
    sampled the least likely tokens."""
    args = {"prompts": [[1, 2]], "max_new_tokens": 8, "temperature": 0.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(MODEL, args["prompts"], args["max_new_tokens"], temperature=args["temperature"])


def test_token_ids_of_any_integer_type_are_taken():
    """numpy and 0-d torch integers are token ids too (a row of a tokenizer's tensor, say)."""
    import numpy as np

    want = generate(MODEL, [[1, 2, 3]], 4).tokens
    assert generate(MODEL, [np.array([1, 2, 3])], 4).tokens == want
    assert generate(MODEL, [torch.tensor([1, 2, 3])], 4).tokens == want


@pytest.mark.slow
def test_compiled_decode_equals_eager_without_recompiles():
    """One compile for the module: an evicting policy over many steps, then a second batch of the same
    shapes; the compiled step must give the eager tokens and compile exactly one graph."""
    from torch._dynamo.utils import counters

    policy = compose("h2o", budget=6, evict_every=2)
    batches = [[[5, 3, 8, 1, 9, 2, 7], [4, 4, 2], list(range(11, 30))],
               [[1, 2], list(range(20, 40)), [7] * 9]]  # same longest prompt: same cache shapes
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for prompts in batches:
        eager = generate(MODEL, prompts, 40, policy, page_size=4)
        compiled = generate(MODEL, prompts, 40, policy, page_size=4, compile=True)
        assert compiled.tokens == eager.tokens
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.slow
def test_compiled_full_cache_equals_eager():
    """The full cache passes no score tensor to the attention op; the compiled step must still lower."""
    prompts = [[5, 3, 8, 1, 9, 2, 7], list(range(11, 30))]
    eager = generate(MODEL, prompts, 6, page_size=4)
    compiled = generate(MODEL, prompts, 6, page_size=4, compile=True)
    assert compiled.tokens == eager.tokens
    for r in (eager, compiled):  # the first step (the compile, when compiled) is timed apart, inside decode_s
        assert 0 < r.extra["first_step_s"] <= r.decode_s
