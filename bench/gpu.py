"""The prepared GPU run: every GPU target of the project measured by one command.

    python bench/gpu.py --out DIR --pack OUT/gpu.tgz   # a CUDA machine: about 8 minutes (boxes: 560 s)
    python bench/gpu.py --out DIR --only quant         # 4/8-bit pages against bf16 pages alone (40 s box)
    python bench/gpu.py --out DIR --only quant_probe   # the quantized GPU-only failure, one change each
    python bench/gpu.py --out DIR --only generation,capacity   # a second, targeted run (their own boxes)
    python bench/gpu.py --out DIR --only generation --runs 16:full,16:streaming   # a rerun after a fix
    python bench/gpu.py --out DIR --smoke              # every stage at tiny shapes on CPU (in the test suite)

Needs only the project's tree and the machine's own packages (torch, triton, transformers, pytest; it puts
``src`` on the path itself, so nothing is installed). Stages, each in its own process with its own time
box, so a crash, a CUDA error or a hang in one loses nothing measured before it:

``env``         device, versions, device-to-device copy bandwidth
``quant_probe`` the quantized decode kernel's GPU-only failure (run 1 of 2026-11-28: the loop without
                prefetching, 2-bit keys at head dim 16, pages of one slot) rerun with one thing changed at a
                time (prefetching, pipeline stages, page size, head dim, bits, GQA, query dtype, length,
                the gathered rows of head dims 48 and 96): which part of the example the error needs
``correctness`` the GPU-only tests, then the kernel, cache, compile and transformers tests on CUDA (bf16 in),
                one JSON line per test as it finishes (per-test timeout where pytest-timeout is installed)
``kernels``     paged decode attention at B8/4k, B64/4k and B1/32k (Hq 32, Hkv 8, D 128, bf16) against SDPA on
                the dense gather and against the copy bandwidth, the fused score update's cost, a sweep of
                launch parameters and split counts (``kvkernels.tuning.SWEEP``), prompt compaction and
                decode-time eviction against ``torch.topk`` + ``gather``, the prefill scorer against SDPA
``quant``       decode attention over 4- and 8-bit packed pages (``quant_decode_attention``, issue 36)
                against the same pages in bf16 (``paged_decode_attention``) at B64/4k and B8/4k, same heads:
                time, ratio, bandwidth over the packed bytes read; the target: 4-bit time <= bf16 time
``generation``  the Llama-3.2-1B shape with random bf16 weights, 4k prompts: prefill cost of the scoring
                policies, then full / h2o / snapkv / streaming at 0.2, batch 1, 16 and 64, compiled, the
                most telling first (``generation_order``); ``--runs 64:full,64:kivi(residual=0)`` adds the
                4-bit cache end to end (not in the default order: it compiles one more decode step, ~40 s)
``hf_static``   transformers ``generate(cache_implementation="static")`` at batch 16 on the same shape, then
                the same model on the paged cache (``kvmodels.hf.wrap_transformers``, eager, ``snapkv``) and
                its ``generate`` with the paged cache under it (``kvmodels.hf.paged_cache``)
``capacity``    the largest batch one fixed page pool holds, full cache against 0.2, run for real

Each stage appends its records to ``DIR/<stage>.jsonl`` as it measures them; after every stage
``DIR/results.json`` (every record, every stage's status) and ``DIR/summary.md`` (tables, the targets of
issues 33 and 36 as met / not met / not measured, and the ``TUNED`` lines to commit in
``kvkernels/tuning.py``) are rewritten, and every 30 s while a stage runs; ``--pack PATH`` then rewrites
one tar.gz of all of ``DIR`` (a tool that returns few files gets everything in one, even from a run cut
short). Timings are medians of device time (CUDA graph replay where the call can be captured, events
otherwise); compare numbers only within one run or one device.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

STAGES = ("env", "quant_probe", "correctness", "kernels", "quant", "generation", "hf_static", "capacity")
# Each stage's default time box in seconds. --budget splits its seconds among the stages run in these
# proportions; without it each stage gets its own box (with --only too). On the H200 (2026-11-26) generation
# needed about 300 s for everything (each new batch compiles full's and h2o's decode step, ~40 s each) and
# capacity about 50 s for full and h2o. Run 3 (all stages) took 416 s: correctness 43, kernels 45 (its sweeps
# fill the box; the defaults are tuned), generation 240, hf_static 43, capacity 36. The quant stage (issue 36,
# ~15 s) took its 25 s from kernels' sweeps and generation's tail; correctness got 5 s more for its tests.
# Run 6 (cef8bc0): kernels 34 s (its sweeps never start: they need 15 s left), capacity 41: quant gets 15 s
# more from them for its B8 shape and its launch-config sweep (the kernel was rewritten after run 6).
# Run 8 (dd21673, 412 s): correctness spent ~30 of its 55 s starting pytest and reached 8 tests; a pytest run
# by hand afterwards found two GPU-only failures in tests/test_cache_quantized.py the stage never reached.
# Correctness now gets 135 s (the run about 490 s, under the device's 600 s per call), quantized tests first.
# Run 1 of 2026-11-28 (generation's box 20 s shorter for hf_static's two runs on the paged cache) cut batch 64
# and batch 1's compressed runs: generation has its 240 s back; those two runs now make 64 tokens (~2 s each
# eager on the H200, against ~8 s at 256), their 5 s from capacity (33 s of its box used in that run).
# Run 1 of 2026-11-28 recorded the tracebacks of the quantized kernel's GPU-only failures (the loop without
# prefetching): quant_probe's 30 s (each variant of the failing example once, to tell which part of it
# matters) come from correctness (cut at its box every run: its tail is the least telling) and capacity.
# The kernels stage measures more since (the scorer with and without the lse and in both loop orders,
# profiler breakdowns of the decode and compaction kernels): 10 s more, from correctness.
SHARES = {"env": 10, "quant_probe": 30, "correctness": 100, "kernels": 45, "quant": 40, "generation": 240,
          "hf_static": 55, "capacity": 40}
WRAP_NEW = 64  # new tokens of hf_static's runs on the paged cache (eager: ~30 steps/s at batch 16)
DEFAULT_BUDGET = sum(SHARES.values())  # 560 s: about 8 minutes in practice (stages end before their boxes)
RUNS_ENV = "KVPOLICIES_GPU_RUNS"  # --runs, handed to the generation stage's process
INDUCTOR_ENV = "KVPOLICIES_GPU_INDUCTOR"  # --inductor, handed to every stage's process
KILL_GRACE_S = 10  # a stage still running this long after its box is killed
SAVE_EVERY_S = 30  # results (and the --pack) rewritten this often while a stage runs

# The kernel, cache, compile and transformers tests that run on CUDA, most telling first (the time box may cut
# the tail; every test that finished is recorded).
TEST_FILES = (
    # Never run on a GPU (2026-12-01, seventeenth session): the decode reduce kernel's wide tiles (every score
    # mode on the one-program and split-K paths; 17 and 40 splits at 32k, more than one tile of splits) and
    # cuDNN's attention as the prompt's lse (prefill_attention(need_lse=True)), each kernel alone.
    "tests/test_paged_attention.py::test_triton_each_mode_on_both_paths",
    "tests/test_gpu.py::test_split_k_at_32k_context_bf16",
    "tests/test_gpu.py::test_prefill_attention_returns_a_kernels_lse",
    # The decode loop without eos ids reads each step's tokens after launching the next (never run on a GPU).
    "tests/test_gpu.py::test_decode_loop_waits_for_the_device_only_to_read_tokens",
    "tests/test_gpu.py::test_quant_decode_attention_triton_equals_reference",  # issue 36
    "tests/test_gpu.py::test_quantized_cache_on_cuda_keeps_quantized_rows_and_matches_cpu",
    "tests/test_score_update.py::test_column_pass_loop_orders_agree",
    # Sliding-window models (2026-12-02, twenty-first session; never run on a GPU): the windows' compaction
    # after every decode step (one graph replay on CUDA) beside the compiled step, and windowed extensions.
    "tests/test_sliding_window.py::test_compiled_decode_step_keeps_the_windows",
    "tests/test_sliding_window.py::test_full_policy_is_the_models_own_generate",
    "tests/test_sliding_window.py::test_compressing_policies_keep_the_windows_and_compress_the_rest",
    "tests/test_sliding_window.py::test_chunked_prefill_and_follow_up_turns_are_the_models_own_generate",
    # Run 10's correctness stage never reached test_quant_attention.py (cut in test_cache_quantized.py, ~90 s
    # there); a pytest run by hand after it, cut too, showed GPU-only failures in its first 17 tests.
    "tests/test_quant_attention.py",
    "tests/test_cache_quantized.py",  # run 9 by hand: 2 GPU-only failures (head dim 8; two formats, fixed)
    "tests/test_quant.py",
    "tests/test_gpu.py::test_compiled_decode_step_is_captured_as_a_cuda_graph",
    "tests/test_gpu.py::test_quantized_compiled_decode_step_is_captured_as_a_cuda_graph",
    "tests/test_gpu.py::test_decode_step_bookkeeping_never_waits_for_the_device",
    "tests/test_gpu_run.py::test_decode_under_swept_configs_matches_ref",
    "tests/test_paged_attention.py", "tests/test_score_update.py",
    "tests/test_topk_compact.py", "tests/test_topk_evict.py", "tests/test_merge.py",
    "tests/test_compact_attention_property.py",
    "tests/test_gpu.py::test_bf16_compiled_step_within_twice_eager_error", "tests/test_decoder.py",
    "tests/test_kvzip.py",  # the reconstruction pass and pooled head budgets: never run on a GPU
    "tests/test_cache.py",
    "tests/test_head_cache.py",
    "tests/test_cache_policies.py", "tests/test_cache_minicache.py", "tests/test_cache_compress_each.py",
    "tests/test_cache_prefill_attend.py", "tests/test_cache_compile.py", "tests/test_generate.py",
    "tests/test_hf_generate.py", "tests/test_hf_wrap.py",  # transformers models on the paged cache
    "tests/test_sliding_window.py",
)
# Tests whose ids hold one of these run after all others: never run on a GPU, and a CUDA error there (run 5 of
# 2026-11-28: a misaligned read in [triton-bytes]) fails every later test of the process.
LAST_TESTS = ("[triton-bytes]",)
SMOKE_TEST_FILES = ("tests/test_gpu.py", "tests/test_layering.py")


# ----------------------------------------------------------------------------------------------------
# Shapes: the real ones on CUDA, tiny ones for --smoke
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shapes:
    decode: tuple[tuple[int, int], ...]  # (batch, context)
    heads: tuple[int, int, int]  # (Hq, Hkv, D)
    page: int
    splits: tuple[int, ...]  # split counts swept (besides the launcher's own choice, 0)
    compact: tuple[int, int, float]  # (batch, prompt length, budget fraction)
    prefill_len: int
    model: str  # "llama-3.2-1b" or "tiny"
    prompt_len: int
    runs: tuple[tuple[int, int], ...]  # (batch, new tokens) of the generation stage
    policies: tuple[str, ...]
    gen_lead: tuple[tuple[int, str], ...]  # (batch, policy) the generation stage runs first, in this order
    prefill_policies: tuple[str, ...]
    budget: float
    hf_run: tuple[int, int]  # (batch, new tokens)
    capacity_new: int
    capacity_full_batch: int
    capacity_max_ratio: int
    reps: int
    quant: tuple[tuple[int, int], ...] = ()  # (batch, context) of the quant stage, the target's first
    quant_bits: tuple[int, ...] = (4, 8)
    quant_group: int = 32  # channels per scale and zero point (kivi's default)


REAL = Shapes(
    decode=((8, 4096), (64, 4096), (1, 32768)), heads=(32, 8, 128), page=16, splits=(1, 2, 4, 8, 16, 32),
    compact=(8, 4096, 0.2), prefill_len=4096, model="llama-3.2-1b", prompt_len=4096,
    runs=((16, 256), (64, 512), (1, 128)), policies=("full", "h2o", "snapkv", "streaming"),
    # Most telling first, since the time box cuts the tail. A new batch compiles full's and h2o's decode step
    # (37-44 s each on the H200); snapkv and streaming then take ~3 s (inductor's caches), so they follow at
    # batch 16 (the transformers comparison). Then batch 1's full cache (the bandwidth floor), full and h2o
    # at batch 64 (the 2x target); the rest (64: snapkv, streaming; 1: h2o, snapkv, streaming) last.
    gen_lead=((16, "full"), (16, "h2o"), (16, "snapkv"), (16, "streaming"), (1, "full"), (64, "full"),
              (64, "h2o")),
    prefill_policies=("full", "h2o", "keyformer", "snapkv", "squeeze+keyformer"), budget=0.2,
    hf_run=(16, 256), capacity_new=128, capacity_full_batch=4, capacity_max_ratio=8, reps=20,
    quant=((64, 4096), (8, 4096)))
SMOKE = Shapes(
    decode=((2, 64), (1, 256)), heads=(4, 2, 32), page=16, splits=(1, 2), compact=(2, 64, 0.25),
    prefill_len=48, model="tiny", prompt_len=48, runs=((1, 6), (2, 6)),
    policies=("full", "h2o", "snapkv", "streaming"), gen_lead=((2, "full"), (2, "h2o"), (1, "full")),
    prefill_policies=("full", "h2o", "snapkv"), budget=0.2,
    hf_run=(2, 6), capacity_new=4, capacity_full_batch=1, capacity_max_ratio=4, reps=1,
    quant=((2, 64),))


# ----------------------------------------------------------------------------------------------------
# A stage's context: deadline, records, timing
# ----------------------------------------------------------------------------------------------------

class Stage:
    """What a stage process has: its output file, its deadline, the device and the shapes."""

    def __init__(self, name: str, out: Path, deadline: float, smoke: bool) -> None:
        import torch

        self.name, self.out, self.deadline, self.smoke = name, out, deadline, smoke
        self.cuda = torch.cuda.is_available() and not smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.shapes = SMOKE if smoke else REAL
        self.path = out / f"{name}.jsonl"

    def left(self) -> float:
        return self.deadline - time.time()

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"stage": self.name, "kind": kind, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        return record

    def error(self, where: str) -> None:
        self.emit("error", where=where, traceback=traceback.format_exc()[-6000:])

    def skipped(self, what: str, why: str) -> None:
        self.emit("skipped", what=what, why=why)

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> float:
        """Seconds of one ``fn()``: CUDA events around it on the GPU, wall time on the CPU."""
        import torch

        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def calls(self, reps: int | None = None) -> int:
        """How many calls a measurement times: ``reps`` (default the shapes'); with --smoke at most the
        smoke's few, since it checks that each measurement runs, not its number (the interpreter is slow)."""
        reps = reps or self.shapes.reps
        return min(reps, self.shapes.reps) if self.smoke else reps

    def seconds(self, fn: Callable[[], Any], reps: int | None = None) -> tuple[float, str]:
        """Median device seconds of one ``fn()`` and how they were measured. On CUDA: ``reps`` calls
        captured in one CUDA graph, replayed (launch overhead excluded); events around each call when the
        call cannot be captured. On CPU: wall time."""
        import torch

        reps = self.calls(reps)
        for _ in range(1 if self.smoke else 2):  # warm-up (compiles; on a GPU, the second settles clocks)
            fn()
        self.sync()
        if not self.cuda:
            return statistics.median(self.timed(fn) for _ in range(reps)), "wall"
        try:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    fn()
            return statistics.median(self.timed(graph.replay) for _ in range(5)) / reps, "cuda-graph"
        except Exception:  # noqa: BLE001 -- not capturable (a host sync inside): time it with events
            torch.cuda.synchronize()
            return statistics.median(self.timed(fn) for _ in range(reps)), "events"

    def mutating_seconds(self, setup: Callable[[], Any], fn: Callable[[Any], Any],
                         reps: int | None = None) -> float:
        """Median seconds of ``fn(setup())`` with only ``fn`` timed (``fn`` mutates what ``setup`` made)."""
        reps = reps or self.shapes.reps
        fn(setup())  # warm-up (compiles Triton kernels)
        times = []
        for _ in range(reps):
            args = setup()
            self.sync()
            times.append(self.timed(functools.partial(fn, args)))
        return statistics.median(times)

    def copy_bandwidth(self) -> dict[str, float]:
        """Device-to-device copy bandwidth (bytes read + written per second) on a 512 MiB buffer."""
        import torch

        nbytes = (512 << 20) if self.cuda else (16 << 20)
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        s, how = self.seconds(lambda: dst.copy_(src), reps=10)
        return {"bytes": nbytes, "seconds": s, "gb_s": 2 * nbytes / s / 1e9, "timed_by": how}


# ----------------------------------------------------------------------------------------------------
# Stage: env
# ----------------------------------------------------------------------------------------------------

def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 -- absent or broken: reported as None
        return None


def stage_env(st: Stage) -> None:
    import torch

    info: dict[str, Any] = dict(python=platform.python_version(), torch=torch.__version__,
                                triton=_version("triton"), transformers=_version("transformers"),
                                cuda=torch.version.cuda, smoke=st.smoke)
    if st.cuda:
        props = torch.cuda.get_device_properties(0)
        major, minor = torch.cuda.get_device_capability()
        info.update(device=torch.cuda.get_device_name(), capability=f"{major}.{minor}",
                    sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info.update(device=f"cpu ({os.cpu_count()} cores)", capability=None)
    st.emit("env", **info)
    st.emit("copy", **st.copy_bandwidth())


# ----------------------------------------------------------------------------------------------------
# Stage: correctness (pytest on CUDA, one JSON line per test through the plugin below)
# ----------------------------------------------------------------------------------------------------

def pytest_runtest_logreport(report: Any) -> None:
    """pytest hook (this module is loaded with ``-p gpu``): one line per test outcome, written at once."""
    path = os.environ.get("KVBENCH_TEST_LOG")
    if not path or (report.when != "call" and report.passed):
        return
    record = {"stage": "correctness", "kind": "test", "test": report.nodeid, "when": report.when,
              "outcome": report.outcome, "seconds": round(report.duration, 3)}
    if report.failed:
        record["traceback"] = str(report.longrepr)[-4000:]
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    """pytest hook: the tests in the order of the arguments that name them (``KVBENCH_TEST_ORDER``, a JSON
    list). pytest merges overlapping arguments (a test named alone and its whole file later) and runs them
    where the file is, which put the first-listed tests of run 4, 2026-11-28 after the time box."""
    order = os.environ.get("KVBENCH_TEST_ORDER")
    if not order:
        return
    args = json.loads(order)

    def rank(item: Any) -> tuple[bool, int]:
        return (any(k in item.nodeid for k in LAST_TESTS),
                next((i for i, a in enumerate(args) if item.nodeid == a or item.nodeid.startswith(a + "::")
                      or item.nodeid.startswith(a + "[")), len(args)))

    items.sort(key=rank)  # stable: a file's own order within each argument


def stage_correctness(st: Stage, files: tuple[str, ...] | None = None) -> None:
    import importlib.util

    files = files or (SMOKE_TEST_FILES if st.smoke else TEST_FILES)
    env = {**os.environ, "KVBENCH_TEST_LOG": str(st.path), "HYPOTHESIS_PROFILE": "ci",
           "KVBENCH_TEST_ORDER": json.dumps(list(files)),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    if st.cuda:
        env.update(KVPOLICIES_TEST_DEVICE="cuda", TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "gpu", "-p", "no:cacheprovider", "-o", "addopts=",
           "--strict-markers", *files]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append("--timeout=120")
    log = st.out / "correctness-pytest.log"
    t0 = time.time()
    cut = False
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=max(5.0, st.left() - 5))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc, cut = None, True
    tests = [r for r in _read_jsonl(st.path) if r["kind"] == "test"]
    counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "skipped")}
    st.emit("tests_done", returncode=rc, cut_at_time_box=cut, seconds=round(time.time() - t0, 1),
            files=list(files), log_tail=open(log).read()[-1500:], **counts)


