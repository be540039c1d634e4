"""Tiny random ``transformers`` models and helpers shared by the tests of ``kvmodels.hf`` (a transformers
model on the paged cache: ``wrap_transformers``, ``paged_cache`` inside ``model.generate``) and of the plugins
checked through it.

The models are a few thousand parameters, so the tests run torch on one thread (``one_thread``: on matrices
this small multi-threaded kernels spend their time waking threads, 20x slower on a busy 2-core machine).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from devices import DEVICE

transformers = pytest.importorskip("transformers")

V = 96
NEW = 8
_MODELS: dict[tuple[str, str, int], torch.nn.Module] = {}
_IN_HOUSE: dict[int, torch.nn.Module] = {}


def tiny(kind: str, attn: str = "sdpa", n_layers: int = 3) -> torch.nn.Module:
    """A tiny random ``kind`` model: ``llama`` (GQA 2:1), ``smollm2`` (SmolLM2's shape in miniature: tied
    embeddings, GQA 3:1, rope_theta 1e5, 2 layers), ``gptj`` (partial rotary) or ``mpt`` (ALiBi)."""
    torch.manual_seed({"llama": 0, "gptj": 1, "mpt": 2, "smollm2": 3}[kind])
    if kind == "smollm2":
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=96, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                       max_position_embeddings=128, rope_theta=100000.0,
                                       tie_word_embeddings=True, attn_implementation=attn)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=n_layers, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=128,
                                       attn_implementation=attn)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "gptj":
        cfg = transformers.GPTJConfig(vocab_size=V, n_embd=64, n_layer=n_layers, n_head=4, rotary_dim=8,
                                      n_positions=128)
        model = transformers.GPTJForCausalLM(cfg)
    else:
        cfg = transformers.MptConfig(vocab_size=V, d_model=64, n_layers=n_layers, n_heads=4, max_seq_len=128,
                                     expansion_ratio=2)
        model = transformers.MptForCausalLM(cfg)
    # No eos: generate(min_new_tokens=...) would mask it (Llama's eos is token 2) where kvmodels does not,
    # and every run here must produce exactly the tokens asked for on both sides.
    model.generation_config.eos_token_id = None
    return model.eval().to(DEVICE)


def model_of(kind: str, attn: str | None = None, n_layers: int = 3) -> torch.nn.Module:
    """:func:`tiny`, built once (``attn``: sdpa for Llama shapes, eager for GPT-J and MPT by default)."""
    attn = attn or ("sdpa" if kind in ("llama", "smollm2") else "eager")
    if (kind, attn, n_layers) not in _MODELS:
        _MODELS[kind, attn, n_layers] = tiny(kind, attn, n_layers)
    return _MODELS[kind, attn, n_layers]


def prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]


def left_pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.int64)
    mask = torch.zeros(len(batch), width, dtype=torch.int64)
    for b, p in enumerate(batch):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    return ids.to(DEVICE), mask.to(DEVICE)


def hf_generate(model: torch.nn.Module, batch: list[list[int]], cache: Any = None, new: int = NEW,
                **kw: Any) -> list[list[int]]:
    """Greedy ``model.generate`` on the left-padded batch with ``cache`` (none: the model's own dense one);
    each row's new tokens."""
    ids, mask = left_pad(batch)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             past_key_values=cache, pad_token_id=0, **kw)
    return out[:, ids.shape[1]:].tolist()


def run(model: torch.nn.Module, batch: list[list[int]], policy: Any = None, new: int = NEW,
        **cache_kw: Any) -> tuple[list[list[int]], Any]:
    """:func:`hf_generate` with a ``kvmodels.hf.paged_cache`` under ``policy`` (none: the model's own dense
    cache); returns (new tokens per sequence, the cache)."""
    from kvmodels.hf import paged_cache

    cache = None if policy is None else paged_cache(model, policy, **cache_kw)
    return hf_generate(model, batch, cache, new, use_cache=True), cache


def in_house(hf_model: torch.nn.Module) -> torch.nn.Module:
    """kvmodels' own model on ``hf_model``'s weights (its Llama, GPT-J or MPT), one conversion per model."""
    from kvmodels.gptj import GPTJ
    from kvmodels.loading import from_transformers
    from kvmodels.mpt import MPT

    if id(hf_model) not in _IN_HOUSE:
        build = {"GPTJForCausalLM": GPTJ.from_hf, "MptForCausalLM": MPT.from_hf}.get(
            type(hf_model).__name__, from_transformers)
        _IN_HOUSE[id(hf_model)] = build(hf_model)
    return _IN_HOUSE[id(hf_model)]


def kept(cache: Any, b: int) -> list[list[list[int]]]:
    """[layer][KV head] -> sorted positions sequence ``b`` keeps, in a paged cache or a ``PagedCache``'s."""
    cache = getattr(getattr(cache, "decoder", None), "cache", cache)
    return [[sorted(d["pos"].tolist()) for d in cache.head_contents(l, b)] for l in range(cache.n_layers)]


def assert_transformers_keeps_what_kvmodels_keeps(kind: str, policy: Any, new: int = NEW) -> None:
    """The transformers model under ``model.generate`` with a ``paged_cache`` and kvmodels' own model on the
    same weights and batch: the same tokens, the same kept positions per (sequence, layer, KV head), and (for
    a compressing policy) something was evicted."""
    from kvmodels import Decoder

    model = model_of(kind)
    batch = prompts([14, 9], seed=7)
    tokens, cache = run(model, batch, policy, new=new)
    dec = Decoder(in_house(model), policy)
    dec.extend(batch, max_new_tokens=new)
    assert tokens == dec.generate(new).tokens
    for b in range(len(batch)):
        assert kept(cache, b) == kept(dec.cache, b), f"sequence {b}"
    if policy.eviction.name != "full":  # the comparison is not vacuous: something was evicted
        assert max(len(h) for layer in kept(cache, 0) for h in layer) < len(batch[0]) + new - 1


def smollm2_hf(monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, list[list[int]]]:
    """The bundled SmolLM2 as a transformers model (sdpa, fp32, no eos) and a two-prompt batch for it."""
    from kvmodels.loading import CheckpointError, load_checkpoint

    try:
        loaded = load_checkpoint()
    except CheckpointError as e:
        pytest.skip(str(e))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        loaded.directory, dtype=torch.float32, attn_implementation="sdpa").eval().to(DEVICE)
    # kvmodels runs every row to max_new_tokens (no eos given); make transformers do the same, so a row that
    # happens to emit <|im_end|> is not padded by generate while kvmodels' row goes on.
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    batch = [[t % model.config.vocab_size for t in p] for p in prompts([40, 25], seed=11)]
    return model, batch


def python_output(code: str) -> str:
    """What ``code`` prints in a fresh interpreter (import state is the point of the tests using it)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
