"""Quality under compression on a real model: passkey retrieval, perplexity under eviction, generation.

    python -m evals                 # CI-sized smoke sweep, with its assertion
    python -m evals --full          # the published sweep (resumable JSON lines)
    python -m evals.plots evals/results/quality-full.jsonl   # figures + tables

Run from the repository root: the harness is research code beside the library (it imports ``kvkernels``,
``kvpolicies`` and ``kvmodels``; they never import it) and is not part of the installed wheel. ``data/``
holds the evaluation text, ``results/`` the sweep's JSON-lines records.

``tasks`` holds the prompts, scoring and task runners, ``sweep`` the configs and the resumable results
file, ``plots`` the figures and the markdown tables of docs/results.md.
"""
