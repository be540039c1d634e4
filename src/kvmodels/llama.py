"""A minimal Llama on the paged, ragged KV cache (gpt-fast shape: the whole model in one file).

RMSNorm, rotary embeddings in Hugging Face's rotate-half layout (with Llama-3 and linear scaling),
grouped-query attention and a SwiGLU MLP. Keys are cached *after* RoPE at their true absolute
positions, so an evicting cache keeps each kept token's original rotation and new tokens get their real
position (design notes §4).

The model implements the protocol in :mod:`kvmodels.generate`: ``prefill`` runs one sequence densely
(causal attention over the prompt, ``cache.prefill_attend``, which also stores every layer's q/k/v);
``decode_step`` runs all sequences of the batch for one token through ``cache.append`` and
``cache.attend``. Only ``decode_step`` is meant to be compiled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvkernels import prefill_attention
from kvmodels.generate import CacheLayout


@dataclass
class LlamaConfig:
    """Shape and hyper-parameters of a Llama-family model.

    ``n_kv_heads`` defaults (0) to ``n_heads`` (no GQA) and ``head_dim`` (0) to ``dim // n_heads``.
    ``rope_scaling`` is ``None`` or a dict in Hugging Face's form: ``{"rope_type": "linear", "factor": f}``
    or ``{"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
    "original_max_position_embeddings": n}``.
    """

    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 0  # 0: n_heads (no GQA)
    head_dim: int = 0  # 0: dim // n_heads
    intermediate: int = 11008
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_embeddings: bool = False
    max_seq_len: int = 2048
    # Extra fields callers may read (the checkpoint's name, say); never affects the math.
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.n_kv_heads:
            self.n_kv_heads = self.n_heads
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate",
                     "max_seq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"LlamaConfig.{name}={getattr(self, name)!r} must be >= 1")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("linear", "llama3", "default"):
                raise ValueError(f"LlamaConfig.rope_scaling: rope_type {kind!r} is not supported; "
                                 "use 'linear', 'llama3' or None")

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A config from the name → overrides table (``LLAMA_CONFIGS``), plus ``overrides``."""
        if name not in LLAMA_CONFIGS:
            raise ValueError(f"unknown Llama config {name!r}; known: {', '.join(sorted(LLAMA_CONFIGS))}")
        return cls(**{**LLAMA_CONFIGS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


LLAMA_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate=1536,
                         rope_theta=100000.0, tie_embeddings=True, max_seq_len=8192),
    "llama-3.2-1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                         intermediate=8192, rope_theta=500000.0, tie_embeddings=True, max_seq_len=131072,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                       intermediate=14336, rope_theta=500000.0, max_seq_len=8192),
    "llama-2-7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, intermediate=11008,
                       max_seq_len=4096),
}


def rope_inv_freq(config: LlamaConfig) -> Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32, with the config's scaling applied."""
    d = config.head_dim
    # float32 throughout, as the reference computes it: at positions in the thousands one ulp of
    # inv_freq moves the angle by ~1e-3, so float64 here would *disagree* with Hugging Face's tables.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
        # interpolates smoothly (in wavelength measured against the original context length).
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / lo, inv_freq / factor,
                               torch.where(wavelen < old_ctx / hi, inv_freq, scaled))
    return inv_freq


