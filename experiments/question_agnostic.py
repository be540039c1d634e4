"""Passkey and story QA with the question asked after compression (question-agnostic), issue 37 item 4.

Each passkey prompt of the evaluation harness (``evals.tasks.passkey_samples``: SmolLM2's chat template,
instruction, prose with the needle, the question "What is the pass key?", the answer prefix "The pass key
is") is cut before the question. The context (everything before it) is prefilled into a
``kvmodels.Decoder`` and compressed to the budget knowing nothing of the question; then the question (and
the rest of the prompt) is fed and ``--new`` tokens are generated greedily. A key counts when the first
number of the answer is the key (``evals.tasks.exact_match``). ``--task story`` runs the story-QA prompts
instead (``evals.tasks.story_samples``: facts such as "The cook's dog was called Biscuit." in the prose, three
of them distractors; the question asks for one name; correct = the answer's first word is the name,
``evals.tasks.word_match``); they are cut before their question the same way.

How the question is fed (``protocol`` in each record):

* ``feed`` (every config): the question's tokens go through decode steps, teacher-forced, each attending to
  the compressed context and the question's tokens before it; nothing is evicted after the context's
  compression (``evict_every`` is set past the question and the answer). ``adakv``'s per-head cache cannot
  take an ``extend`` after the prompt (``HeadRows.check_extendable``), so this is the one protocol every
  config can run, and the table compares configs on it.
* ``extend`` (every config but ``adakv``'s; ``duo``'s per-head pages since 2026-11-27):
  ``Decoder.extend([question])`` then ``Decoder.generate``: the question is prefilled into the compressed
  cache and the sequence is compressed again to the budget of everything seen (the question's window votes
  re-rank the kept tokens), the Decoder's own path.

* ``stream``, ``stream-sized`` and ``stream-pool`` (every config ``extend`` runs): as ``extend``, but the
  context and then the question stream in ``--chunk`` tokens at a time (``extend(chunk=)``), compressed
  after each chunk, into a cache of the model's context (``stream``), of ``max_tokens`` = the budget plus one
  chunk plus the answer per layer (``stream-sized``: a layer-budget policy's or ``duo``'s largest layers
  capped at it, and the question makes room for itself, ``cache.make_room``), or of a page pool that holds
  as much over all layers (``stream-pool``: ``kvmodels.chunked_num_pages``, each layer's own cap left at
  the model's context). The last two bound the memory alike; they differ in how a layer may use it.

One JSON line per (config, budget, protocol), appended to ``--out``; a rerun skips the lines already there.
``--report`` prints the table (answers out of N per config and budget) and runs nothing.

Run: ``python -m experiments.question_agnostic --out experiments/results/question-agnostic.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

PROTOCOLS = ("feed", "extend", "stream", "stream-sized", "stream-pool")
# The eviction every scored config uses: SnapKV per head (the head-budget policies need per-head scores).
SNAPKV = "snapkv(window=16, chunk=5)"
# config name -> policy text ({snapkv} filled in); "profile" and "duo" get this model's measured weights.
CONFIGS: dict[str, str] = {
    "full": "full",
    "streaming": "streaming",
    "snapkv": "{snapkv}",
    "profile+snapkv": "profile+{snapkv}",
    "snapkv+duo": "{snapkv}+duo",
    "profile+snapkv+duo": "profile+{snapkv}+duo",
    # The other eviction policies (defaults; with the feed protocol the ones that evict while decoding
    # evict nothing after the context's compression either) and the other layer / head budget policies.
    "window": "window",
    "h2o": "h2o",
    "tova": "tova",
    "knorm": "knorm",
    "keyformer": "keyformer",
    "a2sf": "a2sf",
    "scissorhands": "scissorhands",
    "chunkkv": "chunkkv",
    "squeeze+snapkv": "squeeze+{snapkv}",
    "pyramid+snapkv": "pyramid+{snapkv}",
    "snapkv+adakv": "{snapkv}+adakv",
    "kvzip": "kvzip",  # ranks the context by a second pass over it (the reconstruction)
    "profile+kvzip": "profile+kvzip",
    "kvzip+adakv": "kvzip+adakv",      # the reconstruction's scores, a layer's budget split among its heads
    "kvzip+pooled": "kvzip+pooled",    # ... and among every layer's heads at once (KVzip's allocation)
    "kvzip+pooled+repeat": "kvzip+pooled",  # ... with KVzip's instruction before the copy (REPEAT_CONFIGS)
    "kvzip(recent=0)+pooled": "kvzip(recent=0)+pooled",  # sinks forced only, as kvpress's KVzip
    "kvzip(recent=32)+pooled": "kvzip(recent=32)+pooled",  # a longer window of the context's end forced
    "kvzip(span=256)+pooled": "kvzip(span=256)+pooled",  # the reconstruction in passes of 256 tokens
    "kvzip(skip=24)+pooled": "kvzip(skip=24)+pooled",  # the template's 24-token opening not context
    "kvzip(skip=24)+pooled+repeat": "kvzip(skip=24)+pooled",  # ... with KVzip's instruction
    "kvzip-as-kvpress": "kvzip(skip=24, recent=0)+pooled",  # kvpress's KVzip scores
    # Fewer bits per kept token (issue 36's precision role): every kept row at 4 bits (KIVI's asymmetric
    # format, no full-precision residual), so a budget 3x larger costs the bytes of an fp16 cache's.
    "kvzip(skip=24)+pooled+kivi4+repeat": "kvzip(skip=24)+pooled+kivi(bits=4, residual=0)",
    "full+kivi4": "full+kivi(bits=4, residual=0)",
    # ... over Hadamard-rotated rows (4 bits lose fewer answers there: docs/results.md)
    "kvzip(skip=24)+pooled+kivi4r+repeat": "kvzip(skip=24)+pooled+kivi(bits=4, residual=0, rotate=True)",
    "full+kivi4r": "full+kivi(bits=4, residual=0, rotate=True)",
}
# Configs whose reconstruction pass starts with KVzip's instruction and the assistant's turn (probe_prefix).
REPEAT_CONFIGS = ("kvzip+pooled+repeat", "kvzip(skip=24)+pooled+repeat", "kvzip-as-kvpress",
                  "kvzip(skip=24)+pooled+kivi4+repeat", "kvzip(skip=24)+pooled+kivi4r+repeat")
# What --configs runs by default: the configs of the first tables (the others: --configs all).
DEFAULT_CONFIGS = ("full", "streaming", "snapkv", "profile+snapkv", "snapkv+duo", "profile+snapkv+duo")
EVICT_EVERY = 64  # past the question and the answer: the feed protocol evicts nothing after the context


def split_question(tokenizer: Any, prompt: Sequence[int], question: str) -> tuple[list[int], list[int]]:
    """``prompt`` cut before the last occurrence of `` question``: ``(context, rest)`` token ids whose
    concatenation is ``prompt``. Found on token boundaries: the shortest suffix that decodes to text
    starting with the question."""
    prompt = [int(t) for t in prompt]
    for cut in range(len(prompt) - 1, 0, -1):
        if tokenizer.decode(prompt[cut:]).lstrip().startswith(question):
            return prompt[:cut], prompt[cut:]
    raise ValueError(f"the prompt does not hold the question {question!r}")


def repeat_prefix(tokenizer: Any) -> list[int]:
    """KVzip's instruction (``kvpolicies.eviction.kvzip.REPEAT``) then the chat template's generation prompt
    (what follows a user turn's text), as token ids: fed before the context's copy (``probe_prefix``)."""
    from kvpolicies.eviction.kvzip import REPEAT

    text = tokenizer.apply_chat_template([{"role": "user", "content": "KVZIPMARK"}])
    return tokenizer.encode(REPEAT + text.partition("KVZIPMARK")[2], add_special_tokens=False)


def answer_feed(model: Any, policy: Any, context: list[int], rest: list[int], new: int,
                probe_prefix: Sequence[int] = ()) -> list[int]:
    """Protocol ``feed``: ``context`` prefilled and compressed by a Decoder, then ``rest`` teacher-forced
    through decode steps, then ``new`` greedy tokens; the generated ids."""
    from kvmodels.decoder import Decoder

    steps = len(rest) + new - 1
    if policy.evict_every <= steps:
        raise ValueError(f"policy evicts every {policy.evict_every} decode steps; the question and the "
                         f"answer take {steps}: compose it with evict_every > {steps}")
    dec = Decoder(model, policy, probe_prefix=probe_prefix)
    dec.extend([context], max_new_tokens=steps + 1)
    cache, device = dec.cache, dec.device
    out: list[int] = []
    with torch.no_grad():
        cache.restart_decode(steps + 1)
        token, position = rest[0], dec.lengths[0]
        for step in range(steps):
            cache.prepare_decode(step)
            logits = model.decode_step(torch.tensor([token], device=device),
                                       torch.tensor([position], device=device), cache)
            cache.after_step(step)
            position += 1
            if step + 1 < len(rest):
                token = rest[step + 1]
            else:
                token = int(logits[0].argmax())
                out.append(token)
    return out  # the predictions of steps len(rest) - 1 onward: `new` tokens


def answer_extend(model: Any, policy: Any, context: list[int], rest: list[int], new: int,
                  probe_prefix: Sequence[int] = ()) -> list[int]:
    """Protocol ``extend``: ``Decoder.extend([context])``, ``extend([rest])``, ``generate(new)``."""
    from kvmodels.decoder import Decoder

    dec = Decoder(model, policy, probe_prefix=probe_prefix)
    dec.extend([context])
    dec.extend([rest], max_new_tokens=new)
    return dec.generate(new, final=True).tokens[0]


def answer_stream(model: Any, policy: Any, context: list[int], rest: list[int], new: int,
                  probe_prefix: Sequence[int] = (), *, chunk: int, bound: str | None) -> list[int]:
    """Protocols ``stream`` (``bound=None``), ``stream-sized`` (``"layer"``), ``stream-pool`` (``"pool"``):
    ``extend([context], chunk=)``, ``extend([rest], chunk=)``, ``generate(new)``."""
    from kvmodels.decoder import Decoder, chunked_num_pages

    tokens, kw = len(context) + len(rest), {}
    if bound == "layer":  # each layer's slots: the budget + one chunk + the answer
        budget = int(policy.budget_tokens(torch.tensor([tokens]))[0])
        kw["max_tokens"] = (min(tokens, budget + chunk) if policy.eviction.prefill_compress else tokens) + new
    elif bound == "pool":
        kw["num_pages"] = chunked_num_pages(model, policy, tokens, chunk, new)
    dec = Decoder(model, policy, probe_prefix=probe_prefix, **kw)
    dec.extend([context], chunk=chunk, max_new_tokens=new)
    dec.extend([rest], chunk=chunk, max_new_tokens=new)
    return dec.generate(new, final=True).tokens[0]


def after_context(model: Any, policy: Any, context: list[int], probe_prefix: Sequence[int] = ()) -> Any:
    """The cache report after the context's compression (``head_tokens`` for per-head policies, bytes)."""
    from kvmodels.decoder import Decoder

    dec = Decoder(model, policy, probe_prefix=probe_prefix)
    dec.extend([context])
    return dec.cache.report()


def build_policies(names: Sequence[str], budgets: Sequence[float], model: Any, snapkv: str = SNAPKV,
                   fraction: float = 0.25) -> dict[tuple[str, float], Any]:
    """The composed policy of each (config, budget); ``profile`` and ``duo`` weights measured on ``model``
    once (``kvmodels.profile``)."""
    from kvmodels.profile import retrieval_head_weights, retrieval_profile
    from kvpolicies import compose

    out: dict[tuple[str, float], Any] = {}
    weights: dict[str, Any] = {}
    for name in names:
        if name not in CONFIGS:
            raise SystemExit(f"--configs: unknown config {name!r}; known: {list(CONFIGS)}")
        text = CONFIGS[name].format(snapkv=snapkv)
        params: dict[str, Any] = {}
        if "profile" in name.split("+"):
            if "profile" not in weights:
                weights["profile"] = retrieval_profile(model)
            params["profile"] = {"weights": weights["profile"]}
        if "duo" in name.split("+"):
            if "duo" not in weights:
                weights["duo"] = retrieval_head_weights(model)
            params["duo"] = {"weights": weights["duo"], "fraction": fraction}
        for budget in [1.0] if name == "full" else budgets:
            out[(name, budget)] = compose(text, budget=budget, evict_every=EVICT_EVERY, **params)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="passkey", choices=("passkey", "story"))
    p.add_argument("--context", type=int, default=1024, help="tokens per prompt (about)")
    p.add_argument("--n", type=int, default=24, help="prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budgets", default="0.2,0.5")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated names of {list(CONFIGS)}, or all")
    p.add_argument("--protocols", default="feed,extend", help="feed, extend, stream, stream-sized, "
                   "stream-pool (all but feed: every config but adakv's)")
    p.add_argument("--chunk", type=int, default=128, help="the stream protocols' chunk")
    p.add_argument("--new", type=int, default=10, help="tokens generated after the question")
    p.add_argument("--fraction", type=float, default=0.25, help="duo's share of retrieval heads")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--out", default="experiments/results/question-agnostic.jsonl")
    p.add_argument("--report", action="store_true", help="print the recorded table and run nothing")
    args = p.parse_args(argv)
    from evals.sweep import append_record, device_name, read_records
    from experiments.quantized_kv import fp16_share

    out = Path(args.out)
    if args.report:  # one --context and --seed's records (a later record of a cell replaces an earlier one)
        print(table([r for r in read_records(out) if r.get("context", args.context) == args.context
                     and r.get("task", "passkey") == args.task and r.get("seed", 0) == args.seed]))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    from evals.sweep import Runner
    from evals.tasks import PASSKEY_QUESTION, exact_match, word_match

    runner = Runner(args.model, seed=args.seed)
    model, tok = runner.model, runner.tokenizer
    samples = runner.samples(args.task, args.context, args.n)
    pieces = [split_question(tok, s.prompt, s.question or PASSKEY_QUESTION) for s in samples]
    correct = exact_match if args.task == "passkey" else word_match
    names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    budgets = [float(b) for b in args.budgets.split(",")]
    protocols = args.protocols.split(",")
    done = {r["key"] for r in read_records(out)}
    t0 = time.perf_counter()
    policies = build_policies(names, budgets, model, fraction=args.fraction)
    calibration_s = time.perf_counter() - t0
    runs = {}  # key -> (name, budget, protocol, policy) still to run
    for (name, budget), policy in policies.items():
        for protocol in protocols:
            if protocol not in PROTOCOLS:
                raise SystemExit(f"--protocols: unknown protocol {protocol!r}; choose from {PROTOCOLS}")
            if protocol != "feed" and policy.heads_refuse_extension:
                continue  # adakv: its split reads the prompt's scores (the cache refuses to extend it)
            streams = f"|chunk={args.chunk}" if protocol.startswith("stream") else ""
            key = (f"{args.task}-qa|{runner.model_name}|ctx={args.context}|n={args.n}|seed={args.seed}|"
                   f"{name}|{budget:g}|{protocol}|new={args.new}{streams}")
            if key not in done:
                runs[key] = (name, budget, protocol, policy)
    if runs:  # every context (and its first chunk) prefilled once, replayed for every config
        firsts = [c[:args.chunk] for c, _ in pieces] if any(p.startswith("stream") for p in protocols) else []
        runner.replay.record([c for c, _ in pieces] + firsts)
        print(f"{len(pieces)} contexts prefilled ({time.perf_counter() - t0:.0f} s)", flush=True)
    replayed = runner.replay  # each context's prefill replayed; the question and decode steps run the model
    for key, (name, budget, protocol, policy) in runs.items():  # in --configs order, a record each
        answer = {"feed": answer_feed, "extend": answer_extend,
                  "stream": partial(answer_stream, chunk=args.chunk, bound=None),
                  "stream-sized": partial(answer_stream, chunk=args.chunk, bound="layer"),
                  "stream-pool": partial(answer_stream, chunk=args.chunk, bound="pool")}[protocol]
        t = time.perf_counter()
        prefix = repeat_prefix(tok) if name in REPEAT_CONFIGS else []
        outputs = [tok.decode(answer(replayed, policy, c, r, args.new, prefix)) for c, r in pieces]
        seconds = time.perf_counter() - t
        right = [correct(o, s.answer) for o, s in zip(outputs, samples, strict=True)]
        record = {"key": key, "task": args.task, "setting": "question asked after compression",
                  "config": name, "protocol": protocol, "policy": policy.label, "budget": budget,
                  "evict_every": policy.evict_every,
                  **({"chunk": args.chunk} if protocol.startswith("stream") else {}),
                  "context": args.context, "n": args.n, "seed": args.seed, "new_tokens": args.new,
                  "context_tokens": [len(c) for c, _ in pieces],
                  "question_tokens": [len(r) for _, r in pieces], "correct": sum(right),
                  "right": right, "answers": [s.answer for s in samples], "outputs": outputs,
                  "seconds": round(seconds, 1), "calibration_s": round(calibration_s, 1),
                  "model": runner.model_name, "device": device_name(), "torch": torch.__version__}
        rep = after_context(replayed, policy, pieces[0][0], prefix)  # the first context, compressed
        record.update(fp16_share(rep, model))
        if policy.heads.per_head:  # each KV head's tokens after the first context's compression
            record["head_tokens_first_prompt"] = [list(layer[0]) for layer in rep.head_tokens]
        append_record(out, record)
        print(f"{name:22s} {budget:4.2f} {protocol:6s} {sum(right)}/{args.n} ({seconds:.0f} s)", flush=True)
    return 0


def table(records: list[dict[str, Any]]) -> str:
    """Markdown: answers out of N, one row per config, one column per (budget, protocol)."""
    if not records:
        return "(no records)"
    cols = sorted({(r["budget"], r["protocol"]) for r in records if r["config"] != "full"},
                  key=lambda c: (c[1] != "feed", c[0]))
    rows: dict[str, dict[Any, str]] = {}
    for r in records:
        cell = f"{r['correct']}/{r['n']}"
        keys = cols if r["config"] == "full" else [(r["budget"], r["protocol"])]
        for k in keys:
            if r["config"] != "full" or k[1] == r["protocol"]:
                rows.setdefault(r["config"], {})[k] = cell
    order = [c for c in CONFIGS if c in rows]
    head = "| config | " + " | ".join(f"{b:g}, {p}" for b, p in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for name in order:
        lines.append(f"| {name} | " + " | ".join(rows[name].get(c, "—") for c in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
