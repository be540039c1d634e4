"""The transformers bridge's storage: one :class:`PolicyLayer` per model layer, compacted in place.

A layer holds dense ``[B, Hkv, N, D]`` K/V (what transformers' attention reads), or with ``kivi`` kvmodels'
packed quantized rows (:mod:`kvpolicies.hf.rows`; with KIVI's residual or MiKV, packed tokens before tokens
in the cache's dtype), and, per slot, what the kvkernels ops need beside
them; to compact it lays itself out as a ``kvkernels`` page pool and calls
``topk_compact``, the op kvmodels' paged cache compacts with. What to keep is not decided here: budgets and
forced counts come from the policy's plan (``kvpolicies.plan``), through the cache.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer

from kvkernels import merge_restore, topk_compact
from kvkernels.quant import key_channel_scale

if TYPE_CHECKING:
    from kvpolicies.hf.cache import PolicyCache
    from kvpolicies.hf.rows import PackedRows


def _front(x: torch.Tensor, keep: torch.Tensor, width: int) -> torch.Tensor:
    """``x [B, Hkv, N, ...]``'s slots where ``keep [B, Hkv, N]``, moved to the front of each row in order and
    cut to ``width`` slots (the rest: whatever followed)."""
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
    if x.dim() > 3:
        order = order[..., None].expand(*order.shape, x.shape[-1])
    return torch.gather(x, 2, order)


@dataclasses.dataclass
class Step:
    """The tokens of the forward in flight."""

    valid: torch.Tensor  # [B, q] bool: which new tokens are real (not padding)
    positions: torch.Tensor  # [B, q] int64 absolute positions of the new tokens


class PolicyLayer(DynamicLayer):
    """One model layer's compacted cache.

    keys, values: ``[B, Hkv, N, D]``; ``positions``: ``[B, Hkv, N]`` int64 original absolute positions;
    ``scores``: ``[B, Hkv, N]`` float32; ``valid``: ``[B, N]`` bool (the same for every head of a layer), or
    ``[B, Hkv, N]`` once a head-budget policy compacted the layer (each KV head its own count; a row is padded
    to the layer's longest head while a forward reads it, and held ragged between forwards, :meth:`hold`;
    :meth:`head_valid` reads either as ``[B, Hkv, N]``).

    After a MiniCache merge, layer ``a`` of a pair holds the pair's *region* (docs/contract.md §5.1) in
    those tensors: a shared slot holds the unit direction, a private slot the original K/V. It also holds
    ``k_mag``, ``v_mag``: ``[2, B, Hkv, N]`` float32 per-slot magnitudes (member 0 = ``a``, 1 = ``b``; 1.0 on
    private slots) and ``slot_mask``: ``[B, Hkv, N]`` uint8 (bit 1: visible to ``a``, bit 2: to ``b``).
    Layer ``b`` holds empty tensors and reads ``a``'s region (``store``) as ``member`` 1.

    With quantized ``rows`` (``kivi(residual=0)``, :mod:`kvpolicies.hf.rows`) ``keys`` and ``values`` are
    packed ``uint8`` rows ``[B, Hkv, N, W]`` (codes, scales and zero points: compaction moves them like any
    slot tensor, bit for bit) and :meth:`dense` reads them back; with ``channel_scale`` the keys are stored
    over ``key_scale [B, Hkv, D]`` float32, each sequence's factors from its prompt. With KIVI's residual or
    MiKV (``rows.precision``) a layer is two parts: ``low_k``, ``low_v`` ``[B, Hkv, Nq, W]`` packed rows (the
    first ``Nq`` slots of ``positions``, ``scores`` and ``valid``: KIVI's older tokens, MiKV's evicted ones)
    and ``keys``, ``values`` ``[B, Hkv, Nf, D]`` in the cache's dtype (the other slots: KIVI's newest, MiKV's
    kept); :meth:`pack_slots` moves tokens from the second part to the first (the split after the
    prompt, then KIVI's aging or MiKV's demotion).
    """

    def __init__(self, owner: PolicyCache, layer_idx: int, rows: PackedRows | None = None) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)
        self.layer_idx = layer_idx
        self.rows = rows
        self.key_scale: torch.Tensor | None = None
        self.low_k: torch.Tensor | None = None  # two parts: the packed part's rows
        self.low_v: torch.Tensor | None = None
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None  # head budgets: K/V held ragged (hold)
        self.kv_dtype: torch.dtype | None = None  # the K/V's dtype (the first update's)
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

    def hold(self) -> None:
        """Between forwards, a layer whose KV heads keep different counts (head budgets) holds its K/V (or
        packed rows) ragged, each (sequence, KV head) its own valid slots one after another, ``[n, D]``,
        instead of padded to its longest head; ``keys`` / ``values`` are then empty ``[B, Hkv, 0, D]``
        placeholders until :meth:`unhold` pads them back for the next forward or compaction."""
        if self._held is None and self.per_head and self.keys is not None:
            valid = self.valid
            self._held = (self.keys[valid], self.values[valid])
            self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]

    def unhold(self) -> None:
        """Pad the ragged K/V of :meth:`hold` back to ``[B, Hkv, N, D]`` (zeros past each head's count)."""
        if self._held is not None:
            self.keys, self.values = self._padded()
            self._held = None

    def _padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._held is not None and self.valid is not None
        out = []
        for flat in self._held:
            x = flat.new_zeros(*self.valid.shape, flat.shape[-1])
            x[self.valid] = flat
            out.append(x)
        return out[0], out[1]

    @property
    def tiered(self) -> bool:
        """Whether this layer holds two parts (KIVI's residual, MiKV): packed rows beside unquantized ones."""
        return self.rows is not None and self.rows.precision is not None

    def parts(self) -> tuple[torch.Tensor, ...]:
        """A copy of what this layer holds per slot (K/V, positions, scores, validity), for
        :meth:`restore_parts` (MiKV's split: the whole prompt again after the eviction chose)."""
        return tuple(x.clone() for x in (self.keys, self.values, self.positions, self.scores, self.valid))

    def restore_parts(self, parts: tuple[torch.Tensor, ...]) -> None:
        self.keys, self.values, self.positions, self.scores, self.valid = parts

    def evict_packed(self, budgets: torch.Tensor, n_sink: torch.Tensor, n_recent: torch.Tensor,
                     share: Any = None) -> None:
        """KIVI's residual under eviction while decoding (kvmodels' ``SideRegion.evict``): the packed part
        alone is compacted (:meth:`compact`) to ``budgets [B]`` slots with forced ``n_sink`` / ``n_recent``
        (0 keeps none); the tokens in the cache's dtype stay whole. ``share``: the eviction policy's
        ``eviction_scores``, applied to the packed part's scores first (its heads then rank alike)."""
        assert self.tiered and self.low_k is not None
        nq = self.low_k.shape[2]
        rest = (self.keys, self.values, self.positions[..., nq:], self.scores[..., nq:], self.valid[:, nq:])
        self.keys, self.values, self.low_k, self.low_v = self.low_k, self.low_v, None, None
        self.positions, self.scores, self.valid = (x[..., :nq]
                                                   for x in (self.positions, self.scores, self.valid))
        if share is not None:
            self.scores = share(self.scores, head_dim=1).clone()
        self.compact(budgets.clamp_min(1), n_sink, n_recent)  # a row keeping none: cleared below
        self.valid &= (budgets > 0).to(self.valid.device)[:, None]
        self.low_k, self.low_v, self.keys, self.values = self.keys, self.values, rest[0], rest[1]
        self.positions, self.scores, self.valid = (torch.cat([x, r], dim=-1) for x, r in zip(
            (self.positions, self.scores, self.valid), rest[2:], strict=True))

    @property
    def merged(self) -> bool:
        """Whether this layer reads a merged pair's region."""
        return self.store.slot_mask is not None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' call: the cache scores and stores the new tokens (MPT's attention hands its queries
        over as ``query``); returns the K/V this layer attends over."""
        owner = self._owner()
        assert owner is not None
        return owner.append_step(self, key_states, value_states, kwargs.get("query"))

    def append(
        self, key_states: torch.Tensor, value_states: torch.Tensor, step: Step,
        new_scores: torch.Tensor | None = None, exact: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``q`` new tokens ``[B, Hkv, q, D]`` (scores ``[B, Hkv, q]``, else zeros); return what this
        layer attends over. A layer of a merged pair appends private slots to its pair's region: exact K/V,
        magnitude 1, visible to it only. Quantized rows store the tokens packed and return the layer
        dequantized, the new tokens exact when ``exact`` (else as stored)."""
        self.kv_dtype = self.kv_dtype or key_states.dtype
        self.unhold()
        if self.merged:
            return self.store._append_private(key_states, value_states, step, self.member, new_scores)
        if self.tiered and self.rows.channel_scale and self.key_scale is None:  # the prompt's factors
            self.key_scale = self._channel_scale(key_states, step)
        if self.rows is None or self.tiered:  # the new tokens in the cache's dtype
            keys, values = super().update(key_states, value_states)
            self._append_side(key_states, step, new_scores)
            return (keys, values) if self.low_k is None else self.dense()
        if not self.is_initialized:  # the prompt: each sequence's channel factors from its real tokens
            self.is_initialized, self.device = True, key_states.device
            B, H = key_states.shape[:2]
            self.keys = self.values = key_states.new_empty(B, H, 0, self.rows.width, dtype=torch.uint8)
            if self.rows.channel_scale:
                self.key_scale = self._channel_scale(key_states, step)
        old_k, old_v = self.dense()
        new_k, new_v = self._encoded(key_states, value_states)
        self.keys, self.values = (torch.cat([x, new], dim=-2) for x, new in ((self.keys, new_k),
                                                                           (self.values, new_v)))
        self._append_side(key_states, step, new_scores)
        if not exact:
            key_states, value_states = self._decoded(new_k, new_v)
        return torch.cat([old_k, key_states], dim=-2), torch.cat([old_v, value_states], dim=-2)

    @staticmethod
    def _channel_scale(key_states: torch.Tensor, step: Step) -> torch.Tensor:
        """``[B, Hkv, D]``: each sequence's channel factors from its prompt's real tokens."""
        return torch.stack([key_channel_scale(k[:, ok].transpose(0, 1))
                            for k, ok in zip(key_states, step.valid, strict=True)])

    def _encoded(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed rows of K/V ``[B, Hkv, n, D]``: keys over their channel factors (a power of two: exact)."""
        assert self.rows is not None
        stored = k if self.key_scale is None else k / self.key_scale[:, :, None].to(k.dtype)
        return self.rows.encode(stored), self.rows.encode(v)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[B, Hkv, N, D]`` in the cache's dtype: as held, or the packed rows dequantized (rotated back,
        keys times their channel factors): what kvmodels reads of the same rows. With two parts the packed
        tokens, then the others as held."""
        if self._held is not None:  # held ragged (head budgets): padded for the reader, not kept
            keys, values = self._padded()
            return (keys, values) if self.rows is None else self._decoded(keys, values)
        if self.rows is None or self.keys is None:
            return self.keys, self.values
        if self.tiered:
            if self.low_k is None:
                return self.keys, self.values
            low_k, low_v = self._decoded(self.low_k, self.low_v)
            return torch.cat([low_k, self.keys], dim=-2), torch.cat([low_v, self.values], dim=-2)
        return self._decoded(self.keys, self.values)

    def pack_slots(self, move: torch.Tensor) -> None:
        """Two parts: the slots ``move [B, Hkv, Nf]`` of the part in the cache's dtype (each KV head as
        many per sequence) join the packed rows, encoded as kvmodels encodes them; both parts are then packed
        to the front of each row, in position order (packed tokens are older than the others)."""
        assert self.tiered and self.keys is not None
        nq = 0 if self.low_k is None else self.low_k.shape[2]
        valid = self.head_valid()
        low_valid, new_valid = valid[..., :nq], valid[..., nq:]
        stay, into_low = new_valid & ~move, torch.cat([low_valid, move], dim=-1)
        width_low, width_new = int(into_low.sum(-1).max()), int(stay.sum(-1).max())
        enc_k, enc_v = self._encoded(self.keys, self.values)
        if self.low_k is not None:
            enc_k, enc_v = torch.cat([self.low_k, enc_k], dim=-2), torch.cat([self.low_v, enc_v], dim=-2)
        self.low_k, self.low_v = _front(enc_k, into_low, width_low), _front(enc_v, into_low, width_low)
        self.keys, self.values = _front(self.keys, stay, width_new), _front(self.values, stay, width_new)
        self.positions, self.scores = (torch.cat([_front(x, into_low, width_low),
                                                  _front(x[..., nq:], stay, width_new)], dim=-1)
                                       for x in (self.positions, self.scores))
        counts = torch.cat([into_low.sum(-1, keepdim=True), stay.sum(-1, keepdim=True)], dim=-1)  # [B, H, 2]
        if bool((counts != counts[:, :1]).any()):
            raise ValueError("two parts need every KV head of a sequence to hold as many tokens in each")
        slots = torch.arange(width_low + width_new, device=valid.device)
        self.valid = torch.where(slots < width_low, slots < counts[:, 0, :1],
                                 slots - width_low < counts[:, 0, 1:])  # [B, N]

    def _decoded(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.rows is not None and self.kv_dtype is not None
        keys = self.rows.decode(k, self.kv_dtype)
        if self.key_scale is not None:
            keys = keys * self.key_scale[:, :, None].to(keys.dtype)
        return keys, self.rows.decode(v, self.kv_dtype)

    def _append_side(self, key_states: torch.Tensor, step: Step,
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
            new_valid = step.valid if self.valid.dim() == 2 else step.valid[:, None, :].expand(B, hkv, q_len)
            self.valid = torch.cat([self.valid, new_valid], dim=-1)

    def _append_private(
        self, key_states: torch.Tensor, value_states: torch.Tensor, step: Step, member: int,
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

    def head_valid(self) -> torch.Tensor:
        """``[B, Hkv, N]`` bool: each KV head's valid slots (``valid`` as it is, or expanded to the heads)."""
        assert self.valid is not None and self.positions is not None
        return self.valid if self.valid.dim() == 3 else self.valid[:, None, :].expand(self.positions.shape)

    @property
    def per_head(self) -> bool:
        """Whether the KV heads of this layer may hold different counts (``valid`` is ``[B, Hkv, N]``)."""
        return self.valid is not None and self.valid.dim() == 3

    def visible(self, member: int) -> torch.Tensor:
        """``[B, Hkv, N]`` bool: the slots layer ``member`` attends to (valid and, in a region, its bit)."""
        seen = self.head_valid()
        if self.slot_mask is None:
            return seen
        return seen & ((self.slot_mask & (1 << member)) != 0)

    def head_tokens(self) -> torch.Tensor:
        """``[B, Hkv]`` int64 valid tokens (a region: slots) each KV head holds per sequence."""
        if self.valid is None:
            return torch.zeros(0, 0, dtype=torch.int64)
        return self.head_valid().sum(-1)

    def nbytes(self) -> int:
        if not self.is_initialized or self.keys is None:
            return 0
        held = [self.keys, self.values, self.low_k, self.low_v, self.k_mag, self.v_mag, self.slot_mask,
                self.key_scale, *(self._held or ())]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def compact(
        self,
        budgets: torch.Tensor,
        n_sink: torch.Tensor,
        n_recent: torch.Tensor,
        priority: torch.Tensor | None = None,
    ) -> None:
        """Keep, per (sequence, KV head), the forced slots plus the top scores up to ``budgets[b]`` tokens.

        budgets, n_sink, n_recent: ``[B]`` int, or ``[B, Hkv]`` (a head-budget policy's per-head budgets, the
        plan's ``rows``; the layer then holds ``valid [B, Hkv, N]``, padded to its longest head). The
        selection is ``kvkernels.topk_compact``, the op that kvmodels' paged cache compacts with
        (docs/contract.md §2.4: forced sinks and recent window, ties to the earlier token, NaN lowest, kept
        slots in original order and bit-identical); this layer only lays its storage out as that op's pool
        (:meth:`_as_pool`). Sequences at or under budget keep everything; the tensors shrink to the longest
        kept row. ``priority`` ``[B, Hkv, N]`` ranks the slots instead of ``scores`` (which are kept as they
        are), as MiniCache's joint selection of a pair does. A region's magnitudes and visibility move with
        its slots.
        """
        if self.valid is None or self.valid.shape[-1] == 0:
            return
        assert self.low_k is None, "a layer is compacted before it is split in two parts"
        self.unhold()
        (priority,) = self._pack(priority)
        B, H, N, _ = self.keys.shape
        dev = self.valid.device
        per_head = budgets.dim() == 2 or self.per_head

        def per_row(t: torch.Tensor) -> torch.Tensor:  # [B] or [B, Hkv] -> [B * Hkv]: a KV head, a sequence
            t = t.to(dev, torch.int64)
            return (t if t.dim() == 2 else t[:, None].expand(B, H)).reshape(B * H).contiguous()

        count = self.head_valid().sum(-1).reshape(B * H)  # [B * Hkv]
        keep_n = torch.minimum(count, per_row(budgets)).view(B, H)

        pool = self._as_pool()
        k, v, pos, score, *extra = pool.values()
        if priority is not None:  # rank by it (a copy: the op sorts it in place); the scores ride along
            extra, score = [score, *extra], priority.reshape(B * H, N, 1).to(torch.float32, copy=True)
        table = torch.arange(B * H, dtype=torch.int32, device=dev)[:, None]  # row r is page r
        free = torch.zeros(B * H + 1, dtype=torch.int32, device=dev)  # released pages: dropped below
        topk_compact(k, v, pos, score, table, count.to(torch.int32), per_row(budgets),
                     per_row(n_sink), per_row(n_recent), free, torch.zeros(1, dtype=torch.int64, device=dev),
                     extra=extra)
        new_n = int(keep_n.max()) if keep_n.numel() else 0
        self._from_pool(pool, new_n)
        valid = torch.arange(new_n, device=dev) < keep_n[..., None]  # [B, Hkv, new_n]
        self.valid = valid if per_head else valid[:, 0]

    def _pack(self, *also: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Move each sequence's valid slots to the front, in order (left padding, a decode step's new token
        behind a compacted row): the layout ``topk_compact``'s sequences have. Pure storage. ``also``:
        further ``[B, Hkv, N]`` tensors (or None), returned packed the same way."""
        valid = self.head_valid()  # [B, Hkv, N]
        packed = torch.arange(valid.shape[-1], device=valid.device) < valid.sum(-1, keepdim=True)
        if torch.equal(packed, valid):
            return list(also)
        order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices  # [B, Hkv, N] valid first

        def gather(x: torch.Tensor | None, per_token: bool = False) -> torch.Tensor | None:
            """Along the slot dim of ``[..., B, Hkv, N]`` (``[B, Hkv, N, D]`` when ``per_token``)."""
            if x is None:
                return None
            idx = order[..., None] if per_token else order
            return torch.gather(x, x.dim() - 1 - per_token, idx.expand(x.shape))

        self.keys, self.values = gather(self.keys, True), gather(self.values, True)
        self.positions, self.scores, self.slot_mask = (gather(x) for x in (self.positions, self.scores,
                                                                          self.slot_mask))
        self.k_mag, self.v_mag = gather(self.k_mag), gather(self.v_mag)
        self.valid = packed if self.per_head else packed[:, 0]
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
