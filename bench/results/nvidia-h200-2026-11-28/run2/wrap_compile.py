# ruff: noqa  (kept exactly as it ran on the device, below its header)
# run2: transformers' LlamaForCausalLM (the Llama-3.2-1B shape, random bf16 weights) wrapped onto the paged
# cache, batch 16, 4k prompts, 256 new tokens, snapkv at 0.2: kvmodels.generate eager, then compiled.
# Run as `python bench/results/nvidia-h200-2026-11-28/run2/wrap_compile.py` from the repository root.
import sys, time, torch, transformers
sys.path.insert(0, 'src')
from kvmodels.loading import llama_config_to_hf
from kvmodels.llama import LlamaConfig
from kvmodels.hf import wrap_transformers
from kvmodels.generate import generate
from kvpolicies import compose
cfg = LlamaConfig.from_name("llama-3.2-1b", max_seq_len=4096 + 256 + 8)
torch.manual_seed(0)
with torch.device("cuda"):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config_to_hf(cfg)))
hf = hf.to(torch.bfloat16).eval()
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, cfg.vocab_size, (4096,), generator=g).tolist() for _ in range(16)]
w = wrap_transformers(hf)
for comp in (False, True):
    st = []
    clock = lambda b, t: b == 0 and st.append(time.perf_counter())
    try:
        r = generate(w, prompts, 256, compose("snapkv", budget=0.2), compile=comp, stream=clock)
        n = len(st) - 1
        print("compile", comp, "decode tok/s", round(16 * (n - 3) / (st[-1] - st[3]), 1), "first step s",
              round(st[1] - st[0], 2), "prefill s", round(r.prefill_s, 2), flush=True)
    except Exception as e:
        import traceback; traceback.print_exc(); print("compile", comp, "FAILED", type(e).__name__, flush=True)
