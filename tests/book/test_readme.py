"""README.md: its ```python runnable``` blocks run as written, and it stays short.

The blocks are run in order in one fresh Python process, in one namespace (as if concatenated: a later
block uses the names of an earlier one), from the repository root. Each block is compiled with the file
name README.md and its own line numbers, so a traceback points at the README's line. Blocks fenced with
a plain ```python are shown to the reader only (a GPU, a model download, an API not in this checkout).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 250
FENCE = "```python runnable"

# Runs in the child: exec each (first line, source) pair in one namespace; on an error, name the block.
DRIVER = """
import json, sys, traceback
namespace = {"__name__": "__main__"}
for index, (first, source) in enumerate(json.loads(sys.argv[1])):
    code = compile("\\n" * (first - 1) + source, "README.md", "exec")
    try:
        exec(code, namespace)
    except BaseException:
        traceback.print_exc()
        print(f"README_BLOCK_FAILED {index}", file=sys.stderr)
        sys.exit(1)
"""


def runnable_blocks(text):
    """[(line of the block's first code line, 1-based; the block's source)] for every runnable fence."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == FENCE:
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise AssertionError(f"README.md line {i + 1}: a runnable block is never closed")
            blocks.append((start + 1, "\n".join(lines[start:end]) + "\n"))
            i = end
        i += 1
    return blocks


def test_readme_length_and_blocks():
    text = README.read_text(encoding="utf-8")
    n_lines = len(text.splitlines())
    assert n_lines <= MAX_LINES, f"README.md has {n_lines} lines; keep it at most {MAX_LINES}"
    assert runnable_blocks(text), f"README.md has no {FENCE} block"


def test_readme_runnable_blocks_run():
    blocks = runnable_blocks(README.read_text(encoding="utf-8"))
    env = dict(os.environ)
    # The blocks use CPU tensors. Without CUDA, `import fa_lib` must choose the interpreter by itself, as
    # the README says: remove any value this test process inherited or fa_lib set in it. With CUDA, ask
    # for the interpreter, as the README tells a GPU user to do to run these blocks as written.
    import torch

    from fa_lib._interpreter import check_versions

    try:
        check_versions()
    except ImportError as error:  # e.g. the GPU image's Triton 3.6 with NumPy 2.5
        pytest.skip(f"the blocks run under Triton's interpreter, which cannot run here: {error}")
    if torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    try:
        result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(blocks)], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"README.md's runnable blocks took more than 120 s\nstderr:\n{error.stderr}")
    if result.returncode != 0:
        failed = [line for line in result.stderr.splitlines() if line.startswith("README_BLOCK_FAILED ")]
        if failed:
            first, source = blocks[int(failed[-1].split()[1])]
            where = f"the block at README.md line {first}:\n{source}"
        else:
            where = "no block named (the process failed outside them)"
        pytest.fail(f"README.md: {where}\nexit status {result.returncode}\nstderr:\n{result.stderr}"
                    f"\nstdout:\n{result.stdout}")
