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

MPT (ALiBi), and GPT-J before transformers 5.24, attend in code of their own instead of calling the
interface: the wrapped model routes their attention methods (:func:`mpt_attention`,
:func:`gptj_attention`).

The attention implementation is switched for the duration of each call only: between calls the model is the
user's, unchanged (the routed methods call the model's own outside a call). Models with sliding-window
or hybrid layers are refused, as in the transformers bridge (``kvpolicies.hf``), whose model discovery this
module shares. :func:`paged_cache` and :func:`compressed` run the same inside ``model.generate``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface, Cache

from kvmodels.generate import CacheLayout
from kvmodels.mpt import alibi_causal_attention, alibi_slopes
from kvpolicies.hf.hooks import cache_kwarg, generation_length
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


def mpt_attention(module: Any, original: Callable[..., Any], hidden_states: Tensor, *args: Any,
                  **kwargs: Any) -> tuple[Tensor, None]:
    """``MptAttention.forward`` on the paged cache (MPT's attention computes ALiBi itself instead of calling
    the attention interface): its ``Wqkv`` projection, clipped as MPT clips it, and the cache's ALiBi
    attention from each kept token's original position, at the calls :class:`kvmodels.mpt.MPT` makes.
    Outside a wrapped model's call, the model's own forward (``original``)."""
    call: _Call | None = getattr(module, "_kvmodels_call", None)
    if call is None or not call.mode:
        return original(hidden_states, *args, **kwargs)
    B, L, _ = hidden_states.shape
    H, D = module.n_heads, module.head_dim
    qkv = module.Wqkv(hidden_states)
    if module.clip_qkv:
        qkv = qkv.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    q, k, v = (x.reshape(B, L, H, D).contiguous() for x in qkv.chunk(3, dim=2))
    l: int = module._kvmodels_layer  # type: ignore[assignment]
    scale, slopes = float(module.softmax_scale), alibi_slopes(H).to(q.device)  # transformers' MPT: bias max 8
    call.layers_seen += 1
    if call.mode == "decode":
        call.cache.append(l, k[:, 0], v[:, 0], call.positions, q=q[:, 0])
        out = call.cache.attend(l, q[:, 0], call.positions, scale=scale, alibi_slopes=slopes)  # [B, H, D]
    elif call.mode == "extend":
        out = call.cache.extend_attend(l, call.b, q[0], k[0], v[0], call.positions, scale=scale,
                                       alibi_slopes=slopes)
    else:
        call.cache.prefill_layer(l, call.b, q[0], k[0], v[0], call.positions, scale=scale,
                                 alibi_slopes=slopes)
        out = alibi_causal_attention(q[0], k[0], v[0], slopes, scale=scale)
    return module.out_proj(out.reshape(B, L, H * D)), None


def gptj_attention(module: Any, original: Callable[..., Any], query: Tensor, key: Tensor,
                   value: Tensor, attention_mask: Any = None, *args: Any,
                   **kwargs: Any) -> tuple[Tensor, None]:
    """``GPTJAttention._attn`` before transformers 5.24 (whose GPT-J does not call the attention interface):
    the rotated ``query``/``key`` and ``value [B, H, L, D]`` it is handed go to :func:`paged_attention`, at
    its softmax scale; outside a wrapped model's call, the model's own ``_attn`` (``original``)."""
    call: _Call | None = getattr(module, "_kvmodels_call", None)
    if call is None or not call.mode:
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
        # the decoder layers and attention modules; refuses encoder-decoders and sliding / hybrid layers
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


# --- model.generate on the paged cache ------------------------------------------------------------------

