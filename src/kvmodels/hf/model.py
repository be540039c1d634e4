"""A ``transformers`` model as a kvmodels model (:class:`TransformersModel`, :func:`wrap_transformers`): its
attention routed to the paged cache through transformers' attention interface (:func:`paged_attention`), or
through MPT's and old GPT-J's own attention methods (:func:`mpt_attention`, :func:`gptj_attention`)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface

from kvmodels.generate import CacheLayout
from kvmodels.mpt import alibi_causal_attention, alibi_slopes

ATTENTION = "kvmodels_paged"
NATIVE = "Llama, GPT-J and MPT models: kvmodels.from_transformers converts them to kvmodels' own"


class UnsupportedModelError(ValueError):
    """A model this module cannot run on the paged cache; the message says why and what to do."""

# --- the model's parts ----------------------------------------------------------------------------------

def sliding_windows(model: Any) -> tuple[int, ...]:
    """Each decoder layer's sliding window ``W`` (it attends to its last ``W`` tokens, itself included: the
    mask transformers builds from ``config.sliding_window``), 0 for a layer that attends to every token;
    ``()`` when no layer has a window. ``config.layer_types`` says which layers slide (Gemma 2 and 3,
    Cohere 2, ...), else every layer does when ``sliding_window`` is set and ``use_sliding_window`` is not
    off (Mistral).
    :class:`UnsupportedModelError` for other layer types (chunked, linear or state-space layers)."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None)
    use = getattr(config, "use_sliding_window", True) is not False
    if layer_types:
        other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if other:
            raise UnsupportedModelError(
                f"{type(model).__name__} has {other} layers (layer_types); the paged cache runs layers of "
                "full or sliding-window attention")
        if "sliding_attention" not in layer_types or not use:
            return ()
        if not isinstance(sliding, int) or isinstance(sliding, bool) or sliding < 2:
            raise UnsupportedModelError(f"{type(model).__name__}: sliding_attention layers with "
                                        f"sliding_window={sliding!r}; expected an int >= 2")
        return tuple(sliding if t == "sliding_attention" else 0 for t in layer_types)
    if sliding is None or not use:
        return ()
    return (int(sliding),) * int(config.num_hidden_layers)


def attention_layers(model: Any) -> tuple[Any, list[Any], list[Any], int | None]:
    """A decoder-only model's base module, decoder layers, their attention modules and the positions it was
    built for; :class:`UnsupportedModelError` for an encoder-decoder model (sliding-window layers:
    :func:`sliding_windows`)."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(model).__name__} is an encoder-decoder model; the paged cache "
                                    "runs decoder-only causal LMs (AutoModelForCausalLM)")
    base, n = getattr(model, "base_model", model), config.num_hidden_layers
    layers = next((m for m in (getattr(base, name, None) for name in ("layers", "h", "blocks"))
                   if isinstance(m, torch.nn.ModuleList) and len(m) == n), None)
    if layers is None:
        raise UnsupportedModelError(f"{type(model).__name__}: could not find its {n} decoder layers (looked "
                                    "for base_model.layers / .h / .blocks)")
    attns = []
    for layer in layers:
        attn = next((getattr(layer, a) for a in ("self_attn", "attn", "attention") if hasattr(layer, a)),
                    None)
        if attn is None:
            raise UnsupportedModelError(f"{type(layer).__name__} has no self_attn / attn module")
        attns.append(attn)
    names = ("max_position_embeddings", "n_positions", "max_seq_len")
    positions = next((int(getattr(config, a)) for a in names if getattr(config, a, None) is not None), None)
    return base, list(layers), attns, positions

# --- the attention, routed to the paged cache -----------------------------------------------------------

@dataclass
class _Call:
    """What the attention function does in the current forward of one wrapped model."""

    cache: Any = None
    mode: str = ""  # "prefill", "extend" or "decode"; "" outside a call
    b: int = 0  # the sequence of a prefill or extension
    positions: Tensor | None = None  # [L] (prefill, extension) or [B] (decode)
    layers_seen: int = 0
    h_in: Tensor | None = None  # the current layer's input hidden state, for cache.observe


def _active_call(module: Any) -> _Call | None:
    """The wrapped model's call ``module`` is inside, or ``None`` outside one."""
    call: _Call | None = getattr(module, "_kvmodels_call", None)
    return call if call is not None and call.mode else None