# ----------------------------------------------------------------------------------------------------
# Stage: kernels
# ----------------------------------------------------------------------------------------------------

def _decode_pool(st: Stage, batch: int, ctx: int):
    """A full paged cache (pages shuffled) of ``batch`` sequences of ``ctx`` tokens, and its dense gather."""
    import torch

    hq, hkv, d = st.shapes.heads
    page = st.shapes.page
    gen = torch.Generator().manual_seed(0)
    per_seq = math.ceil(ctx / page)
    n_pages = batch * per_seq
    dev, dt = st.device, st.dtype
    k_pages = torch.randn(n_pages, page, hkv, d, generator=gen).to(dev, dt)
    v_pages = torch.randn(n_pages, page, hkv, d, generator=gen).to(dev, dt)
    table = torch.randperm(n_pages, generator=gen).view(batch, per_seq).to(dev, torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, generator=gen).to(dev, dt)
    k_dense = k_pages[table.long()].reshape(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    v_dense = v_pages[table.long()].reshape(batch, -1, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    kv_bytes = 2 * batch * ctx * hkv * d * k_pages.element_size()
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, table=table, lens=lens, k_dense=k_dense,
                v_dense=v_dense, scale=d ** -0.5, kv_bytes=kv_bytes,
                score=torch.zeros(n_pages, page, hkv, device=dev))


def _decode_shape(st: Stage, shape: str, t: dict[str, Any], copy_gb_s: float) -> None:
    """The op at its defaults, with the fused H2O and Keyformer (Gumbel noise hashed in the kernel) score
    updates, and SDPA on the dense gather, at one shape."""
    import torch
    import torch.nn.functional as F

    from kvkernels.paged_attention import ScoreUpdate, paged_decode_attention_triton

    args = (t["q"], t["k_pages"], t["v_pages"], t["table"], t["lens"])
    q4 = t["q"][:, :, None, :]
    h2o = ScoreUpdate(t["score"], "accumulate")
    dev = t["q"].device
    batch, n_q = t["q"].shape[:2]
    keys = torch.arange(batch * n_q, dtype=torch.int32, device=dev).view(batch, n_q)  # noise key per head
    gumbel = ScoreUpdate(t["score"], "gumbel", 1.0, keys, torch.ones(1, device=dev))
    impls = {
        "paged": lambda: paged_decode_attention_triton(*args, scale=t["scale"]),
        "paged+h2o-score": lambda: paged_decode_attention_triton(*args, scale=t["scale"], scores=h2o),
        "paged+keyformer-score": lambda: paged_decode_attention_triton(*args, scale=t["scale"],
                                                                       scores=gumbel),
        "sdpa-dense": lambda: F.scaled_dot_product_attention(q4, t["k_dense"], t["v_dense"], scale=t["scale"],
                                                             enable_gqa=True),
    }
    for impl, fn in impls.items():
        s, how = st.seconds(fn)
        gb_s = t["kv_bytes"] / s / 1e9
        st.emit("decode", shape=shape, impl=impl, us=s * 1e6, gb_s=gb_s, pct_of_copy=100 * gb_s / copy_gb_s,
                timed_by=how, kv_bytes=t["kv_bytes"], config="default" if impl != "sdpa-dense" else None)
    # Where the time goes: each kernel's share of a call (the fused score update's cost at B8 and B64; at
    # B1-L32768 the split-K combine, a loop over 33 splits until 2026-12-01, now two tiles of them).
    for impl in ("paged", "paged+h2o-score") + (("paged+keyformer-score",) if shape != "B1-L32768" else ()):
        try:
            st.emit("decode_kernels", shape=shape, impl=impl, **_kernel_times(st, impls[impl]))
        except Exception:  # noqa: BLE001 -- the profiler: recorded, the timings above stand
            st.error(f"decode_kernels {shape} {impl}")


def _kernel_times(st: Stage, fn: Callable[[], Any], reps: int = 20,
                  calls: list[Callable[[], Any]] | None = None) -> dict[str, Any]:
    """Microseconds per call of each kernel ``fn`` launches (``torch.profiler``: device time of the CUDA
    kernels on the GPU, CPU time of the operators with --smoke), named by kernel. ``calls``: these calls
    (each made once; a mutating op's calls on inputs prepared beforehand) in place of ``reps`` calls of
    ``fn``, which warms up."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    st.sync()
    calls = calls or [fn] * st.calls(reps)
    activity = ProfilerActivity.CUDA if st.cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for call in calls:
            call()
        st.sync()
    attr = "device_time_total" if st.cuda else "cpu_time_total"
    per_call = {e.key: getattr(e, attr) / len(calls) for e in prof.key_averages() if getattr(e, attr) > 0}
    return dict(kernels_us={k: round(v, 2) for k, v in sorted(per_call.items(), key=lambda kv: -kv[1])},
                total_us=round(sum(per_call.values()), 2), timed_by=f"profiler ({activity.name.lower()})")


def _sweep_point(st: Stage, shape: str, t: dict[str, Any], cfg: Any, splits: int, copy_gb_s: float) -> None:
    from kvkernels.paged_attention import paged_decode_attention_triton
    from kvkernels.tuning import override

    args = (t["q"], t["k_pages"], t["v_pages"], t["table"], t["lens"])
    try:
        with override(decode=cfg):
            s, how = st.seconds(lambda: paged_decode_attention_triton(*args, scale=t["scale"],
                                                                      num_splits=splits))
        gb_s = t["kv_bytes"] / s / 1e9
        st.emit("decode_sweep", shape=shape, config=cfg.__dict__, num_splits=splits, us=s * 1e6, gb_s=gb_s,
                pct_of_copy=100 * gb_s / copy_gb_s, timed_by=how)
    except Exception:  # noqa: BLE001 -- e.g. out of shared memory for this tile
        st.emit("decode_sweep", shape=shape, config=cfg.__dict__, num_splits=splits,
                error=traceback.format_exc(limit=2)[-800:])


def _decode_records(st: Stage, copy_gb_s: float) -> dict[str, dict[str, Any]]:
    """The decode op at its defaults per shape; returns the pools for the sweep."""
    pools = {}
    for batch, ctx in st.shapes.decode:
        shape = f"B{batch}-L{ctx}"
        try:
            pools[shape] = _decode_pool(st, batch, ctx)
            _decode_shape(st, shape, pools[shape], copy_gb_s)
        except Exception:  # noqa: BLE001
            st.error(f"decode {shape}")
    return pools


def _decode_sweep(st: Stage, cfg: Any, pools: dict[str, dict[str, Any]], copy_gb_s: float) -> None:
    """One launch config at every shape and split count."""
    for shape, t in pools.items():
        max_len = t["table"].shape[1] * st.shapes.page
        for splits in st.shapes.splits:
            if splits == 1 or max_len / splits >= cfg.block:
                _sweep_point(st, shape, t, cfg, splits, copy_gb_s)


def _compaction_records(st: Stage) -> None:
    """Prompt compaction (``topk_compact``) and one decode step's eviction (``topk_evict``, one token per
    head: the sort-based plan, and the selection kernel the cache uses with ``max_excess=1``) on the paged
    pool, against ``torch.topk`` + ``gather`` on dense tensors of the same tokens."""
    batch, length, frac = st.shapes.compact
    budget = max(16, int(length * frac))
    for op, fill in (("topk_compact", length), ("topk_evict", budget + 1),
                     ("topk_evict max_excess=1", budget + 1)):
        try:
            _compaction(st, op, batch, length, fill, budget)
        except Exception:  # noqa: BLE001
            st.error(op)


def _compaction(st: Stage, op: str, batch: int, length: int, fill: int, budget: int) -> None:
    import torch

    from kvkernels.topk_compact import topk_compact, topk_evict

    _, hkv, d = st.shapes.heads
    page, dev = st.shapes.page, st.device
    i32 = lambda x: torch.full((batch,), x, device=dev, dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    per_seq = math.ceil(length / page)
    n_pages = batch * per_seq
    k = torch.randn(n_pages, page, hkv, d, generator=gen).to(dev, st.dtype)
    v = torch.randn(n_pages, page, hkv, d, generator=gen).to(dev, st.dtype)
    score = torch.rand(n_pages, page, hkv, generator=gen).to(dev)
    pos = torch.arange(per_seq * page, dtype=torch.int32).view(per_seq, page, 1).repeat(batch, 1, hkv).to(dev)
    table = torch.randperm(n_pages, generator=gen).view(batch, per_seq).to(dev, torch.int32)
    fn = topk_compact if op == "topk_compact" else topk_evict
    kw = {"max_excess": 1} if op.endswith("max_excess=1") else {}  # the selection kernel (the cache's case)
    counts = (i32(fill), i32(budget), i32(4), i32(min(16, budget // 4)))

    used = table[:, :math.ceil(fill / page)].contiguous()  # the columns in use, as the cache passes them

    def setup():
        free = torch.zeros(n_pages + 1, device=dev, dtype=torch.int32)
        return (k.clone(), v.clone(), pos.clone(), score.clone(), used.clone(), *counts, free,
                torch.zeros(1, device=dev, dtype=torch.int64))

    # As the cache calls it every step: no eager value checks (each reads the device back). Events around one
    # eager call: the host's launches of its ~20-40 small kernels included (run 4 of 2026-11-28: 686 us where
    # its kernels ran 46 us), which a compiled decode step captured as a CUDA graph does not pay; the device
    # time by kernel (torch.profiler) is the number to compare with topk + gather's CUDA-graph time.
    s_op = st.mutating_seconds(setup, lambda a: fn(*a, validate=False, **kw))
    device_us = None
    try:
        inputs = [setup() for _ in range(5)]
        times = _kernel_times(st, lambda: fn(*setup(), validate=False, **kw),
                              calls=[functools.partial(fn, *a, validate=False, **kw) for a in inputs])
        del inputs
        device_us = times["total_us"]
        st.emit("compaction_kernels", op=op, batch=batch, tokens=fill, keep=budget, **times)
    except Exception:  # noqa: BLE001 -- the profiler: recorded, the timing above stands
        st.error(f"compaction_kernels {op}")
    # Dense: the same tokens in logical order, [B, Hkv, fill, D]; keep `budget` per head.
    rows = table.long()
    dk = k[rows].reshape(batch, -1, hkv, d)[:, :fill].transpose(1, 2).contiguous()
    dv = v[rows].reshape(batch, -1, hkv, d)[:, :fill].transpose(1, 2).contiguous()
    ds = score[rows].reshape(batch, -1, hkv)[:, :fill].transpose(1, 2).contiguous()

    def dense():
        idx = torch.topk(ds, budget, dim=-1).indices.sort(dim=-1).values[..., None].expand(-1, -1, -1, d)
        return dk.gather(2, idx), dv.gather(2, idx)

    s_dense, how = st.seconds(dense)
    st.emit("compaction", op=op, batch=batch, tokens=fill, keep=budget, op_device_us=device_us,
            topk_gather_us=s_dense * 1e6,
            device_over_topk_gather=None if device_us is None else device_us / (s_dense * 1e6),
            op_eager_us=s_op * 1e6, op_eager_over_topk_gather=s_op / s_dense,
            timed_by=f"op: torch.profiler device time (eager: events around one call); topk + gather: {how}")


def _prefill_inputs(st: Stage):
    import torch

    L = st.shapes.prefill_len
    hq, hkv, d = st.shapes.heads
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(L, hq, d, generator=gen).to(st.device, st.dtype)
    k, v = (torch.randn(L, hkv, d, generator=gen).to(st.device, st.dtype) for _ in range(2))
    return q, k, v, d ** -0.5


def _prefill_records(st: Stage) -> None:
    """The prefill scorer against the plain causal attention of the prompt (one layer, one sequence): the
    attention with the lse the scorer reuses (``prefill_attention(need_lse=True)``: torch's flash kernel on
    CUDA), then per mode the attention and the scorer as the library runs them, without the lse (the
    scorer's own normaliser pass), and with the column pass's earlier loop order (``heads_outer=False``)."""
    from kvkernels.score_update import (
        COLUMN_SUM_MODES,
        prefill_attention,
        prefill_attention_scores,
        prefill_scores,
        prefill_scores_triton,
    )

    q, k, v, scale = _prefill_inputs(st)
    L = q.shape[0]
    try:
        plain, how = st.seconds(lambda: prefill_attention(q, k, v, scale=scale), reps=5)
        st.emit("prefill", impl="attention", mode="none", L=L, ms=plain * 1e3, over_attention=1.0,
                timed_by=how, kernels=_kernel_names(st, lambda: prefill_attention(q, k, v, scale=scale)))
        s, how = st.seconds(lambda: prefill_attention(q, k, v, scale=scale, need_lse=True), reps=5)
        has_lse = prefill_attention(q, k, v, scale=scale, need_lse=True)[1] is not None
        answered = _lse_kernel_records(st, q, k, v, scale, plain)
        # need_lse runs the first of LSE_KERNELS that answers alone (the same refusals and checks)
        st.emit("prefill", impl="attention (need_lse)", mode="none", L=L, ms=s * 1e3,
                over_attention=s / plain, lse=has_lse, lse_kernel=answered[0] if answered else None,
                timed_by=how)
    except Exception:  # noqa: BLE001
        st.error("prefill attention")
        return
    for mode in ("accumulate", "gumbel"):
        def separate(mode=mode, need_lse=True, heads_outer=True):
            _, lse = prefill_attention(q, k, v, scale=scale, need_lse=need_lse)
            lse = lse if need_lse else None  # on CPU the attention returns it regardless
            if heads_outer:
                return prefill_scores(q, k, scale=scale, mode=mode, seed=1, lse=lse)
            return prefill_scores_triton(q, k, scale=scale, mode=mode, seed=1, lse=lse, heads_outer=False)

        impls = [("attention+scorer", separate),
                 ("attention+scorer, heads inner", functools.partial(separate, heads_outer=False))]
        if mode in COLUMN_SUM_MODES:  # the modes the attention can score in the same pass
            impls.insert(1, ("attention+scorer, no lse", functools.partial(separate, need_lse=False)))
            impls.append(("fused", lambda mode=mode: prefill_attention_scores(q, k, v, scale=scale,
                                                                              mode=mode)))
        for impl, fn in impls:
            try:
                s, how = st.seconds(fn, reps=5)
                st.emit("prefill", impl=impl, mode=mode, L=L, ms=s * 1e3, over_attention=s / plain,
                        timed_by=how)
            except Exception:  # noqa: BLE001
                st.error(f"prefill {impl} {mode}")


def _lse_kernel_records(st: Stage, q: Any, k: Any, v: Any, scale: float, plain: float) -> list[str]:
    """Each kernel of ``kvkernels.score_update.LSE_KERNELS`` alone on the prompt, timed (CUDA only); returns
    those that answered, in that order."""
    if not st.cuda:
        return []
    from kvkernels.score_update import LSE_KERNELS, _attention_with_lse

    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
    answered = []
    for name in LSE_KERNELS:
        try:
            if _attention_with_lse(qt, kt, vt, scale, (name,)) is None:
                st.emit("prefill", impl=f"attention ({name} lse)", mode="none", L=q.shape[0], lse=False,
                        note="refused these inputs, or its lse failed the first-use check")
                continue
            answered.append(name)
            s, how = st.seconds(lambda name=name: _attention_with_lse(qt, kt, vt, scale, (name,)), reps=5)
            st.emit("prefill", impl=f"attention ({name} lse)", mode="none", L=q.shape[0], ms=s * 1e3,
                    over_attention=s / plain, lse=True, timed_by=how)
        except Exception:  # noqa: BLE001
            st.error(f"prefill attention {name} lse")
    return answered


def _kernel_names(st: Stage, fn: Callable[[], Any]) -> list[str] | None:
    """The CUDA kernels ``fn`` launches, longest first (torch.profiler; None on CPU or if it fails): which
    kernel SDPA picked."""
    if not st.cuda:
        return None
    try:
        return [name[:80] for name in _kernel_times(st, fn, reps=2)["kernels_us"]][:3]
    except Exception:  # noqa: BLE001 -- a name is a note, never worth the stage
        return None


def _prefill_sweep(st: Stage, cfg: Any, inputs: tuple) -> None:
    """One launch config of the prefill scorer (H2O's accumulate mode, no log-sum-exp given)."""
    from kvkernels.score_update import prefill_scores
    from kvkernels.tuning import override

    q, k, _, scale = inputs
    try:
        with override(prefill_scores=cfg):
            s, how = st.seconds(lambda: prefill_scores(q, k, scale=scale, mode="accumulate"), reps=5)
        st.emit("prefill_sweep", config=cfg.__dict__, L=q.shape[0], ms=s * 1e3, timed_by=how)
    except Exception:  # noqa: BLE001 -- e.g. out of shared memory for this tile
        st.emit("prefill_sweep", config=cfg.__dict__, L=q.shape[0],
                error=traceback.format_exc(limit=2)[-800:])


def stage_kernels(st: Stage) -> None:
    from kvkernels.tuning import sweep_configs

    copy = st.copy_bandwidth()
    st.emit("copy", **copy)
    # Single measurements first (the prefill scorer's, changed since the last run, before the decode's), then
    # the two sweeps interleaved (a cut leaves both some of each shape).
    try:
        _prefill_records(st)
    except Exception:  # noqa: BLE001
        st.error("_prefill_records")
    pools = _decode_records(st, copy["gb_s"])
    try:
        _compaction_records(st)
    except Exception:  # noqa: BLE001
        st.error("_compaction_records")
    decode, prefill = sweep_configs("decode"), sweep_configs("prefill_scores")
    if st.smoke:  # that the sweeps run: a few configs each
        decode, prefill = decode[:3], prefill[:3]
    inputs = _prefill_inputs(st)
    for i in range(max(len(decode), len(prefill))):
        # A config's compiles and points take ~5-8 s on a GPU (each point is recorded as it is measured, so a
        # stage killed past its box keeps them); the box's 10 s of grace covers one started late.
        # --smoke always runs the first config (what it checks is that the sweeps run; on a 2-core CPU the
        # stage's other work took 34 to 43 s of its 48 s box, which left the sweeps under 3 s at times).
        if st.left() < (3 if st.smoke else 6) and not (st.smoke and i == 0):
            st.skipped("sweeps", f"time box: {min(i, len(decode))} of {len(decode)} decode and "
                       f"{min(i, len(prefill))} of {len(prefill)} prefill configs measured")
            return
        if i < len(decode):
            _decode_sweep(st, decode[i], pools, copy["gb_s"])
        if i < len(prefill):
            _prefill_sweep(st, prefill[i], inputs)


# ----------------------------------------------------------------------------------------------------
# Stage: quant (issue 36: decode attention over packed 4- and 8-bit pages against the same pages in bf16)
# ----------------------------------------------------------------------------------------------------

# The example the H200 found (tests/test_quant_attention.py's _GPU_FOUND): one KV head, one query head, head
# dim 16, 2-bit keys and values in groups of 8 (float16 parameters), float16 queries, pages of one slot, one
# sequence of 2 slots, three splits; the loop without prefetching was 0.22 off the reference there when it
# read contiguous code bytes (run 4 of 2026-11-28: 4- and 2-bit rows of head dim 16 failed, 8-bit rows, head
# dim 64 and every prefetched variant, which reads int32 words, passed). It reads words since
# (quant_attention._loads); a pool that does not start on 4 bytes gathers each channel's code byte ("bytes":
# the pools placed 2 bytes into a buffer).
PROBE_BASE: dict[str, Any] = dict(page=1, n_kv=1, gqa=1, d=16, k=(2, 8), v=(2, 8), lens=(2,), q="float16",
                                  seed=0, prefetch=0, stages=None, splits=3, bytes=False)
# (label, what changes): the most telling first (each variant compiles its kernels: the box may cut the
# tail), each one change from the base; "gathered": rows of head dims that are not powers of two, which the
# library runs without prefetching, a code byte per channel; "bytes" last (the gather on power-of-two rows,
# never run on a GPU: a CUDA error there ends the process's CUDA context and with it the stage, as the
# misaligned parameter reads of run 5, 2026-11-28, did).
PROBE_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("base", {}),  # failed in runs 1 and 4 of 2026-11-28 (code bytes); passed in run 5 (words)
    ("4-bit", {"k": (4, 8), "v": (4, 8)}),
    ("GQA 4", {"gqa": 4}),
    ("40 slots", {"lens": (40,)}),
    ("pages of 16", {"page": 16}),
    ("head dim 96, 4-bit g32, gathered", {"d": 96, "k": (4, 32), "v": (4, 32), "page": 16, "gqa": 4,
                                          "lens": (300, 17), "prefetch": 8}),
    ("num_stages=1", {"stages": 1}),
    ("8-bit", {"k": (8, 8), "v": (8, 8)}),
    ("head dim 64", {"d": 64}),
    ("float32 queries", {"q": "float32"}),
    ("one split", {"splits": 1}),
    ("head dim 48, gathered", {"d": 48, "prefetch": 8}),
    ("prefetched", {"prefetch": 8}),
    ("bytes", {"bytes": True}),  # pools off 4 bytes: the per-channel gather at head dim 16
    ("4-bit, bytes", {"k": (4, 8), "v": (4, 8), "bytes": True}),
)


def _off_four(pool):
    """``pool`` copied into a buffer 2 bytes past its start: the same rows in a pool off 4 bytes but on the
    float16 parameters' 2 (the kernel's per-channel gather, ``quant_attention._loads`` 0; off 1 byte the
    launcher refuses it: run 5 of 2026-11-28 read its parameters misaligned, a CUDA error)."""
    import torch

    buf = torch.empty(pool.numel() + 4, dtype=torch.uint8, device=pool.device)
    out = buf[2:2 + pool.numel()].view(pool.shape)
    out.copy_(pool)
    return out


def _probe_one(st: Stage, case: dict[str, Any]) -> dict[str, Any]:
    """One launch of the quantized decode kernel (``quant_decode_attention_triton``) on ``case`` against the
    reference on the dequantized pool rounded to the query dtype (as ``tests/test_quant_attention.py``)."""
    import torch

    from kvkernels import quant_attention
    from kvkernels.quant import QuantFormat, dequantize_rows, quantize_rows
    from kvkernels.quant_attention import quant_decode_attention_ref, quant_decode_attention_triton
    from kvkernels.tuning import LaunchConfig, launch_config, override

    S, D, lens = case["page"], case["d"], list(case["lens"])
    q_dtype = getattr(torch, case["q"])
    k_fmt, v_fmt = (QuantFormat(b, g, torch.float16) for b, g in (case["k"], case["v"]))
    g = torch.Generator().manual_seed(case["seed"])
    per_seq = [math.ceil(n / S) for n in lens]
    P = sum(per_seq) + 2
    perm = torch.randperm(P, generator=g).to(torch.int32)
    table = torch.full((len(lens), max(per_seq + [1]) + 1), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[i:i + n]
        i += n
    kq = quantize_rows(torch.randn(P, S, case["n_kv"], D, generator=g) * 2, k_fmt)
    vq = quantize_rows(torch.randn(P, S, case["n_kv"], D, generator=g), v_fmt)
    q = torch.randn(len(lens), case["n_kv"] * case["gqa"], D, generator=g).to(q_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    seen = [dequantize_rows(x, D, f).to(q_dtype).float() for x, f in ((kq, k_fmt), (vq, v_fmt))]
    want = quant_decode_attention_ref(q.float(), *seen, table, seq_lens, scale=D ** -0.5, k_format=None,
                                      v_format=None)
    cfg = launch_config("quant_decode", st.device)
    if case["stages"] is not None:
        cfg = LaunchConfig(block=cfg.block, num_warps=cfg.num_warps, num_stages=case["stages"])
    dev = [x.to(st.device) for x in (q, kq, vq, table, seq_lens)]
    if case["bytes"]:
        dev[1], dev[2] = _off_four(dev[1]), _off_four(dev[2])
    with override(quant_decode=cfg), quant_attention.prefetch_tiles(case["prefetch"]):
        took = quant_attention._loads(dev[1], dev[2], k_fmt, v_fmt, D)
        got = quant_decode_attention_triton(*dev, scale=D ** -0.5, k_format=k_fmt, v_format=v_fmt,
                                            num_splits=case["splits"]).float().cpu()
    err = (got - want).abs()
    tol = 2e-3 if q_dtype == torch.float16 else 2e-5
    bad = err > tol + tol * want.abs()
    return dict(loop=LOOPS[took], config=cfg.__dict__,
                max_abs_err=float(err.max()) if err.numel() else 0.0, tol=tol, ok=not bool(bad.any()),
                bad_elements=int(bad.sum()), elements=err.numel())


# quant_attention._loads: how the kernel's loop reads a region's rows.
LOOPS = {0: "bytes, without prefetching", 1: "words, without prefetching", 2: "prefetched"}


def stage_quant_probe(st: Stage) -> None:
    """Each of :data:`PROBE_VARIANTS` once (a compile each), recorded as it finishes; a variant that raises is
    recorded with its error, and the stage ends with its box."""
    for i, (label, change) in enumerate(PROBE_VARIANTS):
        if st.left() < 3:
            st.skipped("quant_probe", f"time box: {i} of {len(PROBE_VARIANTS)} variants run")
            return
        case = {**PROBE_BASE, **change}
        t0 = time.time()
        try:
            st.emit("quant_probe", variant=label, case=case, **_probe_one(st, case),
                    seconds=round(time.time() - t0, 2))
        except Exception as e:  # noqa: BLE001 -- recorded, and the next variant runs
            tb = traceback.format_exc()
            lines = [ln for ln in tb.strip().splitlines() if "CUDA error" in ln or "Error" in ln]
            st.emit("quant_probe", variant=label, case=case, error=tb[-3000:],
                    error_line=(lines[-1] if lines else tb.strip().splitlines()[-1])[:200],
                    seconds=round(time.time() - t0, 2))
            if type(e).__name__ == "AcceleratorError" or "CUDA error" in str(e):
                st.skipped("quant_probe", f"CUDA error in {label!r}: the process's CUDA context is lost, "
                                          f"{len(PROBE_VARIANTS) - i - 1} variants not run")
                return


QUANT_TARGET_SHAPE = "B64-L4096"  # issue 36: 4-bit pages decode faster than bf16 pages at batch 64 / 4k


def _quant_pool(st: Stage, batch: int, ctx: int) -> dict[str, Any]:
    """A full paged cache (pages shuffled) of ``batch`` sequences of ``ctx`` tokens in the stage's dtype,
    drawn on the device (a B64/4k pool is 2 x 268M values: drawing them on the host takes seconds)."""
    import torch

    hq, hkv, d = st.shapes.heads
    page, dev, dt = st.shapes.page, st.device, st.dtype
    gen = torch.Generator(device=dev).manual_seed(0)
    per_seq = math.ceil(ctx / page)
    n_pages = batch * per_seq
    k_pages, v_pages = (torch.randn(n_pages, page, hkv, d, generator=gen, device=dev, dtype=dt)
                        for _ in range(2))
    table = torch.randperm(n_pages, generator=gen, device=dev).view(batch, per_seq).to(torch.int32)
    return dict(q=torch.randn(batch, hq, d, generator=gen, device=dev, dtype=dt), k_pages=k_pages,
                v_pages=v_pages, table=table, lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev),
                scale=d ** -0.5, rows=2 * batch * ctx * hkv)


def _quant_shape(st: Stage, shape: str, t: dict[str, Any], copy_gb_s: float) -> None:
    """At one shape: the native-dtype pages through ``paged_decode_attention`` (its own split choice, and one
    split), then each bit width's packed pages through
    ``quant_decode_attention``; each record's ``over_native`` is its time over the native pages' (default
    split), ``gb_s`` the K/V bytes it reads (packed rows for the quantized pages) per second."""
    import torch

    from kvkernels import quant_attention
    from kvkernels.paged_attention import ScoreUpdate, paged_decode_attention_triton
    from kvkernels.quant import QuantFormat, hadamard_rotation, quantize_rows, rotate
    from kvkernels.quant_attention import quant_decode_attention_triton

    args = (t["q"], t["k_pages"], t["v_pages"], t["table"], t["lens"])
    dtype = str(st.dtype).removeprefix("torch.")
    native_bytes = t["rows"] * t["k_pages"].shape[-1] * t["k_pages"].element_size()
    base = dict(shape=shape, heads=list(st.shapes.heads), page=st.shapes.page, dtype=dtype)

    def emit(impl: str, s: float, how: str, kv_bytes: int, **extra: Any) -> None:
        gb_s = kv_bytes / s / 1e9
        st.emit("quant_decode", **base, impl=impl, us=s * 1e6, kv_bytes=kv_bytes, gb_s=gb_s,
                pct_of_copy=100 * gb_s / copy_gb_s, over_native=s / native_s, timed_by=how, **extra)

    want = paged_decode_attention_triton(*args, scale=t["scale"]).float()
    native_s, how = st.seconds(lambda: paged_decode_attention_triton(*args, scale=t["scale"]))
    emit("native", native_s, how, native_bytes, bits=None)
    s, how = st.seconds(lambda: paged_decode_attention_triton(*args, scale=t["scale"], num_splits=1))
    emit("native-1split", s, how, native_bytes, bits=None)
    for bits in st.shapes.quant_bits:
        if st.left() < 5:
            st.skipped(f"quant {shape} int{bits}", f"time box: {st.left():.0f} s left")
            continue
        fmt = QuantFormat(bits, st.shapes.quant_group)
        kq, vq = quantize_rows(t["k_pages"], fmt), quantize_rows(t["v_pages"], fmt)  # [P, S, Hkv, W] uint8
        qargs = (t["q"], kq, vq, t["table"], t["lens"])
        kw = dict(scale=t["scale"], k_format=fmt, v_format=fmt)
        got = quant_decode_attention_triton(*qargs, **kw).float()
        s, how = st.seconds(lambda qargs=qargs, kw=kw: quant_decode_attention_triton(*qargs, **kw))
        # Not a check (the tests check the kernel): a kernel reading the wrong rows would show here.
        emit(f"int{bits}", s, how, t["rows"] * fmt.row_bytes(t["q"].shape[-1]), bits=bits,
             group=fmt.group, row_bytes=fmt.row_bytes(t["q"].shape[-1]),
             max_abs_diff_vs_native=float((got - want).abs().max()))
        other = not _quant_prefetch_default(bits)
        with _quant_prefetch(other):  # the kernel with its loads a tile ahead by hand, or without
            s, how = st.seconds(lambda qargs=qargs, kw=kw: quant_decode_attention_triton(*qargs, **kw))
            flipped = quant_decode_attention_triton(*qargs, **kw).float()
        emit(f"int{bits} prefetch={'on' if other else 'off'}", s, how,
             t["rows"] * fmt.row_bytes(t["q"].shape[-1]), bits=bits, group=fmt.group,
             row_bytes=fmt.row_bytes(t["q"].shape[-1]), bit_equal_to_default=torch.equal(flipped, got),
             max_abs_diff_vs_default=float((flipped - got).abs().max()))
        half = not quant_attention.HALF_ROWS  # float16 rows and products (2026-12-01), or float32 rows
        with quant_attention.half_rows(half):
            s, how = st.seconds(lambda qargs=qargs, kw=kw: quant_decode_attention_triton(*qargs, **kw))
            flipped = quant_decode_attention_triton(*qargs, **kw).float()
        emit(f"int{bits} half={'on' if half else 'off'}", s, how, t["rows"] * fmt.row_bytes(t["q"].shape[-1]),
             bits=bits, group=fmt.group, row_bytes=fmt.row_bytes(t["q"].shape[-1]),
             max_abs_diff_vs_native=float((flipped - want).abs().max()),
             max_abs_diff_vs_default=float((flipped - got).abs().max()))
        if bits == 4 and st.left() > 5:  # H2O's score update fused into the 4-bit decode (issue 36)
            score = ScoreUpdate(torch.zeros(kq.shape[:3], device=kq.device), "accumulate")
            for flip in (False, True):
                with quant_attention.half_rows(quant_attention.HALF_ROWS != flip):
                    s, how = st.seconds(lambda qargs=qargs, kw=kw, score=score: quant_decode_attention_triton(
                        *qargs, **kw, scores=score))
                    on = quant_attention.HALF_ROWS
                emit("int4+h2o-score" + (f" half={'on' if on else 'off'}" if flip else ""), s, how,
                     t["rows"] * fmt.row_bytes(t["q"].shape[-1]), bits=bits, group=fmt.group,
                     row_bytes=fmt.row_bytes(t["q"].shape[-1]))
        if bits == 4 and st.left() > 5:  # rotated rows (rotate=True): the two rotations around the kernel
            R = hadamard_rotation(t["q"].shape[-1], t["q"].device)

            def rotated(qargs=qargs, kw=kw, R=R):
                out = quant_decode_attention_triton(rotate(qargs[0], R), *qargs[1:], **kw)
                return rotate(out, R, back=True)

            s, how = st.seconds(rotated)
            emit("int4+rotate", s, how, t["rows"] * fmt.row_bytes(t["q"].shape[-1]), bits=bits,
                 group=fmt.group, row_bytes=fmt.row_bytes(t["q"].shape[-1]))
        del kq, vq
        if st.cuda:
            torch.cuda.empty_cache()


def stage_quant(st: Stage) -> None:
    """Each shape of ``st.shapes.quant`` (the target's first), its native pages then its packed pages; a
    shape is skipped when the box is nearly spent."""
    import torch

    copy = st.copy_bandwidth()
    st.emit("copy", **copy)
    try:
        _quant_write(st)
    except Exception:  # noqa: BLE001
        st.error("quant write")
    for i, (batch, ctx) in enumerate(st.shapes.quant):
        shape = f"B{batch}-L{ctx}"
        if st.left() < 8:
            st.skipped(f"quant {shape}", f"time box: {st.left():.0f} s left")
            continue
        try:
            _quant_shape(st, shape, _quant_pool(st, batch, ctx), copy["gb_s"])
        except Exception:  # noqa: BLE001
            st.error(f"quant {shape}")
        if st.cuda:
            torch.cuda.empty_cache()
        if i == 0:  # the target's shape: the occupancy probe before the other shapes and the sweep
            try:
                _quant_occupancy(st)
            except Exception:  # noqa: BLE001
                st.error("quant occupancy")
    _quant_sweep(st)


def _quant_packed(st: Stage) -> tuple[str, tuple, float, Any]:
    """The target's shape (``st.shapes.quant[0]``) as 4-bit pages: its name, the launcher's positional
    arguments ``(q, k_pages, v_pages, page_table, seq_lens)``, the scale and the format."""
    from kvkernels.quant import QuantFormat, quantize_rows

    batch, ctx = st.shapes.quant[0]
    t = _quant_pool(st, batch, ctx)
    fmt = QuantFormat(4, st.shapes.quant_group)
    args = (t["q"], quantize_rows(t["k_pages"], fmt), quantize_rows(t["v_pages"], fmt), t["table"], t["lens"])
    return f"B{batch}-L{ctx}", args, t["scale"], fmt


def _quant_prefetch_default(bits: int) -> bool:
    """Whether the launcher prefetches ``bits``-bit pages by hand by default."""
    from kvkernels import quant_attention

    return bits <= quant_attention.PREFETCH_TILES


def _quant_prefetch(on: bool) -> contextlib.AbstractContextManager[None]:
    """``kvkernels.quant_attention.prefetch_tiles``: on for every bit width, or off, inside the block."""
    from kvkernels import quant_attention

    return quant_attention.prefetch_tiles(8 if on else 0)


def _quant_write(st: Stage) -> None:
    """One decode step's K write for one layer at the target's batch: ``quantize_rows`` (one Triton launch
    on CUDA) against the torch path it replaced (``quantize`` + ``pack``, ~20 kernels); do they agree."""
    import torch

    from kvkernels.quant import QuantFormat, _quantize_fast, pack, quantize_rows

    batch = st.shapes.quant[0][0]
    _, hkv, d = st.shapes.heads
    fmt = QuantFormat(4, st.shapes.quant_group)
    x = torch.randn(batch, hkv, d, generator=torch.Generator().manual_seed(0)).to(st.device, st.dtype)
    torch_path = lambda: pack(_quantize_fast(x, fmt.bits, fmt.group, fmt.param_dtype))  # noqa: E731
    ours, how = st.seconds(lambda: quantize_rows(x, fmt, validate=False))
    ref, _ = st.seconds(torch_path)
    equal = bool(torch.equal(quantize_rows(x, fmt, validate=False), torch_path()))
    st.emit("quant_write", rows=batch * hkv, head_dim=d, bits=4, us=ours * 1e6, torch_path_us=ref * 1e6,
            speedup=ref / ours, bit_equal=equal, timed_by=how)


def _quant_sweep(st: Stage) -> None:
    """4-bit pages at the target's shape under each launch config of ``SWEEP["quant_decode"]`` (the default
    first), while the box lasts: the ``TUNED`` line to commit comes from these records."""
    import torch

    from kvkernels.quant_attention import quant_decode_attention_triton
    from kvkernels.tuning import override, sweep_configs

    configs = sweep_configs("quant_decode")
    if st.left() < 10 and not st.smoke:  # --smoke always sweeps its first config
        st.skipped("quant sweep", f"time box: {st.left():.0f} s left")
        return
    shape, args, scale, fmt = _quant_packed(st)
    # The default config both ways; the others prefetched as by default (the loop without prefetching was
    # slower at every config of run 4, 2026-11-28, by 1-30%).
    default = _quant_prefetch_default(4)
    both = [(configs[0], default), (configs[0], not default)] + [(cfg, default) for cfg in configs[1:]]
    if st.smoke:  # that the sweep runs (its first config both ways), not how many configs fit the box
        both = both[:2]
    for i, (cfg, on) in enumerate(both):
        if st.left() < 6 and not (st.smoke and i == 0):
            st.skipped("quant sweep", f"time box: {i} of {len(both)} configs measured")
            if not st.smoke:
                return
            break
        try:
            with override(quant_decode=cfg), _quant_prefetch(on):
                s, how = st.seconds(lambda: quant_decode_attention_triton(
                    *args, scale=scale, k_format=fmt, v_format=fmt), reps=5)
            st.emit("quant_sweep", shape=shape, bits=4, config=cfg.__dict__, prefetch=on, us=s * 1e6,
                    timed_by=how)
        except Exception:  # noqa: BLE001 -- e.g. out of shared memory for this tile
            st.emit("quant_sweep", shape=shape, bits=4, config=cfg.__dict__, prefetch=on,
                    error=traceback.format_exc(limit=2)[-800:])
    if st.cuda:
        torch.cuda.empty_cache()


#: The occupancy probe's ``(registers per thread, splits)`` points, the launcher's own first. At B64 / 4k the
#: launcher takes one split: 512 programs (64 sequences x 8 KV heads), all resident at once at four per SM
#: (114 registers x 128 threads each): 16 warps an SM, a quarter of what it can hold. The 4-bit loop issues
#: 470-570 instructions a 32-row tile (sm_90, Triton 3.9 / 3.6; the native loop 418 a 64-row tile:
#: ``bench/sass.py``), 120-150 us of issue at B64 where it took 364 us (H200, 2026-11-28): its warps mostly
#: wait, on memory or on their own chains (a tile's products, layout conversions, softmax), and larger
#: tiles did not help (block 128: 377 us). More resident warps would hide that waiting. They need more
#: programs (splits) *and* room for them (fewer registers: 64 fit eight per SM, 1024 programs in one wave;
#: 80 six, 96 five). Splits alone at 128 registers only add waves. The ceiling costs spills
#: (sm_90, the bench shape, prefetched; Triton 3.6, the device's / 3.9: 152 / 208 stack bytes at 64
#: registers, 80 / 112 at 80, 8 / 40 at 96, none at 128, where it takes 114).
OCCUPANCY = ((128, 1), (128, 2), (128, 4), (64, 2), (80, 2), (96, 2), (64, 4))


def _quant_occupancy(st: Stage) -> None:
    """4-bit pages at the target's shape, default launch config, at each ``OCCUPANCY`` point (registers per
    thread x split count): whether more resident warps, not fewer bytes, is what the quantized decode
    lacks. Right after the target's shape, before the other shapes and the launch-config sweep."""
    from kvkernels import quant_attention
    from kvkernels.quant_attention import quant_decode_attention_triton

    if st.left() < 8 and not st.smoke:
        st.skipped("quant occupancy", f"time box: {st.left():.0f} s left")
        return
    shape, args, scale, fmt = _quant_packed(st)
    batch, n_kv = args[0].shape[0], args[1].shape[2]
    # --smoke: each path once (one split, split-K, a ceiling); the interpreter ignores the ceiling itself
    points = [p for p in OCCUPANCY if p in ((128, 1), (128, 2), (64, 2))] if st.smoke else OCCUPANCY
    first = None
    for i, (regs, splits) in enumerate(points):
        if st.left() < 3 and not st.smoke:
            st.skipped("quant occupancy", f"time box: {i} of {len(points)} points measured")
            return
        try:
            with quant_attention.max_registers(regs):
                s, how = st.seconds(lambda splits=splits: quant_decode_attention_triton(
                    *args, scale=scale, k_format=fmt, v_format=fmt, num_splits=splits), reps=5)
        except Exception:  # noqa: BLE001 -- one point failing leaves the others
            st.emit("quant_occupancy", shape=shape, bits=4, max_registers=regs, num_splits=splits,
                    error=traceback.format_exc(limit=2)[-800:])
            continue
        first = s if first is None else first
        st.emit("quant_occupancy", shape=shape, bits=4, max_registers=regs, num_splits=splits,
                programs=batch * n_kv * splits, us=s * 1e6, over_first=s / first, timed_by=how)


# ----------------------------------------------------------------------------------------------------
# Stages: generation, hf_static, capacity
# ----------------------------------------------------------------------------------------------------

def _config(st: Stage, max_seq_len: int):
    """The benchmarked model's shape: Llama-3.2-1B, or a tiny Llama for --smoke."""
    from kvmodels.llama import LlamaConfig

    if st.shapes.model == "tiny":
        return tiny_llama_config(max_seq_len)
    return LlamaConfig.from_name(st.shapes.model, max_seq_len=max_seq_len)


def tiny_llama_config(max_seq_len: int):
    """The smoke runs' Llama (here and in ``bench/test_bench_generate.py``): 2 layers, GQA 2, compiled in
    seconds."""
    from kvmodels.llama import LlamaConfig

    return LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=128,
                       max_seq_len=max_seq_len)


def _model(st: Stage, max_seq_len: int):
    """kvmodels' Llama of :func:`_config`'s shape with random weights (seed 0), in the stage's dtype."""
    import torch

    from kvmodels.llama import Llama

    torch.manual_seed(0)
    cfg = _config(st, max_seq_len)
    with torch.device(st.device):
        model = Llama(cfg)
    return model.to(st.dtype).eval(), cfg


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=g).tolist()


