"""``kvgen``: help, one-line errors for bad input, and real generation (tiny checkpoint; SmolLM2 slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from kvmodels.cli import CPU_COMPILE_FROM, build_parser, choose_compile, conversion_note, main  # noqa: E402

WORDS = ["<eos>", "hello", "world", "the", "cache", "is", "small", "big", "a", "b"]


def checkpoint(d, kind: str = "llama"):
    """``d`` as a Hugging Face directory: a random tiny ``kind`` model (context 64) and a word tokenizer."""
    torch.manual_seed(0)
    shape = dict(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=32, max_position_embeddings=64,
                 eos_token_id=None)  # no eos: every run makes all its tokens
    if kind == "llama":
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).save_pretrained(d)
    elif kind == "gemma3":  # sliding-window layers: a window of 4 on the first layer, the second global
        config = transformers.Gemma3TextConfig(**shape, num_key_value_heads=1, head_dim=8, sliding_window=4,
                                               layer_types=["sliding_attention", "full_attention"])
        transformers.Gemma3ForCausalLM(config).save_pretrained(d)
    else:
        config = transformers.Qwen2Config(**shape, num_key_value_heads=1)
        transformers.Qwen2ForCausalLM(config).save_pretrained(d)
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"unk_token": "a"}))
    return d


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A Hugging Face directory: random tiny Llama (context 64) + a word-level tokenizer."""
    return checkpoint(tmp_path_factory.mktemp("ckpt"))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in text
        assert action.help
    assert "examples:" in text and "squeeze+keyformer" in text


@pytest.mark.parametrize("argv, needle", [
    (["--policy", "stremaing", "hi"], "did you mean 'streaming'"),
    (["--policy", "h2o", "--budget", "0", "hi"], "budget=0"),
    (["--policy", "h2o", "--budget", "1.5", "hi"], "(0, 1]"),
    (["--policy", "h2o", "--budget", "lots", "hi"], "not a number"),
    (["--model", "/no/such/model", "hi"], "checkpoint not found"),
    (["--max-new-tokens", "0", "hi"], "--max-new-tokens"),
    (["--temperature", "-1", "hi"], "--temperature -1.0 must be"),
    (["--temperature", "nan", "hi"], "--temperature nan must be a finite number"),  # was a traceback
    (["--temperature", "inf", "hi"], "--temperature inf must be a finite number"),
    (["--batch-file", "/no/such/file.txt"], "cannot read --batch-file"),
    (["--prompt-file", "/no/such/file.txt"], "cannot read --prompt-file"),
    ([], "no prompt given"),
    ([""], "the prompt is empty"),
    (["  ", " "], "the prompt is empty"),
])
def test_bad_input_is_one_line(capsys, argv, needle):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("kvgen: error: ") and needle in err
    assert "Traceback" not in err


def test_unsupported_architecture_and_too_long_prompt(capsys, tmp_path, tiny_ckpt):
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    rc, _, err = run_cli(capsys, "--model", str(tmp_path), "hi")
    assert rc == 2 and "unsupported architecture 'mamba'" in err and "supported: llama" in err
    assert "attention interface: MambaForCausalLM has ['linear_attention'] layers" in err
    assert err.count("\n") == 1
    rc, _, err = run_cli(capsys, "--model", str(tiny_ckpt), "--no-chat", "hello " * 60)
    assert rc == 2 and "context of 64 tokens" in err and "shorten the prompt" in err and err.count("\n") == 1


def test_generation_on_a_tiny_checkpoint(capsys, tiny_ckpt, tmp_path):
    rc, out, err = run_cli(capsys, "--model", str(tiny_ckpt), "--no-chat", "--max-new-tokens", "5",
                           "--policy", "streaming", "--budget", "0.5", "hello world the cache is small " * 3)
    assert rc == 0
    assert len(out.split()) == 5 and all(w in WORDS for w in out.split())
    assert "decode 4 tokens" in err and "KV cache:" in err and "(50.0%; full = every prompt" in err
    assert "cpu float32, eager decode step" in err
    assert "layer budgets (sequence 0): 9 9" in err  # ceil(0.5 * 18)
    (tmp_path / "batch.txt").write_text("hello world\nthe cache is big\n")
    rc, out, err = run_cli(capsys, "--model", str(tiny_ckpt), "--no-chat", "--max-new-tokens", "3",
                           "--batch-file", str(tmp_path / "batch.txt"))
    assert rc == 0 and "[0] hello world" in out and "[1] the cache is big" in out
    assert "layer budgets (sequence 1)" in err and "tokens per KV head" not in err