def _cached_attention(module: Any, call: _Call, q: Tensor, k: Tensor, v: Tensor, scale: float,
                      alibi_slopes: Tensor | None = None) -> Tensor:
    """One layer's rotated ``q [B, L, Hq, D]`` and this forward's ``k``/``v [B, L, Hkv, D]`` stored, scored
    and attended by the cache at the calls kvmodels' own models make -> ``[B, L, Hq, D]``: ``append`` +
    ``attend`` per decode step, ``extend_attend`` for an extension, ``prefill_attend`` for a prompt (with
    ALiBi ``prefill_layer`` and the model's own causal attention, as :class:`kvmodels.mpt.MPT`)."""
    l: int = module._kvmodels_layer
    call.layers_seen += 1
    if call.mode == "decode":  # (a sliding-window layer holds only its window: the cache evicts each step)
        call.cache.append(l, k[:, 0], v[:, 0], call.positions, q=q[:, 0])
        return call.cache.attend(l, q[:, 0], call.positions, scale=scale, alibi_slopes=alibi_slopes)[:, None]
    q, k, v = q[0], k[0], v[0]  # [L, H, D]: one sequence
    window = call.cache.window(l)
    if window and call.mode == "prefill":  # stored (and compressed to its window later); attends in its band
        call.cache.prefill_layer(l, call.b, q, k, v, call.positions, scale=scale)
        out = sliding_causal_attention(q, k, v, window, scale=scale)
    elif call.mode == "extend":
        out = call.cache.extend_attend(l, call.b, q, k, v, call.positions, scale=scale,
                                       alibi_slopes=alibi_slopes)
    elif alibi_slopes is None:
        out = call.cache.prefill_attend(l, call.b, q, k, v, call.positions, scale=scale)
    else:
        call.cache.prefill_layer(l, call.b, q, k, v, call.positions, scale=scale, alibi_slopes=alibi_slopes)
        out = alibi_causal_attention(q, k, v, alibi_slopes, scale=scale)
    return out[None]


def sliding_causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int, *, scale: float,
                             block: int = 512) -> Tensor:
    """One sequence's causal attention in a sliding window: ``q [L, Hq, D]``, ``k``/``v [L, Hkv, D]`` ->
    ``[L, Hq, D]``, query ``i`` attending to keys ``j`` with ``i - window < j <= i`` (transformers' sliding
    mask). ``block`` query rows at a time over the keys their windows reach, so memory is
    ``O(block * (block + window))`` per head, not ``O(L^2)``."""
    L = q.shape[0]
    out = torch.empty_like(q)
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, D]
    for start in range(0, L, block):
        end = min(start + block, L)
        lo = max(0, start - window + 1)  # the first key the block's first query sees
        i = torch.arange(start, end, device=q.device)[:, None]
        j = torch.arange(lo, end, device=q.device)[None, :]
        band = (j <= i) & (j > i - window)  # [rows, keys]
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            qh[:, :, start:end], kh[:, :, lo:end], vh[:, :, lo:end], attn_mask=band, scale=scale,
            enable_gqa=True)[0].transpose(0, 1)
    return out


def paged_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """The attention function registered as :data:`ATTENTION`: ``query [B, Hq, L, D]`` and this forward's
    ``key``/``value [B, Hkv, L, D]`` (rotated) -> ``[B, L, Hq, D]``, stored, scored and attended by the cache.
    ``attention_mask`` is unused: the cache knows every sequence's kept tokens."""
    call = _active_call(module)
    if call is None:
        raise RuntimeError(f"attention implementation {ATTENTION!r} runs only inside a wrap_transformers "
                           "model's prefill or decode_step; use attn_implementation='sdpa' for other calls")
    window = kwargs.get("sliding_window")
    layer_window = call.cache.window(module._kvmodels_layer)
    if (window or 0) != layer_window:
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {module._kvmodels_layer}) attends with "
            f"sliding_window={window!r}, and its cache was built with window {layer_window} (0: none) from "
            "the model's config (layer_types, sliding_window); build the cache from this model "
            "(kvmodels.Decoder, paged_cache)")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} passes {name}={kwargs[name]!r} to its attention; the paged cache "
                "attends over every kept token with a plain softmax")
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, L, H, D]
    return _cached_attention(module, call, q, k, v, scale), None


