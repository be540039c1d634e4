"""Attention of new tokens over a sequence's kept (possibly compressed) cache plus themselves, and their
eviction scores from the same probabilities: the torch math behind ``kvmodels``'
``PagedKVCache.extend_attend``, kvzip's reconstruction pass among its calls (its probe scores,
``mode="max"``).

A sequence that already holds tokens in the cache takes ``n`` more (a follow-up question, the next chunk of
a chunked prefill). Each new token attends to every kept token and causally to the new tokens up to
itself; keys are already rotated (RoPE) at their true positions, ALiBi biases by the stored positions.
The kept tokens of one KV head need not be the other heads' (per-head eviction): each KV head attends
over its own ``m`` kept tokens, so only the ALiBi bias reads per-head positions.

The scores follow the prefill scorer (``kvkernels.prefill_scores``, docs/contract.md §2.2-2.3): the score
mode's rule is applied once per scored query row, in order, starting from zero, with the mean over the
query heads of a KV group as each row's contribution. Keyformer's noise is the same counter hash as the
prefill's, indexed by (query head, query position, key position), so it does not depend on the chunking.
How those scores combine with the ones the kept tokens carry is the cache's decision
(``PagedKVCache.extend_attend``).
"""

from __future__ import annotations

import torch

# The prefill scorer's noise: the same counter hash ``prefill_scores`` draws.
from ._noise import gumbel_noise_hash


