"""MPT (MosaicML) with ALiBi on the paged KV cache.

MPT has no positional embedding: each head adds ``slope_h * (key_pos - query_pos)`` to its logits
(ALiBi). The cache stores every slot's **original** position (``slot_pos``) and the attention kernel
reads it (``alibi_slopes=`` on ``cache.attend`` / ``cache.prefill_layer``, contract §2.1), so after
eviction a kept token is still biased by its true distance: attention over a compacted cache equals
attention over the full cache restricted to the kept tokens. Other MPT traits: fused ``Wqkv`` with optional
``clip_qkv``, no biases anywhere, LayerNorm without bias, exact GELU, ``lm_head`` tied to ``wte``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvmodels.generate import CacheLayout


@dataclass(frozen=True)
class MPTConfig:
    """MPT hyper-parameters (names follow ``transformers.MptConfig``)."""

    vocab_size: int = 50432
    n_layers: int = 32
    n_heads: int = 32
    hidden_size: int = 4096
    intermediate_size: int = 16384
    layer_norm_eps: float = 1e-5
    alibi_bias_max: float = 8.0
    clip_qkv: float | None = None
    softmax_scale: float | None = None   # None: 1 / sqrt(head_dim)
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.hidden_size % self.n_heads:
            raise ValueError(f"MPTConfig: hidden_size={self.hidden_size} must be divisible by "
                             f"n_heads={self.n_heads}")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ValueError(f"MPTConfig: clip_qkv={self.clip_qkv} must be > 0 or None")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @classmethod
    def from_hf(cls, hf_config: Any) -> MPTConfig:
        """From a ``transformers.MptConfig``.

        ``transformers``' MPT always builds its ALiBi table with ``alibi_bias_max=8`` (it does not pass the
        config value), so that is what we take, to match its logits.
        """
        attn = hf_config.attn_config
        return cls(vocab_size=hf_config.vocab_size, n_layers=hf_config.n_layers, n_heads=hf_config.n_heads,
                   hidden_size=hf_config.d_model, intermediate_size=4 * hf_config.d_model,
                   layer_norm_eps=hf_config.layer_norm_epsilon, alibi_bias_max=8.0,
                   clip_qkv=attn.clip_qkv, softmax_scale=attn.softmax_scale,
                   max_seq_len=hf_config.max_seq_len)


def alibi_slopes(n_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """MPT's ALiBi slopes ``[n_heads]`` float32.

    For ``n`` = the next power of two ``>= n_heads``: ``slope_i = 2 ** (-(i + 1) * alibi_bias_max / n)``;
    when ``n_heads`` is not a power of two MPT takes the odd-indexed slopes first, then the even-indexed,
    and keeps the first ``n_heads``.
    """
    n = 2 ** math.ceil(math.log2(n_heads))
    slopes = 1.0 / torch.pow(2.0, torch.arange(1, n + 1, dtype=torch.float32) * (alibi_bias_max / n))
    if n != n_heads:
        slopes = torch.cat((slopes[1::2], slopes[0::2]))[:n_heads]
    return slopes


def alibi_causal_attention(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, *, scale: float) -> Tensor:
    """Dense causal attention with ALiBi over one prompt (positions ``0..L-1``).

    Parameters
    ----------
    q, k, v : ``[L, H, D]``
    slopes : ``[H]`` float32

    Returns
    -------
    ``[L, H, D]`` in ``q.dtype``
    """
    L = q.shape[0]
    pos = torch.arange(L, device=q.device)
    rel = (pos[None, :] - pos[:, None]).float()                              # [Lq, Lk] key - query
    bias = slopes.float()[:, None, None] * rel                               # [H, Lq, Lk]
    bias = bias.masked_fill(rel > 0, float("-inf")).to(q.dtype)
    # 4-D inputs: with 3-D ones torch's CPU SDPA falls back to the L x L math path.
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=bias[None],
                                         scale=scale)[0]                     # [H, L, D]
    return out.transpose(0, 1)


class MPTBlock(nn.Module):
    def __init__(self, cfg: MPTConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.n_heads, self.head_dim, self.clip_qkv = cfg.n_heads, cfg.head_dim, cfg.clip_qkv
        self.norm_1 = nn.LayerNorm(h, eps=cfg.layer_norm_eps, bias=False)
        self.Wqkv = nn.Linear(h, 3 * h, bias=False)
        self.out_proj = nn.Linear(h, h, bias=False)
        self.norm_2 = nn.LayerNorm(h, eps=cfg.layer_norm_eps, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``[N, H, D]`` from the residual stream ``x [N, h]`` (norm, fused projection, clip)."""
        qkv = self.Wqkv(self.norm_1(x))
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        # contiguous: the chunks are strided views and the kernels index storage directly
        q, k, v = (t.reshape(-1, self.n_heads, self.head_dim).contiguous() for t in qkv.chunk(3, dim=-1))
        return q, k, v                                                        # [N, H, D] each

    def mlp(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.up_proj(self.norm_2(x))))


