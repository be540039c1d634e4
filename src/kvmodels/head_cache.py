"""Per-head pages: a paged cache whose KV heads of one layer hold different token counts (Ada-KV).

``PagedKVCache`` stores a token in slot ``i`` of a page for every KV head at once (pages ``[S, Hkv, D]``),
so the heads of a layer always hold the same number of slots. A head-budget policy such as ``adakv``
(``kvpolicies.heads``) gives them different counts; holding those in shared slots would mean masking the
shorter heads' empty slots, which costs memory instead of saving it (docs/design-adakv.md measures it).

``HeadPagedKVCache`` gives every (sequence, KV head) pair its own row of the page pool: its own page table,
length and budget, in pages of one head (``[S, 1, D]``). It *is* a ``PagedKVCache`` whose rows are
``(sequence b, KV head h) -> row b * Hkv + h``, with one KV head and the ``G = Hq / Hkv`` query heads of
that KV head per row; this class only translates the model's ``[B, Hkv, ...]`` tensors to rows and back
and hands the policy its heads' prompt scores to plan per-head budgets from. So the kernels, the eviction
and the host bookkeeping are the ones every other policy runs through, and a head that keeps ``n`` tokens
holds ``ceil(n / S)`` pages (docs/contract.md §4.1).

Head budgets are planned once per sequence, from the layer's prompt scores before any compression
(``ComposedPolicy.plan(..., head_scores=...)``, whose ``head_budgets`` split each layer), and held while
decoding: decode-time eviction keeps each head at its own budget. ``report()`` lists, per layer and
sequence, the mean over KV heads of the tokens and budgets
(``head_tokens`` has each head's count).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvkernels import check_shape, check_tensor
from kvkernels.paged_attention import Alibi, paged_decode_attention
from kvpolicies.base import LayerStats
from kvpolicies.plan import CompressionPlan

from .cache import _INT_DTYPES, CacheReport, PagedKVCache, _ceil_div


class HeadPagedKVCache(PagedKVCache):
    """A :class:`PagedKVCache` with one page table, length and budget per (sequence, KV head).

    Same parameters and methods as :class:`PagedKVCache`, in the model's terms (``n_kv_heads``,
    ``n_q_heads``, ``max_batch`` sequences, tensors ``[B, Hkv, D]``). ``num_pages`` counts pages of ONE KV
    head (``S`` slots of ``D`` each); ``None`` gives enough for ``max_batch`` uncompressed sequences.

    Attributes (besides the pool's)
    -------------------------------
    kv_heads, q_heads:
        The model's ``Hkv`` and ``Hq``; the pool itself has one KV head and ``G = Hq / Hkv`` query heads per
        row (``n_kv_heads == 1``, ``n_q_heads == G``).
    max_sequences:
        ``max_batch`` as given (the pool holds ``max_batch * Hkv`` rows).
    """

    rows_are_heads = True

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_q_heads: int, max_batch: int,
                 max_tokens: int, page_size: int = 16, num_pages: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", policy=None,
                 seed: int = 0):
        for name, value in (("n_kv_heads", n_kv_heads), ("n_q_heads", n_q_heads), ("max_batch", max_batch),
                            ("max_tokens", max_tokens), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if n_q_heads % n_kv_heads:
            raise ValueError(f"n_q_heads={n_q_heads} must be a multiple of n_kv_heads={n_kv_heads} "
                             "(GQA groups)")
        if policy is not None and policy.eviction.heads_share_selection:
            raise ValueError(f"eviction policy {policy.eviction.name!r} makes every KV head of a layer keep "
                             "the same tokens, which a cache of separate heads cannot see; use PagedKVCache")
        self.kv_heads, self.q_heads, self.max_sequences = n_kv_heads, n_q_heads, max_batch
        self.rows_per_sequence = n_kv_heads
        if num_pages is None:
            num_pages = n_layers * max_batch * n_kv_heads * _ceil_div(max_tokens, page_size)
        super().__init__(n_layers, 1, head_dim, n_q_heads // n_kv_heads, max_batch * n_kv_heads, max_tokens,
                         page_size=page_size, num_pages=num_pages, dtype=dtype, device=device, policy=policy,
                         seed=seed)

    # ------------------------------------------------------------------ rows
    def _rows(self, b: int) -> list[int]:
        """The pool rows of sequence ``b``: one per KV head."""
        H = self.kv_heads
        return list(range(b * H, (b + 1) * H))

    def _check_sequence(self, b: object) -> int:
        if not isinstance(b, int) or not 0 <= b < self.n_sequences:
            raise ValueError(f"sequence b={b!r} is out of range [0, {self.n_sequences}) of the started batch")
        return b

    def _to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv * m, ...]`` (per sequence, heads in KV-head groups) -> ``[B * Hkv, m, ...]``."""
        return x.reshape(x.shape[0] * self.kv_heads, x.shape[1] // self.kv_heads, *x.shape[2:])

    # ------------------------------------------------------------------ lifecycle
    def start(self, prompt_lens: list[int], max_new_tokens: int, *, compress_each: bool = False,
              budget_lens: list[int] | None = None) -> None:
        prompt_lens = [int(x) for x in prompt_lens]
        if not 1 <= len(prompt_lens) <= self.max_sequences:
            raise ValueError(f"prompt_lens has {len(prompt_lens)} sequences; the cache was built for "
                             f"1..max_batch={self.max_sequences} (raise max_batch)")
        per_row = None if budget_lens is None else [int(x) for x in budget_lens for _ in range(self.kv_heads)]
        super().start([L for L in prompt_lens for _ in range(self.kv_heads)], max_new_tokens,
                      compress_each=compress_each, budget_lens=per_row)
        self.n_sequences = len(prompt_lens)
        self.sequence_prompt_lens = prompt_lens
        # Each sequence's plan (head budgets [Lc, 1, Hkv]), made once from the uncompressed prompt's scores.
        self._plans: dict[int, CompressionPlan] = {}

    def prefill_layer(self, l: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, *, scale: float,
                      alibi_slopes: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      scores: torch.Tensor | None = None) -> None:
        """As :meth:`PagedKVCache.prefill_layer`: ``q [L, Hq, D]``, ``k, v [L, Hkv, D]``, ``lse [Hq, L]``,
        ``alibi_slopes [Hq]``, ``scores [Hkv, L]``; each KV head goes to its own row with the queries of its
        group."""
        self._check_layer(l)
        self._check_sequence(b)
        L, H, G, D = self.sequence_prompt_lens[b], self.kv_heads, self.n_q_heads, self.head_dim
        for name, t, heads in (("q", q, self.q_heads), ("k", k, H), ("v", v, H)):
            check_tensor(name, t, ndim=3, dtypes=(self.dtype,), device=self.device)
            check_shape(name, t, [L, heads, D], f"prompt_lens[{b}] x heads x head_dim")
        if scores is not None:
            check_tensor("scores", scores, ndim=2, dtypes=(torch.float32,), device=self.device)
            check_shape("scores", scores, [H, L], f"n_kv_heads x prompt_lens[{b}]")
        for h, row in enumerate(self._rows(b)):
            group = slice(h * G, (h + 1) * G)
            super().prefill_layer(l, row, q[:, group], k[:, h:h + 1], v[:, h:h + 1], positions, scale=scale,
                                  alibi_slopes=None if alibi_slopes is None else alibi_slopes[group],
                                  lse=None if lse is None else lse[group],
                                  scores=None if scores is None else scores[h:h + 1])

    def record_cos_sim(self, l: int, b: int, value: float | torch.Tensor) -> None:
        self._check_sequence(b)
        for row in self._rows(b):
            super().record_cos_sim(l, row, value)

    def _plan(self, seqs: list[int]) -> CompressionPlan:
        """As :meth:`PagedKVCache._plan` for pool rows ``seqs`` (whole sequences): the policy plans each
        sequence once, the first time it is asked (``compress_prompt`` or ``finish_prefill``), with its
        heads' uncompressed prompt scores (``plan(head_scores=...)``); its ``rows`` are then
        ``[Lc, len(seqs)]``, one column per (sequence, KV head)."""
        H, S = self.kv_heads, self.page_size
        plans = []
        for j in range(0, len(seqs), H):
            b = seqs[j] // H
            assert seqs[j:j + H] == self._rows(b), "rows are planned a whole sequence at a time"
            if b not in self._plans:
                first = seqs[j]

                def head_scores(l: int, _: int, first: int = first) -> torch.Tensor:
                    L = int(self._lens[l, first])
                    pages = self.page_table[l, first:first + H, :_ceil_div(L, S)].long()  # [H, pages]
                    return self.slot_score[pages].reshape(H, -1)[:, :L]  # [H, L] in position order

                stats = LayerStats(cos_sim=self.cos_sim[:, [first]].cpu())  # every row of b holds b's
                self._plans[b] = self.policy.plan(
                    torch.tensor([self.sequence_prompt_lens[b]]), self.n_layers, stats,
                    max_new_tokens=self.max_new_tokens, budget_tokens=self.budget_tokens[[first]],
                    head_scores=head_scores)
            plans.append(self._plans[b])
        return CompressionPlan.cat(plans)

    def compress_prompt(self, b: int) -> None:
        """As :meth:`PagedKVCache.compress_prompt`: every KV head of sequence ``b`` to its own budget."""
        if self._state != "prefill":
            raise RuntimeError(f"compress_prompt called in state {self._state!r}; call it after a sequence's "
                               "prefill and before finish_prefill()")
        rows = self._rows(self._check_sequence(b))
        if not self._prefilled[:, rows].all():
            raise RuntimeError(f"sequence {b} is not fully prefilled; call compress_prompt({b}) after its "
                               "whole prefill")
        if not self.eviction.prefill_compress or self._compressed[rows].all():
            return
        budgets, n_sink, n_recent = (x.numpy() for x in self._plan(rows).rows)  # [Lc, H] each
        layers = [l for l in range(self.n_layers) if (self._lens[l, rows] > budgets[l]).any()]
        if layers:
            self._compact(layers, rows, budgets[layers], n_sink[layers], n_recent[layers])
        self._compressed[rows] = True

    def finish_sequence(self, b: int) -> None:
        for row in self._rows(self._check_sequence(b)):
            super().finish_sequence(row)

    def pause(self, b: int) -> None:
        for row in self._rows(self._check_sequence(b)):
            super().pause(row)

    # ------------------------------------------------------------------ decode
    def append(self, l: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               q: torch.Tensor | None = None) -> None:
        """As :meth:`PagedKVCache.append`: ``k, v [B, Hkv, D]``, ``positions [B]``, ``q [B, Hq, D]``."""
        n = self.n_sequences
        for name, t, heads in (("k", k, self.kv_heads), ("v", v, self.kv_heads), ("q", q, self.q_heads)):
            if t is not None:
                check_tensor(name, t, ndim=3, dtypes=(self.dtype,), device=self.device)
                check_shape(name, t, [n, heads, self.head_dim], "batch x heads x head_dim")
        check_tensor("positions", positions, ndim=1, dtypes=_INT_DTYPES, device=self.device)
        check_shape("positions", positions, [n], "one position per sequence of the batch")
        super().append(l, self._to_rows(k), self._to_rows(v), positions.repeat_interleave(self.kv_heads),
                       None if q is None else self._to_rows(q))

    def attend(self, l: int, q: torch.Tensor, q_positions: torch.Tensor, *, scale: float,
               alibi_slopes: torch.Tensor | None = None, update_scores: bool = True) -> torch.Tensor:
        """As :meth:`PagedKVCache.attend`: ``q [B, Hq, D]`` -> ``[B, Hq, D]``."""
        n, H = self.n_sequences, self.kv_heads
        check_tensor("q", q, ndim=3, dtypes=(self.dtype,), device=self.device)
        check_shape("q", q, [n, self.q_heads, self.head_dim], "batch x heads x head_dim")
        check_tensor("q_positions", q_positions, ndim=1, dtypes=_INT_DTYPES, device=self.device)
        check_shape("q_positions", q_positions, [n], "one position per sequence of the batch")
        rows_q, rows_pos = self._to_rows(q), q_positions.repeat_interleave(H)  # [n * H, G, D], [n * H]
        if alibi_slopes is None:
            out = super().attend(l, rows_q, rows_pos, scale=scale, update_scores=update_scores)
            return out.reshape(q.shape)
        # ALiBi slopes belong to query heads, which differ between a sequence's rows: one call per KV head
        # over its rows (b * H + h for every b), each with its group's slopes.
        s, G = self.layout.storage[l], self.n_q_heads
        outs = []
        for h in range(H):
            rows = slice(h, n * H, H)
            noise = self.gumbel_noise[l, :n * H][rows].contiguous() if self.gumbel_noise is not None else None
            outs.append(paged_decode_attention(
                rows_q[rows].contiguous(), self.k_pages, self.v_pages,
                self.page_table[s, :n * H][rows].contiguous(), self._visible_lens(s)[rows].contiguous(),
                scale=scale,
                alibi=Alibi(alibi_slopes[h * G:(h + 1) * G].contiguous(), self.slot_pos,
                            rows_pos[rows].to(torch.int32).contiguous()),
                scores=self._score_update(update_scores, noise)))  # [n, G, D]
        return torch.stack(outs, dim=1).reshape(q.shape)  # [n, H, G, D] -> [n, Hq, D]

    # ------------------------------------------------------------------ inspection
    def head_contents(self, l: int, b: int) -> list[dict[str, torch.Tensor]]:
        """Kept tokens of layer ``l``, sequence ``b``, one dict per KV head, in position order: ``k``/``v``
        ``[n_h, D]``, ``pos`` ``[n_h]`` int32, ``score`` ``[n_h]`` float32 (syncs; for tests)."""
        return [{name: x[:, 0] for name, x in super(HeadPagedKVCache, self).layer_contents(l, row).items()}
                for row in self._rows(self._check_sequence(b))]

    def layer_contents(self, l: int, b: int) -> dict[str, torch.Tensor]:
        raise TypeError("the KV heads of a HeadPagedKVCache layer hold different tokens; use "
                        "head_contents(l, b), one dict per KV head")

    def report(self) -> CacheReport:
        """As :meth:`PagedKVCache.report`, per sequence: ``tokens_per_layer`` and ``layer_budgets`` are the
        means over the sequence's KV heads; ``head_tokens [Lc][B][Hkv]`` each head's count."""
        rep = super().report()
        H, n = self.kv_heads, self.n_sequences

        def per_seq(rows) -> tuple[tuple[float, ...], ...]:
            return tuple(tuple(sum(row[b * H:(b + 1) * H]) / H for b in range(n)) for row in rows)

        heads = tuple(tuple(tuple(int(x) for x in row[b * H:(b + 1) * H]) for b in range(n))
                      for row in rep.tokens_per_layer)
        return replace(rep, tokens_per_layer=per_seq(rep.tokens_per_layer),
                       layer_budgets=None if rep.layer_budgets is None else per_seq(rep.layer_budgets),
                       head_tokens=heads)

