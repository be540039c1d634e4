"""nox sessions. They run in the current interpreter (``venv_backend="none"``): this project's machines
cannot download interpreters, and torch is installed once (``pip install torch==2.13.0`` on CPU).

    nox -s tests          # CPU suite, Triton kernels through the interpreter
    nox -s gpu            # same suite on CUDA with compiled Triton, plus GPU-only checks
    nox -s compile        # every Triton kernel variant compiled for sm_80/sm_90 (no GPU needed)
    nox -s oldest         # the oldest supported Triton and transformers
    nox -s bench          # kernel + model benchmarks -> bench/results/<device>-*.json
    nox -s lint           # ruff + mypy
    nox -s quality        # small quality sweep on SmolLM2 (full sweep: nox -s quality -- --full)
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["tests", "lint"]


def _install(session: nox.Session, extras: str) -> None:
    if session.posargs and "--no-install" in session.posargs:
        return
    session.run("python", "-m", "pip", "install", "-q", "-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """CPU test suite (what CI runs)."""
    _install(session, "test")
    session.run("python", "-m", "pytest", "-q", *[a for a in session.posargs if a != "--no-install"],
                env={"TRITON_INTERPRET": "1"})


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """The suite on CUDA (compiled Triton), with the heavier Hypothesis profile."""
    _install(session, "test")
    session.run("python", "-m", "pytest", "-q", *[a for a in session.posargs if a != "--no-install"],
                env={"KVPOLICIES_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "0", "HYPOTHESIS_PROFILE": "gpu"})


@nox.session(default=False)
def compile(session: nox.Session) -> None:
    """Compile every kernel variant the launchers can pick for sm_80/sm_90 (``-- --full``: all of them)."""
    args = [a for a in session.posargs if a != "--no-install"]
    session.run("python", "-m", "kvkernels.compile_check", *args, env={"TRITON_INTERPRET": "0"})


@nox.session(default=False)
def oldest(session: nox.Session) -> None:
    """The oldest supported Triton (compile check + interpreter kernel tests) and transformers."""
    _install(session, "test")
    session.run("bash", ".ci/oldest-triton", external=True)
    session.run("bash", ".ci/oldest-transformers", external=True)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Kernel and generation benchmarks with pytest-benchmark; JSON under bench/results/."""
    _install(session, "test")
    probe = ("import torch; print(torch.cuda.get_device_name(0).replace(' ', '-') "
             "if torch.cuda.is_available() else 'cpu')")
    device = session.run("python", "-c", probe, silent=True).strip().splitlines()[-1]
    out = f"--benchmark-json=bench/results/{device}-bench.json"
    session.run("python", "-m", "pytest", "bench", "-q", out,
                *[a for a in session.posargs if a != "--no-install"])


@nox.session
def lint(session: nox.Session) -> None:
    """ruff + mypy."""
    session.run("ruff", "check", "src", "tests", "bench", "evals", "experiments", "examples", "noxfile.py")
    session.run("mypy", "src", "evals")


@nox.session(default=False)
def quality(session: nox.Session) -> None:
    """Quality under compression on SmolLM2 (the harness in evals/, records in evals/results/): a quick
    sweep, or the full one with ``-- --full``. Runs from the repository root."""
    _install(session, "eval")
    session.run("python", "-m", "evals", *[a for a in session.posargs if a != "--no-install"])
