"""What KIVI's per-channel keys would buy over the library's per-token keys (issue 36), by simulation.

The library quantizes keys **per token** (each row a scale and zero point per ``group`` channels) so that
eviction can move a row alone; KIVI groups each key *channel* across ``group`` consecutive tokens. This study
measures the accuracy that deviation costs before anyone builds per-channel pages, on SmolLM2-135M-Instruct
(CPU), passkey ~1k (``evals.tasks.passkey_samples``), **question inside the prompt**, greedy, 8 new tokens:

1. ``kvmodels.decoder.Decoder`` prefills a prompt into an unquantized float32 cache under the eviction policy
   (``full``, or the README's passkey setting at 0.2), which compresses it;
2. the kept prompt tokens of every layer, in slot order, are replaced by their quantize-dequantize round trip
   with the library's own arithmetic (``kvkernels.quant.quantize`` / ``dequantize``: asymmetric, float16
   scale and zero point rounded outward): the oldest ``floor((n - residual) / group) * group`` tokens of the
   ``n`` kept (KIVI's rule: the rest wait in full precision as its residual); values always per token
   (groups of ``group`` channels); keys either per token the same way (what the library stores) or per
   channel, each channel's ``group`` consecutive kept tokens sharing a scale and zero point (KIVI);
3. the answer's tokens are decoded over that cache (the 8 new tokens stay in the residual).

A simulation: the stored rows are float32, not packed (bytes are computed, not held), and the first step's
logits come from the prefill's unquantized attention, as in KIVI and in the library.

Run: ``python -m experiments.kivi_channel_keys --out experiments/results/kivi-channel-keys.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kvkernels.quant import dequantize, quantize

SNAPKV = "snapkv(chunk=5, window=16, per_head=False, align='scores')"  # the README's passkey setting
# (eviction policy, budget, bits, group, residual, keys)
CONFIGS = [("full", 1.0, 16, 32, 0, "none")]
CONFIGS += [("full", 1.0, bits, 32, r, keys)
            for bits in (2, 4) for r in (128, 0) for keys in ("token", "channel")]
CONFIGS += [("full", 1.0, 2, 16, 0, keys) for keys in ("token", "channel")]
CONFIGS += [(SNAPKV, 0.2, 16, 32, 0, "none")]
CONFIGS += [(SNAPKV, 0.2, bits, 32, r, keys)
            for bits in (2, 4) for r in (32, 0) for keys in ("token", "channel")]


def round_trip(x: torch.Tensor, bits: int, group: int, dim: int) -> torch.Tensor:
    """``x`` quantized and dequantized with groups of ``group`` along ``dim`` (the library's arithmetic)."""
    moved = x.movedim(dim, -1).contiguous()
    out = dequantize(quantize(moved, bits, group), bits, group, dtype=x.dtype)
    return out.movedim(-1, dim)


def quantize_cache(cache, b: int, bits: int, group: int, residual: int, keys: str) -> int:
    """Replace sequence ``b``'s kept slots in every layer by their round trip; returns how many per layer."""
    S = cache.page_size
    done = 0
    for l in range(cache.n_layers):
        n = int(cache.host.lens[l, b])
        nq = max(0, (n - residual) // group * group)
        if nq == 0:
            continue
        slots = torch.arange(nq)
        page = cache.page_table[l, b][slots // S].long()
        off = slots % S
        k, v = cache.k_pages[page, off], cache.v_pages[page, off]  # [nq, Hkv, D] in slot order
        v_q = round_trip(v, bits, group, -1)
        if keys == "token":
            k_q = round_trip(k, bits, group, -1)
        else:  # per channel: groups of `group` consecutive tokens
            k_q = round_trip(k.unflatten(0, (nq // group, group)), bits, group, 1).flatten(0, 1)
        cache.k_pages[page, off] = k_q
        cache.v_pages[page, off] = v_q
        done = nq
    return done


def bytes_share(bits: int, group: int, residual: int, keys: str, n: int, head_dim: int) -> float:
    """Bytes per kept token and KV head of a K/V pair over an fp16 pair (the pool's position and score
    bytes left out), for ``n`` kept tokens: quantized rows (codes + fp16 parameters) plus the residual's
    fp16 rows. Both layouts cost the same: a group's parameters are shared by ``group`` channels of one
    token (per token) or ``group`` tokens of one channel (per channel)."""
    if keys == "none":
        return 1.0
    nq = max(0, (n - residual) // group * group)
    row = head_dim * bits / 8 + 4 * head_dim / group
    return (nq * 2 * row + (n - nq) * 4 * head_dim) / (n * 4 * head_dim)


def run(runner, name: str, budget: float, bits: int, group: int, residual: int, keys: str,
        context: int, n: int) -> dict:
    from evals.tasks import exact_match
    from kvmodels.decoder import Decoder
    from kvpolicies import compose

    policy = compose(name, budget=budget)
    correct, outputs, kept, quantized = 0, [], [], []
    for s in runner.samples("passkey", context, n):
        dec = Decoder(runner.model, policy)
        dec.extend([list(s.prompt)], max_new_tokens=8)
        kept.append(int(dec.cache.host.lens[:, 0].mean()))
        if keys != "none":
            quantized.append(quantize_cache(dec.cache, 0, bits, group, residual, keys))
        res = dec.generate(8, eos_ids=runner.tokenizer.eos_ids, final=True)
        text = runner.tokenizer.decode(res.tokens[0], skip_special_tokens=True)
        outputs.append(text)
        correct += exact_match(text, s.answer)
    D = runner.model.cache_layout().head_dim
    mean_kept = sum(kept) / len(kept)
    return {"correct": correct, "n": n, "kept_tokens": mean_kept,
            "quantized_tokens": sum(quantized) / len(quantized) if quantized else 0,
            "kv_bytes_vs_fp16": bytes_share(bits, group, residual, keys, round(mean_kept), D) * budget,
            "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="experiments/results/kivi-channel-keys.jsonl")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reverse", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from evals.sweep import Runner, append_record, device_name, read_records

    out = Path(args.out)
    runner = Runner(None, seed=args.seed)
    done = {r["key"] for r in read_records(out)}
    for cfg in (CONFIGS[::-1] if args.reverse else CONFIGS):
        name, budget, bits, group, residual, keys = cfg
        key = (f"kivi-channel|{runner.model_name}|{args.context}|n={args.n}|seed={args.seed}|{name}|"
               f"{budget:g}|bits={bits}|group={group}|residual={residual}|keys={keys}")
        if key in done:
            continue
        t0 = time.perf_counter()
        res = run(runner, name, budget, bits, group, residual, keys, args.context, args.n)
        rec = {"key": key, "policy": name, "budget": budget, "bits": bits, "group": group,
               "residual": residual, "keys": keys, "context": args.context, "device": device_name(),
               "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **res,
               "seconds": round(time.perf_counter() - t0, 1)}
        append_record(out, rec)
        done.add(key)
        print(f"{name} {budget:g} bits={bits} g={group} r={residual} keys={keys}: {res['correct']}/{args.n} "
              f"({rec['seconds']} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