def rope_tables(config: LlamaConfig) -> tuple[Tensor, Tensor]:
    """``cos, sin`` ``[max_seq_len, head_dim]`` float32 (cast to the activation dtype per use, as the
    reference does)."""
    freqs = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float32), rope_inv_freq(config))
    angles = torch.cat((freqs, freqs), dim=-1)  # [max_seq_len, D]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [N, H, D]`` with ``cos``/``sin`` ``[N, D]`` (rotate-half layout: pairs ``(i, i + D/2)``)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 like the reference implementation, then cast back before the scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Block(nn.Module):
    """One decoder layer. Projections are fused (q|k|v and gate|up) so a decode step is 4 matmuls."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        self.attention_norm = RMSNorm(c.dim, c.rms_eps)
        self.wqkv = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.ffn_norm = RMSNorm(c.dim, c.rms_eps)
        self.w13 = nn.Linear(c.dim, 2 * c.intermediate, bias=False)
        self.w2 = nn.Linear(c.intermediate, c.dim, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated q ``[N, Hq, D]``, rotated k and v ``[N, Hkv, D]`` for hidden states ``x [N, dim]``."""
        hq, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.wqkv(self.attention_norm(x)).split([hq * d, hkv * d, hkv * d], dim=-1)
        q = apply_rope(q.view(-1, hq, d), cos, sin)  # [N, Hq, D]
        k = apply_rope(k.view(-1, hkv, d), cos, sin)  # [N, Hkv, D]
        return q, k, v.view(-1, hkv, d)

    def mlp(self, x: Tensor) -> Tensor:
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Llama(nn.Module):
    """Llama decoder on a paged KV cache. One cache layer per model layer.

    Parameters
    ----------
    config : LlamaConfig
    """

    #: ``prefill(..., start > 0)`` continues a cached sequence (``kvmodels.decoder.Decoder.extend``).
    can_extend = True

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.rms_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def blocks(self) -> list[Block]:
        """The decoder layers, typed (``nn.ModuleList`` iterates as plain ``Module``)."""
        return list(self.layers)  # type: ignore[arg-type]

    # --- the model protocol (kvmodels.generate.CausalLM) ----------------------------------------
    @property
    def n_cache_layers(self) -> int:
        return self.config.n_layers

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def cache_layout(self) -> CacheLayout:
        c = self.config
        return CacheLayout(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                           n_q_heads=c.n_heads)

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        cos, sin = self.rope_cos, self.rope_sin
        assert isinstance(cos, Tensor) and isinstance(sin, Tensor)
        return cos[positions].to(dtype), sin[positions].to(dtype)

    def prefill(self, tokens: Tensor, cache: Any, b: int, *, start: int = 0, last_only: bool = False,
                on_layer: Callable[[int], None] | None = None) -> Tensor:
        """Run one prompt densely and write every layer's K/V into ``cache`` for sequence ``b``; with
        ``start > 0``, continue sequence ``b`` instead (its earlier tokens are in the cache).

        Parameters
        ----------
        tokens : Tensor
            ``[L]`` int64 prompt token ids, ``1 <= L <= max_seq_len``.
        cache : PagedKVCache or None
            Receives ``prefill_attend(l, b, q, k, v, positions)`` (returns the layer's attention) and
            ``observe(l, b, h_in, attn_out)`` per layer; ``None`` runs the plain forward pass (nothing
            cached).
        b : int
            Batch slot of this sequence in the cache.
        start : int
            Position of ``tokens[0]``. ``0``: a prompt (``cache.prefill_attend``). ``> 0``: an extension of
            sequence ``b``, which holds ``start`` tokens seen so far (kept or evicted) after
            ``cache.begin_extend``: the tokens get positions ``start ..`` and attend to the kept ones
            (``cache.extend_attend``); ``kvmodels.decoder.Decoder`` drives it.
        last_only : bool
            Return only the last position's logits (``[1, V]``), avoiding an ``[L, V]`` tensor.
        on_layer : callable, optional
            Called with the layer index after each layer (progress reporting).

        Returns
        -------
        Tensor
            ``[L, V]`` (or ``[1, V]``) logits in the model dtype.
        """
        L = tokens.shape[0]
        if start and cache is None:
            raise ValueError(f"start={start} continues a cached sequence; pass its cache")
        positions = torch.arange(start, start + L, device=tokens.device)
        x = self.tok_embeddings(tokens)  # [L, dim]
        cos, sin = self._rope(positions, x.dtype)
        for l, layer in enumerate(self.blocks):
            q, k, v = layer.qkv(x, cos, sin)
            if cache is None:
                attn, _ = prefill_attention(q, k, v, scale=layer.scale)  # [L, Hq, D]
            elif start:  # over the kept tokens and causally over these; stores and scores them
                attn = cache.extend_attend(l, b, q, k, v, positions, scale=layer.scale)
            else:  # stores and scores the prompt K/V too, from the same attention probabilities
                attn = cache.prefill_attend(l, b, q, k, v, positions, scale=layer.scale)
            attn_out = layer.wo(attn.reshape(L, -1))  # [L, dim]
            if cache is not None:  # the observation point: the budget policy reads what it needs
                cache.observe(l, b, x, attn_out)
            x = x + attn_out
            x = x + layer.mlp(x)
            if on_layer is not None:
                on_layer(l)
        if last_only:
            x = x[-1:]
        return self.output(self.norm(x))

    def decode_step(self, tokens: Tensor, positions: Tensor, cache: Any) -> Tensor:
        """One token for every sequence of the batch.

        Parameters
        ----------
        tokens : Tensor
            ``[B]`` int64, the last token of each sequence (anything for inactive rows).
        positions : Tensor
            ``[B]`` int64 absolute position of ``tokens`` (its RoPE angle and its cache position).
        cache : PagedKVCache
            ``append`` then ``attend`` per layer; shapes are static so the step compiles once.

        Returns
        -------
        Tensor
            ``[B, V]`` logits.
        """
        B = tokens.shape[0]
        x = self.tok_embeddings(tokens)  # [B, dim]
        cos, sin = self._rope(positions, x.dtype)
        for l, layer in enumerate(self.blocks):
            q, k, v = layer.qkv(x, cos, sin)
            cache.append(l, k, v, positions, q=q)
            attn = cache.attend(l, q, positions, scale=layer.scale)  # [B, Hq, D]
            x = x + layer.wo(attn.reshape(B, -1))
            x = x + layer.mlp(x)
        return self.output(self.norm(x))
