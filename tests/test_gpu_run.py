"""The prepared GPU run (``bench/gpu.py``): every stage at tiny shapes on CPU so the command cannot rot before
a device is lent, the verdicts it writes against the targets, and the launch-parameter table it tunes
(``kvkernels.tuning``)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from devices import DEVICE
from kvkernels.paged_attention import paged_decode_attention_ref, paged_decode_attention_triton
from kvkernels.tuning import DEFAULTS, SWEEP_FIRST, LaunchConfig, launch_config, override, sweep_configs

ROOT = Path(__file__).resolve().parents[1]


def _gpu_module():
    """``bench/gpu.py`` as a module (bench/ is not a package)."""
    if "kvbench_gpu" not in sys.modules:
        spec = importlib.util.spec_from_file_location("kvbench_gpu", ROOT / "bench" / "gpu.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules["kvbench_gpu"]


@pytest.mark.slow
def test_smoke_run_every_stage_ok(tmp_path):
    """``--smoke`` runs every stage (each in its own process) and each writes its records; ``--pack`` leaves
    one tar.gz of the whole out directory (the device tool returns only a few files)."""
    out, packed = tmp_path / "run", tmp_path / "back" / "gpu.tgz"
    cmd = [sys.executable, "bench/gpu.py", "--smoke", "--out", str(out), "--pack", str(packed)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with tarfile.open(packed) as tar:
        names = set(tar.getnames())
        assert {"run/results.json", "run/summary.md", "run/generation.jsonl", "run/capacity.log"} <= names
        assert tar.extractfile("run/summary.md").read().decode() == (out / "summary.md").read_text()
    assert not list(packed.parent.glob("*.tmp"))
    results = json.loads((out / "results.json").read_text())
    gpu = _gpu_module()
    assert {k: v["status"] for k, v in results["status"].items()} == {s: "ok" for s in gpu.STAGES}
    records = results["records"]
    errors = [r for r in records if r["kind"] == "error"]
    assert not errors, errors[0]["traceback"]
    kinds = {r["kind"] for r in records}
    assert {"env", "copy", "test", "tests_done", "decode", "decode_sweep", "compaction", "prefill",
            "prefill_sweep", "quant_decode", "quant_sweep", "prefill_policy", "gen", "hf_static", "hf_wrap",
            "capacity", "quant_probe"} <= kinds
    breakdown = [r for r in records if r["kind"] == "decode_kernels"]
    assert {(r["shape"], r["impl"]) for r in breakdown} == {(f"B{b}-L{n}", impl) for b, n in gpu.SMOKE.decode
                                                            for impl in ("paged", "paged+h2o-score",
                                                                         "paged+keyformer-score")}
    assert all(r["kernels_us"] and r["total_us"] > 0 for r in breakdown), breakdown
    compaction = [r for r in records if r["kind"] == "compaction_kernels"]
    assert [r["op"] for r in compaction] == ["topk_compact", "topk_evict", "topk_evict max_excess=1"]
    assert all(r["total_us"] > 0 for r in compaction), compaction
    timed = {r["op"]: r for r in records if r["kind"] == "compaction"}  # the profiler's total, compared
    assert all(timed[r["op"]]["op_device_us"] == r["total_us"] > 0 for r in compaction)
    assert all(t["device_over_topk_gather"] > 0 and t["op_eager_us"] > 0 for t in timed.values()), timed
    prefill = {(r["impl"], r["mode"]) for r in records if r["kind"] == "prefill"}
    assert {("attention", "none"), ("attention (need_lse)", "none"), ("attention+scorer", "accumulate"),
            ("attention+scorer, no lse", "accumulate"), ("attention+scorer, heads inner", "accumulate"),
            ("fused", "accumulate"), ("attention+scorer", "gumbel"),
            ("attention+scorer, heads inner", "gumbel")} == prefill
    probe = [r for r in records if r["kind"] == "quant_probe"]
    assert [r["variant"] for r in probe] == [label for label, _ in gpu.PROBE_VARIANTS]
    assert all(r["ok"] for r in probe), probe  # the interpreter passes every variant (the GPU did not)
    loops = {r["variant"]: r["loop"] for r in probe}
    assert loops["base"] == "words, without prefetching" and loops["prefetched"] == "prefetched"
    assert loops["bytes"] == loops["4-bit, bytes"] == "bytes, without prefetching"  # pools off 4 bytes
    assert loops["head dim 48, gathered"] == "bytes, without prefetching"  # no words for gathered rows
    assert loops["head dim 96, 4-bit g32, gathered"] == "bytes, without prefetching"
    for kind in ("hf_wrap", "hf_paged_cache"):  # the transformers model, compressed, both ways
        rec = next(r for r in records if r["kind"] == kind)
        assert rec["decode_tok_s"] > 0 and 0 < rec["kv_kept"] < 1, rec
    quant = {r["impl"]: r for r in records if r["kind"] == "quant_decode"}
    # each width the other way round from its default (every width prefetched by default)
    flipped = ["int4 prefetch=off", "int8 prefetch=off"]
    fused = ["int4+h2o-score", "int4+rotate"]  # the score update fused; rotated rows' two rotations around it
    # float16 rows the other way round (HALF_ROWS on by default): the smoke's float32 queries take neither
    half = ["int4 half=off", "int8 half=off", "int4+h2o-score half=off"]
    assert set(quant) == {"native", "native-1split", "int4", *fused, "int8", *flipped, *half}
    assert all(quant[f]["max_abs_diff_vs_default"] == 0 for f in half[:2])
    assert all(quant[f]["bit_equal_to_default"] for f in flipped)  # the same results (the interpreter)
    assert all(quant[f]["max_abs_diff_vs_default"] == 0 for f in flipped)
    assert {r["kind"] for r in records if r["stage"] == "quant"} >= {"quant_write"}
    assert all(r["bit_equal"] for r in records if r["kind"] == "quant_write")
    occupancy = [r for r in records if r["kind"] == "quant_occupancy"]  # registers x splits: each path
    assert [(r["max_registers"], r["num_splits"]) for r in occupancy] == [(128, 1), (128, 2), (64, 2)]
    assert {(r["max_registers"], r["num_splits"]) for r in occupancy} <= set(gpu.OCCUPANCY)
    assert all("us" in r and r["programs"] == 2 * 2 * r["num_splits"] for r in occupancy), occupancy
    assert occupancy[0]["over_first"] == 1
    sweep = [r for r in records if r["kind"] == "quant_sweep"]
    assert sweep and all("us" in r for r in sweep), sweep  # the quantized decode's launch configs
    assert quant["int4"]["kv_bytes"] < quant["int8"]["kv_bytes"] < quant["native"]["kv_bytes"]
    assert quant["int8"]["max_abs_diff_vs_native"] < quant["int4"]["max_abs_diff_vs_native"] < 0.5
    gen = [r for r in records if r["kind"] == "gen"]
    assert {(r["batch"], r["policy"]) for r in gen} == {(b, p) for b, _ in [(1, 0), (2, 0)]
                                                        for p in ("full", "h2o", "snapkv", "streaming")}
    assert all(r["decode_tok_s"] > 0 for r in gen)
    # torch.compile's phases: the first run compiles (Dynamo's trace among them)
    assert gen[0]["compile_s"] > 0 and "_compile.compile_inner" in gen[0]["compile_phases"], gen[0]
    assert all(r["kv_kept"] < 0.5 for r in gen if r["policy"] != "full")
    assert [(r["batch"], r["policy"]) for r in gen] == [(b, p) for b, _, p in gpu.generation_order(gpu.SMOKE)]
    summary = (out / "summary.md").read_text()
    assert "## Targets (issues 33 and 36)" in summary and "| verdict |" in summary
    assert "torch.compile's phases in each run's first step" in summary
    assert "| 4-bit pages decode <= float32 pages, B2-L64 |" in summary and "## Quantized pages" in summary


def test_correctness_stage_names_tests_that_exist():
    """Every file and test the correctness stage lists exists (a renamed test would fail the whole pytest
    call on the device: 'not found'), the tests of the kernels changed since the last GPU run first (the
    decode reduce kernel's, the prompt lse's; then issue 36's)."""
    gpu = _gpu_module()
    for entry in gpu.TEST_FILES + gpu.SMOKE_TEST_FILES:
        path, _, name = entry.partition("::")
        assert (ROOT / path).is_file(), entry
        assert not name or f"def {name}(" in (ROOT / path).read_text(), entry
    assert gpu.TEST_FILES[:5] == ("tests/test_paged_attention.py::test_triton_each_mode_on_both_paths",
                                  "tests/test_gpu.py::test_split_k_at_32k_context_bf16",
                                  "tests/test_gpu.py::test_prefill_attention_returns_a_kernels_lse",
                                  "tests/test_gpu.py::test_decode_loop_waits_for_the_device_only_to_read_tokens",
                                  "tests/test_gpu.py::test_quant_decode_attention_triton_equals_reference")


def test_stage_time_box_keeps_what_was_measured(tmp_path):
    """A stage that overruns its box is killed and reported as timed out; the other stages still run and
    the records a stage wrote before it died are kept."""
    gpu = _gpu_module()
    out = tmp_path
    (out / "generation.jsonl").write_text(json.dumps({"stage": "generation", "kind": "gen", "batch": 1,
                                                      "policy": "full", "decode_tok_s": 10.0,
                                                      "floor_step_s": 0.05}) + "\n")
    status = {"generation": {"status": "timed out", "seconds": 9.0, "box_s": 9}}
    gpu.write_results(out, status, "abc123")
    results = json.loads((out / "results.json").read_text())
    assert results["records"][0]["decode_tok_s"] == 10.0
    summary = (out / "summary.md").read_text()
    assert "timed out" in summary and "commit abc123" in summary
    # 0.05 s floor at 10 tok/s = 50% of the floor: met
    assert "| batch 1 (full) >= 50% of the (weights + KV) / copy-bandwidth floor | 50% | met |" in summary


def test_summary_names_the_tuned_lines_to_commit(tmp_path):
    """The best decode config at B8/4k and the best prefill-scorer config become TUNED lines for the
    device's compute capability."""
    gpu = _gpu_module()
    lines = [
        {"stage": "env", "kind": "env", "device": "NVIDIA H100", "capability": "9.0"},
        {"stage": "kernels", "kind": "decode_sweep", "shape": "B8-L4096", "num_splits": 8, "us": 50.0,
         "pct_of_copy": 90.0, "config": {"block": 32, "num_warps": 8, "num_stages": 4}},
        {"stage": "kernels", "kind": "decode_sweep", "shape": "B8-L4096", "num_splits": 2, "us": 70.0,
         "pct_of_copy": 60.0, "config": {"block": 64, "num_warps": 4, "num_stages": 3}},
        {"stage": "kernels", "kind": "prefill_sweep", "ms": 2.0, "config": {"block": 64, "num_warps": 4,
                                                                            "num_stages": 3}},
        {"stage": "kernels", "kind": "prefill_sweep", "ms": 1.5, "config": {"block": 128, "num_warps": 8,
                                                                            "num_stages": 2}},
        {"stage": "quant", "kind": "quant_sweep", "shape": "B64-L4096", "us": 300.0,
         "config": {"block": 32, "num_warps": 4, "num_stages": 3}},
        {"stage": "quant", "kind": "quant_sweep", "shape": "B64-L4096", "us": 250.0,
         "config": {"block": 64, "num_warps": 8, "num_stages": 2}},
    ]
    (tmp_path / "kernels.jsonl").write_text("\n".join(json.dumps(r) for r in lines[1:]) + "\n")
    (tmp_path / "env.jsonl").write_text(json.dumps(lines[0]) + "\n")
    summary = gpu.summarize(tmp_path, {}, None)
    assert ('TUNED[("decode", 90)] = LaunchConfig(block=32, num_warps=8, num_stages=4)  # best at B8-L4096'
            in summary)
    assert 'TUNED[("prefill_scores", 90)] = LaunchConfig(block=128, num_warps=8, num_stages=2)' in summary
    assert ('TUNED[("quant_decode", 90)] = LaunchConfig(block=64, num_warps=8, num_stages=2)  # 4-bit, '
            'B64-L4096' in summary)


@pytest.mark.parametrize("best_prefetched,int8,want", [
    (False, {"int8": 400.0, "int8 prefetch=off": 450.0}, "PREFETCH_TILES = 0"),
    (True, {"int8": 446.0, "int8 prefetch=on": 415.0}, "PREFETCH_TILES = 8"),  # 2026-11-28 run 1 (default 4)
    (True, {"int8": 415.0, "int8 prefetch=off": 446.0}, "PREFETCH_TILES = 8"),  # the default 8, no faster off
    (True, {"int8": 554.0, "int8 prefetch=off": 415.0}, "PREFETCH_TILES = 4"),  # 8-bit slower prefetched
    (True, {"int8": 554.0, "int8 prefetch=on": 600.0}, "PREFETCH_TILES = 4"),
    (True, {"int8": 554.0}, "PREFETCH_TILES = 8"),  # not timed both ways: 4-bit's answer
])
def test_summary_names_the_prefetch_width_to_commit(best_prefetched, int8, want):
    """PREFETCH_TILES from the 4-bit sweep's best and the 8-bit pages timed both ways at its shape (the
    records name the flipped run by what it is, the default by its width alone)."""
    gpu = _gpu_module()
    best = {"shape": "B64-L4096", "prefetch": best_prefetched, "us": 360.0}
    kinds = {"quant_decode": [{"shape": "B64-L4096", "bits": 8, "impl": impl, "us": us}
                              for impl, us in int8.items()]
             + [{"shape": "B8-L4096", "bits": 8, "impl": "int8 prefetch=on", "us": 1.0}]}  # another shape
    assert gpu.prefetch_tiles_line(best, kinds).startswith(want)


@given(st.integers(0, 80), st.integers(1, 8), st.integers(0, 56))
def test_largest_batch_finds_the_largest_that_fits(threshold, start, extra):
    """The capacity search (doubling from ``start``, then bisection) against counting up by one: the largest
    batch in ``[1, cap]`` that fits, 0 if none does; and a search cut by its time box says it was cut."""
    gpu = _gpu_module()
    cap = start + extra
    fits = lambda b: b <= threshold  # noqa: E731 -- fitting is monotone in the batch
    want = max((b for b in range(1, cap + 1) if fits(b)), default=0)
    best, exact, tried = gpu.largest_batch(fits, start, cap)
    assert (best, exact) == (want, True)
    assert all(ok == fits(b) and 1 <= b <= cap for b, ok in tried)
    for allowed in range(len(tried)):  # cut after `allowed` tries: a lower bound, and it says so
        go_on = functools.partial(next, iter([True] * allowed), False)  # True `allowed` times, then False
        cut, exact, cut_tried = gpu.largest_batch(fits, start, cap, go_on=go_on)
        assert not exact and cut_tried == tried[:allowed] and cut <= want
    with pytest.raises(ValueError, match="start=2"):
        gpu.largest_batch(fits, 2, 1)


def test_decode_rates_leave_out_the_warm_up_steps():
    """Steady-state tok/s leaves out the first three decode steps, the other rate only the first."""
    gpu = _gpu_module()
    stamps = [0.0, 10.0, 11.0, 12.0, 12.5, 13.0, 13.5]  # prefill end, then six decode steps
    rates = gpu.decode_rates(stamps, batch=4)
    assert rates == {"first_step_s": 10.0, "decode_tok_s": 4 * 3 / 1.5,
                     "decode_tok_s_skip_first": 4 * 5 / 3.5}
    assert gpu.decode_rates([0.0], batch=4) == {"first_step_s": None, "decode_tok_s": None,
                                                 "decode_tok_s_skip_first": None}


def _rec(kind, **kw):
    return {"stage": "x", "kind": kind, **kw}


def test_targets_verdicts():
    """Each target's verdict follows its measurement: met, NOT met, or not measured when the run lacks it."""
    gpu = _gpu_module()
    records = [
        _rec("decode", shape="B8-L4096", impl="paged", us=100.0, pct_of_copy=60.0),
        _rec("decode", shape="B8-L4096", impl="paged+h2o-score", us=104.0, pct_of_copy=58.0),
        _rec("decode", shape="B8-L4096", impl="sdpa-dense", us=90.0, pct_of_copy=70.0),
        _rec("decode_sweep", shape="B8-L4096", config={"block": 64}, num_splits=4, us=80.0, pct_of_copy=85.0),
        _rec("decode_sweep", shape="B8-L4096", config={"block": 32}, num_splits=4, us=95.0, pct_of_copy=70.0),
        _rec("decode", shape="B64-L4096", impl="paged", us=100.0, pct_of_copy=60.0),
        _rec("decode", shape="B64-L4096", impl="paged+h2o-score", us=110.0, pct_of_copy=55.0),
        _rec("gen", batch=64, policy="full", decode_tok_s=1000.0),
        _rec("gen", batch=64, policy="h2o", decode_tok_s=2100.0),
        _rec("gen", batch=64, policy="snapkv", decode_tok_s=1900.0),
        _rec("hf_static", batch=64, decode_tok_s=1000.0),
        _rec("capacity", policy="full", max_batch=4, exact=True, vs_full=1.0),
        _rec("capacity", policy="h2o", max_batch=16, exact=True, vs_full=4.0),
        _rec("prefill_policy", policy="full", prefill_s=1.0),
        _rec("prefill_policy", policy="h2o", prefill_s=1.31),
    ]
    got = {t: (m, v) for t, m, v in gpu.targets(records)}
    assert (got["decode B8-L4096: >= 80% of copy bandwidth, <= SDPA dense"]
            == ("85% (80 us); SDPA 90 us", "met"))
    assert got["decode B64-L4096: >= 80% of copy bandwidth, <= SDPA dense"][1] == "not measured"  # no SDPA
    assert got["decode B1-L32768: >= 80% of copy bandwidth, <= SDPA dense"][1] == "not measured"
    assert got["fused score update at B8-L4096 costs <= 5%"] == ("+4.0%", "met")
    assert got["fused score update at B64-L4096 costs <= 5%"] == ("+10.0%", "NOT met")
    assert got["h2o at 0.2 >= 2x full decode, batch 64"] == ("2.10x", "met")
    assert got["snapkv at 0.2 >= 2x full decode, batch 64"] == ("1.90x", "NOT met")
    assert got["batch 64 >= 2x transformers static-cache generate"] == ("2.10x (h2o)", "met")
    assert got["batch 1 >= 50% of the bandwidth floor"][1] == "not measured"
    assert got["largest batch at 0.2 (h2o) >= 4x full cache's"] == ("16 vs 4 = 4.0x", "met")
    assert got["scoring prefill h2o <= 1.3x plain prefill"] == ("1.31x", "NOT met")
    assert gpu.best_decode(records)["B8-L4096"]["config"] == {"block": 64}


def test_quant_targets_verdicts():
    """Issue 36's target (4-bit pages at B64-L4096 no slower than bf16 pages) and each other bit width and
    shape measured: the ratio, met / NOT met; the B64 4-bit row is listed (not measured) without records.
    A generation run of a policy that keeps every token (kivi alone) is held to 1x the full cache, not 2x."""
    gpu = _gpu_module()
    q = functools.partial(_rec, "quant_decode", dtype="bfloat16")
    records = [q(shape="B64-L4096", impl="native", us=240.0, pct_of_copy=80.0, bits=None),
               q(shape="B64-L4096", impl="native-1split", us=250.0, pct_of_copy=77.0, bits=None),
               q(shape="B64-L4096", impl="int4", us=120.0, pct_of_copy=51.0, bits=4),
               q(shape="B64-L4096", impl="int8", us=250.0, pct_of_copy=44.0, bits=8),
               q(shape="B8-L4096", impl="native", us=40.0, pct_of_copy=60.0, bits=None),
               q(shape="B8-L4096", impl="int4", us=90.0, pct_of_copy=9.0, bits=4),
               _rec("gen_plan", order=[[64, 512, "full"], [64, 512, "kivi(residual=0)"]]),
               _rec("gen", batch=64, policy="full", decode_tok_s=1000.0),
               _rec("gen", batch=64, policy="kivi(residual=0)", decode_tok_s=1200.0)]
    got = {t: (m, v) for t, m, v in gpu.targets(records)}
    assert got["4-bit pages decode <= bf16 pages, B64-L4096 (issue 36)"] == (
        "0.50x (120 vs 240 us; 51% of copy over the packed bytes)", "met")
    assert got["8-bit pages decode <= bf16 pages, B64-L4096"][1] == "NOT met"
    assert got["4-bit pages decode <= bf16 pages, B8-L4096"] == (
        "2.25x (90 vs 40 us; 9% of copy over the packed bytes)", "NOT met")
    assert "8-bit pages decode <= bf16 pages, B8-L4096" not in got  # not measured at that shape: no row
    assert got["kivi(residual=0) (every token kept) >= 1x full decode, batch 64"] == ("1.20x", "met")
    none = {t: v for t, _, v in gpu.targets([])}
    assert none["4-bit pages decode <= bf16 pages, B64-L4096 (issue 36)"] == "not measured"
    assert gpu._policy("kivi(residual=0)", 0.2).budget == 1.0  # every token, 4-bit
    assert gpu._policy("snapkv+kivi(residual=0)", 0.2).budget == 0.2
    assert gpu.parse_runs("64:full,64:kivi(residual=0), 16:snapkv+kivi(bits=8, group=16, residual=0)",
                          gpu.REAL) == [(64, "full"), (64, "kivi(residual=0)"),
                                        (16, "snapkv+kivi(bits=8, group=16, residual=0)")]


def test_capacity_target_says_why_it_was_not_measured():
    """The H200 run of 2026-11-26: the full cache's search raised, h2o's was cut by the time box. Every
    compressed policy's target is 'not measured' and says why; a cut search is a lower bound, which decides
    the target only one way."""
    gpu = _gpu_module()
    crashed = [_rec("error", stage="capacity", where="capacity full", traceback="IndexError: tuple index"),
               _rec("capacity", policy="h2o", max_batch=8, exact=False, vs_full=None)]
    got = {t: (m, v) for t, m, v in gpu.targets(crashed)}
    assert got["largest batch at 0.2 (h2o) >= 4x full cache's"] == (
        "8 (search cut); the full cache's search failed", "not measured")
    assert got["largest batch at 0.2 (snapkv) >= 4x full cache's"] == (
        "—; the full cache's search failed", "not measured")
    cut = [_rec("capacity", policy="full", max_batch=4, exact=True),
           _rec("capacity", policy="h2o", max_batch=8, exact=False),
           _rec("capacity", policy="streaming", max_batch=16, exact=False)]
    got = {t.split("(")[1].split(")")[0]: (m, v) for t, m, v in gpu.targets(cut) if t.startswith("largest")}
    assert got == {"h2o": ("8 (search cut) vs 4 = 2.0x", "not measured"),  # a lower bound under the target
                   "streaming": ("16 (search cut) vs 4 = 4.0x", "met"),  # a lower bound at the target
                   "snapkv": ("—; not reached (time box)", "not measured")}
    none = {t: v for t, _, v in gpu.targets([])}
    assert none["largest batch at 0.2 (h2o) >= 4x full cache's"] == "not measured"


def test_generation_order_runs_the_lead_first():
    """full and h2o at batch 16 (with snapkv and streaming, cheap once those compiled), batch 1's full cache
    and full and h2o at batch 64 come before the rest; every (batch, policy) runs once, with its batch's
    new tokens; a lead naming an unknown pair is refused."""
    gpu = _gpu_module()
    order = gpu.generation_order(gpu.REAL)
    assert [(b, p) for b, _, p in order[:7]] == [(16, "full"), (16, "h2o"), (16, "snapkv"), (16, "streaming"),
                                                 (1, "full"), (64, "full"), (64, "h2o")]
    assert sorted((b, p) for b, _, p in order) == sorted((b, p) for b, _ in gpu.REAL.runs
                                                          for p in gpu.REAL.policies)
    assert all(n == dict(gpu.REAL.runs)[b] for b, n, _ in order)
    with pytest.raises(ValueError, match="gen_lead"):
        gpu.generation_order(dataclasses.replace(gpu.REAL, gen_lead=((8, "full"),)))


def test_runs_pick_the_generation_runs():
    """``--runs`` names (batch, policy) pairs run in its order; a batch outside the shapes' runs, a missing
    policy or a bad policy spec is refused naming the item, before any stage starts."""
    gpu = _gpu_module()
    runs = gpu.parse_runs("16:streaming, 16:full,64:h2o+minicache", gpu.REAL)
    assert runs == [(16, "streaming"), (16, "full"), (64, "h2o+minicache")]
    assert gpu.generation_order(gpu.REAL, runs) == [(16, 256, "streaming"), (16, 256, "full"),
                                                    (64, 512, "h2o+minicache")]
    for bad in ("8:full", "16", "x:full", "16:nosuchpolicy"):
        with pytest.raises((ValueError, KeyError), match="16|8|x|nosuchpolicy"):
            gpu.parse_runs(bad, gpu.REAL)
    with pytest.raises(SystemExit):
        gpu.main(["--out", "/tmp/kvp-gpu-runs-test", "--runs", "8:full"])


def test_skipped_generation_runs_are_not_measured():
    """A run the time box skipped still has its target row, 'not measured' (the stage records its plan)."""
    gpu = _gpu_module()
    records = [_rec("gen_plan", order=[[16, 256, "full"], [16, 256, "h2o"], [64, 512, "full"],
                                       [64, 512, "h2o"]]),
               _rec("gen", batch=16, policy="full", decode_tok_s=100.0),
               _rec("gen", batch=16, policy="h2o", decode_tok_s=150.0)]
    got = {t: (m, v) for t, m, v in gpu.targets(records)}
    assert got["h2o at 0.2 >= 1x full decode, batch 16"] == ("1.50x", "met")
    assert got["h2o at 0.2 >= 2x full decode, batch 64"] == ("—", "not measured")


def test_stage_boxes():
    """Each stage gets its own box (with --only too); --budget splits its seconds in the same proportions."""
    gpu = _gpu_module()
    assert sum(gpu.stage_boxes(gpu.STAGES, None).values()) == gpu.DEFAULT_BUDGET
    assert gpu.stage_boxes(("capacity",), None) == {"capacity": gpu.SHARES["capacity"]}
    boxes = gpu.stage_boxes(("generation", "capacity"), 100.0)
    assert sum(boxes.values()) == pytest.approx(100.0)
    assert boxes["generation"] / boxes["capacity"] == pytest.approx(gpu.SHARES["generation"]
                                                                   / gpu.SHARES["capacity"])


def test_only_runs_env_first_and_refuses_unknown_stages():
    gpu = _gpu_module()
    assert gpu.stages_to_run(None) == gpu.STAGES
    assert gpu.stages_to_run("correctness, quant_probe") == ("env", "quant_probe", "correctness")
    assert gpu.stages_to_run("env") == ("env",)
    with pytest.raises(ValueError, match=r"unknown stages \['kernel'\]"):
        gpu.stages_to_run("kernel,quant")


def test_inductor_settings_parse_apply_and_refuse_bad_ones():
    gpu = _gpu_module()
    assert gpu.parse_inductor("triton.autotune_pointwise=False, fx_graph_cache = True") == {
        "triton.autotune_pointwise": False, "fx_graph_cache": True}
    assert gpu.parse_inductor("") == {}
    for bad in ("triton.autotune_pointwise", "x=not a literal", "=1"):
        with pytest.raises(ValueError, match="--inductor: .* is not NAME=VALUE"):
            gpu.parse_inductor(bad)
    import torch._inductor.config as config

    old = config.triton.autotune_pointwise
    try:
        gpu.apply_inductor({"triton.autotune_pointwise": not old})
        assert config.triton.autotune_pointwise is (not old)
    finally:
        config.triton.autotune_pointwise = old
    with pytest.raises(ValueError, match="has no 'triton.no_such_setting'"):
        gpu.apply_inductor({"triton.no_such_setting": 1})


def test_wait_ticks_then_kills_at_the_timeout():
    """While a stage runs the driver ticks (rewrites the results and the pack); past its box it is killed."""
    gpu = _gpu_module()
    ticks = []
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    t0 = time.time()
    assert gpu.wait(slow, 1.0, lambda: ticks.append(1), every=0.2) is None
    assert time.time() - t0 < 10 and slow.returncode is not None and len(ticks) >= 2
    quick = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert gpu.wait(quick, 30.0, lambda: None, every=0.2) == 3


def test_only_rerun_keeps_the_other_stages(tmp_path):
    """``--only`` into an earlier run's directory reruns the stages it names; the others' records and status
    stay in results.json, summary.md and the pack."""
    gpu = _gpu_module()
    (tmp_path / "capacity.jsonl").write_text(json.dumps(_rec("capacity", policy="full", max_batch=4,
                                                             exact=True)) + "\n")
    before = {"capacity": {"status": "ok", "seconds": 5, "box_s": 60, "commit": "old"}}
    (tmp_path / "results.json").write_text(json.dumps({"status": before}))
    assert gpu.main(["--smoke", "--out", str(tmp_path), "--only", "env", "--commit", "new",
                     "--pack", str(tmp_path / "gpu.tgz")]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {k: (v["status"], v["commit"]) for k, v in results["status"].items()} == {
        "env": ("ok", "new"), "capacity": ("ok", "old")}
    assert {r["kind"] for r in results["records"]} >= {"env", "copy", "capacity"}
    with tarfile.open(tmp_path / "gpu.tgz") as tar:
        summary = tar.extractfile(f"{tmp_path.name}/summary.md").read().decode()
    assert "| capacity | ok | 5 | 60 | old |" in summary


def test_inductor_settings_reach_each_stage(tmp_path):
    gpu = _gpu_module()
    assert gpu.main(["--smoke", "--out", str(tmp_path), "--only", "env", "--inductor",
                     "triton.autotune_pointwise=False"]) == 0
    records = [json.loads(line) for line in (tmp_path / "env.jsonl").read_text().splitlines()]
    rec = next(r for r in records if r["kind"] == "inductor_config")
    assert rec["settings"] == {"triton.autotune_pointwise": False}


def test_results_leave_out_a_line_being_written(tmp_path):
    """Results are rewritten while a stage appends: a partial last line is left out, not an error."""
    gpu = _gpu_module()
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(_rec("gen")) + "\n" + '{"stage": "x", "ki')
    assert gpu._read_jsonl(path) == [_rec("gen")]
    path.write_text('{"stage": "x", "ki\n' + json.dumps(_rec("gen")) + "\n")
    with pytest.raises(json.JSONDecodeError):
        gpu._read_jsonl(path)


def test_launch_config_precedence_and_checks():
    cpu = torch.device("cpu")
    base = launch_config("decode", cpu)
    custom = LaunchConfig(block=32, num_warps=8, num_stages=2)
    with override(decode=custom):
        assert launch_config("decode", cpu) == custom
        assert launch_config("prefill_scores", cpu) == launch_config("prefill_scores", cpu)
        with override(decode=LaunchConfig(block=128)):
            assert launch_config("decode", cpu).block == 128
        assert launch_config("decode", cpu) == custom
    assert launch_config("decode", cpu) == base
    with pytest.raises(ValueError, match="kernel='nope'"):
        launch_config("nope", cpu)
    with pytest.raises(ValueError, match="unknown kernels"):
        with override(nope=custom):
            pass
    for bad, match in ((dict(block=24), "block=24"), (dict(num_warps=3), "num_warps=3"),
                       (dict(num_stages=0), "num_stages=0")):
        with pytest.raises(ValueError, match=match):
            LaunchConfig(**bad)
    configs = sweep_configs("decode")
    assert configs[0] == DEFAULTS["decode"] and len(set(configs)) == len(configs) == 27
    assert tuple(configs[1:1 + len(SWEEP_FIRST["decode"])]) == SWEEP_FIRST["decode"]


@pytest.mark.parametrize("cfg", [LaunchConfig(block=32, num_warps=2, num_stages=2),
                                 LaunchConfig(block=16, num_warps=8, num_stages=4)], ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_under_swept_configs_matches_ref(cfg, num_splits):
    """What the sweep measures is still the op: other tiles, warps, stages and split counts give the
    reference's output (ragged lengths 0, 1 and across pages)."""
    if DEVICE.type != "cuda":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    P, S, Hkv, G, D = 12, 16, 2, 2, 32
    k = torch.randn(P, S, Hkv, D, generator=gen)
    v = torch.randn(P, S, Hkv, D, generator=gen)
    table = torch.randperm(P, generator=gen).to(torch.int32).view(3, 4)
    lens = torch.tensor([0, 1, 50], dtype=torch.int32)
    q = torch.randn(3, Hkv * G, D, generator=gen)
    want = paged_decode_attention_ref(q, k, v, table, lens, scale=D ** -0.5)
    args = [x.to(DEVICE) for x in (q, k, v, table, lens)]
    with override(decode=cfg):
        got = paged_decode_attention_triton(*args, scale=D ** -0.5, num_splits=num_splits)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)
