"""A second region per row for a cache that stores tokens in two formats (issue 36): KIVI's older tokens
quantized beside its unquantized recent ones, ZipCache's non-salient tokens at fewer bits than its salient
ones, MiKV's evicted tokens kept at low bits beside the kept ones at full precision.

The cache's own pool (the *main* region) holds the tokens of the precision policy's higher format; the
:class:`SideRegion` holds the others, in a pool of its own (its pages are as small as its format), with its
own page table, lengths and host mirror, compacted by its own :class:`Compactor`. Both regions receive the
whole prompt at prefill (the side region in its format); once the eviction policy has compressed the main
region, :meth:`SideRegion.split` asks the precision policy which format each token gets
(``PrecisionPolicy.assign`` over the prompt, from the eviction's kept set and the prompt scores) and
compacts each region to its tokens. Decode steps append to the main region and attend to both regions in one
softmax (``kvkernels.quant_attention.quant_decode_attention(second=...)``); KIVI's residual ages into the
side region a group at a time and ZipCache re-compresses the tokens decoded since its last compression
(:meth:`SideRegion.migrate`). A continuation (``begin_extend``: a follow-up turn) evicts nothing: it attends
to both regions and appends its tokens to the main region whole, as decode steps do, and KIVI's residual
ages (ZipCache re-compresses) after it; decode-time eviction with KIVI's residual or ZipCache evicts
side-region tokens only, and with MiKV moves the evicted tokens here instead (below). A chunked prefill's
later chunks (``begin_extend(chunked=True)``) are scored by the policy over both regions and, after KIVI's
residual ages (ZipCache chooses its high bits again, :meth:`SideRegion.reselect`), held to the budget by the
same eviction (MiKV: demotion).

The split (and KIVI's aging) compacts by a membership flag written into each region's slot scores, then
writes the kept tokens' eviction scores back (a compaction keeps the flagged slots in order), and tokens
aging into this region bring their scores: with KIVI's residual an eviction policy that evicts while
decoding (``h2o``, ``tova``, ``scissorhands``, ``a2sf``, ``streaming``, ``knorm``) goes on ranking them. Its
decode steps update both regions' scores in the one softmax (``Region.score``), and :meth:`SideRegion.evict`
evicts from this region only: the residual stays whole (a budget below ``residual + group`` tokens is held
at that).
"""

from __future__ import annotations

import numpy as np
import torch

from .compaction import Compactor
from .pool import PagePool, ceil_div


