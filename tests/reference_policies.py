"""Naive dense references of the eviction papers, for one sequence, written for clarity, not speed.

Each policy is written from its paper (see the module docstrings in ``kvpolicies/eviction/``), without
the policy objects, the score-mode table or the kernels, so the tests can check that a policy's
*description* (forced slots + score rules + top-k) keeps exactly the tokens the paper would, and the cache
tests can check the real paged cache end to end::

    from reference_policies import simulate
    steps = simulate("h2o", {"recent": 0.5}, q_prompt, k_prompt, q_steps, k_steps, budget=8)
    steps[0].kept     # [Hkv, n] token ids kept after the prompt
    steps[t + 1].kept # ... after decode step t

Conventions (the contract's, docs/contract.md §2.2–§2.4 and §4–§5):

* Token ids are positions: the prompt is ``0 .. L-1``, decode step ``t`` adds token ``L + t``.
* A step's attention of KV head ``h`` is the mean over its ``G`` query heads of the softmax over the
  tokens that head holds (the new token included), scores per KV head; never expanded to query heads.
* Prompt scoring is causal: query row ``i`` attends to tokens ``0 .. i``.
* Selection keeps ``b`` tokens: the forced ones (sinks, recent window), then the highest scores;
  **ties: the earlier token wins**. Kept tokens stay in original order.
* Decode step ``t``: append the token (score 0), attend, update scores, then evict down to ``b`` when
  ``(t + 1) % evict_every == 0`` and the policy evicts during decoding. Between steps a head holds at
  most ``b + evict_every - 1`` tokens.
* Budgets: ``b = min(L, ceil(budget * L))`` (float) or ``min(L, budget)`` (int), then at least the
  policy's minimum (``sinks + 1`` for streaming, else 1). ``full`` keeps everything.
* Keyformer's Gumbel noise: ``prefill_noise[hq, i, j]`` for query row ``i`` and token ``j``;
  ``decode_noise(t, n)[hq, slot]`` for the ``n`` slots held at step ``t`` (slot = index among the kept
  tokens in order). Pass the cache's noise to compare with the cache exactly; by default it is drawn
  from ``torch.Generator`` seeded by ``seed``.

Scores are float64 by default (``dtype=``) so that only exact ties are ties.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

# Paper defaults, repeated here on purpose (the reference must not read the policy classes).
DEFAULTS: dict[str, dict[str, Any]] = {
    "full": {},
    "window": {},
    "streaming": {"sinks": 4},
    "h2o": {"recent": 0.5},
    "keyformer": {"tau_init": 1.0, "tau_end": 2.0, "recent": 0.3},
    "a2sf": {"decay": 0.9, "recent": 0.5},
    "snapkv": {"window": 32, "kernel": 7, "pooling": "max", "chunk": 1, "per_head": True, "align": "grid"},
    "chunkkv": {"window": 32, "chunk": 10, "reuse": 1, "per_head": True, "align": "grid"},
    "scissorhands": {"recent": 0.5},
    "tova": {"per_head": False, "decode": True},
    "knorm": {"decode": True},
}


class Step(NamedTuple):
    """What a head holds after the prompt or after one decode step."""

    kept: torch.Tensor     # [Hkv, n] int64 token ids, increasing along n
    scores: torch.Tensor   # [Hkv, n] scores of those tokens (zeros for score-free policies)


# ---------------------------------------------------------------------------------------------------------
# attention
def group_probs(q: torch.Tensor, keys: torch.Tensor, scale: float, *, noise: torch.Tensor | None = None,
                temperature: float = 1.0) -> torch.Tensor:
    """One query step's attention mass per token, averaged over a KV group's query heads.

    q: ``[G, D]`` the group's queries; keys: ``[n, D]`` the tokens the KV head holds;
    noise: ``[G, n]`` Gumbel noise (Keyformer) or None. Returns ``[n]`` float32 (the cache's precision,
    which matters for ``count_low``'s exact ``1 / n`` threshold at uniform attention), summing to 1.
    With noise the softmax is ``softmax((x + noise) / temperature)``, ``x = scale * q.k``.
    """
    if keys.shape[0] == 0:
        return torch.zeros(0)
    logits = (q.float() @ keys.float().T) * scale                      # [G, n]
    if noise is not None:
        logits = (logits + noise.float()) / temperature
    # Written out rather than torch.softmax, whose intra-op threading costs milliseconds on tiny rows.
    e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    return (e / e.sum(dim=-1, keepdim=True)).mean(0)                   # [n]


def below_average(a: torch.Tensor, n: int) -> torch.Tensor:
    """Scissorhands' test ``a < 1 / n``, in float32 like the cache."""
    return a.float() < 1.0 / torch.tensor(float(n), dtype=torch.float32)


def gumbel(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Standard Gumbel samples, float32."""
    u = torch.rand(shape, generator=generator).clamp(1e-10, 1 - 1e-7)
    return -torch.log(-torch.log(u))


def default_prefill_noise(seed: int, n_q_heads: int, prompt_len: int) -> torch.Tensor:
    """``[Hq, L, L]`` Gumbel noise for scoring the prompt: the kernels' counter hash when it exists."""
    try:
        from kvkernels._noise import gumbel_noise_hash
    except ImportError:
        return gumbel((n_q_heads, prompt_len, prompt_len), torch.Generator().manual_seed(seed))
    head = torch.arange(n_q_heads)[:, None, None]
    idx = torch.arange(prompt_len)
    return gumbel_noise_hash(seed, head, idx[None, :, None], idx[None, None, :]).float()


def default_decode_noise(seed: int, n_q_heads: int) -> Callable[[int, int], torch.Tensor]:
    """``noise(step, n) -> [Hq, n]``: fresh Gumbel noise per decode step, reproducible from ``seed``."""
    def noise(step: int, n: int) -> torch.Tensor:
        return gumbel((n_q_heads, n), torch.Generator().manual_seed(seed * 1_000_003 + step + 1))
    return noise


# ---------------------------------------------------------------------------------------------------------
# the papers' rules
def resolve_budget(name: str, params: dict[str, Any], budget: float | int, prompt_len: int,
                   min_tokens: int = 4) -> int:
    """Tokens per head for one sequence (docs/contract.md §4), or the prompt length for ``full``.

    A fraction of the prompt, rounded up, at most the prompt; an int is a cache size, taken as is. Then
    raised to the floor: ``min_tokens`` or, for streaming, its sinks + 1 if that is more.
    """
    if name == "full":
        return prompt_len
    b = min(math.ceil(budget * prompt_len - 1e-9), prompt_len) if isinstance(budget, float) else budget
    minimum = max(min_tokens, params["sinks"] + 1 if name == "streaming" else 1)
    return max(b, minimum)


def recent_count(fraction: float, b: int) -> int:
    """``floor(fraction * b)`` with a guard against binary rounding (0.29 * 100 = 28.999…)."""
    return min(b, math.floor(fraction * b + 1e-9))


def kept_by_fixed_scores(keep_head: Callable[[list[int], int], list[int]], n_heads: int, L: int, T: int,
                         evict_every: int) -> list[list[list[int]]]:
    """``[step][head]`` kept positions of a rule whose scores are fixed when a token is cached (an open
    score rule): ``keep_head(ids, h)`` (head ``h``'s kept positions out of ``ids``) after the prompt
    ``0 .. L-1`` and after every ``evict_every``-th of ``T`` decode steps, each adding position ``L + t``."""
    ids = [keep_head(list(range(L)), h) for h in range(n_heads)]
    out = [ids]
    for t in range(T):
        ids = [i + [L + t] for i in ids]
        if (t + 1) % evict_every == 0:
            ids = [keep_head(i, h) for h, i in enumerate(ids)]
        out.append(ids)
    return out


def keep(name: str, params: dict[str, Any], ids: list[int], scores: list[float], b: int) -> list[int]:
    """Indices into ``ids`` (one head's tokens, in order) that the paper keeps with budget ``b``."""
    n = len(ids)
    if n <= b or name == "full":
        return list(range(n))
    if name == "window":                    # the b most recent
        return list(range(n - b, n))
    if name == "streaming":                 # s sinks + the b - s most recent
        s = min(params["sinks"], b - 1)
        return list(range(s)) + list(range(n - (b - s), n))
    if name in ("tova", "knorm"):           # the b highest scores, nothing forced
        n_recent = 0
    elif name in ("snapkv", "chunkkv"):     # the observation window + the best of the rest
        n_recent = min(params["window"], b)
    else:                                   # h2o, keyformer, a2sf, scissorhands: recent + the best
        n_recent = recent_count(params["recent"], b)
    recent = list(range(n - n_recent, n))
    candidates = sorted(range(n - n_recent), key=lambda i: (-scores[i], ids[i]))   # ties: earlier token
    return sorted(candidates[: b - n_recent] + recent)


def placed_chunks(x: torch.Tensor, c: int) -> torch.Tensor:
    """``[n]`` -> ``[n]``: every token scores the total of its chunk, the chunks placed greedily: the span of
    ``c`` tokens with the highest total first (ties: the earlier), then the best span that overlaps no
    placed chunk, and so on; the runs of tokens left between chunks are chunks of their own, scored by their
    total scaled to ``c`` tokens. Totals are summed left to right."""
    def total(a: int, b: int) -> torch.Tensor:
        t = x[a]
        for j in range(a + 1, b):
            t = t + x[j]
        return t

    n = len(x)
    spans = {s: total(s, s + c) for s in range(n - c + 1)}
    out = x.clone()
    placed = [False] * n
    for s in sorted(spans, key=lambda s: (-float(spans[s]), s)):
        if not any(placed[s:s + c]):
            out[s:s + c] = spans[s]
            placed[s:s + c] = [True] * c
    j = 0
    while j < n:                                  # a run of tokens no chunk holds
        if placed[j]:
            j += 1
            continue
        end = j
        while end < n and not placed[end]:
            end += 1
        out[j:end] = total(j, end) * c / (end - j)     # scaled to a chunk's length: its mean x c
        j = end
    return out


def prompt_scores(name: str, params: dict[str, Any], q: torch.Tensor, k: torch.Tensor, scale: float,
                  noise: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``[Hkv, L]`` scores of the prompt tokens, computed from the dense causal attention per paper."""
    L, n_q_heads, _ = q.shape
    n_kv_heads = k.shape[1]
    group = n_q_heads // n_kv_heads
    scores = torch.zeros(n_kv_heads, L, dtype=dtype)
    if name in ("full", "window", "streaming"):
        return scores
    if name == "knorm":                                   # the lowest key norms first
        return -k.to(dtype).norm(dim=-1).t()
    first_row = max(0, L - params["window"]) if name in ("snapkv", "chunkkv") else 0
    for h in range(n_kv_heads):
        qh = q[:, h * group:(h + 1) * group]                           # [L, G, D]
        for i in range(first_row, L):
            if name == "keyformer":
                noise_i = noise[h * group:(h + 1) * group, i, : i + 1]      # [G, i + 1]
                a = group_probs(qh[i], k[: i + 1, h], scale, noise=noise_i, temperature=params["tau_init"])
            else:
                a = group_probs(qh[i], k[: i + 1, h], scale)
            if name in ("h2o", "keyformer", "snapkv", "chunkkv"):    # accumulated attention
                scores[h, : i + 1] += a
            elif name == "a2sf":                          # accumulated with forgetting
                scores[h, : i + 1] = params["decay"] * scores[h, : i + 1] + a
            elif name == "scissorhands":                  # minus the count of below-average steps
                scores[h, : i + 1] -= below_average(a, i + 1).to(dtype)
            elif name == "tova":                          # the latest query's attention
                scores[h, : i + 1] = a.to(dtype)
    if name == "tova" and not params["per_head"]:        # the paper: averaged over the layer's heads
        scores[:] = scores.mean(0)
    if name == "snapkv":
        n_prefix = L - min(params["window"], L)
        if n_prefix > 0:
            pool = F.max_pool1d if params["pooling"] == "max" else F.avg_pool1d
            k_size = params["kernel"]
            prefix = scores[:, None, :n_prefix]                          # [Hkv, 1, L - W]
            scores[:, :n_prefix] = pool(prefix, k_size, stride=1, padding=k_size // 2)[:, 0]
    if name in ("snapkv", "chunkkv") and params["chunk"] > 1:  # every prefix token scores its chunk's total
        n_prefix = L - min(params["window"], L)
        c = params["chunk"]
        if params.get("align", "grid") == "grid":               # chunks every c tokens from the first
            for start in range(0, n_prefix, c):
                end = min(start + c, n_prefix)
                scores[:, start:end] = scores[:, start:end].sum(-1, keepdim=True)
        elif params["per_head"]:                                 # chunks placed on each head's scores
            for h in range(n_kv_heads):
                scores[h, :n_prefix] = placed_chunks(scores[h, :n_prefix], c)
        elif n_prefix > 0:                                       # ... on the heads' mean, once per layer
            scores[:, :n_prefix] = placed_chunks(scores[:, :n_prefix].mean(0), c)
    if name in ("snapkv", "chunkkv") and not params["per_head"]:  # one ranking for the layer, after pooling
        scores[:] = scores.mean(0)
    return scores


def step_update(name: str, params: dict[str, Any], old: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """One decode step's score update of one head's ``[n]`` scores given its attention ``a [n]``."""
    if name in ("h2o", "keyformer"):
        return old + a
    if name == "a2sf":
        return params["decay"] * old + a
    if name == "scissorhands":
        return old - below_average(a, a.numel()).to(old.dtype)
    if name == "tova":
        return a.to(old.dtype)
    return old   # full, window, streaming, snapkv keep no decode scores


def evicts_during_decode(name: str, params: dict[str, Any]) -> bool:
    return name not in ("full", "snapkv", "chunkkv") and params.get("decode", True)


# ---------------------------------------------------------------------------------------------------------
def simulate(policy: str, params: dict[str, Any] | None, q_prompt: torch.Tensor, k_prompt: torch.Tensor,
             q_steps: torch.Tensor, k_steps: torch.Tensor, budget: float | int, seed: int = 0, *,
             evict_every: int = 1, max_new_tokens: int | None = None, scale: float | None = None,
             prefill_noise: torch.Tensor | None = None,
             decode_noise: Callable[[int, int], torch.Tensor] | None = None,
             dtype: torch.dtype = torch.float64) -> list[Step]:
    """Run one sequence through a policy, densely.

    Parameters
    ----------
    policy : str
        Eviction policy name (a key of ``DEFAULTS``).
    params : dict or None
        Parameters overriding the paper defaults.
    q_prompt : ``[L, Hq, D]``; k_prompt : ``[L, Hkv, D]``
    q_steps : ``[T, Hq, D]``; k_steps : ``[T, Hkv, D]`` — queries and keys of the decode steps.
    budget : float in (0, 1] or int — resolved with ``resolve_budget``.
    seed : int — seeds the default Gumbel noise (Keyformer).
    evict_every : int — decode-time eviction period.
    max_new_tokens : int — Keyformer's temperature schedule length (default ``T``).
    scale : float — logit scale (default ``D ** -0.5``).

    Returns
    -------
    list of ``Step``, length ``T + 1``: after the prompt, then after each decode step.
    """
    if policy not in DEFAULTS:
        raise KeyError(f"no reference for {policy!r}; known: {sorted(DEFAULTS)}")
    p = {**DEFAULTS[policy], **(params or {})}
    L, n_q_heads, head_dim = q_prompt.shape
    n_kv_heads = k_prompt.shape[1]
    group = n_q_heads // n_kv_heads
    T = q_steps.shape[0]
    scale = head_dim ** -0.5 if scale is None else scale
    max_new_tokens = max(T, 1) if max_new_tokens is None else max_new_tokens
    b = resolve_budget(policy, p, budget, L)
    if policy == "keyformer" and prefill_noise is None:
        prefill_noise = default_prefill_noise(seed, n_q_heads, L)
    if policy == "keyformer" and decode_noise is None:
        decode_noise = default_decode_noise(seed, n_q_heads)

    all_k = torch.cat([k_prompt, k_steps], dim=0)                     # [L + T, Hkv, D], row = token id
    scores = prompt_scores(policy, p, q_prompt, k_prompt, scale, prefill_noise, dtype)
    ids = [list(range(L)) for _ in range(n_kv_heads)]
    head_scores = [scores[h].tolist() for h in range(n_kv_heads)]

    def evict() -> None:
        if not p.get("per_head", True):  # one ranking for the layer: every head holds the same ids
            assert all(ids[h] == ids[0] for h in range(n_kv_heads))
            mean = [sum(col) / n_kv_heads for col in zip(*head_scores)]
            for h in range(n_kv_heads):
                head_scores[h] = list(mean)
        for h in range(n_kv_heads):
            chosen = keep(policy, p, ids[h], head_scores[h], b)
            ids[h] = [ids[h][i] for i in chosen]
            head_scores[h] = [head_scores[h][i] for i in chosen]

    def snapshot() -> Step:
        return Step(torch.tensor(ids, dtype=torch.int64).reshape(n_kv_heads, -1),
                    torch.tensor(head_scores, dtype=dtype).reshape(n_kv_heads, -1))

    if policy != "full":
        evict()
    out = [snapshot()]
    for t in range(T):
        noise = decode_noise(t, len(ids[0]) + 1) if policy == "keyformer" else None   # [Hq, n]
        tau = 1.0
        if policy == "keyformer":   # tau_t = tau_init + t (tau_end - tau_init) / max_new_tokens, t = step + 1
            tau = p["tau_init"] + (t + 1) * (p["tau_end"] - p["tau_init"]) / max_new_tokens
        for h in range(n_kv_heads):
            ids[h].append(L + t)
            head_scores[h].append(-float(k_steps[t, h].to(dtype).norm()) if policy == "knorm" else 0.0)
            keys = all_k[ids[h], h]                                    # [n, D]
            noise_h = None if noise is None else noise[h * group:(h + 1) * group]
            a = group_probs(q_steps[t, h * group:(h + 1) * group], keys, scale, noise=noise_h,
                            temperature=tau)
            head_scores[h] = step_update(policy, p, torch.tensor(head_scores[h], dtype=dtype), a).tolist()
        if evicts_during_decode(policy, p) and (t + 1) % evict_every == 0:
            evict()
        out.append(snapshot())
    return out
