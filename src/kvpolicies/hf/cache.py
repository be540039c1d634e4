"""The bridge's cache: :class:`PolicyCache`, a ``transformers.Cache`` that a composed policy drives.

It stores what the policy's plan says (``kvpolicies.plan``; docs/contract.md §3.1) and calls the kvkernels ops
kvmodels' paged cache calls; it decides nothing itself:

* its layers (:class:`~kvpolicies.hf.layer.PolicyLayer`) hold **compacted** K/V ``[B, Hkv, N, D]`` with each
  slot's original position, score and validity (ragged kept lengths, left padding), or with
  ``kivi`` kvmodels' packed quantized rows (with KIVI's residual or ``mikv``, beside tokens as they came),
  dequantized for the attention; heads of a layer keep
  different tokens (per-KV-head selection, never expanded to query heads), and with a head-budget policy
  (``adakv``, ``pooled``, ``duo``) different numbers of them, from the plan's ``rows``;
* the model's hooks (:class:`~kvpolicies.hf.hooks.Hooks`) tell it each forward's padding, positions, queries
  and residual stream; it gives each layer's attention a mask sized to that layer's compacted K/V;
* scores follow docs/contract.md §2.2: the prompt's from ``kvkernels.prefill_scores`` (queries and keys, never
  eager attention weights, so ``sdpa`` works), a decode step's from ``kvkernels.paged_decode_attention``'s
  fused update; at the end of the prefill the policy's ``plan`` gives every budget and forced count, then
  MiniCache pairs are merged (``joint``, the merge policy's ``region``) and every layer is compacted to
  ``storage`` with ``kvkernels.topk_compact``, again after each decode step the ``schedule`` names;
* a policy that ranks the context by a reconstruction pass (``kvzip``) has it run before the first forward
  after the prefill: the cache feeds the context's ids again (after ``probe_prefix``) through the model as
  nested forwards, scores the kept context with ``kvkernels.extend_attention`` (the op kvmodels' probe uses)
  and stores nothing of them, then compresses (:meth:`PolicyCache._reconstruct`);
* a forward of several tokens after the prompt (a question after the context, a follow-up turn) is an
  extension, as ``kvmodels.Decoder.extend``'s: its tokens are scored with ``kvkernels.extend_attention`` over
  the kept tokens and themselves (:meth:`PolicyCache._extension_scores`), then the policy re-plans every
  sequence from all it has seen and every layer is compacted to the plan (:meth:`PolicyCache._end_extension`).

The class is split as kvmodels' paged cache is (``PagedKVCache(PrefillSteps, DecodeSteps, ...)``), one part
a module. This one holds construction, what transformers asks, the forward's lifecycle (``append_step``,
``begin_forward``, ``end_forward``), planning, merging, eviction and masks; the others are mixed in:

* :class:`~kvpolicies.hf.scores.ScoreSteps` (``scores.py``): the prompt's, decode steps' and extensions'
  scores;
* :class:`~kvpolicies.hf.extend.ExtendSteps` (``extend.py``): the reconstruction pass and the checks and end
  of an extension;
* :class:`~kvpolicies.hf.report.InspectSteps` (``report.py``): :class:`~kvpolicies.hf.report.HFCacheReport`
  and the inspection (``report``, ``kept_positions``, ``head_contents``, ``layer_contents``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from kvkernels import noise_seed
from kvpolicies.base import LayerStats, NewTokens, residual_cos_sim
from kvpolicies.hf.extend import ExtendSteps, Probe
from kvpolicies.hf.hooks import Hooks
from kvpolicies.hf.layer import PolicyLayer, Step
from kvpolicies.hf.models import rebuild_query
from kvpolicies.hf.report import HFCacheReport as HFCacheReport  # importable from here, as before the split
from kvpolicies.hf.report import InspectSteps
from kvpolicies.hf.rows import packed_rows
from kvpolicies.hf.scores import ScoreSteps
from kvpolicies.plan import CompressionPlan


class PolicyCache(Cache, ScoreSteps, ExtendSteps, InspectSteps):
    """A ``transformers`` cache driven by a composed policy. Build it with :func:`hf_cache`.

    After ``generate`` (or any forward passes), :meth:`report` gives kept tokens and bytes per layer.
    """

    layers: list[PolicyLayer]  # type: ignore[assignment]  # only PolicyLayers, unlike the base class
    step: Step  # the forward in flight (set before any layer reads it)

    def __init__(
        self, policy: Any, model: torch.nn.Module, *, max_new_tokens: int | None = None, seed: int = 0,
        probe_prefix: Sequence[int] = (),
    ) -> None:
        from kvpolicies import ComposedPolicy

        if not isinstance(policy, ComposedPolicy):
            raise TypeError(
                f"policy must be a kvpolicies.ComposedPolicy (build one with kvpolicies.compose(...)), "
                f"got {type(policy).__name__}"
            )
        prefix = policy.checked_probe_prefix(probe_prefix)
        self.hooks = Hooks.on(model)
        self._family = self.hooks.family
        # kivi / mikv: every layer stores packed quantized rows (kvpolicies.hf.rows; with KIVI's residual or
        # MiKV, beside tokens as they came); else None.
        self.rows = packed_rows(policy, self._family.kind, self._family.head_dim)
        n = len(self._family.layers)
        super().__init__(layers=[PolicyLayer(self, i, self.rows) for i in range(n)])
        self.policy = policy
        self.eviction = policy.eviction
        # Where each layer stores its tokens (MiniCache pairs share a region), as kvmodels' PagedKVCache
        # takes it from the policy.
        self.layout = policy.merge_layout(n)
        if policy.eviction.probe and self.layout.pairs:  # as kvmodels.Decoder refuses it
            raise ValueError(
                f"policy {policy.name!r} ranks the context by a reconstruction pass "
                f"({policy.eviction.name}: the context fed again after itself), which merge policy "
                f"{policy.merge.name!r} cannot take (a merged region takes no tokens after the prompt); "
                "use a policy without merging"
            )
        self.probe_prefix = prefix
        self.seed = seed
        # Seeds as kvmodels' PagedKVCache derives them (kvkernels.noise_seed / prefill_seed): the bridge and
        # kvmodels draw identical Gumbel noise for the same policy and seed.
        self._noise_seed = noise_seed(policy.seed, seed)
        self.max_new_tokens = max_new_tokens
        self.needs_queries = (self.eviction.prefill_mode is not None or self.eviction.score_mode != "none"
                              or self.eviction.probe
                              or (self.eviction.scores_tokens and self.eviction.reads_queries))
        self._fresh = True  # no forward seen yet
        self.prefilled = False  # the prompt went through
        self._compressed = False  # the prompt was compressed to the layer budgets
        self._decode_step = 0
        self.extending = False  # the forward in flight is an extension (several tokens after the prompt)
        # [B] host int64 per sequence: tokens seen (prompt, extensions, decode steps), the length its budget
        # is a fraction of (the prompt's, then each extension's total, as kvmodels' budget_len), and the
        # tokens its budget statistic (SqueezeAttention's cos-sim) averages over (prompt and extensions).
        self._seen_tokens = self._budget_lens = self._stat_tokens = torch.zeros(0, dtype=torch.int64)
        self.step = None  # type: ignore[assignment]
        self._next_pos: torch.Tensor | None = None
        self._seen = 0  # logical length (padded prompt + generated), what generate expects
        self._cos_sum: torch.Tensor | None = None  # [Lc, B] sum of cos-sims over prompt tokens
        self.prompt_lens: torch.Tensor | None = None
        self.plan: CompressionPlan | None = None  # the policy's plan for this batch (end of prefill)
        self.peak_bytes = 0
        self._noise: torch.Tensor | None = None  # [Lc, B, Hq, width] this decode step's Gumbel noise
        self._gumbel: torch.Generator | None = None
        self._context: torch.Tensor | None = None  # [B, L] the prompt's ids, for a reconstruction pass
        self._probe: Probe | None = None  # the reconstruction pass in flight
        # This forward's captures (written by the hooks): its length, queries' projections, rotary inputs,
        # ALiBi slopes, layer inputs. Emptied when the forward ends.
        self.captures: dict[Any, Any] = {}

    @property
    def two_parts(self) -> Any:
        """The precision policy whose packed rows sit beside tokens in the cache's dtype (KIVI with a
        residual, ``mikv(high=16)``), else None."""
        return None if self.rows is None else self.rows.precision

    @property
    def merged_pairs(self) -> list[tuple[int, int]]:
        """MiniCache pairs ``(a, b)`` (``layout.pairs``)."""
        return list(self.layout.pairs)

    @property
    def layer_budgets(self) -> torch.Tensor | None:
        """``[Lc, B]`` int64 budgets of the storage layers (a region's ``B_a + B_b`` under ``a``, 0 under
        ``b``), from the plan; None before the prompt was compressed."""
        return None if self.plan is None else self.plan.storage.budgets

    # --- what transformers asks --------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        # The logical length: generate derives input slicing and (without a mask) positions from it.
        return self._seen

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        # Sized like an uncompressed cache so the model's own mask matches its 2-D attention mask; the hooks
        # then replace each layer's mask by one sized to that layer's compacted K/V. transformers < 5.x
        # (5.2 included) passes the step's cache_position tensor [q_len] instead of the query length.
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self._seen + query_length, 0

    # --- driven by the hooks and the layers ---------------------------------------------------------
    @property
    def observes(self) -> bool:
        """Whether this forward feeds the budget policy's statistic: the prompt and an extension (as kvmodels'
        ``observe``), not a decode step or a reconstruction pass."""
        return self._probe is None and (not self.prefilled or self.extending)

    def append_step(self, layer: PolicyLayer, key_states: torch.Tensor, value_states: torch.Tensor,
                    query: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's ``update``: score and store this forward's new K/V ``[B, Hkv, q, D]``; return what the
        layer attends over. ``query`` ``[B, Hq, q, D]`` when the attention hands it over (MPT), else rebuilt
        from the captured projections when the policy needs it."""
        if self._fresh:
            raise RuntimeError(
                "this PolicyCache was not prepared by the kvpolicies hooks; create it with "
                "kvpolicies.hf.hf_cache(policy, model) and pass it as past_key_values"
            )
        if self.needs_queries and query is None:  # once per layer, for the open rule and the score update
            query = rebuild_query(self._family, layer.layer_idx, self.captures, key_states,
                                  check=not self.prefilled)
        if self._probe is not None:  # a reconstruction pass: it scores the context and is not stored
            assert query is not None
            self._probe_scores(layer, query, key_states, value_states)
            keys, values = layer.dense()
            return torch.cat([keys, key_states], -2), torch.cat([values, value_states], -2)
        new_scores = None
        if self.eviction.scores_tokens:  # an open rule: each new token's score from what the step provides
            # [B, H, q, D] -> the rule's [..., H, D] with [...] = [B, q] -> [B, q, Hkv] -> [B, Hkv, q]
            new = NewTokens(k=key_states.transpose(1, 2), v=value_states.transpose(1, 2),
                            positions=self.step.positions,
                            q=query.transpose(1, 2) if self.eviction.reads_queries else None)
            new_scores = self.eviction.token_scores(new).to(torch.float32).transpose(1, 2)
        # Quantized rows: a decode step attends over its own token as stored (kvmodels writes it, then its
        # kernel reads it back), a prompt or a continuation over its exact K/V (kvmodels' prefill and
        # extend_attention take them as they come).
        exact = not self.prefilled or key_states.shape[2] > 1
        keys, values = layer.append(key_states, value_states, self.step, new_scores, exact=exact)
        if self.extending:
            self._extension_scores(layer, keys, values, query)
        elif query is not None:
            self._score_layer(layer, key_states, query)
        if layer.per_head:  # head budgets: padded for this forward (counted at the peak), then held ragged
            self.peak_bytes = max(self.peak_bytes, sum(x.nbytes() for x in self.layers))
            layer.hold()
        return keys, values

    def begin_forward(
        self, batch: int, q_len: int, device: torch.device, attention_mask: Any, position_ids: Any,
        input_ids: torch.Tensor | None = None,
    ) -> None:
        if self._probe is not None:  # a reconstruction pass's forward (the cache's own, nested)
            self.step = Step(self._probe.valid, self._probe.positions)
            self.captures = {"q_len": q_len}
            return
        extending = self.prefilled and q_len > 1
        if extending:
            self._check_extension()
        if self._fresh:
            self._fresh = False
        elif not self._compressed:
            self._finish_prefill()
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                "PolicyCache needs a 2-D attention_mask [batch, past + new tokens] (or none), got "
                f"shape {tuple(attention_mask.shape)}"
            )
        if attention_mask is None:
            valid = torch.ones(batch, q_len, dtype=torch.bool, device=device)
        else:
            valid = attention_mask[:, -q_len:].to(device=device, dtype=torch.bool)
            if valid.shape[1] < q_len:
                raise ValueError(f"attention_mask covers {valid.shape[1]} tokens but the input has {q_len}")
        # Without position ids (MPT's generate passes none) a row's real tokens take the positions after its
        # last one, padding in the chunk (a left-padded question after the context) taking none.
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        if position_ids is not None:
            positions = position_ids.to(device=device, dtype=torch.int64).expand(batch, q_len)
        elif self._next_pos is not None:
            positions = self._next_pos[:, None] + positions
        if self._next_pos is None and not valid.any(-1).all():
            b = int((~valid.any(-1)).nonzero()[0, 0])
            raise ValueError(f"sequence {b} of the batch is all padding; drop it before generate")
        last = torch.where(valid, positions, positions.new_full((), -1)).amax(-1) + 1
        self._next_pos = last if self._next_pos is None else torch.where(valid.any(-1), last, self._next_pos)
        self.step = Step(valid, positions)
        self.captures = {"q_len": q_len}
        self.extending = extending
        if self.prefilled and not extending and self.eviction.score_mode == "gumbel":
            self._draw_noise(device)
        if not self.prefilled:
            self.prompt_lens = valid.sum(-1)
            self._cos_sum = torch.zeros(len(self.layers), batch, dtype=torch.float64)
            if self.eviction.probe:
                self._check_probe(input_ids)

    def end_forward(self) -> None:
        q_len = self.captures.pop("q_len", 0)
        self.captures = {}
        if self._probe is not None:  # the reconstruction pass stored nothing and saw nothing
            return
        self._seen += q_len
        counts = self.step.valid.sum(-1).cpu()
        if not self.prefilled:
            self.prefilled = True
            self._seen_tokens, self._budget_lens, self._stat_tokens = (counts.clone() for _ in range(3))
        elif self.extending:
            self._end_extension(counts)
        else:
            self._seen_tokens += counts
            step = self._decode_step
            self._decode_step += 1
            assert self.plan is not None  # made when the decode's first forward began
            if self.two_parts is not None:  # as kvmodels' SideRegion
                self._age()
                if self.plan.evicts_after(step) and self.eviction.decode_evict:
                    self._demote() if self.two_parts.name == "mikv" else self._evict_packed()
            elif self.plan.evicts_after(step):
                self._evict_by_plan()
        self.peak_bytes = max(self.peak_bytes, sum(layer.nbytes() for layer in self.layers))

    def _evict_by_plan(self) -> None:
        """Compact every layer to the plan after a decode step or an extension; a policy whose KV heads share
        one selection ranks by one score per token of the layer first (as kvmodels' ``after_step``)."""
        if self.eviction.heads_share_selection:  # every head of a layer holds the same tokens
            for layer in self.layers:
                if layer.store is layer and layer.scores is not None:
                    layer.scores = self.eviction.eviction_scores(layer.scores, head_dim=1).clone()
        self._evict()

    def _finish_prefill(self) -> None:
        """The policy's plan from the prompt statistics (after a reconstruction pass, which replaces the
        prompt's scores), then merge pairs and compress every layer (docs/contract.md §5)."""
        self._compressed = True
        if self.eviction.probe:  # its scores replace the prompt's before anything is planned
            self._reconstruct()
        self._plan_batch()
        for i, (a, b) in enumerate(self.layout.pairs):
            self._merge_pair(a, b, *self.plan.joint.row(i))
        prec = self.two_parts
        mikv = prec is not None and prec.name == "mikv"
        prompt = [layer.parts() for layer in self.layers] if mikv else None  # MiKV keeps what is evicted
        if self.plan.schedule.prefill_compress or self.eviction.probe:
            self._evict(regions=False)  # a region was compressed by its joint selection
        if prec is not None:  # two parts: the split (KIVI's residual, MiKV's evicted tokens)
            for l, layer in enumerate(self.layers):
                kept = layer.head_valid()
                if prompt is not None:  # MiKV: the whole prompt again, what the eviction kept marked
                    held = torch.where(kept, layer.positions, -1).sort(dim=-1).values  # ascending
                    layer.restore_parts(prompt[l])
                    at = torch.searchsorted(held, layer.positions).clamp_max(held.shape[-1] - 1)
                    kept = layer.head_valid() & (held.gather(-1, at) == layer.positions)  # membership
                packed = prec.assign(kept, layer.scores) == self.rows.fmt.bits
                layer.pack_slots(packed & layer.head_valid())  # padding slots are no tokens

    def _evict_packed(self) -> None:
        """KIVI's residual under eviction while decoding (kvmodels' ``SideRegion.evict``): in each layer a
        sequence whose two parts hold more than its budget (the plan's) gives up packed tokens only, keeping
        ``budget - waiting`` of them (the policy's sinks, and the part of its recent window the waiting
        tokens do not hold); the tokens waiting in the cache's dtype stay whole."""
        assert self.plan is not None and self.rows is not None
        ev = self.eviction
        share = ev.eviction_scores if ev.heads_share_selection else None
        for l, layer in enumerate(self.layers):
            budgets, n_sink, n_recent = (x.to(torch.int64) for x in self.plan.rows.row(l))  # [B] each
            nq = layer.low_k.shape[2]
            valid = layer.valid.cpu()
            packed, waiting = valid[:, :nq].sum(-1), valid[:, nq:].sum(-1)
            room = (budgets - waiting).clamp_min(0)
            if not bool((packed > room).any()):
                continue
            keep = torch.minimum(packed, room)
            sink = torch.minimum(n_sink, keep)
            recent = torch.minimum((n_recent - waiting).clamp_min(0), keep - sink)
            layer.evict_packed(keep, sink, recent, share)

    def _demote(self) -> None:
        """MiKV under eviction while decoding (kvmodels' ``SideRegion.demote``): in each layer a sequence
        whose tokens in the cache's dtype exceed its budget (the plan's) packs the ones its eviction would
        drop (``MiKV.demoted``: each head's lowest-ranked, sinks and recent window excepted); none is lost."""
        assert self.plan is not None and self.rows is not None
        ev, prec = self.eviction, self.two_parts
        for l, layer in enumerate(self.layers):
            budgets, n_sink, n_recent = (x.tolist() for x in self.plan.rows.row(l))
            nq = layer.low_k.shape[2]
            held = layer.valid[:, nq:]  # [B, Nf]: the tokens in the cache's dtype, in position order
            move = torch.zeros_like(layer.head_valid()[..., nq:])  # [B, Hkv, Nf]
            for b in range(held.shape[0]):
                slots = held[b].nonzero().squeeze(-1)  # [total]
                keep = int(budgets[b])
                if slots.numel() <= keep:
                    continue
                sink = min(int(n_sink[b]), keep)
                recent = min(int(n_recent[b]), keep - sink)
                scores = layer.scores[b, :, nq + slots].t()  # [total, Hkv]
                rank = ev.eviction_scores(scores, head_dim=-1) if ev.heads_share_selection else scores
                move[b].scatter_(1, slots[prec.demoted(rank, keep, sink, recent)].t(), True)
            if bool(move.any()):
                layer.pack_slots(move)

    def _age(self) -> None:
        """KIVI's residual after a decode step or an extension (kvmodels' ``SideRegion.age``): in each layer a
        sequence quantizes the oldest of the tokens waiting in the cache's dtype that ``Kivi.aging`` names."""
        prec = self.two_parts
        if prec is None or prec.name != "kivi":
            return
        for layer in self.layers:
            nq = layer.low_k.shape[2]
            waiting = layer.head_valid()[..., nq:]  # [B, Hkv, Nf]
            rank = waiting.long().cumsum(-1)  # 1 for each row's oldest waiting token
            aged = prec.aging(waiting.sum(-1))  # [B, Hkv]
            if bool((aged > 0).any()):
                layer.pack_slots(waiting & (rank <= aged[..., None]))

    def _plan_batch(self) -> None:
        """``self.plan``: the same decision kvmodels' cache acts on (``ComposedPolicy.plan``) from each
        sequence's tokens seen, its budget length and its statistic's mean; with head budgets, as its
        ``HeadRows`` plans them, from the scores each head holds (after the prompt: every prompt token's,
        after a reconstruction pass its scores; after an extension each head's, 0 past its count)."""
        cos = (self._cos_sum / self._stat_tokens.to(torch.float64).clamp_min(1)).to(torch.float32)

        def head_scores(l: int, b: int) -> torch.Tensor:  # [Hkv, L]: the scores sequence b holds in layer l
            layer = self.layers[l]
            held = layer.head_valid()[b]  # [Hkv, N]
            order = torch.sort((~held).to(torch.uint8), dim=-1, stable=True).indices  # held slots first
            scores = torch.where(held.gather(-1, order), layer.scores[b].gather(-1, order), 0.0)
            return scores[:, :int(held.sum(-1).max())]

        self.plan = self.policy.plan(self._seen_tokens, len(self.layers), LayerStats(cos_sim=cos),
                                     max_new_tokens=self.max_new_tokens or 0,
                                     budget_tokens=self.policy.checked_budget_tokens(self._budget_lens),
                                     head_scores=head_scores if self.policy.heads.per_head else None)

    def _merge_pair(self, a: int, b: int, keep: torch.Tensor, n_sink: torch.Tensor,
                    n_recent: torch.Tensor) -> None:
        """Turn the prefilled layers ``a`` and ``b`` into one region held by ``a`` (docs/contract.md §5.1).

        As ``kvmodels.cache.PagedKVCache.finish_prefill``: both layers keep the same ``keep [B]`` tokens per
        sequence (the plan's ``joint`` row: ``N = min(L, R // 2)``, all ``L`` without prompt compression),
        chosen on the summed scores with forced slots ``n_sink``/``n_recent [B]``; then the merge policy's
        ``region`` merges them into shared slots plus the retained tokens' private slots, which are packed
        front-aligned per sequence.
        """
        la, lb = self.layers[a], self.layers[b]
        assert la.valid is not None and la.scores is not None and lb.scores is not None
        count = la.valid.sum(-1).cpu()  # [B] prompt tokens (both layers saw the same ones)
        if bool((count > keep).any()):
            summed = la.scores + lb.scores  # [B, Hkv, L]
            for layer in (la, lb):  # the same ranking and forced slots, so the same tokens per head
                layer.compact(keep, n_sink, n_recent, priority=summed)
        regions = []
        for i in range(count.shape[0]):
            idx = la.valid[i].nonzero().squeeze(-1)  # this sequence's kept slots
            per_token = (la.keys, lb.keys, la.values, lb.values, la.positions, la.scores, lb.scores)
            ka, kb, va, vb, pos, sa, sb = (x[i][:, idx].transpose(0, 1) for x in per_token)  # [N, Hkv, ...]
            regions.append(self.policy.merge.region(ka, kb, va, vb, pos, sa, sb))
        n_slots = torch.tensor([r["k"].shape[0] for r in regions], device=la.valid.device)  # [B]
        width = int(n_slots.max())

        def packed(name: str) -> torch.Tensor:
            """Sequences' ``[n_i, Hkv, ...]`` slots, front-aligned, zero-padded: ``[B, Hkv, width, ...]``"""
            rows = [r[name] for r in regions]
            rows = [F.pad(x, (0, 0) * (x.dim() - 1) + (0, width - x.shape[0])) for x in rows]
            return torch.stack(rows).transpose(1, 2)

        la.keys, la.values = packed("k").contiguous(), packed("v").contiguous()
        la.positions, la.scores = packed("pos").to(torch.int64), packed("score").to(torch.float32)
        la.k_mag = torch.stack([packed("k_mag_a"), packed("k_mag_b")])  # [2, B, Hkv, width]
        la.v_mag = torch.stack([packed("v_mag_a"), packed("v_mag_b")])
        la.slot_mask = packed("mask")
        la.valid = torch.arange(width, device=n_slots.device)[None, :] < n_slots[:, None]  # [B, width]
        # b holds nothing of its own from now on: empty tensors (so counts and bytes read 0; fresh ones, not
        # views that would keep its prompt's storage alive) and a reference to the region.
        lb._store, lb.member = la, self.layout.member[b]
        lb.keys, lb.values = (x.new_empty(*x.shape[:2], 0, x.shape[3]) for x in (la.keys, la.values))
        lb.positions, lb.scores = (x.new_empty(*x.shape[:2], 0) for x in (la.positions, la.scores))
        lb.valid = la.valid.new_empty(la.valid.shape[0], 0)

    def _evict(self, regions: bool = True) -> None:
        """Compact every storage layer to the plan's budgets and forced counts (``plan.rows``: ``storage``, or
        each KV head's own budget with head budgets); the regions too unless ``regions=False``."""
        assert self.plan is not None
        width, H = self.layout.width, self._family.n_kv_heads
        per_head = self.plan.head_budgets is not None  # rows [Lc, B * Hkv]: each KV head its own budget
        for l, layer in enumerate(self.layers):
            if width[l] == 0 or (width[l] == 2 and not regions):
                continue  # the second layer of a pair holds no tokens; a region may be left alone
            row = self.plan.rows.row(l)
            layer.compact(*(x.view(-1, H) for x in row) if per_head else row)
            layer.hold()

    def record_cos(self, layer_idx: int, h_in: torch.Tensor, attn_out: torch.Tensor) -> None:
        cos = residual_cos_sim(h_in, attn_out)  # [B, q]
        valid = self.step.valid
        self._cos_sum[layer_idx] += (cos * valid).sum(-1).double().cpu()

    def layer_mask(
        self, layer: PolicyLayer, q_len: int, kind: str, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The attention mask for ``layer`` once ``q_len`` new tokens are appended.

        ``[B, 1, q, N + q]``: a bool "may attend" mask (``sdpa``), an additive float mask (``eager``), or a
        bool "masked out" mask (MPT). ``None`` when every slot is visible to a single query (no padding).
        When the slots differ per KV head (a merged pair's layer sees its region's shared slots and its own
        private slots only; with head budgets each head holds its own count) the mask is ``[B, Hq, q, N + q]``
        (query head ``h`` reads KV head ``h // G``).
        """
        valid_new = self.step.valid
        store = layer.store
        old = store.valid if store.valid is not None else valid_new[:, :0]
        n_old = old.shape[-1]
        if q_len == 1 and bool(old.all()) and kind != "mpt" and not layer.merged:
            return None
        B = valid_new.shape[0]
        if layer.merged or store.per_head:
            group = self._family.n_q_heads // self._family.n_kv_heads
            seen = store.visible(layer.member).repeat_interleave(group, dim=1)  # [B, Hq, N]
        else:
            seen = old[:, None, :]  # [B, 1, N]
        H = seen.shape[1]
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=old.device).tril()  # [q, q]
        new = (causal[None] & valid_new[:, None, :])[:, None]  # [B, 1, q, q]
        allowed = torch.cat(
            [seen[:, :, None, :].expand(B, H, q_len, n_old), new.expand(B, H, q_len, q_len)], dim=-1
        )  # [B, H, q, N + q]
        # A padding query attends to itself only, so no row is empty (an empty row gives NaN in sdpa).
        allowed[:, :, torch.arange(q_len), n_old + torch.arange(q_len)] = True
        if kind == "sdpa":
            return allowed
        if kind == "mpt":
            return ~allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=old.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