def decode_rates(stamps: list[float], batch: int) -> dict[str, float | None]:
    """From the times each step's token was ready (``stamps[0]`` ends the prefill): the first decode
    step's seconds (the compile, when compiled), steady-state tok/s leaving out the first three steps
    (compile, then CUDA graph warm-up and recording), and tok/s leaving out the first step only."""
    n = len(stamps) - 1  # decode steps
    warm = max(0, min(3, n - 1))
    return {"first_step_s": stamps[1] - stamps[0] if n >= 1 else None,
            "decode_tok_s": batch * (n - warm) / (stamps[-1] - stamps[warm]) if n > warm else None,
            "decode_tok_s_skip_first": batch * (n - 1) / (stamps[-1] - stamps[1]) if n > 1 else None}


def compile_phases() -> dict[str, float]:
    """torch.compile's seconds so far in this process by phase (``torch._dynamo.utils.compile_times``:
    Dynamo's trace, Inductor's lowering and codegen, the Triton compiles waited for, ...); {} where
    unavailable."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        return {n: float(v) for n, v in zip(names, values, strict=True)}
    except Exception:  # noqa: BLE001 -- a private API: the breakdown is a diagnostic, never required
        return {}


def phase_deltas(before: dict[str, float], after: dict[str, float], top: int = 8) -> dict[str, float]:
    """The ``top`` phases that grew most between two :func:`compile_phases` snapshots (at least 0.05 s)."""
    grew = {n: round(v - before.get(n, 0.0), 2) for n, v in after.items()
            if v - before.get(n, 0.0) >= 0.05}
    return dict(sorted(grew.items(), key=lambda kv: -kv[1])[:top])


def _policy(name: str, budget: float):
    """``name`` composed at ``budget``, or without one where it keeps every token (``full``, or a precision
    policy alone such as ``kivi(residual=0)``: the full cache in 4 bits)."""
    from kvpolicies import compose

    policy = compose(name)
    return policy if policy.eviction.name == "full" else compose(name, budget=budget)


def parse_runs(text: str, sh: Shapes) -> list[tuple[int, str]]:
    """``--runs "16:full,16:streaming"`` as (batch, policy) pairs; each batch must be one of ``sh.runs``
    (``"64:kivi(bits=4, residual=0)"``: the comma inside parentheses belongs to the policy)."""
    from kvpolicies import compose

    pairs = []
    items = re.split(r",(?![^()]*\))", text)  # commas inside a policy's parentheses stay in its spec
    for item in filter(None, (x.strip() for x in items)):
        batch, _, policy = item.partition(":")
        if not batch.isdigit() or int(batch) not in dict(sh.runs) or not policy:
            raise ValueError(f"--runs: {item!r} must be BATCH:POLICY with BATCH one of "
                             f"{sorted(dict(sh.runs))}, e.g. 16:streaming")
        compose(policy)  # a bad spec fails here, not in the stage
        pairs.append((int(batch), policy))
    return pairs


def generation_order(sh: Shapes, runs: list[tuple[int, str]] | None = None) -> list[tuple[int, int, str]]:
    """(batch, new tokens, policy) in the order the generation stage runs them: ``runs`` (``--runs``) when
    given, else ``sh.gen_lead`` first, then the other (batch, policy) pairs of ``sh.runs`` x ``sh.policies``,
    batch by batch."""
    new = dict(sh.runs)
    if runs:
        return [(b, new[b], p) for b, p in runs]
    every = [(b, p) for b, _ in sh.runs for p in sh.policies]
    unknown = [x for x in sh.gen_lead if x not in every]
    if unknown or len(set(sh.gen_lead)) != len(sh.gen_lead):
        raise ValueError(f"gen_lead {sh.gen_lead} must name distinct (batch, policy) pairs of runs x "
                         f"policies; unknown: {unknown}")
    order = list(sh.gen_lead) + [x for x in every if x not in sh.gen_lead]
    return [(b, new[b], p) for b, p in order]


def _prefill_costs(st: Stage, model: Any, cfg: Any) -> None:
    """Prefill cost of the scoring policies (batch 1, eager, one new token): best of two."""
    from kvmodels.generate import generate

    sh = st.shapes
    prompt = _prompts(1, sh.prompt_len, cfg.vocab_size, seed=7)
    for name in sh.prefill_policies:
        try:
            times = [generate(model, prompt, 1, _policy(name, sh.budget)).prefill_s for _ in range(2)]
            st.emit("prefill_policy", policy=name, budget=_policy(name, sh.budget).budget,
                    prompt_len=sh.prompt_len, prefill_s=min(times))
        except Exception:  # noqa: BLE001
            st.error(f"prefill {name}")
            continue
        try:  # where a prefill's time goes: the device's kernels, or the host between them
            _prefill_profile(st, lambda name=name: generate(model, prompt, 1, _policy(name, sh.budget)), name)
        except Exception:  # noqa: BLE001 -- the profiler: recorded, the timing above stands
            st.error(f"prefill profile {name}")


def _prefill_profile(st: Stage, fn: Callable[[], Any], name: str) -> None:
    """One more prefill under ``torch.profiler``: its wall seconds, the device's busy time (every kernel's
    device time, summed), the largest kernels, and the host operators that took the most CPU time. A
    wall time far above the busy time is a prefill waiting on its host (Python, launches, uploads that
    wait for the device), not on its kernels: what the H200 runs of 2026-11-28 left open (snapkv's prefill
    1.56x the full cache's, where its scorer reads only a 32-row window)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if st.cuda else [])
    st.sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        res = fn()
        st.sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    dev = {e.key: e.device_time_total for e in events if st.cuda and e.device_time_total > 0
           and e.device_type.name == "CUDA"}
    host = {e.key: e.self_cpu_time_total for e in events if e.self_cpu_time_total > 0}
    top = lambda d, n: {k: round(v / 1e3, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]}  # noqa: E731
    st.emit("prefill_profile", policy=name, prefill_s=res.prefill_s, wall_s=wall,
            device_busy_s=sum(dev.values()) / 1e6 if st.cuda else None, kernels_ms=top(dev, 8),
            host_ops_ms=top(host, 8), n_kernels=sum(e.count for e in events if e.key in dev),
            timed_by="torch.profiler (one run, its own overhead included)")


def _generation_run(st: Stage, model: Any, cfg: Any, batch: int, new: int, name: str,
                    weight_bytes: int, copy_gb_s: float) -> None:
    """One compiled ``generate`` of ``batch`` prompts under policy ``name``: one ``gen`` record."""
    import torch
    from torch._dynamo.utils import counters

    from kvmodels.generate import generate

    sh = st.shapes
    counters.clear()
    if st.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    stamps: list[float] = []  # when row 0 gets each token
    clock = lambda b, tok: b == 0 and stamps.append(time.perf_counter())  # noqa: E731
    policy = _policy(name, sh.budget)
    phases = compile_phases()
    res = generate(model, _prompts(batch, sh.prompt_len, cfg.vocab_size), new, policy, compile=True,
                   stream=clock)
    grew = phase_deltas(phases, compile_phases())
    r = res.report
    skips = counters["inductor"].get("cudagraph_skips", 0)
    st.emit("gen", batch=batch, policy=name, budget=policy.budget, new_tokens=new, prompt_len=sh.prompt_len,
            compiled=True, prefill_s=res.prefill_s, **decode_rates(stamps, batch),
            peak_gib=torch.cuda.max_memory_allocated() / 2**30 if st.cuda else None,
            kv_bytes=r.total_bytes, kv_full_bytes=r.full_cache_bytes,
            kv_kept=r.total_bytes / r.full_cache_bytes, weight_bytes=weight_bytes,
            floor_step_s=(weight_bytes + r.total_bytes) / (copy_gb_s * 1e9), cudagraph_skips=skips,
            cuda_graph=bool(st.cuda and skips == 0),
            graphs_compiled=counters["stats"].get("unique_graphs", 0),
            # Where the first step's seconds go: batch 64's compile took 96 s against 39 s at batch 16 in
            # every H200 run (the FX graph does not grow with the batch), which keeps h2o at batch 64 out of
            # the box; torch.compile's own phases (the rest of first_step_s: CUDA graph recording, the
            # library's Triton kernels compiled at their first launch).
            compile_s=grew.get("_compile.compile_inner"), compile_phases=grew)


def stage_generation(st: Stage) -> None:
    """The prefill cost of the scoring policies, then each (batch, policy) of :func:`generation_order`,
    compiled. A run starts only if the time left covers its policy's slowest run so far (the first run of a
    policy at a new batch pays its compile), so a run that cannot finish is skipped and cheaper ones after it
    still run."""
    import torch

    sh = st.shapes
    for name in ("cache_size_limit", "recompile_limit"):  # a recompile per policy must not fall back to eager
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    runs = parse_runs(os.environ.get(RUNS_ENV, ""), sh)
    order = generation_order(sh, runs)
    model, cfg = _model(st, sh.prompt_len + max(n for _, n in sh.runs) + 8)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    copy = st.copy_bandwidth()
    st.emit("model", config=cfg.__dict__, weight_bytes=weight_bytes, copy_gb_s=copy["gb_s"])
    st.emit("gen_plan", order=order)
    if not runs:  # a targeted rerun (--runs) measures only its decode runs
        _prefill_costs(st, model, cfg)

    slowest: dict[str, float] = {}  # policy -> its slowest run so far, seconds
    for batch, new, name in order:
        need = max(10.0, slowest.get(name, 0.0))
        if st.left() < need:
            st.skipped(f"generation B{batch} {name}",
                       f"time box: {st.left():.0f} s left, {name}'s slowest run so far took {need:.0f} s")
            continue
        t0 = time.time()
        try:
            _generation_run(st, model, cfg, batch, new, name, weight_bytes, copy["gb_s"])
        except Exception:  # noqa: BLE001
            st.error(f"generation B{batch} {name}")
            if st.cuda and "out of memory" in traceback.format_exc():
                torch.cuda.empty_cache()
        slowest[name] = max(slowest.get(name, 0.0), time.time() - t0)


class StepClock:
    """A transformers logits processor that stamps each step (the first call ends the prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def stage_hf_static(st: Stage) -> None:
    import torch
    import transformers

    from kvmodels.loading import llama_config_to_hf

    sh = st.shapes
    batch, new = sh.hf_run
    cfg = _config(st, sh.prompt_len + new + 8)
    torch.manual_seed(0)
    with torch.device(st.device):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_to_hf(cfg)))
    hf = hf.to(st.dtype).eval()
    ids = torch.tensor(_prompts(batch, sh.prompt_len, cfg.vocab_size), device=st.device)
    clock = StepClock()
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, cache_implementation="static",
                    logits_processor=transformers.LogitsProcessorList([clock]))
    st.emit("hf_static", batch=batch, new_tokens=new, prompt_len=sh.prompt_len, prefill_s=clock.times[0] - t0,
            **decode_rates(clock.times, batch), transformers=transformers.__version__)
    prompts, wrap_new = ids.tolist(), min(new, WRAP_NEW)
    _hf_wrap_run(st, hf, prompts, wrap_new)
    _hf_paged_cache_run(st, hf, prompts, wrap_new)


def _hf_wrap_run(st: Stage, hf: Any, prompts: list[list[int]], new: int) -> None:
    """The same transformers model on the paged cache (``kvmodels.hf.wrap_transformers``), eager, under
    ``snapkv`` at the shapes' budget: one ``hf_wrap`` record (its decode against ``hf_static``'s)."""
    from kvmodels.generate import generate
    from kvmodels.hf import wrap_transformers

    stamps: list[float] = []
    clock = lambda b, tok: b == 0 and stamps.append(time.perf_counter())  # noqa: E731
    policy = _policy("snapkv", st.shapes.budget)
    res = generate(wrap_transformers(hf), prompts, new, policy, stream=clock)
    st.emit("hf_wrap", batch=len(prompts), policy="snapkv", budget=policy.budget, new_tokens=new,
            prompt_len=len(prompts[0]), compiled=False, prefill_s=res.prefill_s,
            **decode_rates(stamps, len(prompts)),
            kv_kept=res.report.total_bytes / res.report.full_cache_bytes)


def _hf_paged_cache_run(st: Stage, hf: Any, prompts: list[list[int]], new: int) -> None:
    """The same model's own ``generate`` with the paged cache under it (``kvmodels.hf.paged_cache``, snapkv):
    one ``hf_paged_cache`` record, timed as ``hf_static``."""
    import torch
    import transformers

    from kvmodels.hf import paged_cache

    policy = _policy("snapkv", st.shapes.budget)
    cache = paged_cache(hf, policy, max_new_tokens=new)
    ids = torch.tensor(prompts, device=st.device)
    clock = StepClock()
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, past_key_values=cache,
                    logits_processor=transformers.LogitsProcessorList([clock]))
    rep = cache.report()
    st.emit("hf_paged_cache", batch=len(prompts), policy="snapkv", budget=policy.budget, new_tokens=new,
            prompt_len=len(prompts[0]), prefill_s=clock.times[0] - t0,
            **decode_rates(clock.times, len(prompts)), kv_kept=rep.total_bytes / rep.full_cache_bytes)


CAPACITY_POLICIES = ("full", "h2o", "streaming", "snapkv")  # searched in this order; full first
CAPACITY_TARGET = 4  # issue 33: the largest batch at 0.2 is at least 4x the full cache's


def largest_batch(fits: Callable[[int], bool], start: int, cap: int,
                  go_on: Callable[[], bool] = lambda: True) -> tuple[int, bool, list[tuple[int, bool]]]:
    """The largest batch in ``[1, cap]`` for which ``fits`` holds (fitting is monotone in the batch):
    doubling from ``start``, then bisection, asking ``go_on()`` before each try. Returns the batch (0 if
    none fits), whether the search finished (False: cut by ``go_on``, the batch is then a lower bound) and
    every ``(batch, fits)`` tried."""
    if not 1 <= start <= cap:
        raise ValueError(f"start={start} must be in [1, cap={cap}]")
    lo, hi, tried = 0, start, []  # lo fits (or is 0); hi does not fit, or is untried
    while hi <= cap:
        if not go_on():
            return lo, False, tried
        ok = fits(hi)
        tried.append((hi, ok))
        if not ok:
            break
        lo, hi = hi, min(hi * 2, cap + 1)
    while hi - lo > 1:  # hi <= cap + 1, so every mid is <= cap
        if not go_on():
            return lo, False, tried
        mid = (lo + hi) // 2
        ok = fits(mid)
        tried.append((mid, ok))
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo, True, tried


def stage_capacity(st: Stage) -> None:
    """The largest batch one fixed page pool holds: the pool fits ``capacity_full_batch`` uncompressed
    sequences of prompt + new tokens; each policy of :data:`CAPACITY_POLICIES` (full first, then h2o) is
    searched by running ``generate`` for real (eager): doubling, then bisection up to ``capacity_max_ratio``
    times the full cache's batch. The compressed policies start at the target (:data:`CAPACITY_TARGET` times
    the full cache's batch), so their first try answers it."""
    from kvmodels.generate import generate

    sh = st.shapes
    new, full_b, cap = sh.capacity_new, sh.capacity_full_batch, sh.capacity_full_batch * sh.capacity_max_ratio
    model, cfg = _model(st, sh.prompt_len + new + 8)
    page = sh.page
    num_pages = full_b * model.cache_layout().n_layers * math.ceil((sh.prompt_len + new) / page)
    results: dict[str, int] = {}

    def fits(policy: Any, batch: int) -> bool:
        try:
            generate(model, _prompts(batch, sh.prompt_len, cfg.vocab_size, seed=batch), new, policy,
                     num_pages=num_pages, page_size=page)
        except RuntimeError as e:
            if "out of pages" not in str(e):
                raise
            return False
        return True

    for name in CAPACITY_POLICIES:
        policy = _policy(name, sh.budget)
        start = full_b if name == "full" else min(cap, CAPACITY_TARGET * (results.get("full") or full_b))
        try:
            lo, exact, tried = largest_batch(lambda b, policy=policy: fits(policy, b), start, cap,
                                             lambda: st.left() > 15)
            results[name] = lo
            st.emit("capacity", policy=name, budget=policy.budget, max_batch=lo,
                    search_cap=cap, exact=exact, tried=tried, num_pages=num_pages, page_size=page,
                    prompt_len=sh.prompt_len, new_tokens=new,
                    vs_full=lo / results["full"] if results.get("full") else None)
        except Exception:  # noqa: BLE001
            st.error(f"capacity {name}")
        if st.left() < 15:
            st.skipped("capacity", f"time box after {name}")
            return


