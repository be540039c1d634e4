"""The plan: what a composed policy decided for one batch, which every cache stores tokens by.

``ComposedPolicy.plan(prompt_lens, n_layers, stats, ...)`` turns what it is told (prompt lengths, the
generation length, layer statistics, the heads' prompt scores) into one frozen :class:`CompressionPlan`:

* :class:`MergeLayout` -- where each cache layer stores its tokens: MiniCache pairs ``(a, b)`` share one
  region owned by ``a`` (``ComposedPolicy.merge_layout(n_layers)``; a cache builds its storage from it
  before any batch);
* :class:`LayerBudgets` -- budgets and forced sink / recent counts ``[rows, B]``: per layer (``layers``,
  the budget policy's decision), per storage layer (``storage``: a merged pair's region budget
  ``R = B_a + B_b`` and forced ``2 * forced(R // 2)`` under ``a``, 0 under ``b``), per merged pair
  (``joint``: the ``N = min(L, R // 2)`` tokens both layers keep when the pair is merged, forced
  ``forced(N)``);
* per-head budgets ``[Lc, B, Hkv]`` of a head-budget policy (``head_budgets``);
* :class:`EvictionSchedule` -- whether the prompt is compressed and after which decode steps the cache evicts.

A cache (``kvmodels.cache.PagedKVCache``, ``HeadPagedKVCache``, the vLLM plugin) reads these and
derives none of them (docs/contract.md, "The plan").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MergeLayout:
    """Where each of ``n_layers`` cache layers stores its tokens, from the merge policy's pairs.

    Build it with :meth:`of` (or ``ComposedPolicy.merge_layout``); checked: the pairs are disjoint and in
    range (the message names the merge policy).

    Attributes
    ----------
    n_layers : int
        ``Lc``, cache layers.
    pairs : tuple of ``(a, b)``
        Merged pairs; layer ``a`` owns the pair's region, ``b`` reads it.
    merge_name : str
        The merge policy's name (for messages).
    storage : tuple of int, ``[Lc]``
        The layer whose storage holds layer ``l``'s tokens (``a`` for both layers of a pair, else ``l``).
    member : tuple of int, ``[Lc]``
        0, or 1 for the second layer of a pair; the layer's ``slot_mask`` bit is ``1 << member``.
    width : tuple of int, ``[Lc]``
        Slots layer ``l``'s storage gains per decode step: 1, 2 for a region's owner (both layers append a
        private slot), 0 for the layer that reads a region.
    merged : tuple of bool, ``[Lc]``
        Whether layer ``l`` reads a merged region (Python bools: a compiled decode step branches on them).
    """

    n_layers: int
    pairs: tuple[tuple[int, int], ...] = ()
    merge_name: str = "none"
    storage: tuple[int, ...] = field(init=False)
    member: tuple[int, ...] = field(init=False)
    width: tuple[int, ...] = field(init=False)
    merged: tuple[bool, ...] = field(init=False)

    def __post_init__(self) -> None:
        n = self.n_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n_layers must be a positive int, got {n!r}")
        pairs = tuple((int(a), int(b)) for a, b in self.pairs)
        members = [l for pair in pairs for l in pair]
        if len(set(members)) != len(members) or any(not 0 <= l < n for l in members):
            raise ValueError(f"merge policy {self.merge_name!r} gave pairs {list(pairs)} for {n} cache "
                             "layers; pairs must be disjoint and in range")
        storage, member, width = list(range(n)), [0] * n, [1] * n
        for a, b in pairs:
            storage[b], member[b] = a, 1
            width[a], width[b] = 2, 0
        for name, value in (("pairs", pairs), ("storage", tuple(storage)), ("member", tuple(member)),
                            ("width", tuple(width)), ("merged", tuple(w != 1 for w in width))):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, merge, n_layers: int) -> MergeLayout:
        """The layout of merge policy ``merge`` (a ``MergePolicy``) over ``n_layers`` cache layers."""
        return cls(n_layers, tuple(merge.pairs(n_layers)), merge.name)

    @property
    def owners(self) -> tuple[int, ...]:
        """The first layer of each pair: the layers that hold a region."""
        return tuple(a for a, _ in self.pairs)

    @property
    def max_width(self) -> int:
        """Most slots one storage layer gains per decode step (2 with a merged pair, else 1)."""
        return max(self.width)

    def mask_bit(self, l: int) -> int:
        """Layer ``l``'s bit in a region's ``slot_mask`` (1 for ``a``, 2 for ``b``)."""
        return 1 << self.member[l]

    def region_budgets(self, budgets: torch.Tensor) -> torch.Tensor:
        """``[Lc, B]`` budgets per storage layer from per-layer ``budgets [Lc, B]``: a pair's region budget
        ``R = B_a + B_b`` under ``a``, 0 under ``b`` (the total is conserved); other layers unchanged."""
        out = budgets.clone()
        for a, b in self.pairs:
            out[a] = budgets[a] + budgets[b]
            out[b] = 0
        return out


@dataclass(frozen=True, eq=False)
class LayerBudgets:
    """Budgets and forced sink / recent counts of a set of storage rows for each sequence.

    Attributes
    ----------
    budgets, n_sink, n_recent : Tensor ``[rows, B]`` int64, host
        A row is a cache layer (or a merged pair, for ``CompressionPlan.joint``); a column a sequence (a
        (sequence, KV head) for ``CompressionPlan.rows`` of a head-budget policy). A row holding more than
        its budget is compacted to it, keeping its ``n_sink`` first and ``n_recent`` last tokens.

    Iterating gives ``(budgets, n_sink, n_recent)``.
    """

    budgets: torch.Tensor
    n_sink: torch.Tensor
    n_recent: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("budgets", "n_sink", "n_recent"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"LayerBudgets.{name} must be a 2-D tensor [rows, B], got {t!r}")
            object.__setattr__(self, name, t.to("cpu", torch.int64))
        if not self.budgets.shape == self.n_sink.shape == self.n_recent.shape:
            raise ValueError(f"LayerBudgets: budgets {list(self.budgets.shape)}, n_sink "
                             f"{list(self.n_sink.shape)} and n_recent {list(self.n_recent.shape)} must have "
                             "one shape")

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.budgets, self.n_sink, self.n_recent))

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(budgets, n_sink, n_recent)`` of row ``i``, each ``[B]``."""
        return self.budgets[i], self.n_sink[i], self.n_recent[i]

    @staticmethod
    def cat(parts: Sequence[LayerBudgets]) -> LayerBudgets:
        """The parts side by side (along the sequences)."""
        return LayerBudgets(*(torch.cat([getattr(p, name) for p in parts], dim=1)
                              for name in ("budgets", "n_sink", "n_recent")))