def test_another_architecture_runs_through_transformers(capsys, tmp_path):
    """A Qwen2 checkpoint: kvmodels has no Qwen2 of its own; transformers runs it on the paged cache, and the
    tokens are the model's own greedy ones (``kvmodels.hf.wrap_transformers``)."""
    from kvmodels import load_checkpoint
    from kvmodels.hf import TransformersModel

    d = checkpoint(tmp_path, "qwen2")
    rc, out, err = run_cli(capsys, "--model", str(d), "--no-chat", "--max-new-tokens", "4", "--policy", "h2o",
                           "--budget", "0.5", "hello world the cache is small " * 3)
    assert rc == 0 and len(out.split()) == 4 and "KV cache:" in err and "(50.0%; full = every prompt" in err
    loaded = load_checkpoint(d)
    assert isinstance(loaded.model, TransformersModel)
    ids = torch.tensor([loaded.tokenizer.encode("hello world the cache is small")])
    with torch.no_grad():
        own = loaded.model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                       do_sample=False, pad_token_id=0)
    rc, out, _ = run_cli(capsys, "--model", str(d), "--no-chat", "--max-new-tokens", "4",
                         "hello world the cache is small")
    assert rc == 0 and out.split() == [WORDS[i] for i in own[0, ids.shape[1]:].tolist()]


def test_head_budgets_print_each_heads_count(capsys, tiny_ckpt):
    rc, out, err = run_cli(capsys, "--model", str(tiny_ckpt), "--no-chat", "--max-new-tokens", "3",
                           "--policy", "snapkv+adakv", "--budget", "0.5",
                           "hello world the cache is small " * 3)
    assert rc == 0 and "layer budgets (sequence 0) per KV head, mean: 9 9" in err
    line = next(x for x in err.splitlines() if x.startswith("tokens per KV head (sequence 0"))
    per_layer = [[int(n) for n in layer.split("/")] for layer in line.split(": ")[1].split()]
    # each layer's heads share 2 x 9 prompt slots (split by score), and each head appends the 2 decoded
    # tokens (snapkv does not evict while decoding)
    assert len(per_layer) == 2 and all(len(layer) == 2 and sum(layer) == 2 * (9 + 2) for layer in per_layer)


def test_prompt_file_is_one_prompt(capsys, tiny_ckpt, tmp_path):
    (tmp_path / "p.txt").write_text("hello world\nthe cache is small\n")
    rc, out, err = run_cli(capsys, "--model", str(tiny_ckpt), "--no-chat", "--max-new-tokens", "2",
                           "--prompt-file", str(tmp_path / "p.txt"))
    assert rc == 0 and "1 prompt(s), 6 tokens" in err
    (tmp_path / "empty.txt").write_text("\n  \n")
    rc, _, err = run_cli(capsys, "--prompt-file", str(tmp_path / "empty.txt"))
    assert rc == 2 and "is empty" in err and err.count("\n") == 1


def test_compile_default_is_the_faster_path():
    assert choose_compile(None, "cuda", 1)[0] is True
    assert choose_compile(None, "cpu", CPU_COMPILE_FROM - 1)[0] is False
    assert choose_compile(None, "cpu", CPU_COMPILE_FROM)[0] is True
    assert choose_compile(False, "cuda", 10**6) == (False, "as asked")
    assert "compiling costs" in choose_compile(None, "cpu", 10)[1]


def test_conversion_note_names_place_size_and_variable(tmp_path):
    from kvmodels.loading import LoadedModel

    (tmp_path / "model.safetensors").write_bytes(b"x" * 3_000_000)
    fresh = LoadedModel(model=None, tokenizer=None, hf_config={}, directory=tmp_path, converted=True)
    note = conversion_note(fresh)
    assert str(tmp_path) in note and "(3 MB)" in note and "KVPOLICIES_CACHE" in note
    assert conversion_note(LoadedModel(None, None, {}, tmp_path)) is None  # a cache hit says nothing