STAGE_FNS: dict[str, Callable[[Stage], None]] = {
    "env": stage_env, "quant_probe": stage_quant_probe, "correctness": stage_correctness,
    "kernels": stage_kernels, "quant": stage_quant,
    "generation": stage_generation, "hf_static": stage_hf_static, "capacity": stage_capacity,
}


# ----------------------------------------------------------------------------------------------------
# Results: results.json and summary.md (targets of issues 33 and 36)
# ----------------------------------------------------------------------------------------------------

def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of one JSON-lines file; a last line still being written (results are rewritten while a
    stage runs) is left out."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise
    return records


def load(out: Path, stages: tuple[str, ...] = STAGES) -> list[dict[str, Any]]:
    """Every record the stages wrote, stage by stage."""
    return [r for name in stages for r in _read_jsonl(out / f"{name}.jsonl")]


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _short_kernels(rows: list[dict[str, Any]], top: int = 6, width: int = 40) -> list[dict[str, Any]]:
    """Profiler records with ``kernels_us`` cut for the summary: the ``top`` largest kernels, each name to
    ``width`` characters after its template arguments and namespaces (``results.json`` keeps every one)."""
    def short(name: str) -> str:
        name = name.split("(")[0].split("<")[0].removeprefix("void ").split("::")[-1] or name
        return name[:width]

    out = []
    for r in rows:
        shown: dict[str, float] = {}
        for k, v in list((r.get("kernels_us") or {}).items())[:top]:
            shown[short(k)] = round(shown.get(short(k), 0.0) + v, 2)
        rest = len(r.get("kernels_us") or {}) - top
        out.append({**r, "kernels_us": ", ".join(f"{k} {v}" for k, v in shown.items())
                    + (f", {rest} more" if rest > 0 else "")})
    return out