def check_windows(windows: Sequence[int] | None, n_layers: int) -> tuple[int, ...]:
    """A model's sliding windows, one per cache layer (``W >= 2``: the layer attends to its last ``W`` tokens;
    0: to every token), as a tuple; ``()`` when no layer has one. Errors name ``windows`` and the entry."""
    if windows is None:
        return ()
    if isinstance(windows, (str, bytes)) or not isinstance(windows, Sequence):
        raise ValueError(f"windows must be a sequence of ints, one per cache layer, got {windows!r}")
    out = []
    for l, w in enumerate(windows):
        if isinstance(w, bool) or not isinstance(w, int) or w < 0 or w == 1:
            raise ValueError(f"windows[{l}] = {w!r}; each entry must be 0 (the layer attends to every token) "
                             "or a sliding window W >= 2 (its last W tokens, itself included)")
        out.append(int(w))
    if out and len(out) != n_layers:
        raise ValueError(f"windows has {len(out)} entries for {n_layers} cache layers; give one per layer "
                         "(0 for a layer that attends to every token)")
    return tuple(out) if any(out) else ()


def sliding_layers(windows: Sequence[int]) -> tuple[int, ...]:
    """The layers of ``windows`` (:func:`check_windows`'s) that have a sliding window."""
    return tuple(l for l, w in enumerate(windows) if w)


@dataclass(frozen=True)
class EvictionSchedule:
    """When a cache compresses: the prompt (``prefill_compress``) and after which decode steps.

    Attributes
    ----------
    prefill_compress : bool
        The prompt is compressed to the budgets when the prefill ends.
    decode_evict : bool
        Decode-time eviction holds each layer at its budget.
    evict_every : int
        It runs after every ``evict_every``-th decode step, so a layer holds at most ``budget +
        evict_every - 1`` tokens (a region ``R + 2 * (evict_every - 1)`` slots).
    """

    prefill_compress: bool
    decode_evict: bool
    evict_every: int = 1

    def evicts_after(self, step: int) -> bool:
        """Whether decode step ``step`` (0-based) ends with an eviction."""
        return self.decode_evict and (step + 1) % self.evict_every == 0


