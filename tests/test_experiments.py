"""The passkey diagnostics in ``experiments/`` (docs/results.md, "The last ~4k answer at 0.5") on a tiny
model: ``passkey_margins.teacher_forced`` must agree with greedy decoding, and ``passkey_layer_ablation``'s
``LayerAblated`` must keep exactly the chosen layers whole and leave every other layer as the policy has it;
``passkey_profile``'s report must count the full cache's answers a variant keeps. Every study's entry point
(``python -m experiments.<name>``) parses its arguments.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import experiments
from devices import DEVICE
from evals.sweep import append_record
from experiments import passkey_layer_ablation as ablation
from experiments import passkey_margins as margins
from experiments import passkey_profile as pp
from kvmodels.generate import generate
from kvpolicies import compose
from test_generate import V, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


MODEL = tiny_llama(n_layers=3)


@settings(max_examples=15, deadline=None)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=40), n_new=st.integers(1, 6),
       flip=st.integers(0, 5))
def test_teacher_forced_margins_agree_with_greedy(prompt, n_new, flip):
    greedy = generate(MODEL, [prompt], n_new).tokens[0]
    p_key, p_other, other = margins.teacher_forced(MODEL, prompt, greedy)
    assert p_key.shape == p_other.shape == other.shape == (n_new,)
    assert bool((p_key > p_other).all()), "greedy's own tokens are the argmax at every position"
    assert not bool((other == torch.tensor(greedy, device=DEVICE)).any())
    # The first probability is the dense next-token distribution after the prompt.
    with torch.no_grad():
        first = torch.softmax(MODEL.prefill(torch.tensor(prompt, device=DEVICE), None, 0)[-1].float(), dim=-1)
    torch.testing.assert_close(p_key[0], first[greedy[0]], rtol=1e-4, atol=1e-6)
    # Replace one token by the runner-up: that position's margin turns negative, the ones before it stay.
    j = flip % n_new
    changed = list(greedy)
    changed[j] = int(other[j])
    q_key, q_other, _ = margins.teacher_forced(MODEL, prompt, changed)
    assert float(q_key[j]) < float(q_other[j])
    torch.testing.assert_close(q_key[:j], p_key[:j])


def _layer_tokens(policy, prompts, n_new):
    result = generate(MODEL, prompts, n_new, policy, page_size=4)
    return result.tokens, result.report.tokens_per_layer


@pytest.mark.parametrize("name", ["snapkv", "squeeze+h2o"])
def test_layer_ablated_keeps_exactly_the_chosen_layers_whole(name):
    prompts = [list(range(3, 50)), [7, 1, 4] * 12]
    n_new = 5
    policy = compose(name, budget=0.25)
    n_layers = MODEL.n_cache_layers
    tokens, kept = _layer_tokens(policy, prompts, n_new)
    full_tokens, full_kept = _layer_tokens(compose("full"), prompts, n_new)
    assert all(kept[l][b] < full_kept[l][b] for l in range(n_layers) for b in range(2)), "it compresses"

    none_tokens, none_kept = _layer_tokens(ablation.ablated(policy, set()), prompts, n_new)
    assert none_tokens == tokens and none_kept == kept

    all_tokens, all_kept = _layer_tokens(ablation.ablated(policy, set(range(n_layers))), prompts, n_new)
    assert all_tokens == full_tokens and all_kept == full_kept

    for layer in range(n_layers):
        _, one_kept = _layer_tokens(ablation.ablated(policy, {layer}), prompts, n_new)
        for l in range(n_layers):
            # the chosen layer keeps everything; the others exactly what the policy keeps (their budgets
            # are the policy's own, also under squeeze, which moves budget between layers)
            assert one_kept[l] == (full_kept[l] if l == layer else kept[l])


def test_passkey_profile_report_counts_the_full_caches_answers(tmp_path, monkeypatch, capsys):
    """``passkey_profile --report``: a cell counts the full cache's correct answers the variant keeps, and
    separately the ones only the variant gets right; a full-cache record in the profile file wins."""
    answers = ["11111", "22222", "33333", "44444"]
    variants_file, out = tmp_path / "variants.jsonl", tmp_path / "profile.jsonl"
    monkeypatch.setattr(pp, "FULL_RECORDS", variants_file)
    append_record(variants_file, {"variant": "full", "context": 1024, "n": 4, "seed": 0,
                                  "outputs": [" 11111.", " 22222.", " 33333.", " 1."]})
    base = {"task": "passkey", "context": 1024, "n": 4, "answers": answers, "eviction": pp.SETTING}
    append_record(out, {**base, "variant": "uniform", "budget": 0.2, "seed": 0,
                        "outputs": [" 11111.", " 2222.", " 33333.", " 44444."]})      # keeps 2 of 3, +1
    append_record(out, {**base, "variant": "full", "budget": 1.0, "seed": 7, "eviction": "full",
                        "outputs": [" 11111.", " 9.", " 9.", " 9."]})
    append_record(out, {**base, "variant": "uniform", "budget": 0.2, "seed": 7,
                        "outputs": [" 11111.", " 22222.", " 9.", " 9."]})             # keeps 1 of 1, +1
    assert pp.report(out) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "`uniform`" in line)
    assert "| 3 of 4 (75%) +2 |" in row and "seed 0: 2/3 +1; seed 7: 1/1 +1" in row


ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted(m.name for m in pkgutil.iter_modules(experiments.__path__))


def test_the_studies_are_all_here():
    assert STUDIES == ["adakv_imbalance", "adakv_retrieval", "chunked_prefill", "gemma3_passkey",
                       "hf_kivi_perplexity",
                       "hf_wrap_speed", "key_digits_kept", "kivi_channel_keys", "kvpress_question_agnostic",
                       "passkey_layer_ablation", "passkey_margins", "passkey_profile", "passkey_variants",
                       "quantized_baseline", "quantized_kv", "question_agnostic"]


def test_quantized_kv_table_reads_its_records():
    from experiments.quantized_kv import table

    recs = [{"task": "passkey", "context": 1024, "policy": "full+kivi", "budget": 1.0, "correct": 22, "n": 24,
             "slot_bytes": 264.0, "fp16_slot_bytes": 792, "held_vs_fp16": 0.3333},
            {"task": "perplexity", "context": 4096, "policy": "full", "budget": 1.0, "ppl": 52.561}]
    lines = table(recs).splitlines()
    assert lines[2] == "| passkey 1024 | `full+kivi` | 1 | 22 of 24 | 264 (792); held 33.3% of fp16 |"
    assert lines[3] == "| perplexity 4096 | `full` | 1 | ppl 52.56 | - |"


def test_quantized_kv_configs_all_compose():
    """Every config the quantized study runs is a valid policy at its budget (a typo would cost a run its
    row, recorded as an error an hour in)."""
    from experiments.quantized_kv import PERPLEXITY, SETS

    for configs in [*SETS.values(), PERPLEXITY]:
        for name, budget in configs:
            assert compose(compose(name, budget=budget).spec()) == compose(name, budget=budget)


def test_quantized_kv_side_by_side_counts_each_caches_own_full_answers():
    """``--set table --report``: each row counts the answers its own full cache gives (the library's rows
    against ``full``, QuantizedCache's against its ``DynamicCache``), marks answers only it gives, names a
    row not run, and refuses records of other prompts."""
    from experiments.quantized_kv import SNAPKV, side_by_side

    answers = ["11111", "22222", "33333", "44444"]
    common = {"key": "quantized-kv|m|passkey|64|n=4|seed=0|x|1", "task": "passkey", "context": 64, "n": 4,
              "status": "ok", "held_vs_fp16": 0.5}
    ours = [{**common, "policy": "full", "budget": 1.0, "correct": 3,
             "outputs": [" 11111.", " 22222.", " 33333.", " 5."]},
            {**common, "policy": SNAPKV, "budget": 0.2, "correct": 2, "held_vs_fp16": 0.061,
             "outputs": [" 11111.", " 2.", " 3.", " 44444."]}]
    base_common = {"task": "passkey", "context": 64, "n": 4, "seed": 0, "answers": answers}
    base = [{**base_common, "config": "full", "correct": 2, "right": [True, True, False, False],
             "vs_fp16": 2.0},
            {**base_common, "config": "q4-g64", "nbits": 4, "q_group_size": 64, "residual_length": 128,
             "correct": 2, "right": [True, False, True, False], "vs_fp16": 0.3125}]
    rows = side_by_side(ours, base, 64).splitlines()
    assert rows[2] == "| `full` | 1 | 3 | 3 of 3 | 50.0% |"
    assert rows[3] == f"| `{SNAPKV}` | 0.2 | 2 | 1 of 3 (+1) | 6.1% |"
    assert rows[4].endswith("| not run | | |")
    assert rows[-1] == "| QuantizedCache 4 bits, group 64, residual 128 | 1 | 2 | 1 of 2 (+1) | 31.2% |"
    with pytest.raises(ValueError, match="different prompts"):
        side_by_side([{**ours[0], "correct": 2}], base, 64)
    with pytest.raises(ValueError, match="--length 128"):
        side_by_side(ours, base, 128)


@pytest.mark.parametrize("name", STUDIES)
def test_study_entry_point_parses_its_arguments(name, capsys):
    """``main(["--help"])`` imports what the study needs (the harness, the library) and prints its usage."""
    module = importlib.import_module(f"experiments.{name}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_studies_run_as_modules_from_the_repository_root():
    """As the docstrings say to run them: ``python -m experiments.<name>`` from the repository root (a study
    that imports another one, outside pytest's ``pythonpath``)."""
    done = subprocess.run([sys.executable, "-m", "experiments.adakv_retrieval", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout and "--budgets" in done.stdout