def _table(rows: list[dict[str, Any]], cols: list[str]) -> list[str]:
    if not rows:
        return ["(none)"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def best_decode(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Fastest sweep entry per decode shape."""
    best: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["kind"] == "decode_sweep" and "us" in r:
            if r["shape"] not in best or r["us"] < best[r["shape"]]["us"]:
                best[r["shape"]] = r
    return best


Row = tuple[str, str, str]  # (target, measured, verdict)


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "NOT met")


def _by_kind(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        kinds.setdefault(r["kind"], []).append(r)
    return kinds


def _decode_rows(kinds: dict[str, list[dict[str, Any]]], best: dict[str, dict[str, Any]]) -> list[Row]:
    rows: list[Row] = []
    decode = {(r["shape"], r["impl"]): r for r in kinds.get("decode", [])}
    for shape in ("B8-L4096", "B64-L4096", "B1-L32768"):
        target = f"decode {shape}: >= 80% of copy bandwidth, <= SDPA dense"
        b, sdpa = best.get(shape) or decode.get((shape, "paged")), decode.get((shape, "sdpa-dense"))
        if b is None:
            rows.append((target, "—", _verdict(None)))
            continue
        ok = b["pct_of_copy"] >= 80 and (sdpa is None or b["us"] <= sdpa["us"])
        measured = f"{b['pct_of_copy']:.0f}% ({b['us']:.0f} us); SDPA {_fmt(sdpa and sdpa['us'])} us"
        rows.append((target, measured, _verdict(ok if sdpa else None)))
    for shape in ("B8-L4096", "B64-L4096"):
        a, s = decode.get((shape, "paged")), decode.get((shape, "paged+h2o-score"))
        ok = None if not (a and s) else s["us"] <= 1.05 * a["us"]
        rows.append((f"fused score update at {shape} costs <= 5%",
                     "—" if ok is None else f"{100 * (s['us'] / a['us'] - 1):+.1f}%", _verdict(ok)))
        g = decode.get((shape, "paged+keyformer-score"))
        if a and g:  # Keyformer's update: the Gumbel noise hashed in the kernel (no buffer read)
            rows.append((f"fused Keyformer score update at {shape}", f"{100 * (g['us'] / a['us'] - 1):+.1f}%",
                         "(reference)"))
    return rows


def _generation_rows(kinds: dict[str, list[dict[str, Any]]], gen: dict[tuple[int, str], dict[str, Any]]
                     ) -> list[Row]:
    """Each compressed policy against the full cache at each batch planned or measured (a run the time box
    skipped is 'not measured'), and batch 1 against the bandwidth floor."""
    rows: list[Row] = []
    planned = {(b, p) for r in kinds.get("gen_plan", []) for b, _, p in r["order"]} | set(gen)
    for b, p in sorted(planned):
        if p == "full":
            continue
        if _keeps_every_token(p):  # e.g. kivi(residual=0): every token, quantized (issue 36)
            need, target = 1.0, f"{p} (every token kept) >= 1x full decode, batch {b}"
        else:
            need = 2.0 if b >= 64 else 1.0
            target = f"{p} at 0.2 >= {need:g}x full decode, batch {b}"
        full, r = gen.get((b, "full")), gen.get((b, p))
        if full is None or r is None:
            rows.append((target, "—", _verdict(None)))
            continue
        x = r["decode_tok_s"] / full["decode_tok_s"]
        rows.append((target, f"{x:.2f}x", _verdict(x >= need)))
    one = gen.get((1, "full"))
    if one:
        pct = 100 * one["floor_step_s"] * one["decode_tok_s"]
        rows.append(("batch 1 (full) >= 50% of the (weights + KV) / copy-bandwidth floor", f"{pct:.0f}%",
                     _verdict(pct >= 50)))
    else:
        rows.append(("batch 1 >= 50% of the bandwidth floor", "—", _verdict(None)))
    return rows


def _keeps_every_token(name: str) -> bool:
    try:
        from kvpolicies import compose

        return compose(name).eviction.name == "full"
    except Exception:  # noqa: BLE001 -- a name this tree does not know: judged as an eviction policy
        return False


def _quant_rows(kinds: dict[str, list[dict[str, Any]]]) -> list[Row]:
    """Each bit width's packed pages against the native (bf16) pages at each shape measured: time <= the
    native pages' (issue 36's target at B64-L4096 in 4 bits, always listed)."""
    recs = {(r["shape"], r["impl"]): r for r in kinds.get("quant_decode", []) if "us" in r}
    shapes = list(dict.fromkeys([QUANT_TARGET_SHAPE, *(s for s, _ in recs)]))
    bits_seen = sorted({r["bits"] for r in recs.values() if r.get("bits")}) or [4]
    rows: list[Row] = []
    for shape in shapes:
        native = recs.get((shape, "native"))
        for bits in bits_seen:
            r = recs.get((shape, f"int{bits}"))
            if r is None and not (shape == QUANT_TARGET_SHAPE and bits == 4):
                continue
            dtype = (native or r or {}).get("dtype", "bf16").replace("bfloat16", "bf16")
            target = f"{bits}-bit pages decode <= {dtype} pages, {shape}" + (
                " (issue 36)" if (shape, bits) == (QUANT_TARGET_SHAPE, 4) else "")
            if r is None or native is None:
                rows.append((target, "—", _verdict(None)))
                continue
            x = r["us"] / native["us"]
            rows.append((target, f"{x:.2f}x ({r['us']:.0f} vs {native['us']:.0f} us; "
                         f"{r['pct_of_copy']:.0f}% of copy over the packed bytes)", _verdict(x <= 1.0)))
    return rows


def _hf_rows(kinds: dict[str, list[dict[str, Any]]], gen: dict[tuple[int, str], dict[str, Any]]) -> list[Row]:
    hf = kinds.get("hf_static", [])
    if not (hf and hf[0].get("decode_tok_s")):
        return [("batch 16 >= 2x transformers static-cache generate", "—", _verdict(None))]
    rows: list[Row] = []
    b = hf[0]["batch"]
    ours = [r for (bb, p), r in gen.items() if bb == b]
    if ours:
        best_ours = max(ours, key=lambda r: r["decode_tok_s"])
        x = best_ours["decode_tok_s"] / hf[0]["decode_tok_s"]
        rows.append((f"batch {b} >= 2x transformers static-cache generate",
                     f"{x:.2f}x ({best_ours['policy']})", _verdict(x >= 2)))
    full_b = gen.get((b, "full"))
    if full_b:
        rows.append((f"batch {b}, full cache, vs transformers static-cache generate",
                     f"{full_b['decode_tok_s'] / hf[0]['decode_tok_s']:.2f}x", "(reference)"))
    for kind, what in (("hf_wrap", "the transformers model on the paged cache (wrap_transformers, eager, "
                                    "snapkv)"),
                       ("hf_paged_cache", "its own generate with the paged cache under it (paged_cache, "
                                          "snapkv)")):
        rec = kinds.get(kind, [])
        if rec and rec[0].get("decode_tok_s"):
            rows.append((f"batch {b}, {what}, vs transformers static-cache generate",
                         f"{rec[0]['decode_tok_s'] / hf[0]['decode_tok_s']:.2f}x", "(reference)"))
    return rows


def _capacity_gap(p: str, r: dict[str, Any] | None, full: dict[str, Any] | None, failed: set[str]) -> str:
    """Why policy ``p``'s capacity target was not measured (its record ``r``, the full cache's ``full``)."""
    if "full" in failed:
        return "the full cache's search failed"
    if p in failed:
        return f"{p}'s search failed"
    if full is None:
        return "the full cache's search was not reached"
    if r is None:
        return "not reached (time box)"
    return "nothing fit in the full cache's pool"


def _capacity_rows(kinds: dict[str, list[dict[str, Any]]]) -> list[Row]:
    """Each compressed policy's largest batch against the full cache's, once the capacity stage ran. 'not
    measured', with the reason, where either search failed or was not reached; a search cut by the time box
    gives a lower bound, which decides the target only one way."""
    cap = {r["policy"]: r for r in kinds.get("capacity", [])}
    errors = [e for e in kinds.get("error", []) if e["stage"] == "capacity"]
    failed = {e["where"].removeprefix("capacity ") for e in errors}
    if not cap and not failed:
        return [(f"largest batch at 0.2 (h2o) >= {CAPACITY_TARGET}x full cache's", "—", _verdict(None))]
    rows: list[Row] = []
    full = cap.get("full")
    for p in CAPACITY_POLICIES[1:]:
        target, r = f"largest batch at 0.2 ({p}) >= {CAPACITY_TARGET}x full cache's", cap.get(p)
        mine = "—" if r is None else f"{r['max_batch']}" + ("" if r.get("exact") else " (search cut)")
        if r is None or not full or not full["max_batch"]:
            rows.append((target, f"{mine}; {_capacity_gap(p, r, full, failed)}", _verdict(None)))
            continue
        x = r["max_batch"] / full["max_batch"]
        ok: bool | None = x >= CAPACITY_TARGET
        if (ok and not full.get("exact")) or (not ok and not r.get("exact")):
            ok = None  # a cut search's batch is a lower bound
        rows.append((target, f"{mine} vs {full['max_batch']} = {x:.1f}x", _verdict(ok)))
    return rows


def _prefill_rows(kinds: dict[str, list[dict[str, Any]]]) -> list[Row]:
    pre = {r["policy"]: r for r in kinds.get("prefill_policy", [])}
    rows: list[Row] = []
    for p, r in pre.items():
        if p != "full" and "full" in pre:
            x = r["prefill_s"] / pre["full"]["prefill_s"]
            rows.append((f"scoring prefill {p} <= 1.3x plain prefill", f"{x:.2f}x", _verdict(x <= 1.3)))
    return rows


def targets(records: list[dict[str, Any]]) -> list[Row]:
    """(target, measured, verdict) for each target of issues 33 and 36; 'not measured' where a run lacks
    it."""
    kinds = _by_kind(records)
    gen = {(r["batch"], r["policy"]): r for r in kinds.get("gen", []) if r.get("decode_tok_s")}
    return (_decode_rows(kinds, best_decode(records)) + _quant_rows(kinds) + _generation_rows(kinds, gen)
            + _hf_rows(kinds, gen) + _capacity_rows(kinds) + _prefill_rows(kinds))


def prefetch_tiles_line(best_quant: dict[str, Any], kinds: dict[str, list[dict[str, Any]]]) -> str:
    """The ``PREFETCH_TILES`` to commit: 0 where the 4-bit sweep's best ran without prefetching; else 4 where
    8-bit pages were slower prefetched than without at the sweep's shape, else 8 (every width)."""
    if not best_quant["prefetch"]:
        return "PREFETCH_TILES = 0  # the 4-bit sweep's best config ran without prefetching"
    shape = best_quant["shape"]
    int8 = {r["impl"]: r["us"] for r in kinds.get("quant_decode", [])
            if r.get("shape") == shape and r.get("bits") == 8 and "us" in r}
    on = int8.get("int8 prefetch=on", int8.get("int8") if "int8 prefetch=off" in int8 else None)
    off = int8.get("int8 prefetch=off", int8.get("int8") if "int8 prefetch=on" in int8 else None)
    if on is None or off is None:
        return "PREFETCH_TILES = 8  # 4-bit pages prefetched at the sweep's best; 8-bit not timed both ways"
    if on > off:
        return f"PREFETCH_TILES = 4  # 8-bit pages slower prefetched at {shape}: {on:.0f} vs {off:.0f} us"
    return f"PREFETCH_TILES = 8  # every width prefetched; 8-bit at {shape}: {on:.0f} vs {off:.0f} us without"


