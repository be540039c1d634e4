"""A paged, ragged KV cache driven by a composed policy (docs/contract.md §1, §4–§6).

One page pool serves every cache layer. A sequence's layer owns whole pages, listed in its row of the
layer's page table; eviction compacts the kept tokens to the front and returns the pages past the budget to
a free stack, so a smaller budget really holds less memory. Every tensor is allocated once, so a compiled
decode step (``append`` + ``attend``) never sees a new shape, and ``append``/``attend`` are pure tensor
code (no ``.item()``, no branching on tensor values).

Lengths never depend on scores (only on prompt lengths, budgets and the step), so the cache mirrors them on
the host: ``prepare_decode`` checks the free-page count without a device sync and raises before anything is
written.

Layout of the pool: pages ``0 .. num_pages - 1`` are real pages handed out by the free stack; page
``num_pages`` is a *trash page* that rows without a sequence (finished, or beyond the batch) write into, so
``append`` needs no branch for them. ``free_pages[num_pages + 1]`` is the kernels' write sink.

MiniCache (a ``merge`` policy, e.g. ``compose("h2o", "minicache")``): each merged pair of cache layers
``(a, b)`` becomes ONE storage region, owned by layer ``a``'s page table; layer ``b`` reads ``a``'s pages and
holds none of its own. See :meth:`PagedKVCache.finish_prefill` for how the region is built and
docs/contract.md §5 for the accounting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kvkernels import check_shape, check_tensor, draw_gumbel_, noise_seed, prefill_seed

# From the submodules: importing ``kvkernels.topk_compact`` binds the package attribute of that name to the
# submodule, which hides the package's lazily exported function of the same name.
from kvkernels.merge import merge_restore
from kvkernels.paged_attention import Alibi, Restore, ScoreUpdate, paged_decode_attention
from kvkernels.score_update import (
    COLUMN_SUM_MODES,
    prefill_attention,
    prefill_attention_scores,
    prefill_scores,
)
from kvkernels.topk_compact import topk_compact, topk_evict
from kvmodels.extend_attention import extend_attention
from kvmodels.replay import Replays
from kvpolicies.base import LayerStats, NewTokens
from kvpolicies.plan import CompressionPlan

_INT_DTYPES = (torch.int32, torch.int64)


def _op_rows_key(layers, seqs, *rows: np.ndarray) -> tuple:
    return (tuple(layers), tuple(seqs), *(np.ascontiguousarray(r).tobytes() for r in rows))


@dataclass(frozen=True)
class _Compaction:
    """One compaction call (:meth:`PagedKVCache._compaction`): ``device()`` does its tensor work (no host
    sync), ``commit()`` updates the host mirror; ``key`` names the device work (same key, same launches on
    the same tensors) and ``rows`` are the device rows it reads."""

    key: tuple
    rows: tuple
    device: Callable[[], None]
    commit: Callable[[], None]


def _ceil_div(a, b):
    return -(-a // b)


@dataclass
class _Extension:
    """An extension in progress (:meth:`PagedKVCache.begin_extend`): sequence ``b`` takes ``n`` tokens."""

    b: int
    n: int
    budget_len: int  # the length the sequence's budget is a fraction of afterwards
    done: np.ndarray  # [Lc] bool, the layers extended so far


@dataclass(frozen=True)
class CacheReport:
    """Memory held by a :class:`PagedKVCache`, from its host mirror (no device sync).

    Attributes
    ----------
    page_size, page_bytes:
        Slots per page and bytes per page (K and V of every KV head plus the int32 position and the float32
        score of each (slot, head); with MiniCache also the four float32 magnitudes and the uint8 visibility
        mask of each (slot, head), which the pool then holds for every page).
    num_pages:
        Pages in the pool (not counting the trash page).
    bytes_per_layer:
        ``[Lc]`` bytes of the pages each cache layer holds now.
    total_bytes:
        Sum of ``bytes_per_layer``.
    peak_bytes:
        Largest ``total_bytes`` since ``start`` (prefill holds the full prompt before compression).
    full_cache_bytes, full_cache_peak_bytes:
        What an uncompressed cache with the same pages would hold now / at its peak: every token seen by
        every active sequence in every cache layer.
    tokens_per_layer:
        ``[Lc][B]`` slots each layer stores for each sequence of the batch (0 for finished sequences).
    layer_budgets:
        ``[Lc][B]`` per-layer slot budgets (``None`` before ``finish_prefill``).
    merged_pairs:
        MiniCache pairs ``(a, b)``. A pair's shared region is listed under ``a`` (its bytes, its slots --
        shared slots once, each layer's private slots -- and the pair's budget ``B_a + B_b``); ``b`` lists 0
        of each, so every column still sums to what the cache holds and the budgets still sum to
        ``Lc * budget_tokens``.
    head_tokens:
        ``[Lc][B][Hkv]`` tokens each KV head holds, from a ``HeadPagedKVCache`` (whose heads hold different
        counts; its ``tokens_per_layer`` and ``layer_budgets`` are then means over the heads); else ``None``.
    """

    page_size: int
    page_bytes: int
    num_pages: int
    bytes_per_layer: tuple[int, ...]
    total_bytes: int
    peak_bytes: int
    full_cache_bytes: int
    full_cache_peak_bytes: int
    tokens_per_layer: tuple[tuple[float, ...], ...]
    layer_budgets: tuple[tuple[float, ...], ...] | None
    merged_pairs: tuple[tuple[int, int], ...] = ()
    head_tokens: tuple[tuple[tuple[int, ...], ...], ...] | None = None

    @property
    def pages_in_use(self) -> int:
        return self.total_bytes // self.page_bytes

    def __str__(self) -> str:
        mib = 1 / 2**20
        lines = [f"{'layer':>5} {'MiB':>10} {'tokens per sequence':<30} {'budgets':<30}"]
        for l, nbytes in enumerate(self.bytes_per_layer):
            toks = " ".join(str(t) for t in self.tokens_per_layer[l])
            budgets = "-" if self.layer_budgets is None else " ".join(str(t) for t in self.layer_budgets[l])
            lines.append(f"{l:>5} {nbytes * mib:>10.3f} {toks:<30} {budgets:<30}")
        ratio = self.total_bytes / self.full_cache_bytes if self.full_cache_bytes else float("nan")
        lines += [
            f"total {self.total_bytes * mib:.3f} MiB in {self.pages_in_use}/{self.num_pages} pages of "
            f"{self.page_size} slots ({self.page_bytes} B each)",
            f"peak  {self.peak_bytes * mib:.3f} MiB",
            f"full cache {self.full_cache_bytes * mib:.3f} MiB now, "
            f"{self.full_cache_peak_bytes * mib:.3f} MiB peak; held/full = {ratio:.3f}",
        ]
        if self.merged_pairs:
            lines.append(f"merged pairs (stored under the first layer): {list(self.merged_pairs)}")
        return "\n".join(lines)


class PagedKVCache:
    """Paged, ragged, policy-driven KV cache shared by all cache layers of one model.

    Parameters
    ----------
    n_layers:
        ``Lc``, number of cache (KV) layers; the model maps its layers onto these.
    n_kv_heads, head_dim, n_q_heads:
        ``Hkv``, ``D``, ``Hq`` (``Hq`` must be a multiple of ``Hkv``).
    max_batch:
        Most sequences one batch may hold.
    max_tokens:
        Longest ``prompt + new tokens`` one sequence may reach.
    page_size:
        ``S``, slots per page.
    num_pages:
        Pages in the pool; ``None`` gives enough for ``max_batch`` uncompressed sequences of ``max_tokens``.
    dtype, device:
        Of the K/V pages.
    policy:
        A ``kvpolicies.ComposedPolicy`` (``compose(...)``).
    seed:
        Seeds, together with ``policy.seed``, the Gumbel noise of score modes that draw it (decode: a
        ``torch.Generator`` reset by ``start``; prefill: ``prefill_scores(seed=prefill_seed(l, b))``).

    Attributes
    ----------
    k_pages, v_pages:
        ``[P + 1, S, Hkv, D]`` ``dtype`` (the last page is the trash page).
    slot_pos:
        ``[P + 1, S, Hkv]`` int32 original position of each kept token.
    slot_score:
        ``[P + 1, S, Hkv]`` float32 eviction scores.
    free_pages, n_free:
        ``[P + 2]`` int32 stack of free page ids and ``[1]`` int64 its height.
    page_table, seq_lens:
        ``[Lc, max_batch, M]`` int32 and ``[Lc, max_batch]`` int32 (``M = ceil(max_tokens / S)``).
    active:
        ``[max_batch]`` bool, rows holding an unfinished sequence.
    gumbel_noise, temperature:
        ``[Lc, max_batch, Hq, M * S]`` float32 noise of the current step and ``[1]`` float32 tau (only
        allocated for the ``gumbel`` score mode).
    layout:
        ``kvpolicies.plan.MergeLayout``: where each layer stores its tokens (``policy.merge_layout(Lc)``).
    merged_pairs:
        MiniCache pairs ``(a, b)`` of cache layers (``layout.pairs``; empty without merging).
    plan:
        The batch's ``kvpolicies.plan.CompressionPlan`` (``None`` before ``finish_prefill``): the budgets
        and forced counts the cache compacts to, and the eviction schedule.
    k_mag, v_mag:
        ``[2, P + 1, S, Hkv]`` float32 per-slot magnitudes of a merged region (member 0 = layer ``a``, 1 =
        layer ``b``; 1.0 on private slots). Only allocated with merging; ``M`` then covers ``2 * max_tokens``
        slots, since a region holds the private tokens of both layers.
    slot_mask:
        ``[P + 1, S, Hkv]`` uint8 visibility of a region's slots: bit 1 = layer ``a``, bit 2 = layer ``b``.
    """

    # Whether each row of the pool is one (sequence, KV head) of a head-budget policy (HeadPagedKVCache),
    # and how many consecutive rows one sequence spans.
    rows_are_heads = False
    rows_per_sequence = 1

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_q_heads: int, max_batch: int,
                 max_tokens: int, page_size: int = 16, num_pages: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", policy=None,
                 seed: int = 0):
        from kvpolicies import ComposedPolicy, compose

        if policy is None:
            policy = compose("full")
        if not isinstance(policy, ComposedPolicy):
            raise TypeError(f"policy must be a kvpolicies.ComposedPolicy (build one with "
                            f"kvpolicies.compose(...)), got {type(policy).__name__}")
        if policy.heads.per_head and not self.rows_are_heads:
            raise ValueError(f"policy {policy.name!r} gives the KV heads of a layer different budgets "
                             f"({policy.heads.name!r}), which a page of every head cannot hold; use "
                             "kvmodels.head_cache.HeadPagedKVCache (or kvmodels.cache.paged_cache, which "
                             "picks the class for a policy)")
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                            ("n_q_heads", n_q_heads), ("max_batch", max_batch), ("max_tokens", max_tokens),
                            ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if n_q_heads % n_kv_heads:
            raise ValueError(f"n_q_heads={n_q_heads} must be a multiple of n_kv_heads={n_kv_heads} "
                             "(GQA groups)")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        # Where each layer stores its tokens (MiniCache pairs share a region), decided by the policy.
        self.layout = policy.merge_layout(n_layers)
        self._width = np.asarray(self.layout.width, dtype=np.int64)  # [Lc] the layout's, as an array

        self.policy = policy
        self.eviction = policy.eviction
        self.n_layers, self.n_kv_heads, self.n_q_heads = n_layers, n_kv_heads, n_q_heads
        self.head_dim = head_dim
        self.max_batch, self.max_tokens, self.page_size = max_batch, max_tokens, page_size
        # A region holds up to both layers' tokens: 2 * max_tokens slots.
        self.max_pages = _ceil_div(max_tokens * self.layout.max_width, page_size)  # M
        if num_pages is None:  # a region never needs more pages than its two layers would
            num_pages = n_layers * max_batch * _ceil_div(max_tokens, page_size)
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive int or None, got {num_pages!r}")
        self.num_pages = num_pages
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # tensors made on "cuda" report "cuda:N"
            device = torch.device("cuda", torch.cuda.current_device())
        self.dtype, self.device = dtype, device
        # Per pass i of _allocate_next_pages: the layers appending an i-th slot (uploaded once, not per step).
        self._width_masks = [torch.as_tensor(self._width > i, device=self.device)
                             for i in range(self.layout.max_width)]
        self.seed = seed
        # Gumbel noise depends on both the policy's seed and the cache's (e.g. a generation's sampling seed).
        self._noise_seed = noise_seed(policy.seed, seed)
        self.trash_page = num_pages

        P, S, H, D, M = num_pages + 1, page_size, n_kv_heads, head_dim, self.max_pages
        dev = self.device
        self.k_pages = torch.zeros(P, S, H, D, dtype=dtype, device=dev)
        self.v_pages = torch.zeros(P, S, H, D, dtype=dtype, device=dev)
        self.slot_pos = torch.zeros(P, S, H, dtype=torch.int32, device=dev)
        self.slot_score = torch.zeros(P, S, H, dtype=torch.float32, device=dev)
        self.free_pages = torch.zeros(P + 1, dtype=torch.int32, device=dev)
        self.n_free = torch.zeros(1, dtype=torch.int64, device=dev)
        self.page_table = torch.full((n_layers, max_batch, M), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n_layers, max_batch, dtype=torch.int32, device=dev)
        self.active = torch.zeros(max_batch, dtype=torch.bool, device=dev)
        self.budgets = torch.ones(n_layers, max_batch, dtype=torch.int32, device=dev)
        self.cos_sim = torch.zeros(n_layers, max_batch, dtype=torch.float32, device=dev)
        self.k_mag = self.v_mag = self.slot_mask = None
        extra_bytes = 0
        if self.layout.pairs:
            self.k_mag = torch.ones(2, P, S, H, dtype=torch.float32, device=dev)
            self.v_mag = torch.ones(2, P, S, H, dtype=torch.float32, device=dev)
            self.slot_mask = torch.zeros(P, S, H, dtype=torch.uint8, device=dev)
            extra_bytes = 4 * 4 + 1

        self.score_mode = self.eviction.score_mode
        self.gumbel = self.score_mode == "gumbel"
        self.gumbel_noise: torch.Tensor | None = None
        if self.gumbel:
            self.gumbel_noise = torch.zeros(n_layers, max_batch, n_q_heads, M * S, dtype=torch.float32,
                                            device=dev)
        self.temperature = torch.ones(1, dtype=torch.float32, device=dev)
        self.decay = 1.0
        # The compiled decode step mutates these in place (K/V, slot positions and scores, lengths).
        # Inductor's CUDA graph trees replay a graph that mutates its inputs only if those inputs have
        # static addresses, as module buffers do; marked, they do too (unguarded: a new cache re-records
        # the graph instead of recompiling the step). They are allocated once and only ever updated in place.
        for buf in self.static_buffers():
            torch._dynamo.mark_static_address(buf)
        self.page_bytes = S * H * (2 * D * self.k_pages.element_size() + 4 + 4 + extra_bytes)

        self.batch_size = 0
        self._state = "idle"
        # Decode-time eviction as CUDA graphs (kvmodels.replay); eager elsewhere.
        self._replays = Replays(enabled=self.device.type == "cuda")
        self._reset_pool()

    @property
    def merged_pairs(self) -> list[tuple[int, int]]:
        """MiniCache pairs ``(a, b)`` (``layout.pairs``)."""
        return list(self.layout.pairs)

    def static_buffers(self) -> list[torch.Tensor]:
        """Every device tensor the decode step reads or writes; allocated once, updated only in place."""
        bufs = [self.k_pages, self.v_pages, self.slot_pos, self.slot_score, self.free_pages, self.n_free,
                self.page_table, self.seq_lens, self.active, self.budgets, self.cos_sim, self.temperature]
        bufs += [t for t in (self.k_mag, self.v_mag, self.slot_mask, self.gumbel_noise) if t is not None]
        return bufs

    # ------------------------------------------------------------------ host bookkeeping
    def _reset_pool(self) -> None:
        """Every page free, every row empty (in place: a compiled step keeps its buffers)."""
        P = self.num_pages
        # Popping from the top of the stack hands out low page ids first.
        self.free_pages[:P].copy_(torch.arange(P - 1, -1, -1, dtype=torch.int32, device=self.device))
        self.free_pages[P:].fill_(-1)
        self.n_free.fill_(P)
        self.page_table.fill_(-1)
        self.seq_lens.zero_()
        self.active.zero_()
        self.budgets.fill_(1)
        self.cos_sim.zero_()
        self.slot_score.zero_()
        # Host mirror: lengths after the current step's append, free pages, tokens seen per sequence.
        self._lens = np.zeros((self.n_layers, self.max_batch), dtype=np.int64)
        self._free = P
        self._seen = np.zeros(self.max_batch, dtype=np.int64)
        self._active = np.zeros(self.max_batch, dtype=bool)
        # Rows holding a sequence that sits out the decode steps (pause): pages kept, nothing appended.
        self._parked = np.zeros(self.max_batch, dtype=bool)
        # Tokens behind each (layer, sequence)'s budget statistic (cos_sim): a running mean over extensions.
        self._stat_tokens = np.zeros((self.n_layers, self.max_batch), dtype=np.int64)
        self._extension: _Extension | None = None  # the extension in progress (begin_extend)
        self._prefilled = np.zeros((self.n_layers, self.max_batch), dtype=bool)
        self._compressed = np.zeros(self.max_batch, dtype=bool)  # prompt compressed by compress_prompt
        self._shared_scores: dict[tuple[int, int], torch.Tensor] = {}  # (layer, seq) -> scores others reuse
        self.plan: CompressionPlan | None = None  # the batch's plan (finish_prefill)
        self._op_rows_memo: dict[tuple, tuple] = {}  # compaction calls' device rows (_op_rows)
        self._replays.clear()
        self._peak_pages = 0
        self._full_peak_pages = 0

    def _holding(self) -> np.ndarray:
        """``[max_batch]`` bool, rows holding a sequence: decoding (active) or paused."""
        return self._active | self._parked

    def _pages_held(self) -> np.ndarray:
        return _ceil_div(self._lens, self.page_size)  # [Lc, B]

    def _track_peak(self) -> None:
        self._peak_pages = max(self._peak_pages, int(self._pages_held().sum()))
        full = self.n_layers * int(_ceil_div(self._seen[self._holding()], self.page_size).sum())
        self._full_peak_pages = max(self._full_peak_pages, full)

    def _out_of_pages(self, need: int, what: str) -> RuntimeError:
        return RuntimeError(
            f"cache out of pages: {what} needs {need} more pages but only {self._free} of {self.num_pages} "
            f"are free (page_size={self.page_size}); raise num_pages or lower max_batch/budget")

    def _check_layer(self, l: int) -> None:
        if not isinstance(l, int) or not 0 <= l < self.n_layers:
            raise ValueError(f"layer l={l!r} is out of range [0, {self.n_layers}) cache layers")

    # ------------------------------------------------------------------ batch lifecycle
    def start(self, prompt_lens: list[int], max_new_tokens: int, *, compress_each: bool = False,
              budget_lens: list[int] | None = None) -> None:
        """Begin a new batch, dropping whatever the cache held.

        Parameters
        ----------
        prompt_lens:
            Prompt length of each sequence (``1 <= len(prompt_lens) <= max_batch``, each ``>= 1``).
        max_new_tokens:
            Decode steps the batch may run; ``prompt_len + max_new_tokens <= max_tokens``.
        compress_each:
            The caller calls :meth:`compress_prompt` after each sequence's prefill, so the pool must hold
            only the longest prompt whole (checked here) next to the compressed earlier ones (checked by
            each ``prefill_layer``). Otherwise every prompt must fit uncompressed at once.
        budget_lens:
            The lengths each sequence's budget is a fraction of (docs/contract.md §4); default
            ``prompt_lens``. A chunked prefill prefills the first chunk here and passes the whole prompts'
            lengths, so its budgets are those of the unchunked prompts (:meth:`begin_extend` takes the rest).
        """
        prompt_lens = [int(x) for x in prompt_lens]
        n = len(prompt_lens)
        if not 1 <= n <= self.max_batch:
            raise ValueError(f"prompt_lens has {n} sequences; the cache was built for 1..max_batch="
                             f"{self.max_batch} (raise max_batch)")
        if min(prompt_lens) < 1:
            raise ValueError(f"prompt_lens must all be >= 1, got {prompt_lens}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        longest = max(prompt_lens) + max_new_tokens
        if longest > self.max_tokens:
            raise ValueError(f"prompt of {max(prompt_lens)} tokens + max_new_tokens={max_new_tokens} = "
                             f"{longest} exceeds max_tokens={self.max_tokens}; raise max_tokens or shorten "
                             "the prompt")
        if compress_each and self.eviction.prefill_compress and not self.layout.pairs:
            # Prompts are compressed one by one (compress_prompt): only the longest must fit whole; each
            # later prefill_layer checks its own pages before writing anything.
            # (A HeadPagedKVCache's sequence spans one row per KV head: all of them are compressed together.)
            rows = self.rows_per_sequence
            prompt_pages = self.n_layers * rows * _ceil_div(max(prompt_lens), self.page_size)
            what = f"prefill of the longest prompt ({max(prompt_lens)} tokens) in {self.n_layers} layers"
        else:
            prompt_pages = self.n_layers * sum(_ceil_div(L, self.page_size) for L in prompt_lens)
            what = f"prefill of {n} prompts in {self.n_layers} layers"
        if prompt_pages > self.num_pages:
            self._free = self.num_pages
            raise self._out_of_pages(prompt_pages, what)
        budget_lens = prompt_lens if budget_lens is None else [int(x) for x in budget_lens]
        if len(budget_lens) != n or any(bl < pl for bl, pl in zip(budget_lens, prompt_lens, strict=True)):
            raise ValueError(f"budget_lens={budget_lens} must give one length per sequence, each at least "
                             f"its prompt_lens={prompt_lens}")
        budget_tokens = self.policy.checked_budget_tokens(torch.tensor(budget_lens, dtype=torch.int64))

        self._reset_pool()
        self._compressed[:] = False
        self.batch_size = n
        # The lengths the plan reads (budgets as fractions of them, layer budgets capped at them plus
        # max_new_tokens): the prompts, and after an extension the sequence's context (end_extend).
        self.prompt_lens = prompt_lens
        self.max_new_tokens = max_new_tokens
        self.budget_tokens = budget_tokens
        self.active[:n] = True
        self._active[:n] = True
        self._seen[:n] = prompt_lens
        self._step = 0
        self._state = "prefill"
        if self.gumbel:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(self._noise_seed)
        kw = self.eviction.decode_kwargs(0, max(1, max_new_tokens))
        unknown = set(kw) - {"temperature", "decay"}
        if unknown:
            raise ValueError(f"eviction policy {self.eviction.name!r} returned decode_kwargs "
                             f"{sorted(unknown)} the cache does not know; supported: temperature, decay")
        # decay is a constant of the policy, so it is a Python float baked into the compiled step.
        self.decay = float(kw.get("decay", 1.0))

    def prefill_attend(self, l: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       positions: torch.Tensor, *, scale: float) -> torch.Tensor:
        """:meth:`prefill_layer`, and the prompt's causal attention the model needs: ``[L, Hq, D]``.

        The model's prompt attention and the policy's prompt scores read the same probabilities. When the
        scores are a row-weighted column sum of them over most of the prompt (``h2o``, ``a2sf``: every row)
        and this layer computes its own, ``kvkernels.prefill_attention_scores`` takes both from one
        computation of the probabilities (CPU; see :meth:`_fused_scoring`). Otherwise this is
        ``kvkernels.prefill_attention`` followed by ``prefill_layer(..., lse=...)``. Arguments as
        :meth:`prefill_layer` (no ALiBi: ALiBi models run their own attention and call ``prefill_layer``).
        """
        fused = self._fused_scoring(l, q.shape[0]) if q.device.type == "cpu" else None
        if fused is None:
            attn, lse = prefill_attention(q, k, v, scale=scale)
            self.prefill_layer(l, b, q, k, v, positions, scale=scale, lse=lse)
            return attn
        attn, scores = prefill_attention_scores(q, k, v, scale=scale, **fused)
        self.prefill_layer(l, b, q, k, v, positions, scale=scale, scores=scores)
        return attn

    def _fused_scoring(self, l: int, L: int) -> dict | None:
        """``prefill_attention_scores`` keyword arguments (``mode``, ``window``, ``decay``) for layer ``l``'s
        prompt of ``L`` tokens when fusing pays, else ``None``.

        Fusing replaces the flash kernel (~1x) plus the scorer (~0.75x for every row, in proportion to the
        rows it scores) by one pass of ~1.25x (CPU, L=4096, see ``prefill_attention_scores``): it pays when
        the policy scores at least half of the rows, not for a 32-row observation window (SnapKV) nor for
        the last row alone (TOVA). Not for a layer that reuses another's scores, nor for policies with
        other score arguments (Gumbel noise, counts).
        """
        ev = self.eviction
        mode = ev.prefill_mode
        if mode not in COLUMN_SUM_MODES or mode == "replace" or ev.score_source_layer(l) != l:
            return None
        kwargs = ev.prefill_kwargs(L)
        if not set(kwargs) <= {"decay"}:
            return None
        window = ev.prefill_window(L)
        if window and 2 * window < L:
            return None
        return {"mode": mode, "window": window, **kwargs}

    def prefill_layer(self, l: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, *, scale: float,
                      alibi_slopes: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      scores: torch.Tensor | None = None) -> None:
        """Store one sequence's prompt K/V for cache layer ``l`` and score it if the policy needs scores.

        Parameters
        ----------
        q:
            ``[L, Hq, D]`` prompt queries (after RoPE), used only for scoring.
        k, v:
            ``[L, Hkv, D]`` prompt keys (after RoPE) and values, ``dtype`` of the cache.
        positions:
            ``[L]`` int absolute positions of the prompt tokens.
        scale, alibi_slopes:
            Logit scale and optional ``[Hq]`` float32 ALiBi slopes, as used by the model.
        lse:
            Optional ``[Hq, L]`` float32 log-sum-exp of each row of this layer's causal attention logits
            (``kvkernels.prefill_attention`` returns it on CPU): the scorer then skips its own softmax
            normaliser pass (``prefill_scores(lse=...)``).
        scores:
            Optional ``[Hkv, L]`` float32 prompt scores already computed with this layer's
            ``_fused_scoring`` arguments (:meth:`prefill_attend` passes them): used in place of
            ``prefill_scores`` (the policy's post-processing still applies).
        """
        if self._state != "prefill":
            raise RuntimeError(f"prefill_layer called in state {self._state!r}; call start(...) first and "
                               "prefill before finish_prefill()")
        self._check_layer(l)
        if not isinstance(b, int) or not 0 <= b < self.batch_size:
            raise ValueError(f"sequence b={b!r} is out of range [0, {self.batch_size}) of the started batch")
        if self._prefilled[l, b]:
            raise RuntimeError(f"layer {l} of sequence {b} is already prefilled; start a new batch to "
                               "refill it")
        L, H, D = self.prompt_lens[b], self.n_kv_heads, self.head_dim
        dev = self.device
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t, ndim=3, dtypes=(self.dtype,), device=dev)
        check_shape("q", q, [L, self.n_q_heads, D], f"prompt_lens[{b}] x n_q_heads x head_dim")
        check_shape("k", k, [L, H, D], f"prompt_lens[{b}] x n_kv_heads x head_dim")
        check_shape("v", v, [L, H, D], f"prompt_lens[{b}] x n_kv_heads x head_dim")
        check_tensor("positions", positions, ndim=1, dtypes=_INT_DTYPES, device=dev)
        check_shape("positions", positions, [L], f"prompt_lens[{b}]")

        n_pages = _ceil_div(L, self.page_size)
        if n_pages > self._free:
            raise self._out_of_pages(n_pages, f"prefill of sequence {b} layer {l}")
        if scores is not None:
            fused = self._fused_scoring(l, L)
            if fused is None or alibi_slopes is not None:
                raise ValueError(f"scores were given for layer {l}, where the policy "
                                 f"{type(self.eviction).__name__} does not take precomputed column-sum "
                                 "scores (or ALiBi is on); call prefill_attend, or prefill_layer without "
                                 "scores")
            check_tensor("scores", scores, ndim=2, dtypes=(torch.float32,), device=dev)
            check_shape("scores", scores, [H, L], f"n_kv_heads x prompt_lens[{b}]")
        if self.eviction.prefill_mode is not None:
            scores = self._prefill_scores(l, b, q, k, scale, alibi_slopes, lse, scores)  # [H, L]
        elif self.eviction.scores_tokens:  # an open rule: each token's score from what its step provides
            scores = self._token_scores(q, k, v, positions, check=True).t()  # [H, L]

        pages = self.free_pages[self._free - n_pages:self._free].to(torch.int64)  # [n_pages]
        self.n_free -= n_pages
        self._free -= n_pages
        pad = n_pages * self.page_size - L

        def paged(x: torch.Tensor) -> torch.Tensor:  # [L, ...] -> [n_pages, S, ...]
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
            return x.reshape(n_pages, self.page_size, *x.shape[1:])

        self.k_pages.index_copy_(0, pages, paged(k))
        self.v_pages.index_copy_(0, pages, paged(v))
        self.slot_pos.index_copy_(0, pages, paged(positions.to(torch.int32)[:, None].expand(L, H)))
        score_rows = torch.zeros(L, H, device=dev) if scores is None else scores.t()  # [L, H]
        self.slot_score.index_copy_(0, pages, paged(score_rows.to(torch.float32).contiguous()))
        self.page_table[l, b, :n_pages] = pages.to(torch.int32)
        self.seq_lens[l, b] = L
        self._lens[l, b] = L
        self._prefilled[l, b] = True
        self._track_peak()

    def prefill_seed(self, l: int, b: int) -> int:
        """Seed of the prompt-scoring noise of layer ``l``, sequence ``b`` (``prefill_scores(seed=...)``).

        Distinct per (layer, sequence) and reproducible from the policy's and the cache's seeds.
        """
        return prefill_seed(self._noise_seed, l, b)

    def _prefill_scores(self, l, b, q, k, scale, alibi_slopes, lse, raw=None) -> torch.Tensor:
        """``[Hkv, L]`` prompt scores of layer ``l``, sequence ``b``; ``raw``: already computed
        (``prefill_attend``), only post-processed here."""
        source = self.eviction.score_source_layer(l)
        if source != l:  # layer-wise index reuse: the scores an earlier layer of this sequence computed
            return self._shared_scores[source, b]
        L = q.shape[0]
        mode = self.eviction.prefill_mode
        assert mode is not None  # callers check
        scores = raw
        if scores is None:
            kwargs = {"seed": self.prefill_seed(l, b), **self.eviction.prefill_kwargs(L)}
            scores = prefill_scores(q, k, scale=scale, mode=mode, window=self.eviction.prefill_window(L),
                                    alibi_slopes=alibi_slopes, lse=lse, **kwargs)
        scores = self.eviction.postprocess_prefill_scores(scores)
        if l + 1 < self.n_layers and self.eviction.score_source_layer(l + 1) == l:
            self._shared_scores[l, b] = scores  # [Hkv, L], read by the layers that reuse this one's
        return scores

    def _token_scores(self, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      *, check: bool = False) -> torch.Tensor:
        """``[..., Hkv]`` float32 scores of the tokens ``k, v [..., Hkv, D]`` (queries ``q [..., Hq, D]``,
        ``positions [...]``) by the policy's open score rule (``EvictionPolicy.token_scores``); ``check``
        (host side, at prefill) verifies what the rule returns."""
        new = NewTokens(k=k, v=v, positions=positions.to(torch.int64),
                        q=q if self.eviction.reads_queries else None)
        scores = self.eviction.token_scores(new)
        if check and (not isinstance(scores, torch.Tensor) or tuple(scores.shape) != tuple(k.shape[:-1])
                      or not scores.is_floating_point()):
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise ValueError(f"{self.eviction.name}.token_scores returned {got} for k of shape "
                             f"{tuple(k.shape)}; it must return one float score per token and KV head: "
                             f"{tuple(k.shape[:-1])}")
        return scores.to(torch.float32)

    def observe(self, l: int, b: int, h_in: torch.Tensor, attn_out: torch.Tensor) -> None:
        """The models' one observation point in the prefill: cache layer ``l``'s input hidden states
        ``h_in [L, dim]`` and attention output ``attn_out [L, dim]`` for sequence ``b``. The budget policy
        reads what it needs (``layer_statistic``; nothing for most policies), averaged over the prompt. During
        an extension (:meth:`extend_attend`) the average runs over every token the sequence has prefilled, so
        a chunked prefill ends with the whole prompt's mean."""
        stat = self.policy.budget_policy.layer_statistic(h_in, attn_out)
        if stat is None:
            return
        ext = self._extension
        if ext is not None and ext.b == b:
            self._check_layer(l)
            n_old, n_new = int(self._stat_tokens[l, b]), stat.numel()
            self.cos_sim[l, b] = (self.cos_sim[l, b] * n_old + stat.float().sum()) / (n_old + n_new)
            self._stat_tokens[l, b] = n_old + n_new
        else:
            self.record_cos_sim(l, b, stat.mean())

    def record_cos_sim(self, l: int, b: int, value: float | torch.Tensor) -> None:
        """Store the budget policy's prefill statistic of cache layer ``l`` for sequence ``b`` (what
        :meth:`observe` computes; ``LayerStats.cos_sim``)."""
        self._check_layer(l)
        if not isinstance(b, int) or not 0 <= b < self.batch_size:
            raise ValueError(f"sequence b={b!r} is out of range [0, {self.batch_size}) of the started batch")
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"value must be a float or a 0-d tensor, got shape {list(value.shape)}")
        self.cos_sim[l, b] = value
        self._stat_tokens[l, b] = self.prompt_lens[b]  # the tokens an extension's running mean starts from

    def _plan(self, seqs: list[int]) -> CompressionPlan:
        """The policy's plan (``ComposedPolicy.plan``) for the pool rows ``seqs``. Budget policies allocate
        each sequence from its own statistics, so a sequence gets the same budgets alone
        (:meth:`compress_prompt`) as in the whole batch (:meth:`finish_prefill`)."""
        stats = LayerStats(cos_sim=self.cos_sim[:, seqs].cpu())
        return self.policy.plan(torch.tensor([self.prompt_lens[b] for b in seqs]), self.n_layers, stats,
                                max_new_tokens=self.max_new_tokens, budget_tokens=self.budget_tokens[seqs])

    def compress_prompt(self, b: int) -> None:
        """Compress sequence ``b``'s prompt to its layer budgets now, right after its prefill.

        :func:`kvmodels.generate.generate` calls this after each prompt, so the pool only ever holds one
        uncompressed prompt next to compressed ones: at budget 0.2 a pool fits several times the batch
        (``start(..., compress_each=True)``). The tokens kept are exactly those :meth:`finish_prefill`
        keeps (the budgets of a sequence depend on it alone); only the page ids differ. A no-op when the
        policy does not compress prompts, or merges layers (MiniCache merges pairs in ``finish_prefill``).
        """
        if self._state != "prefill":
            raise RuntimeError(f"compress_prompt called in state {self._state!r}; call it after a sequence's "
                               "prefill and before finish_prefill()")
        if not isinstance(b, int) or not 0 <= b < self.batch_size:
            raise ValueError(f"sequence b={b!r} is out of range [0, {self.batch_size}) of the started batch")
        if not self._prefilled[:, b].all():
            missing = int((~self._prefilled[:, b]).sum())
            raise RuntimeError(f"sequence {b} has {missing} layer(s) not prefilled; call "
                               f"compress_prompt({b}) "
                               "after its whole prefill")
        if not self.eviction.prefill_compress or self.layout.pairs or self._compressed[b]:
            return
        budgets, n_sink, n_recent = (x.numpy() for x in self._plan([b]).rows)  # [Lc, 1] each
        rows = [l for l in range(self.n_layers) if self._lens[l, b] > budgets[l, 0]]
        if rows:
            self._compact(rows, [b], budgets[rows], n_sink[rows], n_recent[rows])
        self._compressed[b] = True

    def finish_prefill(self) -> None:
        """Take the policy's plan, merge MiniCache pairs and compress every prompt to its budget
        (docs/contract.md §5 steps 2–3).

        The plan (``self.plan``, ``ComposedPolicy.plan``) gives a merged pair ``(a, b)`` with layer budgets
        ``B_a, B_b`` one budget ``R = B_a + B_b`` (listed under ``a``, 0 under ``b``: the total is
        conserved). Per sequence:

        1. Joint selection: both layers must hold the same tokens, so each slot's score becomes the sum of
           the two layers' scores and both layers keep the same ``N`` tokens (``plan.joint``: ``min(L, R //
           2)``, all ``L`` without prompt compression), forced sinks / recent window ``forced(N)``.
        2. The merge policy's ``region`` (MiniCache's: ``kvkernels.merge_region``) builds the region:
           ``magnitude_direction_merge`` of K and of V over the ``N`` kept tokens (per token and KV head).
           The ``ceil(retain_ratio * N)`` tokens per head with the largest angle ``max(theta_K, theta_V)``
           (one count for K and V, so every head holds the same number of slots) are retained: stored
           privately for each layer with their original K/V and magnitude 1.
        3. The region, in token order: a merged token is one *shared* slot (unit direction, magnitudes in
           ``k_mag``/``v_mag``, ``slot_mask`` 3); a retained token is two slots, ``a``'s (mask 1) then
           ``b``'s (mask 2). Shared slots score ``s_a + s_b``, private slots their own layer's score. The
           region (``N + n_retained`` slots) reuses the first pages of ``a`` and ``b``; the rest, and every
           table entry of ``b``, go back to the pool.

        At decode both layers append private slots (2 per step) and eviction compacts the region to ``R``
        with the plan's forced ``2 * forced(R // 2)`` slots, so the region never holds more than ``R + 2 *
        (evict_every - 1)`` slots, i.e. ``budget + evict_every - 1`` per layer-equivalent.
        """
        if self._state != "prefill":
            raise RuntimeError(f"finish_prefill called in state {self._state!r}; call start(...) and "
                               "prefill first")
        n = self.batch_size
        missing = np.argwhere(~self._prefilled[:, :n])
        if len(missing):
            l, b = missing[0]
            raise RuntimeError(f"layer {l} of sequence {b} was not prefilled ({len(missing)} (layer, "
                               "sequence) pairs missing); call prefill_layer for every cache layer of every "
                               "sequence")
        self.plan = plan = self._plan(list(range(n)))
        # A region's reader row is unused; it holds 1 so the device budgets stay valid op input.
        self.budgets[:, :n] = plan.rows.budgets.clamp_min(1).to(self.device, torch.int32)
        for i, (a, b) in enumerate(self.layout.pairs):
            self._merge_pair(a, b, *(x.numpy() for x in plan.joint.row(i)))
        groups = self._width_groups(range(self.n_layers))
        if plan.schedule.prefill_compress:
            self._compress(groups.get(1, []))
        budgets, n_sink, n_recent = (x.numpy() for x in plan.rows)  # [Lc, n] each
        for ls in groups.values():  # upload decode-time eviction's rows (_compress) now, not mid-decode
            self._op_rows(ls, list(range(n)), budgets[ls], n_sink[ls], n_recent[ls])
        self._state = "decode"

    def _width_groups(self, layers) -> dict[int, list[int]]:
        """``layers`` by storage width, one compaction call each: 1 plain layers, 2 merged pairs' regions (a
        pair's second layer, width 0, stores nothing)."""
        width = self.layout.width
        return {w: ls for w in (1, 2) if (ls := [l for l in layers if width[l] == w])}

    def _compact(self, layers: list[int], seqs: list[int], budgets: np.ndarray, n_sink: np.ndarray,
                 n_recent: np.ndarray, extra: list[torch.Tensor] | None = None, *,
                 in_place: bool = False) -> None:
        """``topk_compact`` (or, ``in_place``, ``topk_evict``) storage layers ``layers`` x sequences ``seqs``
        in one op call, to host ``budgets [len(layers), len(seqs)]`` (with the forced counts beside them),
        and update the host mirror without a sync (:meth:`_compaction`, run now)."""
        call = self._compaction(layers, seqs, budgets, n_sink, n_recent, extra, in_place=in_place)
        call.device()
        call.commit()

    def _compaction(self, layers: list[int], seqs: list[int], budgets: np.ndarray, n_sink: np.ndarray,
                    n_recent: np.ndarray, extra: list[torch.Tensor] | None = None, *,
                    in_place: bool = False) -> _Compaction:
        """One compaction call, split in its device work and its host mirror update.

        The pool is shared, so the rows' page tables stacked into ``[len(layers) * len(seqs), M]`` are one
        batch to the kernel (an eviction over 30 layers is one call, not 30); the free stack receives the
        pages in layer-major order, as one call per layer would push them.

        Nothing here reads the device (a decode step evicts through this every step): the table columns in
        use come from the host mirror, the index and budget tensors are uploaded once per distinct call
        (:meth:`_op_rows`), and the op skips its value checks (the plan checked the budgets). The device
        work touches only static buffers and those rows, so the call's ``key`` names it for a CUDA graph.
        """
        host = np.ix_(layers, seqs)
        rows = self._op_rows(layers, seqs, budgets, n_sink, n_recent)
        ix, budgets_t, n_sink_t, n_recent_t = rows
        cols = int(_ceil_div(self._lens[host].max(initial=0), self.page_size))
        extra = extra or []
        # Decode-time eviction is a few tokens over budget: the op then selects instead of sorting.
        kw = {"max_excess": max(1, int((self._lens[host] - budgets).max(initial=1)))} if in_place else {}
        op = topk_evict if in_place else topk_compact

        def device() -> None:
            table = self.page_table[ix[0], ix[1], :cols].contiguous()  # [L, n, cols], written back below
            lens = self.seq_lens[ix]
            op(self.k_pages, self.v_pages, self.slot_pos, self.slot_score, table.flatten(0, 1), lens.view(-1),
               budgets_t, n_sink_t, n_recent_t, self.free_pages, self.n_free, extra=extra, validate=False, **kw)
            self.page_table[ix[0], ix[1], :cols], self.seq_lens[ix] = table, lens

        def commit() -> None:
            old = self._lens[host]
            new = np.minimum(old, budgets)
            self._free += int((_ceil_div(old, self.page_size) - _ceil_div(new, self.page_size)).sum())
            self._lens[host] = new

        key = (_op_rows_key(layers, seqs, budgets, n_sink, n_recent), cols, in_place, len(extra), *kw.values())
        return _Compaction(key, rows, device, commit)

    def _op_rows(self, layers: list[int], seqs: list[int], *rows: np.ndarray) -> tuple:
        """Device copies of a compaction call's index (``(layers [L, 1], seqs [1, n])``) and of its host rows
        ``[L, n]`` (flattened, int32), uploaded once per distinct call: an upload from host memory waits
        for the device, and decode-time eviction repeats the same call every step."""
        key = _op_rows_key(layers, seqs, *rows)
        if key not in self._op_rows_memo:
            if len(self._op_rows_memo) > 64:  # prefill calls differ per prompt; keep the memo small
                self._op_rows_memo.clear()
            ix = (torch.tensor(layers, device=self.device)[:, None],
                  torch.tensor(seqs, device=self.device)[None])
            dev = [torch.as_tensor(r).to(self.device, torch.int32).flatten() for r in rows]
            self._op_rows_memo[key] = (ix, *dev)
        return self._op_rows_memo[key]

    def _region_extra(self) -> list[torch.Tensor]:
        """Per-slot tensors that move with a region's slots (topk_compact ``extra``)."""
        assert self.k_mag is not None and self.v_mag is not None and self.slot_mask is not None
        return [self.k_mag[0], self.k_mag[1], self.v_mag[0], self.v_mag[1], self.slot_mask]

    def _merge_pair(self, a: int, b: int, keep: np.ndarray, n_sink: np.ndarray,
                    n_recent: np.ndarray) -> None:
        """Turn the prefilled layers ``a`` and ``b`` into one region keeping ``keep [n]`` tokens per
        sequence, forced ``n_sink``/``n_recent [n]`` (the plan's ``joint`` row; see
        :meth:`finish_prefill`)."""
        assert self.k_mag is not None and self.v_mag is not None and self.slot_mask is not None
        n, S = self.batch_size, self.page_size
        own_score = self.slot_score
        if (self._lens[a, :n] > keep).any():
            # Joint selection on the summed scores; each layer's own score rides along in a copy of the
            # score pool (not in a magnitude pool: that holds the regions of pairs merged before this one).
            own_score = self.slot_score.clone()
            for i in range(n):
                pa, pb = (self.page_table[l, i, :_ceil_div(int(self._lens[l, i]), S)].long() for l in (a, b))
                total = self.slot_score[pa] + self.slot_score[pb]
                self.slot_score[pa] = total
                self.slot_score[pb] = total
            both = lambda x: np.stack([x, x])  # noqa: E731 -- the same row for layers a and b
            self._compact([a, b], list(range(n)), both(keep), both(n_sink), both(n_recent), extra=[own_score])

        for i in range(n):
            N = int(self._lens[a, i])
            pa, pb = (self.page_table[l, i, :_ceil_div(N, S)].long() for l in (a, b))

            def rows(pool: torch.Tensor, pages: torch.Tensor, N=N) -> torch.Tensor:
                return pool[pages].flatten(0, 1)[:N]  # [N, Hkv, ...], a copy

            ka, kb, va, vb = rows(self.k_pages, pa), rows(self.k_pages, pb), rows(self.v_pages, pa), \
                rows(self.v_pages, pb)
            sa, sb = rows(own_score, pa), rows(own_score, pb)  # [N, Hkv]
            region = self.policy.merge.region(ka, kb, va, vb, rows(self.slot_pos, pa), sa, sb)
            n_slots = region["k"].shape[0]
            n_pages = _ceil_div(n_slots, S)
            owned = torch.cat([pa, pb])  # n_slots <= 2N, so the two layers' pages are enough
            pages, released = owned[:n_pages], owned[n_pages:]
            pad = n_pages * S - n_slots
            for name, pool in (("k", self.k_pages), ("v", self.v_pages), ("pos", self.slot_pos),
                               ("score", self.slot_score), ("k_mag_a", self.k_mag[0]),
                               ("k_mag_b", self.k_mag[1]), ("v_mag_a", self.v_mag[0]),
                               ("v_mag_b", self.v_mag[1]), ("mask", self.slot_mask)):
                x = region[name]
                x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
                pool.index_copy_(0, pages, x.reshape(n_pages, S, *x.shape[1:]))
            self.free_pages[self._free:self._free + len(released)] = released.to(torch.int32)
            self.n_free += len(released)
            self._free += len(released)
            self.page_table[a, i] = -1
            self.page_table[b, i] = -1
            self.page_table[a, i, :n_pages] = pages.to(torch.int32)
            self.seq_lens[a, i] = n_slots
            self.seq_lens[b, i] = 0
            self._lens[a, i] = n_slots
            self._lens[b, i] = 0

    def _compress(self, layers: list[int] | None = None, in_place: bool = False) -> None:
        """``topk_compact`` every storage layer (of ``layers``) holding more than its budget: one op call
        per storage width (plain layers, merged regions)."""
        for call in self._compress_calls(layers, in_place):
            call.device()
            call.commit()

    def _compress_calls(self, layers: list[int] | None = None, in_place: bool = False) -> list[_Compaction]:
        """The compaction calls :meth:`_compress` makes, not yet run.

        ``in_place`` (decode-time eviction): plain layers evict with ``topk_evict``, which keeps the same
        tokens but moves only the kept slots past the budget, not every kept token after an evicted one.
        Keyformer stays on ``topk_compact``: its decode noise is indexed by slot, and kept slot order is
        what the bridge and the reference policies index it by. Merged regions stay in order too.
        """
        n = self.batch_size
        assert self.plan is not None  # set by finish_prefill
        budgets, n_sink, n_recent = (x.numpy() for x in self.plan.rows)  # [Lc, n] each
        calls = []
        for w, ls in self._width_groups(range(self.n_layers) if layers is None else layers).items():
            if not (self._lens[ls, :n] > budgets[ls]).any():
                continue
            # Every layer of this width, over budget or not (the op leaves the others as they are): one call
            # per width whose device rows finish_prefill uploaded (_op_rows), so no decode step uploads.
            calls.append(self._compaction(ls, list(range(n)), budgets[ls], n_sink[ls], n_recent[ls],
                                          extra=self._region_extra() if w == 2 else [],
                                          in_place=in_place and w == 1 and not self.gumbel))
        return calls

    # ------------------------------------------------------------------ decode
    def prepare_decode(self, step: int) -> None:
        """Eager per-step setup: a page for every layer of every active sequence whose next token starts a new
        page, this step's Gumbel noise and temperature.

        Raises ``RuntimeError`` (before anything is written) when the pool cannot hold the step.
        """
        if self._state != "decode":
            raise RuntimeError(f"prepare_decode called in state {self._state!r}; call finish_prefill() first "
                               "(or after_step(step) after the previous step)")
        if step != self._step:
            raise ValueError(f"prepare_decode(step={step}) but the next step is {self._step}; steps run "
                             "in order")
        if step >= self.max_new_tokens:
            raise ValueError(f"step={step} is past max_new_tokens={self.max_new_tokens} given to start()")
        n, S = self.batch_size, self.page_size
        lens = self._lens[:, :n]
        grow = self._width[:, None] * self._active[:n]  # [Lc, n] slots this step appends
        full = lens + grow > self.max_pages * S
        if full.any():
            l, b = np.argwhere(full)[0]
            raise RuntimeError(f"sequence {b} layer {l} already holds {lens[l, b]} slots, all that the "
                               f"max_tokens={self.max_tokens} the cache was built for allows; raise "
                               "max_tokens")
        n_need = int((_ceil_div(lens + grow, S) - _ceil_div(lens, S)).sum())  # pages the appends open
        if n_need > self._free:
            raise self._out_of_pages(n_need, f"decode step {step}")
        if n_need:
            self._allocate_next_pages()
        self._free -= n_need
        self._lens[:, :n] += grow
        self._seen[:n] += self._active[:n]
        self._track_peak()

        if self.gumbel_noise is not None:
            kw = self.eviction.decode_kwargs(step, self.max_new_tokens)
            self.temperature.fill_(float(kw.get("temperature", 1.0)))
            width = int(self._lens[:, :n].max())  # slots attended this step; the rest is never read
            # Drawn from the cache's generator so a run is reproducible.
            draw_gumbel_(self.gumbel_noise[:, :n, :, :width], self._generator)
        self._state = "step"

    def _allocate_next_pages(self) -> None:
        """Pop a free page for every (storage layer, active row) whose next slot starts a page, on device.

        Pass ``i`` covers the ``i``-th slot a layer appends this step (a merged region appends two)."""
        n, S, M = self.batch_size, self.page_size, self.max_pages
        table = self.page_table[:, :n]  # [Lc, n, M] view
        for i in range(self.layout.max_width):
            width = self._width_masks[i]  # [Lc]
            lens = self.seq_lens[:, :n] + i  # [Lc, n]
            need = (lens % S == 0) & self.active[:n] & width[:, None]  # [Lc, n]
            flat = need.reshape(-1).to(torch.int64)
            rank = torch.cumsum(flat, 0) - flat  # [Lc * n] pops before this one
            src = (self.n_free - 1 - rank).clamp_min(0)
            new_pages = self.free_pages[src].view(self.n_layers, n)  # [Lc, n]
            col = (lens // S).clamp_max(M - 1).to(torch.int64)[..., None]  # [Lc, n, 1]
            current = table.gather(2, col)[..., 0]
            table.scatter_(2, col, torch.where(need, new_pages, current)[..., None])
            self.n_free -= flat.sum()

    def _check_decode_input(self, name: str, t: torch.Tensor, heads: int) -> None:
        check_tensor(name, t, ndim=3, dtypes=(self.dtype,), device=self.device)
        check_shape(name, t, [self.batch_size, heads, self.head_dim], "batch x heads x head_dim")

    def _check_positions(self, name: str, t: torch.Tensor) -> None:
        check_tensor(name, t, ndim=1, dtypes=_INT_DTYPES, device=self.device)
        check_shape(name, t, [self.batch_size], "one position per sequence of the batch")

    def append(self, l: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               q: torch.Tensor | None = None) -> None:
        """Write this step's K/V of cache layer ``l`` after each active sequence's last token.

        Pure tensor code on static buffers (safe inside ``torch.compile(fullgraph=True)``). Rows without an
        active sequence write into the trash page and keep length 0.

        Parameters
        ----------
        k, v:
            ``[B, Hkv, D]`` ``dtype`` (``B`` = the batch given to ``start``).
        positions:
            ``[B]`` int absolute position of the new token.
        q:
            ``[B, Hq, D]`` the new token's queries; required only by an open score rule that reads them
            (``EvictionPolicy.reads_queries``). Models pass it always.
        """
        self._check_layer(l)
        self._check_decode_input("k", k, self.n_kv_heads)
        self._check_decode_input("v", v, self.n_kv_heads)
        self._check_positions("positions", positions)
        if q is not None:
            self._check_decode_input("q", q, self.n_q_heads)
        elif self.eviction.scores_tokens and self.eviction.reads_queries:
            raise ValueError(f"append(q=None): policy {self.eviction.name!r} scores each token from its own "
                             "queries (reads_queries); pass this step's queries q [B, Hq, D]")
        n, S = self.batch_size, self.page_size
        s = self.layout.storage[l]  # a merged layer appends into its pair's region
        lens = self.seq_lens[s, :n]  # [n]
        active = self.active[:n]
        col = (lens // S).clamp_max(self.max_pages - 1).to(torch.int64)
        page = self.page_table[s, :n].gather(1, col[:, None])[:, 0]  # [n]
        page = torch.where(active, page, self.trash_page).to(torch.int64)
        slot = torch.where(active, lens % S, 0).to(torch.int64)
        self.k_pages[page, slot] = k
        self.v_pages[page, slot] = v
        self.slot_pos[page, slot] = positions.to(torch.int32)[:, None].expand(n, self.n_kv_heads)
        self.slot_score[page, slot] = self._token_scores(q, k, v, positions) if self.eviction.scores_tokens \
            else 0.0
        if self.layout.merged[l]:  # a private slot of this layer: exact K/V, visible to this layer only
            assert self.k_mag is not None and self.v_mag is not None and self.slot_mask is not None
            for mag in (self.k_mag, self.v_mag):
                mag[:, page, slot] = 1.0
            self.slot_mask[page, slot] = self.layout.mask_bit(l)
        lens += active.to(torch.int32)

    def attend(self, l: int, q: torch.Tensor, q_positions: torch.Tensor, *, scale: float,
               alibi_slopes: torch.Tensor | None = None, update_scores: bool = True) -> torch.Tensor:
        """Decode attention of cache layer ``l`` over its kept tokens, updating the policy's scores in place.

        A layer of a merged pair reads its pair's region through its own magnitudes and ``slot_mask`` bit
        (restoration inside the kernel); both layers' score updates add into the region's one score array.

        Parameters
        ----------
        q:
            ``[B, Hq, D]`` ``dtype`` queries of this step.
        q_positions:
            ``[B]`` int absolute positions of the queries (read with ALiBi).
        scale, alibi_slopes:
            Logit scale; optional ``[Hq]`` float32 ALiBi slopes.
        update_scores:
            ``False`` reads the cache without touching the scores (e.g. LCKV layers reading the top cache,
            which its owner already scores once per step).

        Returns
        -------
        ``[B, Hq, D]`` attention output (zero rows for finished sequences).
        """
        self._check_layer(l)
        self._check_decode_input("q", q, self.n_q_heads)
        self._check_positions("q_positions", q_positions)
        n, s, member = self.batch_size, self.layout.storage[l], self.layout.member[l]
        alibi = None
        if alibi_slopes is not None:  # from the slots' original positions
            alibi = Alibi(alibi_slopes, self.slot_pos, q_positions.to(torch.int32))
        noise = self.gumbel_noise[l, :n] if self.gumbel_noise is not None else None
        restore = None
        if self.layout.merged[l]:  # the pair's region through this layer's magnitudes and slot_mask bit
            restore = Restore(self.k_mag[member] if self.k_mag is not None else None,
                              self.v_mag[member] if self.v_mag is not None else None,
                              self.slot_mask, mask_bit=self.layout.mask_bit(l))
        return paged_decode_attention(
            q, self.k_pages, self.v_pages, self.page_table[s, :n], self._visible_lens(s), scale=scale,
            alibi=alibi, scores=self._score_update(update_scores, noise), restore=restore)

    def _visible_lens(self, s: int) -> torch.Tensor:
        """``[B]`` int32 slots of storage layer ``s`` a decode step attends to: none for rows that do not
        decode (finished, or paused between turns), so their kept tokens get no score update."""
        n = self.batch_size
        return torch.where(self.active[:n], self.seq_lens[s, :n], 0)

    def _score_update(self, update_scores: bool, gumbel_noise: torch.Tensor | None) -> ScoreUpdate | None:
        """The decode op's score bundle: the policy's score tensor whenever it scores, with its mode, or
        with mode "none" for a read-only call (``update_scores=False``: nothing written). A read-only call
        passes the same tensors because with no score beside scoring calls in one compiled graph, inductor
        failed to lower the op (torch 2.13). ``gumbel_noise``: this call's rows of the step's noise."""
        if self.score_mode == "none":
            return None
        return ScoreUpdate(self.slot_score, self.score_mode if update_scores else "none", self.decay,
                           gumbel_noise, self.temperature if self.gumbel else None)

    def after_step(self, step: int) -> None:
        """Eager end of a decode step: when the plan's schedule says so (every ``evict_every`` steps),
        compact the layers over budget."""
        if self._state != "step" or step != self._step:
            raise RuntimeError(f"after_step(step={step}) must follow prepare_decode(step={step}); the next "
                               f"step is {self._step}")
        assert self.plan is not None  # set by finish_prefill
        if self.plan.evicts_after(step):
            share = self.eviction.heads_share_selection  # every slot holds one token in all heads of its layer
            calls = self._compress_calls(in_place=True)

            def evict() -> None:
                if share:
                    self.slot_score.copy_(self.eviction.eviction_scores(self.slot_score, head_dim=-1))
                for call in calls:
                    call.device()

            # The same calls every step at a steady width: on CUDA, one graph replay instead of ~50 launches.
            self._replays.run((share, *(c.key for c in calls)), evict, keep=tuple(c.rows for c in calls))
            for call in calls:
                call.commit()
        self._step += 1
        self._state = "decode"

    def finish_sequence(self, b: int) -> None:
        """Return all pages of sequence ``b`` to the pool; its row stays in the batch, inactive."""
        if self._state not in ("decode", "prefill"):
            raise RuntimeError(f"finish_sequence called in state {self._state!r}; call it between steps")
        if not isinstance(b, int) or not 0 <= b < self.batch_size:
            raise ValueError(f"sequence b={b!r} is out of range [0, {self.batch_size}) of the started batch")
        if not self._holding()[b]:
            raise ValueError(f"sequence {b} is already finished")
        counts = _ceil_div(self._lens[:, b], self.page_size)  # [Lc]
        ids = torch.cat([self.page_table[l, b, :int(c)] for l, c in enumerate(counts)])
        total = int(counts.sum())
        self.free_pages[self._free:self._free + total] = ids
        self.n_free += total
        self._free += total
        self.page_table[:, b] = -1
        self.seq_lens[:, b] = 0
        self.active[b] = False
        self._lens[:, b] = 0
        self._active[b] = False
        self._parked[b] = False
        self._prefilled[:, b] = True  # nothing left to prefill for it

    # ------------------------------------------------------------------ continuing a sequence
    # A sequence between decode steps (or between turns, paused) takes more tokens: begin_extend, then the
    # model runs them through every layer (extend_attend), then end_extend re-plans and compresses it.
    # restart_decode starts the next generation. Together they are a chunked prefill and a follow-up turn.
    def pause(self, b: int) -> None:
        """Take sequence ``b`` out of the decode steps, keeping its pages (:meth:`finish_sequence` returns
        them): it appends nothing, its kept tokens get no score update (the decode attention reads none of
        them), and :meth:`begin_extend` takes it back."""
        if self._state != "decode":
            raise RuntimeError(f"pause called in state {self._state!r}; call it between decode steps")
        if not isinstance(b, int) or not 0 <= b < self.batch_size:
            raise ValueError(f"sequence b={b!r} is out of range [0, {self.batch_size}) of the started batch")
        if not self._active[b]:
            raise ValueError(f"sequence {b} is not decoding (finished or paused already)")
        self.active[b] = False
        self._active[b] = False
        self._parked[b] = True

    def check_extendable(self) -> None:
        """Raise ``NotImplementedError`` when this cache's policy cannot take tokens after the prompt (a
        merge policy, per-head budgets); :meth:`begin_extend` checks it, callers may check it up front."""
        if self.layout.pairs:
            raise NotImplementedError(f"extending a sequence with merge policy {self.layout.merge_name!r} is "
                                      "not supported (a merged region cannot take prefill tokens); use a "
                                      "policy without merging")
        if self.rows_are_heads:
            raise NotImplementedError(f"extending a sequence with head budgets ({self.policy.heads.name!r}, "
                                      "HeadPagedKVCache) is not supported; use a policy without per-head "
                                      "budgets")

    def slots_held(self, b: int) -> int:
        """The most slots any cache layer holds for sequence ``b`` now (host mirror, no sync)."""
        return int(self._lens[:, b].max(initial=0))

    def decode_room(self, b: int) -> int:
        """Decode steps sequence ``b`` can take before one of its storage layers (a merged region takes two
        slots a step) runs out of the slots ``max_tokens`` gives it, evicting nothing (host mirror)."""
        room = [(self.max_pages * self.page_size - int(self._lens[l, b])) // w
                for l, w in enumerate(self.layout.width) if w]
        return min(room)

    @property
    def slots_per_layer(self) -> int:
        """The most slots one layer may hold for one sequence (``max_tokens`` rounded up to whole pages)."""
        return self.max_pages * self.page_size // self.layout.max_width

    def begin_extend(self, b: int, n: int, *, budget_len: int | None = None,
                     max_new_tokens: int | None = None) -> None:
        """Let sequence ``b`` (between decode steps, or paused) take ``n`` more tokens.

        The model then runs the ``n`` tokens through every cache layer at their true positions (the
        sequence's tokens seen so far, onward), calling :meth:`extend_attend` (and :meth:`observe`) per
        layer; :meth:`end_extend` re-plans the sequence and compresses it to its budgets. Checked here,
        before anything is written: the slots a layer may hold (``max_tokens``) and the pool's free pages.

        Parameters
        ----------
        budget_len:
            The length the sequence's budget is a fraction of afterwards (docs/contract.md §4); default:
            every token it has seen, these included. A chunked prefill passes the whole prompt's length.
        max_new_tokens:
            The planning horizon: the plan caps each layer's budget at the context plus this many decode
            steps (the next generation's length); default: the current one (``start``'s or
            :meth:`restart_decode`'s).
        """
        if self._state != "decode":
            raise RuntimeError(f"begin_extend called in state {self._state!r}; extend a sequence after "
                               "finish_prefill(), between decode steps")
        self.check_extendable()
        if not isinstance(b, int) or not 0 <= b < self.batch_size:
            raise ValueError(f"sequence b={b!r} is out of range [0, {self.batch_size}) of the started batch")
        if not self._holding()[b]:
            raise ValueError(f"sequence {b} is finished (its pages went back to the pool); it cannot be "
                             "extended")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r} must be a positive int (the tokens to add)")
        seen = int(self._seen[b]) + n
        budget_len = seen if budget_len is None else int(budget_len)
        if budget_len < seen:
            raise ValueError(f"budget_len={budget_len} is less than the {seen} tokens sequence {b} will have "
                             "seen; pass at least that")
        if max_new_tokens is not None:
            if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
            self.max_new_tokens = max_new_tokens
        S, capacity = self.page_size, self.max_pages * self.page_size
        lens = self._lens[:, b]
        if (lens + n > capacity).any():
            l = int(np.argmax(lens + n > capacity))
            raise ValueError(f"sequence {b} holds {lens[l]} tokens in layer {l}; {n} more make "
                             f"{lens[l] + n}, past the {capacity} slots per layer of max_tokens="
                             f"{self.max_tokens}; extend in smaller chunks (chunk=) or build the cache with "
                             "a larger max_tokens")
        need = int((_ceil_div(lens + n, S) - _ceil_div(lens, S)).sum())
        if need > self._free:
            raise self._out_of_pages(need, f"extension of sequence {b} by {n} tokens")
        self._extension = _Extension(b, n, budget_len, np.zeros(self.n_layers, dtype=bool))
        self._state = "extend"

    def extend_attend(self, l: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, *, scale: float,
                      alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """The extension's attention in cache layer ``l``: its ``n`` tokens over sequence ``b``'s kept tokens
        and themselves (causal among them); their K/V are appended after the kept ones, and the policy's
        scores come from the same probabilities (``kvmodels.extend_attention``, a torch implementation).

        How the scores carry over (the prefill scorer's rules, docs/contract.md §2.3, over kept + new):

        * a policy that scores every query row (``h2o``, ``a2sf``, ``keyformer``, ``scissorhands``): the
          extension's rows continue the kept tokens' scores as decode steps would (accumulated, decayed,
          counted); new tokens start from 0;
        * window votes (``snapkv``, ``chunkkv``: the last ``window`` rows; ``tova``: the last row): the kept
          tokens' scores are replaced by this extension's votes, post-processed (pooling, chunk sums, the
          heads' mean) over the kept and new tokens in position order, as a prompt's would be;
        * an open score rule (``knorm``): each new token's own score, the kept ones unchanged; no score mode:
          nothing (new tokens 0). ChunkKV's layer-wise index reuse does not apply: every layer scores itself.

        Parameters
        ----------
        q:
            ``[n, Hq, D]`` queries (after RoPE).
        k, v:
            ``[n, Hkv, D]`` keys (after RoPE) and values, ``dtype`` of the cache.
        positions:
            ``[n]`` int, the tokens' absolute positions (the sequence's tokens seen so far, onward).
        scale, alibi_slopes:
            Logit scale and optional ``[Hq]`` float32 ALiBi slopes.

        Returns
        -------
        ``[n, Hq, D]`` attention output in ``q``'s dtype.
        """
        ext = self._extension
        if self._state != "extend" or ext is None:
            raise RuntimeError(f"extend_attend called in state {self._state!r}; call begin_extend(b, n) "
                               "first")
        self._check_layer(l)
        if b != ext.b:
            raise ValueError(f"sequence b={b!r} is not the one being extended ({ext.b})")
        if ext.done[l]:
            raise RuntimeError(f"layer {l} of sequence {b} is already extended; call end_extend({b})")
        n, H, D, S, dev = ext.n, self.n_kv_heads, self.head_dim, self.page_size, self.device
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t, ndim=3, dtypes=(self.dtype,), device=dev)
        check_shape("q", q, [n, self.n_q_heads, D], "n x n_q_heads x head_dim")
        check_shape("k", k, [n, H, D], "n x n_kv_heads x head_dim")
        check_shape("v", v, [n, H, D], "n x n_kv_heads x head_dim")
        check_tensor("positions", positions, ndim=1, dtypes=_INT_DTYPES, device=dev)
        check_shape("positions", positions, [n], "n (the tokens begin_extend announced)")

        # The kept tokens in slot order, then per KV head in position order (pooling reads neighbours).
        m = int(self._lens[l, b])
        table = self.page_table[l, b, :_ceil_div(m, S)].to(torch.int64)
        slots = torch.arange(m, device=dev)
        page, offset = table[slots // S], slots % S  # [m] each
        kept_score = self.slot_score[page, offset]  # [m, Hkv]
        order = torch.sort(self.slot_pos[page, offset].long(), dim=0, stable=True).indices  # [m, Hkv]

        def by_position(pool: torch.Tensor) -> torch.Tensor:  # [m, Hkv, ...] in position order per head
            x = pool[page, offset]
            return x.gather(0, order.view(m, H, *[1] * (x.dim() - 2)).expand_as(x))

        ev, mode = self.eviction, self.eviction.prefill_mode
        window = ev.prefill_window(n) if mode is not None else 0
        kwargs = ev.prefill_kwargs(n) if mode is not None else {}
        decay = float(kwargs.get("decay", 1.0))
        out, scores = extend_attention(
            q, k, v, positions, by_position(self.k_pages), by_position(self.v_pages),
            by_position(self.slot_pos), scale=scale, alibi_slopes=alibi_slopes, mode=mode, window=window,
            decay=decay, seed=self.prefill_seed(l, b), temperature=float(kwargs.get("temperature", 1.0)))
        if scores is not None:
            if window or mode == "replace":  # window votes: they replace the kept tokens' old votes
                scores = ev.postprocess_prefill_scores(scores)
            else:  # every row scores: the rows continue the kept tokens' scores, as decode steps would
                old = kept_score.gather(0, order).t()  # [Hkv, m]
                if mode == "decay":
                    old = old * decay**n
                scores = torch.cat([old + scores[:, :m], scores[:, m:]], dim=1)
            kept = torch.empty_like(kept_score).scatter_(0, order, scores[:, :m].t().contiguous())
            self.slot_score[page, offset] = kept  # back in slot order
            new_scores = scores[:, m:].t()  # [n, Hkv]
        elif ev.scores_tokens:  # an open rule: each token's score from what its step provides
            new_scores = self._token_scores(q, k, v, positions, check=True)
        else:
            new_scores = torch.zeros(n, H, dtype=torch.float32, device=dev)

        # Append after the kept slots, popping the pages the extension opens (begin_extend counted them).
        held, total = _ceil_div(m, S), _ceil_div(m + n, S)
        if total > held:
            self.page_table[l, b, held:total] = self.free_pages[self._free - (total - held):self._free]
            self.n_free -= total - held
            self._free -= total - held
        slots = torch.arange(m, m + n, device=dev)
        page, offset = self.page_table[l, b, :total].to(torch.int64)[slots // S], slots % S
        self.k_pages[page, offset] = k
        self.v_pages[page, offset] = v
        self.slot_pos[page, offset] = positions.to(torch.int32)[:, None].expand(n, H)
        self.slot_score[page, offset] = new_scores.to(torch.float32)
        self.seq_lens[l, b] = m + n
        self._lens[l, b] = m + n
        ext.done[l] = True
        self._track_peak()
        return out

    def end_extend(self, b: int) -> None:
        """Finish sequence ``b``'s extension: re-plan the batch (``b``'s budget from ``budget_len``, its
        layer budgets capped at its context plus the planning horizon) and compress every layer over budget
        (the policy's ``prefill_compress``), returning pages. The sequence decodes at the next step."""
        ext = self._extension
        if self._state != "extend" or ext is None or b != ext.b:
            raise RuntimeError(f"end_extend({b!r}) must follow begin_extend({b!r}) and extend_attend on "
                               "every layer")
        if not ext.done.all():
            l = int(np.argmin(ext.done))
            raise RuntimeError(f"layer {l} of sequence {b} was not extended; call extend_attend for every "
                               "cache layer")
        self._seen[b] += ext.n
        self.prompt_lens[b] = ext.budget_len
        self.budget_tokens[b] = self.policy.checked_budget_tokens(torch.tensor([ext.budget_len]))[0]
        self.active[b] = True
        self._active[b] = True
        self._parked[b] = False
        self._extension = None
        self._state = "decode"
        self._replan()

    def restart_decode(self, max_new_tokens: int) -> None:
        """Start the next generation of the batch: ``max_new_tokens`` decode steps from step 0 (Keyformer's
        temperature schedule restarts). When the horizon changes, the plan is remade with it (each layer's
        budget capped at its context plus ``max_new_tokens``) and layers over their new budget are
        compressed now."""
        if self._state != "decode":
            raise RuntimeError(f"restart_decode called in state {self._state!r}; call it between decode "
                               "steps")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self._step = 0
        if max_new_tokens == self.max_new_tokens and self.plan is not None:
            return
        self.max_new_tokens = max_new_tokens
        self._replan()

    def _replan(self) -> None:
        """The batch's plan from the sequences' current lengths, budgets and horizon (``self.plan``), and,
        with the policy's ``prefill_compress``, every layer over its budget compressed now. A
        sequence's capacity counts every token it has seen (a generation adds to its context), its budget the
        length it was last given (``budget_len``). Layers may be out of position order after decode-time
        eviction: ``topk_evict`` ranks by stored positions (Keyformer's layers stay in order: its decode
        noise is indexed by slot, and ``_compress`` keeps them on ``topk_compact``)."""
        n = self.batch_size
        for b in np.flatnonzero(self._holding()[:n]):
            self.prompt_lens[b] = max(self.prompt_lens[b], int(self._seen[b]))
        self.plan = self._plan(list(range(n)))
        self.budgets[:, :n] = self.plan.rows.budgets.clamp_min(1).to(self.device, torch.int32)
        if self.plan.schedule.prefill_compress:
            if self.eviction.heads_share_selection:  # as after_step: one ranking for the layer's heads
                self.slot_score.copy_(self.eviction.eviction_scores(self.slot_score, head_dim=-1))
            self._compress(in_place=True)

    # ------------------------------------------------------------------ inspection
    def layer_contents(self, l: int, b: int) -> dict[str, torch.Tensor]:
        """Kept tokens of layer ``l``, sequence ``b`` in position order per KV head (for tests and debugging;
        syncs). Decode-time eviction in place leaves slots out of position order; this view sorts them.

        Returns ``k``/``v`` ``[n, Hkv, D]``, ``pos`` ``[n, Hkv]`` int32 and ``score`` ``[n, Hkv]`` float32,
        ``n = seq_lens[l, b]``. For a layer of a merged pair these are the slots of the pair's region in slot
        order (a region is always compacted in order), with ``k``/``v`` restored through this layer's
        magnitudes, plus ``visible`` ``[n, Hkv]`` bool (the slots this layer attends to; the others are the
        other layer's private slots).
        """
        self._check_layer(l)
        s = self.layout.storage[l]
        n = int(self.seq_lens[s, b])
        pages = self.page_table[s, b, :_ceil_div(n, self.page_size)].to(torch.int64)

        def rows(pool: torch.Tensor) -> torch.Tensor:
            return pool[pages].flatten(0, 1)[:n]

        out = {"k": rows(self.k_pages), "v": rows(self.v_pages), "pos": rows(self.slot_pos),
               "score": rows(self.slot_score)}
        if self.layout.merged[l]:
            assert self.k_mag is not None and self.v_mag is not None and self.slot_mask is not None
            m = self.layout.member[l]
            out["k"] = merge_restore(out["k"], rows(self.k_mag[m]))
            out["v"] = merge_restore(out["v"], rows(self.v_mag[m]))
            out["visible"] = (rows(self.slot_mask) & self.layout.mask_bit(l)) != 0
            return out
        order = torch.sort(out["pos"].long(), dim=0, stable=True).indices  # [n, Hkv]
        return {name: x.gather(0, order.view(*order.shape, *[1] * (x.dim() - 2)).expand_as(x))
                for name, x in out.items()}

    def report(self) -> CacheReport:
        """Bytes and tokens held now, the peak since ``start`` and the uncompressed equivalent."""
        n = self.batch_size
        per_layer = self._pages_held().sum(axis=1) * self.page_bytes
        full_pages = self.n_layers * int(_ceil_div(self._seen[self._holding()], self.page_size).sum())
        budgets = None
        if self.plan is not None:  # the storage layers' budgets: a region's under its owner, 0 under b
            budgets = tuple(tuple(int(x) for x in row) for row in self.plan.rows.budgets.tolist())
        return CacheReport(
            page_size=self.page_size, page_bytes=self.page_bytes, num_pages=self.num_pages,
            bytes_per_layer=tuple(int(x) for x in per_layer), total_bytes=int(per_layer.sum()),
            peak_bytes=self._peak_pages * self.page_bytes,
            full_cache_bytes=full_pages * self.page_bytes,
            full_cache_peak_bytes=self._full_peak_pages * self.page_bytes,
            tokens_per_layer=tuple(tuple(int(x) for x in row[:n]) for row in self._lens),
            layer_budgets=budgets, merged_pairs=self.layout.pairs)


def paged_cache(**kw) -> PagedKVCache:
    """The cache ``kw["policy"]`` needs, built from ``PagedKVCache``'s keywords: a
    :class:`kvmodels.head_cache.HeadPagedKVCache` when the policy gives the KV heads of a layer different
    budgets (``policy.heads.per_head``), else a :class:`PagedKVCache`. ``num_pages`` counts pages of every
    KV head; it is scaled to one-head pages."""
    policy = kw.get("policy")
    if policy is None or not policy.heads.per_head:
        return PagedKVCache(**kw)
    from .head_cache import HeadPagedKVCache  # a subclass of this module's cache

    if kw.get("num_pages") is not None:
        kw["num_pages"] = kw["num_pages"] * kw["n_kv_heads"]
    return HeadPagedKVCache(**kw)
