"""Quality under compression on a real model: passkey retrieval, perplexity under eviction, generation.

    python -m kvmodels.eval                 # CI-sized smoke sweep, with its assertion
    python -m kvmodels.eval --full          # the published sweep (resumable JSON lines)
    python -m kvmodels.eval.plots bench/results/quality-full.jsonl   # figures + tables

``tasks`` holds the prompts, scoring and task runners, ``sweep`` the configs and the resumable results
file, ``plots`` the figures and the markdown tables of docs/results.md.
"""