def half_rows_lines(kinds: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each width's packed pages with float16 rows (``quant_attention.HALF_ROWS``) against float32 rows, the
    same run and shape, and the ``HALF_ROWS`` to commit: on where it is faster for 4-bit pages at the
    target's shape (the first timed)."""
    us = {(r["shape"], r["impl"]): r["us"] for r in kinds.get("quant_decode", []) if "us" in r}
    pairs = []
    for (shape, impl), t in us.items():
        flipped = [(i.split(" half=")[1] == "on", v) for (sh, i), v in us.items()
                   if sh == shape and i.startswith(impl + " half=")]
        if flipped and " " not in impl:
            on, other = flipped[0]
            pairs.append((shape, impl, other if on else t, t if on else other))
    if not pairs:
        return []
    lines = ["", "Float16 rows (`HALF_ROWS`) against float32 rows, same shape and config:", "",
             "| shape | impl | half_on_us | half_off_us | on_over_off |", "|---|---|---|---|---|"]
    lines += [f"| {sh} | {impl} | {on:.3g} | {off:.3g} | {on / off:.3g} |" for sh, impl, on, off in pairs]
    first = next(((sh, on, off) for sh, impl, on, off in pairs if impl == "int4"), None)
    if first:
        sh, on, off = first
        lines += ["", f"To commit in `kvkernels/quant_attention.py`: `HALF_ROWS = {on <= off}`  # 4-bit at "
                  f"{sh}: {on:.0f} us with float16 rows, {off:.0f} us without"]
    return lines


def summarize(out: Path, status: dict[str, dict[str, Any]], commit: str | None) -> str:
    records = load(out)
    kinds = _by_kind(records)
    env = (kinds.get("env") or [{}])[0]
    copy = (kinds.get("copy") or [{}])[0]
    lines = [f"# GPU run: {env.get('device', '?')}", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}, "
             f"CUDA {env.get('cuda')}, Python {env.get('python')}; capability {env.get('capability')}; "
             f"commit {commit or 'unknown'}; copy bandwidth {_fmt(copy.get('gb_s'))} GB/s.", "",
             "## Stages", ""]
    ordered = sorted(status.items(), key=lambda kv: STAGES.index(kv[0]))
    lines += _table([{"stage": k, **v} for k, v in ordered],
                    ["stage", "status", "seconds", "box_s", "commit"])
    lines += ["", "## Targets (issues 33 and 36)", "", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in targets(records)]
    tests = kinds.get("test", [])
    done = (kinds.get("tests_done") or [{}])[0]
    lines += ["", "## Correctness", "",
              f"{done.get('passed', 0)} passed, {done.get('failed', 0)} failed, "
              f"{done.get('skipped', 0)} skipped"
              + (" (cut at the time box)" if done.get("cut_at_time_box") else "") + "."]
    for t in tests:
        if t["outcome"] == "failed":
            first = (t.get("traceback") or "").strip().splitlines()
            lines.append(f"- FAILED `{t['test']}` ({t['when']}): {first[-1][:200] if first else ''}")
    lines += ["", "## Decode attention", ""]
    lines += _table(kinds.get("decode", []), ["shape", "impl", "us", "gb_s", "pct_of_copy", "timed_by"])
    lines += ["", "Each kernel's share of a decode call (torch.profiler, 20 calls):", ""]
    lines += _table(_short_kernels(kinds.get("decode_kernels", [])),
                    ["shape", "impl", "total_us", "kernels_us"])
    best = best_decode(records)
    if best:
        lines += ["", "Best of the sweep per shape:", ""]
        lines += _table([{**r, **{f"cfg.{k}": v for k, v in r["config"].items()}} for r in best.values()],
                        ["shape", "cfg.block", "cfg.num_warps", "cfg.num_stages", "num_splits", "us",
                         "pct_of_copy"])
    probe = kinds.get("quant_probe", [])
    if probe:
        lines += ["", "## Quantized kernel's GPU-only failure, one change at a time (quant_probe)", ""]
        lines += _table(probe, ["variant", "loop", "ok", "max_abs_err", "tol", "bad_elements", "elements",
                                "config", "error_line"])
    lines += ["", "## Quantized pages (issue 36)", ""]
    lines += _table(kinds.get("quant_decode", []), ["shape", "impl", "us", "over_native", "gb_s",
                                                    "pct_of_copy", "row_bytes", "max_abs_diff_vs_native",
                                                    "bit_equal_to_default", "max_abs_diff_vs_default",
                                                    "timed_by"])
    lines += half_rows_lines(kinds)
    lines += ["", "4-bit pages at the default config, registers per thread x split count (the occupancy "
              "probe: `OCCUPANCY`; `over_first`, the time over the launcher's own point, the first row):", ""]
    lines += _table(kinds.get("quant_occupancy", []), ["shape", "max_registers", "num_splits", "programs",
                                                       "us", "over_first", "error"])
    lines += ["", "One decode step's 4-bit K write (one layer):", ""]
    lines += _table(kinds.get("quant_write", []), ["rows", "head_dim", "us", "torch_path_us", "speedup",
                                                   "bit_equal", "timed_by"])
    lines += ["", "## Prefill scorer (one layer)", ""]
    lines += _table(kinds.get("prefill", []), ["impl", "mode", "L", "ms", "over_attention", "lse",
                                               "lse_kernel", "kernels"])
    sweep = [r for r in kinds.get("prefill_sweep", []) if "ms" in r]
    best_prefill = min(sweep, key=lambda r: r["ms"]) if sweep else None
    if best_prefill:
        lines += ["", f"Sweep of the scorer alone (accumulate, no lse): {len(sweep)} configs, best "
                  f"{best_prefill['config']} at {best_prefill['ms']:.3g} ms; default "
                  f"{_fmt(next((r['ms'] for r in sweep if r['config'] == sweep[0]['config']), None))} ms."]
    qsweep = [r for r in kinds.get("quant_sweep", []) if "us" in r]
    best_quant = min(qsweep, key=lambda r: r["us"]) if qsweep else None
    if best_quant:
        lines += ["", f"Sweep of the 4-bit decode at {best_quant['shape']}: {len(qsweep)} configs, best "
                  f"{best_quant['config']} (prefetch={best_quant.get('prefetch')}) at "
                  f"{best_quant['us']:.3g} us; default {_fmt(qsweep[0]['us'])} us."]
    cc = env.get("capability")
    if cc and (best or best_prefill or best_quant):
        cc_int = int(cc.replace(".", ""))
        lines += ["", "To commit in `kvkernels/tuning.py`:", "", "```python"]
        if best:
            b = best.get("B8-L4096") or next(iter(best.values()))
            c = b["config"]
            lines.append(f'TUNED[("decode", {cc_int})] = LaunchConfig(block={c["block"]}, '
                         f'num_warps={c["num_warps"]}, num_stages={c["num_stages"]})  # best at {b["shape"]}')
        if best_prefill:
            c = best_prefill["config"]
            lines.append(f'TUNED[("prefill_scores", {cc_int})] = LaunchConfig(block={c["block"]}, '
                         f'num_warps={c["num_warps"]}, num_stages={c["num_stages"]})')
        if best_quant:
            c = best_quant["config"]
            lines.append(f'TUNED[("quant_decode", {cc_int})] = LaunchConfig(block={c["block"]}, '
                         f'num_warps={c["num_warps"]}, num_stages={c["num_stages"]})  # 4-bit, '
                         f'{best_quant["shape"]}')
            if best_quant.get("prefetch") is not None:
                lines.append(f"# kvkernels/quant_attention.py: {prefetch_tiles_line(best_quant, kinds)}")
        lines.append("```")
    lines += ["", "## Compaction and eviction", ""]
    lines += _table(kinds.get("compaction", []), ["op", "batch", "tokens", "keep", "op_device_us",
                                                  "topk_gather_us", "device_over_topk_gather", "op_eager_us"])
    lines += ["", "(`op_device_us`: its kernels' device time, torch.profiler, as a CUDA graph runs them; "
              "`op_eager_us`: events around one eager call, the host's launches included.) Device time by "
              "kernel (5 calls), the largest:", ""]
    lines += _table(_short_kernels(kinds.get("compaction_kernels", [])),
                    ["op", "batch", "tokens", "keep", "total_us", "kernels_us"])
    lines += ["", "## Generation", ""]
    lines += _table(kinds.get("prefill_policy", []), ["policy", "budget", "prompt_len", "prefill_s"])
    lines += ["", "Each prefill once under the profiler (device busy: its kernels' time summed; the rest of "
              "the wall time the device waited on the host):", ""]
    lines += _table(_short_kernels([{**r, "kernels_us": r.get("kernels_ms")} for r in
                                    kinds.get("prefill_profile", [])], top=5),
                    ["policy", "prefill_s", "wall_s", "device_busy_s", "n_kernels", "kernels_us"])
    host = [{"policy": r["policy"],
             "host_ops_ms": ", ".join(f"{k} {v}" for k, v in list(r.get("host_ops_ms", {}).items())[:5])}
            for r in kinds.get("prefill_profile", [])]
    lines += [""] + _table(host, ["policy", "host_ops_ms"])
    lines += [""]
    lines += _table(kinds.get("gen", []), ["batch", "policy", "new_tokens", "prefill_s", "first_step_s",
                                           "compile_s", "decode_tok_s", "decode_tok_s_skip_first", "kv_kept",
                                           "peak_gib", "cuda_graph", "graphs_compiled"])
    phased = [r for r in kinds.get("gen", []) if r.get("compile_phases")]
    if phased:
        lines += ["", "torch.compile's phases in each run's first step (seconds; the largest):", ""]
        lines += [f"- B{r['batch']} {r['policy']}: "
                  + ", ".join(f"{k} {v}" for k, v in r["compile_phases"].items()) for r in phased]
    lines += ["", "transformers static cache:", ""]
    lines += _table(kinds.get("hf_static", []), ["batch", "new_tokens", "prefill_s", "first_step_s",
                                                 "decode_tok_s"])
    lines += ["", "## Capacity", ""]
    lines += _table(kinds.get("capacity", []), ["policy", "budget", "max_batch", "search_cap", "exact",
                                                "vs_full", "num_pages"])
    errors = kinds.get("error", []) + kinds.get("skipped", [])
    if errors:
        lines += ["", "## Errors and cuts", ""]
        for e in errors:
            text = e.get("traceback") or e.get("why") or ""
            last = text.strip().splitlines()[-1] if text.strip() else ""
            lines.append(f"- {e['stage']}: {e.get('where') or e.get('what')}: {last[:300]}")
    return "\n".join(lines) + "\n"


