"""The bridge's forwards after the prompt, as kvmodels' ``extend.py`` takes them: :class:`ExtendSteps`, the
part of :class:`~kvpolicies.hf.cache.PolicyCache` that

* checks and ends an extension (a forward of several tokens after the prompt: a question after the context,
  a follow-up turn), as ``kvmodels.Decoder.extend``: it refuses what kvmodels refuses, then re-plans every
  sequence from all it has seen and compacts every layer to the plan (the extension's scores are
  :mod:`~kvpolicies.hf.scores`');
* runs a reconstruction pass (``kvzip``) before the first forward after the prefill: the context's ids fed
  again (after ``probe_prefix``) through the model as nested forwards (:class:`Probe`), each scoring the kept
  context with ``kvkernels.extend_attention`` (the op kvmodels' probe uses) and storing nothing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvpolicies.hf.models import scale_and_slopes

if TYPE_CHECKING:
    from kvpolicies.hf.hooks import Hooks
    from kvpolicies.hf.layer import PolicyLayer, Step
    from kvpolicies.hf.models import Family
    from kvpolicies.plan import CompressionPlan, MergeLayout


@dataclasses.dataclass
class Probe:
    """One forward of a reconstruction pass (:meth:`PolicyCache._reconstruct`): its tokens (left-padded) and,
    per sequence, the positions ``[lo, hi)`` of the kept context tokens whose scores it replaces (``hi`` None:
    to the end; the whole entry None: the sequence has no pass here)."""

    valid: torch.Tensor  # [B, n] bool
    positions: torch.Tensor  # [B, n] int64
    spans: list[tuple[int, int | None] | None]


class ExtendSteps:
    """Extensions and the reconstruction pass. A part of :class:`~kvpolicies.hf.cache.PolicyCache`: it reads
    the cache's attributes and calls its planning and eviction (annotated here)."""

    layers: list[PolicyLayer]
    step: Step
    policy: Any
    eviction: Any
    layout: MergeLayout
    hooks: Hooks
    captures: dict[Any, Any]
    probe_prefix: list[int]
    plan: CompressionPlan | None
    extending: bool
    _family: Family
    _context: torch.Tensor | None
    _probe: Probe | None
    _next_pos: torch.Tensor | None
    _seen: int
    _seen_tokens: torch.Tensor
    _budget_lens: torch.Tensor
    _stat_tokens: torch.Tensor
    _decode_step: int

    two_parts: Any

    if TYPE_CHECKING:  # the cache's planning, eviction and aging (kvpolicies.hf.cache)
        def _plan_batch(self) -> None: ...
        def _evict_by_plan(self) -> None: ...
        def _age(self) -> None: ...

    # --- an extension: several tokens after the prompt (kvmodels' Decoder.extend) ---------------------
    def _check_extension(self) -> None:
        """Refuse, as ``kvmodels.Decoder`` does, a policy that cannot take tokens after the prompt."""
        name = self.policy.name
        if self.layout.pairs:
            raise NotImplementedError(
                f"policy {name!r} merges layers ({self.policy.merge.name}), which cannot take a forward of "
                "several tokens after the prompt (a question after the context, a chunked prefill), as "
                "kvmodels.Decoder cannot; put the question in the prompt, or use a policy without merging")
        if self.policy.heads_refuse_extension:
            raise NotImplementedError(
                f"policy {name!r} gives KV heads their own budgets from the prompt's token scores "
                f"({self.policy.heads.name}), which evicted tokens no longer have, so it cannot take a "
                "forward of several tokens after the prompt (a question after the context, a chunked "
                "prefill), as kvmodels.Decoder cannot; put the question in the prompt, or use duo's per-head "
                "budgets")

    def _end_extension(self, counts: torch.Tensor) -> None:
        """After an extension (``counts [B]``: each sequence's new tokens), as kvmodels' ``end_extend``: a
        sequence that took tokens has its budget from everything it has seen (``budget_len``); the batch is
        re-planned (each layer's budget capped at the tokens seen plus the horizon) and, with the policy's
        prompt compression, every layer compacted to the plan. A head-budget policy that compresses nothing
        after its split (``kvzip+pooled``) keeps it, as ``HeadRows``. The generation that follows counts
        its decode steps from 0 (``restart_decode``)."""
        self.extending, self._decode_step = False, 0
        self._seen_tokens += counts
        self._stat_tokens += counts
        self._budget_lens = torch.where(counts > 0, self._seen_tokens, self._budget_lens)
        ev = self.eviction
        if self.policy.heads.per_head and not (ev.prefill_compress or ev.decode_evict):
            return
        self._plan_batch()
        assert self.plan is not None
        if self.two_parts is not None:  # two parts: nothing evicted
            self._age()
        elif self.plan.schedule.prefill_compress:
            self._evict_by_plan()

    # --- the reconstruction pass (kvzip) ------------------------------------------------------------
    def _check_probe(self, input_ids: torch.Tensor | None) -> None:
        """At the prefill of a policy with a reconstruction pass: keep the context's ids for it, and refuse
        what cannot run, as ``kvmodels.Decoder`` does: no ids, a context no longer than ``skip``, passes that
        reach past the model's positions."""
        name, ev = self.policy.name, self.eviction
        if input_ids is None:
            raise ValueError(
                f"policy {name!r} ranks the context by a reconstruction pass ({ev.name}), which feeds the "
                "context's token ids again; pass the prompt as input_ids=, not inputs_embeds="
            )
        self._context = input_ids
        extra, limit = len(self.probe_prefix), self._family.max_positions
        for b, (n, start) in enumerate(zip(self.step.valid.sum(-1).tolist(), self._next_pos.tolist())):
            self.policy.check_probe_fits(f"input_ids[{b}]", n, start, extra, limit)

    def _reconstruct(self) -> None:
        """The context's reconstruction pass(es), as ``kvmodels.Decoder._probe`` runs them: per sequence the
        policy's ``probe_passes``, each feeding ``probe_prefix`` + a part of the context's ids at the
        positions after the context, through the model (a nested forward of its base, left-padded:
        sequences differ in length and in number of passes). Each layer's attention covers the kept
        context and, causally, the pass; :meth:`_probe_scores` replaces the context's scores; nothing is
        stored."""
        assert self._context is not None and self._next_pos is not None
        valid = self.layers[0].valid  # [B, L] the prompt's real tokens (every layer holds them all)
        texts = [self._context[b][valid[b]].tolist() for b in range(valid.shape[0])]
        passes = [self.eviction.probe_passes(len(t)) for t in texts]
        B, dev, fam = len(texts), valid.device, self._family
        for i in range(max(map(len, passes))):
            rows: list[list[int]] = []
            spans: list[tuple[int, int | None] | None] = []
            for text, ps in zip(texts, passes):
                if i >= len(ps):
                    rows.append([])
                    spans.append(None)
                    continue
                start, stop, scored = ps[i]
                rows.append(self.probe_prefix + text[start:stop])
                spans.append((scored, None if i == len(ps) - 1 else stop))
            n = max(map(len, rows))
            ids = torch.zeros(B, n, dtype=torch.int64, device=dev)
            on = torch.zeros(B, n, dtype=torch.bool, device=dev)
            for b, row in enumerate(rows):
                if row:
                    ids[b, n - len(row):] = torch.tensor(row, device=dev)
                    on[b, n - len(row):] = True
            positions = torch.where(on, self._next_pos[:, None] + (on.long().cumsum(-1) - 1), 0)
            kwargs: dict[str, Any] = {
                "input_ids": ids, "use_cache": True, self.hooks.base_cache_kwarg: self,
                "attention_mask": torch.cat([torch.ones(B, self._seen, dtype=torch.int64, device=dev),
                                             on.long()], dim=1),
            }
            if fam.kind != "mpt":  # ALiBi (MPT) reads the positions the cache hands its attention
                kwargs["position_ids"] = positions
            self._probe = Probe(on, positions, spans)
            try:
                with torch.no_grad():
                    fam.base(**kwargs)
            finally:
                self._probe = None

    def _probe_scores(self, layer: PolicyLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A reconstruction pass in ``layer``: each sequence's pass rows (``q [B, Hq, n, D]``, ``k, v [B, Hkv,
        n, D]``) attend over its context and themselves, and the largest probability any row and any query
        head of the KV group gives a context token (the policy's ``probe_mode``, renormalised without
        ``skip``'s opening) replaces its score, within the pass's span: the policy's ``extension_scores``
        (``kvkernels.extend_attention``), as kvmodels' probe; its output is not used (the model attended)."""
        assert self._probe is not None and layer.valid is not None and layer.scores is not None
        scale, slopes = scale_and_slopes(self._family, layer.layer_idx, self.captures)
        kept_k, kept_v = layer.dense()  # quantized rows: dequantized, as kvmodels' probe reads them
        for b, span in enumerate(self._probe.spans):
            if span is None:
                continue
            ctx, new = layer.valid[b], self.step.valid[b]
            _, scores = self.eviction.extension_scores(
                q[b][:, new].transpose(0, 1), k[b][:, new].transpose(0, 1), v[b][:, new].transpose(0, 1),
                self.step.positions[b, new], kept_k[b][:, ctx].transpose(0, 1),
                kept_v[b][:, ctx].transpose(0, 1), layer.positions[b][:, ctx].t(), layer.scores[b][:, ctx],
                scale=scale, alibi_slopes=slopes, probe=span)
            assert scores is not None
            layer.scores[b][:, ctx] = scores

    def key_positions(self, layer: PolicyLayer) -> torch.Tensor:
        """``[B, Hkv, N + q]`` positions of the K/V ``layer``'s update returned this forward (a reconstruction
        pass's tokens are returned, not stored)."""
        pos = layer.store.positions
        if self._probe is None:
            return pos
        B, H = pos.shape[:2]
        return torch.cat([pos, self.step.positions[:, None, :].expand(B, H, -1)], dim=-1)
