"""kvpolicies: compose KV-cache eviction, layer-budget and merge policies by name.

    >>> from kvpolicies import compose
    >>> policy = compose("squeeze", "keyformer", budget=0.2)
    >>> policy.name
    'squeeze+keyformer'

Four roles: eviction (which tokens a layer keeps), budget (how many each layer keeps), heads (how a
layer's budget is split among its KV heads: ``adakv``), merge (which layers share storage).
``available()`` lists the registered policies; third-party packages add their own through the
``kvpolicies.policies`` entry-point group. ``kvmodels.hf`` runs a composed policy inside a
``transformers`` model's ``generate`` (``paged_cache(model, policy)``).
"""

from __future__ import annotations

from . import budget, eviction, heads, merge, precision  # noqa: F401  (importing registers the built-in policies)
from .base import (
    BudgetPolicy,
    EvictionPolicy,
    HeadBudgetPolicy,
    LayerStats,
    MergePolicy,
    NewTokens,
    Policy,
    PrecisionPolicy,
)
from .compose import ComposedPolicy, compose
from .plan import CompressionPlan, EvictionSchedule, LayerBudgets, MergeLayout
from .registry import PolicyInfo, UnknownPolicyError, available, get_policy, register_policy

__all__ = [
    "BudgetPolicy",
    "ComposedPolicy",
    "CompressionPlan",
    "EvictionPolicy",
    "EvictionSchedule",
    "HeadBudgetPolicy",
    "LayerBudgets",
    "LayerStats",
    "MergeLayout",
    "MergePolicy",
    "NewTokens",
    "Policy",
    "PrecisionPolicy",
    "PolicyInfo",
    "UnknownPolicyError",
    "available",
    "compose",
    "get_policy",
    "register_policy",
]
