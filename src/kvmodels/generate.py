"""Batched, ragged generation on the paged KV cache, for any model that follows :class:`CausalLM`.

The loop: each prompt is prefilled on its own (dense causal attention, its K/V written into fresh
pages), the cache applies the policy (budgets, merging, prompt compression), then all sequences decode
together, one token per step, through a decode step whose shapes never change (finished rows keep
running as inactive rows; the cache ignores them). That is what lets ``compile=True`` compile the step
once (``torch.compile(fullgraph=True)``; CUDA graphs on CUDA) and never recompile as lengths change.

:func:`generate` is one turn of :class:`kvmodels.decoder.Decoder`, which drives the cache protocol and
continues a batch after a generation (follow-up questions) or prefills long prompts chunk by chunk.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class CacheLayout:
    """What a model needs from the cache: the ``PagedKVCache`` constructor's shape arguments.

    ``n_layers`` counts *cache* layers (fewer than model layers for LCKV); the model owns the
    model-layer → cache-layer map. ``windows``: a model with sliding-window layers gives one entry per cache
    layer, ``W`` for a layer that attends to its last ``W`` tokens (itself included), 0 for one that attends
    to every token (``PagedKVCache(windows=...)``); empty when every layer attends to every token. ``alibi``:
    the model biases attention by each slot's position (ALiBi: ``alibi_slopes=`` on ``cache.attend``), which
    quantized rows do not support yet (``PagedKVCache(alibi=...)`` refuses them up front).
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_q_heads: int
    windows: tuple[int, ...] = ()
    alibi: bool = False


@runtime_checkable
class CausalLM(Protocol):
    """The model protocol ``generate`` drives (docs/contract.md §6). ``kvmodels.llama.Llama`` is the pattern.

    * ``prefill(tokens[L], cache, b, *, last_only=False, on_layer=None) -> logits [L, V]`` (``[1, V]``
      with ``last_only``): one sequence, dense causal attention; calls ``cache.prefill_attend`` (which
      returns the layer's attention) or ``cache.prefill_layer`` (ALiBi and LCKV models, which attend
      themselves) and ``cache.observe(l, b, h_in, attn_out)`` once per cache layer (the one observation
      point: the cache's policy reads what it needs); ``cache=None`` is a plain forward pass;
      ``on_layer(l)`` reports progress.
    * ``decode_step(tokens[B], positions[B], cache) -> logits [B, V]``: ``cache.append`` then
      ``cache.attend`` per cache layer; nothing else touches the cache, so the step compiles.
    * ``n_cache_layers``, ``max_seq_len`` and ``cache_layout()``.
    """

    @property
    def n_cache_layers(self) -> int: ...

    @property
    def max_seq_len(self) -> int: ...

    def cache_layout(self) -> CacheLayout: ...

    def prefill(self, tokens: Tensor, cache: Any, b: int, *, last_only: bool = False,
                on_layer: Callable[[int], None] | None = None) -> Tensor: ...

    def decode_step(self, tokens: Tensor, positions: Tensor, cache: Any) -> Tensor: ...

    def parameters(self) -> Any: ...


@dataclass
class GenerationResult:
    """Output of :func:`generate`.

    tokens: the new tokens of each sequence (eos included when it stopped on one).
    finished_on_eos: per sequence, whether it stopped on an eos token.
    prefill_tokens / prefill_s: prompt tokens and seconds for all prefills plus the policy's
        compression (``finish_prefill``).
    decode_tokens / decode_s: tokens produced by decode steps (active rows only) and their seconds.
    report: the cache's ``CacheReport`` (bytes full vs kept, per-layer budgets…) taken just before the
        first sequence finished and returned its pages, i.e. with every sequence of the batch at its
        longest compressed state (a report after the end would show an empty cache).
    extra: ``first_step_s``, the seconds of the first decode step (included in ``decode_s``; with
        ``compile=True`` it holds the compile time; for a batch of ``B`` rows that all run every step the
        steady-state speed is ``(decode_tokens - B) / (decode_s - first_step_s)``).
    """

    tokens: list[list[int]]
    finished_on_eos: list[bool]
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float
    report: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else math.nan

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else math.nan


