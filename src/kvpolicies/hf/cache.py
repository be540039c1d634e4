"""The bridge's cache: :class:`PolicyCache`, a ``transformers.Cache`` that a composed policy drives.

It stores what the policy's plan says (``kvpolicies.plan``; docs/contract.md §3.1) and calls the kvkernels ops
kvmodels' paged cache calls; it decides nothing itself:

* its layers (:class:`~kvpolicies.hf.layer.PolicyLayer`) hold **compacted** K/V ``[B, Hkv, N, D]`` with each
  slot's original position, score and validity (ragged kept lengths, left padding), or with
  ``kivi(residual=0)`` kvmodels' packed quantized rows, dequantized for the attention; heads of a layer keep
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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from kvkernels import (
    Alibi,
    Restore,
    ScoreUpdate,
    draw_gumbel_,
    noise_seed,
    paged_decode_attention,
    prefill_seed,
)
from kvkernels.extend_attention import extend_attention
from kvpolicies.base import LayerStats, NewTokens, residual_cos_sim
from kvpolicies.hf.hooks import Hooks
from kvpolicies.hf.layer import PolicyLayer, Step
from kvpolicies.hf.models import rebuild_query, scale_and_slopes
from kvpolicies.hf.rows import packed_rows
from kvpolicies.plan import CompressionPlan


@dataclasses.dataclass(frozen=True)
class HFCacheReport:
    """What a :class:`PolicyCache` holds now.

    tokens_per_layer: ``[Lc, B]`` int64 — kept (valid) tokens per layer and sequence (padding excluded).
    bytes_per_layer: ``[Lc]`` int64 — bytes of the K/V tensors each layer physically holds.
    total_bytes / peak_bytes: sum over layers now / the largest total seen.
    layer_budgets: ``[Lc, B]`` int64 or None before the prompt was compressed.
    merged_pairs: MiniCache pairs ``(a, b)``. As in ``kvmodels.cache.CacheReport``, a pair's region is listed
        under ``a``: its slots (a shared slot once, each layer's private slots), its bytes (K/V plus the four
        float32 magnitudes and the uint8 visibility mask per (slot, KV head)) and the pair's budget
        ``B_a + B_b``; ``b`` lists 0 of each, so every column still sums to what the cache holds.
    full_cache_bytes: what an uncompressed cache would hold now: K/V of every token each sequence has seen
        (prompt and generated, padding excluded) in every layer, at the cache's dtype.
    head_tokens: ``[Lc, B, Hkv]`` int64, a head-budget policy's (``adakv``, ``pooled``, ``duo``) kept tokens
        per KV head, else None. As ``kvmodels.cache.CacheReport``, ``tokens_per_layer`` is then float64, each
        sequence's mean over its heads (``layer_budgets`` is the layer's budget, the mean of its heads';
        ``head_budgets`` ``[Lc, B, Hkv]`` the plan's split). Unlike kvmodels, whose heads hold pages of their
        own, a layer here is one tensor padded to its longest head: ``bytes_per_layer`` counts that padding.
    rows, quantized: as ``kvmodels.cache.CacheReport``: how a stored row holds a token (empty: the cache's
        dtype; else the packed format and its bytes per row) and whether rows are quantized. Quantized
        (``kivi(residual=0)``), ``bytes_per_layer`` counts the packed rows (codes, scales and zero points)
        and, with ``channel_scale``, the float32 channel factors; ``full_cache_bytes`` stays the unquantized
        cache's.

    ``print(report)`` shows it as a table (:meth:`__str__`).
    """

    tokens_per_layer: torch.Tensor
    bytes_per_layer: torch.Tensor
    total_bytes: int
    peak_bytes: int
    layer_budgets: torch.Tensor | None
    merged_pairs: tuple[tuple[int, int], ...] = ()
    full_cache_bytes: int = 0
    head_tokens: torch.Tensor | None = None
    head_budgets: torch.Tensor | None = None
    rows: str = ""
    quantized: bool = False

    def __str__(self) -> str:
        mib = 2.0**-20
        lines = [f"{'layer':>5} {'MiB':>9}  {'tokens per sequence':<24} {'budgets':<24}"]
        for l, nbytes in enumerate(self.bytes_per_layer.tolist()):
            kept = self.tokens_per_layer[l].tolist()  # a mean over the heads with head budgets
            toks = " ".join(f"{t:.1f}" if isinstance(t, float) else str(t) for t in kept)
            row = [] if self.layer_budgets is None else self.layer_budgets[l].tolist()
            budgets = " ".join(str(t) for t in row) or "-"
            lines.append(f"{l:>5} {nbytes * mib:>9.3f}  {toks:<24} {budgets:<24}")
        ratio = self.total_bytes / self.full_cache_bytes if self.full_cache_bytes else float("nan")
        lines.append(
            f"KV cache: {self.total_bytes * mib:.3f} MiB kept vs {self.full_cache_bytes * mib:.3f} MiB full "
            f"({ratio:.1%}; full = every prompt and generated token in every layer); peak "
            f"{self.peak_bytes * mib:.3f} MiB" + (f"; {self.rows}" if self.rows else "")
        )
        if self.merged_pairs:
            lines.append(f"merged pairs (stored under the first layer): {list(self.merged_pairs)}")
        return "\n".join(lines)



@dataclasses.dataclass
class Probe:
    """One forward of a reconstruction pass (:meth:`PolicyCache._reconstruct`): its tokens (left-padded) and,
    per sequence, the positions ``[lo, hi)`` of the kept context tokens whose scores it replaces (``hi`` None:
    to the end; the whole entry None: the sequence has no pass here)."""

    valid: torch.Tensor  # [B, n] bool
    positions: torch.Tensor  # [B, n] int64
    spans: list[tuple[int, int | None] | None]


class PolicyCache(Cache):
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
        if isinstance(probe_prefix, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in probe_prefix):
            raise ValueError(f"probe_prefix must be a list of token ids, got {probe_prefix!r}; tokenize it")
        if len(probe_prefix) and not policy.eviction.probe:
            raise ValueError(f"probe_prefix is fed before the context's copy in a reconstruction pass, and "
                             f"policy {policy.name!r} runs none; use kvzip, or leave probe_prefix out")
        self.hooks = Hooks.on(model)
        self._family = self.hooks.family
        # kivi(residual=0): every layer stores packed quantized rows (kvpolicies.hf.rows); else None.
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
        self.probe_prefix = [int(t) for t in probe_prefix]
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
            if self.plan.evicts_after(step):
                if self.eviction.heads_share_selection:  # every head of a layer holds the same tokens
                    for layer in self.layers:
                        if layer.store is layer and layer.scores is not None:
                            layer.scores = self.eviction.eviction_scores(layer.scores, head_dim=1).clone()
                self._evict()
        self.peak_bytes = max(self.peak_bytes, sum(layer.nbytes() for layer in self.layers))

    def _finish_prefill(self) -> None:
        """The policy's plan from the prompt statistics (after a reconstruction pass, which replaces the
        prompt's scores), then merge pairs and compress every layer (docs/contract.md §5)."""
        self._compressed = True
        if self.eviction.probe:  # its scores replace the prompt's before anything is planned
            self._reconstruct()
        self._plan_batch()
        for i, (a, b) in enumerate(self.layout.pairs):
            self._merge_pair(a, b, *self.plan.joint.row(i))
        if self.plan.schedule.prefill_compress or self.eviction.probe:
            self._evict(regions=False)  # a region was compressed by its joint selection

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
        ev, mode = self.eviction, self.eviction.prefill_mode
        if mode is None:
            return
        assert q is not None and layer.positions is not None and layer.scores is not None
        scale, slopes = scale_and_slopes(self._family, layer.layer_idx, self.captures)
        held, pos, score = layer.head_valid(), layer.positions, layer.scores
        B, H, N = pos.shape
        n_old, G, D = N - q.shape[2], q.shape[1] // H, keys.shape[-1]
        rows = [(slice(None), slice(None), -1)] if not self.policy.heads.per_head else [
            (slice(h, h + 1), slice(h * G, (h + 1) * G), h) for h in range(H)]
        for b in range(B):
            new = self.step.valid[b]
            n = int(new.sum())
            if n == 0:
                continue
            new_slots = n_old + new.nonzero().squeeze(-1)  # [n]
            kw = ev.prefill_kwargs(n)
            window, decay = ev.prefill_window(n), float(kw.get("decay", 1.0))
            for heads, group, h in rows:
                idx = held[b, heads.start or 0, :n_old].nonzero().squeeze(-1)  # [m] (the heads hold alike)
                order = pos[b, heads][:, idx].argsort(dim=-1, stable=True)
                slots = idx[order]  # [h, m] each head's kept slots in position order

                def tokens(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:  # [h, N, D] -> [m or n, h, D]
                    return x.gather(1, at[..., None].expand(*at.shape, D)).transpose(0, 1)

                fresh = new_slots.expand(slots.shape[0], n)
                seed = prefill_seed(self._noise_seed, layer.layer_idx, b if h < 0 else b * H + h)  # its row
                _, s = extend_attention(
                    q[b, group][:, new].transpose(0, 1), tokens(keys[b, heads], fresh),
                    tokens(values[b, heads], fresh), self.step.positions[b, new],
                    tokens(keys[b, heads], slots), tokens(values[b, heads], slots),
                    pos[b, heads].gather(-1, slots).t(), scale=scale,
                    alibi_slopes=None if slopes is None else slopes[group], mode=mode, window=window,
                    decay=decay, seed=seed,
                    temperature=float(kw.get("temperature", 1.0)))
                assert s is not None
                m = idx.numel()
                if window or mode == "replace":  # window votes: they replace the kept tokens' old votes
                    s = ev.postprocess_prefill_scores(s)
                else:  # every row scores: the rows continue the kept tokens' scores, as decode steps would
                    old = score[b, heads].gather(-1, slots) * (decay**n if mode == "decay" else 1.0)
                    s = torch.cat([old + s[:, :m], s[:, m:]], dim=-1)
                row = score[b, heads]  # a view: written in place
                row.scatter_(-1, slots, s[:, :m].to(row.dtype))
                row[:, new_slots] = s[:, m:].to(row.dtype)

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
        if self.plan.schedule.prefill_compress:
            if ev.heads_share_selection:  # as after a decode step: one ranking for the layer's heads
                for layer in self.layers:
                    layer.scores = ev.eviction_scores(layer.scores, head_dim=1).clone()
            self._evict()

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
        skip, extra, limit = ev.probe_skip, len(self.probe_prefix), self._family.max_positions
        span = getattr(ev, "span", None)  # kvzip's; a plugin's probe policy may have none
        for b, (n, start) in enumerate(zip(self.step.valid.sum(-1).tolist(), self._next_pos.tolist())):
            if skip is not None and n <= skip[1]:
                raise ValueError(f"input_ids[{b}]: policy {name!r} copies the prompt from token {skip[1]} on "
                                 f"(its skip: the chat template's opening), and the prompt has {n} tokens; "
                                 "lower skip or give a longer prompt")
            need = start + max(extra + stop - lo for lo, stop, _ in ev.probe_passes(n))
            if limit is not None and need > limit:
                with_prefix = f" after the {extra} tokens of probe_prefix" if extra else ""
                how = ("shorten the prompt or reconstruct it in parts (kvzip(span=N))" if span is None
                       else "shorten the prompt or lower span")
                raise ValueError(f"input_ids[{b}]: policy {name!r} feeds the prompt of {n} tokens again "
                                 f"after itself{with_prefix} (the reconstruction pass"
                                 f"{'' if span is None else f', {span} tokens at a time'}), at positions up "
                                 f"to {need}, past the model's {limit} positions; {how}")

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
        ``skip``'s opening) replaces its score, within the pass's span. ``kvkernels.extend_attention``
        computes it, as in kvmodels' probe; its attention output is not used (the model attended)."""
        assert self._probe is not None and layer.valid is not None and layer.scores is not None
        ev = self.eviction
        scale, slopes = scale_and_slopes(self._family, layer.layer_idx, self.captures)
        kept_k, kept_v = layer.dense()  # quantized rows: dequantized, as kvmodels' probe reads them
        for b, span in enumerate(self._probe.spans):
            if span is None:
                continue
            ctx, new = layer.valid[b], self.step.valid[b]
            kept_pos = layer.positions[b][:, ctx]  # [Hkv, m], position order
            _, scores = extend_attention(
                q[b][:, new].transpose(0, 1), k[b][:, new].transpose(0, 1), v[b][:, new].transpose(0, 1),
                self.step.positions[b, new], kept_k[b][:, ctx].transpose(0, 1),
                kept_v[b][:, ctx].transpose(0, 1), kept_pos.t(), scale=scale, alibi_slopes=slopes,
                mode=ev.probe_mode, skip=ev.probe_skip)
            assert scores is not None
            lo, hi = span
            inside = kept_pos >= lo
            if hi is not None:
                inside &= kept_pos < hi
            old = layer.scores[b][:, ctx]
            layer.scores[b][:, ctx] = torch.where(inside, scores[:, :kept_pos.shape[1]], old)

    def key_positions(self, layer: PolicyLayer) -> torch.Tensor:
        """``[B, Hkv, N + q]`` positions of the K/V ``layer``'s update returned this forward (a reconstruction
        pass's tokens are returned, not stored)."""
        pos = layer.store.positions
        if self._probe is None:
            return pos
        B, H = pos.shape[:2]
        return torch.cat([pos, self.step.positions[:, None, :].expand(B, H, -1)], dim=-1)

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

    # --- scores --------------------------------------------------------------------------------------
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
            # The in-house cache's seed for (layer, row), so both draw the same prefill noise: a row is a
            # sequence, or with head budgets (kvmodels' HeadRows) one KV head of it with its query group.
            rows = [(slice(None), slice(None), b)] if not self.policy.heads.per_head else [
                (slice(h, h + 1), slice(h * G, (h + 1) * G), b * H + h) for h in range(H)]
            for heads, group, row in rows:
                s = ev.prompt_scores(qb[:, group].contiguous(), kb[:, heads].contiguous(), scale=scale,
                                     alibi_slopes=None if slopes is None else slopes[group],
                                     seed=prefill_seed(self._noise_seed, layer.layer_idx, row))  # [h, L]
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
        N = store.keys.shape[2]
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

    # --- reporting -----------------------------------------------------------------------------------
    def report(self) -> HFCacheReport:
        """Kept tokens per layer and sequence, bytes per layer, total and peak bytes, layer budgets."""
        if self.prefilled and not self._compressed:
            self._finish_prefill()
        heads = torch.stack([layer.head_tokens().cpu() for layer in self.layers])  # [Lc, B, Hkv]
        per_head = self.policy.heads.per_head
        # Equal counts per head without head budgets (a region's slots too); the heads' mean with them.
        tokens = heads.double().mean(-1) if per_head else heads.sum(-1) // max(1, heads.shape[-1])
        nbytes = torch.tensor([layer.nbytes() for layer in self.layers], dtype=torch.int64)
        total = int(nbytes.sum())
        self.peak_bytes = max(self.peak_bytes, total)
        pairs = self.layout.pairs
        budgets = None if self.plan is None else self.plan.storage.budgets.clone()
        full = 0
        if self.prompt_lens is not None:
            seen = int(self._seen_tokens.sum())
            dtype = next((x.kv_dtype for x in self.layers if x.kv_dtype is not None), None)
            if dtype is not None:  # K/V of every token in the cache's dtype (unquantized)
                fam = self._family
                full = 2 * len(self.layers) * seen * fam.n_kv_heads * fam.head_dim * dtype.itemsize
        head_budgets = None if self.plan is None else self.plan.head_budgets
        return HFCacheReport(tokens, nbytes, total, self.peak_bytes, budgets, pairs, full,
                             heads if per_head else None, head_budgets,
                             rows="" if self.rows is None else self.rows.describe(),
                             quantized=self.rows is not None)

    def kept_positions(self, layer_idx: int, b: int) -> torch.Tensor:
        """``[Hkv, n]`` original positions of the tokens sequence ``b`` keeps in layer ``layer_idx``.

        For a layer of a merged pair: the positions of its pair's region slots (both layers', as
        ``kvmodels.cache.PagedKVCache.layer_contents`` lists them); :meth:`layer_contents` says which ones
        this layer sees.
        """
        store = self.layers[layer_idx].store
        self._check_layer_contents(store)
        return store.positions[b][:, store.valid[b]]

    def _check_layer_contents(self, store: PolicyLayer) -> None:
        if store.per_head:
            raise TypeError("the KV heads of this layer hold different numbers of tokens (head budgets); use "
                            "head_contents(l, b), one dict per KV head")

    def head_contents(self, layer_idx: int, b: int) -> list[dict[str, torch.Tensor]]:
        """Kept tokens of layer ``layer_idx``, sequence ``b``, one dict per KV head, in position order
        (``kvmodels``' ``HeadPagedKVCache.head_contents``): ``k``/``v`` ``[n_h, D]``, ``pos`` ``[n_h]`` int64,
        ``score`` ``[n_h]`` float32. The heads may hold different counts (head budgets)."""
        layer = self.layers[layer_idx]
        store = layer.store
        keys, values = store.restored(layer.member) if layer.merged else store.dense()
        valid = store.visible(layer.member)[b]  # [Hkv, N]
        parts = {"k": keys, "v": values, "pos": store.positions, "score": store.scores}
        return [{name: x[b, h][valid[h]] for name, x in parts.items()} for h in range(valid.shape[0])]

    def layer_contents(self, layer_idx: int, b: int) -> dict[str, torch.Tensor]:
        """Kept slots of layer ``layer_idx``, sequence ``b`` in slot order (``PagedKVCache.layer_contents``).

        Returns ``k``/``v`` ``[n, Hkv, D]`` (a merged layer's restored through its own magnitudes: what it
        attends over), ``pos`` ``[n, Hkv]`` int64 and ``score`` ``[n, Hkv]`` float32; for a layer of a merged
        pair the slots are its region's, plus ``visible`` ``[n, Hkv]`` bool (the slots this layer sees).
        """
        layer = self.layers[layer_idx]
        store = layer.store
        self._check_layer_contents(store)
        keys, values = store.restored(layer.member) if layer.merged else store.dense()
        row = store.valid[b]
        out = {
            "k": keys[b][:, row].transpose(0, 1),
            "v": values[b][:, row].transpose(0, 1),
            "pos": store.positions[b][:, row].t(),
            "score": store.scores[b][:, row].t(),
        }
        if layer.merged:
            out["visible"] = store.visible(layer.member)[b][:, row].t()
        return out