def mpt_attention(module: Any, original: Callable[..., Any], hidden_states: Tensor, *args: Any,
                  **kwargs: Any) -> tuple[Tensor, None]:
    """``MptAttention.forward`` on the paged cache (MPT's attention computes ALiBi itself instead of calling
    the attention interface): its ``Wqkv`` projection, clipped as MPT clips it, and the cache's ALiBi
    attention from each kept token's original position (:func:`_cached_attention`). Outside a wrapped
    model's call, the model's own forward (``original``)."""
    call = _active_call(module)
    if call is None:
        return original(hidden_states, *args, **kwargs)
    B, L, _ = hidden_states.shape
    H, D = module.n_heads, module.head_dim
    qkv = module.Wqkv(hidden_states)
    if module.clip_qkv:
        qkv = qkv.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    q, k, v = (x.reshape(B, L, H, D).contiguous() for x in qkv.chunk(3, dim=2))
    slopes = module.__dict__.get("_kvmodels_slopes")
    if slopes is None or slopes.device != q.device:  # built once per device (transformers' MPT: bias max 8)
        slopes = module._kvmodels_slopes = alibi_slopes(H).to(q.device)
    out = _cached_attention(module, call, q, k, v, float(module.softmax_scale), slopes)
    return module.out_proj(out.reshape(B, L, H * D)), None


def gptj_attention(module: Any, original: Callable[..., Any], query: Tensor, key: Tensor,
                   value: Tensor, attention_mask: Any = None, *args: Any,
                   **kwargs: Any) -> tuple[Tensor, None]:
    """``GPTJAttention._attn`` before transformers 5.24 (whose GPT-J does not call the attention interface):
    the rotated ``query``/``key`` and ``value [B, H, L, D]`` it is handed go to :func:`paged_attention`, at
    its softmax scale; outside a wrapped model's call, the model's own ``_attn`` (``original``)."""
    if _active_call(module) is None:
        return original(query, key, value, attention_mask, *args, **kwargs)
    out, _ = paged_attention(module, query, key, value, None, scaling=1.0 / float(module.scale_attn))
    return out.transpose(1, 2), None  # [B, H, L, D], as _attn returns it


def _route(attns: list[Any], name: str, fn: Callable[..., Any]) -> None:
    """Each attention module's method ``name`` becomes ``fn`` over it and the original, once per module (a
    stable function: a compiled decode step keeps its guards)."""
    for attn in attns:
        if name not in attn.__dict__:
            setattr(attn, name, functools.partial(fn, attn, getattr(attn, name)))


