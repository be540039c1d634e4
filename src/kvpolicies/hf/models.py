"""Model adapters of the transformers bridge: find a decoder's attention modules and rebuild their queries.

Nothing here knows about policies or caches. :func:`family` identifies a model (Llama-style attention with
rotary embeddings, GPT-J or MPT) or refuses it with :class:`UnsupportedModelError`, naming what to change;
:class:`Family` rebuilds a layer's rotated queries from its captured projection outputs (scores need them,
and transformers' attention interface does not hand them to the cache) and gives its softmax scale and ALiBi
slopes.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import torch


class UnsupportedModelError(ValueError):
    """The model (or its attention implementation) cannot be driven by a policy cache."""


@dataclasses.dataclass
class Family:
    """A model's decoder layers, their attention modules and head counts, as :func:`family` found them."""

    kind: str  # "llama" (attention interface + rotary embeddings), "gptj" or "mpt"
    # Modules typed Any: their attributes (q_proj, head_dim, ...) are the family's, unknown to nn.Module.
    layers: list[Any]  # decoder layers, in order
    attns: list[Any]  # their attention modules
    base: Any  # the module whose forward receives input_ids / attention_mask
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    max_positions: int | None  # the positions the model was built for (a reconstruction pass fits in them)


def _decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    base = getattr(model, "base_model", model)
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    for name in ("layers", "h", "blocks"):
        mods = getattr(base, name, None)
        if isinstance(mods, torch.nn.ModuleList) and len(mods) == n:
            return base, mods
    raise UnsupportedModelError(
        f"{type(model).__name__}: could not find its {n} decoder layers (looked for base_model.layers / .h / "
        ".blocks); kvpolicies.hf supports Llama-style, GPT-J and MPT decoders"
    )


