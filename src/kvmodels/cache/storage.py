"""How a pool row holds one token of one KV head: in the cache's dtype, or as a packed quantized row.

The precision policy (``kvpolicies.precision``) decides how many bits a kept token costs; the cache asks
:func:`row_storage` for the matching storage and then never branches on it: the pool allocates
``[P + 1, S, Hkv, width]`` of ``page_dtype``, every write goes through :meth:`encode`, every read of stored
rows through :meth:`decode`, and the decode step's attention through :meth:`attention`. Eviction moves
rows of either kind unchanged (``topk_compact`` / ``topk_evict`` move packed ``uint8`` rows like float
ones), so a kept token stays bit-identical to what was written.

- :class:`NativeRows`: ``[D]`` in the cache's dtype (``native``, the default).
- :class:`PackedRows`: ``kvkernels.quant`` packed rows (``codes | scale | zero``, ``QuantFormat.row_bytes``
  bytes; ``kivi(bits, group, residual=0)``), written by ``kvkernels.quant.quantize_rows`` and attended by
  ``kvkernels.quant_attention.quant_decode_attention``, which dequantizes in registers. With a precision
  policy's ``rotate=True`` the rows are stored Hadamard-rotated: :meth:`encode` / :meth:`decode` rotate on
  the way in and out, and the attention takes the queries through :meth:`queries` and its output through
  :meth:`outputs` (the two-format decode too), so no caller sees the rotated basis.
"""

from __future__ import annotations

import torch

from kvkernels.paged_attention import paged_decode_attention
from kvkernels.quant import QuantFormat, decode_rows, encode_rows, hadamard_rotation, rotate
from kvkernels.quant_attention import quant_decode_attention
from kvpolicies.base import NATIVE_BITS


class NativeRows:
    """Rows in the cache's dtype: what is written is what is stored."""

    quantized = False
    bits = NATIVE_BITS  # the precision policy's name for "the cache's dtype"
    fmt: QuantFormat | None = None  # no quantization format (kvkernels.quant_attention.Region: float rows)
    rotation: torch.Tensor | None = None  # rows are stored as they come

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.head_dim, self.dtype = head_dim, dtype
        self.page_dtype, self.width = dtype, head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row (K or V of one token of one KV head)."""
        return self.width * torch.empty(0, dtype=self.page_dtype).element_size()

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} rows ({self.row_bytes} B per K or V row)"

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries ``[..., D]`` in the basis the rows are stored in."""
        return q

    def outputs(self, out: torch.Tensor) -> torch.Tensor:
        """Attention outputs over the stored rows ``[..., D]`` back in the model's basis."""
        return out

    def attention(self, q, k_pages, v_pages, page_table, seq_lens, *, scale, alibi=None, scores=None,
                  restore=None) -> torch.Tensor:
        return paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, scale=scale, alibi=alibi,
                                      scores=scores, restore=restore)


