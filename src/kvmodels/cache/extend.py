"""Continuing a sequence on a paged cache: ``pause`` between turns, ``begin_extend`` / ``extend_attend`` /
``end_extend`` to take more tokens after the prompt (a chunked prefill, a follow-up turn), ``restart_decode``
for the next generation (``kvmodels.decoder.Decoder`` drives these).

:class:`ExtendSteps` is one part of :class:`kvmodels.cache.PagedKVCache` (a mixin over the cache's pool,
tables and host mirror).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvkernels import check_shape, check_tensor

from .pool import PagePool, ceil_div, per_head_gather
from .rows import INT_DTYPES, check_reserve, check_sequence
from .state import CacheState


@dataclass(frozen=True)
class ProbeSpan:
    """One pass of a reconstruction (``begin_extend(..., probe=ProbeSpan(...))``): the kept tokens at
    positions ``[start, stop)`` take this pass's scores (``stop=None``: every position onward); the sequence
    is compressed after the pass when it is the ``last`` one. ``probe=True`` is ``ProbeSpan()``: one pass
    scoring every kept token, then the compression."""

    start: int = 0
    stop: int | None = None
    last: bool = True


@dataclass
class Extension:
    """An extension in progress (:meth:`ExtendSteps.begin_extend`): sequence ``b`` takes ``n`` tokens."""

    b: int
    n: int
    budget_len: int  # the length the sequence's budget is a fraction of afterwards
    done: np.ndarray  # [Lc] bool, the layers extended so far
    probe: ProbeSpan | None = None  # a reconstruction pass: scores kept tokens, stores nothing (begin_extend)
    reserve: int = 0  # slots each layer keeps free after the extension's compression (the next chunk)
    chunked: bool = False  # a chunk of a prompt: a two-format cache evicts to the budget after it too


class ExtendSteps(CacheState):
    """Pause, extension and restart of the sequences of a started batch."""

    # A sequence between decode steps (or between turns, paused) takes more tokens: begin_extend, then the
    # model runs them through every layer (extend_attend), then end_extend re-plans and compresses it.
    # restart_decode starts the next generation. Together they are a chunked prefill and a follow-up turn.
    def pause(self, b: int) -> None:
        """Take sequence ``b`` out of the decode steps, keeping its pages (``finish_sequence`` returns
        them): it appends nothing, its kept tokens get no score update (the decode attention reads none of
        them), and :meth:`begin_extend` takes it back."""
        if self._state != "decode":
            raise RuntimeError(f"pause called in state {self._state!r}; call it between decode steps")
        for row in self.rows.rows(check_sequence(b, self.n_sequences)):
            if not self.host.active[row]:
                raise ValueError(f"sequence {b} is not decoding (finished or paused already)")
            self.active[row] = False
            self.host.active[row] = False
            self.host.parked[row] = True

    def check_extendable(self) -> None:
        """Raise ``NotImplementedError`` when this cache's policy cannot take tokens after the prompt (a
        merge policy, per-head budgets); :meth:`begin_extend` checks it, callers may check it up front."""
        if self.layout.pairs:
            raise NotImplementedError(f"extending a sequence with merge policy {self.layout.merge_name!r} is "
                                      "not supported (a merged region cannot take prefill tokens); use a "
                                      "policy without merging")
        self.rows.check_extendable(self.policy)

    def slots_held(self, b: int) -> int:
        """The most slots any cache layer (any of its rows) holds for sequence ``b`` now (host mirror)."""
        return int(self.host.lens[:, self.rows.rows(b)].max(initial=0))

    def decode_room(self, b: int) -> int:
        """Decode steps sequence ``b`` can take before one of its storage layers (a merged region takes two
        slots a step) runs out of the slots ``max_tokens`` gives it, evicting nothing (host mirror)."""
        held = self.host.lens[:, self.rows.rows(b)].max(axis=1)
        room = [(self.max_pages * self.page_size - int(held[l])) // w
                for l, w in enumerate(self.layout.width) if w]
        return min(room)

    def decode_pages(self, steps: int, region: str = "main") -> int | None:
        """:meth:`decode_needs` of one pool (``region``: ``"main"``, or with two formats ``"side"``); ``None``
        where it is not counted."""
        needs = self.decode_needs(steps)
        i = int(region == "side")
        return needs[i][1] if i < len(needs) else None

    def decode_needs(self, steps: int) -> list[tuple[PagePool, int]]:
        """Each pool with the most pages the batch's active rows may open in it over the next ``steps``
        decode steps, at worst (host arithmetic, no sync): every row appends each step (a merged region two
        slots) and keeps its pages, save what the plan's decode-time eviction holds it to (at most
        ``max(held, budget)`` plus the slots of ``evict_every`` steps) and what a model's sliding window holds
        (its last ``W - 1`` and one more). With two formats, both pools, replayed step by step on lengths
        (``SideRegion.decode_pages``); none for two formats beside a model's sliding windows, or before a
        plan (not counted). ``Decoder.generate`` compares each with its pool's free pages before its first
        step."""
        if self.plan is None or (self.side is not None and self.sliding):
            return []
        if self.side is not None:
            return list(zip((self.pool, self.side.pool), self.side.decode_pages(self, steps)))
        n, S = self.batch_size, self.page_size
        held = self.host.lens[:, :n].astype(np.int64)
        width = self._width[:, None] * self.host.active[:n]  # [Lc, n] slots a step appends
        peak = held + width * steps
        if self.plan.schedule.decode_evict:
            budgets = self.plan.rows.budgets.numpy()[:, :n].astype(np.int64)
            every = min(steps, self.plan.schedule.evict_every)
            peak = np.minimum(peak, np.maximum(held, budgets) + width * every)
        for l in self.sliding:  # compacted back to the window after every step
            peak[l] = np.minimum(peak[l], np.maximum(held[l], self.windows[l] - 1) + width[l])
        return [(self.pool, int((ceil_div(peak, S) - ceil_div(held, S)).sum()))]

    @property
    def slots_per_layer(self) -> int:
        """The most slots one layer may hold for one sequence (``max_tokens`` rounded up to whole pages)."""
        return self.max_pages * self.page_size // self.layout.max_width

    def can_make_room(self, b: int, n: int) -> bool:
        """Whether :meth:`make_room` gives every layer of sequence ``b`` room for ``n`` more tokens: the
        policy compresses prompts, in one format (two formats evict nothing after the split), with no merged
        layers, and ``b``'s mean budget per layer plus ``n`` fits the slots per layer (so the re-plan's cap
        moves budget between layers, or heads, and drops none of it)."""
        if not self.eviction.prefill_compress or self.side is not None or self.layout.pairs:
            return False
        slots = self.slots_per_layer
        return n < slots and int(self.budget_tokens[self.rows.rows(b)[0]]) + n <= slots

    def make_room(self, b: int, n: int) -> None:
        """Compress sequence ``b`` so that each of its layers (each KV head's row) takes ``n`` more tokens:
        its plan is made again with ``n`` slots reserved (``ComposedPolicy.plan``'s ``room``: the larger
        layers' or heads' budgets capped, the excess handed to the others) and every layer over its budget
        compressed now. :meth:`begin_extend` calls it when a layer lacks the room (:meth:`can_make_room`): a
        layer-budget policy's or ``duo``'s largest layers fill a cache sized for the mean budget, and a
        follow-up turn, whose length the previous plan did not know, would not fit them (found 2026-12-07,
        streaming a context and its questions into a cache of the mean budget + one chunk: refused at a
        question). The tokens it evicts are ranked by the scores so far, before the new tokens vote."""
        if self._state != "decode":
            raise RuntimeError(f"make_room called in state {self._state!r}; call it between decode steps")
        check_sequence(b, self.n_sequences)
        check_reserve(n, self)
        rows = self.rows.rows(b)
        for row in rows:
            self.reserve[row] = n
        self.rows.replanned(b)  # per-head rows: split again, under the cap
        self._replan(rows)

    def begin_extend(self, b: int, n: int, *, budget_len: int | None = None,
                     max_new_tokens: int | None = None, probe: bool | ProbeSpan = False,
                     reserve: int = 0, chunked: bool = False) -> None:
        """Let sequence ``b`` (between decode steps, or paused) take ``n`` more tokens.

        The model then runs the ``n`` tokens through every cache layer at their true positions (the
        sequence's tokens seen so far, onward), calling :meth:`extend_attend` (and :meth:`observe`) per
        layer; :meth:`end_extend` re-plans the sequence and compresses it to its budgets. Checked here,
        before anything is written: the slots a layer may hold (``max_tokens``) and the pool's free pages.

        Parameters
        ----------
        budget_len:
            The length the sequence's budget is a fraction of afterwards (docs/contract.md §4); default:
            every token it has seen, these included. A chunked prefill passes the whole prompt's length.
        max_new_tokens:
            The planning horizon: the plan caps each layer's budget at the context plus this many decode
            steps (the next generation's length); default: the current one (``start``'s or
            :meth:`restart_decode`'s).
        probe:
            A reconstruction pass (an eviction policy with ``probe = True``, ``kvzip``): the ``n`` tokens
            attend as an extension's would, at the positions after every token seen, but they only score:
            each kept token's score is REPLACED by what the ``n`` rows give it (the policy's ``probe_mode``
            over every row; kvzip's ``max``: the largest probability), and the tokens are not stored (no
            pages, lengths and ``seen`` unchanged). :meth:`end_extend` then compresses the sequence to its
            budgets by those scores, whatever the policy's ``prefill_compress``. ``budget_len`` defaults to
            the tokens seen (the probe adds none). A :class:`ProbeSpan` makes it one pass of several (KVzip's
            chunked reconstruction): only the kept tokens at its positions take the pass's scores, and only
            its ``last`` pass compresses.
        reserve:
            The slots every layer of ``b`` must keep free after this extension's compression (the next
            chunk of a chunked prefill; 0, the default, after the last): the plan caps its layer budgets at
            the slots per layer less this and hands the excess to its other layers (``start``'s
            ``reserve``). It holds for ``b``'s later plans until the next extension sets it.
        chunked:
            These tokens are a chunk of a prompt being prefilled (``Decoder.extend(..., chunk=)``), not a
            follow-up turn. It changes a two-format cache only (``kvmodels.cache.tiers``): the chunk's
            rows score both regions' tokens as a one-format cache's would (an evicting policy's window
            votes or accumulated attention), and :meth:`end_extend` then holds the sequence to its budget
            as decoding does (KIVI's residual ages and the oldest region gives up its lowest-ranked tokens,
            ``SideRegion.evict``; MiKV moves what the policy evicts to its low bits; ZipCache first chooses
            its high bits again among the main region's tokens, ``SideRegion.reselect``), where a follow-up
            is kept whole.
        """
        if self._state != "decode":
            raise RuntimeError(f"begin_extend called in state {self._state!r}; extend a sequence after "
                               "finish_prefill(), between decode steps")
        self.check_extendable()
        check_sequence(b, self.n_sequences)
        rows = self.rows.rows(b)
        if not self.host.holding()[rows].all():
            raise ValueError(f"sequence {b} is finished (its pages went back to the pool); it cannot be "
                             "extended")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r} must be a positive int (the tokens to add)")
        if not isinstance(probe, (bool, ProbeSpan)):
            raise TypeError(f"probe must be True, False or a ProbeSpan, got {probe!r}")
        span = ProbeSpan() if probe is True else probe or None
        check_reserve(reserve, self)
        if span is not None:
            self._check_probe()
        if not isinstance(chunked, bool):
            raise TypeError(f"chunked must be True or False, got {chunked!r}")
        seen = int(self.host.seen[rows[0]]) + (0 if span is not None else n)
        budget_len = seen if budget_len is None else int(budget_len)
        if budget_len < seen:
            raise ValueError(f"budget_len={budget_len} is less than the {seen} tokens sequence {b} will have "
                             "seen; pass at least that")
        if max_new_tokens is not None:
            if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
            self.max_new_tokens = max_new_tokens
        if span is not None:  # stores nothing: no slots or pages to check
            self._extension = Extension(b, n, budget_len, np.zeros(self.n_layers, dtype=bool), probe=span,
                                        reserve=reserve, chunked=chunked)
            self._state = "extend"
            return
        S, capacity = self.page_size, self.max_pages * self.page_size
        lens = self.host.lens[:, rows]  # [Lc, rows of b]
        if (lens + n > capacity).any() and self.can_make_room(b, n):
            self.make_room(b, n)
            lens = self.host.lens[:, rows]
        if (lens + n > capacity).any():
            l = int(np.argmax((lens + n > capacity).any(axis=1)))
            lens = lens.max(axis=1)
            raise ValueError(f"sequence {b} holds {lens[l]} tokens in layer {l}; {n} more make "
                             f"{lens[l] + n}, past the {capacity} slots per layer of max_tokens="
                             f"{self.max_tokens}; extend in smaller chunks (chunk=) or build the cache with "
                             "a larger max_tokens")
        need = int((ceil_div(lens + n, S) - ceil_div(lens, S)).sum())
        if need > self.pool.free:
            raise self.pool.out_of_pages(need, f"extension of sequence {b} by {n} tokens")
        if self.side is not None:  # two formats: KIVI's residual ages into the side region afterwards
            aged = self.side.pages_to_age(b, lens[:, 0], n, chunked)
            if aged > self.side.pool.free:
                what = f"the {self.side.side_bits}-bit tokens aging out of the residual"
                raise self.side.pool.out_of_pages(aged, f"extension of sequence {b} by {n} tokens ({what})")
        self._extension = Extension(b, n, budget_len, np.zeros(self.n_layers, dtype=bool), reserve=reserve,
                                    chunked=chunked)
        self._state = "extend"

    def _check_probe(self) -> None:
        """Raise naming the policy when a reconstruction pass (``begin_extend(..., probe=True)``) cannot run:
        an eviction policy that does not rank by one, two storage formats."""
        ev = self.eviction
        if not ev.probe:
            raise ValueError(f"begin_extend(probe=True): eviction policy {ev.name!r} does not rank the "
                             "context by a reconstruction pass (its probe is False); use kvzip, or extend "
                             "without probe")
        if self.side is not None:
            raise NotImplementedError(f"eviction policy {ev.name!r} ranks the context by a reconstruction "
                                      "pass, and this cache stores tokens in two formats "
                                      f"({self.policy.precision.name!r}), split after the prompt and never "
                                      "evicted afterwards; use native precision or kivi(residual=0)")

    def extend_attend(self, l: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, *, scale: float,
                      alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """The extension's attention in cache layer ``l``: its ``n`` tokens over sequence ``b``'s kept tokens
        and themselves (causal among them); their K/V are appended after the kept ones, and the policy's
        scores come from the same probabilities (``kvkernels.extend_attention``, a torch implementation).
        With two formats (``kvmodels.cache.tiers``) the kept tokens are both regions' and nothing is scored:
        nothing is evicted after the split.

        How the scores carry over (the prefill scorer's rules, docs/contract.md §2.3, over kept + new):

        * a policy that scores every query row (``h2o``, ``a2sf``, ``keyformer``, ``scissorhands``): the
          extension's rows continue the kept tokens' scores as decode steps would (accumulated, decayed,
          counted); new tokens start from 0;
        * window votes (``snapkv``, ``chunkkv``: the last ``window`` rows; ``tova``: the last row): the kept
          tokens' scores are replaced by this extension's votes, post-processed (pooling, chunk sums, the
          heads' mean) over the kept and new tokens in position order, as a prompt's would be;
        * an open score rule (``knorm``): each new token's own score, the kept ones unchanged; no score mode:
          nothing (new tokens 0). ChunkKV's layer-wise index reuse does not apply: every layer scores itself.

        Parameters
        ----------
        q:
            ``[n, Hq, D]`` queries (after RoPE).
        k, v:
            ``[n, Hkv, D]`` keys (after RoPE) and values, ``dtype`` of the cache.
        positions:
            ``[n]`` int, the tokens' absolute positions (the sequence's tokens seen so far, onward).
        scale, alibi_slopes:
            Logit scale and optional ``[Hq]`` float32 ALiBi slopes.

        Returns
        -------
        ``[n, Hq, D]`` attention output in ``q``'s dtype.
        """
        ext = self._extension
        if self._state != "extend" or ext is None:
            raise RuntimeError(f"extend_attend called in state {self._state!r}; call begin_extend(b, n) "
                               "first")
        self._check_layer(l)
        if b != ext.b:
            raise ValueError(f"sequence b={b!r} is not the one being extended ({ext.b})")
        if ext.done[l]:
            raise RuntimeError(f"layer {l} of sequence {b} is already extended; call end_extend({b})")
        n, D, dev = ext.n, self.head_dim, self.device
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t, ndim=3, dtypes=(self.dtype,), device=dev)
        check_shape("q", q, [n, self.q_heads, D], "n x n_q_heads x head_dim")
        check_shape("k", k, [n, self.kv_heads, D], "n x n_kv_heads x head_dim")
        check_shape("v", v, [n, self.kv_heads, D], "n x n_kv_heads x head_dim")
        check_tensor("positions", positions, ndim=1, dtypes=INT_DTYPES, device=dev)
        check_shape("positions", positions, [n], "n (the tokens begin_extend announced)")
        outs = [self._extend_row(l, row, *args, positions, scale=scale)
                for row, args in self.rows.extension_rows(b, q, k, v, alibi_slopes)]
        ext.done[l] = True
        self.host.track_peak(self.page_size)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _extend_row(self, l: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    alibi_slopes: torch.Tensor | None, positions: torch.Tensor, *,
                    scale: float) -> torch.Tensor:
        """:meth:`extend_attend` on pool row ``b`` (checked): ``q [n, G*Hkv, D]``, ``k, v [n, Hkv, D]`` in the
        pool's heads of a row."""
        n, H, S, dev = q.shape[0], self.n_kv_heads, self.page_size, self.device
        # The kept tokens in slot order, then per KV head in position order (pooling reads neighbours).
        m = int(self.host.lens[l, b])
        table = self.page_table[l, b, :ceil_div(m, S)].to(torch.int64)
        slots = torch.arange(m, device=dev)
        page, offset = table[slots // S], slots % S  # [m] each
        kept_score = self.slot_score[page, offset]  # [m, Hkv]
        order = torch.sort(self.slot_pos[page, offset].long(), dim=0, stable=True).indices  # [m, Hkv]

        def by_position(pool: torch.Tensor) -> torch.Tensor:  # [m, Hkv, ...] in position order per head
            return per_head_gather(pool[page, offset], order)

        # Two formats: the side region's tokens are attended too. A prompt-only policy scores nothing after
        # the split (a follow-up is kept whole) but a prefill chunk's tokens, which it evicts after; one that
        # evicts while decoding goes on scoring both regions' tokens, as its decode steps do.
        ev, ext = self.eviction, self._extension
        span = None if ext is None else ext.probe
        scoring = self.side is None or ev.decode_evict or (ext is not None and ext.chunked)
        kept_k = self.storage.decode(by_position(self.k_pages))
        kept_v = self.storage.decode(by_position(self.v_pages))
        kept_pos = by_position(self.slot_pos)
        old = kept_score.gather(0, order).t()  # [Hkv, m] position order
        if self.key_scale is not None:  # channel-separable keys: the pool holds k / c
            kept_k = kept_k * self.key_scale[l, b].to(kept_k.dtype)
        ms, both = 0, None
        if self.side is not None:  # the side region's tokens too, both regions' in position order per head
            side_k, side_v, side_pos = self.side.held(
                l, b, None if self.key_scale is None else self.key_scale[l, b])
            side_page, side_off = self.side.slots(l, b)
            ms = side_k.shape[0]
            kept_pos = torch.cat([side_pos, kept_pos])
            both = torch.sort(kept_pos.long(), dim=0, stable=True).indices  # [ms + m, Hkv]
            kept_k = per_head_gather(torch.cat([side_k, kept_k]), both)
            kept_v = per_head_gather(torch.cat([side_v, kept_v]), both)
            kept_pos = per_head_gather(kept_pos, both)
            old = torch.cat([self.side.pool.slot_score[side_page, side_off].t(), old], dim=1)  # [Hkv, ms + m]
            old = old.gather(1, both.t())
        out, scores = ev.extension_scores(
            q, k, v, positions, kept_k, kept_v, kept_pos, old, scale=scale, seed=self.prefill_seed(l, b),
            alibi_slopes=alibi_slopes, probe=None if span is None else (span.start, span.stop),
            scoring=scoring, sliding_window=self.window(l))
        if scores is not None and both is not None:  # back to the side's slot order, then the main's
            held = torch.empty_like(scores[:, :ms + m]).scatter_(1, both.t(), scores[:, :ms + m])
            scores = torch.cat([held, scores[:, ms + m:]], dim=1)
        if span is not None:  # a reconstruction pass: its rows' mass replaces the scores; nothing stored
            assert scores is not None and ms == 0  # _check_probe: one format, a scoring policy
            self.slot_score[page, offset] = torch.empty_like(kept_score).scatter_(0, order, scores.t())
            return out
        if scores is not None:
            if ms:  # the side region's, in its slot order
                assert self.side is not None  # ms > 0: it holds some of the sequence's tokens
                self.side.pool.slot_score[side_page, side_off] = scores[:, :ms].t().contiguous()
            scores = scores[:, ms:]  # the main region's kept tokens (position order), then the new ones
            kept = torch.empty_like(kept_score).scatter_(0, order, scores[:, :m].t().contiguous())
            self.slot_score[page, offset] = kept  # back in slot order
            new_scores = scores[:, m:].t()  # [n, Hkv]
        elif ev.scores_tokens and scoring:  # an open rule: each token's score from what its step provides
            new_scores = self._token_scores(q, k, v, positions, check=True)
        else:
            new_scores = torch.zeros(n, H, dtype=torch.float32, device=dev)

        # Append after the kept slots, popping the pages the extension opens (begin_extend counted them).
        held, total = ceil_div(m, S), ceil_div(m + n, S)
        if total > held:
            self.page_table[l, b, held:total] = self.pool.take(total - held)
        slots = torch.arange(m, m + n, device=dev)
        page, offset = self.page_table[l, b, :total].to(torch.int64)[slots // S], slots % S
        stored_k = k if self.key_scale is None else k / self.key_scale[l, b].to(k.dtype)
        self.k_pages[page, offset] = self.storage.encode(stored_k)
        self.v_pages[page, offset] = self.storage.encode(v)
        self.slot_pos[page, offset] = positions.to(torch.int32)[:, None].expand(n, H)
        self.slot_score[page, offset] = new_scores.to(torch.float32)
        self.seq_lens[l, b] = m + n
        self.host.lens[l, b] = m + n
        return out


    def end_extend(self, b: int) -> None:
        """Finish sequence ``b``'s extension: re-plan the batch (``b``'s budget from ``budget_len``, its
        layer budgets capped at its context plus the planning horizon) and compress every layer over budget
        (the policy's ``prefill_compress``), returning pages; with two formats, compress nothing and let
        KIVI's residual age instead (a prefill chunk, ``begin_extend(chunked=True)``, then evicts the
        lowest-ranked quantized tokens over the budget, or MiKV demotes, as a decode step would). The
        sequence decodes at the next step. After a probe (``begin_extend(..., probe=True)``) the sequence
        has seen no more tokens, and its layers are compressed to their budgets by the probe's scores now,
        whatever the policy's ``prefill_compress``."""
        ext = self._extension
        if self._state != "extend" or ext is None or b != ext.b:
            raise RuntimeError(f"end_extend({b!r}) must follow begin_extend({b!r}) and extend_attend on "
                               "every layer")
        if not ext.done.all():
            l = int(np.argmin(ext.done))
            raise RuntimeError(f"layer {l} of sequence {b} was not extended; call extend_attend for every "
                               "cache layer")
        rows = self.rows.rows(b)
        if ext.probe is None:  # a probe's tokens were never stored: the sequence has seen nothing more
            self.host.seen[rows] += ext.n
        for row in rows:
            self.prompt_lens[row] = ext.budget_len
            self.budget_lens[row] = ext.budget_len
            self.reserve[row] = ext.reserve
        self.budget_tokens[rows] = self.policy.checked_budget_tokens(torch.tensor([ext.budget_len]))[0]
        self.active[rows] = True
        self.host.active[rows] = True
        self.host.parked[rows] = False
        if ext.probe is not None or self.eviction.prefill_compress or self.eviction.decode_evict:
            # Planned anew (per-head rows: split again). A policy that evicts only after its
            # reconstruction pass (kvzip) keeps the pass's split when a later turn appends tokens.
            self.rows.replanned(b)
        self._extension = None
        self._state = "decode"
        self._replan(rows)  # only b's rows: another sequence's new tokens wait for its own extension
        if ext.probe is not None and ext.probe.last:  # compressed by the probe's scores; others may wait
            assert self.plan is not None  # _replan made it
            self._compress_rows(rows, *(x.numpy()[:, rows] for x in self.plan.rows))
        if self.side is not None:  # KIVI: the extension's tokens older than the residual are quantized now
            if ext.chunked and self.side.reselects:  # ZipCache: the chunk split as the prompt was
                ev = self.eviction
                self.side.reselect(self, rows, ev.prefill_window(ext.n) if ev.prefill_mode else 0)
            else:
                self.side.migrate(self)
            if ext.chunked and (self.eviction.prefill_compress or self.eviction.decode_evict):
                self.side.evict(self, rows)  # a prefill chunk: held to the budget, as decoding holds it

    def restart_decode(self, max_new_tokens: int) -> None:
        """Start the next generation of the batch: ``max_new_tokens`` decode steps from step 0 (Keyformer's
        temperature schedule restarts). When the horizon changes, the plan is remade with it (each layer's
        budget capped at its context plus ``max_new_tokens``) and layers over their new budget are
        compressed now."""
        if self._state != "decode":
            raise RuntimeError(f"restart_decode called in state {self._state!r}; call it between decode "
                               "steps")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self._step = 0
        if max_new_tokens == self.max_new_tokens and self.plan is not None:
            return
        self.max_new_tokens = max_new_tokens
        self._replan()

    def _replan(self, rows: list[int] | None = None) -> None:
        """The batch's plan from the sequences' current lengths, budgets and horizon (``self.plan``), and,
        with the policy's ``prefill_compress``, every layer over its budget compressed now (of pool ``rows``
        only when given: an extension compresses its own sequence, so a batch's turn, one sequence at a time,
        keeps what each sequence keeps alone). A
        sequence's capacity counts every token it has seen (a generation adds to its context), its budget the
        length it was last given (``budget_len``). Layers may be out of position order after decode-time
        eviction: ``topk_evict`` ranks by stored positions (Keyformer's layers stay in order: its decode
        noise is indexed by slot, and ``_compress`` keeps them on ``topk_compact``)."""
        n = self.batch_size
        for b in np.flatnonzero(self.host.holding()[:n]):
            self.prompt_lens[b] = max(self.prompt_lens[b], int(self.host.seen[b]))
        self.plan = self._plan(list(range(n)))
        self.budgets[:, :n] = self.plan.rows.budgets.clamp_min(1).to(self.device, torch.int32)
        if self.plan.schedule.prefill_compress and self.side is None:  # two formats: at the split only
            if self.eviction.heads_share_selection:  # as after_step: one ranking for the layer's heads
                self.slot_score.copy_(self.eviction.eviction_scores(self.slot_score, head_dim=-1))
            self._compress(in_place=True, rows=rows)
        elif self.sliding:  # the model's windows hold whatever the policy: back to their last W - 1 tokens
            self._compress(self.sliding, in_place=True, rows=rows)

