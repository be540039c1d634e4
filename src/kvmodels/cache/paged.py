"""The paged cache: :class:`PagedKVCache` joins the page pool, the row layout, the host mirror and the
compactor, and drives a batch through its lifecycle (docs/contract.md §1, §4–§6).

One page pool serves every cache layer. A sequence's layer owns whole pages, listed in its row of the layer's
page table; eviction compacts the kept tokens to the front and returns the pages past the budget to a free
stack, so a smaller budget really holds less memory. Every tensor is allocated once, so a compiled decode step
(``append`` + ``attend``) never sees a new shape, and ``append``/``attend`` are pure tensor code (no
``.item()``, no branching on tensor values).

Lengths never depend on scores (only on prompt lengths, budgets and the step), so the cache mirrors them on
the host: ``prepare_decode`` checks the free-page count without a device sync and raises before anything is
written.

The lifecycle: ``start`` -> ``prefill_layer`` / ``prefill_attend`` per layer and sequence (``prefill.py``),
optionally ``compress_prompt`` -> ``finish_prefill`` -> per step ``prepare_decode``, ``append`` + ``attend``
per layer, ``after_step`` (``decode.py``) -> ``finish_sequence``; between steps ``pause``, ``begin_extend`` /
``extend_attend`` / ``end_extend`` and ``restart_decode`` (``extend.py``).

MiniCache (a ``merge`` policy, e.g. ``compose("h2o", "minicache")``): each merged pair of cache layers
``(a, b)`` becomes ONE storage region, owned by layer ``a``'s page table; layer ``b`` reads ``a``'s pages and
holds none of its own. See ``Compactor.merge_pair`` (``compaction.py``) for how the region is built and
docs/contract.md §5 for the accounting.
"""

from __future__ import annotations

import numpy as np
import torch

from kvkernels import noise_seed
from kvmodels.replay import Replays
from kvpolicies.plan import CompressionPlan

from .compaction import Compaction, Compactor
from .contents import InspectSteps
from .decode import DecodeSteps
from .extend import ExtendSteps, Extension
from .mirror import HostMirror
from .pool import PagePool, ceil_div
from .prefill import PrefillSteps
from .rows import ROW_LAYOUTS, check_layer, check_reserve, check_sequence
from .storage import check_side_pages, row_storage
from .tiers import SideRegion


