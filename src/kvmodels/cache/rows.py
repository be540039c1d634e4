"""Row layouts: how a paged cache maps the model's sequences (and KV heads) onto rows of its page tables.

Every row of a page table holds pages of ``pool_kv_heads`` heads; all kernels, the eviction and the host
mirror work on rows. A layout translates the model's terms (sequence ``b``, tensors ``[B, Hkv, ...]``) to rows
and
back:

* :class:`SequenceRows` (``rows="sequences"``, the default): one row per sequence, a slot holds a token in
  every KV head, so the heads of a layer hold the same number of tokens. Every translation is the identity.
* :class:`HeadRows` (``rows="heads"``): one row per (sequence ``b``, KV head ``h``), row ``b * Hkv + h``, in
  pages of one head with the ``G = Hq / Hkv`` query heads of that KV head: the heads of a layer may hold
  different counts (head-budget policies such as ``adakv``; docs/contract.md §4.1). Each sequence is planned
  once, from its heads' uncompressed prompt scores.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvkernels import check_shape, check_tensor
from kvpolicies.base import LayerStats
from kvpolicies.plan import CompressionPlan

from .pool import ceil_div
from .report import CacheReport

INT_DTYPES = (torch.int32, torch.int64)
# One row's share of an extension: its queries, keys, values and ALiBi slopes (ExtendSteps.extend_attend).
RowArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def check_layer(l: object, n_layers: int) -> None:
    if not isinstance(l, int) or not 0 <= l < n_layers:
        raise ValueError(f"layer l={l!r} is out of range [0, {n_layers}) cache layers")


def check_sequence(b: object, n: int) -> int:
    if not isinstance(b, int) or not 0 <= b < n:
        raise ValueError(f"sequence b={b!r} is out of range [0, {n}) of the started batch")
    return b


def check_reserve(reserve: object, cache) -> int:
    """``reserve`` (slots a layer keeps free at its next plan, ``start``/``begin_extend``), checked: an int
    >= 0 that leaves a slot of the cache's per layer."""
    if isinstance(reserve, bool) or not isinstance(reserve, int) or reserve < 0:
        raise ValueError(f"reserve={reserve!r} must be an int >= 0 (the slots each layer keeps free for the "
                         "next chunk)")
    if reserve >= cache.slots_per_layer:
        raise ValueError(f"reserve={reserve} leaves no slot of the {cache.slots_per_layer} per layer "
                         f"(max_tokens={cache.max_tokens}); lower the chunk or raise max_tokens")
    return reserve


def plan_room(cache, rows: list[int]) -> torch.Tensor:
    """``[len(rows)]`` the most tokens a layer of each row may hold after its next compression
    (``ComposedPolicy.plan``'s ``room``): the slots per layer less what arrives before the compression after
    it, the row's ``reserve`` (a chunked prefill's next chunk) or else the generation's (``max_new_tokens``
    steps; ``evict_every`` of them for a policy that evicts while decoding). Where every token the row will
    have seen by then fits, it binds nothing (the row's context plus ``max_new_tokens``)."""
    slots, horizon = cache.slots_per_layer, cache.max_new_tokens
    decoding = min(cache.policy.evict_every, horizon) if cache.eviction.decode_evict else horizon
    room = []
    for r in rows:
        ahead = cache.reserve[r] or decoding
        if int(cache.host.seen[r]) + (cache.reserve[r] or horizon) <= slots:
            room.append(cache.prompt_lens[r] + horizon)  # the plan's own capacity: no further cap
        elif slots - ahead < 1:
            raise ValueError(f"{ahead} more tokens leave no slot of the {slots} per layer (max_tokens="
                             f"{cache.max_tokens}); lower the chunk or max_new_tokens, or raise max_tokens")
        else:
            room.append(slots - ahead)
    return torch.tensor(room, dtype=torch.int64)