def test_entry_point_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "kvmodels", "--policy", "stremaing", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_smollm2_streaming_policy():
    proc = subprocess.run([sys.executable, "-m", "kvmodels", "--policy", "streaming", "--budget", "0.5",
                           "--max-new-tokens", "12", "What is the capital of France?"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "policy streaming (budget 0.5)" in proc.stderr and "KV cache:" in proc.stderr


def test_profile_without_weights_measures_the_models_retrieval_profile(capsys, tiny_ckpt):
    prompt = "hello world the cache is small " * 3
    rc, out, err = run_cli(capsys, "--model", str(tiny_ckpt), "--no-chat", "--max-new-tokens", "2",
                           "--policy", "profile+snapkv", "--budget", "0.5", prompt)
    assert rc == 0, err
    line = next(x for x in err.splitlines() if x.startswith("profile: this model's retrieval profile"))
    assert len(line.split("layer weights ")[1].split()) == 2          # one weight per layer of the model
    rc, out, err = run_cli(capsys, "--model", str(tiny_ckpt), "--no-chat", "--max-new-tokens", "2",
                           "--policy", "profile(weights=(1, 3))+snapkv", "--budget", "0.5", prompt)
    assert rc == 0 and "retrieval profile" not in err                # weights given: nothing measured
    budgets = next(x for x in err.splitlines() if x.startswith("layer budgets (sequence 0)"))
    low, high = (int(n) for n in budgets.split(": ")[1].split())
    assert low + high == 18 and high > 2 * low                       # 9 per layer on average, split 1 : 3


def test_generation_with_quantized_rows_names_the_row_format(capsys, tiny_ckpt):
    rc, out, err = run_cli(capsys, "--model", str(tiny_ckpt), "--no-chat", "--max-new-tokens", "5",
                           "--policy", "streaming+kivi(bits=4, group=8, residual=0)", "--budget", "0.5",
                           "hello world the cache is small " * 3)
    assert rc == 0 and len(out.split()) == 5
    assert "KV rows: 4-bit rows, group 8" in err and "layer budgets (sequence 0): 9 9" in err
    # full = the unquantized float32 cache: 4-bit rows plus their parameters take well under half of it
    ratio = float(err.split("MiB full (")[1].split("%")[0]) / 100
    assert ratio < 0.5 * 0.5


def test_a_device_this_torch_cannot_use_is_named(capsys, tiny_ckpt, monkeypatch):
    """``--device cuda`` on a CPU build (or with no GPU visible) raised torch's bare AssertionError from
    inside the checkpoint load; an unknown or unsupported device name likewise."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, err = run_cli(capsys, "--model", str(tiny_ckpt), "--device", "cuda", "hi")
    assert rc == 2 and err.count("\n") == 1
    assert "--device cuda: " in err and "use --device cpu" in err
    rc, _, err = run_cli(capsys, "--model", str(tiny_ckpt), "--device", "tpu", "hi")
    assert rc == 2 and "--device tpu: " in err and "use cpu or cuda" in err
    rc, _, err = run_cli(capsys, "--model", str(tiny_ckpt), "--device", "mps", "hi")
    assert rc == 2 and "--device mps: kvgen runs on cpu or cuda" in err


def test_a_sliding_window_model_names_its_windows_in_full(capsys, tmp_path):
    """A checkpoint with sliding-window layers (Gemma 3's kind) runs through transformers; its summary's
    "full" is the model's own cache, the sliding layer at its window."""
    rc, out, err = run_cli(capsys, "--model", str(checkpoint(tmp_path, "gemma3")), "--no-chat", "--policy",
                           "h2o", "--budget", "0.5", "--max-new-tokens", "6", "hello " * 20)
    assert rc == 0 and len(out.split()) == 6
    assert "full = every prompt and generated token in every layer, a sliding-window layer's last 4" in err
    budgets = next(line for line in err.splitlines() if line.startswith("layer budgets"))
    assert budgets.split(": ")[1].split()[0] == "3"  # the window's W - 1, whatever the policy's 0.5
