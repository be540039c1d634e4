"""The plugin's policies: the server's, read from ``KVPOLICIES_VLLM_POLICY``, and a request's own, named in
its ``SamplingParams(extra_args={"kvpolicies": ...})``, each checked once; and the one per-prompt decision
(how many tokens each layer keeps) that the scheduler and the workers both derive from a request's policy.

This module imports no vLLM, so it is tested and used without it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..compose import ComposedPolicy, compose

ENV = "KVPOLICIES_VLLM_POLICY"
#: The key of ``SamplingParams.extra_args`` under which a request names its own policy.
REQUEST_KEY = "kvpolicies"

#: Decode-time score modes the workers apply (every mode of ``kvkernels.SCORE_MODES``): each decode query's
#: attention updates its request's per-slot scores through ``kvkernels.paged_decode_attention`` (``h2o``:
#: accumulate, ``a2sf``: decay, ``tova``: replace, ``scissorhands``: count_low, ``keyformer``: gumbel).
DECODE_SCORE_MODES = ("accumulate", "decay", "replace", "count_low", "gumbel")


class PolicySpecError(ValueError):
    """``KVPOLICIES_VLLM_POLICY`` or a request's ``extra_args["kvpolicies"]`` names no policy this plugin can
    apply; the message is one line."""


def parse(raw: str, where: str = ENV) -> ComposedPolicy:
    """The composed policy of ``raw``: a ``compose`` spec as JSON (``'{"policies": ["streaming"], "budget":
    0.2}'``, what ``ComposedPolicy.to_json()`` writes) or a name (``"snapkv(window=16)"``, budget 1.0).

    Raises
    ------
    PolicySpecError
        One line naming the variable (``where``), the value and what to change: an unknown policy or
        parameter, bad JSON, or a policy the plugin does not apply yet (:func:`check_supported`).
    """
    text = raw.strip()
    try:
        if text.startswith("{"):
            policy = compose(json.loads(text))
        else:
            policy = compose(text)
    except (KeyError, ValueError, TypeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise PolicySpecError(f"{where}={raw!r}: {msg}".replace("\n", " ")) from None
    check_supported(policy, raw, where)
    return policy


def check_supported(policy: ComposedPolicy, raw: str = "", where: str = ENV) -> None:
    """Refuse, in one line, what this slice of the plugin does not apply: a budget policy other than
    ``uniform`` (vLLM's one block table per KV-cache group holds every layer at one length), per-head budgets,
    layer merging, a decode-time score mode the workers do not apply, open score rules that read queries,
    ChunkKV's layer-wise index reuse, a reconstruction pass (kvzip) and quantized precision (kivi, zipcache,
    mikv)."""
    ev = policy.eviction
    problems = []
    if policy.budget_policy.name != "uniform":
        problems.append(f"layer budgets {policy.budget_policy.name!r} (only 'uniform')")
    if policy.heads.per_head:
        problems.append(f"head budgets {policy.heads.name!r}")
    if policy.merge.name != "none":
        problems.append(f"layer merging {policy.merge.name!r}")
    if ev.score_mode not in ("none", *DECODE_SCORE_MODES):
        problems.append(f"eviction {ev.name!r}, whose decode-time score mode {ev.score_mode!r} the workers "
                        "do not apply")
    if ev.scores_tokens and ev.reads_queries:
        problems.append(f"eviction {ev.name!r} reads queries in its token_scores")
    if ev.score_source_layer(1) != 1:
        problems.append(f"eviction {ev.name!r} reuses an earlier layer's scores")
    if ev.probe:
        problems.append(f"eviction {ev.name!r}, which ranks the context by a reconstruction pass (the "
                        "context fed again after itself) that the plugin cannot run")
    if policy.precision.quantizes:
        problems.append(f"quantized storage {policy.precision.name!r}")
    if problems:
        raise PolicySpecError(f"{where}={raw or policy.name!r}: the vLLM plugin does not apply "
                              f"{'; '.join(problems)} yet; use full, window, streaming, knorm, snapkv, "
                              "chunkkv, h2o, tova, a2sf, scissorhands or keyformer with uniform budgets "
                              "(docs/vllm.md)")


def policy_from_env() -> ComposedPolicy | None:
    """The policy in ``KVPOLICIES_VLLM_POLICY`` (None when unset or empty), parsed once per value."""
    raw = os.environ.get(ENV, "")
    return _parsed(raw) if raw.strip() else None


@lru_cache(maxsize=8)
def _parsed(raw: str) -> ComposedPolicy:
    return parse(raw)


def request_policy(params: object, default: ComposedPolicy | None) -> ComposedPolicy | None:
    """The policy of one request: ``params.extra_args["kvpolicies"]`` (``params``: its ``SamplingParams``)
    when the key is present, else the server's ``default``. The value is a ``compose`` spec as a dict
    (``{"policies": ["h2o"], "budget": 0.1}``, what ``ComposedPolicy.spec()`` returns) or a string (a
    name, or that dict as JSON); ``None`` or ``"full"`` keeps the request's cache whole. The scheduler and
    the workers both call this, so they agree on each request's kept lengths.

    Raises
    ------
    PolicySpecError
        One line naming ``extra_args["kvpolicies"]``, the value and what to change.
    """
    extra = getattr(params, "extra_args", None) or {}
    if REQUEST_KEY not in extra:
        return default
    spec = extra[REQUEST_KEY]
    if spec is None:
        spec = "full"
    if isinstance(spec, dict):
        try:
            spec = json.dumps(spec, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise PolicySpecError(f'extra_args["{REQUEST_KEY}"]={spec!r}: not a JSON object ({e})') from None
    if not isinstance(spec, str):
        raise PolicySpecError(f'extra_args["{REQUEST_KEY}"]={spec!r}: name a policy as a compose() spec (a '
                              'dict such as {"policies": ["h2o"], "budget": 0.2}, or a string), or None for '
                              "the full cache")
    return _parsed_request(spec)


@lru_cache(maxsize=64)
def _parsed_request(raw: str) -> ComposedPolicy:
    return parse(raw, f'extra_args["{REQUEST_KEY}"]')


def prompt_budget(policy: ComposedPolicy, prompt_len: int) -> tuple[int, int, int]:
    """``(kept, n_sink, n_recent)`` for a prompt of ``prompt_len`` tokens: what every layer keeps of it
    after prefill (``kept = prompt_len``: nothing is evicted), read off ``policy.plan`` (uniform budgets:
    every layer the same, so one layer stands for all). The scheduler's block accounting and the workers'
    compaction both call this, so they agree on each request's kept length."""
    plan = policy.plan(torch.tensor([prompt_len]), 1)
    if not plan.schedule.prefill_compress:
        return prompt_len, 0, 0
    budget, n_sink, n_recent = (int(x[0]) for x in plan.storage.row(0))
    return min(prompt_len, budget), n_sink, n_recent


