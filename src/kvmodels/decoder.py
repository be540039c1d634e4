"""A continuable generation state: extend a batch of sequences with more tokens, generate, extend again.

:class:`Decoder` holds one model, one paged cache and one policy for a batch, and is the one place that
drives the cache protocol (docs/contract.md §6); :func:`kvmodels.generate.generate` is one ``extend`` and
one ``generate(final=True)``::

    dec = Decoder(model, compose("h2o", budget=0.5))
    dec.extend([context_ids])             # the prompt: prefilled, then compressed to the budget
    answer = dec.generate(32)             # decodes; the cache stays
    dec.extend([question_ids])            # a follow-up costs its own tokens, not a new prefill
    answer2 = dec.generate(32)

* ``extend(tokens)`` prefills each sequence's new tokens into its existing, possibly compressed, cache: they
  attend to its kept tokens and causally to each other, at their true positions (the sequence's tokens
  seen so far, kept or evicted), their K/V are appended and scored, and the policy compresses the sequence
  to its budget afterwards (a fraction budget counts every token seen). The first call is the prompt and
  takes the one-shot path (dense causal attention, then prompt compression). ``chunk=N`` prefills ``N``
  tokens at a time and compresses after each chunk, so a layer never holds more than its budget plus one
  chunk, whatever the prompt's length.
* A policy that ranks the context by a reconstruction pass (``kvzip``: its eviction's ``probe``) keeps the
  first call's prompts whole, then feeds each prompt once more after itself (``begin_extend(...,
  probe=True)``): the copy's attention scores the prompt, nothing of it is stored, and the prompt is
  compressed to its budget by those scores. It costs one more forward over each prompt, and the prompt must
  fit twice in the model's positions (``probe_prefix`` adds its tokens; ``kvzip(span=N)`` reconstructs in
  spans of ``N``, each pass after the prompt; with ``chunk=`` the prompt is held whole until its probe). Only
  the first call's prompts are probed: tokens a later ``extend`` adds (a question, a follow-up turn) are
  appended and kept.
* ``generate(max_new_tokens)`` decodes every sequence. A sequence that stops (an eos id, or its last token)
  is paused: it keeps its pages, and its last token, which no step has fed yet, is fed first by the next
  ``extend`` (or ``generate``). ``final=True`` returns each sequence's pages as it stops instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from kvmodels.generate import (
    CausalLM,
    GenerationResult,
    _sample,
    check_batch,
    compile_decode_step,
    token_ids,
    vocab_size,
)


class _Extendable(Protocol):
    """A model whose ``prefill`` continues a cached sequence from position ``start`` (``can_extend``)."""

    def prefill(self, tokens: Tensor, cache: Any, b: int, *, start: int = 0, last_only: bool = False,
                on_layer: Callable[[int], None] | None = None) -> Tensor: ...


def _positive(name: str, value: object, *, zero: bool = False) -> int:
    lo = 0 if zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}={value!r} must be an int >= {lo}")
    return value


def _eos_ids(eos_ids: object, vocab: int | None) -> set[int]:
    """``generate``'s ``eos_ids`` (``None``, one id or a collection of ids) as a set of checked ids."""
    if eos_ids is None:
        return set()
    if isinstance(eos_ids, (str, bytes)):
        raise ValueError(f"eos_ids={eos_ids!r} must be token ids (e.g. tokenizer.eos_token_id), not text")
    if isinstance(eos_ids, Iterable):
        return set(token_ids("eos_ids", list(eos_ids), vocab))
    try:
        return set(token_ids("eos_ids", [eos_ids], vocab))
    except ValueError as e:  # one id: named without an index
        raise ValueError(str(e).replace("eos_ids[0]=", "eos_ids=", 1)) from None


