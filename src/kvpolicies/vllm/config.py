"""The plugin's policy: read from ``KVPOLICIES_VLLM_POLICY``, checked once, and the one per-prompt decision
(how many tokens each layer keeps) that the scheduler and the workers both derive from it.

This module imports no vLLM, so it is tested and used without it.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import torch

from ..compose import ComposedPolicy, compose

ENV = "KVPOLICIES_VLLM_POLICY"


class PolicySpecError(ValueError):
    """``KVPOLICIES_VLLM_POLICY`` names no policy this plugin can apply; the message is one line."""


def parse(raw: str) -> ComposedPolicy:
    """The composed policy of ``raw``: a ``compose`` spec as JSON (``'{"policies": ["streaming"], "budget":
    0.2}'``, what ``ComposedPolicy.to_json()`` writes) or a name (``"snapkv(window=16)"``, budget 1.0).

    Raises
    ------
    PolicySpecError
        One line naming the variable, the value and what to change: an unknown policy or parameter, bad
        JSON, or a policy the plugin does not apply yet (:func:`check_supported`).
    """
    text = raw.strip()
    try:
        if text.startswith("{"):
            policy = compose(json.loads(text))
        else:
            policy = compose(text)
    except (KeyError, ValueError, TypeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise PolicySpecError(f"{ENV}={raw!r}: {msg}".replace("\n", " ")) from None
    check_supported(policy, raw)
    return policy


def check_supported(policy: ComposedPolicy, raw: str = "") -> None:
    """Refuse, in one line, what this slice of the plugin does not apply: a budget policy other than
    ``uniform`` (vLLM's one block table per KV-cache group holds every layer at one length), per-head budgets,
    layer merging, eviction that scores decode steps (h2o, tova, ...), open score rules that read queries,
    ChunkKV's layer-wise index reuse, and quantized precision (kivi, zipcache, mikv)."""
    ev = policy.eviction
    problems = []
    if policy.budget_policy.name != "uniform":
        problems.append(f"layer budgets {policy.budget_policy.name!r} (only 'uniform')")
    if policy.heads.per_head:
        problems.append(f"head budgets {policy.heads.name!r}")
    if policy.merge.name != "none":
        problems.append(f"layer merging {policy.merge.name!r}")
    if ev.score_mode != "none":
        problems.append(f"eviction {ev.name!r} scores decode steps (score_mode={ev.score_mode!r})")
    if ev.scores_tokens and ev.reads_queries:
        problems.append(f"eviction {ev.name!r} reads queries in its token_scores")
    if ev.score_source_layer(1) != 1:
        problems.append(f"eviction {ev.name!r} reuses an earlier layer's scores")
    if policy.precision.quantizes:
        problems.append(f"quantized storage {policy.precision.name!r}")
    if problems:
        raise PolicySpecError(f"{ENV}={raw or policy.name!r}: the vLLM plugin does not apply "
                              f"{'; '.join(problems)} yet; use full, window, streaming, knorm, snapkv or "
                              "chunkkv with uniform budgets (docs/vllm.md)")


def policy_from_env() -> ComposedPolicy | None:
    """The policy in ``KVPOLICIES_VLLM_POLICY`` (None when unset or empty), parsed once per value."""
    raw = os.environ.get(ENV, "")
    return _parsed(raw) if raw.strip() else None


@lru_cache(maxsize=8)
def _parsed(raw: str) -> ComposedPolicy:
    return parse(raw)


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
