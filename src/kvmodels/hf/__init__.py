"""``transformers`` models on the paged cache: ``model.generate`` with a compressed cache, and any decoder
under kvmodels' own loop. The only module of ``kvmodels`` that needs ``transformers`` at import (an optional
extra: ``pip install 'kvpolicies[hf]'``).

    >>> out = model.generate(**inputs, max_new_tokens=64, past_key_values=paged_cache(model, policy))
    >>> with compressed(model, policy) as caches:     # a fresh cache for each generate call in the block
    ...     out = model.generate(**inputs, max_new_tokens=64)
    >>> generate(wrap_transformers(model), [ids], 64, compose("snapkv", "zipcache", budget=0.2))

:func:`kvmodels.from_transformers` converts the architectures kvmodels implements itself (Llama, GPT-J, MPT)
into its own models. :func:`wrap_transformers` runs any decoder as it is (Llama, Qwen2, Qwen3, Mistral,
Phi-3, Granite, GPT-J, MPT, ...), without copying its weights: the model computes its projections, norms and
rotary embeddings, and an attention function registered with ``transformers.AttentionInterface`` hands each
layer's rotated queries, keys and values to the cache where kvmodels' own models call it
(:class:`kvmodels.generate.CausalLM`). So every policy and storage (quantized pages included), extensions,
sessions and the compiled decode step run on these models through :func:`kvmodels.generate` and
:class:`kvmodels.Decoder`, and inside ``model.generate`` through :class:`PagedCache`, a ``transformers.Cache``
over a ``Decoder`` (:func:`paged_cache`, :func:`compressed`). MPT (ALiBi), and GPT-J before transformers 5.24,
attend in code of their own instead of calling the interface: the wrapped model routes their attention
methods (:func:`mpt_attention`, :func:`gptj_attention`).

The attention implementation is switched for the duration of each call only: between calls the model is the
user's, unchanged (the routed methods call the model's own outside a call). Sliding-window layers (Gemma 3,
Mistral) keep their window in the cache (``CacheLayout.windows``, docs/hf.md); other kinds of layer are
refused (:func:`kvmodels.hf.model.sliding_windows`). This module replaced the transformers bridge
``kvpolicies.hf`` (retired 2026-11-28), which kept a second cache of its own.
"""

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvmodels.hf needs transformers: pip install 'kvpolicies[hf]'") from exc

from kvmodels.hf.generate import PagedCache, cache_kwarg, compressed, generation_length, paged_cache
from kvmodels.hf.model import (
    ATTENTION,
    TransformersModel,
    UnsupportedModelError,
    attention_layers,
    gptj_attention,
    mpt_attention,
    paged_attention,
    wrap_transformers,
)

__all__ = [
    "ATTENTION",
    "PagedCache",
    "TransformersModel",
    "UnsupportedModelError",
    "attention_layers",
    "cache_kwarg",
    "compressed",
    "generation_length",
    "gptj_attention",
    "mpt_attention",
    "paged_attention",
    "paged_cache",
    "wrap_transformers",
]