class SequenceRows:
    """One row per sequence (row ``b`` is sequence ``b``), pages of every KV head."""

    name = "sequences"
    per_sequence = 1  # rows one sequence spans

    def __init__(self, n_kv_heads: int, n_q_heads: int):
        self.kv_heads, self.q_heads = n_kv_heads, n_q_heads
        self.pool_kv_heads, self.pool_q_heads = n_kv_heads, n_q_heads  # heads of one row

    @staticmethod
    def check_policy(policy) -> None:
        if policy.heads.per_head:
            raise ValueError(f"policy {policy.name!r} gives the KV heads of a layer different budgets "
                             f"({policy.heads.name!r}), which a page of every head cannot hold; use rows "
                             "per KV head: kvmodels.head_cache.HeadPagedKVCache "
                             "(PagedKVCache(rows=\"heads\")), or kvmodels.cache.paged_cache, which picks "
                             "the rows for a policy")

    def check_extendable(self, policy) -> None:
        pass

    def start(self) -> None:
        pass

    def replanned(self, b: int) -> None:
        """Sequence ``b`` took more tokens (``end_extend``): its next plan is made anew."""

    def rows(self, b: int) -> list[int]:
        """The rows of sequence ``b``."""
        return [b]

    def per_row(self, values: list[int]) -> list[int]:
        """One value per sequence -> one per row."""
        return list(values)

    # ------------------------------------------------------------------ tensors
    def prompt_rows(self, cache, l, b, q, k, v, alibi_slopes, lse, scores) -> list[tuple]:
        """``prefill_layer``'s arguments per row of sequence ``b``: ``(row, (q, k, v, alibi_slopes, lse,
        scores))`` (checked by the cache per row)."""
        return [(b, (q, k, v, alibi_slopes, lse, scores))]

    def extension_rows(self, b, q, k, v, alibi_slopes) -> list[tuple[int, RowArgs]]:
        """``extend_attend``'s arguments per row of sequence ``b``: ``(row, (q, k, v, alibi_slopes))``; the
        rows' outputs, concatenated over the head dim, are the sequence's."""
        return [(b, (q, k, v, alibi_slopes))]

    def check_new_tokens(self, cache, k, v, positions, q) -> None:
        """Model-level checks of ``append``'s input before translation (rows check the rest)."""

    def check_queries(self, cache, q, q_positions) -> None:
        """Model-level checks of ``attend``'s input before translation."""

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv * m, ...]`` -> ``[rows, heads of a row * m, ...]``."""
        return x

    def positions_to_rows(self, positions: torch.Tensor) -> torch.Tensor:
        return positions

    def from_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``attend``'s output rows -> ``[B, Hq, D]``."""
        return x

    def alibi_groups(self, n: int) -> list[tuple[slice, slice]] | None:
        """``None``: one decode call over all rows with all ALiBi slopes; else ``(rows, slopes)`` per call."""
        return None

    # ------------------------------------------------------------------ planning and reports
    def plan(self, cache, rows: list[int]) -> CompressionPlan:
        """The policy's plan (``ComposedPolicy.plan``) for the rows ``rows``. Budget policies allocate each
        sequence from its own statistics, so a sequence gets the same budgets alone (``compress_prompt``) as
        in the whole batch (``finish_prefill``)."""
        stats = LayerStats(cos_sim=cache.cos_sim[:, rows].cpu())
        return cache.policy.plan(torch.tensor([cache.prompt_lens[b] for b in rows]), cache.n_layers, stats,
                                 max_new_tokens=cache.max_new_tokens, budget_tokens=cache.budget_tokens[rows],
                                 windows=cache.windows, room=plan_room(cache, rows))

    def check_layer_contents(self) -> None:
        pass

    def report(self, rep: CacheReport, n: int) -> CacheReport:
        return rep


