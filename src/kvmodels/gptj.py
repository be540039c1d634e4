"""GPT-J on the paged KV cache.

GPT-J (Wang & Komatsuzaki, 2021) differs from Llama in four places, all visible below:
  * attention and MLP run in parallel on the same LayerNorm output and are added to the residual once;
  * rotary embedding covers only the first ``rotary_dim`` dims of each head, in the interleaved
    ("rotate every two") layout: dims ``(2i, 2i + 1)`` form a pair;
  * LayerNorm with bias, MLP ``fc_in``/``fc_out`` and ``lm_head`` with bias, q/k/v/out without;
  * multi-head attention (``Hkv == Hq``), GELU (tanh form, ``gelu_new``).

Keys enter the cache after rotation, so a kept token keeps its original rotation after eviction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvkernels import prefill_attention
from kvmodels.generate import CacheLayout


@dataclass(frozen=True)
class GPTJConfig:
    """GPT-J hyper-parameters (names follow ``transformers.GPTJConfig`` where they exist)."""

    vocab_size: int = 50400
    n_layers: int = 28
    n_heads: int = 16
    hidden_size: int = 4096
    rotary_dim: int = 64          # rotated dims per head (the first ``rotary_dim``); <= head_dim, even
    intermediate_size: int = 16384
    layer_norm_eps: float = 1e-5
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        if self.hidden_size % self.n_heads:
            raise ValueError(f"GPTJConfig: hidden_size={self.hidden_size} must be divisible by "
                             f"n_heads={self.n_heads}")
        if not (0 < self.rotary_dim <= self.head_dim) or self.rotary_dim % 2:
            raise ValueError(f"GPTJConfig: rotary_dim={self.rotary_dim} must be even and in (0, head_dim="
                             f"{self.head_dim}]")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @classmethod
    def from_hf(cls, hf_config: Any) -> GPTJConfig:
        """From a ``transformers.GPTJConfig`` (or anything with its attribute names)."""
        head_dim = hf_config.n_embd // hf_config.n_head
        return cls(vocab_size=hf_config.vocab_size, n_layers=hf_config.n_layer, n_heads=hf_config.n_head,
                   hidden_size=hf_config.n_embd, rotary_dim=hf_config.rotary_dim or head_dim,
                   intermediate_size=hf_config.n_inner or 4 * hf_config.n_embd,
                   layer_norm_eps=hf_config.layer_norm_epsilon, max_seq_len=hf_config.n_positions)


def rotary_interleaved(x: Tensor, positions: Tensor, rotary_dim: int) -> Tensor:
    """GPT-J rotary embedding on the first ``rotary_dim`` dims, pairs ``(2i, 2i + 1)``.

    Parameters
    ----------
    x : ``[N, H, D]`` float
    positions : ``[N]`` int, absolute positions
    rotary_dim : int, even, ``<= D``

    Returns
    -------
    ``[N, H, D]``, same dtype; dims ``>= rotary_dim`` pass through.
    """
    # Angles in fp32 exactly as GPT-J builds its sinusoid table, so logits match the reference bit-for-bit
    # up to the matmul order.
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=x.device).float() / rotary_dim))
    angles = positions.float()[:, None] * inv_freq                           # [N, R/2]
    cos = angles.cos().to(x.dtype)[:, None, :]                               # [N, 1, R/2]
    sin = angles.sin().to(x.dtype)[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    even, odd = x_rot[..., 0::2], x_rot[..., 1::2]                           # [N, H, R/2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x_pass), dim=-1)


class GPTJBlock(nn.Module):
    def __init__(self, cfg: GPTJConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.n_heads, self.head_dim, self.rotary_dim = cfg.n_heads, cfg.head_dim, cfg.rotary_dim
        self.ln_1 = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.out_proj = nn.Linear(h, h, bias=False)
        self.fc_in = nn.Linear(h, cfg.intermediate_size)
        self.fc_out = nn.Linear(cfg.intermediate_size, h)

    def qkv(self, hn: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated q, k and v ``[N, H, D]`` from the normed hidden states ``hn [N, h]``."""
        shape = (-1, self.n_heads, self.head_dim)
        q = rotary_interleaved(self.q_proj(hn).view(shape), positions, self.rotary_dim)  # [N, H, D]
        k = rotary_interleaved(self.k_proj(hn).view(shape), positions, self.rotary_dim)
        return q, k, self.v_proj(hn).view(shape)

    def mlp(self, hn: Tensor) -> Tensor:
        return self.fc_out(F.gelu(self.fc_in(hn), approximate="tanh"))