def write_results(out: Path, status: dict[str, dict[str, Any]], commit: str | None) -> None:
    (out / "results.json").write_text(json.dumps({"commit": commit, "status": status, "records": load(out)},
                                                 indent=1, default=str))
    (out / "summary.md").write_text(summarize(out, status, commit))


def pack(out: Path, dest: Path) -> None:
    """Rewrite ``dest``, a tar.gz of every file under ``out`` (in a folder named like ``out``). It is written
    beside ``dest`` and renamed, so a run killed while packing leaves the previous pack whole; a file that
    changes while it is read keeps the previous pack too (the next one catches up)."""
    tmp = dest.with_name(dest.name + ".tmp")
    skip = {dest.resolve(), tmp.resolve()}
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(out.rglob("*")):
                if path.is_file() and path.resolve() not in skip:
                    tar.add(path, arcname=str(Path(out.name) / path.relative_to(out)))
        tmp.replace(dest)
    except (OSError, tarfile.TarError) as e:
        print(f"[gpu] pack {dest}: {e!r}; the previous pack stays", flush=True)
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------

def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 -- the device's copy of the tree may have no .git
        return None


def parse_inductor(text: str) -> dict[str, Any]:
    """``--inductor``'s ``name=value`` pairs (comma-separated; Python literals): settings of
    ``torch._inductor.config`` for an experiment, e.g. ``triton.autotune_pointwise=False``."""
    import ast

    settings: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, value = item.partition("=")
        try:
            if not eq or not name.strip():
                raise ValueError
            settings[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"--inductor: {item!r} is not NAME=VALUE with a Python literal value (e.g. "
                             "triton.autotune_pointwise=False)") from None
    return settings


