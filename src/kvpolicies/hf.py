"""Hugging Face ``transformers`` bridge: drive any ``AutoModelForCausalLM`` with a composed policy.

This is the only module of the library that imports ``transformers`` (an optional extra,
``pip install kvpolicies[hf]``); the core packages never import it.

    >>> cache = hf_cache(compose("h2o", budget=0.25), model)
    >>> out = model.generate(**inputs, max_new_tokens=64, past_key_values=cache)
    >>> with compressed(model, compose("squeeze", "keyformer", budget=0.2)) as caches:
    ...     out = model.generate(**inputs, max_new_tokens=64)      # a fresh cache per call
    >>> caches[-1].report()

How it works (docs/hf.md has the full story):

* :class:`PolicyCache` is a ``transformers.Cache`` whose layers (:class:`PolicyLayer`, a ``DynamicLayer``)
  hold **compacted** K/V ``[B, Hkv, N, D]`` plus, per slot, the original absolute position ``[B, Hkv, N]``,
  the policy score ``[B, Hkv, N]`` and a validity mask ``[B, N]`` (ragged per-sequence kept lengths, left
  padding). Heads of a layer keep the same number of tokens but may keep different ones (per-KV-head
  selection, never expanded to query heads).
* Hooks installed on the model (idempotently, inert for any other cache) feed the cache what ``update()``
  alone does not see: the 2-D padding mask and positions (base-model pre-hook), the queries (projection
  hooks; the queries are rebuilt with the model's own rotary code and checked against the keys), the
  residual stream around each attention (SqueezeAttention's cos-sim), and they replace each layer's
  attention mask by the cache's per-layer mask, because after compression layers differ in length.
* MPT's attention indexes ALiBi by the physical cache slot, which is wrong once tokens are evicted, so for
  MPT the bridge runs its own attention (same math, bias from each slot's original position).
* Scores follow ``docs/contract.md`` §2.2: prefill scores come from ``kvkernels.prefill_scores`` (queries
  and keys, never eager attention weights, so ``sdpa`` works); a decode step adds the mean over the GQA
  group of the softmax row of the new query. Selection is the contract's ``topk_compact`` rule.
* MiniCache (a ``merge`` policy) follows ``docs/contract.md`` §5.1 and ``kvmodels``: at the end of prefill
  each merged pair ``(a, b)`` becomes one *region* held by layer ``a`` (shared unit-direction slots plus
  per-layer magnitudes, retained tokens as private slots of each layer, a per-(slot, head) visibility mask);
  layer ``b`` holds nothing and reads ``a``'s region. Each layer attends over the region restored through
  its own magnitudes (``kvkernels.merge.merge_restore``), masked to the slots it may see.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

try:
    import transformers
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvpolicies.hf needs transformers: pip install 'kvpolicies[hf]'") from exc

from kvkernels import draw_gumbel_, merge_restore, noise_seed, prefill_seed
from kvpolicies.base import LayerStats, NewTokens, residual_cos_sim
from kvpolicies.plan import CompressionPlan

__all__ = [
    "PolicyCache",
    "PolicyLayer",
    "HFCacheReport",
    "hf_cache",
    "compressed",
    "UnsupportedModelError",
]

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


class UnsupportedModelError(ValueError):
    """The model (or its attention implementation) cannot be driven by a policy cache."""


# ----------------------------------------------------------------------------------------
# Model adapters: how to find the attention modules and rebuild their queries
# ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Family:
    kind: str  # "llama" (attention interface + rotary embeddings), "gptj" or "mpt"
    # Modules typed Any: their attributes (q_proj, head_dim, ...) are the family's, unknown to nn.Module.
    layers: list[Any]  # decoder layers, in order
    attns: list[Any]  # their attention modules
    base: Any  # the module whose forward receives input_ids / attention_mask
    n_q_heads: int
    n_kv_heads: int
    head_dim: int


def _decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    base = getattr(model, "base_model", model)
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    for name in ("layers", "h", "blocks"):
        mods = getattr(base, name, None)
        if isinstance(mods, torch.nn.ModuleList) and len(mods) == n:
            return base, mods
    raise UnsupportedModelError(
        f"{type(model).__name__}: could not find its {n} decoder layers (looked for base_model.layers / .h / "
        ".blocks); kvpolicies.hf supports Llama-style, GPT-J and MPT decoders"
    )


def _family(model: torch.nn.Module) -> _Family:
    """Identify the model family, or raise an error that says what to change."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; kvpolicies.hf "
            "supports decoder-only causal LMs (AutoModelForCausalLM)"
        )
    layer_types = getattr(config, "layer_types", None)
    if (
        (layer_types and any(t != "full_attention" for t in layer_types))
        or getattr(config, "sliding_window", None) is not None
        and getattr(config, "use_sliding_window", True)
    ):
        raise UnsupportedModelError(
            f"{type(model).__name__} uses sliding-window / hybrid attention layers "
            f"(layer_types={layer_types}, sliding_window={getattr(config, 'sliding_window', None)}); "
            "a policy cache needs full attention in every layer. Set config.sliding_window=None if the model "
            "allows it"
        )
    base, layers = _decoder_layers(model)
    attns = []
    for layer in layers:
        attn = next(
            (getattr(layer, n) for n in ("self_attn", "attn", "attention") if hasattr(layer, n)), None
        )
        if attn is None:
            raise UnsupportedModelError(f"{type(layer).__name__} has no self_attn / attn module")
        attns.append(attn)
    cls = type(attns[0]).__name__
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if cls == "MptAttention":
        h = attns[0].n_heads
        return _Family("mpt", list(layers), attns, base, h, h, attns[0].head_dim)
    if cls == "GPTJAttention":
        h = attns[0].num_attention_heads
        return _Family("gptj", list(layers), attns, base, h, h, attns[0].head_dim)
    if cls.endswith("FlashAttention2") or "flash" in impl or impl == "flex_attention":
        raise UnsupportedModelError(
            f"attention implementation {impl!r} ({cls}) cannot take the per-layer masks of a compressed "
            "cache; load the model with attn_implementation='sdpa' (or 'eager')"
        )
    a = attns[0]
    modeling = sys.modules[type(a).__module__]
    if not all(hasattr(a, n) for n in ("q_proj", "k_proj", "layer_idx")) or not hasattr(
        modeling, "apply_rotary_pos_emb"
    ):
        raise UnsupportedModelError(
            f"{cls}: kvpolicies.hf supports Llama-style attention (q_proj/k_proj/v_proj with rotary "
            "position_embeddings, e.g. Llama, Mistral, Qwen2, SmolLM), GPT-J and MPT; use kvmodels for others"
        )
    if impl not in ("sdpa", "eager"):
        raise UnsupportedModelError(
            f"attention implementation {impl!r} is not supported; load the model "
            "with attn_implementation='sdpa' (or 'eager')"
        )
    return _Family(
        "llama",
        list(layers),
        attns,
        base,
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        a.head_dim,
    )