def _generate_hooks(hf: Any) -> None:
    """Install, once per model, the forward hooks through which a :class:`PagedCache` drives ``generate``'s
    forwards; inert for a forward without one."""
    if getattr(hf, "_kvmodels_generate_hooks", False):
        return

    running: list[PagedCache | None] = []  # per forward in progress (the decoder's own forwards nest)

    def pre(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # 5.24's name, and the earlier one
        if not isinstance(cache, PagedCache) or cache.wrapped.hf is not module:  # not ours: update refuses
            running.append(None)  # a cache built for another model
            return None
        if args:
            raise TypeError("call the model with keyword arguments (input_ids=...) when it runs a PagedCache")
        running.append(None)  # what the forward hook pops, also when before_forward raises (always_call)
        kwargs = cache.before_forward(kwargs)
        running[-1] = cache
        return args, kwargs

    def post(module: Any, args: tuple, output: Any) -> Any:
        cache = running.pop()
        return output if cache is None else cache.after_forward(output)

    hf.register_forward_pre_hook(pre, with_kwargs=True)
    hf.register_forward_hook(post, always_call=True)  # also after a forward that raised (output None)
    generate = hf.generate

    @functools.wraps(generate)
    def length_aware(*args: Any, **kwargs: Any) -> Any:
        """``generate`` that tells a PagedCache built without ``max_new_tokens`` the length it resolves."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, PagedCache):
            if kwargs.setdefault("use_cache", True) is False:  # MPT's config defaults to False
                raise ValueError("use_cache=False with a PagedCache: generate would feed the whole sequence "
                                 "at every step; leave use_cache at True")
            if cache.learns_length:
                n = generation_length(hf, args, kwargs)
                if n is None or n < 1:
                    raise ValueError(f"generate resolves no positive max_new_tokens ({n}); pass "
                                     "max_new_tokens=")
                cache.max_new_tokens = n
        return generate(*args, **kwargs)

    hf.generate = length_aware
    hf._kvmodels_generate_hooks = True


class PagedCache(Cache):
    """A ``transformers`` cache whose tokens live in kvmodels' paged cache: ``model.generate(**inputs,
    past_key_values=cache)`` (``cache=`` from transformers 5.24 on) runs the policy through a
    :class:`kvmodels.Decoder` over the wrapped model. Built by :func:`paged_cache`.

    A prompt, and a later call's new tokens (a follow-up question), go to ``Decoder.extend``, one sequence at
    a time without its left padding; the forward transformers runs for them is cut to each row's last token
    and its logits replaced by the decoder's. Each decode step is transformers' own forward, its attention
    through the paged cache. A row that stops early keeps running, as in ``generate``'s own batches.
    """

    def __init__(self, model: Any, policy: Any, *, max_new_tokens: int | None = None,
                 max_tokens: int | None = None, seed: int = 0, probe_prefix: Sequence[int] = ()) -> None:
        from kvmodels.decoder import Decoder

        super().__init__(layers=[])
        for name, value in (("max_new_tokens", max_new_tokens), ("max_tokens", max_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.wrapped = model if isinstance(model, TransformersModel) else wrap_transformers(model)
        self.max_new_tokens, self.max_tokens = max_new_tokens, max_tokens
        self.learns_length = max_new_tokens is None  # each model.generate call sets max_new_tokens
        # checks the policy and probe prefix now; its pool is sized by the first prompts (before_forward)
        self.decoder = Decoder(self.wrapped, policy, seed=seed, probe_prefix=probe_prefix)
        self._width = 0  # columns of generate's input_ids consumed (left padding included)
        self._decoding_started = False  # the decoder's decode steps started since the last new tokens
        self._logits: Tensor | None = None  # [B, 1, V]: what a cut forward returns
        self._decoding: Any = None  # the attention routing of the decode step running
        self._failed = False  # a decode step raised part way through
        _generate_hooks(self.wrapped.hf)

    # --- what transformers asks ---------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width

    def get_mask_sizes(self, query_length: int | Tensor, layer_idx: int = 0) -> tuple[int, int]:
        if isinstance(query_length, Tensor):  # transformers before 5.24 passes cache_position
            query_length = query_length.shape[0]
        return self._width + int(query_length), 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:  # an attention cache: generate slices a continuation's inputs by it
        return [False]

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        if self._decoding is None:  # a forward the hooks did not route: another model, or a direct call
            raise RuntimeError("this PagedCache stores through the model it was built for, inside its "
                               "forward (model.generate or model(...)); build one per model with "
                               "paged_cache(model, policy)")
        return key_states, value_states  # stored by the attention function (paged_attention)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise NotImplementedError("PagedCache does not support beam search; use greedy decoding or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PagedCache does not support num_return_sequences > 1 or beam search")

    def report(self) -> Any:
        """The paged cache's :class:`kvmodels.cache.CacheReport`."""
        if self.decoder.cache is None:
            raise RuntimeError("report() before the cache held a prompt: run model.generate with it first")
        return self.decoder.cache.report()

    # --- one forward of generate ---------------------------------------------------------------------
    def before_forward(self, kwargs: dict) -> dict:
        """The forward's keyword arguments as the model should run them (the pre-hook)."""
        if self._failed:
            raise RuntimeError("a decode step of this PagedCache raised part way through, leaving its layers "
                               "out of step; start a new cache (paged_cache(model, policy))")
        if kwargs.get("return_dict") is False or "input_ids" not in kwargs:
            raise ValueError("a PagedCache runs forwards called with input_ids=... that return a ModelOutput "
                             "(not return_dict=False, not inputs_embeds), as generate calls them")
        if self.max_new_tokens is None:
            raise ValueError("this PagedCache was built without max_new_tokens, which model.generate tells "
                             "it; driving the model by hand, pass paged_cache(..., max_new_tokens=)")
        ids: Tensor = kwargs["input_ids"]
        B, L = ids.shape
        dec = self.decoder
        if dec.cache is not None and B != dec.batch_size:
            raise ValueError(f"input_ids has {B} rows; this PagedCache holds {dec.batch_size} sequences "
                             "(num_return_sequences and beam search are not supported)")
        if L == 1 and dec.cache is not None:  # a decode step: transformers' forward, attention paged
            if not self._decoding_started:
                dec.start_decode(self.max_new_tokens)
                self._decoding_started = True
            if dec.step >= self.max_new_tokens:
                raise ValueError(f"generate runs more steps than max_new_tokens={self.max_new_tokens}, the "
                                 "generation this PagedCache plans and holds room for; build it with "
                                 "generate's max_new_tokens")
            positions = dec.begin_step()
            self._decoding = self.wrapped._paged(dec.cache, "decode", positions, 0, None)
            self._decoding.__enter__()
            return {**kwargs, "position_ids": positions[:, None]}
        # a prompt, or new tokens after a generation: the decoder takes each row's own tokens
        mask = kwargs.get("attention_mask")
        real = torch.ones(B, L, dtype=torch.bool) if mask is None else mask[:, -L:].bool().cpu()
        rows = [ids[b][real[b].to(ids.device)].tolist() for b in range(B)]
        if not all(rows):
            raise ValueError(f"row {rows.index([])} of input_ids has no token that its attention_mask keeps")
        if dec.cache is None:  # the prompts size the pool: the longest plus the generation, or max_tokens
            dec.max_tokens = self.max_tokens or max(map(len, rows)) + self.max_new_tokens
        logits = dec.extend(rows, max_new_tokens=self.max_new_tokens)
        self._logits = torch.stack([x for x in logits if x is not None])[:, None]
        self._decoding_started, self._width = False, self._width + L
        cut = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "cache_position")}
        return {**cut, "input_ids": ids[:, -1:], "attention_mask": None, "use_cache": False,
                "position_ids": torch.zeros(B, 1, dtype=torch.int64, device=ids.device)}

    def after_forward(self, output: Any) -> Any:
        """The forward's output as ``generate`` should see it (the forward hook); ``None`` after a forward
        that raised: the model's attention is restored, nothing is counted."""
        if self._decoding is not None:  # a decode step
            routing, self._decoding = self._decoding, None
            routing.__exit__(None, None, None)
            if output is None:  # the step stopped part way: its layers hold different tokens
                self._failed = True
                return None
            self.decoder.end_step(range(self.decoder.batch_size))
            self._width += 1
        elif output is None:
            return None
        else:
            assert self._logits is not None
            output.logits = self._logits.to(output.logits.dtype)
        for f in dataclasses.fields(output):
            if f.name in ("cache", "past_key_values"):
                output[f.name] = self
        return output


