"""Execute chapter notebooks in place, the way they are committed.

    .venv/bin/python tools/execute_notebooks.py book/02_online_softmax.ipynb [...]
    make notebooks            # every chapter

Runs each notebook top to bottom with nbclient (kernel python3, cwd book/), then removes the volatile
per-cell execution timestamps and merges consecutive stdout/stderr chunks of a cell, so that a
re-execution changes the file only where an output really changed. nbval (strict) then checks the
committed outputs against a fresh run in `make test`.
"""
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def _merge_streams(outputs):
    merged = []
    for out in outputs:
        if merged and out.get("output_type") == "stream" and merged[-1].get("output_type") == "stream" \
                and merged[-1].get("name") == out.get("name"):
            merged[-1]["text"] += out["text"]
        else:
            merged.append(out)
    return merged


def execute(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = _merge_streams(cell.outputs)
    nbformat.write(nb, path)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"executing {arg}", flush=True)
        execute(Path(arg))
