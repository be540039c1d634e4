"""``compose``: pick at most one policy per role by name and get one frozen, serialisable object.

    >>> policy = compose("squeeze", "keyformer", budget=0.2, squeeze={"p": 0.3})
    >>> policy.name
    'squeeze+keyformer'
    >>> compose(policy.spec()) == policy
    True

The spec (``ComposedPolicy.spec()``) has the same shape as ``compose``'s keywords, so a spec is a call:
``{"policies": ["squeeze", "keyformer"], "budget": 0.2, "evict_every": 1, "seed": 0, "squeeze": {"p": 0.3}}``.
A name may carry its parameters as the policies print them, so one string (a command-line flag) says it
all: ``compose("squeeze(p=0.3)+keyformer", budget=0.2)`` is the policy above.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .base import (
    ROLES,
    BudgetPolicy,
    EvictionPolicy,
    HeadBudgetPolicy,
    LayerStats,
    MergePolicy,
    ModelProbe,
    Policy,
    PrecisionPolicy,
)
from .budget._rounding import cap_budgets
from .plan import CompressionPlan, EvictionSchedule, LayerBudgets, MergeLayout, check_windows
from .registry import _REGISTRY, available, get_policy

# Roles left out of a composition get these; their names are omitted from ``ComposedPolicy.name``.
DEFAULTS = {"eviction": "full", "budget": "uniform", "merge": "none", "heads": "even", "precision": "native"}
# Canonical order of names: "squeeze+snapkv+adakv", "snapkv+kivi".
_NAME_ORDER = ("budget", "eviction", "heads", "merge", "precision")
_OPTIONS = ("budget", "evict_every", "seed", "min_tokens")  # compose's keywords that are not policy names
MIN_TOKENS = 4  # default floor of every layer's budget: StreamingLLM's four attention sinks


def _check_budget(budget: object) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget={budget!r} must be a float fraction of the prompt in (0, 1] or an int "
                        f"number of tokens >= 1")
    if isinstance(budget, float) and not (0.0 < budget <= 1.0):
        whole = budget > 1 and budget.is_integer()
        hint = f"; for {budget:g} tokens pass the int {int(budget)}" if whole else ""
        raise ValueError(f"budget={budget!r} is out of range: a float budget is a fraction of the prompt in "
                         f"(0, 1]{hint}")
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"budget={budget!r} is out of range: an int budget is a number of tokens >= 1")


def _check_count(name: str, value: object, lo: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int")
    if lo is not None and value < lo:
        raise ValueError(f"{name}={value!r} is out of range: it must be >= {lo}")


@dataclass(frozen=True, repr=False)
class ComposedPolicy:
    """One eviction, one layer-budget, one merge and one head-budget policy plus the budget they share.

    Build it with ``compose``. Immutable and hashable; ``compose(p.spec()) == p``.

    Attributes
    ----------
    eviction, budget_policy, merge, heads : the four role policies (``heads`` defaults to ``even``).
    budget : float in (0, 1] (fraction of each prompt) or int >= 1 (cache size in tokens per layer: what a
        layer may grow to and is held at while decoding, whatever the prompt length); docs/contract.md §4.
    evict_every : int >= 1 — decode-time eviction runs every ``evict_every`` steps, so a layer holds at most
        ``budget + evict_every - 1`` tokens between steps.
    seed : int — seeds stochastic scores (Keyformer's Gumbel noise).
    min_tokens : int >= 1 — no layer's budget falls below ``max(min_tokens, eviction.min_budget())``
        (:attr:`floor`), however small the budget or however far a layer-budget policy moves it.
    """

    eviction: EvictionPolicy
    budget_policy: BudgetPolicy
    merge: MergePolicy
    budget: float | int = 1.0
    evict_every: int = 1
    seed: int = 0
    min_tokens: int = MIN_TOKENS
    heads: HeadBudgetPolicy = None  # type: ignore[assignment]  # None: ``even``, set in __post_init__
    precision: PrecisionPolicy = None  # type: ignore[assignment]  # None: ``native``, set in __post_init__

    def __post_init__(self) -> None:
        if self.heads is None:
            object.__setattr__(self, "heads", get_policy(DEFAULTS["heads"])())
        if self.precision is None:
            object.__setattr__(self, "precision", get_policy(DEFAULTS["precision"])())
        roles = (("eviction", EvictionPolicy), ("budget_policy", BudgetPolicy), ("merge", MergePolicy),
                 ("heads", HeadBudgetPolicy), ("precision", PrecisionPolicy))
        for attr, base in roles:
            if not isinstance(getattr(self, attr), base):
                raise TypeError(f"{attr} must be a {base.__name__}, got {getattr(self, attr)!r}")
        _check_budget(self.budget)
        _check_count("evict_every", self.evict_every, 1)
        _check_count("seed", self.seed, None)
        _check_count("min_tokens", self.min_tokens, 1)
        if self.eviction.name == DEFAULTS["eviction"] and self.budget_policy.name != DEFAULTS["budget"]:
            name = self.budget_policy.name
            raise ValueError(f"budget policy {name!r} needs an eviction policy: 'full' keeps every token; "
                             f"add one, e.g. compose({name!r}, 'h2o')")
        if self.heads.per_head:
            self._check_per_head()
        ev, prec = self.eviction, self.precision
        if prec.needs_scores and ev.prefill_mode is None and not ev.scores_tokens:
            raise ValueError(f"precision policy {prec.name!r} ranks tokens by their attention scores, and "
                             f"eviction policy {ev.name!r} scores no prompt; compose it with a scorer, e.g. "
                             f"compose('h2o', {prec.name!r}, budget=1.0) to quantize without evicting")
        if prec.quantizes and self.merge.name != DEFAULTS["merge"]:
            raise ValueError(f"precision policy {prec.name!r} cannot be composed with merge policy "
                             f"{self.merge.name!r}: a merged region stores magnitudes and directions, not "
                             "quantized rows")

    def _check_per_head(self) -> None:
        """Per-head budgets split a layer's budget by the prompt scores of its heads (HeadBudgetPolicy)."""
        ev, name = self.eviction, self.heads.name
        if ev.prefill_mode is None and not ev.scores_tokens:
            raise ValueError(f"head-budget policy {name!r} splits a layer's budget among its KV heads by "
                             f"their prompt scores, and eviction policy {ev.name!r} scores no prompt; "
                             f"compose it with a scorer, e.g. compose('snapkv', {name!r})")
        if ev.heads_share_selection:
            raise ValueError(f"head-budget policy {name!r} gives heads different tokens, and eviction "
                             f"policy {ev.name!r} (with {ev.params() or 'its defaults'}) makes every "
                             f"head of a layer keep the same ones; use a per-head scorer: "
                             f"{ev.name}={{'per_head': True}}")
        if self.merge.name != DEFAULTS["merge"]:
            raise ValueError(f"head-budget policy {name!r} cannot be composed with merge policy "
                             f"{self.merge.name!r}: a merged region holds one token count for every head")

    # -- calibration --------------------------------------------------------------------------------------
    @property
    def needs_calibration(self) -> bool:
        """Whether a role policy measures something on the model first (``profile`` or ``duo`` without
        weights)."""
        return self.budget_policy.needs_calibration or self.heads.needs_calibration

    def calibrate(self, probe: ModelProbe) -> tuple[ComposedPolicy, list[str]]:
        """This policy fitted to one model through ``probe`` (``kvmodels.profile.ModelProbe``): each role
        policy's :meth:`~kvpolicies.base.BudgetPolicy.calibrate`, and one ``"<name>: <what was measured>"``
        line per policy that measured something. Unchanged (and no lines) when nothing needs it."""
        budget_policy, note = self.budget_policy.calibrate(probe)
        heads, head_note = self.heads.calibrate(probe)
        notes = [f"{p.name}: {n}" for p, n in ((budget_policy, note), (heads, head_note)) if n]
        return dataclasses.replace(self, budget_policy=budget_policy, heads=heads), notes

    def check_model(self, n_layers: int, n_kv_heads: int) -> None:
        """Each role policy's :meth:`~kvpolicies.base.Policy.check_model` for a model of ``n_layers`` cache
        layers and ``n_kv_heads`` KV heads: weights measured on another model (``profile``'s per layer,
        ``duo``'s per layer and KV head), or none where they are needed (``duo`` not calibrated), are refused
        where the cache is built, not after a prefill."""
        for p in self.policies().values():
            p.check_model(n_layers, n_kv_heads)

    # -- naming and serialisation -------------------------------------------------------------------------
    def policies(self) -> dict[str, Policy]:
        """The role policies by role, in canonical order (budget, eviction, heads, merge, precision)."""
        by_role: dict[str, Policy] = {"budget": self.budget_policy, "eviction": self.eviction,
                                      "merge": self.merge, "heads": self.heads, "precision": self.precision}
        return {role: by_role[role] for role in _NAME_ORDER}

    @property
    def name(self) -> str:
        """Canonical name: non-default policies joined by ``+`` (budget, eviction, heads, merge, precision),
        or ``"full"``."""
        parts = [p.name for role, p in self.policies().items() if p.name != DEFAULTS[role]]
        return "+".join(parts) or DEFAULTS["eviction"]

    def spec(self) -> dict[str, Any]:
        """A JSON-able dict that ``compose`` turns back into an equal object."""
        out: dict[str, Any] = {"policies": self.name.split("+"), "budget": self.budget,
                               "evict_every": self.evict_every, "seed": self.seed,
                               "min_tokens": self.min_tokens}
        for p in self.policies().values():
            if p.params():
                out[p.name] = p.params()
        return out

    def to_json(self) -> str:
        """``json.dumps(self.spec())``; ``compose`` accepts the string back."""
        return json.dumps(self.spec(), sort_keys=True)

    def __repr__(self) -> str:
        params = "".join(f", {p.name}={p.params()!r}" for p in self.policies().values() if p.params())
        floor = "" if self.min_tokens == MIN_TOKENS else f", min_tokens={self.min_tokens}"
        return (f"ComposedPolicy({self.name!r}, budget={self.budget!r}, evict_every={self.evict_every}, "
                f"seed={self.seed}{floor}{params})")

    @property
    def label(self) -> str:
        """:attr:`name` with each policy's non-default parameters, e.g. ``'pyramid+snapkv(chunk=10)'``;
        ``compose(label, budget=...)`` reads it back."""
        parts = []
        for role, p in self.policies().items():
            if p.name == DEFAULTS[role] and not (role == "eviction" and self.name == "full"):
                continue
            args = ", ".join(f"{k}={v!r}" for k, v in p.params().items())
            parts.append(f"{p.name}({args})" if args else p.name)
        return "+".join(parts)

    def __str__(self) -> str:
        return f"{self.label} @ budget={self.budget!r}, evict_every={self.evict_every}, seed={self.seed}"

    def hf_cache(self, model: Any, **kw: Any) -> Any:
        """Retired with the transformers bridge: ``kvmodels.hf.paged_cache(model, policy)`` (docs/hf.md)."""
        raise AttributeError("policy.hf_cache(model) was retired with kvpolicies.hf: use "
                             "kvmodels.hf.paged_cache(model, policy) (same keywords: max_new_tokens, seed, "
                             "probe_prefix), or kvmodels.hf.compressed(model, policy)")

    # -- budgets ------------------------------------------------------------------------------------------
    @property
    def floor(self) -> int:
        """The fewest tokens any layer's budget holds: ``max(min_tokens, eviction.min_budget())``."""
        return max(self.min_tokens, self.eviction.min_budget())

    def budget_tokens(self, prompt_lens: torch.Tensor) -> torch.Tensor:
        """Per-sequence, per-layer token budgets (docs/contract.md §4).

        A fraction gives ``ceil(budget * prompt_len)``: the prompt is compressed to that and, with
        decode-time eviction, the cache is held there. An int is a cache size (StreamingLLM's and H2O's
        "cache size"): the prompt is kept whole while it fits, the cache grows to ``budget`` tokens per layer
        while decoding and is held there; it is not capped at the prompt length. Both are then raised to
        :attr:`floor`. ``full`` keeps everything: its budget is the prompt length.

        Parameters
        ----------
        prompt_lens : Tensor ``[B]`` int

        Returns
        -------
        Tensor ``[B]`` int64 on ``prompt_lens.device``.
        """
        if not isinstance(prompt_lens, torch.Tensor) or prompt_lens.dim() != 1:
            raise ValueError("prompt_lens must be a 1-D integer tensor [B], e.g. torch.tensor([12, 40])")
        if prompt_lens.is_floating_point() or prompt_lens.dtype == torch.bool:
            raise TypeError(f"prompt_lens has dtype {prompt_lens.dtype}; pass integer lengths (.long())")
        lens = prompt_lens.to(torch.int64)
        if lens.numel() and int(lens.min()) < 0:
            raise ValueError(f"prompt_lens must be >= 0, got min {int(lens.min())}")
        ev = self.eviction
        if not ev.prefill_compress and not ev.decode_evict and not ev.probe:  # full: keeps every token
            return lens.clone()
        if isinstance(self.budget, float):
            # The 1e-9 guard keeps binary rounding from adding a token (0.2 * 5 = 1.0000000000000002).
            raw = torch.minimum(torch.ceil(lens.to(torch.float64) * self.budget - 1e-9).to(torch.int64), lens)
        else:
            raw = torch.full_like(lens, self.budget)
        return torch.clamp(raw, min=self.floor)

    def layer_budgets(self, budget_tokens: torch.Tensor, n_layers: int,
                      stats: LayerStats | None = None, capacity: torch.Tensor | None = None) -> torch.Tensor:
        """``[n_layers, B]`` int64 layer budgets from the budget policy, floored at the eviction's min.

        capacity : ``[B]`` int, optional — the most tokens a layer can ever hold (prompt length + new
            tokens). Budgets above it are capped and the overflow goes to the other layers
            (``cap_budgets``), so the total is conserved as far as the sequence allows.
        """
        budgets = self.budget_policy.allocate(budget_tokens, n_layers, stats, self.floor)
        if capacity is not None:
            budgets = cap_budgets(budgets, torch.as_tensor(capacity))
        return budgets

    def checked_budget_tokens(self, prompt_lens: torch.Tensor,
                              budget_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`budget_tokens` of ``prompt_lens`` (or the ``budget_tokens`` given) as host int64 ``[B]``,
        checked: one per sequence, each ``>= 1``. Caches call it before prefilling; :meth:`plan` too."""
        lens = torch.as_tensor(prompt_lens).to("cpu", torch.int64)
        bt = self.budget_tokens(lens) if budget_tokens is None else budget_tokens
        bt = torch.as_tensor(bt).to("cpu", torch.int64)
        if bt.shape != (int(lens.numel()),) or bool((bt < 1).any()):
            raise ValueError(f"policy {self.name!r} (budget={self.budget!r}) gave per-sequence budgets "
                             f"{bt.tolist()} for prompt_lens={lens.tolist()}; each must be >= 1")
        return bt

    @property
    def schedule(self) -> EvictionSchedule:
        """When a cache compresses (both caches ask, through the plan): the prompt, and after which decode
        steps (the eviction policy evicts during decoding, every ``evict_every`` steps)."""
        return EvictionSchedule(bool(self.eviction.prefill_compress), bool(self.eviction.decode_evict),
                                self.evict_every)

    def checked_probe_prefix(self, probe_prefix: Sequence[int]) -> list[int]:
        """``probe_prefix`` as token ids, fed before the context's copy in a reconstruction pass (kvzip's
        instruction); ``ValueError`` for text or a policy that runs no such pass."""
        if isinstance(probe_prefix, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in probe_prefix):
            raise ValueError(f"probe_prefix must be a list of token ids, got {probe_prefix!r}; tokenize it")
        if len(probe_prefix) and not self.eviction.probe:
            raise ValueError(f"probe_prefix is fed before the prompt's copy in a reconstruction pass, and "
                             f"policy {self.name!r} runs none; use kvzip, or leave probe_prefix out")
        return [int(t) for t in probe_prefix]

    def check_probe_fits(self, where: str, n: int, start: int, extra: int, limit: int | None) -> None:
        """Refuse a reconstruction pass over a prompt of ``n`` tokens (``where`` names it, e.g.
        ``tokens[0]``) that cannot run: a prompt no longer than ``skip``'s opening, or passes fed at positions
        from ``start`` on (after ``extra`` tokens of probe prefix) that reach past the model's ``limit``
        positions (None: no limit)."""
        ev, name = self.eviction, self.name
        skip = ev.probe_skip
        if skip is not None and n <= skip[1]:
            raise ValueError(f"{where}: policy {name!r} copies the prompt from token {skip[1]} on (its "
                             f"skip: the chat template's opening), and the prompt has {n} tokens; lower skip "
                             "or give a longer prompt")
        need = start + max(extra + stop - lo for lo, stop, _ in ev.probe_passes(n))
        if limit is not None and need > limit:
            span = getattr(ev, "span", None)  # kvzip's; a plugin's probe policy may have none
            with_prefix = f" after the {extra} tokens of probe_prefix" if extra else ""
            how = ("shorten the prompt or reconstruct it in parts (kvzip(span=N))" if span is None
                   else "shorten the prompt or lower span")
            raise ValueError(f"{where}: policy {name!r} feeds the prompt of {n} tokens again after itself"
                             f"{with_prefix} (the reconstruction pass"
                             f"{'' if span is None else f', {span} tokens at a time'}), at positions up to "
                             f"{need}, past the model's context of {limit}; {how}")

    @property
    def heads_refuse_extension(self) -> bool:
        """Whether a sequence cannot take tokens after its prompt because of its head budgets: a per-head
        split that reads the tokens' scores (``adakv``, ``pooled``) is made again after an extension, from
        what the heads hold; once anything was evicted, only the survivors' scores are left. A policy that
        compresses nothing but after its reconstruction pass (``kvzip``: the context is held whole until the
        probe ranks it) splits once over the whole context, and a later re-split compresses nothing."""
        ev = self.eviction
        return (self.heads.per_head and self.heads.split_reads_scores
                and (ev.prefill_compress or ev.decode_evict))

    def evicts_after(self, step: int) -> bool:
        """Whether decode step ``step`` (0-based) ends with an eviction (:attr:`schedule`)."""
        return self.schedule.evicts_after(step)

    def merge_layout(self, n_layers: int) -> MergeLayout:
        """Where each of ``n_layers`` cache layers stores its tokens: the merge policy's pairs, checked
        (disjoint, in range; the error names the merge policy). A cache builds its storage from it."""
        return MergeLayout.of(self.merge, n_layers)

    def plan(self, prompt_lens: torch.Tensor, n_layers: int, stats: LayerStats | None = None, *,
             max_new_tokens: int = 0, budget_tokens: torch.Tensor | None = None,
             head_scores: Callable[[int, int], torch.Tensor] | None = None,
             windows: Sequence[int] | None = None, room: torch.Tensor | None = None) -> CompressionPlan:
        """The compression decision every cache acts on, made once per batch (docs/contract.md, "The plan").

        Parameters
        ----------
        prompt_lens : Tensor ``[B]`` int
            Prompt length of each sequence.
        n_layers : int
            ``Lc``, cache layers.
        stats : LayerStats, optional
            The budget policy's prefill statistics (``cos_sim [Lc, B]``).
        max_new_tokens : int
            Decode steps; a layer can hold at most ``prompt_len + max_new_tokens`` tokens, and a budget
            above that is capped (:meth:`layer_budgets`).
        budget_tokens : Tensor ``[B]`` int, optional
            :meth:`budget_tokens` of ``prompt_lens`` when the caller has them already.
        head_scores : callable ``(l, j) -> Tensor [Hkv, L]``, optional
            The prompt scores of layer ``l`` of the ``j``-th sequence before any compression, which
            :meth:`head_budgets` splits the layer's budget by; the plan then has ``head_budgets``. Required
            by a head-budget policy (``heads.per_head``); a cache of per-head pages passes it always.
        windows : sequence of int, optional
            The model's sliding windows, one per cache layer (0: the layer attends to every token; ``W >= 2``:
            to its last ``W``, e.g. five of Gemma 3's six layers). Such a layer keeps its last
            ``min(W - 1, prompt_len + max_new_tokens)`` tokens whatever the policy (its own attention reads
            no more), evicting after every decode step (``CompressionPlan.sliding``); the policy's budgets and
            selection act on the other layers. A layer-budget policy still plans over every layer: what it
            gives a sliding layer is replaced by the window, not moved to the others. Refused with a merge
            policy or per-head budgets.
        room : Tensor ``[B]`` int, optional
            The most tokens a layer of each sequence may hold after this compression: a cache's slots per
            layer less what must still fit before the next one (a chunked prefill's next chunk). Layer
            budgets are capped at it as at ``prompt_len + max_new_tokens``, the excess handed to the layers
            with room, so a layer-budget policy's large layers fit a cache sized for the mean budget; so are
            head budgets (``duo``'s retrieval heads), the excess handed to the layer's other heads.

        Returns
        -------
        CompressionPlan
            Host int64 tensors, checked: every layer budget ``>= 1``, forced slots within it.
        """
        lens = torch.as_tensor(prompt_lens).to("cpu", torch.int64)
        B = int(lens.numel())
        bt = self.checked_budget_tokens(lens, budget_tokens)
        capacity = lens + max_new_tokens  # the most a layer can ever hold
        if room is not None:
            room = torch.as_tensor(room).to("cpu", torch.int64)
            if room.shape != (B,) or bool((room < 1).any()):
                raise ValueError(f"room={room.tolist()} must be one int >= 1 per sequence ({B})")
            capacity = torch.minimum(capacity, room)
        budgets = torch.as_tensor(self.layer_budgets(bt, n_layers, stats, capacity=capacity))
        budgets = budgets.to(torch.int64).cpu()
        if budgets.shape != (n_layers, B) or bool((budgets < 1).any()):
            raise ValueError(f"policy {self.name!r} gave layer budgets {budgets.tolist()}; expected shape "
                             f"[{n_layers}, {B}] with every entry >= 1")
        windows = check_windows(windows, n_layers)
        n_sink, n_recent = self._forced(budgets)
        if windows:  # the model's own window: its last min(W - 1, capacity) tokens, forced, whatever the plan
            if self.merge.name != DEFAULTS["merge"] or self.heads.per_head:
                what = self.merge.name if self.merge.name != DEFAULTS["merge"] else self.heads.name
                raise ValueError(f"policy {self.name!r}: {what!r} is not supported on a model with "
                                 "sliding-window layers (windows=...); drop it, or run a model whose layers "
                                 "all attend to every token")
            for l, w in enumerate(windows):
                if w:
                    budgets[l] = torch.minimum(capacity, torch.tensor(w - 1)).clamp_min(1)
                    n_sink[l], n_recent[l] = 0, budgets[l]
        layers = LayerBudgets(budgets, n_sink, n_recent)
        if bool((layers.n_sink + layers.n_recent > budgets).any()):
            raise ValueError(f"eviction policy {self.eviction.name!r} forces more tokens (sinks + recent) "
                             f"than the layer budgets {budgets.tolist()} allow; raise the budget")
        layout = self.merge_layout(n_layers)
        schedule = self.schedule
        # A merged pair is one region: budget R = B_a + B_b; each decode step adds one private slot of each
        # layer, so its forced slots are 2 * forced(R // 2). Merging keeps N = min(L, R // 2) per layer.
        regions = layout.region_budgets(budgets)
        n_sink, n_recent = layers.n_sink.clone(), layers.n_recent.clone()
        keep = torch.zeros(len(layout.pairs), B, dtype=torch.int64)
        for i, (a, b) in enumerate(layout.pairs):
            n_sink[a], n_recent[a] = (2 * x for x in self.eviction.forced(regions[a] // 2))
            n_sink[b] = n_recent[b] = 0
            keep[i] = torch.minimum(lens, regions[a] // 2) if schedule.prefill_compress else lens
        heads = None
        if self.heads.per_head or head_scores is not None:
            heads = self._plan_heads(layers, head_scores, None if room is None else capacity)
        return CompressionPlan(layout, schedule, bt, layers, LayerBudgets(regions, n_sink, n_recent),
                               LayerBudgets(keep, *self._forced(keep)), heads, windows)

    def _forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The eviction's forced ``(n_sink, n_recent)`` for each row of ``budgets [rows, B]``."""
        if budgets.shape[0] == 0:
            return budgets.clone(), budgets.clone()
        forced = [self.eviction.forced(row) for row in budgets]
        return (torch.stack([s for s, _ in forced]).to(torch.int64),
                torch.stack([r for _, r in forced]).to(torch.int64))

    def _plan_heads(self, layers: LayerBudgets, head_scores: Callable[[int, int], torch.Tensor] | None,
                    room: torch.Tensor | None = None) -> torch.Tensor:
        """``[Lc, B, Hkv]`` head budgets: each compressed layer's budget split by :meth:`head_budgets` (all
        of a sequence's compressed layers together by :meth:`pooled_head_budgets` when the head policy
        ``pools_layers``); a layer the prompt fits in (or without prompt compression) gives every head its
        budget. A policy that ranks the prompt by a reconstruction pass (``kvzip``) compresses after it: its
        layers are split too (before the pass, by the prompt's own scores; the cache replans after it).
        ``room [B]`` (``plan(room=)``): no head keeps more, the excess handed to the layer's other heads."""
        if head_scores is None:
            raise ValueError(f"head-budget policy {self.heads.name!r} splits each layer's budget by its "
                             "heads' prompt scores; pass plan(..., head_scores=lambda l, j: scores [Hkv, L])")
        compresses = self.eviction.prefill_compress or self.eviction.probe
        Lc, B = layers.budgets.shape
        out = []
        for j in range(B):
            scores = [head_scores(l, j) for l in range(Lc)]  # [Hkv, L] each
            budget, n_sink, n_recent = (x[:, j].tolist() for x in layers)
            H = scores[0].shape[0]
            row = torch.tensor(budget, dtype=torch.int64)[:, None].repeat(1, H)  # [Lc, Hkv]
            split = [l for l in range(Lc) if compresses and scores[l].shape[1] > budget[l]]
            if self.heads.pools_layers and split:
                row[split] = self.pooled_head_budgets([scores[l] for l in split], [budget[l] for l in split],
                                                      [(n_sink[l], n_recent[l]) for l in split])
            else:
                for l in split:
                    row[l] = self.head_budgets(scores[l], budget[l], n_sink[l], n_recent[l], layer=l)
            if room is not None:  # each layer's heads as the layers of cap_budgets
                row = cap_budgets(row.T, room[j].repeat(Lc)).T
            out.append(row)
        return torch.stack(out, dim=1)  # [Lc, B, Hkv]

    def pooled_head_budgets(self, scores: list[torch.Tensor], budgets: list[int],
                            n_forced: list[tuple[int, int]]) -> torch.Tensor:
        """``[n, Hkv]`` int64 budgets of ``n`` compressed layers of one sequence split together
        (``heads.split_layers``); checked: each head keeps its forced tokens (and at least one) and at most
        its layer's ``L``, and the heads hold ``Hkv * sum(budgets)`` tokens in all."""
        H = scores[0].shape[0]
        out = torch.as_tensor(self.heads.split_layers(scores, budgets, n_forced)).to(torch.int64).cpu()
        lens = torch.tensor([s.shape[1] for s in scores])[:, None]
        floor = torch.tensor([max(1, a + b) for a, b in n_forced])[:, None]
        if (out.shape != (len(scores), H) or bool((out < torch.minimum(floor, lens)).any())
                or bool((out > lens).any()) or int(out.sum()) != H * sum(budgets)):
            raise ValueError(f"head-budget policy {self.heads.name!r} split budgets {budgets} of layers of "
                             f"{lens.flatten().tolist()} tokens into {out.tolist()} for {H} KV heads; it "
                             f"must give each head at least max(1, n_sink + n_recent), at most its layer's "
                             f"tokens, and {H * sum(budgets)} in all")
        return out

    def head_budgets(self, scores: torch.Tensor, budget: int, n_sink: int, n_recent: int, *,
                     layer: int | None = None) -> torch.Tensor:
        """``[Hkv]`` int64 budgets of the KV heads of one layer of one sequence, from the head-budget policy
        (``heads.split``) given the layer's ``[Hkv, L]`` prompt scores, its budget ``B``, its forced
        counts (``plan.layers``) and its index ``layer`` (``duo`` needs it); checked: each head keeps its
        forced tokens (and at least one), and when the layer is compressed (``L > B``) the heads hold
        ``Hkv * B`` tokens, none more than ``L``."""
        H, L = scores.shape
        out = torch.as_tensor(self.heads.split(scores, int(budget), (int(n_sink), int(n_recent)),
                                               layer=layer))
        out = out.to(torch.int64).cpu()
        ok = out.shape == (H,) and bool((out >= max(1, n_sink + n_recent)).all())
        if ok and L > budget:
            ok = int(out.sum()) == H * budget and bool((out <= L).all())
        if not ok:
            raise ValueError(f"head-budget policy {self.heads.name!r} split budget {budget} of a "
                             f"layer of {L} tokens into {out.tolist()} for {H} KV heads; it must give "
                             f"each head at least max(1, n_sink + n_recent) = {max(1, n_sink + n_recent)} "
                             f"and, when L > budget, at most L each and {H * budget} in all")
        return out


# ---------------------------------------------------------------------------------------------------------
def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _make(name: str, params: Mapping[str, Any]) -> Policy:
    cls = get_policy(name)
    if not isinstance(params, Mapping):
        raise TypeError(f"parameters for {name!r} must be a dict, got {params!r}")
    fields = [f.name for f in dataclasses.fields(cls)]
    for key in params:
        if key not in fields:
            known = f"its parameters are {fields}" if fields else "it takes no parameters"
            raise ValueError(f"{name}: unknown parameter {key!r} ({known}){_suggest(str(key), fields)}")
    return cls(**params)


_NAME_WITH_PARAMS = re.compile(r"([A-Za-z_][\w-]*)\s*(?:\((.*)\))?", re.S)


def _split_plus(text: str) -> list[str]:
    """``text`` split at the ``+`` signs outside parentheses (a parameter value may hold one: ``1e+3``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "+" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _parse_name(part: str) -> tuple[str, dict[str, Any]]:
    """``"snapkv(chunk=10, per_head=False)"`` -> ``("snapkv", {"chunk": 10, "per_head": False})``: keyword
    arguments with Python literal values, as a policy prints itself; a bare name has no parameters."""
    m = _NAME_WITH_PARAMS.fullmatch(part)
    if m is None:
        raise ValueError(f"cannot read the policy {part!r}; write a name, optionally with parameters as "
                         "keyword literals, e.g. 'snapkv' or 'snapkv(chunk=10, per_head=False)'")
    name, args = m.group(1), m.group(2)
    if args is None or not args.strip():
        return name, {}
    try:
        call = ast.parse(f"f({args})", mode="eval").body
    except (SyntaxError, ValueError):
        call = None
    # One plain call of keyword arguments only (no positional ones, no **kwargs, no second call).
    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args
            and all(k.arg for k in call.keywords)):
        try:
            return name, {str(k.arg): ast.literal_eval(k.value) for k in call.keywords}
        except ValueError:  # a value that is not a literal
            pass
    raise ValueError(f"cannot read the parameters of {part!r}; give them as keyword=literal pairs, e.g. "
                     f"{_example(name)}")


def _example(name: str) -> str:
    """A policy text of ``name`` with one of its own parameters at its default (for error messages)."""
    try:
        fields = [f for f in dataclasses.fields(get_policy(name)) if f.default is not dataclasses.MISSING]
    except Exception:  # noqa: BLE001 -- an unknown name (reported later) or a policy that is no dataclass
        return "'snapkv(chunk=10, per_head=False)'"
    if not fields:
        return f"'{name}' (it takes no parameters)"
    return f"'{name}({fields[0].name}={fields[0].default!r})'"


def _expand(item: Any, names: list[tuple[str, dict[str, Any]]], options: dict[str, Any]) -> None:
    """Add one positional argument of ``compose`` to ``names`` / ``options``."""
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(f"could not parse the JSON spec {item!r}: {exc}") from None
    if isinstance(item, ComposedPolicy):
        item = item.spec()
    if isinstance(item, Mapping):
        spec = dict(item)
        policies = spec.pop("policies", [])
        if isinstance(policies, str):
            policies = [policies]
        for key, value in spec.items():
            if key in options:
                raise ValueError(f"{key!r} is given twice (in the spec and as a keyword)")
            options[key] = value
        for p in policies:
            _expand(p, names, options)
    elif isinstance(item, str):
        for part in _split_plus(item):
            if not part.strip():
                raise ValueError(f"empty policy name in {item!r}; join names with '+', e.g. 'squeeze+h2o'")
            names.append(_parse_name(part.strip()))
    elif (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
          and isinstance(item[1], Mapping)):  # (name, params), or the pair as JSON writes it: a list
        names.append((item[0], dict(item[1])))
    elif isinstance(item, (tuple, list)):  # several of the above: ["h2o", "kivi"]
        for p in item:
            _expand(p, names, options)
    elif isinstance(item, Policy):
        names.append((item.name, item.params()))
    else:
        raise TypeError(f"compose() takes policy names, 'a+b' strings, (name, {{params}}) pairs, Policy "
                        f"objects, lists of these or a dict/JSON spec; got {item!r}")


def compose(*policies: Any, **kwargs: Any) -> ComposedPolicy:
    """Compose eviction, layer-budget, merge and head-budget policies by name.

    Parameters
    ----------
    *policies
        Any mix of names (``"keyformer"``), ``"squeeze+keyformer"`` strings, ``(name, params)`` pairs
        (or ``[name, params]``, as JSON writes a pair), lists of these, policy objects, or a spec (dict or
        JSON string, as ``ComposedPolicy.spec()`` returns). Order does not matter; at most one policy per
        role; missing roles get ``full`` / ``uniform`` / ``none`` / ``even``.
    budget : float in (0, 1] or int >= 1, default 1.0
        Fraction of each prompt, or tokens per cache layer (docs/contract.md §4). ``full`` ignores it.
    evict_every : int >= 1, default 1
        Run decode-time eviction every ``n`` steps.
    seed : int, default 0
        Seed of stochastic scores.
    min_tokens : int >= 1, default 4
        Floor of every layer's budget (with the eviction policy's own minimum, e.g. streaming's sinks + 1).
    **params
        ``<policy name>={param: value}`` for the policies composed, e.g. ``keyformer={"tau_end": 3.0}``.

    Returns
    -------
    ComposedPolicy

    Raises
    ------
    KeyError
        Unknown policy name (the message suggests the closest names).
    ValueError, TypeError
        Two policies of one role, an unknown or out-of-range parameter, a bad budget; the message names it.
    """
    names: list[tuple[str, dict[str, Any]]] = []
    options: dict[str, Any] = {}
    for item in policies:
        _expand(item, names, options)
    for key, value in kwargs.items():
        if key in options:
            raise ValueError(f"{key!r} is given twice (in the spec and as a keyword)")
        options[key] = value

    chosen: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, params in names:
        role = get_policy(name).role
        if role in chosen:
            other = chosen[role][0]
            what = f"{name!r} is given twice" if other == name else \
                f"{other!r} and {name!r} are both {role} policies"
            raise ValueError(f"{what}; compose takes at most one policy per role")
        chosen[role] = (name, dict(params))

    settings = {k: options.pop(k) for k in _OPTIONS if k in options}
    composed_names = {n for n, _ in chosen.values()}
    for key, value in options.items():   # what is left must be parameters of composed policies
        if key in composed_names:
            role = get_policy(key).role
            if not isinstance(value, Mapping):
                raise TypeError(f"{key}={value!r}: parameters for {key!r} must be a dict, e.g. {key}={{...}}")
            overlap = set(value) & set(chosen[role][1])
            if overlap:
                raise ValueError(f"{key}: parameter(s) {sorted(overlap)} given twice")
            chosen[role][1].update(value)
        elif key in _REGISTRY:
            raise ValueError(f"parameters given for {key!r}, which is not composed; add it, e.g. "
                             f"compose(..., {key!r}, {key}={{...}})")
        else:
            options_known = list(_OPTIONS) + [r.name for r in available()]
            raise TypeError(f"compose() got an unknown keyword {key!r}; it takes budget=, evict_every=, "
                            f"seed=, min_tokens= or <policy name>={{params}}{_suggest(key, options_known)}")

    built = {role: _make(*chosen.get(role, (DEFAULTS[role], {}))) for role in ROLES}
    return ComposedPolicy(eviction=built["eviction"], budget_policy=built["budget"],  # type: ignore[arg-type]
                          merge=built["merge"], heads=built["heads"],  # type: ignore[arg-type]
                          precision=built["precision"],  # type: ignore[arg-type]
                          budget=settings.get("budget", 1.0),  # type: ignore[arg-type]
                          evict_every=settings.get("evict_every", 1),
                          seed=settings.get("seed", 0), min_tokens=settings.get("min_tokens", MIN_TOKENS))