class HeadRows(SequenceRows):
    """One row per (sequence ``b``, KV head ``h``): row ``b * Hkv + h``, pages of one head, the ``G`` query
    heads of that KV head."""

    name = "heads"

    def __init__(self, n_kv_heads: int, n_q_heads: int):
        self.kv_heads, self.q_heads = n_kv_heads, n_q_heads
        self.per_sequence = n_kv_heads
        self.pool_kv_heads, self.pool_q_heads = 1, n_q_heads // n_kv_heads
        # Each sequence's plan (head budgets [Lc, 1, Hkv]), made once from the uncompressed prompt's scores.
        self.plans: dict[int, CompressionPlan] = {}

    @staticmethod
    def check_policy(policy) -> None:
        if policy.eviction.heads_share_selection:
            raise ValueError(f"eviction policy {policy.eviction.name!r} makes every KV head of a layer keep "
                             "the same tokens, which a cache of separate heads cannot see; use PagedKVCache")

    def check_extendable(self, policy) -> None:
        if policy.heads_refuse_extension:
            raise NotImplementedError(
                f"extending a sequence with head budgets {policy.heads.name!r} is not supported: its split "
                "ranks heads by the prompt's token scores, and after the first split the evicted tokens' "
                "scores are gone; use a split that does not read them (duo, even)")

    def start(self) -> None:
        self.plans = {}

    def replanned(self, b: int) -> None:
        self.plans.pop(b, None)

    def rows(self, b: int) -> list[int]:
        H = self.kv_heads
        return list(range(b * H, (b + 1) * H))

    def per_row(self, values: list[int]) -> list[int]:
        return [int(x) for x in values for _ in range(self.kv_heads)]

    # ------------------------------------------------------------------ tensors
    def prompt_rows(self, cache, l, b, q, k, v, alibi_slopes, lse, scores) -> list[tuple]:
        """``q [L, Hq, D]``, ``k, v [L, Hkv, D]``, ``lse [Hq, L]``, ``alibi_slopes [Hq]``, ``scores [Hkv,
        L]``: each KV head to its own row with the queries of its group."""
        check_layer(l, cache.n_layers)
        check_sequence(b, cache.n_sequences)
        L, H, G, D = cache.sequence_prompt_lens[b], self.kv_heads, self.pool_q_heads, cache.head_dim
        for name, t, heads in (("q", q, self.q_heads), ("k", k, H), ("v", v, H)):
            check_tensor(name, t, ndim=3, dtypes=(cache.dtype,), device=cache.device)
            check_shape(name, t, [L, heads, D], f"prompt_lens[{b}] x heads x head_dim")
        if scores is not None:
            check_tensor("scores", scores, ndim=2, dtypes=(torch.float32,), device=cache.device)
            check_shape("scores", scores, [H, L], f"n_kv_heads x prompt_lens[{b}]")
        out = []
        for h, row in enumerate(self.rows(b)):
            group = slice(h * G, (h + 1) * G)
            out.append((row, (q[:, group], k[:, h:h + 1], v[:, h:h + 1],
                              None if alibi_slopes is None else alibi_slopes[group],
                              None if lse is None else lse[group],
                              None if scores is None else scores[h:h + 1])))
        return out

    def extension_rows(self, b, q, k, v, alibi_slopes) -> list[tuple[int, RowArgs]]:
        """``q [n, Hq, D]``, ``k, v [n, Hkv, D]``: each KV head to its own row with its group's queries."""
        G = self.pool_q_heads
        return [(row, (q[:, h * G:(h + 1) * G], k[:, h:h + 1], v[:, h:h + 1],
                       None if alibi_slopes is None else alibi_slopes[h * G:(h + 1) * G]))
                for h, row in enumerate(self.rows(b))]

    def _check_batch(self, cache, name: str, t: torch.Tensor, heads: int) -> None:
        check_tensor(name, t, ndim=3, dtypes=(cache.dtype,), device=cache.device)
        check_shape(name, t, [cache.n_sequences, heads, cache.head_dim], "batch x heads x head_dim")

    def _check_positions(self, cache, name: str, t: torch.Tensor) -> None:
        check_tensor(name, t, ndim=1, dtypes=INT_DTYPES, device=cache.device)
        check_shape(name, t, [cache.n_sequences], "one position per sequence of the batch")

    def check_new_tokens(self, cache, k, v, positions, q) -> None:
        for name, t, heads in (("k", k, self.kv_heads), ("v", v, self.kv_heads), ("q", q, self.q_heads)):
            if t is not None:
                self._check_batch(cache, name, t, heads)
        self._check_positions(cache, "positions", positions)

    def check_queries(self, cache, q, q_positions) -> None:
        self._check_batch(cache, "q", q, self.q_heads)
        self._check_positions(cache, "q_positions", q_positions)

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0] * self.kv_heads, x.shape[1] // self.kv_heads, *x.shape[2:])

    def positions_to_rows(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.repeat_interleave(self.kv_heads)

    def from_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0] // self.kv_heads, x.shape[1] * self.kv_heads, *x.shape[2:])

    def alibi_groups(self, n: int) -> list[tuple[slice, slice]]:
        # ALiBi slopes belong to query heads, which differ between a sequence's rows: one call per KV head
        # over its rows (b * H + h for every b), each with its group's slopes.
        H, G = self.kv_heads, self.pool_q_heads
        return [(slice(h, n * H, H), slice(h * G, (h + 1) * G)) for h in range(H)]

    # ------------------------------------------------------------------ planning and reports
    def plan(self, cache, rows: list[int]) -> CompressionPlan:
        """As :meth:`SequenceRows.plan` for rows ``rows`` (whole sequences): the policy plans each sequence
        once, the first time it is asked (``compress_prompt`` or ``finish_prefill``), with its heads'
        uncompressed prompt scores (``plan(head_scores=...)``); its ``rows`` are then ``[Lc, len(rows)]``, one
        column per (sequence, KV head). After an extension (:meth:`replanned`) the sequence is planned again
        from what its heads hold then: rows of different lengths, their scores padded with 0 to the longest
        (a split that reads the scores is refused for extension, ``check_extendable``)."""
        H, S = self.kv_heads, cache.page_size
        plans = []
        for j in range(0, len(rows), H):
            b = rows[j] // H
            assert rows[j:j + H] == self.rows(b), "rows are planned a whole sequence at a time"
            if b not in self.plans:
                first = rows[j]

                def head_scores(l: int, _: int, first: int = first) -> torch.Tensor:
                    lens = [int(x) for x in cache.host.lens[l, first:first + H]]
                    L = max(lens)
                    pages = cache.page_table[l, first:first + H, :ceil_div(L, S)].long()  # [H, pages]
                    scores = cache.slot_score[pages].reshape(H, -1)[:, :L]  # [H, L] in position order
                    if min(lens) < L:  # (an extension: each row's slots past its own length are not its)
                        n_held = torch.tensor(lens, device=scores.device)[:, None]
                        held = torch.arange(L, device=scores.device) < n_held
                        scores = torch.where(held, scores, 0.0)
                    return scores

                stats = LayerStats(cos_sim=cache.cos_sim[:, [first]].cpu())  # every row of b holds b's
                self.plans[b] = cache.policy.plan(
                    torch.tensor([cache.prompt_lens[first]]), cache.n_layers, stats,
                    max_new_tokens=cache.max_new_tokens, budget_tokens=cache.budget_tokens[[first]],
                    head_scores=head_scores, room=plan_room(cache, [first]))
            plans.append(self.plans[b])
        return CompressionPlan.cat(plans)

    def check_layer_contents(self) -> None:
        raise TypeError("the KV heads of a HeadPagedKVCache layer hold different tokens; use "
                        "head_contents(l, b), one dict per KV head")

    def report(self, rep: CacheReport, n: int) -> CacheReport:
        """Per sequence: ``tokens_per_layer`` and ``layer_budgets`` are the means over the sequence's KV
        heads; ``head_tokens [Lc][B][Hkv]`` each head's count."""
        H = self.kv_heads

        def per_seq(rows) -> tuple[tuple[float, ...], ...]:
            return tuple(tuple(sum(row[b * H:(b + 1) * H]) / H for b in range(n)) for row in rows)

        heads = tuple(tuple(tuple(int(x) for x in row[b * H:(b + 1) * H]) for b in range(n))
                      for row in rep.tokens_per_layer)
        return replace(rep, tokens_per_layer=per_seq(rep.tokens_per_layer),
                       layer_budgets=None if rep.layer_budgets is None else per_seq(rep.layer_budgets),
                       head_tokens=heads)


ROW_LAYOUTS = {"sequences": SequenceRows, "heads": HeadRows}
