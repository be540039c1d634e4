"""The five policy roles and the statistics they read.

A policy is a frozen dataclass: its fields are its parameters, validated in ``__post_init__`` with
errors that name the parameter. Policies carry no tensors and no state; the cache
(``kvmodels.cache.PagedKVCache``) holds the state and asks the policy what to do. See
``docs/contract.md`` §3–§5.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from kvkernels import prefill_scores
from kvkernels.extend_attention import extend_attention

Role = Literal["eviction", "budget", "merge", "heads", "precision"]
ROLES: tuple[Role, ...] = ("eviction", "budget", "merge", "heads", "precision")

# Decode-time per-slot score updates the attention kernel can fuse (docs/contract.md §2.2).
ScoreMode = Literal["none", "accumulate", "gumbel", "decay", "replace", "count_low"]


def check_range(policy: str, name: str, value: float, lo: float, hi: float, *, lo_open: bool = False,
                hi_open: bool = False) -> None:
    """Raise ``ValueError`` naming ``policy.name`` when ``value`` is outside the interval."""
    bad = (value <= lo if lo_open else value < lo) or (value >= hi if hi_open else value > hi)
    if bad or (isinstance(value, float) and math.isnan(value)):
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        raise ValueError(f"{policy}: parameter {name}={value!r} is out of range {left}{lo}, {hi}{right}")


def check_number(policy: str, name: str, value: object) -> None:
    """Raise ``TypeError`` naming ``policy.name`` unless ``value`` is a real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{policy}: parameter {name} must be a number, got {value!r}")