class Decoder:
    """Generation state of a batch on one paged, compressed cache, continuable after each generation.

    Parameters
    ----------
    model : CausalLM
        e.g. :class:`kvmodels.llama.Llama`; continuing a sequence needs ``model.can_extend`` (Llama,
        GPT-J, MPT; not LCKV).
    policy : ComposedPolicy, optional
        From ``kvpolicies.compose``; default ``compose("full")``.
    max_tokens : int, optional
        The most tokens one cache layer may hold for one sequence at once (the page tables' width); default
        the model's context. With a compressing policy and ``chunk``, the budget plus one chunk (plus the
        tokens generated before the next eviction) is enough, however long the context, but it caps a
        layer-budget policy's large layers at that: bound ``num_pages`` instead.
    page_size, num_pages :
        Pool geometry (``num_pages=None``: enough for every sequence of the batch at ``max_tokens``;
        :func:`chunked_num_pages`: every layer's budget plus one chunk, shared by the layers).
    side_pages : int, optional
        With a precision that stores two formats (KIVI's residual, ZipCache, MiKV), the pages of the
        second format's pool (``None``: ``num_pages``); ``chunked_num_pages(..., region="side")`` sizes it
        and ``region="main"`` the unquantized pool.
    seed : int
        Seeds sampling and the cache's policy noise (Keyformer).
    compile : bool
        Compile the decode step once (``torch.compile(fullgraph=True)``; CUDA graphs on CUDA); every
        ``generate`` reuses it.
    probe_prefix : list of int
        With a policy that ranks the prompt by a reconstruction pass (``kvzip``): token ids fed before the
        prompt's copy in that pass, e.g. KVzip's instruction (``kvpolicies.eviction.kvzip.REPEAT``, "Repeat
        the previous context exactly.") followed by the chat template's opening of the assistant's turn, as
        ``kvgen --context`` does; their rows score the prompt too. Default: none, the bare copy.

    Attributes
    ----------
    cache : PagedKVCache or None
        Built by the first :meth:`extend` (its batch is the number of sequences given there), its page
        tables ``max_tokens`` wide (which may be set until then).
    lengths : list of int
        Tokens each sequence has in its context (cached, kept or evicted): the next token's position.
    pending : list of int or None
        Each sequence's last generated token, not yet fed to the model (the next extend feeds it first).
    closed : list of bool
        Sequences whose pages went back to the pool (``generate(final=True)``).
    step : int
        The decode step within the current generation (:meth:`start_decode`, :meth:`begin_step`,
        :meth:`end_step`: how :meth:`generate` and ``kvmodels.hf.PagedCache`` drive one).
    """

    def __init__(self, model: CausalLM, policy: Any = None, *, max_tokens: int | None = None,
                 page_size: int = 16, num_pages: int | None = None, seed: int = 0,
                 compile: bool = False, probe_prefix: Sequence[int] = (),
                 side_pages: int | None = None) -> None:
        from kvpolicies import ComposedPolicy, compose

        if policy is None:
            policy = compose("full")
        if not isinstance(policy, ComposedPolicy):
            raise TypeError("policy must be a kvpolicies.ComposedPolicy (build one with "
                            f"kvpolicies.compose(...)), got {type(policy).__name__}")
        self.model, self.policy = model, policy
        param = next(iter(model.parameters()))
        self.device, self.dtype = param.device, param.dtype
        # What the cache would refuse, refused now: weights measured on another model, rows it cannot store.
        layout = model.cache_layout()
        policy.check_model(layout.n_layers, layout.n_kv_heads)
        from kvmodels.cache.storage import check_side_pages, row_storage

        _, side = row_storage(policy, layout.head_dim, self.dtype, alibi=layout.alibi)
        self.side_pages = check_side_pages(side_pages, policy, side)
        self.max_tokens = model.max_seq_len if max_tokens is None else _positive("max_tokens", max_tokens)
        self.page_size, self.num_pages, self.seed, self.compile = page_size, num_pages, seed, compile
        self.cache: Any = None
        self.lengths: list[int] = []
        self.pending: list[int | None] = []
        self.closed: list[bool] = []
        self._logits: list[Tensor | None] = []  # [1, V] last-position logits of each sequence's last extend
        self._generator = torch.Generator(device=self.device)  # sampling at temperature > 0
        self._generator.manual_seed(seed)
        self._step_fn = compile_decode_step(model) if compile else model.decode_step
        self.probe_prefix = policy.checked_probe_prefix(probe_prefix)
        self._prefill_tokens, self._prefill_s = 0, 0.0  # since the last generate
        self.step = 0
        self._positions: Tensor | None = None  # [B] on the device: each sequence's next position

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    # ------------------------------------------------------------------ extend
    def extend(self, tokens: Sequence[Sequence[int]], *, chunk: int | None = None, max_new_tokens: int = 0,
               on_prefill: Callable[[int, int, int], None] | None = None) -> list[Tensor | None]:
        """Prefill more tokens into each sequence's cache; the policy compresses each to its budget after.

        Parameters
        ----------
        tokens : list of list of int
            One list per sequence; the first call sets the batch (every list non-empty: the prompts). Later
            a list may be empty (nothing new for that sequence); a sequence's pending token goes first.
        chunk : int, optional
            Prefill at most ``chunk`` tokens at a time, compressing after each chunk: a layer holds at most
            its budget plus ``chunk`` tokens (docs/usage.md). ``None``: all at once.
        max_new_tokens : int
            The generation that will follow (planning only: each layer's budget is capped at the context
            plus this; :meth:`generate` re-plans with its own). ``generate()`` passes its own.
        on_prefill : callable, optional
            ``on_prefill(b, layers_done, n_layers)`` after each prefilled layer (of each chunk).

        Returns
        -------
        list of Tensor or None
            Per sequence, the logits ``[V]`` after its last new token (what :meth:`generate` samples its
            first token from), or ``None`` when it took no tokens.
        """
        new = self._new_tokens(tokens)
        chunk = None if chunk is None else _positive("chunk", chunk)
        _positive("max_new_tokens", max_new_tokens, zero=True)
        first_call = self.cache is None
        self._check_extension(new, chunk, max_new_tokens, first_call)
        if first_call:
            self._build_cache(len(new))
        self._positions = None  # the contexts grow: a generation in progress ends (start_decode again)
        t0 = time.perf_counter()
        with torch.no_grad():
            if first_call:
                self._prefill(new, chunk, max_new_tokens, on_prefill)
                if self.policy.eviction.probe:
                    for b, toks in enumerate(new):
                        self._probe(b, toks, max_new_tokens)
            else:
                for b, toks in enumerate(new):
                    if toks:
                        self.pending[b] = None
                        self._extend_sequence(b, toks, chunk, max_new_tokens, on_prefill,
                                              budget_len=self.lengths[b] + len(toks))
        self._prefill_s += time.perf_counter() - t0
        self._prefill_tokens += sum(map(len, new))
        return [logits[0] if toks and logits is not None else None
                for toks, logits in zip(new, self._logits, strict=True)]

    def _new_tokens(self, tokens: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each sequence's tokens to prefill: its pending token, then ``tokens[b]``; checked."""
        check_batch("tokens", tokens)
        vocab = vocab_size(self.model)
        if self.cache is None:
            for b, t in enumerate(tokens):
                if len(t) == 0:
                    raise ValueError(f"tokens[{b}] is empty; every prompt needs at least one token "
                                     "(e.g. BOS)")
            return [token_ids(f"tokens[{b}]", t, vocab) for b, t in enumerate(tokens)]
        if len(tokens) != self.batch_size:
            raise ValueError(f"tokens has {len(tokens)} lists; this Decoder's batch has {self.batch_size} "
                             "sequences (pass [] for a sequence with nothing new)")
        new: list[list[int]] = []
        for b, t in enumerate(tokens):
            if self.closed[b]:
                if len(t):
                    raise ValueError(f"tokens[{b}]: sequence {b} is closed (close() or generate(final=True) "
                                     "returned its pages); start a new Decoder to continue it")
                new.append([])
                continue
            last = self.pending[b]
            new.append(([] if last is None else [last]) + token_ids(f"tokens[{b}]", t, vocab))
        return new

    def _check_extension(self, new: list[list[int]], chunk: int | None, max_new_tokens: int,
                         first_call: bool) -> None:
        """Refuse, before anything is written, what cannot run: past the model's context, past the cache's
        ``max_tokens``, a chunk the policy cannot score, a model or policy that cannot continue."""
        model, policy = self.model, self.policy
        continues = any(new) if not first_call else chunk is not None and max(map(len, new)) > chunk
        if continues and not getattr(model, "can_extend", False):
            raise NotImplementedError(f"{type(model).__name__} cannot continue a cached sequence (extend "
                                      "after the prompt, or chunk=); Llama, GPT-J and MPT can")
        if continues and policy.merge_layout(model.n_cache_layers).pairs:
            raise NotImplementedError(f"policy {policy.name!r} merges layers, which cannot take tokens after "
                                      "the prompt (extend, chunk=); use a policy without merging")
        if continues and policy.heads_refuse_extension:
            raise NotImplementedError(f"policy {policy.name!r} gives KV heads their own budgets from the "
                                      f"prompt's token scores ({policy.heads.name}), which evicted tokens no "
                                      "longer have, so it cannot take tokens after the prompt (extend, "
                                      "chunk=); duo's per-head budgets can")
        if first_call and policy.eviction.probe:
            self._check_probe(new)
        window = policy.eviction.prefill_window(1 << 30) if policy.eviction.prefill_mode else 0
        if chunk is not None and window > 1 and chunk < window:
            name = policy.eviction.name
            raise ValueError(f"chunk={chunk} is smaller than {name}'s observation window of {window} "
                             f"queries, which vote at the end of each chunk; use chunk >= {window} (or a "
                             f"smaller {name} window)")
        context = model.max_seq_len
        capacity = self.max_tokens if first_call else self.cache.slots_per_layer
        for b, toks in enumerate(new):
            if not toks:
                continue
            before = 0 if first_call else self.lengths[b]
            total = before + len(toks) + max_new_tokens
            if total > context:
                raise ValueError(f"tokens[{b}]: sequence {b} would reach {total} tokens ({before} so far + "
                                 f"{len(toks)} new + max_new_tokens={max_new_tokens}), past the model's "
                                 f"context of {context}; shorten them or start a new Decoder")
            held = 0 if first_call else self.cache.slots_held(b)
            compresses = policy.eviction.prefill_compress
            # without compression every token stays; with it, each chunk lands on a compressed layer
            step = len(toks) if chunk is None or not compresses else min(chunk, len(toks))
            # a follow-up to layers that fill the cache: the extension compresses them first (make_room)
            if held + step > capacity and (first_call or not self.cache.can_make_room(b, step)):
                arg = "chunk" if chunk is not None else f"tokens[{b}]"
                fix = ("prefill in smaller chunks (chunk=) or raise max_tokens" if compresses else
                       f"raise max_tokens (policy {policy.name!r} compresses no prompt, so chunks would not "
                       "help)")
                raise ValueError(f"{arg}: sequence {b} would hold {held} + {step} tokens in a layer, more "
                                 f"than max_tokens={self.max_tokens} allows; {fix}")
            if chunk is not None and compresses and len(toks) > chunk:
                budget = int(policy.budget_tokens(torch.tensor([before + len(toks)]))[0])
                # A layer holds its budget plus one chunk (KIVI's residual: at least the residual and a
                # group), and never more than the tokens it has seen.
                budget = max(budget, _residual_hold(policy))
                if min(budget + chunk, before + len(toks)) > capacity:
                    raise ValueError(f"chunk={chunk}: each layer holds its budget ({budget} tokens) plus one "
                                     f"chunk, more than max_tokens={self.max_tokens}; lower chunk or raise "
                                     "max_tokens")

    def _check_probe(self, prompts: list[list[int]]) -> None:
        """Refuse a reconstruction pass (``kvzip``) that cannot run: a model that cannot continue a sequence,
        merged layers, two storage formats, a prompt whose reconstruction passes do not fit in the model's
        positions after it."""
        name, model = self.policy.name, self.model
        what = f"policy {name!r} ranks the prompt by a reconstruction pass ({self.policy.eviction.name}"
        if not getattr(model, "can_extend", False):
            raise NotImplementedError(f"{what}: the prompt fed again after itself), and "
                                      f"{type(model).__name__} cannot continue a cached sequence; use Llama, "
                                      "GPT-J or MPT")
        if self.policy.merge_layout(model.n_cache_layers).pairs:
            raise NotImplementedError(f"{what}: an extension of each sequence), which merge policy "
                                      f"{self.policy.merge.name!r} cannot take (a merged region takes no "
                                      "tokens after the prompt); use a policy without merging")
        if stores_two_formats(self.policy):
            raise NotImplementedError(f"{what}), and precision {self.policy.precision.name!r} stores tokens "
                                      "in two formats, split once after the prompt's compression, which "
                                      "this pass would redo; use native precision or kivi(residual=0)")
        for b, toks in enumerate(prompts):
            self.policy.check_probe_fits(f"tokens[{b}]", len(toks), len(toks), len(self.probe_prefix),
                                         model.max_seq_len)

    def _probe(self, b: int, toks: list[int], max_new_tokens: int) -> None:
        """Sequence ``b``'s reconstruction: its prompt ``toks`` fed again at the positions after it (after
        ``probe_prefix``; in spans with ``kvzip(span=)``), scoring the kept prompt and storing nothing; the
        last pass's ``end_extend`` compresses the prompt by those scores. The sequence's length and its last
        logits (what ``generate`` samples from) stay the prompt's."""
        from kvmodels.cache import ProbeSpan

        cache, model = self.cache, cast(_Extendable, self.model)  # checked: model.can_extend
        passes = self.policy.eviction.probe_passes(len(toks))
        for i, (start, stop, scored) in enumerate(passes):
            probe = self.probe_prefix + toks[start:stop]
            last = i == len(passes) - 1
            span = True if len(passes) == 1 else ProbeSpan(scored, None if last else stop, last)
            cache.begin_extend(b, len(probe), max_new_tokens=max_new_tokens, probe=span)
            model.prefill(torch.tensor(probe, dtype=torch.int64, device=self.device), cache, b,
                          start=self.lengths[b], last_only=True)
            cache.end_extend(b)

    def _build_cache(self, batch: int) -> None:
        from kvmodels.cache import paged_cache  # the cache pulls in the kernels; import when used

        layout = self.model.cache_layout()
        self.cache = paged_cache(
            n_layers=layout.n_layers, n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
            n_q_heads=layout.n_q_heads, max_batch=batch, max_tokens=self.max_tokens,
            page_size=self.page_size, num_pages=self.num_pages, dtype=self.dtype, device=self.device,
            policy=self.policy, seed=self.seed, windows=layout.windows or None, alibi=layout.alibi,
            side_pages=self.side_pages)
        self.lengths, self.pending = [0] * batch, [None] * batch
        self.closed, self._logits = [False] * batch, [None] * batch

    def _progress(self, b: int, on_prefill: Callable[[int, int, int], None] | None):
        if on_prefill is None:
            return None
        n = self.model.n_cache_layers
        return lambda l: on_prefill(b, l + 1, n)

    def _prefill(self, prompts: list[list[int]], chunk: int | None, max_new_tokens: int,
                 on_prefill: Callable[[int, int, int], None] | None) -> None:
        """The first call: each prompt's first chunk (all of it without ``chunk``) through the one-shot path,
        compressed right after its prefill (so the pool holds one uncompressed prompt at a time); then the
        rest chunk by chunk. Budgets are those of the whole prompts."""
        cache = self.cache
        first = [p if chunk is None else p[:chunk] for p in prompts]
        # each layer keeps room for the next chunk (ComposedPolicy.plan's room), so a layer-budget policy's
        # largest layers still take it
        cache.start([len(p) for p in first], max_new_tokens, compress_each=True,
                    budget_lens=[len(p) for p in prompts],
                    reserve=[min(len(p) - len(f), chunk or 0) for p, f in zip(prompts, first)])
        for b, toks in enumerate(first):
            logits = self.model.prefill(torch.tensor(toks, dtype=torch.int64, device=self.device), cache, b,
                                        last_only=True, on_layer=self._progress(b, on_prefill))
            cache.compress_prompt(b)
            self._logits[b] = logits[-1:]
            self.lengths[b] = len(toks)
        cache.finish_prefill()
        for b, toks in enumerate(prompts):
            if len(toks) > len(first[b]):
                self._extend_sequence(b, toks[len(first[b]):], chunk, max_new_tokens, on_prefill,
                                      budget_len=len(toks), chunked=True)

    def _extend_sequence(self, b: int, toks: list[int], chunk: int | None, max_new_tokens: int,
                         on_prefill: Callable[[int, int, int], None] | None, *, budget_len: int,
                         chunked: bool = False) -> None:
        """Sequence ``b`` takes ``toks`` through the cache's extension path, ``chunk`` at a time (``chunked``:
        the rest of a prompt, which a two-format cache holds to its budget as a one-format one does, not a
        follow-up, which it keeps whole)."""
        cache, step = self.cache, chunk or len(toks)
        for i in range(0, len(toks), step):
            piece = toks[i:i + step]
            cache.begin_extend(b, len(piece), budget_len=budget_len, max_new_tokens=max_new_tokens,
                               reserve=len(toks[i + step:i + 2 * step]),  # room for the next chunk
                               chunked=chunked)
            model = cast(_Extendable, self.model)  # checked: model.can_extend
            logits = model.prefill(torch.tensor(piece, dtype=torch.int64, device=self.device), cache, b,
                                   start=self.lengths[b], last_only=True,
                                   on_layer=self._progress(b, on_prefill))
            cache.end_extend(b)
            self.lengths[b] += len(piece)
            self._logits[b] = logits[-1:]

    def close(self, b: int) -> None:
        """Return sequence ``b``'s pages to the pool now; it takes no more tokens (``closed[b]``)."""
        if self.cache is None or not isinstance(b, int) or not 0 <= b < self.batch_size:
            raise ValueError(f"sequence b={b!r} is not in this Decoder's batch of {self.batch_size}")
        if not self.closed[b]:
            self.cache.finish_sequence(b)
            self.closed[b], self._logits[b] = True, None

    # ------------------------------------------------------------------ decode steps
    @property
    def decoding(self) -> bool:
        """Whether a generation is in progress: :meth:`start_decode` ran since the last :meth:`extend`."""
        return self._positions is not None

    def start_decode(self, max_new_tokens: int) -> None:
        """Start a generation of up to ``max_new_tokens`` tokens: the policy's decode schedule restarts
        (Keyformer's temperature, the layer-budget cap) and :attr:`step` is 0."""
        self.cache.restart_decode(max_new_tokens)
        self.step = 0
        # a closed row's position stays 0, so its (ignored) step never indexes past the RoPE table
        self._positions = torch.tensor([0 if c else n for n, c in zip(self.lengths, self.closed)],
                                       dtype=torch.int64, device=self.device)

    def begin_step(self) -> Tensor:
        """Ready the cache for decode step :attr:`step` (the policy's eviction and scores before it);
        returns each sequence's position ``[B]`` on the device, for the model's ``decode_step``."""
        if self._positions is None:
            raise RuntimeError("begin_step() before start_decode() (which every extend() ends)")
        self.cache.prepare_decode(self.step)
        return self._positions

    def end_step(self, stepped: Sequence[int]) -> None:
        """After the model ran decode step :attr:`step`: the cache's bookkeeping (scores, appended lengths),
        and the token each sequence in ``stepped`` fed is counted in its context."""
        assert self._positions is not None
        self.cache.after_step(self.step)
        self.step += 1
        for b in stepped:
            self.lengths[b] += 1
        self._positions = self._positions + 1

    def _growth(self, b: int, steps: int) -> int:
        """The most tokens a layer may take beyond what it holds now, in a generation that caches ``steps``:
        all of them under a policy that evicts nothing while decoding; the first ``evict_every`` under one
        that does (its eviction then holds each layer at a budget the plan leaves room beside,
        ``plan_room``); all of them again in two formats whose main region that eviction leaves whole and
        which may outgrow the slots per layer (``SideRegion.main_peak``: KIVI's residual until it ages; not
        ZipCache's, re-compressed to its budget; MiKV demotes what eviction drops). Found by
        tests/test_policy_fuzz.py: a step past max_tokens failed mid-generation after a follow-up, which two
        formats append whole."""
        policy, side = self.policy, self.cache.side
        if not policy.eviction.decode_evict:
            return steps
        if side is None or policy.precision.keeps_evicted:  # eviction holds every layer at its budget
            return min(steps, policy.evict_every)
        peak = side.main_peak(self.cache, b)
        return steps if peak is None or peak > self.cache.slots_per_layer else 0

    def _check_pool(self, max_new_tokens: int) -> None:
        """Refuse, before the first decode step, a generation whose steps may open more pages than the pool
        has free (``cache.decode_needs``: the worst case, every sequence running to ``max_new_tokens``),
        where it would fail at the step that finds none (a pool sized by ``num_pages`` for fewer or shorter
        turns than the conversation has: found 2026-12-07). Two formats: each of the two pools (since
        2026-12-08)."""
        what = f"a generation of max_new_tokens={max_new_tokens} (at worst, counted before step 0)"
        for pool, need in self.cache.decode_needs(max_new_tokens - 1):  # the last token is not cached
            if need > pool.free:  # the pool's own error, raised before any step
                raise pool.out_of_pages(need, what)

    def _replan_makes_room(self, b: int, steps: int) -> bool:
        """Whether the plan this generation makes (``cache.restart_decode``: each layer capped at the slots
        per layer less ``steps``, the excess handed to the sequence's other layers) leaves sequence ``b``'s
        layers room for ``steps`` more tokens: the policy compresses prompts (in one format, so a re-plan
        compresses; not per-head budgets, which are split once per turn) and its mean budget per layer
        leaves that room, so nothing below the budget is dropped. (Told the generation's length,
        ``extend(max_new_tokens=)`` plans that room with the prompt: per-head budgets too.)"""
        return not self.policy.heads.per_head and self.cache.can_make_room(b, steps)

    # ------------------------------------------------------------------ generate
    def generate(self, max_new_tokens: int, *, temperature: float = 0.0,
                 eos_ids: int | Sequence[int] | None = None, stream: Callable[[int, int], None] | None = None,
                 final: bool = False) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens for every open sequence, from its context so far.

        Parameters
        ----------
        max_new_tokens : int
            Tokens to generate per sequence (fewer when it stops on an eos id).
        temperature : float
            0 = greedy; otherwise sample from ``softmax(logits / temperature)`` (the Decoder's seeded
            generator, continued across calls).
        eos_ids : int or list of int, optional
            A sequence stops after producing one of these.
        stream : callable, optional
            ``stream(b, token_id)`` for every new token as soon as it is read: at once with ``eos_ids``;
            without them, from the second step on, once the step after it is launched (the device never
            waits for the host between steps). Same tokens, same order.
        final : bool
            Return each sequence's pages to the pool as soon as it stops; no ``extend`` may follow for it.
            Otherwise a stopped sequence is paused, its pages kept for the next turn.

        Returns
        -------
        GenerationResult
            ``prefill_tokens``/``prefill_s`` cover the extensions since the previous ``generate``; ``report``
            is the cache's report when the first sequence stops (``final``) or at the end, every sequence
            still holding its pages.
        """
        if self.cache is None:
            raise RuntimeError("generate() before extend(): prefill the prompts with extend(prompts) first")
        _positive("max_new_tokens", max_new_tokens)
        if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                or not math.isfinite(temperature) or temperature < 0):
            raise ValueError(f"temperature={temperature!r} must be a finite number >= 0 (0: greedy)")
        eos = _eos_ids(eos_ids, vocab_size(self.model))
        if stream is not None and not callable(stream):
            raise TypeError(f"stream={stream!r} must be a callable, stream(b, token_id)")
        B, cache, model = self.batch_size, self.cache, self.model
        live = [not c for c in self.closed]
        if not any(live):
            raise RuntimeError("every sequence is closed (close() or generate(final=True)); start a new "
                               "Decoder")
        for b in range(B):
            if not live[b]:
                continue
            context = self.lengths[b] + (self.pending[b] is not None)
            if context + max_new_tokens > model.max_seq_len:
                raise ValueError(f"max_new_tokens={max_new_tokens}: sequence {b} has {context} tokens; "
                                 f"{context + max_new_tokens} exceed the model's context of "
                                 f"{model.max_seq_len}; lower max_new_tokens or start a new Decoder")
            steps = (self.pending[b] is not None) + max_new_tokens - 1  # tokens the model will cache
            grow = self._growth(b, steps)
            if grow > cache.decode_room(b) and not self._replan_makes_room(b, steps):
                what = (f"would cache {steps} more tokens" if grow == steps else
                        f"would hold {grow} more tokens before its first decode-time eviction (evict_every="
                        f"{self.policy.evict_every})")
                fix = "raise max_tokens or lower max_new_tokens" + (" or evict_every" if grow < steps else "")
                if self.policy.eviction.prefill_compress:  # the prompt's plan can leave the room
                    fix += " (or tell extend() the generation's length: extend(..., max_new_tokens=))"
                raise ValueError(f"max_new_tokens={max_new_tokens}: sequence {b} {what}, more than its "
                                 f"layers have room for under max_tokens={self.max_tokens}; {fix}")
        if any(live[b] and self._logits[b] is None for b in range(B)):
            self.extend([[] for _ in range(B)], max_new_tokens=max_new_tokens)  # feed the pending tokens
        out: list[list[int]] = [[] for _ in range(B)]
        on_eos = [False] * B
        active = list(live)
        report = None

        def emit(next_tokens: list[int]) -> None:
            nonlocal report
            for b in range(B):
                if not active[b]:
                    continue
                out[b].append(next_tokens[b])
                if stream is not None:
                    stream(b, next_tokens[b])
                if next_tokens[b] in eos or len(out[b]) == max_new_tokens:
                    on_eos[b] = next_tokens[b] in eos
                    active[b] = False
                    self.pending[b] = next_tokens[b]
                    if final:
                        if report is None:
                            report = cache.report()
                        cache.finish_sequence(b)
                        self.closed[b] = True
                    else:
                        cache.pause(b)

        with torch.no_grad():
            t0 = time.perf_counter()
            self.start_decode(max_new_tokens)
            self._check_pool(max_new_tokens)
            first = []  # one draw per sequence, in order (a closed row gets a placeholder and no draw)
            for b in range(B):
                logits = self._logits[b]
                first.append(torch.zeros(1, dtype=torch.int64, device=self.device) if logits is None
                             else _sample(logits, temperature, self._generator))
            tokens = torch.cat(first)  # [B]
            next_tokens = tokens.tolist()  # synchronises, so the prefill time is real
            prefill_s, prefill_tokens = self._prefill_s + time.perf_counter() - t0, self._prefill_tokens
            self._prefill_s, self._prefill_tokens = 0.0, 0
            self._logits = [None] * B
            emit(next_tokens)

            step_fn, on_cuda = self._step_fn, self.compile and self.device.type == "cuda"
            # Without eos ids a sequence stops only at max_new_tokens, which the host knows: the next step
            # need not wait for this one's tokens. From the second step on, each step's tokens are read (the
            # one sync of a step) after the next step is launched, so the host's work between two steps
            # (emitting, the cache's bookkeeping, the launches) overlaps the device's instead of leaving it
            # idle. With eos ids every step is read before the next (a stop decides who steps next).
            lag = not eos
            unread = None  # lag: the last step's tokens on the device, not yet read or emitted
            decode_tokens = 0
            first_step_s = math.nan
            t0 = time.perf_counter()
            for step in range(max_new_tokens - 1):
                if not any(active):
                    break
                stepping = [b for b in range(B) if active[b]]
                positions = self.begin_step()
                if on_cuda:
                    torch.compiler.cudagraph_mark_step_begin()
                logits = step_fn(tokens, positions, cache)  # [B, V]
                tokens = _sample(logits, temperature, self._generator)
                self.end_step(stepping)  # the token fed this step is cached now
                decode_tokens += len(stepping)
                if unread is not None:
                    emit(unread.tolist())
                    unread = None
                if lag and step > 0:  # the first step is read at once: first_step_s is its real time
                    unread = tokens
                else:
                    emit(tokens.tolist())
                if step == 0:
                    first_step_s = time.perf_counter() - t0
            if unread is not None:
                emit(unread.tolist())
            decode_s = time.perf_counter() - t0
        if report is None:
            report = cache.report()
        return GenerationResult(tokens=out, finished_on_eos=on_eos, prefill_tokens=prefill_tokens,
                                prefill_s=prefill_s, decode_tokens=decode_tokens, decode_s=decode_s,
                                report=report, extra={"first_step_s": first_step_s})


def chunked_num_pages(model: Any, policy: Any, tokens: int, chunk: int, max_new_tokens: int, *,
                      page_size: int = 16, batch: int = 1, follow_ups: int = 0,
                      region: str | None = None) -> int:
    """The page pool (``Decoder(num_pages=)``) for ``batch`` sequences of at most ``tokens`` tokens (a prompt,
    or a conversation before its last answer: a fractional budget grows with the length) streamed ``chunk``
    at a time, then ``max_new_tokens`` generated: every layer's budget plus one chunk plus the generation,
    and one page per layer (per KV head's row) for the last page's rounding; every token under a policy that
    compresses no prompt.

    ``follow_ups``: the tokens later turns add before the last answer (their questions and the earlier
    answers; ``kvgen --context``), after a context of ``tokens``: compressed with it in one format (the
    budget of every token), kept whole (as generated tokens) in two.

    With a precision that stores two formats (``kvmodels.cache.tiers``), ``region`` sizes one of its two
    pools: ``"main"`` (``Decoder(num_pages=)``) the higher format's, ``"side"`` (``Decoder(side_pages=)``)
    the lower one's; ``None`` (the default) enough for either, for a ``num_pages`` both pools take. KIVI's
    unquantized pool holds its residual, a group and one chunk (the rest is quantized as it ages), its
    quantized pool the budget plus a chunk and the generation; MiKV keeps every token at its low bits, so its
    side pool takes them all; ZipCache's high bits hold their share of the budget (``salient``) plus a chunk
    and the generation, its low bits the budget plus a chunk and the generation.

    The pool is shared by the layers, so a layer-budget policy (``pyramid``, ``squeeze``, ``profile``) or
    ``duo`` keeps its shape, its large layers (heads) taking the pages the small ones leave: the layers'
    budgets add up to the mean's (the plan conserves the total), and each holds at most its budget plus a
    chunk (or a follow-up, or the generation) at a time. Leave ``max_tokens`` (each layer's own cap) at the
    model's context; a cache of ``max_tokens`` = the mean budget + one chunk holds as much but caps the large
    layers at it (measured on SmolLM2 passkey: docs/results.md, 2026-12-07).

        >>> pages = chunked_num_pages(model, policy, len(ids), 512, 64)
        >>> dec = Decoder(model, policy, num_pages=pages)
        >>> dec.extend([ids], chunk=512, max_new_tokens=64)
    """
    from kvmodels.cache.pool import ceil_div  # the cache pulls in the kernels; import when used

    for name, value in (("tokens", tokens), ("chunk", chunk), ("page_size", page_size), ("batch", batch),
                        ("max_new_tokens", max_new_tokens), ("follow_ups", follow_ups)):
        _positive(name, value, zero=name in ("max_new_tokens", "follow_ups"))
    two = stores_two_formats(policy)
    if region not in (None, "main", "side"):
        raise ValueError(f"region={region!r} must be 'main', 'side' or None (enough for either)")
    if region == "side" and not two:
        raise ValueError(f"region='side': policy {policy.name!r} stores tokens in one format (one pool); "
                         "use region=None or 'main'")
    if two and region is None:
        return max(chunked_num_pages(model, policy, tokens, chunk, max_new_tokens, page_size=page_size,
                                     batch=batch, follow_ups=follow_ups, region=r) for r in ("main", "side"))
    per_layer = tokens + follow_ups + max_new_tokens
    p = policy.precision
    residual = _residual_hold(policy)
    if residual and region == "main":  # the residual, a group, and a chunk before it ages
        per_layer = min(per_layer, residual + chunk)
    elif policy.eviction.prefill_compress and not (region == "side" and p.keeps_evicted):  # MiKV: all
        if two:  # follow-ups join whole, as generated tokens do
            budget = int(policy.budget_tokens(torch.tensor([tokens]))[0])
            if region == "main" and p.reselects:  # ZipCache's high bits: their share of the budget
                budget = p.high_share(budget)
            budget += follow_ups
        else:
            budget = int(policy.budget_tokens(torch.tensor([tokens + follow_ups]))[0])
        per_layer = min(per_layer, budget + chunk + max_new_tokens)
    return batch * int(model.n_cache_layers) * (ceil_div(per_layer, page_size) + 1)


def _residual_hold(policy: Any) -> int:
    """The tokens a precision's unquantized residual may hold whole in a layer between agings (KIVI's
    ``residual + group``: two formats, ``kvmodels.cache.tiers``), whatever the budget; 0 for the others."""
    p = getattr(policy, "precision", None)
    return 0 if p is None else int(p.held_unquantized())  # (a residual is a second format)


def stores_two_formats(policy: Any) -> bool:
    """Whether ``policy``'s precision stores tokens in two formats (``kvmodels.cache.tiers``)."""
    if getattr(policy, "precision", None) is None:
        return False
    from kvmodels.cache.storage import stored_formats  # the cache pulls in the kernels; import when used

    return len(stored_formats(policy.precision)) > 1