@dataclass(frozen=True, eq=False)
class CompressionPlan:
    """Everything a cache needs to store one batch's tokens, decided by ``ComposedPolicy.plan``.

    Attributes
    ----------
    layout : MergeLayout
        Where each layer stores its tokens.
    schedule : EvictionSchedule
        When the cache compresses.
    budget_tokens : Tensor ``[B]`` int64
        The per-layer budget of each sequence (docs/contract.md §4), before the layer-budget policy.
    layers : LayerBudgets ``[Lc, B]``
        Each layer's budget (the layer-budget policy's, capped at prompt + new tokens) and its forced counts.
    storage : LayerBudgets ``[Lc, B]``
        What each storage layer holds: ``layers``, except that a merged pair's region gets ``R = B_a + B_b``
        with forced ``2 * forced(R // 2)`` under ``a`` (each decode step's two private slots are one token
        of each layer) and 0 under ``b``. A cache compacts to these and reports them as its layer budgets.
    joint : LayerBudgets ``[n_pairs, B]``
        Row ``i`` (pair ``layout.pairs[i]``): the ``N`` tokens both layers of the pair keep when they are
        merged (``min(L, R // 2)`` with prompt compression, else all ``L``) and ``forced(N)``.
    head_budgets : Tensor ``[Lc, B, Hkv]`` int64 or None
        Per-KV-head budgets of a head-budget policy (``heads.per_head``); None when every head keeps the
        layer's budget.
    windows : tuple of int, ``[Lc]`` or empty
        The model's sliding windows (``ComposedPolicy.plan(windows=...)``): a layer with ``W > 0`` attends to
        its last ``W`` tokens only, so it keeps its last ``min(W - 1, capacity)`` (``n_sink = 0``,
        ``n_recent`` its whole budget) and is compacted to them after *every* decode step, whatever
        :attr:`schedule` says (:attr:`sliding`); 0 (or an empty tuple) for layers that attend to every token.
    """

    layout: MergeLayout
    schedule: EvictionSchedule
    budget_tokens: torch.Tensor
    layers: LayerBudgets
    storage: LayerBudgets
    joint: LayerBudgets
    head_budgets: torch.Tensor | None = None
    windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        Lc, B = self.layout.n_layers, int(self.budget_tokens.numel())
        for name, part, rows in (("layers", self.layers, Lc), ("storage", self.storage, Lc),
                                 ("joint", self.joint, len(self.layout.pairs))):
            if tuple(part.budgets.shape) != (rows, B):
                raise ValueError(f"CompressionPlan.{name} has shape {list(part.budgets.shape)}; expected "
                                 f"[{rows}, {B}]")
        if self.head_budgets is not None and (self.head_budgets.dim() != 3
                                              or tuple(self.head_budgets.shape[:2]) != (Lc, B)):
            raise ValueError(f"CompressionPlan.head_budgets has shape {list(self.head_budgets.shape)}; "
                             f"expected [{Lc}, {B}, Hkv]")
        if self.windows and len(self.windows) != Lc:
            raise ValueError(f"CompressionPlan.windows has {len(self.windows)} entries; expected one per "
                             f"cache layer ({Lc}) or none")

    @property
    def sliding(self) -> tuple[int, ...]:
        """The sliding-window layers (:attr:`windows` ``> 0``), compacted to their window every step."""
        return sliding_layers(self.windows)

    @property
    def batch_size(self) -> int:
        return int(self.budget_tokens.numel())

    def evicts_after(self, step: int) -> bool:
        """Whether decode step ``step`` (0-based) ends with an eviction (:class:`EvictionSchedule`)."""
        return self.schedule.evicts_after(step)

    @property
    def rows(self) -> LayerBudgets:
        """What each storage row of a cache is compacted to: :attr:`storage` ``[Lc, B]``, or with per-head
        budgets ``[Lc, B * Hkv]`` (column ``b * Hkv + h``: head ``h``'s budget, the layer's forced counts)."""
        if self.head_budgets is None:
            return self.storage
        Lc, B, H = self.head_budgets.shape
        return LayerBudgets(self.head_budgets.reshape(Lc, B * H),
                            self.storage.n_sink.repeat_interleave(H, dim=1),
                            self.storage.n_recent.repeat_interleave(H, dim=1))

    @staticmethod
    def cat(plans: Sequence[CompressionPlan]) -> CompressionPlan:
        """Plans of disjoint sequences, side by side (in order). A sequence's plan depends on it alone, so
        planning sequences one at a time and concatenating equals planning them together."""
        if not plans:
            raise ValueError("CompressionPlan.cat needs at least one plan")
        first = plans[0]
        if any(p.layout != first.layout or p.schedule != first.schedule or p.windows != first.windows
               for p in plans):
            raise ValueError("CompressionPlan.cat: the plans come from different policies or layer counts")
        heads = [p.head_budgets for p in plans]
        if any((h is None) != (heads[0] is None) for h in heads):
            raise ValueError("CompressionPlan.cat: some plans have head budgets and some do not")
        return CompressionPlan(
            first.layout, first.schedule, torch.cat([p.budget_tokens for p in plans]),
            LayerBudgets.cat([p.layers for p in plans]), LayerBudgets.cat([p.storage for p in plans]),
            LayerBudgets.cat([p.joint for p in plans]),
            None if heads[0] is None else torch.cat(heads, dim=1),  # type: ignore[arg-type]
            first.windows)
