"""Worker side: vLLM's CPU attention backend (``CPU_ATTN``), extended to compress each request's prompt.

Layout. vLLM's CPU KV cache of one layer is ``[num_blocks, Hkv, block_size, 2 * D]`` (keys then values of a
block's slots, per KV head; the order of the elements inside a block depends on the kernel's ISA and is
measured once, :func:`slot_layout`), and a request's slot ``j`` is slot ``j % bs`` of block
``table[j // bs]``. vLLM writes the token at position ``p`` to slot ``p``. This backend keeps that until the
step in which a request's prompt (``L`` tokens) is complete; in that step each layer, once its attention has
run:

1. reads the prompt's keys and values back from the request's blocks (``[L, Hkv, D]``, after RoPE);
2. scores them as the policy says -- an open rule (``knorm``: ``token_scores``), the prefill's own queries
   through ``kvkernels.prefill_scores`` (``snapkv``, ``chunkkv``: the last ``window`` queries, then
   ``postprocess_prefill_scores``), or none (``streaming``, ``window``: forced slots only);
3. selects and compacts with ``kvkernels.topk_compact``, the op every cache of the library compacts with
   (each KV head a one-page sequence, as the head-paged cache lays a layer out): per KV head the forced
   sinks and recent tokens plus the top scores, ``kept`` tokens in original order, bit-identical;
4. writes them to slots ``[0, kept)``; any tokens after the prompt in the same step (a preempted request
   recomputing its generated tokens) follow at ``kept``, and their attention is run again over the
   compacted slots (kept tokens, then theirs), replacing the first pass's output, which had attended to the
   whole prompt: so they hold the keys and values an uninterrupted decode would have given them.

In that step the builder also cuts the request's row of the worker's block table (and the runner's
per-request block list) to its first ``cdiv(c - d, bs)`` blocks (``c``: the tokens cached after the step,
``d = L - kept``): the ones :mod:`kvpolicies.vllm.manager` keeps when it frees the rest at its next
scheduling of the request. The scheduler's new blocks are then appended right after them, so both sides
hold the same list and a row never needs more than ``cdiv(max_model_len, bs)`` columns. From the next step
on the request is *compacted*: the builder hands the stock CPU kernel seq_len ``- d`` and writes the token at
position ``p`` to slot ``p - d``. Positions are untouched: RoPE was applied before caching, so a kept key
keeps its original rotation wherever it is stored, and the attention kernel needs no positions.

Decode-time eviction (``streaming``, ``window``, ``knorm``, and by attention scores ``h2o``, ``a2sf``,
``tova``, ``scissorhands``, ``keyformer``): a request past its prompt with ``c`` tokens cached holds
``stored(c)`` slots (``KeptLengths``), reads ``seq_len - d(c)`` and writes new tokens ``d(c) = c -
stored(c)`` slots earlier.
The step's tokens past the prompt are split after each eviction point (``config.step_pieces``); after the
batch's attention each layer runs rounds: a second attention for the pieces the batch's pass gave the wrong
slots (a recomputed request's generated tokens), the score update of every piece (:func:`score_pieces`),
then the evictions (:func:`evict_many`), which keep ``budget`` slots in order and move the step's later tokens
behind them.

Scores (``config.decode_scores``): per (request, layer) the worker holds a ``[Hkv, stored]`` float32 score
per held slot (``_SCORES``), as kvmodels' caches hold ``slot_score``: set from the prompt's scores by the
compaction (also when the prompt is kept whole), extended with 0 for each new token, updated by each decode
query's attention over the slots it sees (``kvkernels.paged_decode_attention`` with a ``ScoreUpdate``, the
op kvmodels' decode runs, on the held keys gathered into one page), and moved with the tokens an eviction
keeps. Keyformer's Gumbel noise is the one kvmodels' cache draws for the first sequence of a batch with the
same seeds (:func:`request_noise_seed`): the prompt's from ``prefill_seed(noise_seed, layer, 0)``, decode step
``s``'s from ``decode_keys(noise_seed, s, ...)[layer, 0]``, its temperature from the request's
``max_tokens``; so a request's noise depends on the policy's seed, the layer, the step and the slot only.

``kept`` and ``stored`` come from ``ComposedPolicy.plan`` (:func:`kvpolicies.vllm.config.kept_lengths`), as
on the scheduler side. Only in-process state is kept here, per worker process: with chunked prefill, the
observation-window queries of earlier chunks (``_WINDOW_QUERIES``) until the compaction uses them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from ..base import NewTokens
from ..compose import ComposedPolicy
from .config import decode_scores, kept_lengths, policy_from_env, query_window, request_policy, step_pieces

#: The model runner of this worker process (set when it is built; the builder reads its batch's requests).
_RUNNER: Any = None


#: With ``KVPOLICIES_VLLM_RECORD_KEPT=1`` (tests), each compaction's kept positions ``[Hkv, kept]`` by
#: ``(request id, layer name)``.
#: Queries of a prompt's observation window that arrived in earlier prefill chunks (chunked prefill), by
#: ``(request id, layer name)``: ``(first position, [n, Hq, D])`` pieces, used up by the compaction.
_WINDOW_QUERIES: dict[tuple[str, str], list[tuple[int, torch.Tensor]]] = {}

#: Per-slot scores ``[Hkv, stored]`` float32 of each request's held slots, by ``(request id, layer name)``,
#: for a policy that scores decode steps (``config.decode_scores``).
_SCORES: dict[tuple[str, str], torch.Tensor] = {}

RECORD_KEPT = os.environ.get("KVPOLICIES_VLLM_RECORD_KEPT", "") == "1"
KEPT: dict[tuple[str, str], torch.Tensor] = {}


@dataclass(frozen=True)
class Compaction:
    """One request whose prompt completes in this step: compress it in every layer after its attention.

    ``start``: its first query row in the step's batch; ``computed``: tokens cached before the step;
    ``total``: after it; ``blocks``: its block ids ``[n]`` int64; ``policy``: the request's (the builder
    sets it; the functions below take the policy as an argument)."""

    request: str
    start: int
    computed: int
    total: int
    prompt_len: int
    kept: int
    n_sink: int
    n_recent: int
    blocks: torch.Tensor
    policy: ComposedPolicy | None = None


@dataclass(frozen=True)
class Eviction:
    """One decode-time eviction of one request, run in every layer after the attention of the tokens that
    precede it: of the request's first ``held`` slots (in its ``blocks``), keep ``budget`` (the first
    ``n_sink``, the last ``n_recent``, then the top scores of a scoring rule, in order) at slots
    ``[0, budget)``; the ``pending`` slots after them (tokens of this step that come later) follow.
    ``policy``: the request's (the builder sets it)."""

    request: str
    blocks: torch.Tensor
    held: int
    budget: int
    n_sink: int
    n_recent: int
    pending: int
    policy: ComposedPolicy | None = None