def _llama_rope(
    attn: torch.nn.Module, proj_out: torch.Tensor, norm: str, n_heads: int, ctx: dict[str, Any]
) -> torch.Tensor:
    """Rotated heads ``[B, H, L, D]`` from a q_proj/k_proj output ``[B, L, H*D]``, as the model does it."""
    x = proj_out.view(*proj_out.shape[:2], n_heads, attn.head_dim)  # [B, L, H, D]
    if hasattr(attn, norm):  # Qwen3-style per-head q_norm / k_norm before RoPE
        x = getattr(attn, norm)(x)
    x = x.transpose(1, 2)  # [B, H, L, D]
    cos, sin = ctx["position_embeddings"]
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb(x, x, cos, sin)[0]


def _gptj_rope(attn: torch.nn.Module, proj_out: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    x = proj_out.view(*proj_out.shape[:2], attn.num_attention_heads, attn.head_dim)  # [B, L, H, D]
    if ctx.get("position_embeddings") is not None:  # transformers >= 5.24 hands (sin, cos) to the attention
        sin, cos = (t.to(x.dtype) for t in ctx["position_embeddings"])
    else:  # older releases: the attention looks its table up by position
        position_ids = ctx["position_ids"]
        embed = attn._get_embed_positions(position_ids)
        sincos = torch.gather(embed, 1, position_ids.unsqueeze(-1).repeat(1, 1, embed.shape[-1])).to(x.dtype)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    if attn.rotary_dim is not None:
        x = torch.cat([rope(x[..., : attn.rotary_dim], sin, cos), x[..., attn.rotary_dim :]], dim=-1)
    else:
        x = rope(x, sin, cos)
    return x.permute(0, 2, 1, 3)  # [B, H, L, D]


# ----------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------
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

    ``print(report)`` shows it as a table (:meth:`__str__`).
    """

    tokens_per_layer: torch.Tensor
    bytes_per_layer: torch.Tensor
    total_bytes: int
    peak_bytes: int
    layer_budgets: torch.Tensor | None
    merged_pairs: tuple[tuple[int, int], ...] = ()
    full_cache_bytes: int = 0

    def __str__(self) -> str:
        mib = 2.0**-20
        lines = [f"{'layer':>5} {'MiB':>9}  {'tokens per sequence':<24} {'budgets':<24}"]
        for l, nbytes in enumerate(self.bytes_per_layer.tolist()):
            toks = " ".join(str(t) for t in self.tokens_per_layer[l].tolist())
            row = [] if self.layer_budgets is None else self.layer_budgets[l].tolist()
            budgets = " ".join(str(t) for t in row) or "-"
            lines.append(f"{l:>5} {nbytes * mib:>9.3f}  {toks:<24} {budgets:<24}")
        ratio = self.total_bytes / self.full_cache_bytes if self.full_cache_bytes else float("nan")
        lines.append(
            f"KV cache: {self.total_bytes * mib:.3f} MiB kept vs {self.full_cache_bytes * mib:.3f} MiB full "
            f"({ratio:.1%}; full = every prompt and generated token in every layer); peak "
            f"{self.peak_bytes * mib:.3f} MiB"
        )
        if self.merged_pairs:
            lines.append(f"merged pairs (stored under the first layer): {list(self.merged_pairs)}")
        return "\n".join(lines)


class PolicyLayer(DynamicLayer):
    """One model layer's compacted cache.

    keys, values: ``[B, Hkv, N, D]``; ``positions``: ``[B, Hkv, N]`` int64 original absolute positions;
    ``scores``: ``[B, Hkv, N]`` float32; ``valid``: ``[B, N]`` bool (the same for every head of a layer).

    After a MiniCache merge, layer ``a`` of a pair holds the pair's *region* (docs/contract.md §5.1) in
    those tensors: a shared slot holds the unit direction, a private slot the original K/V. It also holds
    ``k_mag``, ``v_mag``: ``[2, B, Hkv, N]`` float32 per-slot magnitudes (member 0 = ``a``, 1 = ``b``; 1.0 on
    private slots) and ``slot_mask``: ``[B, Hkv, N]`` uint8 (bit 1: visible to ``a``, bit 2: to ``b``).
    Layer ``b`` holds empty tensors and reads ``a``'s region (``store``) as ``member`` 1.
    """

    def __init__(self, owner: PolicyCache, layer_idx: int) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.positions: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.k_mag: torch.Tensor | None = None
        self.v_mag: torch.Tensor | None = None
        self.slot_mask: torch.Tensor | None = None
        self._store: PolicyLayer | None = None  # the pair's first layer, for the second layer of a pair
        self.member = 0  # which layer of a merged pair this is (its slot_mask bit is 1 << member)

    @property
    def store(self) -> PolicyLayer:
        """The layer whose tensors hold this layer's tokens: itself, or its pair's region owner."""
        return self if self._store is None else self._store

    @property
    def merged(self) -> bool:
        """Whether this layer reads a merged pair's region."""
        return self.store.slot_mask is not None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self._owner()
        assert owner is not None
        if owner._fresh:
            raise RuntimeError(
                "this PolicyCache was not prepared by the kvpolicies hooks; create it with "
                "kvpolicies.hf.hf_cache(policy, model) and pass it as past_key_values"
            )
        step = owner._step
        query = kwargs.get("query")  # [B, Hq, q, D]: MPT's attention hands it over, the others are rebuilt
        if owner.needs_queries and query is None:  # once per layer, for the open rule and the score update
            query = owner._layer_query(self.layer_idx, key_states)
        new_scores = None
        if owner.eviction.scores_tokens:  # an open rule: each new token's score from what the step provides
            # [B, H, q, D] -> the rule's [..., H, D] with [...] = [B, q] -> [B, q, Hkv] -> [B, Hkv, q]
            new = NewTokens(k=key_states.transpose(1, 2), v=value_states.transpose(1, 2),
                            positions=step.positions,
                            q=query.transpose(1, 2) if owner.eviction.reads_queries else None)
            new_scores = owner.eviction.token_scores(new).to(torch.float32).transpose(1, 2)
        if self.merged:
            # A private slot of this layer in its pair's region: exact K/V, magnitude 1, visible to it only.
            keys, values = self.store._append_private(key_states, value_states, step, self.member, new_scores)
        else:
            keys, values = super().update(key_states, value_states)
            self._append_side(key_states, step, new_scores)
        if query is not None:
            owner._score_layer(self, key_states, query)
        return keys, values

    def _append_side(self, key_states: torch.Tensor, step: Any,
                     new_scores: torch.Tensor | None = None) -> None:
        """Append positions, scores (``new_scores [B, Hkv, q]``, else zeros) and validity of ``q`` new tokens
        ``[B, Hkv, q, D]``."""
        B, hkv, q_len = key_states.shape[0], key_states.shape[1], key_states.shape[2]
        new_pos = step.positions[:, None, :].expand(B, hkv, q_len)  # [B, Hkv, q]
        if new_scores is None:
            new_scores = torch.zeros(B, hkv, q_len, dtype=torch.float32, device=key_states.device)
        if self.positions is None:
            self.positions, self.scores, self.valid = new_pos.clone(), new_scores, step.valid.clone()
        else:
            self.positions = torch.cat([self.positions, new_pos], dim=-1)
            self.scores = torch.cat([self.scores, new_scores], dim=-1)
            self.valid = torch.cat([self.valid, step.valid], dim=-1)

    def _append_private(
        self, key_states: torch.Tensor, value_states: torch.Tensor, step: Any, member: int,
        new_scores: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``member``'s new tokens to this region; return the region restored for ``member``."""
        assert self.k_mag is not None and self.v_mag is not None and self.slot_mask is not None
        B, hkv, q_len = key_states.shape[0], key_states.shape[1], key_states.shape[2]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self._append_side(key_states, step, new_scores)
        ones = torch.ones(2, B, hkv, q_len, dtype=torch.float32, device=key_states.device)
        self.k_mag = torch.cat([self.k_mag, ones], dim=-1)
        self.v_mag = torch.cat([self.v_mag, ones], dim=-1)
        bit = torch.full((B, hkv, q_len), 1 << member, dtype=torch.uint8, device=key_states.device)
        self.slot_mask = torch.cat([self.slot_mask, bit], dim=-1)
        return self.restored(member)

    def restored(self, member: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This region's K/V ``[B, Hkv, N, D]`` as layer ``member`` of the pair sees them: ``direction * mag``
        (private slots have magnitude 1, so they come back exactly)."""
        assert self.k_mag is not None and self.v_mag is not None
        return merge_restore(self.keys, self.k_mag[member]), merge_restore(self.values, self.v_mag[member])

    def visible(self, member: int) -> torch.Tensor:
        """``[B, Hkv, N]`` bool: the slots layer ``member`` attends to (valid and, in a region, its bit)."""
        assert self.valid is not None and self.positions is not None
        seen = self.valid[:, None, :].expand(self.positions.shape)
        if self.slot_mask is None:
            return seen
        return seen & ((self.slot_mask & (1 << member)) != 0)

    def kept_tokens(self) -> torch.Tensor:
        """``[B]`` int64 valid tokens (a region: slots) held per sequence."""
        if self.valid is None:
            return torch.zeros(0, dtype=torch.int64)
        return self.valid.sum(-1)

    def nbytes(self) -> int:
        if not self.is_initialized or self.keys is None:
            return 0
        held = [self.keys, self.values, self.k_mag, self.v_mag, self.slot_mask]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def compact(
        self,
        budgets: torch.Tensor,
        n_sink: torch.Tensor,
        n_recent: torch.Tensor,
        priority: torch.Tensor | None = None,
    ) -> None:
        """Keep, per (sequence, KV head), the forced slots plus the top scores up to ``budgets[b]`` tokens.

        budgets, n_sink, n_recent: ``[B]`` int. The selection is ``kvkernels.topk_compact``, the op that
        kvmodels' paged cache compacts with (docs/contract.md §2.4: forced sinks and recent window, ties to
        the earlier token, NaN lowest, kept slots in original order and bit-identical); this layer only lays
        its storage out as that op's pool (:meth:`_as_pool`). Sequences at or under budget keep everything;
        the tensors shrink to the longest kept row. ``priority`` ``[B, Hkv, N]`` ranks the slots instead of
        ``scores`` (which are kept as they are), as MiniCache's joint selection of a pair does. A region's
        magnitudes and visibility move with its slots.
        """
        import kvkernels

        if self.valid is None or self.valid.shape[1] == 0:
            return
        (priority,) = self._pack(priority)
        B, H, N, _ = self.keys.shape
        dev = self.valid.device
        count = self.valid.sum(-1)  # [B]
        keep_n = torch.minimum(count, budgets.to(dev, torch.int64))  # [B]

        def per_row(t: torch.Tensor) -> torch.Tensor:  # [B] -> [B * Hkv]: each KV head is a pool sequence
            return t.to(dev, torch.int64).repeat_interleave(H)

        pool = self._as_pool()
        k, v, pos, score, *extra = pool.values()
        if priority is not None:  # rank by it (a copy: the op sorts it in place); the scores ride along
            extra, score = [score, *extra], priority.reshape(B * H, N, 1).to(torch.float32, copy=True)
        table = torch.arange(B * H, dtype=torch.int32, device=dev)[:, None]  # row r is page r
        free = torch.zeros(B * H + 1, dtype=torch.int32, device=dev)  # released pages: dropped below
        kvkernels.topk_compact(k, v, pos, score, table, per_row(count).to(torch.int32), per_row(budgets),
                               per_row(n_sink), per_row(n_recent), free, torch.zeros(1, dtype=torch.int64,
                                                                                   device=dev), extra=extra)
        new_n = int(keep_n.max()) if keep_n.numel() else 0
        self._from_pool(pool, new_n)
        self.valid = torch.arange(new_n, device=dev)[None, :] < keep_n[:, None]  # [B, new_n]

    def _pack(self, *also: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Move each sequence's valid slots to the front, in order (left padding, a decode step's new token
        behind a compacted row): the layout ``topk_compact``'s sequences have. Pure storage. ``also``:
        further ``[B, Hkv, N]`` tensors (or None), returned packed the same way."""
        assert self.valid is not None
        N = self.valid.shape[1]
        count = self.valid.sum(-1)  # [B]
        packed = torch.arange(N, device=self.valid.device)[None, :] < count[:, None]  # [B, N]
        if torch.equal(packed, self.valid):
            return list(also)
        order = torch.sort((~self.valid).to(torch.uint8), dim=-1, stable=True).indices  # [B, N] valid first

        def gather(x: torch.Tensor | None, per_token: bool = False) -> torch.Tensor | None:
            """Along the slot dim of ``[..., B, Hkv, N]`` (``[B, Hkv, N, D]`` when ``per_token``)."""
            if x is None:
                return None
            idx = order[:, None, :, None] if per_token else order[:, None, :]
            return torch.gather(x, x.dim() - 1 - per_token, idx.expand(x.shape))

        self.keys, self.values = gather(self.keys, True), gather(self.values, True)
        self.positions, self.scores, self.slot_mask = (gather(x) for x in (self.positions, self.scores,
                                                                          self.slot_mask))
        self.k_mag, self.v_mag = gather(self.k_mag), gather(self.v_mag)
        self.valid = packed
        return [gather(x) for x in also]

    def _as_pool(self) -> dict[str, torch.Tensor]:
        """This layer's per-slot tensors as a ``kvkernels`` page pool (docs/contract.md §2): each (sequence,
        KV head) row is a sequence of one page of ``N`` slots with one KV head, ``[B * Hkv, N, 1, ...]``,
        positions as int32, a region's magnitudes one tensor per member. Copies, so that an op working in
        place never writes into a tensor someone else still holds. Order: ``k v pos`` then ``score``, then
        what is present of ``k_mag[0..1] v_mag[0..1] slot_mask``."""
        B, H, N, D = self.keys.shape

        def rows(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(B * H, N, 1, *x.shape[3:])

        pool = {"k": rows(self.keys), "v": rows(self.values), "pos": rows(self.positions.to(torch.int32)),
                "score": rows(self.scores)}
        for name in ("k_mag", "v_mag"):
            mag = getattr(self, name)
            if mag is not None:
                pool[f"{name}0"], pool[f"{name}1"] = rows(mag[0]), rows(mag[1])
        if self.slot_mask is not None:
            pool["slot_mask"] = rows(self.slot_mask)
        return {k: v.clone(memory_format=torch.contiguous_format) for k, v in pool.items()}

    def _from_pool(self, pool: dict[str, torch.Tensor], n: int) -> None:
        """Take back :meth:`_as_pool`'s tensors, keeping each row's first ``n`` slots."""
        B, H = self.keys.shape[:2]

        def back(x: torch.Tensor) -> torch.Tensor:
            return x.view(B, H, x.shape[1], *x.shape[3:])[:, :, :n].contiguous()

        self.keys, self.values, self.scores = back(pool["k"]), back(pool["v"]), back(pool["score"])
        self.positions = back(pool["pos"]).to(torch.int64)
        for name in ("k_mag", "v_mag"):
            if f"{name}0" in pool:
                setattr(self, name, torch.stack([back(pool[f"{name}0"]), back(pool[f"{name}1"])]))
        if "slot_mask" in pool:
            self.slot_mask = back(pool["slot_mask"])

    # Beam search / contrastive search reorder or crop the batch; keep the side tensors in step.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("PolicyCache does not support beam search; use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PolicyCache cannot be cropped (assisted decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("PolicyCache does not support num_return_sequences > 1 or beam search")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("PolicyCache does not support batch selection")


@dataclasses.dataclass
class _StepInputs:
    valid: torch.Tensor  # [B, q] bool: which new tokens are real (not padding)
    positions: torch.Tensor  # [B, q] int64 absolute positions of the new tokens


class PolicyCache(Cache):
    """A ``transformers`` cache driven by a composed policy. Build it with :func:`hf_cache`.

    After ``generate`` (or any forward passes), :meth:`report` gives kept tokens and bytes per layer.
    """

    layers: list[PolicyLayer]  # type: ignore[assignment]  # only PolicyLayers, unlike the base class
    _step: Any  # _StepInputs of the forward in flight (set before any layer reads it)

    def __init__(
        self, policy: Any, model: torch.nn.Module, *, max_new_tokens: int | None = None, seed: int = 0
    ) -> None:
        from kvpolicies import ComposedPolicy

        if not isinstance(policy, ComposedPolicy):
            raise TypeError(
                f"policy must be a kvpolicies.ComposedPolicy (build one with kvpolicies.compose(...)), "
                f"got {type(policy).__name__}"
            )
        if policy.heads.per_head:
            raise ValueError(
                f"policy {policy.name!r}: the transformers bridge stores every KV head of a layer with one "
                f"token count, so it cannot hold head-budget policy {policy.heads.name!r}; run it on a "
                "kvmodels model (kvmodels.generate), whose HeadPagedKVCache gives each head its own pages"
            )
        if policy.precision.quantizes:
            raise ValueError(
                f"policy {policy.name!r}: precision policy {policy.precision.name!r} stores tokens as "
                "quantized rows, which the transformers bridge does not hold yet (it stores the cache's "
                f"dtype); drop {policy.precision.name!r} from the composition (issue 36 tracks quantized "
                "storage)"
            )
        self._family = _install(model)
        n = len(self._family.layers)
        super().__init__(layers=[PolicyLayer(self, i) for i in range(n)])
        self.policy = policy
        self.eviction = policy.eviction
        # Where each layer stores its tokens (MiniCache pairs share a region), as kvmodels' PagedKVCache
        # takes it from the policy.
        self.layout = policy.merge_layout(n)
        self.seed = seed
        # Seeds as kvmodels' PagedKVCache derives them (kvkernels.noise_seed / prefill_seed): the bridge and
        # kvmodels draw identical Gumbel noise for the same policy and seed.
        self._noise_seed = noise_seed(policy.seed, seed)
        self.max_new_tokens = max_new_tokens
        self.needs_queries = (self.eviction.prefill_mode is not None or self.eviction.score_mode != "none"
                              or (self.eviction.scores_tokens and self.eviction.reads_queries))
        self._fresh = True  # no forward seen yet
        self._prefilled = False  # the prompt went through
        self._compressed = False  # the prompt was compressed to the layer budgets
        self._decode_step = 0
        self._step = None
        self._next_pos: torch.Tensor | None = None
        self._seen = 0  # logical length (padded prompt + generated), what generate expects
        self._cos_sum: torch.Tensor | None = None  # [Lc, B] sum of cos-sims over prompt tokens
        self.prompt_lens: torch.Tensor | None = None
        self.plan: CompressionPlan | None = None  # the policy's plan for this batch (end of prefill)
        self.peak_bytes = 0
        self._noise: torch.Tensor | None = None  # [Lc, B, Hq, width] this decode step's Gumbel noise
        self._gumbel: torch.Generator | None = None

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

    # --- driven by the hooks -----------------------------------------------------------------------
    def _begin_forward(
        self, batch: int, q_len: int, device: torch.device, attention_mask: Any, position_ids: Any
    ) -> None:
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
        if position_ids is not None:
            positions = position_ids.to(device=device, dtype=torch.int64).expand(batch, q_len)
        elif self._next_pos is None:
            positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        else:
            positions = self._next_pos[:, None] + torch.arange(q_len, device=device)[None, :]
        if self._next_pos is None and not valid.any(-1).all():
            b = int((~valid.any(-1)).nonzero()[0, 0])
            raise ValueError(f"sequence {b} of the batch is all padding; drop it before generate")
        self._next_pos = torch.where(valid, positions, positions.new_full((), -1)).amax(-1) + 1
        self._step = _StepInputs(valid, positions)
        if self._prefilled and self.eviction.score_mode == "gumbel":
            self._draw_noise(device)
        if not self._prefilled:
            self.prompt_lens = valid.sum(-1)
            self._cos_sum = torch.zeros(len(self.layers), batch, dtype=torch.float64)

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
        lens = torch.stack([layer.kept_tokens() for layer in self.layers])  # [Lc, B] before this step
        # Slots each layer appends this step (the layout's width), as kvmodels grows its lengths.
        grow = torch.tensor(self.layout.width, dtype=lens.dtype, device=lens.device)[:, None]  # [Lc, 1]
        width = int((lens + grow).max())
        noise = torch.empty(len(self.layers), lens.shape[1], self._family.n_q_heads, width, device=device)
        self._noise = draw_gumbel_(noise, self._gumbel)

    def _end_forward(self, q_len: int) -> None:
        self._seen += q_len
        if not self._prefilled:
            self._prefilled = True
        else:
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
        """The policy's plan from the prompt statistics, then merge pairs and compress every layer
        (docs/contract.md §5)."""
        self._compressed = True
        lens = self.prompt_lens.cpu()
        cos = (self._cos_sum / lens.to(torch.float64).clamp_min(1)).to(torch.float32)
        # The same decision kvmodels' cache acts on (ComposedPolicy.plan).
        self.plan = self.policy.plan(lens, len(self.layers), LayerStats(cos_sim=cos),
                                     max_new_tokens=self.max_new_tokens or 0)
        for i, (a, b) in enumerate(self.layout.pairs):
            self._merge_pair(a, b, *self.plan.joint.row(i))
        if self.plan.schedule.prefill_compress:
            self._evict(regions=False)  # a region was compressed by its joint selection

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
        """Compact every storage layer to the plan's budgets and forced counts (``plan.storage``); the
        regions too unless ``regions=False``."""
        assert self.plan is not None
        width = self.layout.width
        for l, layer in enumerate(self.layers):
            if width[l] == 0 or (width[l] == 2 and not regions):
                continue  # the second layer of a pair holds no tokens; a region may be left alone
            layer.compact(*self.plan.storage.row(l))

    def _record_cos(self, layer_idx: int, h_in: torch.Tensor, attn_out: torch.Tensor) -> None:
        cos = residual_cos_sim(h_in, attn_out)  # [B, q]
        valid = self._step.valid
        self._cos_sum[layer_idx] += (cos * valid).sum(-1).double().cpu()

    def _layer_mask(
        self, layer: PolicyLayer, q_len: int, kind: str, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The attention mask for ``layer`` once ``q_len`` new tokens are appended.

        ``[B, 1, q, N + q]``: a bool "may attend" mask (``sdpa``), an additive float mask (``eager``), or a
        bool "masked out" mask (MPT). ``None`` when every slot is visible to a single query (no padding).
        A layer of a merged pair sees its region's shared slots and its own private slots only, which differ
        per KV head: its mask is ``[B, Hq, q, N + q]`` (query head ``h`` reads KV head ``h // G``).
        """
        valid_new = self._step.valid
        store = layer.store
        old = store.valid if store.valid is not None else valid_new[:, :0]
        n_old = old.shape[1]
        if q_len == 1 and bool(old.all()) and kind != "mpt" and not layer.merged:
            return None
        B = valid_new.shape[0]
        if layer.merged:
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
    def _layer_query(self, l: int, new_keys: torch.Tensor) -> torch.Tensor:
        """Layer ``l``'s rotated queries ``[B, Hq, q, D]`` of this forward, from its captured projections."""
        ctx = _CTX[id(self)] if id(self) in _CTX else {}
        return _rebuild_query(self._family, l, ctx, new_keys, check=not self._prefilled)

    def _score_layer(self, layer: PolicyLayer, new_keys: torch.Tensor, query: torch.Tensor) -> None:
        """The policy's attention scores of this forward's queries ``[B, Hq, q, D]`` over ``layer``."""
        fam, l = self._family, layer.layer_idx
        ctx = _CTX[id(self)] if id(self) in _CTX else {}
        scale, slopes = _scale_and_slopes(fam, l, ctx)
        if not self._prefilled:
            if self.eviction.prefill_mode is not None:
                self._prefill_scores(layer, query, new_keys, scale, slopes)
        elif self.eviction.score_mode != "none":
            self._decode_scores(layer, query, scale, slopes)

    def _prefill_scores(
        self, layer: PolicyLayer, q: torch.Tensor, k: torch.Tensor, scale: float, slopes: torch.Tensor | None
    ) -> None:
        import kvkernels

        ev = self.eviction
        source = ev.score_source_layer(layer.layer_idx)
        if source != layer.layer_idx:  # layer-wise index reuse: rank by an earlier layer's prompt scores
            layer.scores = self.layers[source].scores.clone()
            return
        for b in range(q.shape[0]):
            idx = self._step.valid[b].nonzero().squeeze(-1)  # real (unpadded) prompt tokens
            L = int(idx.numel())
            qb = q[b][:, idx].transpose(0, 1).contiguous()  # [L, Hq, D]
            kb = k[b][:, idx].transpose(0, 1).contiguous()  # [L, Hkv, D]
            kw = dict(ev.prefill_kwargs(L))
            # The in-house cache's seed for (layer, sequence), so both draw the same prefill noise.
            kw.setdefault("seed", prefill_seed(self._noise_seed, layer.layer_idx, b))
            s = kvkernels.prefill_scores(
                qb,
                kb,
                scale=scale,
                mode=ev.prefill_mode,
                window=ev.prefill_window(L),
                alibi_slopes=slopes,
                **kw,
            )  # [Hkv, L]
            s = ev.postprocess_prefill_scores(s)
            layer.scores[b][:, idx] = s.to(torch.float32)

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
        import kvkernels

        ev = self.eviction
        kw = ev.decode_kwargs(self._decode_step, self._max_new_tokens() if ev.needs_max_new_tokens else 1)
        B, hq, q_len, _ = q.shape
        store = layer.store
        N = store.keys.shape[2]
        dev = store.keys.device

        def pool(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, N, ...] -> [B, N, Hkv, ...], a copy
            return x.transpose(1, 2).contiguous()

        keys = pool(store.keys)
        score = pool(store.scores)  # updated in place by the op, then taken back
        restore = kvkernels.Restore(k_scale=pool(store.k_mag[layer.member]) if layer.merged else None,
                                    slot_mask=pool(store.visible(layer.member).to(torch.uint8)), mask_bit=1)
        scores = kvkernels.ScoreUpdate(score, ev.score_mode, decay=float(kw.get("decay", 1.0)))
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
                seen = store.valid[:, :n_seen]
                logical = (seen.long().cumsum(-1) - 1).clamp(0, self._noise.shape[-1] - 1)  # [B, n_seen]
                logical = F.pad(logical, (0, N - n_seen))
                scores = scores._replace(gumbel_noise=torch.gather(
                    self._noise[layer.layer_idx], 2, logical[:, None, :].expand(B, hq, N)
                ).contiguous())  # [B, Hq, N]
            alibi = None
            if slopes is not None:
                alibi = kvkernels.Alibi(alibi_slopes, slot_pos,
                                        self._step.positions[:, i].to(torch.int32).contiguous())
            lens = torch.full((B,), n_seen, dtype=torch.int32, device=dev)
            kvkernels.paged_decode_attention(q[:, :, i].to(keys.dtype).contiguous(), keys, keys, table, lens,
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
        if self._prefilled and not self._compressed:
            self._finish_prefill()
        tokens = torch.stack([layer.kept_tokens().cpu() for layer in self.layers])
        nbytes = torch.tensor([layer.nbytes() for layer in self.layers], dtype=torch.int64)
        total = int(nbytes.sum())
        self.peak_bytes = max(self.peak_bytes, total)
        pairs = self.layout.pairs
        budgets = None if self.plan is None else self.plan.storage.budgets.clone()
        full = 0
        if self.prompt_lens is not None:
            seen = int(self.prompt_lens.sum()) + self._decode_step * int(self.prompt_lens.numel())
            shaped = [x for x in self.layers if getattr(x, "keys", None) is not None and x.keys.numel()]
            if shaped:
                k = shaped[0].keys  # [B, Hkv, N, D]
                full = 2 * len(self.layers) * seen * k.shape[1] * k.shape[3] * k.element_size()
        return HFCacheReport(tokens, nbytes, total, self.peak_bytes, budgets, pairs, full)

    def kept_positions(self, layer_idx: int, b: int) -> torch.Tensor:
        """``[Hkv, n]`` original positions of the tokens sequence ``b`` keeps in layer ``layer_idx``.

        For a layer of a merged pair: the positions of its pair's region slots (both layers', as
        ``kvmodels.cache.PagedKVCache.layer_contents`` lists them); :meth:`layer_contents` says which ones
        this layer sees.
        """
        store = self.layers[layer_idx].store
        return store.positions[b][:, store.valid[b]]

    def layer_contents(self, layer_idx: int, b: int) -> dict[str, torch.Tensor]:
        """Kept slots of layer ``layer_idx``, sequence ``b`` in slot order (``PagedKVCache.layer_contents``).

        Returns ``k``/``v`` ``[n, Hkv, D]`` (a merged layer's restored through its own magnitudes: what it
        attends over), ``pos`` ``[n, Hkv]`` int64 and ``score`` ``[n, Hkv]`` float32; for a layer of a merged
        pair the slots are its region's, plus ``visible`` ``[n, Hkv]`` bool (the slots this layer sees).
        """
        layer = self.layers[layer_idx]
        store = layer.store
        keys, values = store.restored(layer.member) if layer.merged else (store.keys, store.values)
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


def _scale_and_slopes(fam: _Family, l: int, ctx: dict[str, Any]) -> tuple[float, torch.Tensor | None]:
    attn = fam.attns[l]
    if fam.kind == "mpt":
        return float(attn.softmax_scale), ctx.get("slopes")
    if fam.kind == "gptj" and hasattr(attn, "scale_attn"):  # GPT-J before transformers 5.24
        return 1.0 / float(attn.scale_attn), None
    return float(attn.scaling), None


def _rebuild_query(
    fam: _Family, l: int, ctx: dict[str, Any], new_keys: torch.Tensor, check: bool
) -> torch.Tensor:
    """The rotated queries ``[B, Hq, q, D]`` of layer ``l`` from its captured projection outputs."""
    attn = fam.attns[l]
    q_out, k_out = ctx.pop(("q", l), None), ctx.pop(("k", l), None)
    if q_out is None:
        raise RuntimeError(
            f"layer {l}: the query projection was not captured; was the model called with "
            "this cache outside its forward?"
        )
    if fam.kind == "gptj":
        rebuild = functools.partial(_gptj_rope, attn, ctx=ctx)
        q, k = rebuild(q_out), (rebuild(k_out) if check else None)
    else:
        q = _llama_rope(attn, q_out, "q_norm", fam.n_q_heads, ctx)
        k = _llama_rope(attn, k_out, "k_norm", fam.n_kv_heads, ctx) if check else None
    # The queries are rebuilt outside the model's forward; prove the recipe on the keys it cached.
    if check and (
        k is None or k.shape != new_keys.shape or not torch.allclose(k, new_keys, rtol=1e-4, atol=1e-5)
    ):
        raise UnsupportedModelError(
            f"{type(attn).__name__} (layer {l}) computes its keys differently from the Llama/GPT-J recipe "
            "the bridge uses to rebuild queries for attention-mass scores; use a policy without attention "
            "scores (window, streaming, full) or the kvmodels implementation"
        )
    return q


# ----------------------------------------------------------------------------------------
# Hooks (installed once per model, inert unless the call carries a PolicyCache)
# ----------------------------------------------------------------------------------------
_CTX: dict[int, dict[str, Any]] = {}  # id(cache) -> per-forward captures (queries, rotary inputs, slopes)
_ACTIVE: list[PolicyCache] = []  # the cache of the forward now running (forwards do not nest)


# What forward passes call the cache: ``cache`` from transformers 5.24 on (``past_key_values`` is deprecated
# there), ``past_key_values`` before; MPT's blocks hand it to their attention as ``layer_past``.
_CACHE_NAMES = ("cache", "past_key_values", "layer_past")


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword this model's ``generate`` takes a cache by (``cache`` from transformers 5.24 on)."""
    params = inspect.signature(model.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_from(kwargs: dict[str, Any]) -> PolicyCache | None:
    for name in _CACHE_NAMES:
        c = kwargs.get(name)
        if isinstance(c, PolicyCache):
            return c
    return None


def _base_pre(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    cache = _cache_from(kwargs)
    if cache is None:
        return
    if kwargs.get("use_cache") is False:
        # generate then re-feeds the whole sequence every step and the cache would hold it many times over.
        raise ValueError(
            "a PolicyCache needs use_cache=True; pass generate(..., use_cache=True) (MPT configs "
            "default to use_cache=False)"
        )
    x = kwargs.get("input_ids", args[0] if args else None)
    if x is None:
        x = kwargs["inputs_embeds"]
    batch, q_len = x.shape[0], x.shape[1]
    cache._begin_forward(batch, q_len, x.device, kwargs.get("attention_mask"), kwargs.get("position_ids"))
    _CTX[id(cache)] = {"q_len": q_len}
    _ACTIVE.append(cache)


def _base_post(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    cache = _cache_from(kwargs)
    if cache is None:
        return
    ctx = _CTX.pop(id(cache), {})
    if _ACTIVE and _ACTIVE[-1] is cache:
        _ACTIVE.pop()
    cache._end_forward(ctx.get("q_len", 0))


def _layer_pre(l: int, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    if not _ACTIVE:
        return
    cache = _ACTIVE[-1]
    if not cache._prefilled and cache.eviction is not None:
        h = kwargs.get("hidden_states", args[0] if args else None)
        _CTX[id(cache)][("h_in", l)] = h


def _attn_pre(
    fam: _Family, l: int, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    cache = _cache_from(kwargs)
    if cache is None:
        return None
    ctx = _CTX[id(cache)]
    ctx["position_embeddings"] = kwargs.get("position_embeddings")
    ctx["position_ids"] = kwargs.get("position_ids")
    if cache._prefilled and fam.kind != "mpt":
        layer = cache.layers[l]
        # GPT-J before transformers 5.24 ran its own eager attention on a float32 additive mask; from 5.24
        # on it goes through the attention interface like Llama.
        legacy = fam.kind == "gptj" and hasattr(module, "scale_attn")
        kind = "eager" if legacy else module.config._attn_implementation
        dtype = torch.float32 if legacy else args[0].dtype if args else kwargs["hidden_states"].dtype
        kwargs["attention_mask"] = cache._layer_mask(layer, ctx["q_len"], kind, dtype)
    return args, kwargs


def _attn_post(l: int, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    cache = _cache_from(kwargs)
    if cache is None or cache._prefilled:
        return
    h_in = _CTX[id(cache)].pop(("h_in", l), None)
    if h_in is not None:
        cache._record_cos(l, h_in, output[0])


def _proj_hook(which: str, l: int, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
    if _ACTIVE and _ACTIVE[-1].needs_queries:
        _CTX[id(_ACTIVE[-1])][(which, l)] = output


def _mpt_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_bias: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MPT attention over a compacted cache: ALiBi from each slot's original position.

    The cache comes third, by position or by name (``cache`` from transformers 5.24 on, ``past_key_values``
    before), then ``attention_mask``."""
    if args:
        found = args[0]
    else:
        found = kwargs.pop("cache", None)
        found = kwargs.pop("past_key_values", found)
    attention_mask = args[1] if len(args) > 1 else kwargs.pop("attention_mask", None)
    if not isinstance(found, PolicyCache):  # both versions take the cache third, the mask fourth
        return self._kvp_forward(hidden_states, position_bias, found, attention_mask, *args[2:], **kwargs)
    cache = found
    B, q_len = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (t.reshape(B, q_len, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
    # position_bias is [H, 1, S] = slope * (j - (S - 1)): the slope is minus its second-to-last entry.
    slopes = -position_bias[:, 0, -2].float()  # [H]
    ctx = _CTX[id(cache)]
    ctx["slopes"] = slopes
    layer = cache.layers[self.layer_idx]
    mask = cache._layer_mask(layer, q_len, "mpt", q.dtype)  # [B, 1, q, N + q], True = masked out
    # The layer's own update: Cache.update forwards extra keywords only from transformers 5.3 on.
    k, v = layer.update(k, v, query=q)
    scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale  # [B, H, q, N + q]
    # Bias relative to the last query of the chunk (a per-row constant away from the true distance, which
    # softmax ignores) so that an uncompressed cache reproduces the stock module's numbers.
    rel = layer.store.positions[:, :, None, :] - cache._step.positions[:, -1, None, None, None]  # [B,H,1,N+q]
    scores = scores + slopes.view(1, -1, 1, 1) * rel.to(slopes.dtype)
    scores = scores.masked_fill(mask, torch.finfo(q.dtype).min)
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    weights = F.dropout(weights, p=self.attn_dropout_p, training=self.training)
    ctx_states = torch.matmul(weights, v).permute(0, 2, 1, 3).reshape(B, q_len, -1)
    return self.out_proj(ctx_states), weights


def _install(model: torch.nn.Module) -> _Family:
    """Install the bridge hooks on ``model`` once; later calls return the cached family."""
    fam = getattr(model, "_kvpolicies_family", None)
    if fam is not None:
        return fam
    fam = _family(model)
    handles = [
        fam.base.register_forward_pre_hook(_base_pre, with_kwargs=True),
        fam.base.register_forward_hook(_base_post, with_kwargs=True),
    ]
    for l, (layer, attn) in enumerate(zip(fam.layers, fam.attns)):
        handles.append(layer.register_forward_pre_hook(functools.partial(_layer_pre, l), with_kwargs=True))
        handles.append(attn.register_forward_pre_hook(functools.partial(_attn_pre, fam, l), with_kwargs=True))
        handles.append(attn.register_forward_hook(functools.partial(_attn_post, l), with_kwargs=True))
        if fam.kind == "mpt":
            attn._kvp_forward = attn.forward
            attn.forward = types.MethodType(_mpt_forward, attn)
        else:
            handles.append(attn.q_proj.register_forward_hook(functools.partial(_proj_hook, "q", l)))
            handles.append(attn.k_proj.register_forward_hook(functools.partial(_proj_hook, "k", l)))
    model._kvpolicies_family = fam
    model._kvpolicies_handles = handles
    model._kvpolicies_generate = model.__dict__.get("generate")  # an instance override to restore, if any
    model.generate = _length_aware(model, model.generate)
    return fam


def _new_tokens(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> int | None:
    """How many tokens this ``generate`` call may produce, as transformers resolves it: ``max_new_tokens``
    (keyword, then the ``generation_config`` given, then the model's), else ``max_length`` minus the
    prompt width."""
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    n = kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None))
    if n is None:
        max_length = kwargs.get("max_length", getattr(gc, "max_length", None))
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if max_length is not None and isinstance(ids, torch.Tensor):
            n = int(max_length) - ids.shape[-1]
    return None if n is None else int(n)


def _length_aware(model: torch.nn.Module, generate: Any) -> Any:
    """``model.generate`` that tells a :class:`PolicyCache` passed to it the generation length, so
    ``hf_cache(policy, model)`` needs no ``max_new_tokens`` (Keyformer's schedule and the layer-budget cap
    read it)."""

    @functools.wraps(generate)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        cache = _cache_from(kwargs)
        if cache is not None and cache.max_new_tokens is None:
            cache.max_new_tokens = _new_tokens(model, args, kwargs)
        return generate(*args, **kwargs)

    return wrapped


def _uninstall(model: torch.nn.Module) -> None:
    fam = getattr(model, "_kvpolicies_family", None)
    if fam is None:
        return
    for h in model._kvpolicies_handles:
        h.remove()
    if model._kvpolicies_generate is None:
        del model.generate
    else:
        model.generate = model._kvpolicies_generate
    del model._kvpolicies_generate
    if fam.kind == "mpt":
        for attn in fam.attns:
            del attn.forward
            del attn._kvp_forward
    del model._kvpolicies_family
    del model._kvpolicies_handles


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------
def hf_cache(
    policy: Any, model: torch.nn.Module, *, max_new_tokens: int | None = None, seed: int = 0
) -> PolicyCache:
    """A fresh ``transformers`` cache that ``policy`` drives, for one ``generate`` call on ``model``.

    Parameters
    ----------
    policy : ComposedPolicy
        From ``kvpolicies.compose(...)``.
    model : transformers.PreTrainedModel
        A decoder-only causal LM: Llama-style attention (``sdpa`` or ``eager``), GPT-J or MPT.
    max_new_tokens : int, optional
        The generation length. Not needed with ``model.generate``, which tells the cache the length it
        resolves (its ``max_new_tokens`` / ``max_length``); pass it only when driving the model by hand with
        a policy whose decode schedule depends on it (Keyformer's temperature).
    seed : int
        Seeds, with ``policy.seed``, the Gumbel noise of stochastic scores (Keyformer), exactly as
        ``kvmodels.generate(..., seed=seed)`` does, so both keep the same tokens.

    Returns
    -------
    PolicyCache
        Pass it as ``model.generate(..., past_key_values=cache)``; one cache per generate call.

    Raises
    ------
    UnsupportedModelError
        For model families or attention implementations the bridge cannot drive, naming what to change.
    """
    return PolicyCache(policy, model, max_new_tokens=max_new_tokens, seed=seed)


@contextlib.contextmanager
def compressed(model: torch.nn.Module, policy: Any, *, seed: int = 0) -> Iterator[list[PolicyCache]]:
    """Within the block, ``model.generate`` uses a fresh :class:`PolicyCache` per call.

    Yields the list of caches created so far (the last one is the latest call's), for ``report()``.
    The hooks and the patched ``generate`` are removed on exit.
    """
    caches: list[PolicyCache] = []
    installed_here = getattr(model, "_kvpolicies_family", None) is None
    _install(model)
    original = model.generate  # the length-aware generate _install put on the instance

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if all(kwargs.get(name) is None for name in _CACHE_NAMES):
            cache = hf_cache(policy, model, seed=seed)
            kwargs[_cache_kwarg(model)] = cache
            kwargs.setdefault("use_cache", True)
            caches.append(cache)
        return original(*args, **kwargs)

    model.generate = generate
    try:
        yield caches
    finally:
        model.generate = original
        if installed_here:
            _uninstall(model)

