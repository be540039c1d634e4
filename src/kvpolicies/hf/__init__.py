"""Hugging Face ``transformers`` bridge: drive any ``AutoModelForCausalLM`` with a composed policy.

The only part of the library that imports ``transformers`` (an optional extra, ``pip install
kvpolicies[hf]``); the core packages never import it.

    >>> cache = hf_cache(compose("h2o", budget=0.25), model)
    >>> out = model.generate(**inputs, max_new_tokens=64, past_key_values=cache)
    >>> with compressed(model, compose("squeeze", "keyformer", budget=0.2)) as caches:
    ...     out = model.generate(**inputs, max_new_tokens=64)      # a fresh cache per call
    >>> caches[-1].report()
    >>> cache = hf_cache(compose("kvzip(skip=24)", "pooled", budget=0.2), model, probe_prefix=instruction_ids)
    >>> model(input_ids=context_ids, past_key_values=cache)     # the context; its reconstruction pass and
    >>> out = model.generate(input_ids=context_and_question_ids, past_key_values=cache)  # compression first

Its parts (docs/hf.md has the full story): :mod:`~kvpolicies.hf.cache`, the ``transformers.Cache`` that stores
what the policy's plan says and calls the kvkernels ops, with its scores (:mod:`~kvpolicies.hf.scores`), its
reconstruction pass and extensions (:mod:`~kvpolicies.hf.extend`) and its report
(:mod:`~kvpolicies.hf.report`) in modules of their own; :mod:`~kvpolicies.hf.layer`, its per-layer storage;
:mod:`~kvpolicies.hf.hooks`, what it learns from the model's forward; :mod:`~kvpolicies.hf.models`, the model
families it can drive (Llama-style attention with rotary embeddings, GPT-J, MPT) and how their queries are
rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("kvpolicies.hf needs transformers: pip install 'kvpolicies[hf]'") from exc

from kvpolicies.hf.cache import PolicyCache
from kvpolicies.hf.hooks import CACHE_NAMES, Hooks, cache_kwarg
from kvpolicies.hf.layer import PolicyLayer
from kvpolicies.hf.models import UnsupportedModelError
from kvpolicies.hf.report import HFCacheReport

__all__ = [
    "PolicyCache",
    "PolicyLayer",
    "HFCacheReport",
    "hf_cache",
    "compressed",
    "UnsupportedModelError",
]


def hf_cache(
    policy: Any, model: torch.nn.Module, *, max_new_tokens: int | None = None, seed: int = 0,
    probe_prefix: Sequence[int] = (),
) -> PolicyCache:
    """A fresh ``transformers`` cache that ``policy`` drives, for one ``generate`` call on ``model``.

    Parameters
    ----------
    policy : ComposedPolicy
        From ``kvpolicies.compose(...)``.
    model : transformers.PreTrainedModel
        A decoder-only causal LM: Llama-style attention (``sdpa`` or ``eager``), GPT-J or MPT.
    max_new_tokens : int, optional
        The generation length. Not needed with ``model.generate``, which tells the cache the length it
        resolves (its ``max_new_tokens`` / ``max_length``); pass it only when driving the model by hand with
        a policy whose decode schedule depends on it (Keyformer's temperature).
    seed : int
        Seeds, with ``policy.seed``, the Gumbel noise of stochastic scores (Keyformer), exactly as
        ``kvmodels.generate(..., seed=seed)`` does, so both keep the same tokens.
    probe_prefix : list of int
        With a policy that ranks the context by a reconstruction pass (``kvzip``): token ids fed before the
        context's copy, e.g. KVzip's instruction (``kvpolicies.eviction.kvzip.REPEAT``) and the chat
        template's opening of the assistant's turn, tokenized, as ``kvmodels.Decoder(probe_prefix=)``.

    Returns
    -------
    PolicyCache
        Pass it as ``model.generate(..., past_key_values=cache)``; one cache per generate call.

    Raises
    ------
    UnsupportedModelError
        For model families or attention implementations the bridge cannot drive, naming what to change.
    """
    return PolicyCache(policy, model, max_new_tokens=max_new_tokens, seed=seed, probe_prefix=probe_prefix)


@contextlib.contextmanager
def compressed(model: torch.nn.Module, policy: Any, *, seed: int = 0,
               probe_prefix: Sequence[int] = ()) -> Iterator[list[PolicyCache]]:
    """Within the block, ``model.generate`` uses a fresh :class:`PolicyCache` per call (``seed`` and
    ``probe_prefix`` as for :func:`hf_cache`).

    Yields the list of caches created so far (the last one is the latest call's), for ``report()``.
    The hooks and the patched ``generate`` are removed on exit.
    """
    caches: list[PolicyCache] = []
    installed_here = "_kvpolicies_hooks" not in model.__dict__
    hooks = Hooks.on(model)
    original = model.generate  # the length-aware generate the hooks put on the instance

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if all(kwargs.get(name) is None for name in CACHE_NAMES):
            cache = hf_cache(policy, model, seed=seed, probe_prefix=probe_prefix)
            kwargs[cache_kwarg(model)] = cache
            kwargs.setdefault("use_cache", True)
            caches.append(cache)
        return original(*args, **kwargs)

    model.generate = generate
    try:
        yield caches
    finally:
        model.generate = original
        if installed_here:
            hooks.remove()

