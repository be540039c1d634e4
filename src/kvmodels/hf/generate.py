"""``model.generate`` on the paged cache: :class:`PagedCache`, a ``transformers.Cache`` that stores nothing
itself and drives a :class:`kvmodels.Decoder` over the wrapped model (:func:`paged_cache`,
:func:`compressed`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import Cache

from kvmodels.hf.model import TransformersModel, wrap_transformers


def cache_kwarg(model: Any) -> str:
    """The keyword this model's ``generate`` takes a cache by (``cache`` from transformers 5.24 on)."""
    params = inspect.signature(model.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def generation_length(model: Any, args: tuple, kwargs: dict[str, Any]) -> int | None:
    """How many tokens a ``model.generate(*args, **kwargs)`` call may produce, as transformers resolves it:
    ``max_new_tokens`` (keyword, then the ``generation_config`` given, then the model's), else ``max_length``
    minus the prompt's width."""
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    n = kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None))
    if n is None:
        max_length = kwargs.get("max_length", getattr(gc, "max_length", None))
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if max_length is not None and isinstance(ids, Tensor):
            n = int(max_length) - ids.shape[-1]
    return None if n is None else int(n)


def _given_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a forward or ``generate`` call was given: ``cache=`` from transformers 5.24 on,
    ``past_key_values=`` before (and still accepted there)."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def _generate_hooks(hf: Any) -> None:
    """Install, once per model, the forward hooks through which a :class:`PagedCache` drives ``generate``'s
    forwards; inert for a forward without one."""
    if getattr(hf, "_kvmodels_generate_hooks", False):
        return

    running: list[PagedCache | None] = []  # per forward in progress (the decoder's own forwards nest)

    def pre(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        cache = _given_cache(kwargs)
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
        cache = _given_cache(kwargs)
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
        ids: Tensor = kwargs["input_ids"]
        B, L = ids.shape
        dec = self.decoder
        if dec.cache is not None and B != dec.batch_size:
            raise ValueError(f"input_ids has {B} rows; this PagedCache holds {dec.batch_size} sequences "
                             "(num_return_sequences and beam search are not supported)")
        if L == 1 and dec.cache is not None:  # a decode step: transformers' forward, attention paged
            if self.max_new_tokens is None:
                raise ValueError("a decode step on a PagedCache built without max_new_tokens, which "
                                 "model.generate tells it; driving the model by hand, pass "
                                 "paged_cache(..., max_new_tokens=)")
            if not dec.decoding:
                dec.start_decode(self.max_new_tokens)
            if dec.step >= self.max_new_tokens:
                raise ValueError(f"generate runs more steps than max_new_tokens={self.max_new_tokens}, the "
                                 "generation this PagedCache plans and holds room for; build it with "
                                 "generate's max_new_tokens")
            positions = dec.begin_step()
            self._decoding = self.wrapped.paged(dec.cache, "decode", positions, 0, None)
            self._decoding.__enter__()
            return {**kwargs, "position_ids": positions[:, None]}
        # a prompt, or new tokens after a generation: the decoder takes each row's own tokens
        mask = kwargs.get("attention_mask")
        real = torch.ones(B, L, dtype=torch.bool) if mask is None else mask[:, -L:].bool().cpu()
        rows = [ids[b][real[b].to(ids.device)].tolist() for b in range(B)]
        if not all(rows):
            raise ValueError(f"row {rows.index([])} of input_ids has no token that its attention_mask keeps")
        planned = self.max_new_tokens or 0  # a prompt by hand, no length told: Decoder.extend's default
        if dec.cache is None:  # the prompts size the pool: the longest plus the generation, or max_tokens
            dec.max_tokens = self.max_tokens or max(map(len, rows)) + planned
        logits = dec.extend(rows, max_new_tokens=planned)
        self._logits = torch.stack([x for x in logits if x is not None])[:, None]
        self._width += L
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
        if _given_cache(kwargs) is None:
            kwargs[name] = paged_cache(wrapped, policy, max_tokens=max_tokens, seed=seed,
                                       probe_prefix=probe_prefix)
            caches.append(kwargs[name])
        return original(*args, **kwargs)

    hf.generate = generate
    try:
        yield caches
    finally:
        hf.generate = original