def check_bool(policy: str, name: str, value: object) -> None:
    """Raise ``TypeError`` naming ``policy.name`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise TypeError(f"{policy}: parameter {name} must be True or False, got {value!r}")


def check_int(policy: str, name: str, value: object, lo: int) -> None:
    """Raise naming ``policy.name`` unless ``value`` is an int ``>= lo`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{policy}: parameter {name} must be an int, got {value!r}")
    if value < lo:
        raise ValueError(f"{policy}: parameter {name}={value!r} is out of range [{lo}, inf)")


def chunk_sums(scores: torch.Tensor, chunk: int) -> torch.Tensor:
    """Each token's score replaced by the sum over its chunk: ``[H, n] -> [H, n]``, chunks of ``chunk``
    consecutive tokens from the first (the last one may be shorter). Top-k over the result keeps whole
    chunks, best chunk first (ties inside a chunk go to the earlier token, so a chunk fills in order)."""
    if chunk <= 1 or scores.shape[-1] == 0:
        return scores
    n = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -n % chunk))  # [H, ceil(n / chunk) * chunk]
    sums = padded.view(*scores.shape[:-1], -1, chunk).sum(-1)  # [H, n_chunks]
    return sums.repeat_interleave(chunk, dim=-1)[..., :n]


def placed_chunk_sums(scores: torch.Tensor, chunk: int) -> torch.Tensor:
    """Like :func:`chunk_sums`, but each row's chunks are placed on its scores instead of every ``chunk``
    tokens from the first: the span of ``chunk`` consecutive tokens with the highest total becomes a chunk,
    then the highest span that overlaps no placed chunk, and so on (ties: the earlier span); the tokens left
    between placed chunks (runs shorter than ``chunk``) form chunks of their own, scored by their total
    scaled to ``chunk`` tokens. ``[H, n] -> [H, n]``.

    Why: a fixed grid cuts a number or a name in two wherever a boundary falls inside it, and a layer then
    keeps one half (SmolLM2 writes a 5-digit key as five tokens; docs/results.md, "Chunks placed on the
    scores"). A chunk placed on the highest-scoring span keeps it whole. Placement is greedy: one pass on
    the host over the spans sorted by total (prompt time only; on CUDA it syncs once per call)."""
    if chunk <= 1 or scores.shape[-1] == 0:
        return scores
    rows, n = scores.shape
    m = max(n - chunk + 1, 0)  # spans that fit
    spans = scores[:, :m].clone()  # [H, m]: span totals, summed left to right (the reference's order)
    for o in range(1, chunk):
        spans += scores[:, o:o + m]
    # Greedy = one pass over the spans, best first: a span is placed unless it overlaps a placed one. Two
    # spans of one length overlap iff one holds an end of the other, so two lookups decide it.
    order = torch.sort(spans, dim=-1, descending=True, stable=True).indices.tolist()  # ties: earlier span
    placed_starts: list[list[int]] = []
    for row in order:
        taken = bytearray(n)
        starts = []
        for s in row:
            if not taken[s] and not taken[s + chunk - 1]:
                taken[s:s + chunk] = b"\x01" * chunk
                starts.append(s)
        placed_starts.append(starts)
    first = torch.zeros_like(scores, dtype=torch.int64)  # first[h, j]: start of the placed chunk holding j
    placed = torch.zeros_like(scores, dtype=torch.bool)
    offsets = torch.arange(chunk, device=scores.device)
    for h, starts in enumerate(placed_starts):
        if starts:
            s = torch.tensor(starts, device=scores.device)
            idx = (s[:, None] + offsets).flatten()
            first[h, idx] = s.repeat_interleave(chunk)
            placed[h, idx] = True
    out = spans.gather(1, first.clamp(max=max(m - 1, 0))) if m else scores
    # The runs between placed chunks: each run's tokens score the run's total scaled to a chunk's length
    # (its mean x chunk), so a short run that holds a key's last digit competes with whole chunks on equal
    # terms instead of ranking below every one of them. scatter_add sums a run in token order on CPU;
    # CUDA's atomics may round a run's total differently.
    gap = ~placed
    run_start = gap & torch.cat([torch.ones_like(gap[:, :1]), placed[:, :-1]], dim=-1)
    run = torch.where(gap, run_start.cumsum(-1) - 1, n)  # [H, n] run index, n for placed tokens
    totals = torch.zeros(rows, n + 1, dtype=scores.dtype, device=scores.device).scatter_add_(1, run, scores)
    lengths = torch.zeros(rows, n + 1, dtype=scores.dtype, device=scores.device).scatter_add_(
        1, run, torch.ones_like(scores))
    return torch.where(gap, totals.gather(1, run) * chunk / lengths.gather(1, run), out)


def fraction_count(budgets: torch.Tensor, fraction: float) -> torch.Tensor:
    """``floor(fraction * budgets)`` as int32 ``[B]``: how many of a budget's slots a fraction names.

    The ``1e-9`` guard stops binary rounding from losing a slot (``0.29 * 100 = 28.999…``).
    """
    counts = torch.floor(budgets.to(torch.float64) * fraction + 1e-9).to(torch.int32)
    return torch.minimum(counts, budgets.to(torch.int32))


@dataclass(frozen=True)
class Policy:
    """Base of every registered policy. Subclasses are frozen dataclasses."""

    name: ClassVar[str] = ""
    role: ClassVar[Role]
    description: ClassVar[str] = ""

    def check_model(self, n_layers: int, n_kv_heads: int) -> None:
        """``ValueError`` naming this policy and the fix when its parameters do not fit a model of
        ``n_layers`` cache layers and ``n_kv_heads`` KV heads (weights measured on another model). A cache
        calls it where it is built, before any prefill; the default checks nothing."""

    def params(self) -> dict[str, Any]:
        """Parameters that differ from the defaults (what ``spec()`` serialises)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            if value != default:
                out[f.name] = value
        return out


@dataclass(frozen=True)
class LayerStats:
    """Prefill statistics a budget policy may read.

    cos_sim: ``[Lc, B]`` float32 — the budget policy's per-layer statistic: the mean over prompt tokens of
        its :meth:`BudgetPolicy.layer_statistic` (SqueezeAttention's ``cos(h_in, h_in + Attn(LN(h_in)))``,
        higher = the layer changes the residual less; the only statistic a built-in policy reads).
    """

    cos_sim: torch.Tensor | None = None


def residual_cos_sim(h_in: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """SqueezeAttention's per-token statistic: cosine similarity (float32) between the hidden state before
    an attention block ``h_in [..., dim]`` and after its residual add ``h_in + attn_out``; ``[...]``.

    ``squeeze``'s :meth:`BudgetPolicy.layer_statistic`; caches average it over the prompt's tokens.
    """
    return torch.nn.functional.cosine_similarity(h_in.float(), (h_in + attn_out).float(), dim=-1)


@runtime_checkable
class ModelProbe(Protocol):
    """What a budget policy may measure on a model to calibrate itself (:meth:`BudgetPolicy.calibrate`).

    ``kvmodels.profile.ModelProbe`` implements it for kvmodels' models; the policies never import a model.
    """

    name: str

    def retrieval_profile(self) -> tuple[float, ...]:
        """Per-cache-layer weights from the model's echo and induction heads (RazorAttention)."""
        ...

    def retrieval_heads(self) -> tuple[tuple[float, ...], ...]:
        """Per cache layer, one retrieval score per KV head: its query heads' strongest echo or induction
        score (RazorAttention), for the ``duo`` head-budget policy."""
        ...


@dataclass(frozen=True)
class NewTokens:
    """What a step provides about the tokens it caches, for an open score rule
    (:meth:`EvictionPolicy.token_scores`). ``...`` are the tokens' leading dimensions: ``[L]`` for one
    sequence's prompt, ``[B]`` for a decode step of kvmodels.

    k, v:
        ``[..., Hkv, D]`` the tokens' keys (after RoPE where the model rotates them) and values.
    positions:
        ``[...]`` int64 absolute positions.
    q:
        ``[..., Hq, D]`` the tokens' own queries (after RoPE; query head ``h`` reads KV head ``h // G``), only
        for a rule that sets ``reads_queries = True``; else ``None``.
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    q: torch.Tensor | None = None


@dataclass(frozen=True)
class EvictionPolicy(Policy):
    """Which tokens a cache layer keeps.

    A policy reduces to (a) how per-slot scores evolve (``score_mode`` at decode, ``prefill_mode`` over
    the prompt) and (b) which slots are forced (sinks, recent window); ``kvkernels.topk_compact`` then
    keeps the forced slots plus the top-scoring rest.
    """

    role: ClassVar[Role] = "eviction"
    score_mode: ClassVar[ScoreMode] = "none"
    # Mode used to score the prompt (``kvkernels.prefill_scores``); None = the prompt needs no scores.
    prefill_mode: ClassVar[ScoreMode | None] = None
    prefill_compress: ClassVar[bool] = True   # compress the prompt to the budget after prefill
    decode_evict: ClassVar[bool] = True       # evict during decoding
    # Whether ``decode_kwargs`` depends on the generation length (Keyformer's temperature schedule).
    needs_max_new_tokens: ClassVar[bool] = False
    # Whether ``token_scores`` reads ``NewTokens.q`` (the caches then hand it the tokens' queries).
    reads_queries: ClassVar[bool] = False
    # The context is ranked by a reconstruction pass that the Decoder runs (kvzip), with this score mode over
    # the pass's rows (``kvkernels.extend_attention``'s modes; ``max``: the largest probability a token gets).
    probe: ClassVar[bool] = False
    probe_mode: ClassVar[str] = "accumulate"

    @property
    def probe_skip(self) -> tuple[int, int] | None:
        """``(lo, hi)``: a reconstruction pass copies the prompt from ``hi`` on and leaves positions
        ``[lo, hi)`` out of its scores (``extend_attention``'s ``skip``); None: it copies and scores all."""
        return None

    def probe_passes(self, n: int) -> list[tuple[int, int, int]]:
        """A reconstruction's passes over a context of ``n`` tokens: ``(start, stop, scored)`` each copies
        context tokens ``[start, stop)`` and takes the scores of the kept tokens from position ``scored``
        on (up to ``stop``, except in the last pass). One pass here, from :attr:`probe_skip`'s end; every
        cache that runs the probe (``kvmodels.Decoder``) asks this."""
        skip = self.probe_skip
        return [(0 if skip is None else skip[1], n, 0)]

    def prefill_window(self, prompt_len: int) -> int:
        """Query rows (the last ``window``) that score the prompt; 0 = all rows."""
        return 0

    def forced(self, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n_sink, n_recent)`` int32 ``[B]`` for per-sequence ``budgets`` ``[B]``.

        ``n_sink + n_recent <= budgets`` always.
        """
        zero = torch.zeros_like(budgets, dtype=torch.int32)
        return zero, zero

    def min_budget(self) -> int:
        """Smallest per-layer budget this policy can run with."""
        return 1

    def decode_kwargs(self, step: int, max_new_tokens: int) -> dict[str, Any]:
        """Extra keyword arguments for the fused score update at decode ``step`` (0-based)."""
        return {}

    def prefill_kwargs(self, prompt_len: int) -> dict[str, Any]:
        """Extra keyword arguments for ``prefill_scores`` (decay, temperature, seed…)."""
        return {}

    def postprocess_prefill_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Transform ``[Hkv, L]`` prompt scores before selection (e.g. SnapKV pooling)."""
        return scores

    def prompt_scores(self, q: torch.Tensor, k: torch.Tensor, *, scale: float, seed: int = 0,
                      alibi_slopes: torch.Tensor | None = None,
                      lse: torch.Tensor | None = None) -> torch.Tensor:
        """``[Hkv, L]`` scores of a prompt's keys ``k [L, Hkv, D]`` by its rotated queries ``q [L, Hq, D]``:
        ``kvkernels.prefill_scores`` with this policy's ``prefill_mode``, ``prefill_window(L)`` and
        ``prefill_kwargs(L)`` (which may override ``seed``), then :meth:`postprocess_prefill_scores`. Every
        cache (kvmodels' paged cache, the vLLM plugin) scores a prompt through it."""
        if self.prefill_mode is None:
            raise ValueError(f"eviction policy {self.name!r} scores no prompt (prefill_mode is None)")
        L = q.shape[0]
        kwargs = {"seed": seed, **self.prefill_kwargs(L)}
        scores = prefill_scores(q, k, scale=scale, mode=self.prefill_mode, window=self.prefill_window(L),
                                alibi_slopes=alibi_slopes, lse=lse, **kwargs)
        return self.postprocess_prefill_scores(scores)

    def extension_scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         kept_k: torch.Tensor, kept_v: torch.Tensor, kept_pos: torch.Tensor,
                         kept_scores: torch.Tensor, *, scale: float, seed: int = 0,
                         alibi_slopes: torch.Tensor | None = None,
                         probe: tuple[int, int | None] | None = None, scoring: bool = True,
                         sliding_window: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An extension's attention and scores: ``n`` new tokens (``q [n, Hq, D]``, ``k, v [n, Hkv, D]``,
        ``positions [n]``) after the kept ones (``kept_k, kept_v [m, Hkv, D]``, ``kept_pos [m, Hkv]`` and
        ``kept_scores [Hkv, m]``, each KV head's in position order), through ``kvkernels.extend_attention``
        (``sliding_window``: the layer's, when the model has one there).

        Returns its output ``[n, Hq, D]`` and the scores the tokens hold after it (None when nothing is
        scored: no ``prefill_mode``, or ``scoring=False``):

        * ``probe=(lo, hi)``: a reconstruction pass (:attr:`probe_mode`, :attr:`probe_skip`) whose tokens
          are not stored: ``[Hkv, m]``, the kept tokens at positions ``lo <= p < hi`` (``hi`` None: to the
          end) take the pass's scores, the others keep theirs;
        * window votes (:meth:`prefill_window` > 0, or ``replace``): ``[Hkv, m + n]``, the votes over kept
          and new tokens, post-processed (:meth:`postprocess_prefill_scores`), replace the old ones;
        * else every row scores: the kept tokens continue theirs (``decay``: times ``decay ** n``) and the
          new ones start from theirs, as decode steps would have scored them.

        Every cache that takes tokens after the prompt (``kvmodels``' ``extend_attend``) scores them through
        it."""
        n, m = q.shape[0], kept_k.shape[0]
        mode = self.probe_mode if probe is not None else self.prefill_mode if scoring else None
        window = self.prefill_window(n) if mode is not None and probe is None else 0
        kwargs = self.prefill_kwargs(n) if mode is not None else {}
        decay = float(kwargs.get("decay", 1.0))
        out, scores = extend_attention(
            q, k, v, positions, kept_k, kept_v, kept_pos, scale=scale, alibi_slopes=alibi_slopes, mode=mode,
            window=window, decay=decay, seed=seed, temperature=float(kwargs.get("temperature", 1.0)),
            skip=self.probe_skip if probe is not None else None, sliding_window=sliding_window)
        if scores is None:
            return out, None
        if probe is not None:
            lo, hi = probe
            inside = kept_pos.t() >= lo
            if hi is not None:
                inside &= kept_pos.t() < hi
            return out, torch.where(inside, scores[:, :m], kept_scores)
        if window or mode == "replace":  # window votes: they replace the kept tokens' old votes
            return out, self.postprocess_prefill_scores(scores)
        old = kept_scores * decay**n if mode == "decay" else kept_scores
        return out, torch.cat([old + scores[:, :m], scores[:, m:]], dim=1)

    def score_source_layer(self, layer: int) -> int:
        """The cache layer whose prompt scores ``layer`` selects by (itself; ChunkKV's layer-wise index
        reuse names an earlier one). Layers are prefilled in order, so the source is always scored first."""
        return layer

    def token_scores(self, new: NewTokens) -> torch.Tensor:
        """An open score rule: each new token's score from what its step provides (:class:`NewTokens`: its
        key, value, position and, with ``reads_queries = True``, its own queries), ``[...]`` leading
        dimensions -> ``[..., Hkv]`` float32 (higher = kept first; ties: the earlier token).

        Override it to write a new rule in torch alone (``knorm`` is one): the caches call it on the
        prompt at prefill and on each new token when it is appended (inside the compiled decode step: keep
        it traceable, no host syncs), store the result as the slot's score and rank by it; no cache or
        kernel changes. A score is fixed when its token is cached. Such a policy keeps
        ``score_mode = "none"`` and ``prefill_mode = None`` (checked when the class is defined): rules whose
        scores change as later queries attend (attention mass) are the built-in score modes, fused in the
        kernels, because the kernels do not materialise the attention probabilities.
        """
        raise NotImplementedError(f"{type(self).__name__} scores tokens through its score modes")

    @property
    def scores_tokens(self) -> bool:
        """Whether this policy defines :meth:`token_scores` (an open, attention-free score rule)."""
        return type(self).token_scores is not EvictionPolicy.token_scores

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.token_scores is not EvictionPolicy.token_scores and (
                cls.score_mode != "none" or cls.prefill_mode is not None):
            raise TypeError(f"{cls.__name__} defines token_scores and also score_mode={cls.score_mode!r} / "
                            f"prefill_mode={cls.prefill_mode!r}; a policy scores tokens one way: keep "
                            "score_mode='none' and prefill_mode=None with token_scores")
        if cls.reads_queries and cls.token_scores is EvictionPolicy.token_scores:
            raise TypeError(f"{cls.__name__} sets reads_queries but defines no token_scores to read them")

    @property
    def heads_share_selection(self) -> bool:
        """Whether every KV head of a layer keeps the same tokens: before each decode-time eviction the
        cache replaces each slot's per-head scores by their mean over the layer's KV heads (the policy's
        ``postprocess_prefill_scores`` does the same for the prompt). Heads then rank identically and, as
        they hold the same tokens in the same slots, evict the same ones."""
        return False

    def eviction_scores(self, scores: torch.Tensor, head_dim: int) -> torch.Tensor:
        """What a decode-time eviction ranks by, from the stored per-(slot, KV head) ``scores`` (KV heads
        along ``head_dim``): the scores themselves, or, when :attr:`heads_share_selection`, their mean over
        the layer's KV heads broadcast back to every head (a view; both caches call this)."""
        if not self.heads_share_selection:
            return scores
        return scores.mean(head_dim, keepdim=True).expand_as(scores)


@dataclass(frozen=True)
class BudgetPolicy(Policy):
    """How many tokens each cache layer keeps."""

    role: ClassVar[Role] = "budget"
    needs_stats: ClassVar[bool] = False

    def layer_statistic(self, h_in: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor | None:
        """What this policy reads from a prefilled layer, per token: ``[...]`` float32 from the layer's input
        hidden states ``h_in [..., dim]`` and its attention output ``attn_out [..., dim]``, or ``None`` when
        it reads nothing (the default: the cache then computes nothing). Caches average it over the prompt
        into ``LayerStats.cos_sim``. Models offer the two tensors at one observation point
        (``cache.observe``) and know no policy."""
        return None

    @property
    def needs_calibration(self) -> bool:
        """Whether :meth:`calibrate` has something to measure (e.g. ``profile`` without weights)."""
        return False

    def calibrate(self, probe: ModelProbe) -> tuple[BudgetPolicy, str | None]:
        """This policy fitted to a model through ``probe``, and a line saying what was measured (``None``
        when nothing was). Called once per model, before generating; the default changes nothing."""
        return self, None

    def allocate(self, budget_tokens: torch.Tensor, n_layers: int, stats: LayerStats | None,
                 min_budget: int = 1) -> torch.Tensor:
        """Per-layer budgets ``[n_layers, B]`` int64 from per-layer budgets ``[B]``.

        Each column sums to exactly ``n_layers * budget_tokens[b]`` and each entry is ``>= min_budget``
        (when ``budget_tokens[b] >= min_budget``).
        """
        raise NotImplementedError


@dataclass(frozen=True)
class MergePolicy(Policy):
    """Which cache layers share storage (MiniCache)."""

    role: ClassVar[Role] = "merge"

    def pairs(self, n_layers: int) -> list[tuple[int, int]]:
        """Adjacent cache-layer pairs ``(l - 1, l)`` to merge; empty = no merging."""
        return []

    def region(self, ka: torch.Tensor, kb: torch.Tensor, va: torch.Tensor, vb: torch.Tensor,
               pos: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> dict[str, torch.Tensor]:
        """One sequence's merged region (docs/contract.md §5.1) from the pair's kept tokens.

        ``ka, kb, va, vb [N, Hkv, D]`` are the two layers' keys and values of the same ``N`` tokens,
        ``pos [N, Hkv]`` their positions and ``sa, sb [N, Hkv]`` their scores. Returns the region's
        ``[n_slots, Hkv, ...]`` tensors ``k v pos score k_mag_a k_mag_b v_mag_a v_mag_b mask`` (as
        ``kvkernels.merge_region`` builds them). Both caches call this and only store what it returns, so a
        merge policy's parameters and rule live here. A policy whose :meth:`pairs` is not empty must
        define it (checked when the class is defined).
        """
        raise NotImplementedError(f"{type(self).__name__} merges no layers")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.pairs is not MergePolicy.pairs and cls.region is MergePolicy.region:
            raise TypeError(f"{cls.__name__} defines pairs but not region; a merge policy that pairs layers "
                            "says how the pair is stored: define region(ka, kb, va, vb, pos, sa, sb), e.g. "
                            "by calling kvkernels.merge_region with the policy's own parameters")


@dataclass(frozen=True)
class HeadBudgetPolicy(Policy):
    """How a cache layer's budget is split among its KV heads (Ada-KV).

    The default, ``even``, gives every head the layer's budget. A policy with ``per_head = True`` gives the
    heads of a layer different token counts; the cache must then hold each (sequence, KV head) in pages of
    its own (``kvmodels.cache.HeadPagedKVCache``), so a head that keeps ``n`` tokens holds ``ceil(n / S)``
    pages (docs/contract.md §4.1).
    """

    role: ClassVar[Role] = "heads"
    per_head: ClassVar[bool] = False
    # Whether split() ranks heads by the tokens' scores. A sequence that takes more tokens after its prompt
    # (a follow-up turn, a chunked prefill) is re-split from the tokens its heads still hold: a split that
    # reads scores would then see only the survivors of the first split (``adakv``), so the cache refuses to
    # extend it; one that reads the scores' shape only (``duo``: which heads retrieve is fixed) can continue.
    split_reads_scores: ClassVar[bool] = True
    # Whether the policy splits the budgets of all of a sequence's compressed layers together
    # (:meth:`split_layers`, ``pooled``): slots move between layers as well as heads, the total is kept.
    pools_layers: ClassVar[bool] = False

    @property
    def needs_calibration(self) -> bool:
        """Whether :meth:`calibrate` has something to measure (e.g. ``duo`` without weights)."""
        return False

    def calibrate(self, probe: ModelProbe) -> tuple[HeadBudgetPolicy, str | None]:
        """This policy fitted to a model through ``probe``, and a line saying what was measured (``None``
        when nothing was); as :meth:`BudgetPolicy.calibrate`. The default changes nothing."""
        return self, None

    def split(self, scores: torch.Tensor, budget: int, n_forced: tuple[int, int], *,
              layer: int | None = None) -> torch.Tensor:
        """Per-head budgets ``[Hkv]`` int64 of one layer of one sequence.

        Parameters
        ----------
        scores:
            ``[Hkv, L]`` float32 prompt scores of the layer's tokens in position order, as the eviction policy
            ranks them (higher = kept first).
        budget:
            The layer's budget ``B`` per head (from the layer-budget policy).
        n_forced:
            ``(n_sink, n_recent)`` the eviction policy forces in every head at budget ``B``: the first
            ``n_sink`` and the last ``n_recent`` tokens.
        layer:
            The cache layer's index (``ComposedPolicy.plan`` passes it), for a policy that treats layers
            differently (``duo``); ``None`` when the caller has none (the others ignore it).

        Returns budgets that sum to ``Hkv * B`` when ``L > B`` (each at least ``n_sink + n_recent`` and 1, at
        most ``L``) and ``B`` for every head otherwise.
        """
        return torch.full((scores.shape[0],), int(budget), dtype=torch.int64)

    def split_layers(self, scores: Sequence[torch.Tensor], budgets: Sequence[int],
                     n_forced: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``[n, Hkv]`` int64 budgets of the ``n`` compressed layers of one sequence, split together
        (called instead of :meth:`split` when ``pools_layers``): ``scores[i]`` ``[Hkv, L_i]`` with ``L_i >
        budgets[i]``, ``n_forced[i]`` as :meth:`split`'s. Returns budgets summing to ``Hkv * sum(budgets)``,
        each at least ``n_sink + n_recent`` and 1 and at most ``L_i``. The default splits each layer alone."""
        return torch.stack([torch.as_tensor(self.split(s, b, f)).to(torch.int64)
                            for s, b, f in zip(scores, budgets, n_forced)])


NATIVE_BITS = 16  # PrecisionPolicy.assign's code for a token stored unquantized, in the cache's dtype


@dataclass(frozen=True)
class PrecisionPolicy(Policy):
    """How many bits each token costs (KIVI, ZipCache, MiKV): the default, ``native``, stores every kept
    token in the cache's dtype; the others store some or all tokens as ``kvkernels.quant`` rows (codes of
    ``bits`` per channel plus a scale and a zero point per ``group`` channels), token-wise so that eviction
    can still move or drop any slot on its own.

    A precision policy decides per (KV head, token) of a layer, from the eviction policy's decision and its
    prompt scores, how the token is stored (:meth:`assign`); storage adapters that hold quantized rows read
    that decision. ``quantizes`` is False only for ``native``. A policy with a ``channel_scale`` field set
    asks for ZipCache's channel-separable keys (each sequence's keys stored over a per-channel factor,
    ``kvkernels.quant.key_channel_scale``); one with ``rotate`` set, for rows stored rotated by a fixed
    randomized Hadamard matrix (``kvkernels.quant.hadamard_rotation``; every token quantized).
    """

    role: ClassVar[Role] = "precision"
    quantizes: ClassVar[bool] = True

    def assign(self, kept: torch.Tensor, scores: torch.Tensor | None,
               voters: torch.Tensor | None = None) -> torch.Tensor:
        """Bits per token ``[Hkv, L]`` int64 of one layer of one sequence, tokens in position order: 0 for a
        token not stored, :data:`NATIVE_BITS` for one stored unquantized, else 2, 4 or 8.

        ``kept [Hkv, L]`` bool is the eviction policy's decision (True = kept); ``scores [Hkv, L]`` float32
        its prompt scores (accumulated attention where it has them; None for selections without scores);
        ``voters [L]`` how many of the queries behind those scores see each token (a policy whose last
        ``W`` queries vote, ``snapkv``: ``min(W, L - i)``; None: every query, ``L - i``).
        """
        return torch.where(kept, NATIVE_BITS, 0).to(torch.int64)

    needs_scores: ClassVar[bool] = False  # assign ranks by the eviction policy's prompt scores
    #: What an eviction policy evicts while decoding is kept at the lower format instead of dropped (MiKV).
    keeps_evicted: ClassVar[bool] = False
    #: The higher format holds the most salient tokens, chosen again as tokens arrive (ZipCache, its
    #: ``saliency`` and ``salient`` share): after each chunk of a prompt, and while decoding every ``every``
    #: tokens (kvmodels' ``SideRegion.reselect`` / ``recompress``).
    reselects: ClassVar[bool] = False

    def held_unquantized(self) -> int:
        """The newest tokens a row may hold in the cache's dtype whatever its budget, waiting to be quantized
        as they age (:meth:`aging`): KIVI's ``residual + group``; 0 for a precision that ages nothing. Every
        cache that holds such a residual sizes its unquantized pool and its checks by it."""
        return 0

    def aging(self, n):
        """How many of a row's ``n`` newest tokens, waiting in the cache's dtype, are quantized now (an int,
        or per row of a numpy array / tensor); none unless :meth:`held_unquantized`."""
        return n * 0

    def group_size(self) -> int:
        """Channels per scale / zero point of the quantized rows (0: nothing quantized)."""
        return 0

    def formats(self) -> tuple[int, ...]:
        """The bit widths :meth:`assign` can return besides 0 (each needs its own row format)."""
        return (NATIVE_BITS,)


def token_bytes(bits: torch.Tensor, head_dim: int, group: int, dtype_bytes: int,
                param_dtype: torch.dtype = torch.float16) -> int:
    """Bytes of K and V of the tokens in ``bits`` (:meth:`PrecisionPolicy.assign`'s output): a native
    token ``2 * head_dim * dtype_bytes``, a quantized one twice its packed row
    (``kvkernels.quant.bytes_per_row``: codes plus a scale and a zero point per group), a dropped one
    nothing."""
    from kvkernels.quant import bytes_per_row

    total = 0
    for b in bits.unique().tolist():
        if b == 0:
            continue
        per = head_dim * dtype_bytes if b == NATIVE_BITS else bytes_per_row(head_dim, b, group, param_dtype)
        total += 2 * int((bits == b).sum()) * per
    return total
