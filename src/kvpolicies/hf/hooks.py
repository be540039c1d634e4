"""The bridge's hooks on a model: they feed a :class:`~kvpolicies.hf.cache.PolicyCache` what ``update()``
alone does not see.

:meth:`Hooks.on` installs them once per model (idempotently); they are inert for any call that does not carry
a cache built for this model (``cache.hooks is self``). What they capture, per forward, goes into the cache's
``captures``; the only state here is the cache whose forward is running (a user's forwards do not nest; a
reconstruction pass, kvzip's, runs as the cache's own forward of the base model from within the next forward's
first hook, and leaves that state as it found it):

* the base model: the 2-D padding mask, positions and token ids (``cache.begin_forward``), and the end of the
  forward;
* each decoder layer's input and its attention's output: the residual stream around the attention
  (SqueezeAttention's cos-sim, during the prefill);
* each attention: the rotary inputs, and its mask replaced by the cache's per-layer one (after compression
  layers differ in length); the ``q_proj``/``k_proj`` outputs, from which the cache rebuilds the queries;
* MPT's attention indexes ALiBi by the physical cache slot, which is wrong once tokens are evicted, so for
  MPT the bridge runs its own attention (same math, bias from each slot's original position);
* ``model.generate`` tells a cache passed to it the generation length it resolves (Keyformer's schedule and
  the layer-budget cap read it), so ``hf_cache(policy, model)`` needs no ``max_new_tokens``.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
import torch.nn.functional as F

from kvpolicies.hf.models import Family, family

# What forward passes call the cache: ``cache`` from transformers 5.24 on (``past_key_values`` is deprecated
# there), ``past_key_values`` before; MPT's blocks hand it to their attention as ``layer_past``.
CACHE_NAMES = ("cache", "past_key_values", "layer_past")


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword this model's ``generate`` takes a cache by (``cache`` from transformers 5.24 on)."""
    params = inspect.signature(model.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


class Hooks:
    """The bridge's hooks on one model (``model._kvpolicies_hooks``). Build with :meth:`on`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.family: Family = family(model)
        self.active: Any = None  # the cache whose forward is running
        fam = self.family
        self.handles = [
            fam.base.register_forward_pre_hook(self._base_pre, with_kwargs=True),
            fam.base.register_forward_hook(self._base_post, with_kwargs=True),
        ]
        for l, (layer, attn) in enumerate(zip(fam.layers, fam.attns)):
            self.handles += [
                layer.register_forward_pre_hook(functools.partial(self._layer_pre, l), with_kwargs=True),
                attn.register_forward_pre_hook(functools.partial(self._attn_pre, l), with_kwargs=True),
                attn.register_forward_hook(functools.partial(self._attn_post, l), with_kwargs=True),
            ]
            if fam.kind == "mpt":
                attn._kvp_forward = attn.forward
                attn.forward = types.MethodType(functools.partial(_mpt_forward, self), attn)
            else:
                self.handles += [attn.q_proj.register_forward_hook(functools.partial(self._proj, "q", l)),
                                 attn.k_proj.register_forward_hook(functools.partial(self._proj, "k", l))]
        # The keyword the base model's forward takes a cache by (a reconstruction pass calls it).
        takes_cache = "cache" in inspect.signature(fam.base.forward).parameters  # transformers >= 5.24
        self.base_cache_kwarg = "cache" if takes_cache else "past_key_values"
        self.saved_generate = model.__dict__.get("generate")  # an instance override to restore, if any
        model.generate = self._length_aware(model.generate)

    @classmethod
    def on(cls, model: torch.nn.Module) -> Hooks:
        """The hooks installed on ``model``, installing them the first time."""
        hooks = model.__dict__.get("_kvpolicies_hooks")
        if hooks is None:
            hooks = model._kvpolicies_hooks = cls(model)
        return hooks

    def remove(self) -> None:
        """Take every hook off the model and restore its ``generate`` and MPT's attention."""
        for h in self.handles:
            h.remove()
        if self.saved_generate is None:
            del self.model.generate
        else:
            self.model.generate = self.saved_generate
        if self.family.kind == "mpt":
            for attn in self.family.attns:
                del attn.forward
                del attn._kvp_forward
        del self.model._kvpolicies_hooks

    def cache_in(self, kwargs: dict[str, Any]) -> Any:
        """The cache built for this model that the call carries, or None."""
        for name in CACHE_NAMES:
            c = kwargs.get(name)
            if getattr(c, "hooks", None) is self:
                return c
        return None

    # --- the hooks ---------------------------------------------------------------------------------
    def _base_pre(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        cache = self.cache_in(kwargs)
        if cache is None:
            return
        if kwargs.get("use_cache") is False:
            # generate would re-feed the whole sequence every step and the cache hold it many times over.
            raise ValueError(
                "a PolicyCache needs use_cache=True; pass generate(..., use_cache=True) (MPT configs "
                "default to use_cache=False)"
            )
        ids = x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs["inputs_embeds"]
        cache.begin_forward(x.shape[0], x.shape[1], x.device, kwargs.get("attention_mask"),
                            kwargs.get("position_ids"), ids)
        self.active = cache

    def _base_post(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        cache = self.cache_in(kwargs)
        if cache is None:
            return
        self.active = None
        cache.end_forward()

    def _layer_pre(self, l: int, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        cache = self.active
        if cache is not None and cache.observes:
            cache.captures[("h_in", l)] = kwargs.get("hidden_states", args[0] if args else None)

    def _attn_pre(
        self, l: int, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]] | None:
        cache = self.cache_in(kwargs)
        if cache is None:
            return None
        ctx = cache.captures
        ctx["position_embeddings"] = kwargs.get("position_embeddings")
        ctx["position_ids"] = kwargs.get("position_ids")
        if cache.prefilled and self.family.kind != "mpt":
            # GPT-J before transformers 5.24 ran its own eager attention on a float32 additive mask; from 5.24
            # on it goes through the attention interface like Llama.
            legacy = self.family.kind == "gptj" and hasattr(module, "scale_attn")
            kind = "eager" if legacy else module.config._attn_implementation
            dtype = torch.float32 if legacy else args[0].dtype if args else kwargs["hidden_states"].dtype
            kwargs["attention_mask"] = cache.layer_mask(cache.layers[l], ctx["q_len"], kind, dtype)
        return args, kwargs

    def _attn_post(self, l: int, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
                   output: Any) -> None:
        cache = self.cache_in(kwargs)
        if cache is None or not cache.observes:
            return
        h_in = cache.captures.pop(("h_in", l), None)
        if h_in is not None:
            cache.record_cos(l, h_in, output[0])

    def _proj(self, which: str, l: int, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self.active is not None and self.active.needs_queries:
            self.active.captures[(which, l)] = output

    def _length_aware(self, generate: Any) -> Any:
        """``model.generate`` that tells a cache passed to it the generation length (when it has none)."""

        @functools.wraps(generate)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            cache = self.cache_in(kwargs)
            if cache is not None and cache.max_new_tokens is None:
                cache.max_new_tokens = generation_length(self.model, args, kwargs)
            return generate(*args, **kwargs)

        return wrapped


def generation_length(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> int | None:
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


def _mpt_forward(
    hooks: Hooks,
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
    if getattr(found, "hooks", None) is not hooks:  # both versions take the cache third, the mask fourth
        return self._kvp_forward(hidden_states, position_bias, found, attention_mask, *args[2:], **kwargs)
    cache = found
    B, q_len = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (t.reshape(B, q_len, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
    # position_bias is [H, 1, S] = slope * (j - (S - 1)): the slope is minus its second-to-last entry.
    slopes = -position_bias[:, 0, -2].float()  # [H]
    cache.captures["slopes"] = slopes
    layer = cache.layers[self.layer_idx]
    mask = cache.layer_mask(layer, q_len, "mpt", q.dtype)  # [B, 1, q, N + q], True = masked out
    # The layer's own update: Cache.update forwards extra keywords only from transformers 5.3 on.
    k, v = layer.update(k, v, query=q)
    scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale  # [B, H, q, N + q]
    # Bias relative to the last query of the chunk (a per-row constant away from the true distance, which
    # softmax ignores) so that an uncompressed cache reproduces the stock module's numbers.
    rel = cache.key_positions(layer)[:, :, None, :] - cache.step.positions[:, -1, None, None, None]
    # rel: [B, H, 1, N + q]
    scores = scores + slopes.view(1, -1, 1, 1) * rel.to(slopes.dtype)
    scores = scores.masked_fill(mask, torch.finfo(q.dtype).min)
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    weights = F.dropout(weights, p=self.attn_dropout_p, training=self.training)
    ctx_states = torch.matmul(weights, v).permute(0, 2, 1, 3).reshape(B, q_len, -1)
    return self.out_proj(ctx_states), weights