def scored_rows(n: int, mode: str, window: int) -> int:
    """The first of ``n`` query rows whose update survives: ``n - window`` (0 for ``window == 0``); for
    ``replace`` only the last row (as ``kvkernels.score_update``'s scorer)."""
    if mode == "replace":
        return n - 1
    return max(n - window, 0) if window else 0


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     kept_k: torch.Tensor, kept_v: torch.Tensor, kept_pos: torch.Tensor, *, scale: float,
                     alibi_slopes: torch.Tensor | None = None, mode: str | None = None, window: int = 0,
                     decay: float = 1.0, seed: int = 0, temperature: float = 1.0,
                     skip: tuple[int, int] | None = None, sliding_window: int = 0,
                     block: int = 128) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``n`` new tokens over ``m`` kept tokens and themselves (causal among the new ones).

    Parameters
    ----------
    q : ``[n, Hq, D]`` the new tokens' queries (after RoPE).
    k, v : ``[n, Hkv, D]`` their keys (after RoPE) and values.
    positions : ``[n]`` int, their absolute positions (all after every kept token's).
    kept_k, kept_v : ``[m, Hkv, D]`` the kept tokens of each KV head (``m`` may be 0).
    kept_pos : ``[m, Hkv]`` int, their original positions.
    scale : logit scale.
    alibi_slopes : optional ``[Hq]`` float32; the logit gets ``slope * (key_pos - query_pos)``.
    mode : score mode (``accumulate``, ``decay``, ``replace``, ``gumbel``, ``count_low``; ``max``: the largest
        probability any scored row and any query head of the KV group gives the token, kvzip's
        reconstruction score), or ``None`` / ``"none"`` for no scores.
    window : score only the last ``window`` query rows (0: all rows).
    decay, seed, temperature : the mode's parameters (``decay``: ``score = decay * score + c``; ``gumbel``:
        ``p = softmax((x + G) / temperature)`` with ``G = gumbel_noise_hash(seed, query head, query position,
        key position)``).
    skip : ``max`` only: key positions ``lo <= pos < hi`` are left out of the scores: each row's
        probabilities are renormalised over the other keys, and those tokens score 0 (kvzip's ``skip``: the
        chat template's opening before the context). The attention output is unchanged.
    sliding_window : a layer's sliding window ``W`` (0: none): each new token attends only to the keys at
        positions ``> its position - W`` (``W`` tokens, itself included), kept or new.
    block : query rows per step; memory is ``O(block * (m + n))`` per query head.

    Returns
    -------
    out : ``[n, Hq, D]`` in ``q``'s dtype.
    scores : ``[Hkv, m + n]`` float32, this extension's scores of the kept tokens then the new ones (the
        rule applied over the scored rows, from zero; a new token gets nothing from the rows before it), or
        ``None`` without a mode.
    """
    n, Hq, D = q.shape
    m, Hkv = kept_k.shape[0], k.shape[1]
    G, T = Hq // Hkv, m + n
    dev = q.device
    keys = torch.cat([kept_k, k]).float().permute(1, 2, 0)  # [Hkv, D, T]
    values = torch.cat([kept_v, v]).float().transpose(0, 1)  # [Hkv, T, D]
    key_pos = torch.cat([kept_pos.long(), positions.long()[:, None].expand(n, Hkv)]).t()  # [Hkv, T]
    q_f = q.float().view(n, Hkv, G, D)
    slopes = alibi_slopes.float().view(Hkv, G, 1, 1) if alibi_slopes is not None else None
    scoring = mode not in (None, "none")
    first = scored_rows(n, mode or "none", window) if scoring else n
    scores = torch.zeros(Hkv, T, dtype=torch.float32, device=dev) if scoring else None
    heads = torch.arange(Hq, device=dev).view(Hkv, G, 1, 1)
    columns = torch.arange(T, device=dev)
    outside = None  # ``max`` with ``skip``: the keys each row's probabilities are renormalised over
    if skip is not None and mode == "max":
        outside = ((key_pos < skip[0]) | (key_pos >= skip[1]))[:, None, None, :]  # [Hkv, 1, 1, T]
    out = torch.empty(n, Hq, D, dtype=q.dtype, device=dev)
    for start in range(0, n, block):
        end = min(start + block, n)
        C = end - start
        rows = torch.arange(start, end, device=dev)  # [C] indices among the new tokens
        q_c = q_f[start:end].permute(1, 2, 0, 3).reshape(Hkv, G * C, D)  # [Hkv, G*C, D]
        x = torch.bmm(q_c, keys).view(Hkv, G, C, T).mul_(scale)  # [Hkv, G, C, T]
        q_pos = positions[start:end].long().view(1, 1, C, 1)
        if slopes is not None:
            x.add_(slopes * (key_pos[:, None, None, :] - q_pos))
        hidden = columns > (m + rows)[:, None]  # [C, T]: new tokens after the row
        x.masked_fill_(hidden, float("-inf"))
        if sliding_window:  # keys that left the row's window (positions, per KV head)
            x.masked_fill_(key_pos[:, None, None, :] <= q_pos - sliding_window, float("-inf"))
        probs = torch.softmax(x, dim=-1)  # [Hkv, G, C, T]
        attn = torch.bmm(probs.view(Hkv, G * C, T), values).view(Hkv, G, C, D)
        out[start:end] = attn.permute(2, 0, 1, 3).reshape(C, Hq, D).to(q.dtype)
        if scores is None or end <= first:
            continue
        r0 = max(first - start, 0)  # the first scored row of this block
        if mode == "gumbel":
            noise = gumbel_noise_hash(seed, heads, q_pos[:, :, r0:], key_pos[:, None, None, :])
            probs = torch.softmax((x[:, :, r0:] + noise) / temperature, dim=-1)
        else:
            probs = probs[:, :, r0:]
        if mode == "max":  # the largest probability over the group's query heads and the scored rows
            if outside is not None:  # renormalised over the keys outside [lo, hi)
                probs = probs * outside
                probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)
            torch.maximum(scores, probs.amax(dim=(1, 2)), out=scores)
            continue
        contrib = probs.mean(dim=1)  # [Hkv, C', T]: the group mean, each row summing to 1 per KV head
        rows = rows[r0:]
        if mode == "count_low":
            threshold = 1.0 / (m + rows + 1).to(torch.float32)  # 1 / n_valid of each row
            scores -= ((contrib < threshold[:, None]) & ~hidden[r0:]).sum(dim=1)
        elif mode == "decay":
            weight = (decay ** (n - 1 - rows).double()).float()  # [C']: later rows decay less
            scores += (contrib * weight[:, None]).sum(dim=1)
        else:  # accumulate, gumbel, replace (its one row)
            scores += contrib.sum(dim=1)
    return out, scores
