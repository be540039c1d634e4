"""``experiments.chunked_prefill`` (docs/results.md, "Chunked prefill against compressing once") on a tiny
random Llama and a word-level tokenizer: replaying each prompt's first chunk and running the model on the
rest gives exactly the model's own chunked generation; the entry point writes one record per config with
the single-sequence peak (budget + one chunk when chunked), resumes, and its report renders the table.
"""

from __future__ import annotations

import json

import pytest
import torch

from evals import tasks
from experiments import chunked_prefill as cp
from kvmodels.generate import generate
from kvmodels.llama import Llama, LlamaConfig
from kvpolicies import compose
from test_eval import TEXT, WordTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny() -> Llama:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, intermediate=48,
                      max_seq_len=512)
    model = Llama(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model


class Tokenizer(WordTokenizer):
    """A random model generates ids past the words seen: those decode as ``<id>``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.words[i - 1] if i <= len(self.words) else f"<{i}>" for i in ids if i > 0)


class TinyRunner:
    """What the study reads of ``evals.sweep.Runner``: model, tokenizer, samples, seed."""

    def __init__(self) -> None:
        self.model = _tiny()
        self.model_name = "tiny-llama"
        self.tokenizer = Tokenizer()
        self.corpus = tasks.Corpus.from_text(TEXT, self.tokenizer)
        self.seed = 0

    def samples(self, task: str, context: int, n: int) -> list[tasks.Sample]:
        assert task == "passkey"
        return tasks.passkey_samples(self.tokenizer, self.corpus, n, context, self.seed)


@pytest.fixture(scope="module")
def runner() -> TinyRunner:
    return TinyRunner()


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "streaming"])
def test_replayed_first_chunk_equals_the_models_chunked_generation(runner, name):
    prompts = [list(s.prompt) for s in runner.samples("passkey", 120, 2)]
    policy = compose(name, budget=0.3)
    replay = cp._replay_class()(runner.model)
    replay.record([p[:40] for p in prompts])
    direct = generate(runner.model, prompts, 4, policy, chunk=40)
    replayed = generate(replay, prompts, 4, policy, chunk=40)
    assert replayed.tokens == direct.tokens
    assert replayed.report.tokens_per_layer == direct.report.tokens_per_layer
    assert replayed.report.peak_bytes == direct.report.peak_bytes


def test_spread_covers_the_depths():
    assert cp.spread(24, 8) == [0, 3, 6, 9, 12, 15, 18, 21]
    assert cp.spread(5, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="chunk-n"):
        cp.spread(4, 5)


def test_entry_point_records_resumes_and_reports(runner, tmp_path, capsys):
    out = tmp_path / "chunked.jsonl"
    argv = ["--contexts", "120", "--n", "4", "--chunk-n", "2", "--policies", "snapkv;streaming",
            "--budgets", "0.25", "--chunks", "40,100,200", "--batch", "2", "--out", str(out)]
    assert cp.main(argv, runner=runner) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2 * 4  # 2 policies x (once, chunk=40, chunk=100, chunk=200)
    by = {(r["policy"], r["chunk"]): r for r in recs}
    for pol in ("snapkv", "streaming"):
        once, small, whole = by[(pol, None)], by[(pol, 40)], by[(pol, 200)]
        assert once["samples"] == [0, 1, 2, 3] and small["samples"] == whole["samples"] == [0, 2]
        # A chunk longer than the prompt is compressing once: same answers as once on those samples.
        assert whole["outputs"] == [once["outputs"][i] for i in whole["samples"]]
        assert whole["kv_peak_bytes"] == once["kv_peak_bytes"] <= once["kv_bytes_full"]  # the whole prompt
        # Chunked: the peak is the budget plus one chunk, below the whole prompt's.
        assert small["kv_bytes"] < small["kv_peak_bytes"] < once["kv_peak_bytes"]
        assert all(len(o) > 0 for o in small["outputs"]) and small["n_run"] == 2
        # Budget + chunk past the prompt (30 + 100 > ~120 + 8 new tokens), which generate() would refuse:
        # it runs, and holds no more than the whole prompt.
        assert by[(pol, 100)]["kv_peak_bytes"] <= once["kv_peak_bytes"]
    capsys.readouterr()
    assert cp.main(argv, runner=runner) == 0  # everything recorded: nothing runs again
    assert len(out.read_text().splitlines()) == 8
    table = cp.report(out)
    assert "| `snapkv` | 0.25 |" in table and "chunk=40 (2)" in table and "once (4)" in table
