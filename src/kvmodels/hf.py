"""Any ``transformers`` decoder on the paged cache, through its attention interface.

:func:`kvmodels.from_transformers` converts the architectures kvmodels implements itself (Llama, GPT-J, MPT)
into its own models. :func:`wrap_transformers` runs the others as they are (Qwen2, Qwen3, Mistral, Phi-3,
Granite, ...: every decoder whose attention layers call ``transformers``' attention interface), without
copying their weights: the model computes its projections, norms and rotary embeddings, and an attention
function registered with ``transformers.AttentionInterface`` hands each layer's rotated queries, keys and
values to the cache where kvmodels' own models call it (:class:`kvmodels.generate.CausalLM`). So every policy
and storage (quantized pages included), extensions, sessions and the compiled decode step run on these models
through :func:`kvmodels.generate` and :class:`kvmodels.Decoder`:

    >>> model = wrap_transformers(AutoModelForCausalLM.from_pretrained(path))
    >>> generate(model, [ids], 64, compose("snapkv", "zipcache", budget=0.2))

The attention implementation is switched for the duration of each call only: between calls the model is the
user's, unchanged. Models with sliding-window or hybrid layers are refused, as in the transformers bridge
(``kvpolicies.hf``), whose model discovery this module shares.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvmodels.generate import CacheLayout
from kvpolicies.hf.models import UnsupportedModelError, attention_layers

#: The name the attention function is registered under with ``transformers.AttentionInterface``.
ATTENTION = "kvmodels_paged"
NATIVE = "Llama, GPT-J and MPT models: kvmodels.from_transformers converts them to kvmodels' own"


@dataclass
class _Call:
    """What the attention function does in the current forward of one wrapped model."""

    cache: Any = None
    mode: str = ""  # "prefill", "extend" or "decode"; "" outside a call
    b: int = 0  # the sequence of a prefill or extension
    positions: Tensor | None = None  # [L] (prefill, extension) or [B] (decode)
    layers_seen: int = 0
    h_in: Tensor | None = None  # the current layer's input hidden state, for cache.observe


def paged_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """The attention function registered as :data:`ATTENTION`: ``query [B, Hq, L, D]`` and this forward's
    ``key``/``value [B, Hkv, L, D]`` (rotated) -> ``[B, L, Hq, D]``, stored, scored and attended by the cache.
    ``attention_mask`` is unused: the cache knows every sequence's kept tokens."""
    call: _Call | None = getattr(module, "_kvmodels_call", None)
    if call is None or not call.mode:
        raise RuntimeError(f"attention implementation {ATTENTION!r} runs only inside a wrap_transformers "
                           "model's prefill or decode_step; use attn_implementation='sdpa' for other calls")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} passes {name}={kwargs[name]!r} to its attention; the paged cache "
                "attends over every kept token with a plain softmax")
    l: int = module._kvmodels_layer  # type: ignore[assignment]
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    call.layers_seen += 1
    if call.mode == "decode":
        q = query[:, :, 0]  # [B, Hq, D]
        call.cache.append(l, key[:, :, 0], value[:, :, 0], call.positions, q=q)
        return call.cache.attend(l, q, call.positions, scale=scale)[:, None], None
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [L, H, D]
    attend = call.cache.prefill_attend if call.mode == "prefill" else call.cache.extend_attend
    return attend(l, call.b, q, k, v, call.positions, scale=scale)[None], None


class TransformersModel(torch.nn.Module):
    """A ``transformers`` causal LM as a :class:`kvmodels.generate.CausalLM`; ``.hf`` is the model.

    Built by :func:`wrap_transformers` (see the module docstring).
    """

    #: ``prefill(..., start > 0)`` continues a cached sequence (``kvmodels.Decoder.extend``).
    can_extend = True

    def __init__(self, hf: Any) -> None:  # a transformers PreTrainedModel
        super().__init__()
        from transformers import AttentionInterface

        self.hf = hf
        self.config = hf.config.get_text_config(decoder=True)
        # the decoder layers and attention modules; refuses encoder-decoders and sliding / hybrid layers
        _, self._layers, self._attns, positions = attention_layers(hf)
        modeling = sys.modules[type(self._attns[0]).__module__]
        if not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS"):  # MPT; GPT-J before transformers 5.24
            raise UnsupportedModelError(
                f"{type(self._attns[0]).__name__} does not call transformers' attention interface, which "
                f"wrap_transformers needs; {NATIVE}")
        c, hq = self.config, self.config.num_attention_heads
        self._layout = CacheLayout(n_layers=len(self._attns), n_q_heads=hq,
                                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // hq,
                                   n_kv_heads=getattr(c, "num_key_value_heads", None) or hq)
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
        with self._paged(cache, "extend" if start else "prefill", positions, b, on_layer):
            out = self.hf(input_ids=tokens[None], position_ids=positions[None], use_cache=False,
                          logits_to_keep=1 if last_only else 0)
        return out.logits[0]

    def decode_step(self, tokens: Tensor, positions: Tensor, cache: Any) -> Tensor:
        """One token for every sequence of the batch, as :meth:`kvmodels.llama.Llama.decode_step`."""
        with self._paged(cache, "decode", positions, 0, None):
            out = self.hf(input_ids=tokens[:, None], position_ids=positions[:, None], use_cache=False)
        return out.logits[:, -1]

    # --- one forward on the paged cache ---------------------------------------------------------------
    @contextlib.contextmanager
    def _paged(self, cache: Any, mode: str, positions: Tensor, b: int,
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