class MPT(nn.Module):
    """MPT for causal LM on ``kvmodels.cache.PagedKVCache``; one cache layer per model layer.

    Follows the model protocol of :class:`kvmodels.generate.CausalLM`: ``prefill`` (``cache=None`` is
    the plain forward pass), ``decode_step``, ``n_cache_layers``, ``max_seq_len``, ``cache_layout()``.

    Parameters
    ----------
    config : MPTConfig
    """

    #: ``prefill(..., start > 0)`` continues a cached sequence (``kvmodels.decoder.Decoder.extend``).
    can_extend = True

    def __init__(self, config: MPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(MPTBlock(config) for _ in range(config.n_layers))
        self.norm_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=False)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        s = config.softmax_scale
        self.scale = s if s is not None else config.head_dim ** -0.5
        self.register_buffer("_slopes", alibi_slopes(config.n_heads, config.alibi_bias_max), persistent=False)

    @property
    def alibi_slopes(self) -> Tensor:
        """``[H]`` float32 (the kernels take fp32 slopes whatever the model dtype)."""
        return self._slopes.float()

    @property
    def n_cache_layers(self) -> int:
        return self.config.n_layers

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def cache_layout(self) -> CacheLayout:
        c = self.config
        return CacheLayout(n_layers=c.n_layers, n_kv_heads=c.n_heads, head_dim=c.head_dim,
                           n_q_heads=c.n_heads, alibi=True)

    def prefill(self, tokens: Tensor, cache: Any, b: int, *, start: int = 0, last_only: bool = False,
                on_layer: Callable[[int], None] | None = None) -> Tensor:
        """Run one prompt densely and write every layer's K/V into ``cache`` for sequence ``b``.

        Parameters
        ----------
        tokens : ``[L]`` int64 prompt ids
        cache : PagedKVCache or None (``None``: plain forward pass, nothing cached)
        b : batch slot of this sequence in the cache
        start : position of ``tokens[0]``; ``> 0`` continues sequence ``b``: the cache attends over its kept
            tokens with ALiBi from their stored positions (``cache.extend_attend``)
        last_only : return only the last position's logits ``[1, V]``
        on_layer : called with the layer index after each layer

        Returns
        -------
        ``[L, V]`` (or ``[1, V]``) logits in the model dtype.
        """
        L = tokens.shape[0]
        if start and cache is None:
            raise ValueError(f"start={start} continues a cached sequence; pass its cache")
        positions = torch.arange(start, start + L, device=tokens.device)
        x = self.wte(tokens)                                                 # [L, h]
        for l, blk in enumerate(self.blocks):
            q, k, v = blk.qkv(x)
            if start:
                attn = cache.extend_attend(l, b, q, k, v, positions, scale=self.scale,
                                           alibi_slopes=self.alibi_slopes)
            else:
                if cache is not None:
                    cache.prefill_layer(l, b, q, k, v, positions, scale=self.scale,
                                        alibi_slopes=self.alibi_slopes)
                attn = alibi_causal_attention(q, k, v, self.alibi_slopes, scale=self.scale)
            attn = blk.out_proj(attn.reshape(L, -1))                          # [L, h]
            if cache is not None:  # the observation point: the budget policy reads what it needs
                cache.observe(l, b, x, attn)
            x = x + attn
            x = x + blk.mlp(x)
            if on_layer is not None:
                on_layer(l)
        if last_only:
            x = x[-1:]
        return self.lm_head(self.norm_f(x))

    def decode_step(self, tokens: Tensor, positions: Tensor, cache: Any) -> Tensor:
        """One token for each sequence: ``tokens[B]`` int64 at ``positions[B]`` int64 -> logits ``[B, V]``.

        The kernel biases each slot by ``slope * (slot_pos - position)`` with the slot's original position.
        """
        B = tokens.shape[0]
        x = self.wte(tokens)                                                 # [B, h]
        for l, blk in enumerate(self.blocks):
            q, k, v = blk.qkv(x)
            cache.append(l, k, v, positions, q=q)
            attn = cache.attend(l, q, positions, scale=self.scale, alibi_slopes=self.alibi_slopes)
            x = x + blk.out_proj(attn.reshape(B, -1))
            x = x + blk.mlp(x)
        return self.lm_head(self.norm_f(x))

    @classmethod
    def from_hf(cls, hf_model: Any) -> MPT:
        """Build from a ``transformers.MptForCausalLM`` (weights copied, dtype kept)."""
        cfg = MPTConfig.from_hf(hf_model.config)
        sd = hf_model.state_dict()
        model = cls(cfg).to(sd["transformer.wte.weight"].dtype)
        model.load_state_dict(convert_hf_state_dict(sd, cfg.n_layers))
        return model.eval()

    @classmethod
    def from_pretrained(cls, path: str) -> MPT:
        """Build from a Hugging Face MPT checkpoint directory (``config.json`` + weights)."""
        from kvmodels.loading import load_checkpoint

        return load_checkpoint(path, dtype=None).model


def convert_hf_state_dict(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Rename a ``MptForCausalLM`` state dict to this module's names; ``lm_head`` falls back to ``wte``."""
    wte = sd["transformer.wte.weight"]
    out = {"wte.weight": wte, "norm_f.weight": sd["transformer.norm_f.weight"],
           "lm_head.weight": sd.get("lm_head.weight", wte)}
    names = {"norm_1.weight": "norm_1.weight", "Wqkv.weight": "attn.Wqkv.weight",
             "out_proj.weight": "attn.out_proj.weight", "norm_2.weight": "norm_2.weight",
             "up_proj.weight": "ffn.up_proj.weight", "down_proj.weight": "ffn.down_proj.weight"}
    for i in range(n_layers):
        for ours, theirs in names.items():
            out[f"blocks.{i}.{ours}"] = sd[f"transformer.blocks.{i}.{theirs}"]
    return out