class PagedKVCache(PrefillSteps, DecodeSteps, ExtendSteps, InspectSteps):
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
    side_pages:
        Pages in the second format's pool, with a precision that stores two (``kvmodels.cache.tiers``: KIVI's
        residual, ZipCache, MiKV; refused otherwise); ``None``: ``num_pages``. Its pages are as small as
        its format, so sizing the two pools apart (``kvmodels.chunked_num_pages(region=)``) keeps the
        unquantized pool to what it holds (KIVI: the residual and a chunk).
    dtype, device:
        Of the K/V pages.
    policy:
        A ``kvpolicies.ComposedPolicy`` (``compose(...)``).
    rows:
        The row layout (``kvmodels.cache.rows``): ``"sequences"`` (one page-table row per sequence, a slot
        holds a token of every KV head) or ``"heads"`` (one row per (sequence, KV head), pages of one head,
        for head-budget policies such as ``adakv``; ``num_pages`` then counts pages of ONE head).
        :func:`kvmodels.cache.paged_cache` picks it for a policy.
    windows:
        The model's sliding windows, one per cache layer (``kvmodels.generate.CacheLayout.windows``): a layer
        with ``W > 0`` attends to its last ``W`` tokens only (Gemma 3's local layers, Mistral's), so it keeps
        its last ``W - 1`` and is compacted to them after every decode step (``CompressionPlan.sliding``);
        the policy acts on the other layers. ``None`` or all 0: every layer attends to every token.
        Rows per sequence only, one storage format, no merging; an extension attends in each window
        (``kvkernels.extend_attention(sliding_window=)``) and is compacted back to it.
    alibi:
        The model biases attention by each slot's position (``CacheLayout.alibi``, MPT): quantized rows are
        refused here (the quantized decode kernel does not read positions), before any prefill.
    seed:
        Seeds, together with ``policy.seed``, the Gumbel noise of score modes that draw it (decode: a
        per-step keys ``kvkernels.decode_keys(noise_seed, step, ...)``, the step counted from ``start``;
        prefill: ``prefill_scores(seed=prefill_seed(l, b))``).

    Attributes
    ----------
    pool, host, compactor, rows:
        The parts (``kvmodels.cache``): the :class:`PagePool` (its buffers are also attributes of the cache,
        below), the :class:`HostMirror` of lengths, the :class:`Compactor` and the row layout.
    n_kv_heads, n_q_heads, max_batch, batch_size, prompt_lens:
        Of the pool's rows: with rows per KV head, ``1``, ``G``, ``max_batch * Hkv`` rows, the started rows
        and their prompt lengths. ``kv_heads``, ``q_heads``, ``max_sequences``, ``n_sequences`` and
        ``sequence_prompt_lens`` are the model's (equal to them with rows per sequence).
    k_pages, v_pages, slot_pos, slot_score, free_pages, n_free, k_mag, v_mag, slot_mask, trash_page,
    page_bytes:
        The pool's (:class:`kvmodels.cache.PagePool`): ``[P + 1, S, Hkv, ...]`` pages (the last one the trash
        page), ``[P + 2]`` free stack; the MiniCache magnitudes and visibility bits only with merging (``M``
        then covers ``2 * max_tokens`` slots, since a region holds the private tokens of both layers).
    page_table, seq_lens:
        ``[Lc, max_batch, M]`` int32 and ``[Lc, max_batch]`` int32 (``M = ceil(max_tokens / S)``).
    active:
        ``[max_batch]`` bool, rows holding an unfinished sequence.
    gumbel_keys, temperature:
        ``[Lc, max_batch, Hq]`` int32 keys of the current step's Gumbel noise (``kvkernels.decode_keys``; the
        decode kernel hashes the noise from them, ``ScoreUpdate.gumbel_key``; only allocated for the
        ``gumbel`` score mode) and ``[1]`` float32 tau.
    layout:
        ``kvpolicies.plan.MergeLayout``: where each layer stores its tokens (``policy.merge_layout(Lc)``).
    merged_pairs:
        MiniCache pairs ``(a, b)`` of cache layers (``layout.pairs``; empty without merging).
    plan:
        The batch's ``kvpolicies.plan.CompressionPlan`` (``None`` before ``finish_prefill``): the budgets
        and forced counts the cache compacts to, and the eviction schedule.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_q_heads: int, max_batch: int,
                 max_tokens: int, page_size: int = 16, num_pages: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", policy=None,
                 seed: int = 0, rows: str = "sequences", windows=None, alibi: bool = False,
                 side_pages: int | None = None):
        from kvpolicies import ComposedPolicy, compose
        from kvpolicies.plan import check_windows, sliding_layers

        if policy is None:
            policy = compose("full")
        if not isinstance(policy, ComposedPolicy):
            raise TypeError(f"policy must be a kvpolicies.ComposedPolicy (build one with "
                            f"kvpolicies.compose(...)), got {type(policy).__name__}")
        if rows not in ROW_LAYOUTS:
            raise ValueError(f"rows={rows!r} is not a row layout; use one of {sorted(ROW_LAYOUTS)}")
        ROW_LAYOUTS[rows].check_policy(policy)
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                            ("n_q_heads", n_q_heads), ("max_batch", max_batch), ("max_tokens", max_tokens),
                            ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if n_q_heads % n_kv_heads:
            raise ValueError(f"n_q_heads={n_q_heads} must be a multiple of n_kv_heads={n_kv_heads} "
                             "(GQA groups)")
        policy.check_model(n_layers, n_kv_heads)  # weights measured on another model: refused now
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        # How a pool row holds a token: the cache's dtype, or a packed quantized row (the precision role).
        self.storage, side = row_storage(policy, head_dim, dtype, device, alibi=alibi)
        side_pages = check_side_pages(side_pages, policy, side)
        if side is not None and rows != "sequences":
            raise ValueError(f"policy {policy.name!r}: precision {policy.precision.name!r} keeps tokens in "
                             "two formats, which the paged cache holds for one row per sequence only; drop "
                             "the head-budget policy or use kivi(residual=0)")
        # The model's terms, and the pool's rows: a row holds pool_kv_heads heads of one sequence.
        self.rows = ROW_LAYOUTS[rows](n_kv_heads, n_q_heads)
        self.kv_heads, self.q_heads, self.max_sequences = n_kv_heads, n_q_heads, max_batch
        n_kv_heads, n_q_heads = self.rows.pool_kv_heads, self.rows.pool_q_heads
        max_batch *= self.rows.per_sequence
        # Where each layer stores its tokens (MiniCache pairs share a region), decided by the policy.
        self.layout = policy.merge_layout(n_layers)
        self._width = np.asarray(self.layout.width, dtype=np.int64)  # [Lc] the layout's, as an array
        # The model's sliding-window layers keep their window (the plan's); the policy acts on the rest.
        self.windows = check_windows(windows, n_layers)
        self.sliding = list(sliding_layers(self.windows))
        if self.windows:
            why = ("two storage formats (use one: kivi(residual=0))" if side is not None
                   else "rows per KV head (a head-budget policy); drop it" if rows != "sequences"
                   else f"merge policy {self.layout.merge_name!r}; drop it" if self.layout.pairs else None)
            if why is not None:
                raise ValueError(f"policy {policy.name!r}: a cache with sliding-window layers (windows=...) "
                                 f"does not support {why}")

        self.policy = policy
        self.eviction = policy.eviction
        self.n_layers, self.n_kv_heads, self.n_q_heads = n_layers, n_kv_heads, n_q_heads
        self.head_dim = head_dim
        self.max_batch, self.max_tokens, self.page_size = max_batch, max_tokens, page_size
        # A region holds up to both layers' tokens: 2 * max_tokens slots.
        self.max_pages = ceil_div(max_tokens * self.layout.max_width, page_size)  # M
        if num_pages is None:  # a region never needs more pages than its two layers would
            num_pages = n_layers * max_batch * ceil_div(max_tokens, page_size)
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

        M, dev = self.max_pages, self.device
        self.pool = pool = PagePool(num_pages, page_size, n_kv_heads, self.storage, device=dev,
                                    merged=bool(self.layout.pairs))
        # The pool's buffers, read by the decode step as attributes of the cache.
        self.k_pages, self.v_pages = pool.k_pages, pool.v_pages
        self.slot_pos, self.slot_score = pool.slot_pos, pool.slot_score
        self.free_pages, self.n_free = pool.free_pages, pool.n_free
        self.k_mag, self.v_mag, self.slot_mask = pool.k_mag, pool.v_mag, pool.slot_mask
        self.trash_page, self.page_bytes = pool.trash_page, pool.page_bytes
        self.page_table = torch.full((n_layers, max_batch, M), -1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n_layers, max_batch, dtype=torch.int32, device=dev)
        self.active = torch.zeros(max_batch, dtype=torch.bool, device=dev)
        self.budgets = torch.ones(n_layers, max_batch, dtype=torch.int32, device=dev)
        self.cos_sim = torch.zeros(n_layers, max_batch, dtype=torch.float32, device=dev)
        # ZipCache's channel-separable keys (a precision policy's channel_scale=True): each row's factor per
        # KV head and channel, set by its prefill (kvkernels.quant.key_channel_scale). The pool stores k / c
        # and decode steps attend with q * c; reads (contents, extensions) multiply back, exactly.
        self.key_scale: torch.Tensor | None = None
        if getattr(policy.precision, "channel_scale", False):
            self.key_scale = torch.ones(n_layers, max_batch, n_kv_heads, head_dim, dtype=torch.float32,
                                        device=dev)
        self.compactor = Compactor(pool, self.page_table, self.seq_lens, self.layout)
        # Tokens in a second format (kvmodels.cache.tiers): a pool of their own, as many (smaller) pages.
        self.side: SideRegion | None = None
        if side is not None:
            self.side = SideRegion(side, num_pages if side_pages is None else side_pages, n_layers, max_batch,
                                   M, n_kv_heads, page_size, dev,
                                   self.layout, policy.precision, self.storage.bits,
                                   capped=self.eviction.decode_evict)

        self.score_mode = self.eviction.score_mode
        if self.score_mode == "none" and self.side is not None and self.side.every:
            self.score_mode = "accumulate"  # ZipCache ranks decoded tokens by their accumulated attention
        self.gumbel = self.score_mode == "gumbel"
        self.gumbel_keys: torch.Tensor | None = None
        if self.gumbel:  # a key per (layer, row, query head) and step: no [.., slots] noise buffer
            self.gumbel_keys = torch.zeros(n_layers, max_batch, n_q_heads, dtype=torch.int32, device=dev)
        self.temperature = torch.ones(1, dtype=torch.float32, device=dev)
        self.decay = 1.0
        # The compiled decode step mutates these in place (K/V, slot positions and scores, lengths).
        # Inductor's CUDA graph trees replay a graph that mutates its inputs only if those inputs have
        # static addresses, as module buffers do; marked, they do too (unguarded: a new cache re-records
        # the graph instead of recompiling the step). They are allocated once and only ever updated in place.
        for buf in self.static_buffers():
            torch._dynamo.mark_static_address(buf)

        self.batch_size = self.n_sequences = 0
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
        bufs += [t for t in (self.k_mag, self.v_mag, self.slot_mask, self.gumbel_keys, self.key_scale)
                 if t is not None]
        return bufs + (self.side.static_buffers() if self.side is not None else [])

    def _reset_pool(self) -> None:
        """Every page free, every row empty (in place: a compiled step keeps its buffers); a new host
        mirror."""
        self.pool.reset()
        self.page_table.fill_(-1)
        self.seq_lens.zero_()
        self.active.zero_()
        self.budgets.fill_(1)
        self.cos_sim.zero_()
        self.host = HostMirror(self.n_layers, self.max_batch, self.windows)
        self._extension: Extension | None = None  # the extension in progress (begin_extend)
        self._shared_scores: dict[tuple[int, int], torch.Tensor] = {}  # (layer, seq) -> scores others reuse
        self.plan: CompressionPlan | None = None  # the batch's plan (finish_prefill)
        self.compactor.reset()
        self._replays.clear()
        self._split = np.zeros(self.max_batch, dtype=bool)  # rows whose tokens the side region split
        if self.side is not None:
            self.side.reset()

    def window(self, l: int) -> int:
        """Cache layer ``l``'s sliding window ``W`` (0: it attends to every token)."""
        return self.windows[l] if self.windows else 0

    def _check_layer(self, l: int) -> None:
        check_layer(l, self.n_layers)

    # ------------------------------------------------------------------ batch lifecycle
    def start(self, prompt_lens: list[int], max_new_tokens: int, *, compress_each: bool = False,
              budget_lens: list[int] | None = None, reserve: list[int] | None = None) -> None:
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
        reserve:
            Per sequence, the slots every layer must keep free after its prompt's compression (default 0): a
            chunked prefill's next chunk. The plan caps each layer's budget at ``max_tokens`` (in whole
            pages) less this, handing the excess to the sequence's other layers (``ComposedPolicy.plan``'s
            ``room``), so a layer-budget policy's largest layers still take the next chunk.
        """
        sequence_lens = [int(x) for x in prompt_lens]
        if not 1 <= len(sequence_lens) <= self.max_sequences:
            raise ValueError(f"prompt_lens has {len(sequence_lens)} sequences; the cache was built for "
                             f"1..max_batch={self.max_sequences} (raise max_batch)")
        # From here on, one entry per pool row (the row layout spreads a sequence over its rows).
        prompt_lens = self.rows.per_row(sequence_lens)
        budget_lens = None if budget_lens is None else self.rows.per_row(budget_lens)
        n = len(prompt_lens)
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
            # (A sequence may span several rows, one per KV head: all of them are compressed together.)
            rows = self.rows.per_sequence
            prompt_pages = self.n_layers * rows * ceil_div(max(prompt_lens), self.page_size)
            what = f"prefill of the longest prompt ({max(prompt_lens)} tokens) in {self.n_layers} layers"
        else:
            prompt_pages = self.n_layers * sum(ceil_div(L, self.page_size) for L in prompt_lens)
            what = f"prefill of {n} prompts in {self.n_layers} layers"
        if prompt_pages > self.num_pages:
            self.pool.free = self.num_pages
            raise self.pool.out_of_pages(prompt_pages, what)
        budget_lens = prompt_lens if budget_lens is None else [int(x) for x in budget_lens]
        if len(budget_lens) != n or any(bl < pl for bl, pl in zip(budget_lens, prompt_lens, strict=True)):
            raise ValueError(f"budget_lens={budget_lens} must give one length per sequence, each at least "
                             f"its prompt_lens={prompt_lens}")
        budget_tokens = self.policy.checked_budget_tokens(torch.tensor(budget_lens, dtype=torch.int64))
        if reserve is not None and len(reserve) != len(sequence_lens):
            raise ValueError(f"reserve={reserve} must give one count per sequence ({len(sequence_lens)})")
        reserve = [0] * n if reserve is None else self.rows.per_row([check_reserve(r, self) for r in reserve])

        self._reset_pool()
        self.host.compressed[:] = False
        self.batch_size = n
        self.n_sequences, self.sequence_prompt_lens = len(sequence_lens), sequence_lens
        self.rows.start()
        # The lengths the plan reads (budgets as fractions of them, layer budgets capped at them plus
        # max_new_tokens): the prompts, and after an extension the sequence's context (end_extend).
        self.prompt_lens = prompt_lens
        self.max_new_tokens = max_new_tokens
        self.budget_tokens = budget_tokens
        self.budget_lens = list(budget_lens)  # its own list: the plan raises prompt_lens as sequences grow
        self.reserve = reserve
        self.active[:n] = True
        self.host.active[:n] = True
        self.host.seen[:n] = prompt_lens
        self._step = 0
        self._state = "prefill"
        self._noise_step = 0  # decode steps drawn since start (later turns continue it)
        kw = self.eviction.decode_kwargs(0, max(1, max_new_tokens))
        unknown = set(kw) - {"temperature", "decay"}
        if unknown:
            raise ValueError(f"eviction policy {self.eviction.name!r} returned decode_kwargs "
                             f"{sorted(unknown)} the cache does not know; supported: temperature, decay")
        # decay is a constant of the policy, so it is a Python float baked into the compiled step.
        self.decay = float(kw.get("decay", 1.0))


    def _plan(self, rows: list[int]) -> CompressionPlan:
        """The policy's plan for the pool rows ``rows`` (whole sequences), as the row layout makes it."""
        return self.rows.plan(self, rows)

    def finish_prefill(self) -> None:
        """Take the policy's plan, merge MiniCache pairs and compress every prompt to its budget
        (docs/contract.md §5 steps 2–3).

        The plan (``self.plan``, ``ComposedPolicy.plan``) gives a merged pair ``(a, b)`` with layer budgets
        ``B_a, B_b`` one budget ``R = B_a + B_b`` (listed under ``a``, 0 under ``b``: the total is
        conserved); ``Compactor.merge_pair`` builds each pair's region (joint selection, the merge policy's
        region, shared and private slots). At decode both layers append private slots (2 per step) and
        eviction compacts the region to ``R`` with the plan's forced ``2 * forced(R // 2)`` slots, so the
        region never holds more than ``R + 2 * (evict_every - 1)`` slots, i.e. ``budget + evict_every - 1``
        per layer-equivalent.
        """
        if self._state != "prefill":
            raise RuntimeError(f"finish_prefill called in state {self._state!r}; call start(...) and "
                               "prefill first")
        n = self.batch_size
        missing = np.argwhere(~self.host.prefilled[:, :n])
        if len(missing):
            l, b = missing[0]
            raise RuntimeError(f"layer {l} of sequence {b} was not prefilled ({len(missing)} (layer, "
                               "sequence) pairs missing); call prefill_layer for every cache layer of every "
                               "sequence")
        self.plan = plan = self._plan(list(range(n)))
        # A region's reader row is unused; it holds 1 so the device budgets stay valid op input.
        self.budgets[:, :n] = plan.rows.budgets.clamp_min(1).to(self.device, torch.int32)
        for i, (a, b) in enumerate(self.layout.pairs):
            self.compactor.merge_pair(self.host.lens, n, self.policy.merge, a, b,
                                      *(x.numpy() for x in plan.joint.row(i)))
        groups = self.compactor.width_groups(range(self.n_layers))
        if plan.schedule.prefill_compress:
            self._compress(groups.get(1, []))
        elif self.sliding:  # the model's windows hold whatever the policy (no merging with them)
            self._compress(self.sliding)
        self._split_formats(list(range(n)))
        budgets, n_sink, n_recent = (x.numpy() for x in plan.rows)  # [Lc, n] each
        for ls in groups.values():  # upload decode-time eviction's rows (_compress) now, not mid-decode
            self.compactor.op_rows(ls, list(range(n)), budgets[ls], n_sink[ls], n_recent[ls])
        self._state = "decode"


    def _split_formats(self, rows: list[int]) -> None:
        """Once a row's prompt is compressed: the precision policy's two formats split between the main and
        the side region (``kvmodels.cache.tiers``); nothing without a side region."""
        todo = [b for b in rows if not self._split[b] and self.host.holding()[b]]
        if self.side is not None and todo:
            self.side.split(self, todo)
        self._split[rows] = True

    def _compress(self, layers: list[int] | None = None, in_place: bool = False,
                  rows: list[int] | None = None) -> None:
        """Compact every storage layer (of ``layers``) holding more than its budget, in pool ``rows`` (all
        when None): one op call per storage width (plain layers, merged regions)."""
        for call in self._compress_calls(layers, in_place, rows):
            call.device()
            call.commit()

    def _compress_calls(self, layers: list[int] | None = None, in_place: bool = False,
                        rows: list[int] | None = None) -> list[Compaction]:
        """The compaction calls :meth:`_compress` makes, not yet run (``Compactor.compress_calls``;
        Keyformer's layers stay in slot order)."""
        assert self.plan is not None  # set by finish_prefill
        return self.compactor.compress_calls(self.host.lens, self.plan, self.batch_size, layers, in_place,
                                             keep_order=self.gumbel, rows=rows)

    def finish_sequence(self, b: int) -> None:
        """Return all pages of sequence ``b`` to the pool; its row stays in the batch, inactive."""
        if self._state not in ("decode", "prefill"):
            raise RuntimeError(f"finish_sequence called in state {self._state!r}; call it between steps")
        for row in self.rows.rows(check_sequence(b, self.n_sequences)):
            if not self.host.holding()[row]:
                raise ValueError(f"sequence {b} is already finished")
            self.pool.release(self.page_table[:, row], self.host.lens[:, row])
            self.seq_lens[:, row] = 0
            self.active[row] = False
            self.host.lens[:, row] = 0
            self.host.active[row] = False
            self.host.parked[row] = False
            self.host.prefilled[:, row] = True  # nothing left to prefill for it
            if self.side is not None:
                self.side.finish(row)


