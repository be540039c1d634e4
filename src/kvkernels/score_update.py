"""Prefill scorer: every prompt token's eviction score under one score mode (docs/contract.md §2.2-§2.3).

For one sequence, query row ``i`` gives key ``j <= i`` the contribution ``c[i, j]`` = mean over the ``G``
query heads of a KV group of the causal softmax row ``p[i, :i+1]`` (Gumbel-perturbed and tempered for
``gumbel``). Starting from zero, each processed row applies the mode's update to the keys it sees, in
order. Because every later row sees every earlier key, the row loop has closed forms:

* ``accumulate`` / ``gumbel``: ``score[j] = sum_i c[i, j]``;
* ``decay``: ``score[j] = sum_i decay**(L-1-i) * c[i, j]``;
* ``replace``: ``score[j] = c[L-1, j]`` (only the last row survives);
* ``count_low``: ``score[j] = -#{i >= j : c[i, j] < 1 / (i + 1)}``;
* ``none``: zeros.

Neither form ever holds an ``L x L`` matrix: the reference takes ``chunk`` query rows at a time
(``O(chunk * L)`` per head); the Triton kernels run two passes, (1) per (query head, query block) the
softmax row max and normaliser, (2) per (KV head, key block) a loop over query blocks and the heads of
the group that sums that key block's column contributions, so every output element has one owner and
no atomics are needed. Accumulation is float32 throughout.

The softmax normaliser of a row is what the model's own attention over the prompt computes anyway: a
flash kernel returns it as the row log-sum-exp. :func:`prefill_attention` runs that attention and hands
the log-sum-exp back; given as ``lse``, it spares the scorer its normaliser pass (the first Triton pass,
or the CPU path's full-row softmax), so probabilities come from one pass over key tiles that stay in cache.
For the column-sum modes :func:`prefill_attention_scores` goes one step further on CPU: the attention and the
scores share one computation of the probabilities, so no logit is computed twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvkernels._checks import FLOAT_DTYPES, check_choice, check_shape, check_tensor
from kvkernels._modes import SCORE_MODES
from kvkernels._noise import _as_int32, gumbel_noise_hash, seed_key
from kvkernels._triton import (
    HAS_TRITON,
    LOG2E,
    LOG2E_C,
    covering,
    launch,
    require_triton,
    tl,
    triton,
    use_triton,
)
from kvkernels.tuning import launch_config

if HAS_TRITON:
    from kvkernels._noise import gumbel_noise_tl, gumbel_weight_tl

    @triton.jit
    def _logit_tile(q, k, rows, keys, slopes_ptr, hq, L, scale, temperature, noise_key,
                    HAS_ALIBI: tl.constexpr, GUMBEL: tl.constexpr, UNIT_TEMP: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr):
        """Logits ``[BLOCK_Q, BLOCK_K]`` of query head ``hq``: ``-inf`` where the key is not visible.
        ``GUMBEL``: perturbed and tempered, ``(x + G) / temperature``; but with ``UNIT_TEMP``
        (temperature 1) the plain logits, the noise applied as a factor by :func:`_softmax_terms`."""
        x = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale
        if HAS_ALIBI:
            x += tl.load(slopes_ptr + hq) * (keys[None, :] - rows[:, None]).to(tl.float32)
        if GUMBEL and not UNIT_TEMP:
            x = (x + gumbel_noise_tl(noise_key, hq, rows[:, None], keys[None, :])) / temperature
        visible = (keys[None, :] <= rows[:, None]) & (rows[:, None] < L)
        return tl.where(visible, x, float("-inf"))

    @triton.jit
    def _softmax_terms(x, m, hq, rows, keys, noise_key, GUMBEL: tl.constexpr, UNIT_TEMP: tl.constexpr):
        """``exp(x - m)`` of :func:`_logit_tile`'s logits against the rows' max ``m`` (``[BLOCK_Q]``);
        ``GUMBEL`` at ``UNIT_TEMP``, times ``exp(G)`` (:func:`kvkernels._noise.gumbel_weight_tl`):
        ``exp(x + G - m)`` with one ``log`` per logit. ``m`` is then the plain logits' max, and the terms
        stay finite (``exp(G) <= 1 / -log(1 - 2**-24) < 2**25``)."""
        e = tl.exp2(x * LOG2E_C - (m * LOG2E_C)[:, None])  # one EX2, no range fix-up
        if GUMBEL and UNIT_TEMP:
            e = e * gumbel_weight_tl(noise_key, hq, rows[:, None], keys[None, :])
        return e

    @triton.jit
    def _row_stats_kernel(q_ptr, k_ptr, slopes_ptr, m_ptr, l_ptr,
                          L, first, n_rows, scale, temperature, noise_key,
                          stride_ql, stride_qh, stride_qd, stride_kl, stride_kh, stride_kd,
                          G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ALIBI: tl.constexpr,
                          GUMBEL: tl.constexpr, UNIT_TEMP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """Pass 1, one program per (query block, query head): softmax max ``m`` and normaliser ``l``
        (``GUMBEL`` at ``UNIT_TEMP``: the plain logits' max, the perturbed terms' sum)."""
        qb = tl.program_id(0)
        hq = tl.program_id(1)
        hkv = hq // G
        rows = first + qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
        d = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + rows[:, None] * stride_ql + hq * stride_qh + d[None, :] * stride_qd,
                    mask=(rows[:, None] < L) & (d[None, :] < D), other=0.0)
        # A finite start keeps exp(m_old - m_new) at 0, not NaN, for padding rows that see no key.
        m = tl.full([BLOCK_Q], -1e30, tl.float32)
        l = tl.zeros([BLOCK_Q], tl.float32)
        end = tl.minimum(first + (qb + 1) * BLOCK_Q, L)  # keys past the block's last row are invisible
        for k_start in range(0, end, BLOCK_K):
            keys = k_start + tl.arange(0, BLOCK_K)
            k = tl.load(k_ptr + keys[:, None] * stride_kl + hkv * stride_kh + d[None, :] * stride_kd,
                        mask=(keys[:, None] < L) & (d[None, :] < D), other=0.0)
            x = _logit_tile(q, k, rows, keys, slopes_ptr, hq, L, scale, temperature, noise_key,
                            HAS_ALIBI, GUMBEL, UNIT_TEMP, INPUT_PRECISION)
            m_new = tl.maximum(m, tl.max(x, 1))
            e = _softmax_terms(x, m_new, hq, rows, keys, noise_key, GUMBEL, UNIT_TEMP)
            l = l * tl.exp(m - m_new) + tl.sum(e, 1)
            m = m_new
        out = hq * n_rows + (rows - first)
        tl.store(m_ptr + out, m, mask=rows < L)
        tl.store(l_ptr + out, l, mask=rows < L)

    @triton.jit
    def _column_tile(q_ptr, k, rowb_ptr, slopes_ptr, rows, keys, d, hq, L, first, n_rows, scale, temperature,
                     noise_key, stride_ql, stride_qh, stride_qd, D: tl.constexpr, HAS_ALIBI: tl.constexpr,
                     GUMBEL: tl.constexpr, UNIT_TEMP: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                     CAUSAL: tl.constexpr):
        """``[BLOCK_Q, BLOCK_K]`` terms of query head ``hq``'s rows ``rows`` for the key tile ``k``: each
        probability (times the row's weight) as one ``exp2(x * scale * log2(e) - b)``, ``b`` the row's
        offset in base 2 (``rowb``: the softmax normaliser, ``log2(l) + m log2(e)``, less the decay's
        ``log2`` weight); 0 for rows past ``L`` (their ``b`` loads as ``+inf``). ``CAUSAL``: the tile holds
        keys after some of its rows (the first query tile of a key block), which are masked; the other
        tiles see every key, so they take no mask (the probabilities in one multiply-add and one
        ``exp2``, where :func:`_probabilities` takes a scale, a mask, a subtraction, an ``exp`` and a
        division)."""
        row_ok = rows < L
        q = tl.load(q_ptr + rows[:, None] * stride_ql + hq * stride_qh + d[None, :] * stride_qd,
                    mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        b = tl.load(rowb_ptr + hq * n_rows + (rows - first), mask=row_ok, other=float("inf"))
        if HAS_ALIBI or (GUMBEL and not UNIT_TEMP):  # logits in natural units first
            x = _logit_tile(q, k, rows, keys, slopes_ptr, hq, L, scale, temperature, noise_key, HAS_ALIBI,
                            GUMBEL, UNIT_TEMP, INPUT_PRECISION)
            x = x * LOG2E_C - b[:, None]
        else:
            x = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * (scale * LOG2E_C)
            x = x - b[:, None]
            if CAUSAL:
                x = tl.where(keys[None, :] <= rows[:, None], x, float("-inf"))
        e = tl.exp2(x)
        if GUMBEL and UNIT_TEMP:
            e = e * gumbel_weight_tl(noise_key, hq, rows[:, None], keys[None, :])
        return e

    @triton.jit
    def _column_scores_kernel(q_ptr, k_ptr, slopes_ptr, m_ptr, l_ptr, rowb_ptr, out_ptr,
                              L, first, n_rows, scale, temperature, noise_key, log2_decay,
                              stride_ql, stride_qh, stride_qd, stride_kl, stride_kh, stride_kd,
                              G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ALIBI: tl.constexpr,
                              GUMBEL: tl.constexpr, UNIT_TEMP: tl.constexpr, DECAY: tl.constexpr,
                              COUNT_LOW: tl.constexpr, HEADS_OUTER: tl.constexpr,
                              INPUT_PRECISION: tl.constexpr):
        """Pass 2, one program per (key block, KV head): that block's scores, summed over query rows.

        ``HEADS_OUTER`` (every mode but ``count_low``, whose test needs each row's mean over the group before
        it counts): one loop over the query blocks per head of the group, so the innermost loop, the one
        Triton's pipeliner overlaps, is the long one (a query tile's load issued stages ahead). Otherwise
        the heads of the group are the inner loop (``G`` steps: the pipeline fills and drains once per
        query block), which ``count_low`` needs. The heads-outer loop sums its terms (:func:`_column_tile`)
        into a ``[BLOCK_Q, BLOCK_K]`` tile and reduces its rows once at the end, where the other loop sums
        each query tile's rows as it goes (a reduction across the warps per tile)."""
        kb = tl.program_id(0)
        hkv = tl.program_id(1)
        keys = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        d = tl.arange(0, BLOCK_D)
        k = tl.load(k_ptr + keys[:, None] * stride_kl + hkv * stride_kh + d[None, :] * stride_kd,
                    mask=(keys[:, None] < L) & (d[None, :] < D), other=0.0)
        acc = tl.zeros([BLOCK_K], tl.float32)
        # Rows before this key block see none of it. Query blocks need no alignment: m and l are per row.
        row_start = tl.maximum(first, kb * BLOCK_K)
        if HEADS_OUTER and not COUNT_LOW:
            tl.static_assert(BLOCK_Q == BLOCK_K, "a key block's first query tile holds its diagonal")
            terms = tl.zeros([BLOCK_Q, BLOCK_K], tl.float32)
            for g in range(G):
                hq = hkv * G + g
                # The first query tile holds the rows that see part of the key block (the rows of the key
                # block itself, or from `first` on); every later row sees all of it.
                rows = row_start + tl.arange(0, BLOCK_Q)
                terms += _column_tile(q_ptr, k, rowb_ptr, slopes_ptr, rows, keys, d, hq, L, first, n_rows,
                                      scale, temperature, noise_key, stride_ql, stride_qh, stride_qd, D,
                                      HAS_ALIBI, GUMBEL, UNIT_TEMP, INPUT_PRECISION, True)
                for q_start in range(row_start + BLOCK_Q, L, BLOCK_Q):
                    rows = q_start + tl.arange(0, BLOCK_Q)
                    terms += _column_tile(q_ptr, k, rowb_ptr, slopes_ptr, rows, keys, d, hq, L, first,
                                          n_rows, scale, temperature, noise_key, stride_ql, stride_qh,
                                          stride_qd, D, HAS_ALIBI, GUMBEL, UNIT_TEMP, INPUT_PRECISION, False)
            acc = tl.sum(terms, 0) / G
        else:
            for q_start in range(row_start, L, BLOCK_Q):
                rows = q_start + tl.arange(0, BLOCK_Q)
                row_ok = rows < L
                c = tl.zeros([BLOCK_Q, BLOCK_K], tl.float32)
                for g in range(G):
                    c += _probabilities(q_ptr, k, m_ptr, l_ptr, slopes_ptr, rows, keys, d, hkv * G + g, L,
                                        first, n_rows, scale, temperature, noise_key, stride_ql, stride_qh,
                                        stride_qd, D, HAS_ALIBI, GUMBEL, UNIT_TEMP, INPUT_PRECISION)
                c = c / G
                if COUNT_LOW:
                    visible = (keys[None, :] <= rows[:, None]) & row_ok[:, None]
                    n_valid = (rows + 1).to(tl.float32)
                    threshold = tl.math.div_rn(tl.full([BLOCK_Q], 1.0, tl.float32), n_valid)  # IEEE, as torch
                    acc -= tl.sum((visible & (c < threshold[:, None])).to(tl.float32), 0)
                elif DECAY:
                    weight = tl.exp2((L - 1 - rows).to(tl.float32) * log2_decay)
                    acc += tl.sum(c * weight[:, None], 0)
                else:
                    acc += tl.sum(c, 0)
        tl.store(out_ptr + hkv * L + keys, acc, mask=keys < L)

    @triton.jit
    def _probabilities(q_ptr, k, m_ptr, l_ptr, slopes_ptr, rows, keys, d, hq, L, first, n_rows, scale,
                       temperature, noise_key, stride_ql, stride_qh, stride_qd, D: tl.constexpr,
                       HAS_ALIBI: tl.constexpr, GUMBEL: tl.constexpr, UNIT_TEMP: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr):
        """``[BLOCK_Q, BLOCK_K]`` softmax probabilities of query head ``hq``'s rows ``rows`` for the key
        tile ``k`` (0 where not visible), from the rows' max ``m`` and normaliser ``l`` of pass 1."""
        row_ok = rows < L
        q = tl.load(q_ptr + rows[:, None] * stride_ql + hq * stride_qh + d[None, :] * stride_qd,
                    mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        x = _logit_tile(q, k, rows, keys, slopes_ptr, hq, L, scale, temperature, noise_key,
                        HAS_ALIBI, GUMBEL, UNIT_TEMP, INPUT_PRECISION)
        m = tl.load(m_ptr + hq * n_rows + (rows - first), mask=row_ok, other=0.0)
        l = tl.load(l_ptr + hq * n_rows + (rows - first), mask=row_ok, other=1.0)
        return _softmax_terms(x, m, hq, rows, keys, noise_key, GUMBEL, UNIT_TEMP) / l[:, None]


#: The column pass's register ceiling per thread (``maxnreg``). Compiled for sm_90 at the bench's shape
#: (``bench/sass.py prefill``: 4 warps, 64 x 64 tiles) its heads-outer loop, which keeps a tile of terms
#: across the query tiles, takes 193 registers unbounded: two programs per SM, where the loop before it
#: (162) left three. 168 leaves three, with no spills and the same inner loop (221 instructions, 218
#: unbounded).
COLUMN_MAX_REGISTERS = 168


def _rows(L: int, mode: str, window: int) -> int:
    """The first query row whose update survives: ``L - window`` (0 for ``window == 0``); for
    ``replace`` only the last row matters."""
    if mode == "replace":
        return L - 1
    return L - window if window else 0


#: Score modes whose prompt score is a row-weighted column sum of the attention probabilities: the ones
#: :func:`prefill_attention_scores` fuses into the attention itself, and the ones whose scorer takes the
#: attention's row log-sum-exp for its normaliser. Not ``gumbel`` (its logits carry noise the attention
#: never saw) nor ``count_low`` (integer counts of ``p < 1/n``, where a last-bit difference in the
#: normaliser could flip a near tie).
COLUMN_SUM_MODES = ("accumulate", "decay", "replace")


def _uses_lse(mode: str, lse: torch.Tensor | None) -> bool:
    """Whether a given row log-sum-exp replaces the scorer's own normaliser (:data:`COLUMN_SUM_MODES`)."""
    return lse is not None and mode in COLUMN_SUM_MODES


def prefill_scores_triton(q: torch.Tensor, k: torch.Tensor, *, scale: float, mode: str, window: int = 0,
                          decay: float = 1.0, seed: int = 0, temperature: float = 1.0,
                          alibi_slopes: torch.Tensor | None = None, chunk: int = 256,
                          lse: torch.Tensor | None = None, heads_outer: bool = True) -> torch.Tensor:
    """Triton launcher of :func:`prefill_scores` (no input checks; ``chunk`` is unused: the kernels
    hold ``O(L)`` per head, never ``O(L^2)``). With ``lse`` the row-stats pass is skipped:
    ``m = lse, l = 1``. ``heads_outer=False``: the column pass's earlier loop order (the group's heads
    inside the query-block loop; ``count_low`` always runs it), kept for the GPU bench to time both."""
    require_triton()
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    out = torch.zeros((Hkv, L), dtype=torch.float32, device=q.device)
    if mode == "none" or L == 0:
        return out
    first = _rows(L, mode, window)
    n_rows = L - first
    m = torch.empty((Hq, n_rows), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    slopes = alibi_slopes.to(torch.float32).contiguous() if alibi_slopes is not None else m  # m: unused
    cfg = launch_config("prefill_scores", q.device)  # tile, warps and stages: kvkernels.tuning
    block = cfg.block  # 16 under the interpreter, so small tests cross block edges
    common = dict(
        L=L, first=first, n_rows=n_rows, scale=float(scale), temperature=float(temperature),
        noise_key=_as_int32(seed_key(seed)),
        stride_ql=q.stride(0), stride_qh=q.stride(1), stride_qd=q.stride(2),
        stride_kl=k.stride(0), stride_kh=k.stride(1), stride_kd=k.stride(2),
        G=Hq // Hkv, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_Q=block, BLOCK_K=block,
        HAS_ALIBI=alibi_slopes is not None, GUMBEL=mode == "gumbel",
        UNIT_TEMP=mode == "gumbel" and float(temperature) == 1.0,  # Keyformer's prompt (tau_init = 1)
        # fp32 inputs: exact fp32 products, not TF32, so scores match the reference closely.
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if _uses_lse(mode, lse):
        assert lse is not None
        m.copy_(lse[:, first:])
        l.fill_(1.0)
    else:
        launch(_row_stats_kernel, (triton.cdiv(n_rows, block), Hq), q, k, slopes, m, l,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
    # Each row's offset in base 2 for the heads-outer loop (_column_tile), formed here once per row rather
    # than per query tile in the kernel (there a precise log2 per row added ~25% to the loop step).
    rowb = m  # the heads-inner loop (count_low, heads_outer=False) reads m and l instead
    if heads_outer and mode != "count_low":
        rowb = (m + l.log()) * LOG2E
        if mode == "decay":  # its weight decay**(L - 1 - i), as a base-2 offset
            rowb -= (L - 1 - torch.arange(first, L, device=q.device, dtype=torch.float32)) * math.log2(decay)
    launch(
        _column_scores_kernel, (triton.cdiv(L, block), Hkv),
        q, k, slopes, m, l, rowb, out, log2_decay=math.log2(decay), DECAY=mode == "decay",
        COUNT_LOW=mode == "count_low", HEADS_OUTER=heads_outer, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, maxnreg=COLUMN_MAX_REGISTERS, **common)
    return out


def prefill_scores_ref(q: torch.Tensor, k: torch.Tensor, *, scale: float, mode: str, window: int = 0,
                       decay: float = 1.0, seed: int = 0, temperature: float = 1.0,
                       alibi_slopes: torch.Tensor | None = None, chunk: int = 256,
                       lse: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch reference of :func:`prefill_scores`: ``chunk`` query rows at a time, closed forms.
    ``lse`` is ignored: the oracle always computes its own softmax."""
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scores = torch.zeros((Hkv, L), dtype=torch.float32, device=q.device)
    if mode == "none" or L == 0:
        return scores
    keys = torch.arange(L, device=q.device)
    k_t = k.float().permute(1, 2, 0)  # [Hkv, D, L]
    heads = torch.arange(Hq, device=q.device).view(Hkv, G, 1, 1)
    for start in range(_rows(L, mode, window), L, chunk):
        rows = torch.arange(start, min(start + chunk, L), device=q.device)  # [C]
        q_c = q[rows].float().view(len(rows), Hkv, G, D).permute(1, 2, 0, 3)  # [Hkv, G, C, D]
        x = (q_c @ k_t[:, None]) * scale  # [Hkv, G, C, L]
        if alibi_slopes is not None:
            x = x + alibi_slopes.float().view(Hkv, G, 1, 1) * (keys - rows[:, None])
        if mode == "gumbel":
            x = (x + gumbel_noise_hash(seed, heads, rows[:, None], keys)) / temperature
        visible = keys <= rows[:, None]  # [C, L]
        contrib = torch.softmax(x.masked_fill(~visible, float("-inf")), dim=-1).mean(dim=1)  # [Hkv, C, L]
        if mode == "count_low":
            threshold = 1.0 / (rows + 1).to(torch.float32)  # 1 / n_valid, as in _modes.update_scores_ref
            scores -= (visible & (contrib < threshold[:, None])).sum(dim=1)
        elif mode == "decay":
            weight = (decay ** (L - 1 - rows).double()).float()  # [C]
            scores += (contrib * weight[:, None]).sum(dim=1)
        else:  # accumulate, gumbel, replace (one row)
            scores += contrib.sum(dim=1)
    return scores


def _prefill_scores_torch_lse(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, *, scale: float, mode: str,
                              window: int, decay: float, alibi_slopes: torch.Tensor | None,
                              chunk: int) -> torch.Tensor:
    """:func:`prefill_scores_torch` when the row log-sum-exp is known (``accumulate``, ``decay``,
    ``replace``): ``p = exp(scale * q.k [+ alibi] - lse)`` tile by tile, ``[Hkv, G*C, KEYS]`` blocks of
    ~2 MB that stay in cache for the exp and the weighted column sum; the logits and the ``-lse`` shift
    come from one ``baddbmm``. Only tiles on the diagonal need the causal mask.
    Measured (1 thread, L=4096, Hq=9, Hkv=3, D=64): ~225 ms against ~475 ms for the full-row softmax; the
    ``baddbmm`` alone (the logits, recomputed) is ~140 ms at the core's GEMM peak, the ``exp`` ~75 ms."""
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    keys_per_tile = 256
    scores = torch.zeros((Hkv, L), dtype=torch.float32, device=q.device)
    keys = torch.arange(L, device=q.device)
    q_g = q.float().view(L, Hkv, G, D).permute(1, 2, 0, 3)  # [Hkv, G, L, D]
    k_t = k.float().permute(1, 2, 0)  # [Hkv, D, L]
    neg_lse = lse.float().neg().view(Hkv, G, L)
    slopes = alibi_slopes.float().view(Hkv, G, 1, 1) if alibi_slopes is not None else None
    chunk = min(chunk, 256)  # 256 x 256 tiles: ~4% faster than 128 x 512 here, the GEMM is at its peak
    for start in range(_rows(L, mode, window), L, chunk):
        end = min(start + chunk, L)
        C = end - start
        rows = keys[start:end]
        q_c = q_g[:, :, start:end].reshape(Hkv, G * C, D)
        shift = neg_lse[:, :, start:end].reshape(Hkv, G * C, 1)
        weight = (decay ** (L - 1 - rows).double()).float() if mode == "decay" else rows.new_ones(
            C, dtype=torch.float32)
        weight = (weight / G).repeat(G)  # [G*C]: the group mean and the row sum in one product
        for k0 in range(0, end, keys_per_tile):
            k1 = min(k0 + keys_per_tile, end)
            x = torch.baddbmm(shift, q_c, k_t[:, :, k0:k1], alpha=scale)  # [Hkv, G*C, n] = logit - lse
            if slopes is not None:
                x.view(Hkv, G, C, k1 - k0).add_(slopes * (keys[k0:k1] - rows[:, None]))
            x.exp_()
            if k1 - 1 > start:  # a diagonal tile: keys after a row are not visible to it
                hidden = keys[k0:k1] > rows[:, None]  # [C, n]
                x.view(Hkv, G, C, k1 - k0).masked_fill_(hidden, 0.0)
            scores[:, k0:k1] += weight @ x
    return scores


def prefill_scores_torch(q: torch.Tensor, k: torch.Tensor, *, scale: float, mode: str, window: int = 0,
                         decay: float = 1.0, seed: int = 0, temperature: float = 1.0,
                         alibi_slopes: torch.Tensor | None = None, chunk: int = 256,
                         lse: torch.Tensor | None = None) -> torch.Tensor:
    """Fast pure-torch form of :func:`prefill_scores` (the op's CPU path; no input checks).

    Same closed forms as :func:`prefill_scores_ref`, which stays the oracle, but per chunk of ``C`` query
    rows: one batched matmul ``[Hkv, G*C, D] @ [Hkv, D, n]`` for all heads (K is never expanded to query
    heads), only the ``n = last row + 1`` keys the chunk can see (later keys get exactly 0), in-place
    element-wise work, and the Gumbel noise in vectorised ``[Hq, rows, n]`` calls sized to stay in cache.
    """
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scores = torch.zeros((Hkv, L), dtype=torch.float32, device=q.device)
    if mode == "none" or L == 0:
        return scores
    if _uses_lse(mode, lse):
        assert lse is not None
        return _prefill_scores_torch_lse(q, k, lse, scale=scale, mode=mode, window=window, decay=decay,
                                         alibi_slopes=alibi_slopes, chunk=chunk)
    keys = torch.arange(L, device=q.device)
    q_f = q.float().view(L, Hkv, G, D)
    k_t = k.float().permute(1, 2, 0)  # [Hkv, D, L]
    heads = torch.arange(Hq, device=q.device).view(Hkv, G, 1, 1)
    slopes = alibi_slopes.float().view(Hkv, G, 1, 1) if alibi_slopes is not None else None
    # ``chunk`` bounds the memory; fewer rows per step run faster on CPU (the [Hq, C, n] blocks stay
    # closer to cache: measured at L=4096, 128 rows take ~0.65x the time of 256 and ~0.3x of 1024).
    chunk = min(chunk, 128)
    for start in range(_rows(L, mode, window), L, chunk):
        end = min(start + chunk, L)
        rows = torch.arange(start, end, device=q.device)  # [C]
        C = end - start
        # [C, Hkv, G, D] -> [Hkv, G*C, D]: the rows of every query head of a group share one matmul.
        q_c = q_f[start:end].permute(1, 2, 0, 3).reshape(Hkv, G * C, D)
        x = torch.bmm(q_c, k_t[:, :, :end]).view(Hkv, G, C, end).mul_(scale)  # [Hkv, G, C, n]
        if slopes is not None:
            x.add_(slopes * (keys[:end] - rows[:, None]))
        if mode == "gumbel":
            # The hash makes ~20 in-place passes over its block: blocks of ~2**17 elements stay in cache
            # (measured at L=4096, 1 thread: ~0.41 s of noise per layer against ~0.75 s for one row at a
            # time and ~0.7 s for 32 rows).
            step = max(1, 2**17 // (Hq * end))
            for r in range(0, C, step):
                x[:, :, r:r + step] += gumbel_noise_hash(seed, heads, rows[r:r + step, None], keys[:end])
            x.div_(temperature)
        hidden = keys[:end] > rows[:, None]  # [C, n]
        probs = torch.softmax(x.masked_fill_(hidden, float("-inf")), dim=-1)  # [Hkv, G, C, n]
        if mode == "count_low":
            contrib = probs.mean(dim=1)  # [Hkv, C, n]
            threshold = 1.0 / (rows + 1).to(torch.float32)  # 1 / n_valid, as in _modes.update_scores_ref
            scores[:, :end] -= ((contrib < threshold[:, None]) & ~hidden).sum(dim=1)
        else:
            # Row weights (decay**(L-1-i), or 1) / G fold the group mean and the row sum into one
            # matrix-vector product per KV head.
            weight = (decay ** (L - 1 - rows).double()).float() if mode == "decay" else rows.new_ones(
                C, dtype=torch.float32)
            weight = (weight / G).repeat(G)  # [G*C], row order of probs.view(Hkv, G*C, n)
            scores[:, :end] += weight @ probs.view(Hkv, G * C, end)
    return scores


@torch.library.custom_op("kvkernels::prefill_scores", mutates_args=())
def _prefill_scores_op(q: torch.Tensor, k: torch.Tensor, scale: float, mode: str, window: int, decay: float,
                       seed: int, temperature: float, alibi_slopes: torch.Tensor | None,
                       chunk: int, lse: torch.Tensor | None) -> torch.Tensor:
    impl = prefill_scores_triton if use_triton(q) else prefill_scores_torch
    return impl(q, k, scale=scale, mode=mode, window=window, decay=decay, seed=seed, temperature=temperature,
                alibi_slopes=alibi_slopes, chunk=chunk, lse=lse)


@_prefill_scores_op.register_fake
def _(q, k, scale, mode, window, decay, seed, temperature, alibi_slopes, chunk, lse):
    return q.new_empty((k.shape[1], q.shape[0]), dtype=torch.float32)


def _check_number(name: str, value: object, ok: Callable[[float], bool], need: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not ok(value):
        raise ValueError(f"{name}={value!r} is out of range; {name} must be {need}")


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is out of range; {name} must be in [{lo}, {hi}]")


def _check_score_args(q: torch.Tensor, k: torch.Tensor, *, scale: float, mode: str, window: int, decay: float,
                      seed: int, temperature: float, chunk: int, alibi_slopes: torch.Tensor | None,
                      lse: torch.Tensor | None) -> None:
    """The checks of :func:`prefill_scores`' arguments (shared with :func:`prefill_attention_scores`)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    check_shape("k", k, [L, None, D], "[L, Hkv, D] with the L and D of q")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"k has {Hkv} KV heads but q has {Hq} query heads; Hq must be a positive multiple "
                         "of Hkv (each KV head serves Hq // Hkv query heads)")
    check_choice("mode", mode, SCORE_MODES)
    _check_int("window", window, 0, L)
    _check_int("chunk", chunk, 1, 2**62)
    _check_int("seed", seed, 0, 2**63 - 1)
    _check_number("scale", scale, math.isfinite, "finite")
    _check_number("temperature", temperature, lambda t: 0 < t < math.inf, "> 0 and finite")
    _check_number("decay", decay, lambda d: 0 < d <= 1, "in (0, 1]")
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes, ndim=1, dtypes=(torch.float32,), device=q.device)
        check_shape("alibi_slopes", alibi_slopes, [Hq], "one slope per query head")
    if lse is not None:
        check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,), device=q.device)
        check_shape("lse", lse, [Hq, L], "[Hq, L]: one log-sum-exp per query head and prompt row")


def prefill_scores(q: torch.Tensor, k: torch.Tensor, *, scale: float, mode: str, window: int = 0,
                   decay: float = 1.0, seed: int = 0, temperature: float = 1.0,
                   alibi_slopes: torch.Tensor | None = None, chunk: int = 256,
                   lse: torch.Tensor | None = None) -> torch.Tensor:
    """Per-KV-head eviction scores of every prompt token of one sequence (causal prefill).

    Parameters
    ----------
    q : Tensor
        ``[L, Hq, D]`` float32 / float16 / bfloat16 queries (after RoPE).
    k : Tensor
        ``[L, Hkv, D]`` keys, same dtype and device as ``q``; ``Hq % Hkv == 0`` (GQA group ``G = Hq // Hkv``).
    scale : float
        Logit scale, usually ``D ** -0.5``.
    mode : str
        One of ``SCORE_MODES`` (contract §2.2): ``none``, ``accumulate``, ``gumbel``, ``decay``,
        ``replace``, ``count_low``.
    window : int
        Score with the last ``window`` query rows only (SnapKV's observation window); ``0`` = all rows.
        Must be in ``[0, L]``.
    decay : float
        Forgetting factor for ``decay``, in ``(0, 1]``.
    seed : int
        Gumbel noise seed for ``gumbel`` (``0 <= seed < 2**63``); see ``kvkernels._noise``.
    temperature : float
        Gumbel softmax temperature (``> 0``).
    alibi_slopes : Tensor, optional
        ``[Hq]`` float32 ALiBi slopes; logits get ``slope[h] * (j - i)`` for key ``j``, query ``i``.
    chunk : int
        Most query rows per step of the CPU path (memory ``O(chunk * L)`` per head); results do not
        depend on it. The Triton path ignores it.
    lse : Tensor, optional
        ``[Hq, L]`` float32 log-sum-exp of each query row's visible logits (``scale * q.k``, plus ALiBi),
        as the model's attention over the prompt computed them (:func:`prefill_attention` returns it).
        Used by ``accumulate``, ``decay`` and ``replace`` in place of the scorer's own normaliser pass;
        ignored by ``gumbel`` and ``count_low`` (see ``_uses_lse``). A wrong ``lse`` gives wrong scores.

    Returns
    -------
    Tensor
        ``[Hkv, L]`` float32 scores, ``score[h, j]`` for key ``j`` of KV head ``h``, on ``q.device``.

    The op runs the Triton kernels on CUDA tensors and :func:`prefill_scores_torch` on CPU tensors, and is
    opaque to ``torch.compile``. Inputs are checked here, before any work.
    """
    _check_score_args(q, k, scale=scale, mode=mode, window=window, decay=decay, seed=seed,
                      temperature=temperature, chunk=chunk, alibi_slopes=alibi_slopes, lse=lse)
    return _prefill_scores_op(q, k, float(scale), mode, window, float(decay), seed, float(temperature),
                              alibi_slopes, chunk, lse)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                      need_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of one prompt, and the row log-sum-exp :func:`prefill_scores` can reuse.

    Parameters
    ----------
    q : Tensor
        ``[L, Hq, D]`` queries (after RoPE).
    k, v : Tensor
        ``[L, Hkv, D]``, ``Hq % Hkv == 0`` (grouped-query attention without expanding K/V).
    scale : float
        Logit scale.
    need_lse : bool
        On CUDA, ask for the log-sum-exp (the caller scores the prompt from it): the attention then runs a
        kernel that returns it (:data:`LSE_KERNELS`: cuDNN's attention where torch's SDPA prefers it, which
        is SDPA's own kernel there and costs nothing more; else torch's flash kernel) rather than
        ``F.scaled_dot_product_attention``'s choice of kernel, for float16 / bfloat16 inputs. Where every
        kernel refuses the inputs (an error, remembered per device, dtype and head counts), the lse is
        ``None`` as without ``need_lse``. Ignored on CPU, where it comes at no cost.

    Returns
    -------
    (Tensor, Tensor or None)
        ``[L, Hq, D]`` attention output in ``q``'s dtype; ``[Hq, L]`` float32 log-sum-exp of each row's
        scaled causal logits on CPU tensors (torch's CPU flash kernel computes it for its own softmax and
        returns it at no cost) and on CUDA with ``need_lse`` where a kernel of :data:`LSE_KERNELS` takes
        the inputs, ``None`` otherwise (``F.scaled_dot_product_attention`` does not return it; the scorer
        then computes its normaliser itself, a second pass over the prompt's logits).
    """
    if q.shape[0] == 0:  # torch's CPU flash kernel divides by the length (SIGFPE on an empty prompt)
        lse0 = q.new_zeros((q.shape[1], 0), dtype=torch.float32) if q.device.type == "cpu" else None
        return q.new_zeros((0, q.shape[1], v.shape[2])), lse0
    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, D]
    if q.device.type == "cpu":
        # The kernel F.scaled_dot_product_attention picks for these inputs on CPU (GQA included).
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, True,
                                                                              scale=scale)
        return out[0].transpose(0, 1), lse[0].float()
    if need_lse:
        found = _attention_with_lse(qt, kt, vt, scale)
        if found is not None:
            return found[0][0].transpose(0, 1), found[1][0]
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                                           enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1), None


#: The CUDA kernels :func:`prefill_attention` asks for the log-sum-exp, in order: cuDNN's fused attention
#: (what ``F.scaled_dot_product_attention`` itself runs on sm_90 / sm_100 with cuDNN > 9.15.0, torch >= 2.11:
#: the lse at the plain attention's cost), then the flash kernel (the H200 runs of 2026-11-28 timed it at
#: 1.95x SDPA's time at L 4096, Hq 32, Hkv 8, D 128: the cost of every lse until cuDNN's was asked).
LSE_KERNELS = ("cudnn", "flash")

# (kernel, device, dtype, Hq, Hkv, D) a kernel refused, or returned an lse that failed the first-use check:
# prefill_attention(need_lse=True) asks the next kernel there, never this one again.
_LSE_REFUSED: set[tuple[str, torch.device, torch.dtype, int, int, int]] = set()
# The same keys whose lse passed that check once.
_LSE_CHECKED: set[tuple[str, torch.device, torch.dtype, int, int, int]] = set()


def _cudnn_prefers(device: torch.device) -> bool:
    """Whether torch's SDPA prefers cuDNN's attention on ``device`` (its own gate: sm_90 or sm_100 and cuDNN
    > 9.15.0, whose 9.15.1 fixed sequence lengths that are not multiples of 128, pytorch/pytorch#169849)."""
    if device.type != "cuda" or not torch.backends.cudnn.is_available():
        return False
    version = torch.backends.cudnn.version()
    return bool(version and version > 91500 and torch.cuda.get_device_capability(device)[0] in (9, 10))


def _attention_with_lse(
    qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, scale: float,
    kernels: tuple[str, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """``([1, Hq, L, D] output, [1, Hq, L] float32 lse, kernel)`` of the causal attention of ``[1, H, L, D]``
    float16 / bfloat16 CUDA inputs from the first of ``kernels`` (:data:`LSE_KERNELS`) that takes them
    (grouped KV heads as they are: both take ``Hq % Hkv == 0``), or ``None``. A kernel's first lse for
    each key is checked against three rows computed here (:func:`_lse_agrees`: a layout or a log base other
    than this reads fails it), so a torch version whose op returns something else falls through to the
    next kernel rather than into the scores."""
    if qt.dtype not in (torch.float16, torch.bfloat16):
        return None
    for name in LSE_KERNELS if kernels is None else kernels:
        key = (name, qt.device, qt.dtype, qt.shape[1], kt.shape[1], qt.shape[-1])
        if key in _LSE_REFUSED or (name == "cudnn" and not _cudnn_prefers(qt.device)):
            continue
        try:
            if name == "cudnn":
                out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                    qt, kt, vt, None, True, 0.0, True, False, scale=scale)
            else:
                out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
                    qt, kt, vt, 0.0, True, False, scale=scale)
        except torch.OutOfMemoryError:  # a RuntimeError, but about this call's memory, not the inputs' kind
            raise
        except (RuntimeError, NotImplementedError):  # no such kernel for these inputs (arch, head dim, ...)
            _LSE_REFUSED.add(key)
            continue
        if lse.dim() == 4 and lse.shape[-1] == 1:  # cuDNN's [B, H, L, 1]
            lse = lse[..., 0]
        if tuple(out.shape) != tuple(qt.shape) or tuple(lse.shape) != tuple(qt.shape[:3]):
            _LSE_REFUSED.add(key)  # not the layout this reads (another torch version's op): never again
            continue
        lse = lse.float()
        if key not in _LSE_CHECKED:
            if not _lse_agrees(qt, kt, scale, lse):
                _LSE_REFUSED.add(key)
                continue
            _LSE_CHECKED.add(key)
        return out, lse, name
    return None


def _lse_agrees(qt: torch.Tensor, kt: torch.Tensor, scale: float, lse: torch.Tensor) -> bool:
    """Whether ``lse [1, Hq, L]`` is the natural log-sum-exp of the scaled causal logits on the first,
    middle and last rows (float32 here; 1e-2 apart at most: the kernels' own float32 sums differ by far less,
    a base-2 lse or a transposed layout by far more). One device read, once per kernel and input kind."""
    L, n_q, n_kv = qt.shape[2], qt.shape[1], kt.shape[1]
    rows = torch.tensor(sorted({0, L // 2, L - 1}), device=qt.device)
    k = kt[0].float().repeat_interleave(n_q // n_kv, dim=0)  # [Hq, L, D]
    logits = torch.einsum("hrd,hjd->hrj", qt[0, :, rows].float(), k) * scale  # [Hq, rows, L]
    logits = logits.masked_fill(torch.arange(L, device=qt.device)[None, None, :] > rows[None, :, None],
                                float("-inf"))
    want = torch.logsumexp(logits, dim=-1)
    return bool(torch.allclose(lse[0, :, rows], want, rtol=1e-2, atol=1e-2))


def prefill_attention_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mode: str,
                             window: int = 0, decay: float = 1.0,
                             chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one prompt and its eviction scores, from one computation of the probabilities.

    :func:`prefill_attention` followed by :func:`prefill_scores` (given its ``lse``) computes every
    visible logit twice: once in the attention, once in the scorer, which needs the probabilities
    themselves. For the modes whose score is a row-weighted column sum of those probabilities
    (:data:`COLUMN_SUM_MODES`), this computes them once per chunk of query rows and takes both the
    output (``p @ v``) and the scores (``w @ p``) from them.

    Parameters
    ----------
    q : Tensor
        ``[L, Hq, D]`` queries (after RoPE).
    k, v : Tensor
        ``[L, Hkv, D]``, same dtype and device as ``q``, ``Hq % Hkv == 0``.
    scale : float
        Logit scale.
    mode, window, decay :
        As in :func:`prefill_scores`; ``mode`` must be one of :data:`COLUMN_SUM_MODES`.
    chunk : int
        Query rows per step on CPU (memory ``O(chunk * L * Hq)``); results do not depend on it beyond
        float rounding.

    Returns
    -------
    (Tensor, Tensor)
        ``[L, Hq, D]`` attention output in ``q``'s dtype (equal to :func:`prefill_attention`'s up to float
        rounding) and ``[Hkv, L]`` float32 scores (equal to :func:`prefill_scores`' up to float rounding).

    Fused on CPU tensors only: there it costs ~1.2x the flash kernel alone against ~1.7x for flash plus
    the scorer (1 thread, L=4096, Hq=9, Hkv=3, D=64). On other devices it runs :func:`prefill_attention`
    (``need_lse=True``) and the Triton scorer's one pass from that lse (no fused kernel yet).
    """
    if mode not in COLUMN_SUM_MODES:
        raise ValueError(f"mode={mode!r} is not a column sum of the attention probabilities; "
                         f"prefill_attention_scores takes one of {COLUMN_SUM_MODES} (score other modes with "
                         "prefill_scores)")
    _check_score_args(q, k, scale=scale, mode=mode, window=window, decay=decay, seed=0, temperature=1.0,
                      chunk=chunk, alibi_slopes=None, lse=None)
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_shape("v", v, list(k.shape), "[L, Hkv, D] like k")
    if q.device.type != "cpu":
        out, lse = prefill_attention(q, k, v, scale=scale, need_lse=True)
        return out, prefill_scores(q, k, scale=scale, mode=mode, window=window, decay=decay, lse=lse)
    return _prefill_attention_scores_torch(q, k, v, scale=scale, mode=mode, window=window, decay=decay,
                                           chunk=chunk)


def _prefill_attention_scores_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                                    mode: str, window: int, decay: float,
                                    chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU path of :func:`prefill_attention_scores`: per chunk of ``C`` query rows, one
    ``[Hkv, G*C, D] @ [Hkv, D, n]`` for the logits of all heads (``n`` = the keys the chunk sees), an
    in-place softmax numerator, then ``@ v`` for the output and a row-weight vector ``@`` for the scores,
    each scaled by the rows' ``1 / sum``. The logits live in one buffer reused by every chunk: allocating
    it per chunk costs ~30% here (fresh pages each time).
    Measured (1 thread, L=4096, Hq=9, Hkv=3, D=64): ~215 ms against ~180 ms for the flash kernel alone and
    ~310 ms for flash plus the scorer; the gain is the scorer's recomputed ``q.k`` and ``exp``."""
    L, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scores = torch.zeros((Hkv, L), dtype=torch.float32, device=q.device)
    out = torch.empty((Hkv, G, L, v.shape[2]), dtype=torch.float32, device=q.device)
    if L == 0:
        return out.permute(2, 0, 1, 3).reshape(L, Hq, v.shape[2]).to(q.dtype), scores
    C = min(chunk, L)
    q_g = (q.float() * scale).view(L, Hkv, G, D).permute(1, 2, 0, 3)  # [Hkv, G, L, D], scale folded in
    k_t = k.float().permute(1, 2, 0)  # [Hkv, D, L]
    v_h = v.float().transpose(0, 1)  # [Hkv, L, Dv]
    keys = torch.arange(L, device=q.device)
    first = _rows(L, mode, window)  # rows before it do not score
    buf = torch.empty(Hkv * G * C * L, dtype=torch.float32, device=q.device)
    for start in range(0, L, C):
        end = min(start + C, L)
        rows = keys[start:end]
        n = end - start
        x = buf[:Hkv * G * n * end].view(Hkv, G * n, end)  # rows in (g, row) order
        torch.bmm(q_g[:, :, start:end].reshape(Hkv, G * n, D), k_t[:, :, :end], out=x)
        hidden = keys[start:end] > rows[:, None]  # [n, n]: the diagonal block's future keys
        x.view(Hkv, G, n, end)[..., start:end].masked_fill_(hidden, float("-inf"))
        x.sub_(x.amax(dim=-1, keepdim=True)).exp_()  # softmax numerator; every row sees itself
        inv = x.sum(dim=-1, keepdim=True).reciprocal_()  # [Hkv, G*n, 1]
        out[:, :, start:end] = (torch.bmm(x, v_h[:, :end]) * inv).view(Hkv, G, n, -1)
        if end <= first:
            continue
        weight = (decay ** (L - 1 - rows).double()).float() if mode == "decay" else torch.ones(
            n, dtype=torch.float32, device=q.device)
        weight = weight.masked_fill_(rows < first, 0.0).div_(G).repeat(G)  # [G*n]: group mean, row sum
        scores[:, :end] += torch.bmm((weight * inv[..., 0])[:, None], x)[:, 0]
    return out.permute(2, 0, 1, 3).reshape(L, Hq, -1).to(q.dtype), scores


# ----------------------------------------------------------------------------------------------------
# Compile variants (kvkernels.compile_check)
# ----------------------------------------------------------------------------------------------------

# Every option the launcher turns into a different kernel: each mode, ALiBi, GQA group sizes, every dtype,
# head dims that are and are not powers of two, and prompt lengths / windows whose row counts are 1 (an
# int argument equal to 1 is specialised as a constant), not a multiple of 16, and a multiple of 16.
COMPILE_AXES: dict[str, tuple] = {
    "mode": tuple(m for m in SCORE_MODES if m != "none"),  # "none" launches nothing
    "alibi": (False, True),
    "group": (1, 2, 4, 8),
    "dtype": FLOAT_DTYPES,
    "head_dim": (64, 128, 96),
    "length": (1, 50, 1024),
    "window": (0, 32),
    "heads_outer": (True, False),  # the column pass's loop order (False: the bench's comparison)
    "temperature": (1.5, 1.0),  # gumbel at 1: the noise as a factor (UNIT_TEMP)
}


def compile_variants(full: bool = False):
    """``(label, thunk)`` pairs: each thunk calls :func:`prefill_scores_triton` on ``meta`` tensors with
    one configuration of :data:`COMPILE_AXES` (a pairwise covering set, or all with ``full``)."""
    for cfg in covering(COMPILE_AXES, full=full):
        label = "prefill_scores " + " ".join(f"{k}={v}" for k, v in cfg.items())
        yield label, (lambda cfg=cfg: _meta_launch(**cfg))


def _meta_launch(mode: str, alibi: bool, group: int, dtype: torch.dtype, head_dim: int, length: int,
                 window: int, heads_outer: bool, temperature: float) -> None:
    Hkv = 2
    meta = torch.device("meta")
    q = torch.empty(length, Hkv * group, head_dim, dtype=dtype, device=meta)
    k = torch.empty(length, Hkv, head_dim, dtype=dtype, device=meta)
    slopes = torch.empty(Hkv * group, dtype=torch.float32, device=meta) if alibi else None
    prefill_scores_triton(q, k, scale=head_dim ** -0.5, mode=mode, window=min(window, length), decay=0.9,
                          seed=3, temperature=temperature, alibi_slopes=slopes, heads_outer=heads_outer)
