"""Layer-Condensed KV cache (LCKV; Wu & Tu, 2024, ``papers/lckv.txt``) on the paged KV cache.

A Llama whose layers, except a few *warmup* layers, attend to the KV of the **top** layer instead of
their own. Only warmup layers and the top layer have K/V projections and caches, so the cache has fewer
layers than the model; this module owns the model-layer -> cache-layer map (``cache_layer_of``).

* Warmup layers (``warmup_bottom`` at the bottom, ``warmup_top`` at the top: the sandwich) are standard
  causal attention layers with their own cache. The top layer is a warmup layer when ``warmup_top >= 1``.
* Every other layer ("condensed") pairs its queries with the top layer's KV of the **previous** tokens:
  the diagonal is masked (a token cannot attend to its own top-layer KV, which does not exist until the
  pass reaches the top), and the first token sees only zero KVs, i.e. its attention output is zero (the
  reference code's choice).
* Training / prompt encoding cannot be causal-parallel, so the whole stack runs ``m + b`` times over all
  tokens in parallel; iteration ``i`` pairs queries with the top-layer KV of iteration ``i - 1`` (zeros
  before the first). Gradients flow through the last ``b`` iterations only (paper §2.2; m=7, b=2).
  With ``n`` iterations over ``n`` tokens this equals token-by-token computation exactly (Theorem 1).
* Decoding is plain token-by-token: condensed layers read the top cache, which holds the previous tokens
  only; the current token's top-layer KV is computed from its own top-layer input during this step and
  appended to the top cache when the pass reaches the top layer (before the top layer attends when the top
  is a warmup layer, after when it is condensed), so later tokens see it. The paged cache expresses the
  masked diagonal directly: the condensed layers attend before the append.

Eviction policies run on the cache layers as on any model. A cache layer is *scored* by one query per
step, the layer that owns it (a warmup layer, or the top layer for the shared top cache): condensed
layers read the top cache without a score update, so a policy's per-step score mass (contract §2.2) is the
same as on a standard model. SqueezeAttention's statistic of a cache layer is likewise its owner's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvmodels.generate import CacheLayout
from kvmodels.llama import Block, Llama, LlamaConfig, RMSNorm, apply_rope, rope_tables


@dataclass
class LCKVConfig:
    """An LCKV model: a Llama shape plus where the warmup layers are and how prompts are iterated.

    ``forward_iterations`` (``m``) run without gradients, then ``backward_iterations`` (``b``) with them;
    prompts are encoded with ``m + b`` iterations unless ``prefill`` is given another number.
    """

    llama: LlamaConfig = field(default_factory=LlamaConfig)
    warmup_bottom: int = 1
    warmup_top: int = 1
    forward_iterations: int = 7
    backward_iterations: int = 2

    def __post_init__(self) -> None:
        n = self.llama.n_layers
        if self.warmup_bottom < 0 or self.warmup_top < 0 or self.warmup_bottom + self.warmup_top > n:
            raise ValueError(f"LCKVConfig: warmup_bottom={self.warmup_bottom} and "
                             f"warmup_top={self.warmup_top} must be >= 0 and sum to at most n_layers={n}")
        if self.forward_iterations < 0 or self.backward_iterations < 1:
            raise ValueError(f"LCKVConfig: forward_iterations={self.forward_iterations} must be >= 0 and "
                             f"backward_iterations={self.backward_iterations} >= 1")

    @property
    def iterations(self) -> int:
        return self.forward_iterations + self.backward_iterations

    def is_warmup(self, layer: int) -> bool:
        return layer < self.warmup_bottom or layer >= self.llama.n_layers - self.warmup_top

    def has_kv(self, layer: int) -> bool:
        """Whether model layer ``layer`` computes (and caches) its own K/V."""
        return self.is_warmup(layer) or layer == self.llama.n_layers - 1


class QueryBlock(Block):
    """A condensed layer: a Llama block with a query projection only (no K/V weights)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        del self.wqkv
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)

    def q(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotated queries ``[N, Hq, D]`` for hidden states ``x [N, dim]``."""
        return apply_rope(self.wq(self.attention_norm(x)).view(-1, self.n_heads, self.head_dim), cos, sin)


def _attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, strict: bool) -> Tensor:
    """Causal attention over a batch of sequences at positions ``0..L-1``.

    ``q [B, L, Hq, D]``, ``k, v [B, L, Hkv, D]`` -> ``[B, L, Hq, D]``. ``strict`` masks the diagonal too
    (key ``j`` visible to query ``i`` iff ``j < i``); a query that sees no key gets a zero row.
    """
    L, group = q.shape[1], q.shape[2] // k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)        # [B, H, L, D]
    if not strict:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=group > 1)
        return out.transpose(1, 2)
    # Row 0 sees nothing; SDPA on the other rows with an explicit strict mask, row 0 set to zero.
    visible = torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)        # [Lq, Lk]
    visible[0, 0] = True  # keep softmax finite for row 0; its output is replaced below
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible, scale=scale, enable_gqa=group > 1)
    out = out.transpose(1, 2)                                                    # [B, L, Hq, D]
    first = torch.arange(L, device=q.device) == 0
    return out.masked_fill(first[None, :, None, None], 0.0)


class LCKV(nn.Module):
    """LCKV causal LM on ``kvmodels.cache.PagedKVCache`` (model protocol of ``kvmodels.generate``).

    Parameters
    ----------
    config : LCKVConfig

    Attributes
    ----------
    cache_layer_of : list[int]
        Cache layer each model layer attends to (condensed layers -> the top layer's cache layer).
    kv_cache_layers : dict[int, int]
        Model layer -> the cache layer it writes (warmup layers and the top layer only).
    """

    def __init__(self, config: LCKVConfig) -> None:
        super().__init__()
        self.config = config
        c = config.llama
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) if config.has_kv(l) else QueryBlock(c)
                                    for l in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.rms_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(c)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        kv_layers = [l for l in range(c.n_layers) if config.has_kv(l)]
        self.kv_cache_layers = {l: i for i, l in enumerate(kv_layers)}
        self.top = c.n_layers - 1
        top_cache = self.kv_cache_layers[self.top]
        self.cache_layer_of = [self.kv_cache_layers.get(l, top_cache) for l in range(c.n_layers)]
        self.scale = c.head_dim ** -0.5

    # --- model protocol -------------------------------------------------------------------------------
    @property
    def n_cache_layers(self) -> int:
        return len(self.kv_cache_layers)

    @property
    def max_seq_len(self) -> int:
        return self.config.llama.max_seq_len

    def cache_layout(self) -> CacheLayout:
        c = self.config.llama
        return CacheLayout(n_layers=self.n_cache_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                           n_q_heads=c.n_heads)

    def prefill(self, tokens: Tensor, cache: Any, b: int, *, last_only: bool = False,
                on_layer: Callable[[int], None] | None = None, iterations: int | None = None) -> Tensor:
        """Encode one prompt by ``iterations`` parallel passes and write its cache layers for sequence ``b``.

        Parameters
        ----------
        tokens : ``[L]`` int64 prompt ids
        cache : PagedKVCache or None (``None``: no cache writes)
        b : batch slot of this sequence in the cache
        last_only : return only the last position's logits ``[1, V]``
        on_layer : called with the model layer index after each layer of the last iteration
        iterations : passes over the prompt; default ``m + b`` from the config

        Returns
        -------
        ``[L, V]`` (or ``[1, V]``) logits of the last iteration.
        """
        n_iter = self.config.iterations if iterations is None else iterations
        if n_iter < 1:
            raise ValueError(f"iterations={n_iter} must be >= 1")
        kv = None
        for it in range(n_iter):
            last = it == n_iter - 1
            x, kv = self._pass(tokens[None], kv, cache=cache if last else None, b=b,
                               on_layer=on_layer if last else None)
        x = x[0]
        if last_only:
            x = x[-1:]
        return self.output(self.norm(x))

    def decode_step(self, tokens: Tensor, positions: Tensor, cache: Any) -> Tensor:
        """One token per sequence: ``tokens[B]`` int64 at ``positions[B]`` int64 -> logits ``[B, V]``."""
        B = tokens.shape[0]
        x = self.tok_embeddings(tokens)                                        # [B, dim]
        cos, sin = self._rope(positions, x.dtype)
        for l, layer in enumerate(self.layers):
            cl = self.cache_layer_of[l]
            if isinstance(layer, QueryBlock):
                # The top cache holds only previous tokens here: the masked diagonal, for free.
                attn = cache.attend(cl, layer.q(x, cos, sin), positions, scale=self.scale,
                                    update_scores=False)
            else:
                q, k, v = layer.qkv(x, cos, sin)
                if self.config.is_warmup(l):
                    cache.append(cl, k, v, positions, q=q)
                    attn = cache.attend(cl, q, positions, scale=self.scale)
                else:  # condensed top layer: previous tokens only, then publish this token's KV
                    attn = cache.attend(cl, q, positions, scale=self.scale)
                    cache.append(cl, k, v, positions, q=q)
            x = x + layer.wo(attn.reshape(B, -1))
            x = x + layer.mlp(x)
        return self.output(self.norm(x))

    # --- the parallel iteration -----------------------------------------------------------------------
    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return self.rope_cos[positions].to(dtype), self.rope_sin[positions].to(dtype)

    def _pass(self, tokens: Tensor, top_kv: tuple[Tensor, Tensor] | None, *, cache: Any = None, b: int = 0,
              on_layer: Callable[[int], None] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One bottom-up pass over ``tokens [B, L]`` in parallel.

        Condensed layers attend (diagonal masked) to ``top_kv`` = ``(k, v) [B, L, Hkv, D]`` from the
        previous pass (zeros when None). Returns the final hidden states ``[B, L, dim]`` and this pass's
        top-layer KV. With ``cache`` (``B == 1``) the warmup/top layers' K/V are written for sequence ``b``.
        """
        c = self.config.llama
        B, L = tokens.shape
        positions = torch.arange(L, device=tokens.device)
        x = self.tok_embeddings(tokens).reshape(B * L, c.dim)                   # [B*L, dim]
        cos, sin = self._rope(positions.repeat(B), x.dtype)                      # [B*L, D]
        if top_kv is None:
            zeros = x.new_zeros(B, L, c.n_kv_heads, c.head_dim)
            top_kv = (zeros, zeros)
        new_kv = top_kv
        for l, layer in enumerate(self.layers):
            if isinstance(layer, QueryBlock):
                q = layer.q(x, cos, sin).view(B, L, c.n_heads, c.head_dim)
                attn = _attention(q, *top_kv, scale=self.scale, strict=True)
            else:
                q, k, v = (t.view(B, L, -1, c.head_dim) for t in layer.qkv(x, cos, sin))
                if l == self.top:
                    new_kv = (k, v)
                if self.config.is_warmup(l):
                    attn = _attention(q, k, v, scale=self.scale, strict=False)
                else:
                    attn = _attention(q, *top_kv, scale=self.scale, strict=True)
                if cache is not None:
                    cache.prefill_layer(self.kv_cache_layers[l], b, q[0], k[0], v[0], positions,
                                        scale=self.scale)
            attn_out = layer.wo(attn.reshape(B * L, -1))                         # [B*L, dim]
            if cache is not None and l in self.kv_cache_layers:  # the observation point
                cache.observe(self.kv_cache_layers[l], b, x, attn_out)
            x = x + attn_out
            x = x + layer.mlp(x)
            if on_layer is not None:
                on_layer(l)
        return x.view(B, L, c.dim), new_kv

    def iterate(self, tokens: Tensor, iterations: int, *, grad_iterations: int = 0,
                trace: bool = False) -> tuple[Tensor, list[float]]:
        """Run ``iterations`` parallel passes over ``tokens [B, L]``; logits ``[B, L, V]`` of the last.

        Only the last ``grad_iterations`` passes record gradients (the first ones run under ``no_grad``).
        With ``trace`` the second value lists, per pass after the first, the mean squared change of the
        top-layer K and V from the previous pass (the paper's KV-convergence measure, Fig. 3); else ``[]``.
        """
        if iterations < 1 or not 0 <= grad_iterations <= iterations:
            raise ValueError(f"iterations={iterations} must be >= 1 and grad_iterations={grad_iterations} in "
                             f"[0, iterations]")
        kv: tuple[Tensor, Tensor] | None = None
        changes: list[float] = []
        for it in range(iterations):
            with torch.set_grad_enabled(torch.is_grad_enabled() and it >= iterations - grad_iterations):
                x, new_kv = self._pass(tokens, kv)
            if trace and kv is not None:
                changes.append(float(sum(F.mse_loss(n.detach().float(), o.detach().float())
                                         for n, o in zip(new_kv, kv)) / 2))
            kv = new_kv
        return self.output(self.norm(x)), changes

    def loss(self, tokens: Tensor) -> Tensor:
        """Next-token cross entropy of ``tokens [B, L]`` after ``m + b`` passes, gradients through ``b``."""
        cfg = self.config
        logits, _ = self.iterate(tokens, cfg.iterations, grad_iterations=cfg.backward_iterations)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())

    # --- initialisation from a standard Llama (paper Appendix C.1) ------------------------------------
    @classmethod
    def from_llama(cls, llama: Llama, *, warmup_bottom: int = 1, warmup_top: int = 1,
                   forward_iterations: int = 7, backward_iterations: int = 2) -> LCKV:
        """Initialise from a pre-trained :class:`~kvmodels.llama.Llama`: every weight is copied, except the
        K/V projections of condensed layers, which LCKV does not have (Appendix C.1: "ignore")."""
        cfg = LCKVConfig(llama=llama.config, warmup_bottom=warmup_bottom, warmup_top=warmup_top,
                         forward_iterations=forward_iterations, backward_iterations=backward_iterations)
        param = next(llama.parameters())
        model = cls(cfg).to(device=param.device, dtype=param.dtype)
        c = cfg.llama
        state = {}
        for name, t in llama.state_dict().items():
            parts = name.split(".")
            if parts[0] == "layers" and parts[2] == "wqkv" and not cfg.has_kv(int(parts[1])):
                state[f"layers.{parts[1]}.wq.weight"] = t[: c.n_heads * c.head_dim]
            else:
                state[name] = t
        model.load_state_dict(state)
        return model.eval()


def train_step(model: LCKV, optimizer: torch.optim.Optimizer, tokens: Tensor, *, max_grad_norm: float = 1.0
               ) -> float:
    """One optimisation step on ``tokens [B, L]`` (``model.loss``, gradient clipping); returns the loss."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = model.loss(tokens)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return float(loss.detach())