def _selected(scores: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """``[n, Hkv]``: each KV head's ``scores [Hkv, L]`` where ``flags [Hkv, L]`` (the same count per head),
    in their order."""
    return scores[flags].view(scores.shape[0], -1).t()


def _of_rows(rows: list[int] | None, n: int) -> np.ndarray:
    """``[n]`` bool: the pool rows in ``rows`` (every one of the ``n`` when None)."""
    mask = np.zeros(n, dtype=bool)
    mask[slice(None) if rows is None else rows] = True
    return mask


class SideRegion:
    """The second region's pool, page table ``[Lc, B, M]``, lengths (device and host) and compactor."""

    def __init__(self, storage, num_pages: int, n_layers: int, max_batch: int, max_pages: int,
                 n_kv_heads: int, page_size: int, device: torch.device, layout, precision, main_bits: int,
                 capped: bool = False):
        self.storage, self.precision, self.main_bits = storage, precision, main_bits
        self.side_bits = storage.bits
        self.page_size = page_size
        self.pool = PagePool(num_pages, page_size, n_kv_heads, storage, device=device, merged=False,
                             name="side_pages")
        self.page_table = torch.full((n_layers, max_batch, max_pages), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n_layers, max_batch, dtype=torch.int32, device=device)
        self.compactor = Compactor(self.pool, self.page_table, self.seq_lens, layout)
        self.lens = np.zeros((n_layers, max_batch), dtype=np.int64)  # host mirror of seq_lens
        # ZipCache (`reselects`): the main region's first `settled` slots were placed by a compression; the
        # tokens after them wait for the next one (recompress; `every` decoded tokens, 0: never). 0 for the
        # other precision policies. `capped`: the eviction policy evicts while decoding, so both regions
        # share the plan's budget.
        self.reselects = precision.reselects
        self.every = precision.every if self.reselects else 0
        self.capped = capped
        self.settled = np.zeros((n_layers, max_batch), dtype=np.int64)
        self.peak_pages = 0

    def static_buffers(self) -> list[torch.Tensor]:
        p = self.pool
        return [p.k_pages, p.v_pages, p.slot_pos, p.slot_score, p.free_pages, p.n_free, self.page_table,
                self.seq_lens]

    def reset(self) -> None:
        self.pool.reset()
        self.page_table.fill_(-1)
        self.seq_lens.zero_()
        self.lens[:] = 0
        self.settled[:] = 0
        self.peak_pages = 0
        self.compactor.reset()

    def pages_held(self) -> np.ndarray:
        """``[Lc]`` pages each layer's side rows hold."""
        return ceil_div(self.lens, self.page_size).sum(axis=1)

    def write_prompt(self, l: int, b: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scores: torch.Tensor) -> None:
        """Store row ``b``'s whole prompt of layer ``l``: ``k``/``v`` ``[L, Hkv, D]``, ``scores [L, Hkv]``."""
        L = k.shape[0]
        n_pages = ceil_div(L, self.page_size)
        if n_pages > self.pool.free:
            raise self.pool.out_of_pages(n_pages, f"prefill of sequence {b} layer {l} (the "
                                         f"{self.side_bits}-bit region)")
        self.page_table[l, b, :n_pages] = self.pool.write_prompt(self.storage, k, v, positions, scores)
        self.seq_lens[l, b] = L
        self.lens[l, b] = L
        self.peak_pages = max(self.peak_pages, int(self.pages_held().sum()))

    def _rows(self, table: torch.Tensor, n: int):
        """``(page, offset)`` index tensors of a row's first ``n`` slots."""
        slots = torch.arange(n, device=table.device)
        return table[slots // self.page_size].to(torch.int64), slots % self.page_size

    def split(self, cache, rows: list[int]) -> None:
        """Give each token of ``rows`` (every layer) the format the precision policy assigns it: the main
        region keeps its ``main_bits`` tokens, this region its ``side_bits`` ones; a token assigned 0 leaves
        both. Reads the device (prompt time only).

        A row whose prompt goes on in later chunks (its budget is a share of a longer prompt,
        ``start(budget_lens=)``) under ZipCache keeps its kept tokens at the high bits up to their share of
        that budget (:meth:`reselect`'s choice), not their share of the chunk: the high bits' pool is sized
        for it, and a token sent to the low bits now could not come back when a later chunk votes for it."""
        streaming = [b for b in rows if self.reselects and cache.budget_lens[b] > cache.host.seen[b]]
        for l in range(cache.n_layers):
            budgets_side, budgets_main, kept_scores = [], [], []
            for b in rows:
                L, m = int(self.lens[l, b]), int(cache.host.lens[l, b])
                page, off = self._rows(self.page_table[l, b], L)
                pos = self.pool.slot_pos[page, off].long()  # [L, Hkv], position order
                scores = self.pool.slot_score[page, off].t()  # [Hkv, L]
                mpage, moff = self._rows(cache.page_table[l, b], m)
                kept_pos = cache.slot_pos[mpage, moff].long()  # [m, Hkv]
                start = int(pos[0, 0]) if L else 0
                kept = torch.zeros_like(scores, dtype=torch.bool)  # [Hkv, L]
                kept.scatter_(1, (kept_pos - start).t(), True)
                if b in streaming:  # all kept at the high bits; reselect() below takes their share
                    bits = torch.where(kept, self.main_bits, 0)
                else:
                    bits = self.precision.assign(kept, scores, voters=self._voters(cache.eviction, L))
                side = bits == self.side_bits
                main_scores = cache.slot_score[mpage, moff].t()  # [Hkv, m]
                self.pool.slot_score[page, off] = side.t().float()
                main_flags = bits.gather(1, (kept_pos - start).t()) == self.main_bits  # [Hkv, m]
                cache.slot_score[mpage, moff] = main_flags.t().float()
                budgets_side.append(self._count(side, "side", l, b))
                budgets_main.append(self._count(main_flags, "main", l, b))
                kept_scores.append((_selected(scores, side), _selected(main_scores, main_flags)))
            self._compact(self.compactor, self.pool, self.lens, self.page_table, self.seq_lens, l, rows,
                          budgets_side)
            self._compact(cache.compactor, cache.pool, cache.host.lens, cache.page_table, cache.seq_lens, l,
                          rows, budgets_main)
            for b, (side_scores, main_scores) in zip(rows, kept_scores, strict=True):  # the flags out again
                self._set_scores(self.pool, self.page_table[l, b], side_scores)
                self._set_scores(cache.pool, cache.page_table[l, b], main_scores)
            if self.reselects:
                self.settled[l, rows] = budgets_main
        ev = cache.eviction
        for n in sorted({int(cache.host.seen[b]) for b in streaming}):  # a batch's first chunks may differ
            some = [b for b in streaming if int(cache.host.seen[b]) == n]
            budgets = np.minimum(cache.budget_tokens[some].numpy(), [cache.budget_lens[b] for b in some])
            self.reselect(cache, some, ev.prefill_window(n) if ev.prefill_mode else 0,
                          np.broadcast_to(budgets, (cache.n_layers, len(some))))

    def _voters(self, eviction, L: int) -> torch.Tensor:
        """``[L]``: how many of the queries behind the eviction policy's prompt scores see each token of an
        ``L``-token prompt: its last ``W`` (``prefill_window``; 0 = all) that come at or after the token."""
        W = eviction.prefill_window(L) or L
        return (L - torch.arange(L, device=self.page_table.device)).clamp(max=W)

    def _set_scores(self, pool: PagePool, table: torch.Tensor, scores: torch.Tensor) -> None:
        """The first ``n`` slots of a row (``table``) get ``scores [n, Hkv]``: a compaction by flags keeps the
        flagged slots in their order at the front, so their eviction scores come back in that order."""
        page, off = self._rows(table, scores.shape[0])
        pool.slot_score[page, off] = scores

    def _count(self, flags: torch.Tensor, region: str, l: int, b: int) -> int:
        counts = flags.sum(dim=1)
        if bool((counts != counts[0]).any()):
            raise ValueError(f"precision {self.precision.name!r} gives the KV heads of layer {l}, sequence "
                             f"{b} different token counts in the {region} region ({counts.tolist()}); a "
                             "cache with one row per sequence needs equal counts")
        return int(counts[0])

    @staticmethod
    def _compact(compactor: Compactor, pool: PagePool, lens: np.ndarray, table: torch.Tensor,
                 seq_lens: torch.Tensor, l: int, rows: list[int], budgets: list[int]) -> None:
        """Compact layer ``l``'s ``rows`` to ``budgets`` flagged slots (no forced slots); a row keeping none
        gives all its pages back."""
        keep = [(b, n) for b, n in zip(rows, budgets, strict=True) if n > 0 and n < lens[l, b]]
        if keep:
            seqs, n = [b for b, _ in keep], np.array([[n for _, n in keep]])
            zeros = np.zeros_like(n)
            compactor.compact(lens, [l], seqs, n, zeros, zeros)
        for b, budget in zip(rows, budgets, strict=True):
            if budget == 0 and lens[l, b]:
                pool.release(table[l, b], lens[l, b])
                seq_lens[l, b] = 0
                lens[l, b] = 0

    def held(self, l: int, b: int,
             key_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row ``b``'s tokens of layer ``l`` in this region, in slot order: ``k``/``v`` ``[n, Hkv, D]``
        dequantized to the cache's dtype and ``pos [n, Hkv]`` int32 (host lengths: no sync);
        ``key_scale [Hkv, D]``: the cache's channel factors of the row (the keys are stored divided by
        them)."""
        page, off = self.slots(l, b)
        k, v = (self.storage.decode(t[page, off]) for t in (self.pool.k_pages, self.pool.v_pages))
        if key_scale is not None:
            k = k * key_scale.to(k.dtype)
        return k, v, self.pool.slot_pos[page, off]

    def slots(self, l: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page, offset)`` int64 ``[n]``: row ``b``'s slots in layer ``l``, slot order (host lengths)."""
        return self._rows(self.page_table[l, b], int(self.lens[l, b]))

    def contents(self, l: int, b: int,
                 key_scale: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
        """:meth:`held` as one dict per KV head: ``k``/``v`` ``[n, D]``, ``pos [n]`` (for tests)."""
        k, v, pos = self.held(l, b, key_scale)
        return [{"k": k[:, h], "v": v[:, h], "pos": pos[:, h]} for h in range(k.shape[1])]

    def _receive(self, cache, l: int, b: int, index: tuple[torch.Tensor, ...], what: str) -> None:
        """Append to row ``b`` of layer ``l`` the main region's slots at ``index`` (``(page, offset)``
        ``[m]``, or ``(page, offset, head)`` ``[m, Hkv]`` for each head's own slots), in order, re-encoded in
        this region's format, with their positions and eviction scores; ``out_of_pages`` naming ``what``
        when the pool is short."""
        S, have, m = self.page_size, int(self.lens[l, b]), index[0].shape[0]
        need = int(ceil_div(have + m, S) - ceil_div(have, S))
        if need > self.pool.free:
            raise self.pool.out_of_pages(need, what)
        if need:
            self.page_table[l, b, ceil_div(have, S):ceil_div(have + m, S)] = self.pool.take(need)
        slots = torch.arange(have, have + m, device=self.page_table.device)
        spage, soff = self.page_table[l, b][slots // S].to(torch.int64), slots % S
        pool = self.pool
        for dst, src in ((pool.k_pages, cache.k_pages), (pool.v_pages, cache.v_pages)):
            dst[spage, soff] = self.storage.encode(cache.storage.decode(src[index]))
        pool.slot_pos[spage, soff] = cache.slot_pos[index]
        pool.slot_score[spage, soff] = cache.slot_score[index]
        self.seq_lens[l, b] = have + m
        self.lens[l, b] = have + m

    def pages_to_age(self, b: int, main_lens: np.ndarray, n: int, chunked: bool = False) -> int:
        """Pages this region takes (at most) when row ``b``, whose main region holds ``main_lens``
        (``[Lc]``), takes ``n`` more tokens there and then KIVI's residual ages or ZipCache re-compresses
        (:meth:`migrate`; :meth:`reselect` after a prompt's chunk, ``chunked``); 0 for the other precision
        policies (host arithmetic)."""
        p = self.precision
        total = main_lens.astype(np.int64) + n
        if self.reselects and (chunked or self.capped):  # at most all of them
            moved = total
        elif self.every:  # every token past the settled ones, once `every` wait
            waiting = total - self.settled[:len(total), b]
            moved = np.where(waiting >= self.every, waiting, 0)
        elif p.held_unquantized():
            moved = p.aging(total)
        else:
            return 0
        have = self.lens[:len(total), b]
        return int((ceil_div(have + moved, self.page_size) - ceil_div(have, self.page_size)).sum())

    def decode_pages(self, cache, steps: int) -> tuple[int, int]:
        """The most pages the main pool and this one may each open over the next ``steps`` decode steps of
        the batch's active rows, at worst (every row appends each step): a replay of the steps on lengths
        alone -- the append; KIVI's aging or ZipCache's re-compression (:meth:`migrate`); with a policy that
        evicts while decoding, every ``evict_every`` steps, :meth:`evict` or MiKV's :meth:`demote` -- whose
        counts depend on lengths only (which tokens move, on the scores), each pool's peak taken where it
        occurs (the main pool's after the append, this one's before the eviction). Host arithmetic, a few
        numpy operations a step. ``PagedKVCache.decode_pages`` asks it."""
        n, S, p, plan = cache.batch_size, self.page_size, self.precision, cache.plan
        main, side = cache.host.lens[:, :n].astype(np.int64), self.lens[:, :n].astype(np.int64)
        settled = self.settled[:, :n].astype(np.int64)
        active = cache.host.active[:n].astype(np.int64)
        budgets = plan.rows.budgets.numpy()[:, :n].astype(np.int64)
        cap = p.high_share(budgets) if self.reselects else budgets

        def pages(x: np.ndarray) -> int:
            return int(ceil_div(x, S).sum())

        start_main, start_side = pages(main), pages(side)
        peak_main, peak_side = start_main, start_side
        for step in range(steps):
            main = main + active
            peak_main = max(peak_main, pages(main))
            if self.every:  # ZipCache's re-compression (recompress), on counts
                waiting = main - settled
                due = waiting >= self.every
                high = settled + p.high_share(waiting)
                if self.capped:
                    due |= (main > budgets) & (waiting > 0)
                    high = np.where(high > cap, cap, high)
                settled = np.where(due, high, settled)
                moved = np.where(due, np.maximum(main - high, 0), 0)
            else:  # KIVI's residual ages (none for the others)
                moved = p.aging(main)
            main, side = main - moved, side + moved
            peak_side = max(peak_side, pages(side))
            if plan.evicts_after(step) and cache.eviction.decode_evict:
                if p.keeps_evicted:  # demote: the main region over its budget moves down
                    moved = np.maximum(main - budgets, 0)
                    main, side = main - moved, side + moved
                    peak_side = max(peak_side, pages(side))
                else:  # evict: this region keeps what the budget leaves beside the main one
                    side = np.minimum(side, np.clip(budgets - main, 0, None))
        return peak_main - start_main, peak_side - start_side

    def main_peak(self, cache, b: int) -> int | None:
        """Under a policy that evicts while decoding and a precision that does not keep what it evicts (MiKV,
        ``keeps_evicted``, demotes it, so its main region is held at the budget), the most tokens a layer of
        sequence ``b``'s main region can hold after a decode step's append however long it decodes, or
        ``None`` where it grows with every token: KIVI's residual ages once ``residual + group`` are exceeded
        (``residual + group + 1``); ZipCache's re-compresses whenever it holds more than its layer's budget
        (:meth:`recompress`; an extension's :meth:`migrate` too), so it holds at most that budget before a
        step (the plan's largest layer budget + 1)."""
        p = self.precision
        if p.held_unquantized():
            return p.held_unquantized() + 1
        if self.every and self.capped and cache.plan is not None:
            return int(cache.plan.rows.budgets[:, cache.rows.rows(b)].max()) + 1
        return None

    def migrate(self, cache) -> None:
        """What the precision policy does with the main region's new tokens after a decode step or an
        extension: KIVI's residual ages (:meth:`age`), ZipCache re-compresses (:meth:`recompress`); the
        others' new tokens stay in the main region."""
        p = self.precision
        if self.every:
            self.recompress(cache)
        elif p.held_unquantized():
            self.age(cache)

    def age(self, cache) -> None:
        """KIVI's residual as it ages: a row whose main region holds more than ``residual + group`` tokens
        moves all but its newest ``residual`` to this region, quantized (the main region holds them in
        position order: the split keeps order and decode steps append). Eager, host-driven (no sync)."""
        p = self.precision
        n = cache.batch_size
        lens = cache.host.lens[:, :n]
        aged = p.aging(lens)
        excess = np.argwhere(aged > 0)
        if not len(excess):
            return
        heads = self.pool.k_pages.shape[2]
        for l in sorted({int(x) for x in excess[:, 0]}):
            moves = []
            for b in (int(b) for ll, b in excess if ll == l):
                m = int(aged[l, b])  # the main region's oldest m
                out = torch.arange(m, device=self.page_table.device)[:, None].expand(m, heads)
                moves.append((b, out, int(lens[l, b]) - m))
            self._move_down(cache, l, moves, "quantizing aged tokens")

    def recompress(self, cache) -> None:
        """ZipCache while decoding: a row whose main region holds ``every`` tokens or more past its settled
        ones (or, under an evicting policy, more than its budget) re-compresses. Each KV head keeps at the
        high bits its settled tokens and the ``salient`` share (rounded up) of the waiting ones, by normalized
        score (``ZipCache.saliency``: the policy's score over the queries that have seen the token; ties to
        the earlier); under an evicting policy at most the ``salient`` share of the budget (rounded up), then
        chosen among all of the main region's tokens the same way. The others move to this region, with
        their positions and scores. Eager, host-driven lengths."""
        p, n = self.precision, cache.batch_size
        main, settled = cache.host.lens[:, :n], self.settled[:, :n]
        waiting = main - settled
        due = waiting >= self.every
        budgets = cache.plan.rows.budgets.numpy()[:, :n] if self.capped else None
        if budgets is not None:
            due |= (main > budgets) & (waiting > 0)
        for l in sorted({int(x) for x in np.argwhere(due)[:, 0]}):
            moves = []
            for b in (int(b) for b in np.flatnonzero(due[l])):
                total, s = int(main[l, b]), int(settled[l, b])
                n_high = s + p.high_share(total - s)
                settled_stay = True  # else the salient share of the budget, chosen among all of them
                if budgets is not None and n_high > (cap := p.high_share(budgets[l, b])):
                    n_high, settled_stay = cap, False
                moves += self._keep_salient(cache, l, b, n_high, s if settled_stay else 0)
            if moves:
                self._move_down(cache, l, moves, "re-compressing")

    def reselect(self, cache, rows: list[int], window: int, budgets: np.ndarray | None = None) -> None:
        """ZipCache after a prompt's chunk (``begin_extend(chunked=True)``), as the prompt's split: each KV
        head of ``rows`` keeps at the high bits the ``salient`` share (rounded up) of its layer's budget (the
        plan's), chosen among all of the main region's tokens (the chunk's and those a previous chunk kept
        there) by normalized score -- the chunk's scores over the queries behind them: every query at or
        after a token, or the last ``window`` where window votes replaced every held token's score (0: no
        window) -- ties to the earlier; the others move to this region, with their positions and scores.
        What both regions then hold over the budget, :meth:`evict` takes. ``budgets``: ``[Lc, len(rows)]``
        instead of the plan's (:meth:`split`: the sequence's, before the plan knows the whole prompt). Eager,
        host-driven lengths."""
        p = self.precision
        if budgets is None:  # the plan's, never above the prompt it is a share of (an int budget may be)
            budgets = np.minimum(cache.plan.rows.budgets.numpy()[:, rows],
                                 [cache.budget_lens[b] for b in rows])
        for l in range(cache.n_layers):
            moves = []
            for i, b in enumerate(rows):
                total = int(cache.host.lens[l, b])
                moves += self._keep_salient(cache, l, b, min(total, p.high_share(budgets[l, i])), 0, window)
            if moves:
                self._move_down(cache, l, moves, "re-compressing a chunk")

    def _keep_salient(self, cache, l: int, b: int, n_high: int, stay: int,
                      window: int = 0) -> list[tuple[int, torch.Tensor, int]]:
        """Row ``b`` of layer ``l`` keeps ``n_high`` main-region tokens per KV head: its first ``stay``
        (settled) slots, then the highest normalized scores (``ZipCache.saliency``, ``window``), ties to the
        earlier; the settled count becomes ``n_high``. Returns the :meth:`_move_down` entry of the others
        (none when every token stays)."""
        total = int(cache.host.lens[l, b])
        self.settled[l, b] = n_high
        if n_high >= total:
            return []
        page, off = self._rows(cache.page_table[l, b], total)
        rank = self.precision.saliency(cache.slot_score[page, off], cache.slot_pos[page, off].long(),
                                       int(cache.host.seen[b]), window)  # [total, Hkv]
        rank[:stay] = float("inf")
        order = torch.sort(rank, dim=0, descending=True, stable=True).indices  # ties: earlier first
        return [(b, order[n_high:].sort(dim=0).values, n_high)]

    def evict(self, cache, rows: list[int] | None = None) -> None:
        """Decode-time eviction of a two-format cache (KIVI's residual or ZipCache with an eviction policy
        that evicts while decoding): each row whose two regions together hold more than its budget (the
        plan's) gives up this region's lowest-ranked tokens in place (``topk_evict``, which ranks a row in
        position order), the policy's sinks kept and its recent window (the tokens of it that the main
        region's waiting tokens -- KIVI's residual, ZipCache's tokens since its last compression -- do not
        hold, at most, as this region's newest); the main region stays whole (KIVI's newest ``residual`` to
        ``residual + group`` tokens, ZipCache's high bits, which :meth:`recompress` holds to their share of
        the budget). Eager, host-driven (no sync). A precision policy that keeps what is evicted (MiKV)
        demotes instead (:meth:`demote`). ``rows``: those rows only (a prefill chunk's sequence); all when
        None."""
        if self.precision.keeps_evicted:
            self.demote(cache, rows)
            return
        n = cache.batch_size
        budgets, n_sink, n_recent = (x.numpy()[:, :n] for x in cache.plan.rows)  # [Lc, n]
        main, side = cache.host.lens[:, :n], self.lens[:, :n]
        waiting = main - self.settled[:, :n]  # the main region's newest tokens (KIVI: all of them)
        room = np.clip(budgets - main, 0, None)  # what this region may keep
        mine = _of_rows(rows, n)
        seqs = [int(b) for b in np.flatnonzero(((side > room) & mine).any(axis=0))]
        if not seqs:
            return
        for l, b in zip(*np.nonzero((room == 0) & (side > 0) & mine), strict=True):  # the main one fills it
            self.pool.release(self.page_table[l, b], self.lens[l, b])
            self.seq_lens[l, b] = 0
            self.lens[l, b] = 0
        keep = np.minimum(self.lens[:, :n], room)[:, seqs]
        sink = np.minimum(n_sink[:, seqs], keep)
        recent = np.minimum(np.clip(n_recent[:, seqs] - waiting[:, seqs], 0, None), keep - sink)
        ev = cache.eviction
        if ev.heads_share_selection:  # one ranking for the layer's heads, as for the main region
            self.pool.slot_score.copy_(ev.eviction_scores(self.pool.slot_score, head_dim=-1))
        # (a released row keeps "1" of its 0 slots: the op needs budgets >= 1 and moves nothing there)
        self.compactor.compact(self.lens, list(range(cache.n_layers)), seqs, np.maximum(keep, 1), sink,
                               recent, in_place=True)

    def demote(self, cache, rows: list[int] | None = None) -> None:
        """MiKV while decoding (``compose("h2o", "mikv")``): each row whose main region holds more than its
        budget (the plan's) moves the tokens the eviction policy would evict there -- each KV head's
        lowest-ranked, the plan's sinks and recent window excepted, ties to the older -- into this region at
        its lower precision, with their positions and scores (decode steps go on ranking them); nothing
        leaves the cache. Eager, host-driven lengths. ``rows``: those rows only; all when None."""
        n = cache.batch_size
        budgets, n_sink, n_recent = (x.numpy()[:, :n] for x in cache.plan.rows)  # [Lc, n]
        main = cache.host.lens[:, :n]
        over = np.argwhere((main > budgets) & _of_rows(rows, n))
        ev = cache.eviction
        for l in sorted({int(x) for x in over[:, 0]}):
            moves = []
            for b in (int(b) for ll, b in over if ll == l):
                total, keep = int(main[l, b]), int(budgets[l, b])
                sink = min(int(n_sink[l, b]), keep)
                recent = min(int(n_recent[l, b]), keep - sink)
                page, off = self._rows(cache.page_table[l, b], total)
                scores = cache.slot_score[page, off]  # [total, Hkv], slot (= position) order
                rank = ev.eviction_scores(scores, head_dim=-1) if ev.heads_share_selection else scores
                moves.append((b, self.precision.demoted(rank, keep, sink, recent), keep))
            self._move_down(cache, l, moves, "keeping evicted tokens")

    def _move_down(self, cache, l: int, moves: list[tuple[int, torch.Tensor, int]], why: str) -> None:
        """For each ``(b, out, keep)`` of ``moves``: row ``b``'s main-region slots ``out`` (``[m, Hkv]``,
        each KV head's own, ascending) move to this region in its format, with their positions and scores,
        and the main region keeps its other ``keep`` slots in order (one compaction for the layer)."""
        staying, keeps = [], []
        for b, out, keep in moves:
            total = int(cache.host.lens[l, b])
            page, off = self._rows(cache.page_table[l, b], total)
            scores = cache.slot_score[page, off]  # [total, Hkv]
            head = torch.arange(scores.shape[1], device=page.device)
            self._receive(cache, l, b, (page[out], off[out], head),
                          f"{why}: {out.shape[0]} tokens of sequence {b} layer {l} to {self.side_bits} bits")
            moved = torch.zeros_like(scores, dtype=torch.bool).scatter_(0, out, True)  # [total, Hkv]
            staying.append(_selected(scores.t(), ~moved.t()))  # [keep, Hkv]
            cache.slot_score[page, off] = (~moved).float()
            keeps.append(keep)
        self._compact(cache.compactor, cache.pool, cache.host.lens, cache.page_table, cache.seq_lens, l,
                      [b for b, _, _ in moves], keeps)
        for (b, _, _), scores in zip(moves, staying, strict=True):
            self._set_scores(cache.pool, cache.page_table[l, b], scores)
        self.peak_pages = max(self.peak_pages, int(self.pages_held().sum()))

    def finish(self, row: int) -> None:
        """Return every page of ``row`` (all layers)."""
        self.pool.release(self.page_table[:, row], self.lens[:, row])
        self.seq_lens[:, row] = 0
        self.lens[:, row] = 0
        self.settled[:, row] = 0
