"""Per-layer retrieval profile of a model, for the ``profile`` layer-budget policy.

RazorAttention (Tang et al., 2024) finds the heads that retrieve from far back in the context on a prompt
that holds no information at all: random tokens, repeated. In the second copy, a head that attends to the
earlier occurrence of the current token is an *echo* head; one that attends to the token *after* that
occurrence (and so can copy what came next) is an *induction* head. Both scores are the mean attention
probability on that one key, over the second copy's queries; a head that ignores the repetition scores about
``1 / position``.

``retrieval_profile`` turns them into per-layer weights, ``floor + max over the layer's heads of
max(echo, induction)``, for ``compose(("profile", {"weights": w}), ...)``: layers with a retrieval head get
more of the total budget, the rest keep at least ``floor`` relative to them. The measurement needs no data
and runs once per model (a few seconds on CPU for a 135M model).
"""

from __future__ import annotations

from typing import Any

import torch

from kvkernels import prefill_attention


class _Recorder:
    """Receives a dense prefill as a cache would (``prefill_attend``) and keeps each layer's echo and
    induction scores ``[Hq]`` for a prompt that is ``T`` random tokens twice."""

    def __init__(self, T: int) -> None:
        self.T = T
        self.echo: dict[int, torch.Tensor] = {}
        self.induction: dict[int, torch.Tensor] = {}

    def prefill_attend(self, l: int, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       positions: torch.Tensor, *, scale: float) -> torch.Tensor:
        T = self.T
        Hq, Hkv = q.shape[1], k.shape[1]
        rows = torch.arange(T + 1, 2 * T, device=q.device)               # second copy, after its first token
        k_q = k.float().repeat_interleave(Hq // Hkv, dim=1)               # [2T, Hq, D]
        logits = torch.einsum("rhd,khd->hrk", q[rows].float(), k_q) * scale  # [Hq, R, 2T]
        visible = torch.arange(2 * T, device=q.device)[None, :] <= rows[:, None]
        p = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        r = torch.arange(rows.numel(), device=q.device)
        self.echo[l] = p[:, r, rows - T].mean(dim=1).cpu()                # the same token, one copy back
        self.induction[l] = p[:, r, rows - T + 1].mean(dim=1).cpu()       # the token that followed it
        return prefill_attention(q, k, v, scale=scale)[0]

    def prefill_layer(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("retrieval_scores needs a model that runs its prompt attention through "
                         "cache.prefill_attend (Llama, GPT-J); this one computes its own (ALiBi or shared KV "
                         "layers) and calls prefill_layer")

    def observe(self, l: int, b: int, h_in: torch.Tensor, attn_out: torch.Tensor) -> None:
        pass


def retrieval_scores(model: Any, *, length: int | None = None, trials: int = 3, seed: int = 0,
                     vocab: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Echo and induction scores of every query head, ``([n_cache_layers, Hq], [n_cache_layers, Hq])``
    float32, the mean over ``trials`` prompts of ``length`` distinct random tokens repeated twice.

    ``vocab`` is the ``[low, high)`` range the tokens are drawn from (default: the upper 90% of the
    embedding table, away from the special and byte tokens at the start of most vocabularies); ``length``
    defaults to 200, or less where the context or that range is smaller. The model must run its prompt
    attention through ``cache.prefill_attend`` (Llama, GPT-J; not the ALiBi models).
    """
    n_vocab = model.config.vocab_size
    low, high = vocab if vocab is not None else (n_vocab // 10, n_vocab)
    if length is None:
        length = min(200, model.max_seq_len // 2, high - low)
    if isinstance(length, bool) or not isinstance(length, int) or length < 2:
        raise ValueError(f"length={length!r} must be an int >= 2 (tokens per copy)")
    if 2 * length > model.max_seq_len:
        raise ValueError(f"length={length} repeated twice exceeds the model's max_seq_len "
                         f"{model.max_seq_len}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials={trials!r} must be an int >= 1")
    if not 0 <= low < high <= n_vocab or high - low < length:
        raise ValueError(f"vocab={vocab!r} must be a range [low, high) inside [0, {n_vocab}) holding at "
                         f"least length={length} tokens")
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    echo, induction = [], []
    with torch.no_grad():
        for _ in range(trials):
            # Distinct tokens, so each query of the second copy has exactly one earlier occurrence.
            first = low + torch.randperm(high - low, generator=g)[:length]
            rec = _Recorder(length)
            model.prefill(torch.cat([first, first]).to(device), rec, 0, last_only=True)
            if len(rec.echo) != model.n_cache_layers:
                raise ValueError(f"{type(model).__name__} reported {len(rec.echo)} of {model.n_cache_layers} "
                                 "cache layers through prefill_attend; retrieval_scores needs a model that "
                                 "runs its prompt attention through cache.prefill_attend")
            echo.append(torch.stack([rec.echo[l] for l in range(model.n_cache_layers)]))
            induction.append(torch.stack([rec.induction[l] for l in range(model.n_cache_layers)]))
    return torch.stack(echo).mean(0), torch.stack(induction).mean(0)


def retrieval_profile(model: Any, *, floor: float = 0.25, **kwargs: Any) -> tuple[float, ...]:
    """Per-layer weights for the ``profile`` budget policy: ``floor`` + the layer's strongest echo or
    induction score (:func:`retrieval_scores`, which takes ``kwargs``), rounded to 4 decimals."""
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not floor > 0:
        raise ValueError(f"floor={floor!r} must be a number > 0 (the weight of a layer without retrieval "
                         "heads)")
    echo, induction = retrieval_scores(model, **kwargs)
    strongest = torch.maximum(echo, induction).amax(dim=1)              # [n_cache_layers]
    return tuple(round(float(floor + s), 4) for s in strongest)


def retrieval_head_weights(model: Any, **kwargs: Any) -> tuple[tuple[float, ...], ...]:
    """Per cache layer, one retrieval score per KV head for the ``duo`` head-budget policy: the strongest
    echo or induction score (:func:`retrieval_scores`, which takes ``kwargs``) of the head's group of query
    heads, rounded to 4 decimals."""
    echo, induction = retrieval_scores(model, **kwargs)
    strongest = torch.maximum(echo, induction)                          # [n_cache_layers, Hq]
    n_kv = model.cache_layout().n_kv_heads
    per_kv = strongest.view(strongest.shape[0], n_kv, -1).amax(dim=2)   # query heads grouped by KV head
    return tuple(tuple(round(float(x), 4) for x in row) for row in per_kv)


class ModelProbe:
    """What budget policies may measure on a kvmodels model (``kvpolicies.base.ModelProbe``), for
    ``ComposedPolicy.calibrate``: ``compose("profile+snapkv").calibrate(ModelProbe(model))`` measures the
    ``profile`` weights once for this model. Each measurement is computed on first use and kept."""

    name = "kvmodels.profile"

    def __init__(self, model: Any) -> None:
        self.model = model
        self._profile: tuple[float, ...] | None = None
        self._heads: tuple[tuple[float, ...], ...] | None = None

    def retrieval_profile(self) -> tuple[float, ...]:
        """:func:`retrieval_profile` with its defaults."""
        if self._profile is None:
            self._profile = retrieval_profile(self.model)
        return self._profile

    def retrieval_heads(self) -> tuple[tuple[float, ...], ...]:
        """:func:`retrieval_head_weights` with its defaults."""
        if self._heads is None:
            self._heads = retrieval_head_weights(self.model)
        return self._heads