def paged_cache(model: Any, policy: Any, *, max_new_tokens: int | None = None, max_tokens: int | None = None,
                seed: int = 0, probe_prefix: Sequence[int] = ()) -> PagedCache:
    """A ``transformers`` cache for ``model.generate`` that stores and attends through kvmodels' paged cache
    under ``policy`` (see :class:`PagedCache`).

    ``max_new_tokens``: the generation the policy plans for (Keyformer's schedule, the layer-budget cap) and
    the pool holds room for; ``model.generate`` tells it the length it resolves, so it is needed only to drive
    the model by hand. ``max_tokens``: the most tokens one layer of one sequence may hold (default: the
    longest prompt plus the first generation; raise it for follow-up questions on the same cache). ``seed``
    and ``probe_prefix`` as :class:`kvmodels.Decoder`'s."""
    return PagedCache(model, policy, max_new_tokens=max_new_tokens, max_tokens=max_tokens, seed=seed,
                      probe_prefix=probe_prefix)


@contextlib.contextmanager
def compressed(model: Any, policy: Any, *, max_tokens: int | None = None, seed: int = 0,
               probe_prefix: Sequence[int] = ()) -> Iterator[list[PagedCache]]:
    """Within the block, each ``model.generate`` call given no cache runs a fresh :func:`paged_cache` under
    ``policy`` (keywords as there). Yields the list of caches built so far (the latest call's last), for
    ``report()``; ``model.generate`` is restored on exit.

        >>> with compressed(model, compose("snapkv", budget=0.2)) as caches:
        ...     out = model.generate(**inputs, max_new_tokens=64)
        >>> caches[-1].report()
    """
    wrapped = model if isinstance(model, TransformersModel) else wrap_transformers(model)
    hf = wrapped.hf
    _generate_hooks(hf)
    caches: list[PagedCache] = []
    original, name = hf.generate, cache_kwarg(hf)

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
            kwargs[name] = paged_cache(wrapped, policy, max_tokens=max_tokens, seed=seed,
                                       probe_prefix=probe_prefix)
            caches.append(kwargs[name])
        return original(*args, **kwargs)

    hf.generate = generate
    try:
        yield caches
    finally:
        hf.generate = original
