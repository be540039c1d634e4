"""The README (and docs/usage.md, which holds the examples moved out of it) runs as written: every Python
snippet and every ``kvgen`` command, compared with the expected output shown beside it.

A fenced ``text`` block right after a ``python`` or ``bash`` block is that block's expected output,
abridged: each of its lines must be found in what the block printed, where ``...`` in an expected line
stands for anything (each piece between them must appear) and timings (``2.33 s``, ``273.2 tok/s``) may
differ. Snippets run in a fresh interpreter from the repository root, as a user would run them.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = (README, ROOT / "docs" / "usage.md")  # every page whose snippets are run
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>\w*)\s*$")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    expected: str | None = None  # the text block that follows, if any


def blocks(text: str) -> list[Block]:
    """Fenced blocks in order (indented ones inside list items too), each code block paired with the
    ``text`` block that follows it before any other block (prose may stand between them)."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        block = Block(m["lang"], textwrap.dedent("\n".join(body)), start + 1)
        if block.lang == "text" and out and out[-1].expected is None and out[-1].lang != "text":
            out[-1].expected = block.code
        out.append(block)
        i += 1
    return out


TIMING = [(re.compile(r"\d+(\.\d+)? s\b"), "<T> s"), (re.compile(r"\d+(\.\d+)? tok/s"), "<R> tok/s")]


def normalise(text: str) -> str:
    for pattern, repl in TIMING:
        text = pattern.sub(repl, text)
    return " ".join(text.split())


def assert_shows(output: str, expected: str, where: str) -> None:
    got = normalise(output)
    for line in expected.splitlines():
        for piece in normalise(line).split("..."):
            piece = piece.strip()
            if piece:
                assert piece in got, f"{where}: expected {piece!r} in the output:\n{output[-3000:]}"


def test_block_parser_pairs_outputs():
    text = ("```python\nprint(1)\n```\n\n```text\n1\n```\n  ```bash\n  echo hi\n  ```\nExpected:\n"
            "```text\nhi\n```\n```python\npass\n```\n```bash\nls\n```\n```text\nx\n```\n")
    found = blocks(text)
    assert [(b.lang, b.expected) for b in found] == [("python", "1"), ("text", None), ("bash", "hi"),
                                                     ("text", None), ("python", None), ("bash", "x"),
                                                     ("text", None)]
    assert_shows("loaded in 1.4 s; 12.5 tok/s", "loaded in 9.9 s; ... tok/s", "self-test")
    with pytest.raises(AssertionError):
        assert_shows("The answer is Paris.", "The answer is Rome.", "self-test")


README_BLOCKS = blocks(README.read_text())
# (page, block) for every page of DOCS; ids name the page and line.
DOC_BLOCKS = [(page, b) for page in DOCS for b in blocks(page.read_text())]
PYTHON = [(page, b) for page, b in DOC_BLOCKS if b.lang == "python"]


def block_id(item: tuple[Path, Block]) -> str:
    page, block = item
    return f"{page.relative_to(ROOT)}:{block.line}"


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"snippet failed:\n{code}\n--- stderr ---\n{done.stderr[-3000:]}"
    return done.stdout


def needs_model(code: str) -> bool:
    return "load_checkpoint" in code or "kvgen" in code


def skip_without_model() -> None:
    from kvmodels.loading import CheckpointError, default_model_path

    try:
        default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))


@pytest.mark.slow
@pytest.mark.parametrize("item", PYTHON, ids=block_id)
def test_python_snippet_runs_and_prints_what_the_readme_shows(item):
    block = item[1]
    if needs_model(block.code):
        skip_without_model()
    out = run_python(block.code)
    if block.expected is not None:
        assert_shows(out, block.expected, block_id(item))


def kvgen_commands(code: str) -> list[list[str]]:
    """The ``kvgen`` invocations of a bash block (the last command of an ``&&`` chain; comments dropped)."""
    out = []
    for line in code.splitlines():
        command = line.split("&&")[-1].strip()
        words = shlex.split(command, comments=True)
        if words[:1] == ["kvgen"]:
            out.append(words[1:])
        elif words[:3] == ["python", "-m", "kvmodels"]:
            out.append(words[3:])
    return out


SHELL = [(page, b) for page, b in DOC_BLOCKS if b.lang == "bash" and kvgen_commands(b.code)]


def test_readme_has_the_commands_it_promises():
    readme_python = [b for b in README_BLOCKS if b.lang == "python"]
    readme_shell = [b for b in README_BLOCKS if b.lang == "bash" and kvgen_commands(b.code)]
    assert len(readme_python) >= 3 and len(readme_shell) >= 2
    assert all(b.expected is not None for _, b in SHELL)
    main = kvgen_commands(readme_shell[0].code)
    assert main and "--prompt-file" in main[0]  # the main job asks about a prompt long enough to compress


@pytest.mark.slow
@pytest.mark.parametrize("item", SHELL, ids=block_id)
def test_kvgen_commands_run_and_print_what_the_readme_shows(item):
    block = item[1]
    skip_without_model()
    outputs = []
    for args in kvgen_commands(block.code):
        done = subprocess.run([sys.executable, "-m", "kvmodels", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, f"kvgen {shlex.join(args)} failed:\n{done.stderr[-3000:]}"
        outputs.append(done.stdout + "\n" + done.stderr)
    assert_shows("\n".join(outputs), block.expected, block_id(item))
