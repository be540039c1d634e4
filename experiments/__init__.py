"""Research studies behind docs/results.md and docs/design-adakv.md: the passkey diagnostics and Ada-KV's
head budgets on SmolLM2-135M, on the evaluation harness's samples (``evals``).

Run each from the repository root as a module; their JSON-lines records are in ``experiments/results/``:

    python -m experiments.passkey_variants --context 1024 --n 24      # policy variants the sweep cannot name
    python -m experiments.passkey_profile --context 2048 --seeds 0,1,2,3,4 --budgets 0.2,0.5
    python -m experiments.passkey_margins --context 4096 --n 24 --seed 2
    python -m experiments.passkey_layer_ablation --context 4096 --seed 2 --sample 5 --budget 0.5 POLICY
    python -m experiments.key_digits_kept --context 4096 --seed 2 --budget 0.2 POLICY ...
    python -m experiments.adakv_imbalance --context 1024 --n 24
    python -m experiments.adakv_retrieval --context 1024 --n 24
    python -m experiments.chunked_prefill --contexts 1024 --n 24 --chunk-n 8   # chunked prefill vs once

Like ``evals``, this is research code beside the library: it imports ``kvkernels``, ``kvpolicies``,
``kvmodels`` and ``evals``; the library never imports it, and it is not part of the installed wheel.
"""