class GPTJ(nn.Module):
    """GPT-J for causal LM on ``kvmodels.cache.PagedKVCache``; one cache layer per model layer.

    Follows the model protocol of :class:`kvmodels.generate.CausalLM` (``kvmodels.llama.Llama`` is the
    pattern): ``prefill`` (``cache=None`` is the plain forward pass), ``decode_step``, ``n_cache_layers``,
    ``max_seq_len``, ``cache_layout()``.

    Parameters
    ----------
    config : GPTJConfig
    """

    #: ``prefill(..., start > 0)`` continues a cached sequence (``kvmodels.decoder.Decoder.extend``).
    can_extend = True

    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(GPTJBlock(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
        self.scale = config.head_dim ** -0.5

    # --- model protocol -------------------------------------------------------------------------------
    @property
    def n_cache_layers(self) -> int:
        return self.config.n_layers

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def cache_layout(self) -> CacheLayout:
        c = self.config
        return CacheLayout(n_layers=c.n_layers, n_kv_heads=c.n_heads, head_dim=c.head_dim,
                           n_q_heads=c.n_heads)

    def prefill(self, tokens: Tensor, cache: Any, b: int, *, start: int = 0, last_only: bool = False,
                on_layer: Callable[[int], None] | None = None) -> Tensor:
        """Run one prompt densely and write every layer's K/V into ``cache`` for sequence ``b``.

        Parameters
        ----------
        tokens : ``[L]`` int64 prompt ids
        cache : PagedKVCache or None (``None``: plain forward pass, nothing cached)
        b : batch slot of this sequence in the cache
        start : position of ``tokens[0]``; ``> 0`` continues sequence ``b`` (``cache.extend_attend``, as
            ``kvmodels.llama.Llama.prefill``)
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
            hn = blk.ln_1(x)
            q, k, v = blk.qkv(hn, positions)
            if cache is None:
                attn, _ = prefill_attention(q, k, v, scale=self.scale)         # [L, H, D]
            elif start:  # over the kept tokens and causally over these
                attn = cache.extend_attend(l, b, q, k, v, positions, scale=self.scale)
            else:  # stores and scores the prompt K/V too, from the same attention probabilities
                attn = cache.prefill_attend(l, b, q, k, v, positions, scale=self.scale)
            attn = blk.out_proj(attn.reshape(L, -1))                          # [L, h]
            if cache is not None:  # the observation point: the budget policy reads what it needs
                cache.observe(l, b, x, attn)
            x = x + attn + blk.mlp(hn)                                       # parallel residual
            if on_layer is not None:
                on_layer(l)
        if last_only:
            x = x[-1:]
        return self.lm_head(self.ln_f(x))

    def decode_step(self, tokens: Tensor, positions: Tensor, cache: Any) -> Tensor:
        """One token for each sequence: ``tokens[B]`` int64 at ``positions[B]`` int64 -> logits ``[B, V]``."""
        B = tokens.shape[0]
        x = self.wte(tokens)                                                 # [B, h]
        for l, blk in enumerate(self.blocks):
            hn = blk.ln_1(x)
            q, k, v = blk.qkv(hn, positions)
            cache.append(l, k, v, positions, q=q)
            attn = cache.attend(l, q, positions, scale=self.scale)           # [B, H, D]
            x = x + blk.out_proj(attn.reshape(B, -1)) + blk.mlp(hn)
        return self.lm_head(self.ln_f(x))

    # --- loading --------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_model: Any) -> GPTJ:
        """Build from a ``transformers.GPTJForCausalLM`` (weights copied, dtype kept)."""
        cfg = GPTJConfig.from_hf(hf_model.config)
        sd = hf_model.state_dict()
        model = cls(cfg).to(sd["lm_head.weight"].dtype)
        model.load_state_dict(convert_hf_state_dict(sd, cfg.n_layers))
        return model.eval()

    @classmethod
    def from_pretrained(cls, path: str) -> GPTJ:
        """Build from a Hugging Face GPT-J checkpoint directory (``config.json`` + weights)."""
        from kvmodels.loading import load_checkpoint

        return load_checkpoint(path, dtype=None).model


def convert_hf_state_dict(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Rename a ``GPTJForCausalLM`` state dict to this module's names (no layout change needed)."""
    out = {"wte.weight": sd["transformer.wte.weight"],
           "ln_f.weight": sd["transformer.ln_f.weight"], "ln_f.bias": sd["transformer.ln_f.bias"],
           "lm_head.weight": sd["lm_head.weight"], "lm_head.bias": sd["lm_head.bias"]}
    names = {"ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias",
             "q_proj.weight": "attn.q_proj.weight", "k_proj.weight": "attn.k_proj.weight",
             "v_proj.weight": "attn.v_proj.weight", "out_proj.weight": "attn.out_proj.weight",
             "fc_in.weight": "mlp.fc_in.weight", "fc_in.bias": "mlp.fc_in.bias",
             "fc_out.weight": "mlp.fc_out.weight", "fc_out.bias": "mlp.fc_out.bias"}
    for i in range(n_layers):
        for ours, theirs in names.items():
            out[f"blocks.{i}.{ours}"] = sd[f"transformer.h.{i}.{theirs}"]
    return out