def _sample(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """Next token ``[B]`` int64 from ``[B, V]`` logits: argmax at temperature 0, else a seeded draw."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_batch(name: str, batch: object) -> None:
    """``batch`` is a non-empty list of token-id lists, one per sequence (``generate``'s ``prompts``,
    ``Decoder.extend``'s ``tokens``); else a ``ValueError`` naming ``name`` and what to pass."""
    if isinstance(batch, Tensor):
        raise ValueError(f"{name} is a torch.Tensor; pass a list of token-id lists, one per sequence, "
                         f"without padding (a ragged batch is fine; {name}.tolist() for an unpadded one)")
    if isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence) or len(batch) == 0:
        raise ValueError(f"{name} must be a non-empty list of token-id lists, one per sequence; tokenize the "
                         "text first")


def vocab_size(model: object) -> int | None:
    """The model's vocabulary size (``model.config.vocab_size``, as kvmodels' models and transformers'
    configs have it), or ``None`` when it does not say."""
    n = getattr(getattr(model, "config", None), "vocab_size", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def token_ids(name: str, tokens: Sequence[object], vocab: int | None) -> list[int]:
    """``tokens`` as Python ints, each checked: an integer (Python, numpy or a 0-d integer tensor; not a
    float or a bool) in ``[0, vocab)``. A ``ValueError`` names the first bad one (``name[i]``)."""
    out = []
    for i, x in enumerate(tokens):
        try:
            if isinstance(x, bool):
                raise TypeError
            t = operator.index(x)  # type: ignore[arg-type]  # TypeError for what has no __index__
        except TypeError:
            raise ValueError(f"{name}[{i}]={x!r} is not a token id (an int); tokenize the text "
                             "first") from None
        if t < 0 or (vocab is not None and t >= vocab):
            bound = ("must be >= 0" if vocab is None
                     else f"is outside the model's vocabulary ({vocab} ids, 0 .. {vocab - 1})")
            raise ValueError(f"{name}[{i}]={t} {bound}; was it tokenized for this model?")
        out.append(t)
    return out


def _check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, model: CausalLM) -> None:
    check_batch("prompts", prompts)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    vocab = vocab_size(model)
    for b, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{b}] is empty; every prompt needs at least one token (e.g. BOS)")
        token_ids(f"prompts[{b}]", p, vocab)
        if len(p) + max_new_tokens > model.max_seq_len:
            raise ValueError(
                f"prompts[{b}] has {len(p)} tokens + max_new_tokens={max_new_tokens} = "
                f"{len(p) + max_new_tokens}, more than the model's context of {model.max_seq_len} tokens; "
                "shorten the prompt or lower max_new_tokens")


def compile_decode_step(model: CausalLM) -> Callable[[Tensor, Tensor, Any], Tensor]:
    """``model.decode_step`` compiled as one graph: CUDA graphs on CUDA, the default mode on CPU."""
    device = next(iter(model.parameters())).device
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    return torch.compile(model.decode_step, fullgraph=True, dynamic=False, mode=mode)


def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    policy: Any = None,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    eos_ids: int | Sequence[int] | None = None,
    compile: bool = False,
    stream: Callable[[int, int], None] | None = None,
    on_prefill: Callable[[int, int, int], None] | None = None,
    page_size: int = 16,
    num_pages: int | None = None,
    chunk: int | None = None,
    side_pages: int | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens for each prompt, sharing one paged, compressed cache.

    Parameters
    ----------
    model : CausalLM
        e.g. :class:`kvmodels.llama.Llama`; its parameters' device and dtype are used for the cache.
    prompts : list of list of int
        Token ids, one list per sequence; lengths may differ (each ``>= 1``).
    max_new_tokens : int
        Tokens to generate per sequence (fewer when it stops on an eos id).
    policy : ComposedPolicy, optional
        From ``kvpolicies.compose``; default ``compose("full")`` (keep everything).
    temperature : float
        0 = greedy; otherwise sample from ``softmax(logits / temperature)`` with a generator seeded
        by ``seed``.
    seed : int
        Seeds sampling and the cache's policy noise (Keyformer).
    eos_ids : int or list of int, optional
        A sequence stops after producing one of these; its pages return to the pool.
    compile : bool
        Compile the decode step (``torch.compile(fullgraph=True)``; ``mode="reduce-overhead"`` on CUDA).
        The first call pays the compile time; tokens equal the eager path's.
    stream : callable, optional
        ``stream(b, token_id)`` for every new token as soon as it is known.
    on_prefill : callable, optional
        ``on_prefill(b, layers_done, n_layers)`` after each prefilled layer of sequence ``b``.
    page_size, num_pages, side_pages :
        Cache pool geometry (``num_pages=None``: enough for every sequence at full length; ``side_pages``:
        the second format's pool with a precision that stores two, ``Decoder(side_pages=)``;
        ``kvmodels.chunked_num_pages`` sizes both for a chunked prefill).
    chunk : int, optional
        Prefill each prompt ``chunk`` tokens at a time, compressing after each chunk, so a layer holds at
        most its budget plus one chunk while prefilling (``Decoder.extend(chunk=)``; Llama, GPT-J, MPT).
        ``None``: each prompt at once, then compressed.

    Returns
    -------
    GenerationResult
    """
    from kvmodels.decoder import Decoder  # the one driver of the cache protocol

    _check_prompts(prompts, max_new_tokens, model)
    decoder = Decoder(model, policy, max_tokens=max(len(p) for p in prompts) + max_new_tokens,
                      page_size=page_size, num_pages=num_pages, seed=seed, compile=compile,
                      side_pages=side_pages)
    decoder.extend(prompts, chunk=chunk, max_new_tokens=max_new_tokens, on_prefill=on_prefill)
    return decoder.generate(max_new_tokens, temperature=temperature, eos_ids=eos_ids, stream=stream,
                            final=True)