def apply_inductor(settings: dict[str, Any]) -> None:
    """Set each ``torch._inductor.config`` name (dotted: ``triton.cudagraphs``); an unknown name raises."""
    import torch._inductor.config as config

    for name, value in settings.items():
        *path, last = name.split(".")
        target = config
        for part in path:
            target = getattr(target, part)
        if not hasattr(target, last):
            raise ValueError(f"--inductor: torch._inductor.config has no {name!r}")
        setattr(target, last, value)


def run_stage(name: str, out: Path, deadline: float, smoke: bool) -> int:
    """Child process: run one stage; its own exceptions become an error record (exit 1)."""
    st = Stage(name, out, deadline, smoke)
    try:
        settings = parse_inductor(os.environ.get(INDUCTOR_ENV, ""))
        if settings:
            apply_inductor(settings)
            st.emit("inductor_config", settings=settings)
        STAGE_FNS[name](st)
    except Exception:  # noqa: BLE001
        st.error(name)
        return 1
    return 0


def stage_boxes(stages: tuple[str, ...], budget: float | None) -> dict[str, float]:
    """Seconds each stage may run: its default box (:data:`SHARES`), or ``budget`` split among ``stages`` in
    the same proportions."""
    total = sum(SHARES[s] for s in stages)
    scale = 1.0 if budget is None else budget / total
    return {s: SHARES[s] * scale for s in stages}


def wait(proc: subprocess.Popen, timeout: float, tick: Callable[[], None] | None = None,
         every: float = SAVE_EVERY_S) -> int | None:
    """``proc``'s exit code, or None once it ran ``timeout`` seconds (then it is killed); ``tick()`` every
    ``every`` seconds meanwhile."""
    end = time.time() + timeout
    while True:
        left = end - time.time()
        try:
            return proc.wait(timeout=max(0.0, min(every, left) if tick else left))
        except subprocess.TimeoutExpired:
            if time.time() >= end:
                proc.kill()
                proc.wait()
                return None
            if tick:
                tick()


def previous_status(out: Path) -> dict[str, dict[str, Any]]:
    """The stage status of an earlier run into ``out`` (its records stay beside this run's: --only reruns
    some stages and the results keep the others)."""
    try:
        return dict(json.loads((out / "results.json").read_text())["status"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def stages_to_run(only: str | None) -> tuple[str, ...]:
    """``--only``'s stages in the order of :data:`STAGES`, ``env`` first (its ~8 s name the device and the
    versions: run 5 of 2026-11-28, without it, left its summary's device and versions blank); every stage
    without it."""
    if not only:
        return STAGES
    named = {s.strip() for s in only.split(",")}
    unknown = sorted(named - set(STAGES))
    if unknown:
        raise ValueError(f"--only: unknown stages {unknown}; choose from {', '.join(STAGES)}")
    return tuple(s for s in STAGES if s in named or s == "env")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="directory for results.json, summary.md, logs")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton through its interpreter)")
    p.add_argument("--only", default=None, help=f"comma-separated stages of {','.join(STAGES)} (the other "
                   "stages' records already in --out stay in the results)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the stages run, split in the default boxes' proportions (default: each "
                   f"stage its own box, {DEFAULT_BUDGET} s for all; 600 s with --smoke)")
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    p.add_argument("--pack", default=None, type=Path,
                   help="a tar.gz of the whole --out directory, rewritten while each stage runs and after it")
    p.add_argument("--runs", default=None,
                   help="the generation stage runs only these BATCH:POLICY pairs, in this order (e.g. "
                   "16:full,16:streaming; no prefill costs): a targeted rerun after a fix")
    p.add_argument("--inductor", default=None,
                   help="torch._inductor.config settings for every stage, NAME=VALUE,... (Python "
                   "literals; e.g. triton.autotune_pointwise=False): an experiment on the compile's cost, "
                   "recorded per stage")
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # child process: one stage
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        return run_stage(args.stage, args.out, args.deadline, args.smoke)

    try:
        stages = stages_to_run(args.only)
    except ValueError as e:
        p.error(str(e))
    boxes = stage_boxes(stages, args.budget or (600.0 if args.smoke else None))
    commit = args.commit or _commit()
    env = dict(os.environ)
    env.pop(RUNS_ENV, None)
    env.pop(INDUCTOR_ENV, None)
    if args.inductor:
        try:
            parse_inductor(args.inductor)
        except ValueError as e:
            p.error(str(e))
        env[INDUCTOR_ENV] = args.inductor
    if args.runs:
        try:
            parse_runs(args.runs, SMOKE if args.smoke else REAL)
        except ValueError as e:
            p.error(str(e))
        env[RUNS_ENV] = args.runs
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"  # kernels on CPU tensors through the interpreter
        env["CUDA_VISIBLE_DEVICES"] = ""
    status = {k: v for k, v in previous_status(args.out).items() if k in STAGES and k not in stages}
    for name in stages:
        (args.out / f"{name}.jsonl").unlink(missing_ok=True)

    def save() -> None:
        write_results(args.out, status, commit)
        if args.pack:
            pack(args.out, args.pack)

    for name in stages:
        box, start = boxes[name], time.time()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--out", str(args.out),
               "--deadline", str(start + box - 3)] + (["--smoke"] if args.smoke else [])
        print(f"[gpu] {name}: up to {box:.0f} s", flush=True)

        def record(state: str, name: str = name, box: float = box, start: float = start) -> None:
            status[name] = {"status": state, "seconds": round(time.time() - start, 1), "box_s": round(box),
                            "commit": commit}
            save()

        with open(args.out / f"{name}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            rc = wait(proc, box + KILL_GRACE_S, functools.partial(record, "running"))
        record("timed out" if rc is None else "ok" if rc == 0 else f"failed (exit {rc})")
        print(f"[gpu] {name}: {status[name]['status']} in {status[name]['seconds']} s", flush=True)
    print((args.out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