class PackedRows(NativeRows):
    """Rows stored as ``kvkernels.quant`` packed rows of ``fmt`` (K and V alike); with ``rotation``
    (``[D, D]`` orthogonal, ``kvkernels.quant.hadamard_rotation``) each row is rotated before it is
    quantized, the queries are rotated the same way and the attention's output is rotated back."""

    quantized = True
    fmt: QuantFormat

    def __init__(self, head_dim: int, dtype: torch.dtype, fmt: QuantFormat,
                 rotation: torch.Tensor | None = None):
        fmt.check(head_dim)
        super().__init__(head_dim, dtype)
        self.fmt, self.bits, self.rotation = fmt, fmt.bits, rotation
        self.page_dtype, self.width = torch.uint8, fmt.row_bytes(head_dim)

    def describe(self) -> str:
        rotated = ", Hadamard-rotated" if self.rotation is not None else ""
        return (f"{self.fmt.bits}-bit rows, group {self.fmt.group}{rotated} ({self.row_bytes} B per K or V "
                f"row, {self.head_dim * 2} B in float16)")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return encode_rows(x, self.fmt, self.rotation)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        return decode_rows(rows, self.head_dim, self.fmt, self.dtype, self.rotation)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        return q if self.rotation is None else rotate(q, self.rotation)

    def outputs(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.rotation is None else rotate(out, self.rotation, back=True)

    def attention(self, q, k_pages, v_pages, page_table, seq_lens, *, scale, alibi=None, scores=None,
                  restore=None) -> torch.Tensor:
        # The cache refuses ALiBi with quantized rows, and compose refuses merging (restore) with them.
        assert alibi is None and restore is None
        out = quant_decode_attention(self.queries(q), k_pages, v_pages, page_table, seq_lens, scale=scale,
                                     k_format=self.fmt, v_format=self.fmt, scores=scores, validate=False)
        return self.outputs(out)


def stored_formats(precision) -> list[int]:
    """The bit widths a precision policy's tokens are stored at, low to high (``NATIVE_BITS`` = 16: the
    cache's dtype): two for a cache with a second region (``kvmodels.cache.tiers``)."""
    return sorted(precision.formats())


def check_side_pages(side_pages: object, policy, side: PackedRows | None) -> int | None:
    """``side_pages`` (the second format's pool, ``PagedKVCache(side_pages=)``) checked against ``policy``'s
    storages (``side``: :func:`row_storage`'s second): a positive int with two formats, or None."""
    if side_pages is None:
        return None
    if side is None:
        raise ValueError(f"side_pages={side_pages!r}: policy {policy.name!r} stores tokens in one format "
                         "(one pool); pass side_pages only with a precision that stores two (kivi's "
                         "residual, zipcache, mikv)")
    if isinstance(side_pages, bool) or not isinstance(side_pages, int) or side_pages < 1:
        raise ValueError(f"side_pages must be a positive int or None, got {side_pages!r}")
    return side_pages


def row_storage(policy, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                alibi: bool = False) -> tuple[NativeRows, PackedRows | None]:
    """The row storages ``policy``'s precision role asks for: the main region's, and the side region's
    (``kvmodels.cache.tiers``) when tokens come in two formats (else ``None``). ``ValueError`` naming what
    the paged cache cannot store and the fix; ``alibi``: the model biases attention by each slot's position
    (``CacheLayout.alibi``), which the quantized decode kernel does not read, so quantized rows are refused
    here, before any prefill, rather than at the first decode step."""
    precision = policy.precision
    if not precision.quantizes:
        return NativeRows(head_dim, dtype), None
    name = f"policy {policy.name!r}: precision {precision.name!r} ({precision})"
    if alibi:
        raise ValueError(f"{name} does not fit this model: it biases attention by each slot's position "
                         "(ALiBi, MPT), which the quantized decode kernel does not read yet; use a RoPE "
                         "model (Llama, GPT-J) or precision 'native'")
    rotation = None
    if getattr(precision, "rotate", False):  # every format is quantized (the policy checked it)
        try:
            rotation = hadamard_rotation(head_dim, device)
        except ValueError as e:
            raise ValueError(f"{name} does not fit this model: {e}; use rotate=False") from None
    ev = policy.eviction
    # Merging (restored from magnitudes) with quantization is refused by compose itself.
    formats = stored_formats(precision)
    if len(formats) > 2:
        raise ValueError(f"{name} stores tokens in {len(formats)} formats; the paged cache holds two at most")

    def storage(bits: int) -> NativeRows:
        if bits == NATIVE_BITS:
            return NativeRows(head_dim, dtype)
        fmt = QuantFormat(bits, precision.group_size())
        try:
            fmt.check(head_dim)
        except ValueError as e:  # e.g. a group that does not divide this model's head dim
            raise ValueError(f"{name} does not fit this model: {e}") from None
        return PackedRows(head_dim, dtype, fmt, rotation)

    main = storage(formats[-1])
    if len(formats) == 1:
        return main, None
    if ev.decode_evict and precision.reselects and precision.every == 0:
        raise ValueError(f"{name} never re-compresses (every=0), so under eviction {ev.name!r}, which evicts "
                         "while decoding from the low bits only, the high bits would outgrow the budget; use "
                         "every >= 1 (ZipCache's is ~100) or a prompt-only policy (snapkv)")
    side = storage(formats[0])
    assert isinstance(side, PackedRows)
    return main, side