class HeadPagedKVCache(PagedKVCache):
    """A :class:`PagedKVCache` with one page table, length and budget per (sequence, KV head)
    (``rows="heads"``, ``kvmodels.cache.rows.HeadRows``): the KV heads of a layer may hold different token
    counts (Ada-KV, docs/contract.md §4.1).

    Same parameters and methods, in the model's terms (``n_kv_heads``, ``n_q_heads``, ``max_batch``
    sequences, tensors ``[B, Hkv, D]``). ``num_pages`` counts pages of ONE KV head (``S`` slots of ``D``
    each); ``None`` gives enough for ``max_batch`` uncompressed sequences. ``kv_heads`` and ``q_heads`` are
    the model's ``Hkv`` and ``Hq``; the pool itself has one KV head and ``G = Hq / Hkv`` query heads per row
    (``n_kv_heads == 1``, ``n_q_heads == G``); ``max_sequences`` is ``max_batch`` as given.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_q_heads: int, max_batch: int,
                 max_tokens: int, page_size: int = 16, num_pages: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", policy=None,
                 seed: int = 0, windows=None, alibi: bool = False, side_pages: int | None = None):
        super().__init__(n_layers, n_kv_heads, head_dim, n_q_heads, max_batch, max_tokens,
                         page_size=page_size, num_pages=num_pages, dtype=dtype, device=device, policy=policy,
                         seed=seed, rows="heads", windows=windows, alibi=alibi, side_pages=side_pages)
