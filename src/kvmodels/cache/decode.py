"""The decode phase of a paged cache: per step, ``prepare_decode`` (eager: pages, noise), ``append`` and
``attend`` per layer (pure tensor code on static buffers: the compiled step), ``after_step`` (eager: the
plan's decode-time eviction, replayed as a CUDA graph on CUDA by ``kvmodels.replay.Replays``).

:class:`DecodeSteps` is one part of :class:`kvmodels.cache.PagedKVCache` (a mixin over the cache's pool,
tables and host mirror); ``append``/``attend`` translate the model's tensors to pool rows through the cache's
row layout (``kvmodels.cache.rows``) and run on rows.
"""

from __future__ import annotations

import numpy as np
import torch

from kvkernels import check_shape, check_tensor, decode_keys
from kvkernels.paged_attention import Alibi, Restore, ScoreUpdate, paged_decode_attention
from kvkernels.quant_attention import Region, quant_decode_attention

from .pool import ceil_div
from .rows import INT_DTYPES
from .state import CacheState


class DecodeSteps(CacheState):
    """Decode steps over the pool rows: page allocation, append, attention with the fused score update,
    decode-time eviction."""

    def prepare_decode(self, step: int) -> None:
        """Eager per-step setup: a page for every layer of every active sequence whose next token starts a new
        page, this step's Gumbel noise keys and temperature.

        Raises ``RuntimeError`` (before anything is written) when the pool cannot hold the step.
        """
        if self._state != "decode":
            raise RuntimeError(f"prepare_decode called in state {self._state!r}; call finish_prefill() first "
                               "(or after_step(step) after the previous step)")
        if step != self._step:
            raise ValueError(f"prepare_decode(step={step}) but the next step is {self._step}; steps run "
                             "in order")
        if step >= self.max_new_tokens:
            raise ValueError(f"step={step} is past max_new_tokens={self.max_new_tokens} given to start()")
        n, S = self.batch_size, self.page_size
        lens = self.host.lens[:, :n]
        grow = self._width[:, None] * self.host.active[:n]  # [Lc, n] slots this step appends
        full = lens + grow > self.max_pages * S
        if full.any():
            l, b = np.argwhere(full)[0]
            raise RuntimeError(f"sequence {b} layer {l} already holds {lens[l, b]} slots, all that the "
                               f"max_tokens={self.max_tokens} the cache was built for allows; raise "
                               "max_tokens")
        n_need = int((ceil_div(lens + grow, S) - ceil_div(lens, S)).sum())  # pages the appends open
        if n_need > self.pool.free:
            raise self.pool.out_of_pages(n_need, f"decode step {step}")
        if n_need:
            self._allocate_next_pages()
        self.pool.free -= n_need
        self.host.lens[:, :n] += grow
        self.host.seen[:n] += self.host.active[:n]
        self.host.track_peak(self.page_size)

        if self.gumbel_keys is not None:
            kw = self.eviction.decode_kwargs(step, self.max_new_tokens)
            self.temperature.fill_(float(kw.get("temperature", 1.0)))
            # Fresh noise per step, reproducible from the seeds: one key per (layer, row, query head), hashed
            # with the slot inside the decode kernel (kvkernels.gumbel_noise_keyed).
            n_layers, _, n_heads = self.gumbel_keys.shape
            keys = decode_keys(self._noise_seed, self._noise_step, n_layers, n, n_heads)
            self.gumbel_keys[:, :n].copy_(keys)
            self._noise_step += 1
        self._state = "step"

    def _allocate_next_pages(self) -> None:
        """Pop a free page for every (storage layer, active row) whose next slot starts a page, on device.

        Pass ``i`` covers the ``i``-th slot a layer appends this step (a merged region appends two)."""
        n, S, M = self.batch_size, self.page_size, self.max_pages
        table = self.page_table[:, :n]  # [Lc, n, M] view
        for i in range(self.layout.max_width):
            width = self._width_masks[i]  # [Lc]
            lens = self.seq_lens[:, :n] + i  # [Lc, n]
            need = (lens % S == 0) & self.active[:n] & width[:, None]  # [Lc, n]
            flat = need.reshape(-1).to(torch.int64)
            rank = torch.cumsum(flat, 0) - flat  # [Lc * n] pops before this one
            src = (self.n_free - 1 - rank).clamp_min(0)
            new_pages = self.free_pages[src].view(self.n_layers, n)  # [Lc, n]
            col = (lens // S).clamp_max(M - 1).to(torch.int64)[..., None]  # [Lc, n, 1]
            current = table.gather(2, col)[..., 0]
            table.scatter_(2, col, torch.where(need, new_pages, current)[..., None])
            self.n_free -= flat.sum()

    def _check_decode_input(self, name: str, t: torch.Tensor, heads: int) -> None:
        check_tensor(name, t, ndim=3, dtypes=(self.dtype,), device=self.device)
        check_shape(name, t, [self.batch_size, heads, self.head_dim], "batch x heads x head_dim")

    def _check_positions(self, name: str, t: torch.Tensor) -> None:
        check_tensor(name, t, ndim=1, dtypes=INT_DTYPES, device=self.device)
        check_shape(name, t, [self.batch_size], "one position per sequence of the batch")

    def append(self, l: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               q: torch.Tensor | None = None) -> None:
        """Write this step's K/V of cache layer ``l`` after each active sequence's last token.

        Pure tensor code on static buffers (safe inside ``torch.compile(fullgraph=True)``). Rows without an
        active sequence write into the trash page and keep length 0.

        Parameters
        ----------
        k, v:
            ``[B, Hkv, D]`` ``dtype`` (``B`` = the batch given to ``start``).
        positions:
            ``[B]`` int absolute position of the new token.
        q:
            ``[B, Hq, D]`` the new token's queries; required only by an open score rule that reads them
            (``EvictionPolicy.reads_queries``). Models pass it always.
        """
        # The row layout translates the model's [B, Hkv, ...] to pool rows (the identity by default).
        rows = self.rows
        rows.check_new_tokens(self, k, v, positions, q)
        self._append_rows(l, rows.to_rows(k), rows.to_rows(v), rows.positions_to_rows(positions),
                          None if q is None else rows.to_rows(q))

    def _append_rows(self, l: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     q: torch.Tensor | None) -> None:
        """:meth:`append` on pool rows (``[rows, heads of a row, D]``)."""
        self._check_layer(l)
        self._check_decode_input("k", k, self.n_kv_heads)
        self._check_decode_input("v", v, self.n_kv_heads)
        self._check_positions("positions", positions)
        if q is not None:
            self._check_decode_input("q", q, self.n_q_heads)
        elif self.eviction.scores_tokens and self.eviction.reads_queries:
            raise ValueError(f"append(q=None): policy {self.eviction.name!r} scores each token from its own "
                             "queries (reads_queries); pass this step's queries q [B, Hq, D]")
        n, S = self.batch_size, self.page_size
        s = self.layout.storage[l]  # a merged layer appends into its pair's region
        lens = self.seq_lens[s, :n]  # [n]
        active = self.active[:n]
        col = (lens // S).clamp_max(self.max_pages - 1).to(torch.int64)
        page = self.page_table[s, :n].gather(1, col[:, None])[:, 0]  # [n]
        page = torch.where(active, page, self.trash_page).to(torch.int64)
        slot = torch.where(active, lens % S, 0).to(torch.int64)
        stored_k = k  # channel-separable keys: k / c (prefill set each row's factor); scores read k itself
        if self.key_scale is not None:
            stored_k = k / self.key_scale[s, :n].to(k.dtype)
        self.k_pages[page, slot] = self.storage.encode(stored_k)
        self.v_pages[page, slot] = self.storage.encode(v)
        self.slot_pos[page, slot] = positions.to(torch.int32)[:, None].expand(n, self.n_kv_heads)
        self.slot_score[page, slot] = self._token_scores(q, k, v, positions) if self.eviction.scores_tokens \
            else 0.0
        if self.layout.merged[l]:  # a private slot of this layer: exact K/V, visible to this layer only
            assert self.k_mag is not None and self.v_mag is not None and self.slot_mask is not None
            for mag in (self.k_mag, self.v_mag):
                mag[:, page, slot] = 1.0
            self.slot_mask[page, slot] = self.layout.mask_bit(l)
        lens += active.to(torch.int32)

    def attend(self, l: int, q: torch.Tensor, q_positions: torch.Tensor, *, scale: float,
               alibi_slopes: torch.Tensor | None = None, update_scores: bool = True) -> torch.Tensor:
        """Decode attention of cache layer ``l`` over its kept tokens, updating the policy's scores in place.

        A layer of a merged pair reads its pair's region through its own magnitudes and ``slot_mask`` bit
        (restoration inside the kernel); both layers' score updates add into the region's one score array.

        Parameters
        ----------
        q:
            ``[B, Hq, D]`` ``dtype`` queries of this step.
        q_positions:
            ``[B]`` int absolute positions of the queries (read with ALiBi).
        scale, alibi_slopes:
            Logit scale; optional ``[Hq]`` float32 ALiBi slopes.
        update_scores:
            ``False`` reads the cache without touching the scores (e.g. LCKV layers reading the top cache,
            which its owner already scores once per step).

        Returns
        -------
        ``[B, Hq, D]`` attention output (zero rows for finished sequences).
        """
        rows = self.rows
        rows.check_queries(self, q, q_positions)
        if alibi_slopes is not None and self.storage.quantized:
            raise ValueError("attend(alibi_slopes=...): ALiBi reads each slot's position beside its K/V, "
                             "which the quantized decode kernel does not yet; use a RoPE model (Llama, "
                             f"GPT-J) with {self.policy.precision.name!r}")
        groups = None if alibi_slopes is None else rows.alibi_groups(self.n_sequences)
        if groups is not None and alibi_slopes is not None:  # one call per group of rows, its own slopes
            return self._attend_groups(l, rows.to_rows(q), rows.positions_to_rows(q_positions), groups,
                                       scale=scale, alibi_slopes=alibi_slopes,
                                       update_scores=update_scores).reshape(q.shape)
        return rows.from_rows(self._attend_rows(l, rows.to_rows(q), rows.positions_to_rows(q_positions),
                                                scale=scale, alibi_slopes=alibi_slopes,
                                                update_scores=update_scores))

    def _attend_rows(self, l: int, q: torch.Tensor, q_positions: torch.Tensor, *, scale: float,
                     alibi_slopes: torch.Tensor | None = None, update_scores: bool = True) -> torch.Tensor:
        """:meth:`attend` on pool rows: ``q [rows, query heads of a row, D]``."""
        self._check_layer(l)
        self._check_decode_input("q", q, self.n_q_heads)
        self._check_positions("q_positions", q_positions)
        n, s, member = self.batch_size, self.layout.storage[l], self.layout.member[l]
        alibi = None
        if alibi_slopes is not None:  # from the slots' original positions
            alibi = Alibi(alibi_slopes, self.slot_pos, q_positions.to(torch.int32))
        keys = self.gumbel_keys[l, :n] if self.gumbel_keys is not None else None
        if self.key_scale is not None:  # the pool holds k / c: (q * c) . (k / c) = q . k
            qg = q.reshape(n, self.n_kv_heads, -1, q.shape[-1]) * self.key_scale[s, :n, :, None].to(q.dtype)
            q = qg.reshape(q.shape)
        restore = None
        if self.layout.merged[l]:  # the pair's region through this layer's magnitudes and slot_mask bit
            restore = Restore(self.k_mag[member] if self.k_mag is not None else None,
                              self.v_mag[member] if self.v_mag is not None else None,
                              self.slot_mask, mask_bit=self.layout.mask_bit(l))
        if self.side is not None:  # the side region's slots first, then the main region's: one softmax
            side = self.side
            scores = self._score_update(update_scores, keys)
            main = Region(self.k_pages, self.v_pages, self.page_table[s, :n], self._visible_lens(s),
                          self.storage.fmt, self.storage.fmt, None if scores is None else self.slot_score)
            if scores is not None:  # both regions' scores in the one softmax (KIVI's residual + eviction)
                scores = scores._replace(score=side.pool.slot_score)
            lens = torch.where(self.active[:n], side.seq_lens[s, :n], 0)
            # Rotated rows (rotate=True): both regions are quantized in the one rotation (the policy checks).
            fmt = side.storage.fmt
            out = quant_decode_attention(side.storage.queries(q), side.pool.k_pages, side.pool.v_pages,
                                         side.page_table[s, :n], lens, scale=scale, k_format=fmt,
                                         v_format=fmt, second=main, scores=scores, validate=False)
            return side.storage.outputs(out)
        return self.storage.attention(
            q, self.k_pages, self.v_pages, self.page_table[s, :n], self._visible_lens(s), scale=scale,
            alibi=alibi, scores=self._score_update(update_scores, keys), restore=restore)

    def _attend_groups(self, l: int, q: torch.Tensor, q_positions: torch.Tensor, groups, *, scale: float,
                       alibi_slopes: torch.Tensor, update_scores: bool) -> torch.Tensor:
        """:meth:`attend` on pool rows, one decode call per ``(rows, slopes)`` group of the row layout (ALiBi
        slopes of rows that hold different query heads): ``[rows of a group, groups, G, D]``."""
        n, s = self.batch_size, self.layout.storage[l]
        outs = []
        for rows, slopes in groups:
            keys = self.gumbel_keys[l, :n][rows].contiguous() if self.gumbel_keys is not None else None
            outs.append(paged_decode_attention(
                q[rows].contiguous(), self.k_pages, self.v_pages, self.page_table[s, :n][rows].contiguous(),
                self._visible_lens(s)[rows].contiguous(), scale=scale,
                alibi=Alibi(alibi_slopes[slopes].contiguous(), self.slot_pos,
                            q_positions[rows].to(torch.int32).contiguous()),
                scores=self._score_update(update_scores, keys)))  # [n, G, D]
        return torch.stack(outs, dim=1)

    def _visible_lens(self, s: int) -> torch.Tensor:
        """``[B]`` int32 slots of storage layer ``s`` a decode step attends to: none for rows that do not
        decode (finished, or paused between turns), so their kept tokens get no score update."""
        n = self.batch_size
        return torch.where(self.active[:n], self.seq_lens[s, :n], 0)

    def _score_update(self, update_scores: bool, gumbel_key: torch.Tensor | None) -> ScoreUpdate | None:
        """The decode op's score bundle: the policy's score tensor whenever it scores, with its mode, or
        with mode "none" for a read-only call (``update_scores=False``: nothing written). A read-only call
        passes the same tensors because with no score beside scoring calls in one compiled graph, inductor
        failed to lower the op (torch 2.13). ``gumbel_key``: this call's rows of the step's noise keys."""
        if self.score_mode == "none":
            return None
        return ScoreUpdate(self.slot_score, self.score_mode if update_scores else "none", self.decay,
                           gumbel_key, self.temperature if self.gumbel else None)

    def after_step(self, step: int) -> None:
        """Eager end of a decode step: when the plan's schedule says so (every ``evict_every`` steps),
        compact the layers over budget."""
        if self._state != "step" or step != self._step:
            raise RuntimeError(f"after_step(step={step}) must follow prepare_decode(step={step}); the next "
                               f"step is {self._step}")
        assert self.plan is not None  # set by finish_prefill
        evicts = self.plan.evicts_after(step)
        if evicts and self.side is None:
            self._evict_in_place(None, self.eviction.heads_share_selection)
        elif self.sliding:  # the model's sliding windows: back to their last W - 1 tokens after every step
            self._evict_in_place(self.sliding, False)
        if self.side is not None:  # KIVI: tokens older than the residual move to the quantized region
            self.side.migrate(self)
            if evicts and self.eviction.decode_evict:  # then the quantized tokens over budget go
                self.side.evict(self)
        self._step += 1
        self._state = "decode"

    def _evict_in_place(self, layers: list[int] | None, share: bool) -> None:
        """Decode-time eviction of ``layers`` (all when None) over their budgets, in place; ``share``: one
        ranking for a layer's heads first (``eviction_scores``). Every slot holds one token in all heads of
        its layer."""
        calls = self._compress_calls(layers, in_place=True)

        def evict() -> None:
            if share:
                self.slot_score.copy_(self.eviction.eviction_scores(self.slot_score, head_dim=-1))
            for call in calls:
                call.device()

        # The same calls every step at a steady width: on CUDA, one graph replay instead of ~50 launches.
        self._replays.run((share, *(c.key for c in calls)), evict, keep=tuple(c.rows for c in calls))
        for call in calls:
            call.commit()

