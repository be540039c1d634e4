"""The bridge's report and inspection: :class:`HFCacheReport`, what ``PolicyCache.report()`` returns, and
:class:`InspectSteps`, the part of :class:`~kvpolicies.hf.cache.PolicyCache` that reads what the cache holds
(mixed into it as kvmodels' ``InspectSteps`` is into its paged cache): ``report``, ``kept_positions`` and,
token by token, ``head_contents`` / ``layer_contents`` (for tests and debugging)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvpolicies.hf.layer import PolicyLayer
    from kvpolicies.hf.models import Family
    from kvpolicies.hf.rows import PackedRows
    from kvpolicies.plan import CompressionPlan, MergeLayout


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
        ``head_budgets`` ``[Lc, B, Hkv]`` the plan's split). Between forwards such a layer holds each head's
        tokens ragged (``PolicyLayer.hold``): ``bytes_per_layer`` counts the heads' tokens, no padding (and no
        page rounding, unlike kvmodels' per-head pages); ``peak_bytes`` counts the layer a forward pads.
    rows, quantized: as ``kvmodels.cache.CacheReport``: how a stored row holds a token (empty: the cache's
        dtype; else the packed format and its bytes per row) and whether rows are quantized. Quantized
        (``kivi``), ``bytes_per_layer`` counts the packed rows (codes, scales and zero points; with KIVI's
        residual, beside the newest tokens in the cache's dtype)
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


class InspectSteps:
    """What the cache holds, as an :class:`HFCacheReport` and token by token. A part of
    :class:`~kvpolicies.hf.cache.PolicyCache`: it reads the cache's attributes (annotated here)."""

    layers: list[PolicyLayer]
    policy: Any
    layout: MergeLayout
    plan: CompressionPlan | None
    rows: PackedRows | None
    _family: Family
    prefilled: bool
    _compressed: bool
    peak_bytes: int
    prompt_lens: torch.Tensor | None
    _seen_tokens: torch.Tensor

    if TYPE_CHECKING:
        def _finish_prefill(self) -> None: ...  # the cache's lifecycle (kvpolicies.hf.cache)

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