#: ``max_new_tokens`` for the plan of decode-time eviction: the budget is not capped at the prompt (a
#: request's generation length is unknown to the plan here, and a budget past ``prompt + generated`` tokens
#: never evicts anything, so capping it would change nothing).
_UNCAPPED = 1 << 40


@dataclass(frozen=True)
class KeptLengths:
    """How many slots a request of ``prompt_len`` tokens holds after ``t`` tokens were processed, the one
    function of ``t`` the scheduler (blocks) and the workers (slots, evictions) both derive from the plan.

    The prompt is compressed to ``kept`` when it completes; with decode-time eviction (``budget > 0``) the
    decode steps append, and the step that processes token ``t`` (``t - prompt_len`` a multiple of
    ``every``, ``every`` = the plan's ``evict_every``) ends by evicting back to ``budget`` (keeping the
    ``n_sink`` first and ``n_recent`` last of the held tokens, plus the top scores), as the library's caches
    do after decode step ``s = t - prompt_len - 1`` (``EvictionSchedule.evicts_after``)."""

    prompt_len: int
    kept: int
    n_sink: int  # the prompt compaction's forced counts
    n_recent: int
    budget: int = 0  # decode-time eviction holds the request at this many slots (0: no decode eviction)
    dec_sink: int = 0
    dec_recent: int = 0
    every: int = 1

    def stored(self, t: int) -> int:
        """Slots held after ``t`` tokens were processed (``t >= prompt_len``; before: ``t``)."""
        L = self.prompt_len
        if t < L:
            return t
        last = L + self.every * ((t - L) // self.every)  # the last eviction point at or before t
        if self.budget <= 0 or last == L or self.kept + (last - L) <= self.budget:
            return self.kept + (t - L)
        return self.budget + (t - last)

    def dropped(self, t: int) -> int:
        """Tokens of the first ``t`` evicted from every layer: ``t - stored(t)``."""
        return t - self.stored(t)

    def evicted_at(self, t: int) -> int:
        """Tokens evicted at the end of the step that processes token ``t`` (1-based count; 0: none)."""
        if t <= self.prompt_len or self.budget <= 0:
            return 0
        return self.stored(t - 1) + 1 - self.stored(t)

    def segments(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """Tokens ``[start, end)`` past the prompt (``start >= prompt_len``), split after each eviction:
        ``(a, b, evicted)`` pieces whose tokens attend to the ``stored(a)`` held slots and to each other
        (causally), after which ``evicted`` tokens leave (0 for a last piece that ends before an eviction)."""
        out: list[tuple[int, int, int]] = []
        a = start
        for t in range(start + 1, end + 1):
            x = self.evicted_at(t)
            if x or t == end:
                out.append((a, t, x))
                a = t
        return out


@lru_cache(maxsize=4096)
def kept_lengths(policy: ComposedPolicy, prompt_len: int) -> KeptLengths:
    """The :class:`KeptLengths` of a prompt of ``prompt_len`` tokens under ``policy``: the prompt's kept
    length and forced counts (:func:`prompt_budget`) and, when the policy evicts while decoding, its budget
    and forced counts read off ``policy.plan`` with the budget uncapped by the generation length."""
    kept, n_sink, n_recent = prompt_budget(policy, prompt_len)
    if not decode_evicts(policy):
        return KeptLengths(prompt_len, kept, n_sink, n_recent)
    plan = policy.plan(torch.tensor([prompt_len]), 1, max_new_tokens=_UNCAPPED)
    budget, dec_sink, dec_recent = (int(x[0]) for x in plan.storage.row(0))
    return KeptLengths(prompt_len, kept, n_sink, n_recent, budget, dec_sink, dec_recent,
                       plan.schedule.evict_every)


def decode_evicts(policy: ComposedPolicy) -> bool:
    """Whether the plugin evicts while decoding under ``policy``: its plan says so, the prompt is compressed
    too, and the selection needs no scores (``streaming``, ``window``), is ``knorm``, whose score (the key
    norm) the workers recompute from the held keys, or scores decode steps by attention
    (:func:`decode_scores`: ``h2o``, ``a2sf``, ``tova``, ``scissorhands``, ``keyformer``). Other open score
    rules (which may
    read positions, which a held slot does not record) stay prompt-only."""
    ev, schedule = policy.eviction, policy.schedule
    if not (schedule.decode_evict and schedule.prefill_compress):
        return False
    if decode_scores(policy):
        return True
    if ev.prefill_mode is not None:
        return False
    return not ev.scores_tokens or ev.name == "knorm"


def query_window(policy: ComposedPolicy, prompt_len: int) -> int:
    """How many of a prompt's last queries score it (``prefill_window``, whose 0 means every row): the rows
    a worker keeps across prefill chunks until the compaction reads them."""
    window = policy.eviction.prefill_window(prompt_len)
    return prompt_len if window <= 0 else min(window, prompt_len)


def decode_scores(policy: ComposedPolicy) -> bool:
    """Whether the workers keep per-slot scores that decode steps update (:data:`DECODE_SCORE_MODES`),
    from the prompt's scores on: the policy evicts while decoding, by attention."""
    schedule = policy.schedule
    return (policy.eviction.score_mode in DECODE_SCORE_MODES and schedule.decode_evict
            and schedule.prefill_compress)


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` past the prompt that one step processes together: they attend to the
    ``stored`` slots held before them and to each other (causally); ``redo``: the batch's attention did not
    give them that, so they attend again; then ``evicted`` tokens leave (0: none), the ``pending`` tokens
    of the step that follow them moving down with the kept ones."""

    start: int
    end: int
    stored: int
    redo: bool
    evicted: int
    pending: int


def step_pieces(lengths: KeptLengths, computed: int, scheduled: int) -> list[Piece]:
    """What a worker does, after the batch's attention, for a request with ``computed`` tokens cached whose
    step processes ``scheduled`` more: the step's tokens past the prompt split after each decode-time
    eviction (:meth:`KeptLengths.segments`). The batch's attention gives a request already past its prompt
    its held slots and its own tokens, right for the first piece only; in the step that compresses the
    prompt it gave every token the whole prompt, so with compression every piece attends again. After the
    step the request holds ``lengths.stored(computed + scheduled)`` slots."""
    L, end = lengths.prompt_len, computed + scheduled
    compacting = computed < L and lengths.kept < L
    pieces = lengths.segments(max(computed, L), end) if end > L else []
    return [Piece(a, b, lengths.stored(a), k > 0 or compacting, x, end - b)
            for k, (a, b, x) in enumerate(pieces)]
