"""The bridge's scores (docs/contract.md §2.2): :class:`ScoreSteps`, the part of
:class:`~kvpolicies.hf.cache.PolicyCache` that scores what a forward appends, with the ops kvmodels' paged
cache calls:

* the prompt's scores from ``kvkernels.prefill_scores`` (the policy's ``prompt_scores``: queries and keys,
  never eager attention weights, so ``sdpa`` works);
* a decode step's from ``kvkernels.paged_decode_attention``'s fused update, with the step's Gumbel noise drawn
  as kvmodels draws it;
* an extension's (several tokens after the prompt) from the policy's ``extension_scores``
  (``kvkernels.extend_attention``), as kvmodels' ``extend_attend``.

The model attended already: the ops' attention outputs are not used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvkernels import (
    Alibi,
    Restore,
    ScoreUpdate,
    draw_gumbel_,
    paged_decode_attention,
    prefill_seed,
)
from kvpolicies.hf.models import scale_and_slopes

if TYPE_CHECKING:
    from kvpolicies.hf.layer import PolicyLayer, Step
    from kvpolicies.hf.models import Family
    from kvpolicies.plan import MergeLayout


class ScoreSteps:
    """The policy's scores of each forward's tokens, written into the layers' ``scores``. A part of
    :class:`~kvpolicies.hf.cache.PolicyCache`: it reads the cache's attributes (annotated here)."""

    layers: list[PolicyLayer]
    step: Step
    policy: Any
    eviction: Any
    layout: MergeLayout
    captures: dict[Any, Any]
    max_new_tokens: int | None
    prefilled: bool
    _family: Family
    _decode_step: int
    _noise_seed: int
    _noise: torch.Tensor | None
    _gumbel: torch.Generator | None

    # --- scores --------------------------------------------------------------------------------------
    def _score_rows(self, H: int, G: int) -> list[tuple[slice, slice, int | None]]:
        """The rows a sequence's prompt or extension is scored in, as ``(KV heads, query heads, head)``: the
        whole sequence (head None), or with head budgets (kvmodels' ``HeadRows``) each KV head with its
        group of ``G`` query heads."""
        if not self.policy.heads.per_head:
            return [(slice(None), slice(None), None)]
        return [(slice(h, h + 1), slice(h * G, (h + 1) * G), h) for h in range(H)]

    def _row_seed(self, l: int, b: int, h: int | None, H: int) -> int:
        """The in-house cache's seed for layer ``l``'s row of sequence ``b`` (KV head ``h`` of ``H`` with head
        budgets), so both caches draw the same prefill noise."""
        return prefill_seed(self._noise_seed, l, b if h is None else b * H + h)

    def _score_layer(self, layer: PolicyLayer, new_keys: torch.Tensor, query: torch.Tensor) -> None:
        """The policy's attention scores of this forward's queries ``[B, Hq, q, D]`` over ``layer``."""
        fam, l = self._family, layer.layer_idx
        scale, slopes = scale_and_slopes(fam, l, self.captures)
        if not self.prefilled:
            if self.eviction.prefill_mode is not None:
                self._prefill_scores(layer, query, new_keys, scale, slopes)
        elif self.eviction.score_mode != "none":
            self._decode_scores(layer, query, scale, slopes)

    def _prefill_scores(
        self, layer: PolicyLayer, q: torch.Tensor, k: torch.Tensor, scale: float, slopes: torch.Tensor | None
    ) -> None:
        ev = self.eviction
        source = ev.score_source_layer(layer.layer_idx)
        if source != layer.layer_idx:  # layer-wise index reuse: rank by an earlier layer's prompt scores
            layer.scores = self.layers[source].scores.clone()
            return
        B, H = k.shape[:2]
        G = q.shape[1] // H
        for b in range(B):
            idx = self.step.valid[b].nonzero().squeeze(-1)  # real (unpadded) prompt tokens
            qb = q[b][:, idx].transpose(0, 1).contiguous()  # [L, Hq, D]
            kb = k[b][:, idx].transpose(0, 1).contiguous()  # [L, Hkv, D]
            for heads, group, h in self._score_rows(H, G):
                s = ev.prompt_scores(qb[:, group].contiguous(), kb[:, heads].contiguous(), scale=scale,
                                     alibi_slopes=None if slopes is None else slopes[group],
                                     seed=self._row_seed(layer.layer_idx, b, h, H))  # [h, L]
                layer.scores[b, heads][:, idx] = s.to(torch.float32)

    def _decode_scores(
        self, layer: PolicyLayer, q: torch.Tensor, scale: float, slopes: torch.Tensor | None
    ) -> None:
        """One decode step's per-slot score update (docs/contract.md §2.2), query row by query row.

        The update is ``kvkernels.paged_decode_attention``'s fused one, the op kvmodels' decode step runs;
        its attention output is not used (transformers computed the attention). The layer's storage is laid
        out as that op's pool: each sequence is one page of the layer's ``N`` slots, ``[B, N, Hkv, ...]``;
        padding, and in a merged pair's region the slots this layer may not see, are hidden by
        ``slot_mask``. A layer of a merged pair scores over the keys restored through its own magnitudes
        (``k_scale``), and the update goes into the region's one score array (a shared slot collects both
        layers' mass)."""
        ev = self.eviction
        kw = ev.decode_kwargs(self._decode_step, self._max_new_tokens() if ev.needs_max_new_tokens else 1)
        B, hq, q_len, _ = q.shape
        store = layer.store
        N = store.positions.shape[-1]  # slots (with two parts: both)
        dev = store.keys.device

        def pool(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, N, ...] -> [B, N, Hkv, ...], a copy
            return x.transpose(1, 2).contiguous()

        keys = pool(store.dense()[0])  # quantized rows: dequantized, the keys kvmodels' kernel reads
        score = pool(store.scores)  # updated in place by the op, then taken back
        restore = Restore(k_scale=pool(store.k_mag[layer.member]) if layer.merged else None,
                                    slot_mask=pool(store.visible(layer.member).to(torch.uint8)), mask_bit=1)
        scores = ScoreUpdate(score, ev.score_mode, decay=float(kw.get("decay", 1.0)))
        if ev.score_mode == "gumbel":
            tau = kw.get("temperature", 1.0)
            scores = scores._replace(
                temperature=torch.as_tensor(tau, dtype=torch.float32, device=dev).reshape(1).clone())
        if slopes is not None:  # ALiBi from original positions
            alibi_slopes, slot_pos = slopes.float().contiguous(), pool(store.positions.to(torch.int32))
        table = torch.arange(B, dtype=torch.int32, device=dev)[:, None]  # sequence b is page b
        for i in range(q_len):
            n_seen = N - q_len + i + 1  # causal within the new chunk: the slots up to this query's own
            if ev.score_mode == "gumbel":
                # Noise is indexed by logical slot (a region's invisible slots included), as kvmodels indexes
                # it; padding slots take their neighbour's and are masked out.
                seen = store.head_valid()[:, :, :n_seen]  # per KV head: its own slots with head budgets
                logical = (seen.long().cumsum(-1) - 1).clamp(0, self._noise.shape[-1] - 1)  # [B, Hkv, n_seen]
                logical = F.pad(logical, (0, N - n_seen)).repeat_interleave(hq // logical.shape[1], dim=1)
                scores = scores._replace(gumbel_noise=torch.gather(
                    self._noise[layer.layer_idx], 2, logical).contiguous())  # [B, Hq, N]
            alibi = None
            if slopes is not None:
                alibi = Alibi(alibi_slopes, slot_pos,
                                        self.step.positions[:, i].to(torch.int32).contiguous())
            lens = torch.full((B,), n_seen, dtype=torch.int32, device=dev)
            paged_decode_attention(q[:, :, i].to(keys.dtype).contiguous(), keys, keys, table, lens,
                                             scale=scale, alibi=alibi, scores=scores, restore=restore)
        store.scores = score.transpose(1, 2).contiguous()

    def _max_new_tokens(self) -> int:
        if self.max_new_tokens is None:  # model.generate fills it in (_install); a hand-written loop must not
            raise ValueError(
                f"{self.policy.name}: the policy's decode schedule needs the generation length; it is taken "
                "from model.generate(max_new_tokens=...) automatically; outside generate pass "
                "hf_cache(policy, model, max_new_tokens=...)"
            )
        return int(self.max_new_tokens)

    def _draw_noise(self, device: torch.device) -> None:
        """This step's Gumbel(0, 1) noise ``[Lc, B, Hq, width]``, indexed by logical slot.

        Drawn as ``kvmodels.cache.PagedKVCache.prepare_decode`` draws it: a generator seeded with the
        in-house cache's noise seed, one ``exponential_`` draw per step over ``[Lc, B, Hq, width]`` with
        ``width`` the longest layer after this step's append, in the same order, so a keyformer run keeps
        the same tokens as the in-house model (tests/test_hf_bridge.py checks the two draws are equal).
        """
        if self._gumbel is None:
            self._gumbel = torch.Generator(device=device)
            self._gumbel.manual_seed(self._noise_seed)
        # [Lc, B] before this step: each layer's longest row (its longest KV head with head budgets)
        lens = torch.stack([layer.head_tokens().amax(-1) for layer in self.layers])
        # Slots each layer appends this step (the layout's width), as kvmodels grows its lengths.
        grow = torch.tensor(self.layout.width, dtype=lens.dtype, device=lens.device)[:, None]  # [Lc, 1]
        width = int((lens + grow).max())
        noise = torch.empty(len(self.layers), lens.shape[1], self._family.n_q_heads, width, device=device)
        self._noise = draw_gumbel_(noise, self._gumbel)

    def _extension_scores(self, layer: PolicyLayer, keys: torch.Tensor, values: torch.Tensor,
                          q: torch.Tensor | None) -> None:
        """An extension's scores in ``layer``, as kvmodels' ``extend_attend`` makes them: per sequence (per KV
        head with head budgets, with its query group and seed) ``kvkernels.extend_attention`` of its new
        tokens (``q [B, Hq, n, D]``; ``keys``/``values`` ``[B, Hkv, N, D]``, what the layer returned: the
        kept slots, then the new ones exact) over its kept tokens in position order and, causally,
        themselves, in the policy's prefill score mode. Window votes (snapkv, tova) replace the kept tokens'
        scores, post-processed over kept + new; rows that all score continue them (``decay``: times
        ``decay**n``). Without a prefill mode nothing more: an open rule scored the new tokens as they were
        appended, else they score 0. The op's attention output is not used (the model attended)."""
        ev = self.eviction
        if ev.prefill_mode is None or (layer.tiered and not ev.decode_evict):  # two parts: nothing is
            return  # evicted after the split unless the policy evicts while decoding
        assert q is not None and layer.positions is not None and layer.scores is not None
        scale, slopes = scale_and_slopes(self._family, layer.layer_idx, self.captures)
        held, pos, score = layer.head_valid(), layer.positions, layer.scores
        B, H, N = pos.shape
        n_old, G, D = N - q.shape[2], q.shape[1] // H, keys.shape[-1]
        for b in range(B):
            new = self.step.valid[b]
            n = int(new.sum())
            if n == 0:
                continue
            new_slots = n_old + new.nonzero().squeeze(-1)  # [n]
            for heads, group, h in self._score_rows(H, G):
                idx = held[b, heads.start or 0, :n_old].nonzero().squeeze(-1)  # [m] (the heads hold alike)
                order = pos[b, heads][:, idx].argsort(dim=-1, stable=True)
                slots = idx[order]  # [h, m] each head's kept slots in position order

                def tokens(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # [h, N, D] -> [m or n, h, D]
                    return x.gather(1, at[..., None].expand(*at.shape, D)).transpose(0, 1)

                fresh = new_slots.expand(slots.shape[0], n)
                row = score[b, heads]  # a view: written in place
                _, s = ev.extension_scores(
                    q[b, group][:, new].transpose(0, 1), tokens(keys[b, heads], fresh),
                    tokens(values[b, heads], fresh), self.step.positions[b, new],
                    tokens(keys[b, heads], slots), tokens(values[b, heads], slots),
                    pos[b, heads].gather(-1, slots).t(), row.gather(-1, slots).float(), scale=scale,
                    seed=self._row_seed(layer.layer_idx, b, h, H),
                    alibi_slopes=None if slopes is None else slopes[group])
                assert s is not None
                m = idx.numel()
                row.scatter_(-1, slots, s[:, :m].to(row.dtype))
                row[:, new_slots] = s[:, m:].to(row.dtype)
