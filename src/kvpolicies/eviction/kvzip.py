"""KVzip-style question-agnostic eviction (after Kim et al., 2025, "KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction", arXiv 2505.23416). Written from the paper's idea, not its code.

Why: a prompt-compression policy that votes with the prompt's last queries (SnapKV) keeps what the end of
the prompt asks about; when the question comes after the compression (a context cached once and asked many
questions), those votes are the wrong ones. KVzip ranks the context by how much the model needs each token
to *reproduce the whole context*, which depends on no question.

How it runs here: the context is prefilled and kept whole (``prefill_compress = False``); then
``kvmodels.decoder.Decoder`` runs a reconstruction pass (``probe = True``): the context's own tokens are fed
again, at the positions after it, through every layer as an extension (``PagedKVCache.begin_extend(...,
probe=True)``). Their attention covers the kept context and, causally, themselves; each context token's
score is REPLACED by the largest attention probability any probe row and any query head of its KV group
gives it (``probe_mode = "max"``, the paper's choice as we read it: a token the reconstruction needs once,
sharply, ranks high, where a sum over the rows favours tokens every row glances at). The probe's own tokens
are not stored, and
``end_extend`` compresses the sequence to its budget by those scores: the ``sinks`` first and ``recent``
last context tokens forced, the top of the rest (ties: the earlier token). Nothing is evicted while
decoding (``decode_evict = False``): the questions and answers that follow are appended.

Use it with ``pooled`` head budgets (``compose("kvzip", "pooled")``): KVzip's own allocation, one top-k
over the scores of every layer and KV head, so that a layer or head the reconstruction needs little gives
its slots to one that needs many (the split is made after the pass; docs/contract.md §4.1). Alone, every KV
head keeps its layer's share. ``Decoder(probe_prefix=)`` feeds KVzip's instruction (:data:`REPEAT`) before
the copy; ``kvgen --context`` does. ``span=N`` reconstructs the context in parts of ``N`` tokens, as the
paper does for long contexts (one pass by default, so the context must fit twice in the model's positions).
``skip=N`` leaves a chat template's opening (the prompt's first ``N`` tokens) out of the copy and the
ranking; ``kvgen --context`` sets it. Differences from kvpress's KVzip, whose scores ``kvzip(skip=N,
recent=0)`` with the instruction reproduces: in parts, each pass here normalises over the whole kept context
(there, over the sinks, its own chunk and the copy), and the ``recent`` last tokens are forced here.
Measured (SmolLM2-135M, 24 ~1k passkey prompts, the question asked after compression, full cache 22;
docs/results.md): ``kvzip(skip=24)+pooled`` with the instruction answers 21 at 0.2 and 20 at 0.5 (a second
set of 24: 22 and 22), as kvpress's KVzip (21 and 20; 21 and 22); without ``skip`` 19 and 22;
``kvzip+adakv`` (heads within a layer only) 9 and 23; ``kvzip`` alone 0 and 13. Cost: one more forward
over the context at prefill time. kvmodels' Decoder (also under a transformers model's ``generate``:
``kvmodels.hf.paged_cache(model, policy, probe_prefix=...)``, docs/hf.md) runs the probe; the vLLM plugin
refuses this policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import EvictionPolicy, check_int
from ..registry import register_policy

#: KVzip's instruction before the context's copy (the paper's), as text: a caller with a tokenizer feeds it,
#: then the chat template's opening of the assistant's turn, before the copy (``Decoder(probe_prefix=)``).
REPEAT = "\n\nRepeat the previous context exactly."
#: With ``span``: each pass after the first starts its copy this many tokens before its span (the text it
#: continues from).
OVERLAP = 8


@register_policy("kvzip", role="eviction")
@dataclass(frozen=True)
class KVzip(EvictionPolicy):
    """KVzip: rank the context by a reconstruction pass's attention, keep the top of it (question-agnostic).

    sinks: the first tokens always kept (attention sinks, StreamingLLM's 4).
    recent: the last context tokens always kept (the text a question continues from; 8 by default, small
        against any useful budget so that the reconstruction's ranking decides the rest).
    span: reconstruct the context ``span`` tokens at a time (KVzip's chunked reconstruction: one pass per
        span, each copying its span (after the probe prefix and the previous span's last ``OVERLAP``
        tokens) and scoring only its span's tokens), so a context needs ``len + prefix + OVERLAP + span``
        positions instead of ``2 * len + prefix``; ``None``: one pass over the whole context.
    skip: the prompt's first ``skip`` tokens are the chat template's opening (system prompt, user header),
        not context, as kvpress's KVzip treats them: the copy starts after them, those past the ``sinks``
        score 0 (evicted first), and each reconstruction row's probabilities are renormalised over the other
        tokens. 0 (default): the whole prompt is context.
    """

    sinks: int = 4
    recent: int = 8
    span: int | None = None
    skip: int = 0

    prefill_mode = "accumulate"  # the prompt's own scores (as h2o's); the probe's replace them
    probe_mode = "max"           # the reconstruction pass: the largest probability a token gets
    prefill_compress = False     # the context is kept whole until the probe has ranked it
    decode_evict = False         # questions and answers are appended, never evicted
    probe = True

    def __post_init__(self) -> None:
        check_int("kvzip", "sinks", self.sinks, 0)
        check_int("kvzip", "recent", self.recent, 0)
        if self.span is not None:
            check_int("kvzip", "span", self.span, 1)
        check_int("kvzip", "skip", self.skip, 0)

    @property
    def probe_skip(self) -> tuple[int, int] | None:
        """``(min(sinks, skip), skip)``: the chat template's opening, not copied and (past the sinks) out of
        the reconstruction's scores; None without ``skip``."""
        return (min(self.sinks, self.skip), self.skip) if self.skip else None

    def probe_passes(self, n: int) -> list[tuple[int, int, int]]:
        """One pass over the context (after ``skip``'s opening); with ``span``, one per span, each copied
        from ``OVERLAP`` tokens before it and scoring its span's tokens (the first pass every position)."""
        first = self.skip
        if self.span is None or self.span >= n - first:
            return [(first, n, 0)]
        return [(max(first, s - OVERLAP), min(n, s + self.span), 0 if s == first else s)
                for s in range(first, n, self.span)]

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``sinks`` first and ``recent`` last tokens, cut to the budget (sinks first)."""
        b = budgets.to(torch.int32)
        n_sink = b.clamp(max=self.sinks)
        return n_sink, (b - n_sink).clamp(max=self.recent)
