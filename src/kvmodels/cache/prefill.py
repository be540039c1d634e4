"""The prefill phase of a paged cache: each sequence's prompt stored and scored per layer, the budget policy's
statistics observed, a prompt compressed right after its prefill (``compress_each``).

:class:`PrefillSteps` is one part of :class:`kvmodels.cache.PagedKVCache` (a mixin: its methods read the
cache's pool, tables and host mirror); the tensors it receives are translated to rows by the cache's row
layout (``kvmodels.cache.rows``).
"""

from __future__ import annotations

import numpy as np
import torch

from kvkernels import check_shape, check_tensor, prefill_seed
from kvkernels.quant import key_channel_scale
from kvkernels.score_update import (
    COLUMN_SUM_MODES,
    prefill_attention,
    prefill_attention_scores,
)
from kvpolicies.base import NewTokens

from .pool import ceil_div
from .rows import INT_DTYPES, check_sequence
from .state import CacheState


class PrefillSteps(CacheState):
    """Prompt storage and scoring, the observation point, per-sequence prompt compression."""

    def prefill_attend(self, l: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       positions: torch.Tensor, *, scale: float) -> torch.Tensor:
        """:meth:`prefill_layer`, and the prompt's causal attention the model needs: ``[L, Hq, D]``.

        The model's prompt attention and the policy's prompt scores read the same probabilities. When the
        scores are a row-weighted column sum of them over most of the prompt (``h2o``, ``a2sf``: every row)
        and this layer computes its own, ``kvkernels.prefill_attention_scores`` takes both from one
        computation of the probabilities (CPU; see :meth:`_fused_scoring`). Otherwise this is
        ``kvkernels.prefill_attention`` followed by ``prefill_layer(..., lse=...)``. Arguments as
        :meth:`prefill_layer` (no ALiBi: ALiBi models run their own attention and call ``prefill_layer``).
        """
        fused = self._fused_scoring(l, q.shape[0]) if q.device.type == "cpu" else None
        if fused is None:
            attn, lse = prefill_attention(q, k, v, scale=scale, need_lse=self._lse_pays(l, q.shape[0]))
            self.prefill_layer(l, b, q, k, v, positions, scale=scale, lse=lse)
            return attn
        attn, scores = prefill_attention_scores(q, k, v, scale=scale, **fused)
        self.prefill_layer(l, b, q, k, v, positions, scale=scale, scores=scores)
        return attn

    def _fused_scoring(self, l: int, L: int) -> dict | None:
        """``prefill_attention_scores`` keyword arguments (``mode``, ``window``, ``decay``) for layer ``l``'s
        prompt of ``L`` tokens when fusing pays, else ``None``.

        Fusing replaces the flash kernel (~1x) plus the scorer (~0.75x for every row, in proportion to the
        rows it scores) by one pass of ~1.25x (CPU, L=4096, see ``prefill_attention_scores``): it pays when
        the policy scores at least half of the rows, not for a 32-row observation window (SnapKV) nor for
        the last row alone (TOVA). Not for a layer that reuses another's scores, nor for policies with
        other score arguments (Gumbel noise, counts).
        """
        ev = self.eviction
        mode = ev.prefill_mode
        if mode not in COLUMN_SUM_MODES or mode == "replace" or not self._scores_most_rows(l, L):
            return None
        kwargs = ev.prefill_kwargs(L)
        if not set(kwargs) <= {"decay"}:
            return None
        return {"mode": mode, "window": ev.prefill_window(L), **kwargs}

    def _lse_pays(self, l: int, L: int) -> bool:
        """Whether layer ``l`` scores its prompt of ``L`` tokens from the attention's log-sum-exp over at
        least half of the rows (``prefill_attention(need_lse=True)``: on CUDA a kernel that returns it then
        runs, cuDNN's where SDPA itself runs it, else the flash kernel, and the scorer skips its normaliser
        pass, a pass over the scored rows' logits; for a 32-row observation window or the last row alone
        that pass is small and the model's attention keeps its own kernel)."""
        return self.eviction.prefill_mode in COLUMN_SUM_MODES and self._scores_most_rows(l, L)

    def _scores_most_rows(self, l: int, L: int) -> bool:
        """Whether layer ``l`` computes its own prompt scores (not another layer's) from at least half of the
        ``L`` rows: every row, or an observation window (TOVA's: the last row) of at least ``L / 2`` rows."""
        ev = self.eviction
        return ev.score_source_layer(l) == l and 2 * (ev.prefill_window(L) or L) >= L

    def prefill_layer(self, l: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, *, scale: float,
                      alibi_slopes: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      scores: torch.Tensor | None = None) -> None:
        """Store one sequence's prompt K/V for cache layer ``l`` and score it if the policy needs scores.

        Parameters
        ----------
        q:
            ``[L, Hq, D]`` prompt queries (after RoPE), used only for scoring.
        k, v:
            ``[L, Hkv, D]`` prompt keys (after RoPE) and values, ``dtype`` of the cache.
        positions:
            ``[L]`` int absolute positions of the prompt tokens.
        scale, alibi_slopes:
            Logit scale and optional ``[Hq]`` float32 ALiBi slopes, as used by the model.
        lse:
            Optional ``[Hq, L]`` float32 log-sum-exp of each row of this layer's causal attention logits
            (``kvkernels.prefill_attention`` returns it on CPU): the scorer then skips its own softmax
            normaliser pass (``prefill_scores(lse=...)``).
        scores:
            Optional ``[Hkv, L]`` float32 prompt scores already computed with this layer's
            ``_fused_scoring`` arguments (:meth:`prefill_attend` passes them): used in place of
            ``prefill_scores`` (the policy's post-processing still applies).
        """
        parts = self.rows.prompt_rows(self, l, b, q, k, v, alibi_slopes, lse, scores)
        for row, (q_r, k_r, v_r, alibi_r, lse_r, scores_r) in parts:
            self._prefill_row(l, row, q_r, k_r, v_r, positions, scale=scale, alibi_slopes=alibi_r, lse=lse_r,
                              scores=scores_r)

    def _prefill_row(self, l: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor, *, scale: float, alibi_slopes: torch.Tensor | None = None,
                     lse: torch.Tensor | None = None, scores: torch.Tensor | None = None) -> None:
        """:meth:`prefill_layer` of pool row ``b`` (tensors of the row's heads)."""
        if self._state != "prefill":
            raise RuntimeError(f"prefill_layer called in state {self._state!r}; call start(...) first and "
                               "prefill before finish_prefill()")
        self._check_layer(l)
        check_sequence(b, self.batch_size)
        if self.host.prefilled[l, b]:
            raise RuntimeError(f"layer {l} of sequence {b} is already prefilled; start a new batch to "
                               "refill it")
        L, H, D = self.prompt_lens[b], self.n_kv_heads, self.head_dim
        dev = self.device
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t, ndim=3, dtypes=(self.dtype,), device=dev)
        check_shape("q", q, [L, self.n_q_heads, D], f"prompt_lens[{b}] x n_q_heads x head_dim")
        check_shape("k", k, [L, H, D], f"prompt_lens[{b}] x n_kv_heads x head_dim")
        check_shape("v", v, [L, H, D], f"prompt_lens[{b}] x n_kv_heads x head_dim")
        check_tensor("positions", positions, ndim=1, dtypes=INT_DTYPES, device=dev)
        check_shape("positions", positions, [L], f"prompt_lens[{b}]")

        n_pages = ceil_div(L, self.page_size)
        if n_pages > self.pool.free:
            raise self.pool.out_of_pages(n_pages, f"prefill of sequence {b} layer {l}")
        if scores is not None:
            fused = self._fused_scoring(l, L)
            if fused is None or alibi_slopes is not None:
                raise ValueError(f"scores were given for layer {l}, where the policy "
                                 f"{type(self.eviction).__name__} does not take precomputed column-sum "
                                 "scores (or ALiBi is on); call prefill_attend, or prefill_layer without "
                                 "scores")
            check_tensor("scores", scores, ndim=2, dtypes=(torch.float32,), device=dev)
            check_shape("scores", scores, [H, L], f"n_kv_heads x prompt_lens[{b}]")
        if self._windowed_unscored(l):  # a sliding layer keeps its window: its scores rank nothing
            scores = None
        elif self.eviction.prefill_mode is not None:
            scores = self._prefill_scores(l, b, q, k, scale, alibi_slopes, lse, scores)  # [H, L]
        elif self.eviction.scores_tokens:  # an open rule: each token's score from what its step provides
            scores = self._token_scores(q, k, v, positions, check=True).t()  # [H, L]

        score_rows = torch.zeros(L, H, device=dev) if scores is None else scores.t()  # [L, H]
        if self.key_scale is not None:  # channel-separable keys: the row's factor, from its prompt
            c = key_channel_scale(k)
            self.key_scale[l, b] = c
            k = k / c.to(k.dtype)  # a power of two: exact
        self.page_table[l, b, :n_pages] = self.pool.write_prompt(self.storage, k, v, positions, score_rows)
        if self.side is not None:  # the whole prompt in the second format too, until the split
            self.side.write_prompt(l, b, k, v, positions, score_rows)
        self.seq_lens[l, b] = L
        self.host.lens[l, b] = L
        self.host.prefilled[l, b] = True
        self.host.track_peak(self.page_size)

    def _windowed_unscored(self, l: int) -> bool:
        """Layer ``l`` has a sliding window (it keeps its last ``W - 1`` tokens, whatever their scores) and no
        later layer reuses its prompt scores (ChunkKV's layer-wise index reuse): its prompt is not scored."""
        if not self.window(l):
            return False
        return all(self.eviction.score_source_layer(m) != l for m in range(l + 1, self.n_layers))

    def prefill_seed(self, l: int, b: int) -> int:
        """Seed of the prompt-scoring noise of layer ``l``, sequence ``b`` (``prefill_scores(seed=...)``).

        Distinct per (layer, sequence) and reproducible from the policy's and the cache's seeds.
        """
        return prefill_seed(self._noise_seed, l, b)

    def _prefill_scores(self, l, b, q, k, scale, alibi_slopes, lse, raw=None) -> torch.Tensor:
        """``[Hkv, L]`` prompt scores of layer ``l``, sequence ``b``; ``raw``: already computed
        (``prefill_attend``), only post-processed here."""
        source = self.eviction.score_source_layer(l)
        if source != l:  # layer-wise index reuse: the scores an earlier layer of this sequence computed
            return self._shared_scores[source, b]
        if raw is None:
            scores = self.eviction.prompt_scores(q, k, scale=scale, seed=self.prefill_seed(l, b),
                                                 alibi_slopes=alibi_slopes, lse=lse)
        else:
            scores = self.eviction.postprocess_prefill_scores(raw)
        if l + 1 < self.n_layers and self.eviction.score_source_layer(l + 1) == l:
            self._shared_scores[l, b] = scores  # [Hkv, L], read by the layers that reuse this one's
        return scores

    def _token_scores(self, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      *, check: bool = False) -> torch.Tensor:
        """``[..., Hkv]`` float32 scores of the tokens ``k, v [..., Hkv, D]`` (queries ``q [..., Hq, D]``,
        ``positions [...]``) by the policy's open score rule (``EvictionPolicy.token_scores``); ``check``
        (host side, at prefill) verifies what the rule returns."""
        new = NewTokens(k=k, v=v, positions=positions.to(torch.int64),
                        q=q if self.eviction.reads_queries else None)
        scores = self.eviction.token_scores(new)
        if check and (not isinstance(scores, torch.Tensor) or tuple(scores.shape) != tuple(k.shape[:-1])
                      or not scores.is_floating_point()):
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"{self.eviction.name}.token_scores returned {got} for k of shape "
                             f"{tuple(k.shape)}; it must return one float score per token and KV head: "
                             f"{tuple(k.shape[:-1])}")
        return scores.to(torch.float32)

    def observe(self, l: int, b: int, h_in: torch.Tensor, attn_out: torch.Tensor) -> None:
        """The models' one observation point in the prefill: cache layer ``l``'s input hidden states
        ``h_in [L, dim]`` and attention output ``attn_out [L, dim]`` for sequence ``b``. The budget policy
        reads what it needs (``layer_statistic``; nothing for most policies), averaged over the prompt. During
        an extension (:meth:`extend_attend`) the average runs over every token the sequence has prefilled, so
        a chunked prefill ends with the whole prompt's mean."""
        stat = self.policy.budget_policy.layer_statistic(h_in, attn_out)
        if stat is None:
            return
        ext = self._extension
        if ext is not None and ext.b == b:
            self._check_layer(l)
            if ext.probe is not None:  # a reconstruction pass re-reads the context: no new statistic
                return
            for row in self.rows.rows(b):  # every row of the sequence holds its statistic
                n_old, n_new = int(self.host.stat_tokens[l, row]), stat.numel()
                self.cos_sim[l, row] = (self.cos_sim[l, row] * n_old + stat.float().sum()) / (n_old + n_new)
                self.host.stat_tokens[l, row] = n_old + n_new
        else:
            self.record_cos_sim(l, b, stat.mean())

    def record_cos_sim(self, l: int, b: int, value: float | torch.Tensor) -> None:
        """Store the budget policy's prefill statistic of cache layer ``l`` for sequence ``b`` (what
        :meth:`observe` computes; ``LayerStats.cos_sim``)."""
        self._check_layer(l)
        check_sequence(b, self.n_sequences)
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"value must be a float or a 0-d tensor, got shape {list(value.shape)}")
        for row in self.rows.rows(b):  # every row of the sequence holds its statistic
            self.cos_sim[l, row] = value
            self.host.stat_tokens[l, row] = self.prompt_lens[row]  # where an extension's running mean starts

    def compress_prompt(self, b: int) -> None:
        """Compress sequence ``b``'s prompt to its layer budgets now, right after its prefill.

        :func:`kvmodels.generate.generate` calls this after each prompt, so the pool only ever holds one
        uncompressed prompt next to compressed ones: at budget 0.2 a pool fits several times the batch
        (``start(..., compress_each=True)``). The tokens kept are exactly those :meth:`finish_prefill`
        keeps (the budgets of a sequence depend on it alone); only the page ids differ. A no-op when the
        policy does not compress prompts, or merges layers (MiniCache merges pairs in ``finish_prefill``).
        """
        if self._state != "prefill":
            raise RuntimeError(f"compress_prompt called in state {self._state!r}; call it after a sequence's "
                               "prefill and before finish_prefill()")
        rows = self.rows.rows(check_sequence(b, self.n_sequences))
        if not self.host.prefilled[:, rows].all():
            missing = int((~self.host.prefilled[:, rows].all(axis=1)).sum())
            raise RuntimeError(f"sequence {b} has {missing} layer(s) not prefilled; call "
                               f"compress_prompt({b}) "
                               "after its whole prefill")
        compresses = self.eviction.prefill_compress or self.sliding  # (windows: the model's own, always)
        if not compresses or self.layout.pairs or self.host.compressed[rows].all():
            self._split_formats(rows)
            return
        self._compress_rows(rows, *(x.numpy() for x in self._plan(rows).rows))
        self._split_formats(rows)

    def _compress_rows(self, rows: list[int], budgets: np.ndarray, n_sink: np.ndarray,
                       n_recent: np.ndarray) -> None:
        """Compact pool rows ``rows`` in every layer holding more than its budget (``budgets``, ``n_sink``,
        ``n_recent``: ``[Lc, len(rows)]``), and mark them compressed (a prompt's compression, kvzip's after
        its reconstruction pass)."""
        layers = [l for l in range(self.n_layers) if (self.host.lens[l, rows] > budgets[l]).any()]
        if layers:
            self.compactor.compact(self.host.lens, layers, rows, budgets[layers], n_sink[layers],
                                   n_recent[layers])
        self.host.compressed[rows] = True