@dataclass(frozen=True)
class Scored:
    """The decode-time score update of one piece of a request's tokens past its prompt: query rows
    ``[row, row + count)`` of the step's batch, whose tokens sit at slots ``[stored, stored + count)`` (in
    ``blocks``) after the ``stored`` held ones; row ``i`` sees slots ``[0, stored + i]`` and is decode step
    ``step + i`` of a generation of ``max_new`` tokens (Keyformer's noise and temperature). ``policy``:
    the request's (the builder sets it)."""

    request: str
    blocks: torch.Tensor
    row: int
    count: int
    stored: int
    step: int = 0
    max_new: int = 1
    policy: ComposedPolicy | None = None


@dataclass(frozen=True)
class Round:
    """One round of a step's decode-time work, after the batch's attention: a second attention for some
    requests' tokens (``redo``: their query rows ``[n]`` and the metadata of an attention over each one's
    held slots, replacing the first outputs), the score updates of their pieces (``scored``), then
    ``evictions``."""

    redo: tuple[torch.Tensor, Any] | None
    evictions: list[Eviction]
    scored: list[Scored] = dataclasses.field(default_factory=list)


class CompressingMetadataBuilder(CPUAttentionMetadataBuilder):
    """``CPU_ATTN``'s builder, plus: a request past its prompt reads its ``stored(c) + q`` held slots
    (``KeptLengths``) and writes its new tokens after them; requests whose prompt completes in this step are
    listed for compaction (``metadata.kvp_compactions``); decode-time evictions and the second attention of
    tokens that must see fewer slots than the batch's pass gave them are listed as rounds
    (``metadata.kvp_rounds``); and block-table rows are cut to the blocks the scheduler keeps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.policy: ComposedPolicy | None = policy_from_env()  # the server's; a request may name its own
        if self.policy is not None and self.kv_cache_dtype != "auto":
            raise ValueError(f"kvpolicies vLLM plugin: kv_cache_dtype={self.kv_cache_dtype!r} is not "
                             "supported yet (compaction moves tokens of an unquantized cache); use 'auto'")

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        cm = common_attn_metadata
        runner = _RUNNER
        batch = getattr(runner, "input_batch", None)
        n = cm.num_reqs
        if self.policy is None or batch is None or len(batch.req_ids) < n or n == 0:
            return super().build(common_prefix_len, cm, fast_build)  # warm-up and dummy runs
        live = getattr(runner, "requests", {})
        for held_state in (_WINDOW_QUERIES, _SCORES):
            for key in [k for k in held_state if k[0] not in live]:
                del held_state[key]
        bs = self.block_size
        qsl = cm.query_start_loc_cpu.tolist()
        held = batch.block_table[0].num_blocks_per_row
        table, seq_lens, slots = cm.block_table_tensor, cm.seq_lens, cm.slot_mapping
        new_lens: torch.Tensor | None = None
        new_slots: torch.Tensor | None = None
        jobs: list[Compaction] = []
        stash: list[tuple[str, int, int, int]] = []  # (request, first row, first position, rows)
        cuts: list[tuple[int, str, int]] = []  # (row, request, blocks kept after this step)
        # Per round k: requests' k-th pieces of tokens past the prompt that need a second attention
        # (first row, rows, held slots before them, blocks), and evictions after their k-th pieces.
        redo: list[list[tuple[int, int, int, torch.Tensor]]] = []
        evictions: list[list[Eviction]] = []
        scored: list[list[Scored]] = []
        for r in range(n):
            rid = batch.req_ids[r]
            policy = request_policy(getattr(live.get(rid), "sampling_params", None), self.policy)
            if policy is None:
                continue
            L, c = int(batch.num_prompt_tokens[r]), int(batch.num_computed_tokens_cpu[r])
            q = qsl[r + 1] - qsl[r]
            if c + q < L:  # a prompt chunk: keep its window queries
                if policy.eviction.prefill_mode is not None:
                    if c == 0:  # (re)starting: drop what a preempted run left
                        for key in [k for k in _WINDOW_QUERIES if k[0] == rid]:
                            del _WINDOW_QUERIES[key]
                    first = max(c, L - query_window(policy, L))
                    if c + q > first:
                        stash.append((rid, qsl[r] + first - c, first, c + q - first))
                continue
            lengths = kept_lengths(policy, L)
            scoring = decode_scores(policy)
            end = c + q
            blocks = table[r, :int(held[r])].to(torch.int64).clone()
            compacting = c < L and lengths.kept < L
            if c >= L and (d := lengths.dropped(c)):  # the held slots, then this step's tokens
                if new_lens is None or new_slots is None:
                    new_lens, new_slots = seq_lens.clone(), slots.clone()
                new_lens[r] -= d
                pos = cm.positions[qsl[r]:qsl[r + 1]].to(torch.int64) - d  # logical slots
                new_slots[qsl[r]:qsl[r + 1]] = (blocks[pos // bs] * bs + pos % bs).to(slots.dtype)
            if compacting or (c < L and scoring):  # a scoring policy scores a prompt kept whole too
                jobs.append(Compaction(rid, qsl[r], c, end, L, lengths.kept, lengths.n_sink,
                                       lengths.n_recent, blocks, policy))
            for k, piece in enumerate(step_pieces(lengths, c, q)):
                while len(redo) <= k:
                    redo.append([])
                    evictions.append([])
                    scored.append([])
                if scoring:
                    scored[k].append(Scored(rid, blocks, qsl[r] + piece.start - c, piece.end - piece.start,
                                            piece.stored, piece.start - L, _max_tokens(live.get(rid)),
                                            policy))
                if piece.redo:
                    redo[k].append((qsl[r] + piece.start - c, piece.end - piece.start, piece.stored, blocks))
                if piece.evicted:
                    evictions[k].append(Eviction(rid, blocks, piece.stored + piece.end - piece.start,
                                                 lengths.budget, lengths.dec_sink, lengths.dec_recent,
                                                 piece.pending, policy))
            keep = cdiv(lengths.stored(end), bs)
            if keep < int(held[r]):
                cuts.append((r, rid, keep))
        new_table: torch.Tensor | None = None
        if cuts:
            # This step still reads the held blocks; from the next one on the request's row holds only the
            # blocks the scheduler keeps (it frees the rest when it next schedules the request), so new
            # blocks are appended right after them and the row never outgrows cdiv(max_model_len, bs).
            new_table = table.clone()  # ``table`` is a view of the batch's block table on CPU
            for r, rid, keep in cuts:
                cut_block_table_row(runner, r, rid, keep)
        rounds = [Round(self._redo_metadata(cm, parts, fast_build), evs, sc)
                  for parts, evs, sc in zip(redo, evictions, scored)]
        if new_table is not None or new_lens is not None:
            cm = dataclasses.replace(cm, block_table_tensor=table if new_table is None else new_table,
                                     seq_lens=seq_lens if new_lens is None else new_lens,
                                     slot_mapping=slots if new_slots is None else new_slots)
        meta = super().build(common_prefix_len, cm, fast_build)
        meta.kvp_compactions = jobs
        meta.kvp_window_queries = stash
        meta.kvp_slot_mapping = new_slots
        meta.kvp_rounds = [rd for rd in rounds if rd.redo is not None or rd.evictions or rd.scored]
        return meta

    def _redo_metadata(self, cm: Any, parts: list[tuple[int, int, int, torch.Tensor]],
                       fast_build: bool) -> tuple[torch.Tensor, Any] | None:
        """For pieces of tokens past a prompt ``(first row, rows, held slots before them, blocks)``: their
        query rows ``[n]`` and the metadata of an attention over each one's held slots and themselves
        (causal), whose outputs replace the batch's pass's. That pass gave them the whole prompt (a
        preempted request recomputing its generated tokens in the step that compresses its prompt) or the
        tokens a later eviction drops (several decode steps recomputed in one step); the second attention
        gives them what an uninterrupted decode gives them."""
        if not parts:
            return None
        rows, starts, lens, table_rows = [], [0], [], []
        width = cm.block_table_tensor.shape[1]
        for first, count, stored, blocks in parts:
            rows.append(torch.arange(first, first + count))
            starts.append(starts[-1] + count)
            lens.append(stored + count)
            row = torch.zeros(width, dtype=cm.block_table_tensor.dtype)
            row[:blocks.numel()] = blocks.to(row.dtype)
            table_rows.append(row)
        idx = torch.cat(rows)
        qsl = torch.tensor(starts, dtype=cm.query_start_loc.dtype)
        sub = dataclasses.replace(
            cm, query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
            seq_lens=torch.tensor(lens, dtype=cm.seq_lens.dtype), num_reqs=len(parts),
            num_actual_tokens=idx.numel(), max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
            max_seq_len=max(lens), block_table_tensor=torch.stack(table_rows),
            slot_mapping=cm.slot_mapping[idx], positions=None if cm.positions is None else cm.positions[idx])
        return idx, super().build(0, sub, fast_build)


def cut_block_table_row(runner: Any, r: int, request: str, keep: int) -> None:
    """Cut the worker's record of ``request``'s blocks (row ``r`` of the batch's block table, and the
    runner's per-request list it is rebuilt from when the request rejoins the batch) to its first ``keep``
    blocks: the ones the scheduler keeps after compaction."""
    bt = runner.input_batch.block_table[0]
    held = int(bt.num_blocks_per_row[r])
    if held > keep:
        bt.block_table.np[r, keep:held] = 0
        bt.num_blocks_per_row[r] = keep
    state = runner.requests.get(request)
    if state is not None and state.block_ids and len(state.block_ids[0]) > keep:
        state.block_ids = (list(state.block_ids[0][:keep]), *state.block_ids[1:])


class CompressingImpl(CPUAttentionBackendImpl):
    """``CPU_ATTN``'s attention; new tokens go to the builder's remapped slots, and after the attention of a
    step in which a request's prompt completes, this layer's copy of that prompt is compressed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        window = getattr(self, "sliding_window", -1)
        if window not in (-1, None) and policy_from_env() is not None:  # (unset: the plugin does nothing)
            raise ValueError(
                f"kvpolicies vLLM plugin: this model has sliding-window attention layers (window {window}), "
                "which vLLM masks by slot and its hybrid cache manager sizes by position, and compaction "
                "moves tokens between slots; not supported yet. Unset KVPOLICIES_VLLM_POLICY to serve it "
                "without the plugin, or run it on kvmodels (kvmodels.hf.wrap_transformers keeps its windows)")

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        meta = _metadata_of(layer)
        remapped = getattr(meta, "kvp_slot_mapping", None)
        if remapped is not None:
            slot_mapping = remapped[: slot_mapping.shape[0]]
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        for rid, row, first, n in getattr(attn_metadata, "kvp_window_queries", ()):
            piece = query[row:row + n].clone()  # [n, Hq, D]
            _WINDOW_QUERIES.setdefault((rid, layer.layer_name), []).append((first, piece))
        for job in getattr(attn_metadata, "kvp_compactions", ()):
            policy = job.policy
            assert policy is not None  # the builder names every listed request's policy
            held_key = (job.request, layer.layer_name)
            earlier = _WINDOW_QUERIES.pop(held_key, [])
            kept, scores = compact(policy, job, query, kv_cache, self.scale, layer.isa, earlier,
                                   layer=_layer_index(layer.layer_name))
            if decode_scores(policy):
                _SCORES[held_key] = scores
            if RECORD_KEPT and job.kept < job.prompt_len:
                KEPT[held_key] = kept
        for rd in getattr(attn_metadata, "kvp_rounds", ()):
            if rd.redo is not None:  # tokens that must attend to the held slots only: attend again
                idx, meta = rd.redo
                again = output.new_empty((idx.numel(), *output.shape[1:]))
                super().forward(layer, query[idx].contiguous(), key[idx].contiguous(),
                                value[idx].contiguous(), kv_cache, meta, again, *args, **kwargs)
                output[idx] = again
            # One score update and one eviction per policy for all its requests (a request may name its
            # own policy in its SamplingParams, so a batch can hold several).
            for policy, pieces, evictions in _by_policy(rd.scored, rd.evictions):
                keys = [(p.request, layer.layer_name) for p in pieces]
                held = [_held_scores(key, p.stored) for key, p in zip(keys, pieces)]
                _SCORES.update(zip(keys, score_pieces(policy, pieces, held, query, kv_cache, self.scale,
                                                      layer.isa, _layer_index(layer.layer_name))))
                keys = [(e.request, layer.layer_name) for e in evictions]
                held_scores = ([_held_scores(key, e.held) for key, e in zip(keys, evictions)]
                               if decode_scores(policy) else None)
                # one selection for all
                kept_scores = evict_many(policy, evictions, kv_cache, layer.isa, held_scores)
                if kept_scores is not None:
                    _SCORES.update(zip(keys, kept_scores))
        return out


def _by_policy(pieces: list[Scored], evictions: list[Eviction]
               ) -> list[tuple[ComposedPolicy, list[Scored], list[Eviction]]]:
    """A round's score updates and evictions grouped by their requests' policy, in first-seen order."""
    groups: dict[int, tuple[ComposedPolicy, list[Scored], list[Eviction]]] = {}

    def group(policy: ComposedPolicy | None) -> tuple[ComposedPolicy, list[Scored], list[Eviction]]:
        assert policy is not None  # the builder names every listed request's policy
        return groups.setdefault(id(policy), (policy, [], []))

    for piece in pieces:
        group(piece.policy)[1].append(piece)
    for eviction in evictions:
        group(eviction.policy)[2].append(eviction)
    return list(groups.values())


@cache
def _layer_index(layer_name: str) -> int:
    """The model's layer index of an attention layer's name (``model.layers.3.self_attn.attn`` -> 3): the
    layer kvmodels' noise seeds are drawn for (read once per layer, not every step)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


def _max_tokens(state: Any) -> int:
    """The generation length a request asked for (``SamplingParams.max_tokens``; 1 when unknown): the length
    Keyformer's temperature schedule rises over."""
    params = getattr(state, "sampling_params", None)
    return max(1, int(getattr(params, "max_tokens", None) or 1))


def request_noise_seed(policy: ComposedPolicy) -> int:
    """The Gumbel noise seed of every request: kvmodels' cache's ``noise_seed(policy.seed, 0)`` (a cache or
    generation seed of 0)."""
    from kvkernels import noise_seed

    return noise_seed(policy.seed, 0)


def _held_scores(key: tuple[str, str], held: int) -> torch.Tensor:
    """The scores ``[Hkv, held]`` of a request's ``held`` slots in one layer, checked: the worker must have
    seen every step of the request since its prompt's compaction."""
    scores = _SCORES.get(key)
    if scores is None or scores.shape[1] != held:
        have = None if scores is None else scores.shape[1]
        raise RuntimeError(f"kvpolicies vLLM plugin: request {key[0]!r} layer {key[1]!r} holds {held} slots "
                           f"but its decode-time scores cover {have} (a step of the request was not seen)")
    return scores


class CompressingCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with prompt compression (registered in its place by the plugin)."""

    @staticmethod
    def get_impl_cls() -> type[CompressingImpl]:
        return CompressingImpl

    @staticmethod
    def get_builder_cls() -> type[CompressingMetadataBuilder]:
        return CompressingMetadataBuilder


def _metadata_of(layer: Any) -> Any:
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):
        meta = meta[0]
    if isinstance(meta, dict):
        return meta.get(getattr(layer, "layer_name", None))
    return meta


def prompt_scores(policy: ComposedPolicy, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None,
                  scale: float, seed: int = 0) -> torch.Tensor:
    """``[Hkv, L]`` float32 scores of a prompt's keys ``k`` / values ``v`` ``[L, Hkv, D]``, ranked as the
    caches rank them: an open rule's ``token_scores``, or the queries ``q [L, Hq, D]`` (rows before the
    policy's window may be zeros: only the last ``prefill_window(L)`` are read) through
    ``kvkernels.prefill_scores`` and the policy's ``postprocess_prefill_scores``; zeros when the selection
    needs no scores. ``seed``: the prompt's noise seed (Keyformer)."""

    ev = policy.eviction
    L, H = k.shape[0], k.shape[1]
    if ev.scores_tokens:
        new = NewTokens(k=k, v=v, positions=torch.arange(L))
        return ev.token_scores(new).to(torch.float32).transpose(0, 1).contiguous()
    if ev.prefill_mode is not None:
        assert q is not None
        return ev.prompt_scores(q.contiguous(), k.contiguous(), scale=scale, seed=seed).to(torch.float32)
    return torch.zeros(H, L, dtype=torch.float32)


def select(k: torch.Tensor, v: torch.Tensor, scores: torch.Tensor, kept: int, n_sink: int,
           n_recent: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``kept`` tokens each KV head keeps of ``k`` / ``v`` ``[L, Hkv, D]`` by ``scores [Hkv, L]``, in
    original order, bit-identical: ``kvkernels.topk_compact`` (forced ``n_sink`` first and ``n_recent`` last
    tokens, then the top scores, ties to the earlier token) with each KV head a one-page sequence.
    Returns ``[kept, Hkv, D]`` keys and values and ``[Hkv, kept]`` int64 their positions (indices in
    ``k``)."""
    import kvkernels

    L, H, D = k.shape

    def pool(x: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, L, 1, ...], a copy the op may rewrite
        return x.transpose(0, 1).unsqueeze(2).contiguous()

    kp, vp = pool(k), pool(v)
    pos = pool(torch.arange(L, dtype=torch.int32)[:, None].expand(L, H))  # [H, L, 1]
    score = scores.to(torch.float32).reshape(H, L, 1).clone()  # the op compacts it: not the caller's
    per_head = lambda x: torch.full((H,), x, dtype=torch.int32)  # noqa: E731
    table = torch.arange(H, dtype=torch.int32)[:, None]  # KV head h is page h
    free = torch.zeros(H + 1, dtype=torch.int32)
    kvkernels.topk_compact(kp, vp, pos, score, table, per_head(L), per_head(kept), per_head(n_sink),
                           per_head(n_recent), free, torch.zeros(1, dtype=torch.int64))
    return kp[:, :kept, 0].transpose(0, 1), vp[:, :kept, 0].transpose(0, 1), pos[:, :kept, 0].to(torch.int64)


@lru_cache(maxsize=8)
def slot_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> torch.Tensor:
    """Where the CPU kernels store a token's key and value inside a block: ``[2, block_size, head_size]``
    int64 offsets into one (block, KV head)'s ``2 * block_size * head_size`` elements (0: keys, 1: values).

    The layout depends on the kernel's ISA (``vec`` keeps keys dimension-major, ``[D, bs]``, and values
    ``[bs, D]``; ``amx`` packs pairs), so it is measured once: ``cpu_attn_reshape_and_cache`` writes probes
    holding each element's slot, then its dimension (small integers, exact in any float dtype), into one
    block, and the offsets are read back.
    """
    from vllm import _custom_ops as ops

    bs, D = block_size, head_size
    found = []
    for probe in (torch.arange(bs)[:, None].expand(bs, D), torch.arange(D)[None, :].expand(bs, D)):
        kv = torch.full((1, 1, bs, 2 * D), -1.0, dtype=dtype)
        k_cache, v_cache = kv.view(1, 1, 2 * bs, D).chunk(2, dim=2)
        x = probe.to(dtype)[:, None, :].contiguous()  # [bs, 1, D]: token t, KV head 0
        ops.cpu_attn_reshape_and_cache(x, x.clone(), k_cache, v_cache, torch.arange(bs), isa, k_scale=1.0,
                                       v_scale=1.0, kv_cache_dtype="auto")
        found.append(kv.reshape(2, bs * D).to(torch.int64))  # [keys | values] of the block, flattened
    slot, dim = found
    offsets = torch.full((2, bs, D), -1, dtype=torch.int64)
    for part in range(2):
        offsets[part, slot[part], dim[part]] = torch.arange(bs * D)
    if bool((offsets < 0).any()):
        raise NotImplementedError(f"kvpolicies vLLM plugin: the CPU attention ISA {isa!r} does not store "
                                  f"one element per (slot, dim) in a block ({dtype}); cannot move tokens")
    return offsets


@lru_cache(maxsize=8)
def slot_strides(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> tuple[tuple[int, int, int],
                                                                                         ...] | None:
    """``(offset, slot stride, dim stride)`` of the keys and of the values inside one (block, KV head) when
    :func:`slot_layout` is affine in (slot, dim) (``vec``: keys ``[D, bs]``, values ``[bs, D]``), else None
    (then tokens move through an element index)."""
    offsets = slot_layout(isa, dtype, block_size, head_size)
    found = []
    for part in range(2):
        o = offsets[part]
        base = int(o[0, 0])
        ss = int(o[1, 0]) - base if block_size > 1 else 0
        sd = int(o[0, 1]) - base if head_size > 1 else 0
        want = base + torch.arange(block_size)[:, None] * ss + torch.arange(head_size)[None, :] * sd
        if not torch.equal(o, want):
            return None
        found.append((base, ss, sd))
    return tuple(found)


def _part_view(kv_cache: torch.Tensor, isa: str, part: int) -> torch.Tensor | None:
    """The keys (``part`` 0) or values (1) of ``kv_cache [num_blocks, Hkv, bs, 2 * D]`` as a ``[num_blocks,
    Hkv, bs, D]`` view, when the ISA's layout is affine (:func:`slot_strides`)."""
    nb, H, bs, two_d = kv_cache.shape
    strides = slot_strides(isa, kv_cache.dtype, bs, two_d // 2)
    if strides is None:
        return None
    base, ss, sd = strides[part]
    return kv_cache.as_strided((nb, H, bs, two_d // 2), (H * bs * two_d, bs * two_d, ss, sd),
                               kv_cache.storage_offset() + part * bs * (two_d // 2) + base)


def _element_index(kv_cache: torch.Tensor, isa: str, part: int, block: torch.Tensor, head: torch.Tensor,
                   slot: torch.Tensor) -> torch.Tensor:
    """The ``[*shape, D]`` positions in ``kv_cache.view(-1)`` of (block, head, slot in block) triples of one
    broadcast ``shape``: the path for a layout that is not affine."""
    _, H, bs, two_d = kv_cache.shape
    D = two_d // 2
    offsets = slot_layout(isa, kv_cache.dtype, bs, D)  # [2, bs, D] within one (block, head)
    return ((block * H + head) * (2 * bs * D) + part * bs * D)[..., None] + offsets[part, slot]


def read_slots(kv_cache: torch.Tensor, isa: str, part: int, block: torch.Tensor, head: torch.Tensor,
               slot: torch.Tensor) -> torch.Tensor:
    """The keys (``part`` 0) or values (1) at (block, KV head, slot in block) triples (index tensors of one
    broadcast shape), ``[*shape, D]``, a copy."""
    view = _part_view(kv_cache, isa, part)
    if view is not None:
        return view[block, head, slot]
    return kv_cache.view(-1)[_element_index(kv_cache, isa, part, block, head, slot)]


def write_slots(kv_cache: torch.Tensor, isa: str, part: int, block: torch.Tensor, head: torch.Tensor,
                slot: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values [*shape, D]`` to the keys (``part`` 0) or values (1) at (block, KV head, slot in
    block) triples, in place."""
    view = _part_view(kv_cache, isa, part)
    if view is not None:
        view[block, head, slot] = values
    else:
        kv_cache.view(-1)[_element_index(kv_cache, isa, part, block, head, slot)] = values


def request_slots(kv_cache: torch.Tensor, requests: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Several requests' slots, ``(blocks, slots [T])`` each (slot ``j``: slot ``j % bs`` of block
    ``blocks[j // bs]``), one request after the other, as the (block ``[sum T, 1]``, KV head ``[1, Hkv]``,
    slot in block ``[sum T, 1]``) triples of :func:`read_slots` for all heads: ``[sum T, Hkv, D]``."""
    bs = kv_cache.shape[2]
    slots = torch.cat([s for _, s in requests])
    block = torch.cat([b[s // bs] for b, s in requests])
    return block[:, None], torch.arange(kv_cache.shape[1])[None, :], (slots % bs)[:, None]


def read_requests(kv_cache: torch.Tensor, isa: str, part: int,
                  requests: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The keys (``part`` 0) or values (1) of several requests' slots (:func:`request_slots`), ``[sum T,
    Hkv, D]``: one gather for all of them."""
    return read_slots(kv_cache, isa, part, *request_slots(kv_cache, requests))


def write_requests(kv_cache: torch.Tensor, isa: str, part: int,
                   requests: list[tuple[torch.Tensor, torch.Tensor]], values: torch.Tensor) -> None:
    """Write ``values [sum T, Hkv, D]`` to several requests' slots (:func:`request_slots`): one scatter."""
    write_slots(kv_cache, isa, part, *request_slots(kv_cache, requests), values)


def compact(policy: ComposedPolicy, job: Compaction, query: torch.Tensor, kv_cache: torch.Tensor,
            scale: float, isa: str, earlier: list[tuple[int, torch.Tensor]] | None = None, *,
            layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress one request's prompt in one layer's ``kv_cache [num_blocks, Hkv, bs, 2 * D]`` in place:
    its kept tokens to slots ``[0, kept)``, the tokens after the prompt (if any) right behind them (a
    prompt kept whole, ``kept == prompt_len``, is only scored). ``query``: the step's queries ``[tokens, Hq,
    D]``; ``earlier``: ``(first position, [n, Hq, D])`` window queries of earlier prefill chunks; ``layer``:
    the model's layer index (Keyformer's noise seed, :func:`request_noise_seed`). Returns
    the kept positions ``[Hkv, kept]`` int64 and the kept tokens' scores ``[Hkv, kept]`` float32."""
    held = [(job.blocks, torch.arange(job.total))]
    k, v = read_requests(kv_cache, isa, 0, held), read_requests(kv_cache, isa, 1, held)  # [total, H, D]
    L = job.prompt_len
    q = None
    if policy.eviction.prefill_mode is not None:
        first = L - query_window(policy, L)  # only rows [first, L) are read
        q = query.new_zeros(L, query.shape[1], query.shape[2])
        seen = torch.zeros(L, dtype=torch.bool)
        for pos, piece in earlier or []:
            q[pos:pos + piece.shape[0]] = piece
            seen[pos:pos + piece.shape[0]] = True
        q[job.computed:L] = query[job.start: job.start + L - job.computed]
        seen[job.computed:L] = True
        if not bool(seen[first:].all()):
            raise RuntimeError(f"kvpolicies vLLM plugin: request {job.request!r} lacks queries of its "
                               f"observation window [{first}, {L}) (a prefill chunk was not seen)")
    from kvkernels import prefill_seed

    seed = prefill_seed(request_noise_seed(policy), layer, 0)
    scores = prompt_scores(policy, k[:L], v[:L], q, scale, seed=seed)
    if job.kept >= L:
        return torch.arange(L).expand(scores.shape[0], L), scores
    kk, vk, positions = select(k[:L], v[:L], scores, job.kept, job.n_sink, job.n_recent)
    new_k, new_v = torch.cat([kk, k[L:]]), torch.cat([vk, v[L:]])
    dest = [(job.blocks, torch.arange(new_k.shape[0]))]
    write_requests(kv_cache, isa, 0, dest, new_k)
    write_requests(kv_cache, isa, 1, dest, new_v)
    return positions, scores.gather(1, positions)


def score_pieces(policy: ComposedPolicy, pieces: list[Scored], scores: list[torch.Tensor],
                 query: torch.Tensor, kv_cache: torch.Tensor, scale: float, isa: str,
                 layer: int = 0) -> list[torch.Tensor]:
    """The decode-time score updates of pieces of requests' tokens in one layer: each piece's ``stored``
    held slots' scores (``scores``, ``[Hkv, stored]`` each), extended with 0 for its ``count`` tokens, then
    updated by each of their queries (rows of ``query [tokens, Hq, D]``) in order, over the slots it sees,
    by the policy's ``score_mode``: ``kvkernels.paged_decode_attention`` with a ``ScoreUpdate``, the op the
    kvmodels caches decode with, with the policy's ``decode_kwargs`` of each row's decode step and, for
    Keyformer, that step's noise keys of model layer ``layer`` (:func:`request_noise_seed`). Every request's
    keys are gathered once into one pool of one-slot pages, each request's row of the page table listing
    its slots, so one call updates the ``i``-th rows of all pieces (one call per temperature for Keyformer,
    whose requests are at different steps); the op's output is not used (vLLM's kernel gave the step's),
    so the keys stand in for the values. Returns the ``[Hkv, stored + count]`` scores of each piece."""
    import kvkernels
    from kvkernels.paged_attention import ScoreUpdate

    if not pieces:
        return []
    ends = [p.stored + p.count for p in pieces]
    k = read_requests(kv_cache, isa, 0, [(p.blocks, torch.arange(n)) for p, n in zip(pieces, ends)])
    k = k[:, None]  # [sum(ends), 1, H, D]: one-slot pages
    first = [0]
    for n in ends:
        first.append(first[-1] + n)
    pool = torch.cat([torch.cat([sc, sc.new_zeros(sc.shape[0], p.count)], dim=1).t()
                      for sc, p in zip(scores, pieces)]).contiguous()[:, None]  # [sum(ends), 1, H] float32
    ev = policy.eviction
    gumbel = ev.score_mode == "gumbel"
    for i in range(max(p.count for p in pieces)):
        groups: dict[tuple[float, float], list[int]] = {}  # (temperature, decay) -> pieces with an i-th row
        for j, p in enumerate(pieces):
            if i < p.count:
                kw = ev.decode_kwargs(p.step + i, p.max_new)
                group = (float(kw.get("temperature", 1.0)), float(kw.get("decay", 1.0)))
                groups.setdefault(group, []).append(j)
        for (temperature, decay), rows in groups.items():
            lens = [pieces[j].stored + i + 1 for j in rows]
            # Row r lists its piece's one-slot pages; past its length, pages the op never reads (clamped).
            table = (torch.tensor([first[j] for j in rows])[:, None] + torch.arange(max(lens))[None, :])
            table = table.clamp(max=first[-1] - 1).to(torch.int32)
            q = query[[pieces[j].row + i for j in rows]].to(k.dtype).contiguous()  # [rows, Hq, D]
            key = temp = None
            if gumbel:  # kvmodels' keys of each row's step, this layer, a batch's first row: [rows, Hq]
                seed, Hq = request_noise_seed(policy), q.shape[1]
                key = torch.cat([kvkernels.decode_keys(seed, pieces[j].step + i, layer + 1, 1, Hq)[layer]
                                 for j in rows])
                temp = torch.tensor([temperature], dtype=torch.float32)
            update = ScoreUpdate(pool, ev.score_mode, decay, key, temp)
            kvkernels.paged_decode_attention(q, k, k, table, torch.tensor(lens, dtype=torch.int32),
                                             scale=scale, scores=update)
    return [pool[a:b, 0].t().contiguous() for a, b in zip(first, first[1:])]


def _move_slots(kv_cache: torch.Tensor, isa: str,
                moves: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """For requests' ``(blocks, slots, shift)``: the keys and values at ``slots`` move ``shift`` slots down
    (read before any is written, so the ranges may overlap), one gather and one scatter for all."""
    if not moves:
        return
    src = [(blocks, slots) for blocks, slots, _ in moves]
    dst = [(blocks, slots - shift) for blocks, slots, shift in moves]
    for part in range(2):
        write_requests(kv_cache, isa, part, dst, read_requests(kv_cache, isa, part, src))


def evict_many(policy: ComposedPolicy, evs: list[Eviction], kv_cache: torch.Tensor, isa: str,
               scores: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
    """The decode-time evictions of several requests in one layer's ``kv_cache``, in place: of each one's
    ``held`` slots keep ``budget`` at slots ``[0, budget)`` in order (its first ``n_sink``, its last
    ``n_recent``, then the top scores, ties to the earlier slot), its ``pending`` slots (later tokens of its
    step) right behind. Ranked by the held slots' ``scores`` (``[Hkv, held]`` each) for a policy that scores
    decode steps (their mean over the KV heads where the heads share one selection: ``eviction_scores``,
    which they keep, as kvmodels' caches do), by an open score rule's ``token_scores`` of the held keys and
    values (``knorm``: they are gathered for it), or by nothing (``streaming``, ``window``: every kept slot
    forced, so the recent slots of every request shift down in one gather and one scatter). Otherwise one
    ``kvkernels.compaction_plan`` (``topk_compact``'s selection) ranks every (request, KV head) at once and
    only the (slot, head) rows whose token changes are moved, in one gather and one scatter, bit for bit.
    Returns each request's kept scores ``[Hkv, budget]`` (None without ``scores``)."""
    import kvkernels

    if not evs:
        return [] if scores is not None else None
    if scores is None and not policy.eviction.scores_tokens and all(e.n_sink + e.n_recent >= e.budget
                                                                     for e in evs):
        # Every kept slot forced (streaming, window): the last n_recent held slots and the pending ones
        # shift down over the evicted ones, in one gather and one scatter; nothing else moves.
        _move_slots(kv_cache, isa, [(e.blocks, torch.arange(e.held - e.n_recent, e.held + e.pending),
                                     e.held - e.n_recent - e.n_sink) for e in evs])
        return None
    H, M = kv_cache.shape[1], max(e.held for e in evs)
    first = torch.tensor([0] + [e.held for e in evs]).cumsum(0)
    ranks = None
    if scores is not None:
        ranks = [policy.eviction.eviction_scores(sc, head_dim=0).contiguous() for sc in scores]
        rank = torch.cat(ranks, dim=1)  # [H, sum(held)]
    elif policy.eviction.scores_tokens:
        held = [(e.blocks, torch.arange(e.held)) for e in evs]
        k = read_requests(kv_cache, isa, 0, held)  # [sum(held), H, D]
        v = read_requests(kv_cache, isa, 1, held)
        rank = torch.cat([prompt_scores(policy, k[a:b], v[a:b], None, 0.0)
                          for a, b in zip(first.tolist(), first[1:].tolist())], dim=1)
    else:
        rank = torch.zeros(H, int(first[-1]))
    # Request b's slot j is column first[b] + j; past its held slots the columns are another request's,
    # never read (the plan ignores slots past each request's length).
    cols = (first[:-1, None] + torch.arange(M)[None, :]).clamp(max=rank.shape[1] - 1)  # [B, M]
    per_seq = [torch.tensor(x) for x in zip(*[(e.held, e.budget, e.n_sink, e.n_recent) for e in evs])]
    src, n_move = kvkernels.compaction_plan(rank[:, cols].transpose(0, 1), *per_seq)  # [B, H, M], [B]
    d = torch.arange(M)
    b, h, dst = ((d < n_move[:, None, None]) & (src != d)).nonzero(as_tuple=True)  # the rows that change
    if b.numel():
        table = torch.nn.utils.rnn.pad_sequence([e.blocks for e in evs], batch_first=True)  # [B, blocks]
        bs = kv_cache.shape[2]
        j = src[b, h, dst]
        for part in range(2):  # the sources are gathered before any destination is written
            write_slots(kv_cache, isa, part, table[b, dst // bs], h, dst % bs,
                        read_slots(kv_cache, isa, part, table[b, j // bs], h, j % bs))
    # A recomputed request's later tokens of this step, right behind its kept ones.
    _move_slots(kv_cache, isa, [(e.blocks, torch.arange(e.held, e.held + e.pending), e.held - e.budget)
                                for e in evs if e.pending])
    if ranks is None:
        return None
    return [r.gather(1, src[i, :, :e.budget]) for i, (r, e) in enumerate(zip(ranks, evs))]


def install() -> None:
    """Register :class:`CompressingCPUBackend` as ``CPU_ATTN`` and let the builder see the worker's batch."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.worker import cpu_model_runner

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.CompressingCPUBackend")
    runner_cls = cpu_model_runner.CPUModelRunner
    if getattr(runner_cls, "_kvpolicies_hooked", False):
        return
    init = runner_cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        global _RUNNER
        init(self, *args, **kwargs)
        _RUNNER = self

    runner_cls.__init__ = __init__
    runner_cls._kvpolicies_hooked = True