class TransformersModel(torch.nn.Module):
    """A ``transformers`` causal LM as a :class:`kvmodels.generate.CausalLM`; ``.hf`` is the model.

    Built by :func:`wrap_transformers` (see the module docstring).
    """

    #: ``prefill(..., start > 0)`` continues a cached sequence (``kvmodels.Decoder.extend``).
    can_extend = True

    def __init__(self, hf: Any) -> None:  # a transformers PreTrainedModel
        super().__init__()
        self.hf = hf
        self.config = hf.config.get_text_config(decoder=True)
        windows = sliding_windows(hf)  # refuses layers of other kinds (linear, chunked, state-space)
        # the decoder layers and attention modules; refuses encoder-decoders
        _, self._layers, self._attns, positions = attention_layers(hf)
        modeling = sys.modules[type(self._attns[0]).__module__]
        # MPT, and GPT-J before transformers 5.24, attend in code of their own: routed at their own methods
        self._own_attention = not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS")
        cls = type(self._attns[0]).__name__
        if cls == "MptAttention":
            _route(self._attns, "forward", mpt_attention)
        elif cls == "GPTJAttention" and self._own_attention:
            _route(self._attns, "_attn", gptj_attention)
        elif self._own_attention:
            raise UnsupportedModelError(
                f"{cls} does not call transformers' attention interface, which wrap_transformers needs; "
                f"{NATIVE}")
        c, hq = self.config, self.config.num_attention_heads
        self._layout = CacheLayout(n_layers=len(self._attns), n_q_heads=hq,
                                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // hq,
                                   n_kv_heads=getattr(c, "num_key_value_heads", None) or hq,
                                   windows=windows, alibi=cls == "MptAttention")
        self._max_positions = positions or 2048
        self._call = _Call()
        for l, attn in enumerate(self._attns):
            attn._kvmodels_layer = l
        AttentionInterface.register(ATTENTION, paged_attention)

    # --- the model protocol ---------------------------------------------------------------------------
    @property
    def n_cache_layers(self) -> int:
        return self._layout.n_layers

    @property
    def max_seq_len(self) -> int:
        return self._max_positions

    def cache_layout(self) -> CacheLayout:
        return self._layout

    def prefill(self, tokens: Tensor, cache: Any, b: int, *, start: int = 0, last_only: bool = False,
                on_layer: Callable[[int], None] | None = None) -> Tensor:
        """One sequence's prompt (``start == 0``) or extension, as :meth:`kvmodels.llama.Llama.prefill`;
        ``cache=None`` is the model's own forward pass."""
        positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)
        if cache is None:
            if start:
                raise ValueError(f"start={start} continues a cached sequence; pass its cache")
            logits = self.hf(input_ids=tokens[None], position_ids=positions[None], use_cache=False).logits[0]
            return logits[-1:] if last_only else logits
        with self.paged(cache, "extend" if start else "prefill", positions, b, on_layer):
            out = self.hf(input_ids=tokens[None], position_ids=positions[None], use_cache=False,
                          logits_to_keep=1 if last_only else 0)
        return out.logits[0]

    def decode_step(self, tokens: Tensor, positions: Tensor, cache: Any) -> Tensor:
        """One token for every sequence of the batch, as :meth:`kvmodels.llama.Llama.decode_step`."""
        with self.paged(cache, "decode", positions, 0, None):
            out = self.hf(input_ids=tokens[:, None], position_ids=positions[:, None], use_cache=False)
        return out.logits[:, -1]

    # --- one forward on the paged cache ---------------------------------------------------------------
    @contextlib.contextmanager
    def paged(self, cache: Any, mode: str, positions: Tensor, b: int,
              on_layer: Callable[[int], None] | None) -> Iterator[None]:
        """The model's attention goes to ``cache`` for one forward; its observation point, outside decoding,
        hands the policy each layer's input and attention output (``cache.observe``)."""
        call, config, saved = self._call, self.config, self.config._attn_implementation
        hooks = []
        if mode != "decode":
            for l, (layer, attn) in enumerate(zip(self._layers, self._attns, strict=True)):
                hooks.append(layer.register_forward_pre_hook(self._save_input, with_kwargs=True))
                hooks.append(attn.register_forward_hook(self._observer(l, on_layer)))
        for attn in self._attns:  # this wrapper's, even when the same model is wrapped twice
            attn._kvmodels_call = call
        call.cache, call.mode, call.positions, call.b, call.layers_seen = cache, mode, positions, b, 0
        if not self._own_attention:  # (MPT's, old GPT-J's mask code runs as it is: their routing ignores it)
            config._attn_implementation = ATTENTION
        try:
            yield
        finally:
            config._attn_implementation = saved
            call.cache, call.mode, call.positions, call.h_in = None, "", None, None
            for h in hooks:
                h.remove()
        if mode != "decode" and call.layers_seen != self._layout.n_layers:  # (a compiled step: no count)
            raise UnsupportedModelError(
                f"{type(self.hf).__name__}: {call.layers_seen} of its {self._layout.n_layers} attention "
                f"layers called transformers' attention interface; wrap_transformers needs all; {NATIVE}")

    def _save_input(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._call.h_in = args[0] if args else kwargs["hidden_states"]

    def _observer(self, l: int, on_layer: Callable[[int], None] | None) -> Callable[..., None]:
        def observe(module: torch.nn.Module, args: Any, output: Any) -> None:
            call = self._call
            attn_out = output[0] if isinstance(output, tuple) else output  # after the output projection
            assert call.h_in is not None
            call.cache.observe(l, call.b, call.h_in[0], attn_out[0])
            if on_layer is not None:
                on_layer(l)
        return observe


def wrap_transformers(model: Any) -> TransformersModel:
    """``model``, a ``transformers`` decoder-only causal LM, as a kvmodels model on the paged cache."""
    return TransformersModel(model)