def attention_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, list[Any], list[Any], int | None]:
    """A decoder-only model's base module, decoder layers, their attention modules and the positions it was
    built for, or :class:`UnsupportedModelError` for an encoder-decoder model or sliding / hybrid layers
    (a compressed cache needs full attention in every layer). Shared with ``kvmodels.hf``."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; a policy cache drives "
            "decoder-only causal LMs (AutoModelForCausalLM)"
        )
    layer_types = getattr(config, "layer_types", None)
    if (
        (layer_types and any(t != "full_attention" for t in layer_types))
        or getattr(config, "sliding_window", None) is not None
        and getattr(config, "use_sliding_window", True)
    ):
        raise UnsupportedModelError(
            f"{type(model).__name__} uses sliding-window / hybrid attention layers "
            f"(layer_types={layer_types}, sliding_window={getattr(config, 'sliding_window', None)}); "
            "a policy cache needs full attention in every layer. Set config.sliding_window=None if the model "
            "allows it"
        )
    base, layers = _decoder_layers(model)
    attns = []
    for layer in layers:
        attn = next(
            (getattr(layer, n) for n in ("self_attn", "attn", "attention") if hasattr(layer, n)), None
        )
        if attn is None:
            raise UnsupportedModelError(f"{type(layer).__name__} has no self_attn / attn module")
        attns.append(attn)
    names = ("max_position_embeddings", "n_positions", "max_seq_len")
    positions = next((int(getattr(config, n)) for n in names if getattr(config, n, None) is not None), None)
    return base, list(layers), attns, positions


def family(model: torch.nn.Module) -> Family:
    """Identify the model family, or raise an error that says what to change."""
    config = model.config.get_text_config(decoder=True)
    base, layers, attns, positions = attention_layers(model)
    cls = type(attns[0]).__name__
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if cls == "MptAttention":
        h = attns[0].n_heads
        return Family("mpt", list(layers), attns, base, h, h, attns[0].head_dim, positions)
    if cls == "GPTJAttention":
        h = attns[0].num_attention_heads
        return Family("gptj", list(layers), attns, base, h, h, attns[0].head_dim, positions)
    if cls.endswith("FlashAttention2") or "flash" in impl or impl == "flex_attention":
        raise UnsupportedModelError(
            f"attention implementation {impl!r} ({cls}) cannot take the per-layer masks of a compressed "
            "cache; load the model with attn_implementation='sdpa' (or 'eager')"
        )
    a = attns[0]
    modeling = sys.modules[type(a).__module__]
    if not all(hasattr(a, n) for n in ("q_proj", "k_proj", "layer_idx")) or not hasattr(
        modeling, "apply_rotary_pos_emb"
    ):
        raise UnsupportedModelError(
            f"{cls}: kvpolicies.hf supports Llama-style attention (q_proj/k_proj/v_proj with rotary "
            "position_embeddings, e.g. Llama, Mistral, Qwen2, SmolLM), GPT-J and MPT; use kvmodels for others"
        )
    if impl not in ("sdpa", "eager"):
        raise UnsupportedModelError(
            f"attention implementation {impl!r} is not supported; load the model "
            "with attn_implementation='sdpa' (or 'eager')"
        )
    return Family(
        "llama",
        list(layers),
        attns,
        base,
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        a.head_dim,
        positions,
    )


def _llama_rope(
    attn: torch.nn.Module, proj_out: torch.Tensor, norm: str, n_heads: int, ctx: dict[str, Any]
) -> torch.Tensor:
    """Rotated heads ``[B, H, L, D]`` from a q_proj/k_proj output ``[B, L, H*D]``, as the model does it."""
    x = proj_out.view(*proj_out.shape[:2], n_heads, attn.head_dim)  # [B, L, H, D]
    if hasattr(attn, norm):  # Qwen3-style per-head q_norm / k_norm before RoPE
        x = getattr(attn, norm)(x)
    x = x.transpose(1, 2)  # [B, H, L, D]
    cos, sin = ctx["position_embeddings"]
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb(x, x, cos, sin)[0]


def _gptj_rope(attn: torch.nn.Module, proj_out: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    x = proj_out.view(*proj_out.shape[:2], attn.num_attention_heads, attn.head_dim)  # [B, L, H, D]
    if ctx.get("position_embeddings") is not None:  # transformers >= 5.24 hands (sin, cos) to the attention
        sin, cos = (t.to(x.dtype) for t in ctx["position_embeddings"])
    else:  # older releases: the attention looks its table up by position
        position_ids = ctx["position_ids"]
        embed = attn._get_embed_positions(position_ids)
        sincos = torch.gather(embed, 1, position_ids.unsqueeze(-1).repeat(1, 1, embed.shape[-1])).to(x.dtype)
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
    rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    if attn.rotary_dim is not None:
        x = torch.cat([rope(x[..., : attn.rotary_dim], sin, cos), x[..., attn.rotary_dim :]], dim=-1)
    else:
        x = rope(x, sin, cos)
    return x.permute(0, 2, 1, 3)  # [B, H, L, D]


def scale_and_slopes(fam: Family, l: int, ctx: dict[str, Any]) -> tuple[float, torch.Tensor | None]:
    """Layer ``l``'s softmax scale and, for MPT, its ALiBi slopes ``[H]`` (captured by the MPT attention)."""
    attn = fam.attns[l]
    if fam.kind == "mpt":
        return float(attn.softmax_scale), ctx.get("slopes")
    if fam.kind == "gptj" and hasattr(attn, "scale_attn"):  # GPT-J before transformers 5.24
        return 1.0 / float(attn.scale_attn), None
    return float(attn.scaling), None


def rebuild_query(
    fam: Family, l: int, ctx: dict[str, Any], new_keys: torch.Tensor, check: bool
) -> torch.Tensor:
    """The rotated queries ``[B, Hq, q, D]`` of layer ``l`` from its captured projection outputs."""
    attn = fam.attns[l]
    q_out, k_out = ctx.pop(("q", l), None), ctx.pop(("k", l), None)
    if q_out is None:
        raise RuntimeError(
            f"layer {l}: the query projection was not captured; was the model called with "
            "this cache outside its forward?"
        )
    if fam.kind == "gptj":
        rebuild = functools.partial(_gptj_rope, attn, ctx=ctx)
        q, k = rebuild(q_out), (rebuild(k_out) if check else None)
    else:
        q = _llama_rope(attn, q_out, "q_norm", fam.n_q_heads, ctx)
        k = _llama_rope(attn, k_out, "k_norm", fam.n_kv_heads, ctx) if check else None
    # The queries are rebuilt outside the model's forward; prove the recipe on the keys it cached.
    if check and (
        k is None or k.shape != new_keys.shape or not torch.allclose(k, new_keys, rtol=1e-4, atol=1e-5)
    ):
        raise UnsupportedModelError(
            f"{type(attn).__name__} (layer {l}) computes its keys differently from the Llama/GPT-J recipe "
            "the bridge uses to rebuild queries for attention-mass scores; use a policy without attention "
            "scores (window, streaming, full) or the kvmodels implementation"
        )
    return q

