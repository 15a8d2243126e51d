"""Data files that ship with fa_lib, found wherever fa_lib is installed.

* ``sweep-<device>.json``, ``memory-<device>.json``, ``experiments-<device>.json``: the GPU
  measurements written by ``python -m fa_lib.bench`` (with the device and the software versions), which
  the book's chapters *Performance on a GPU* and *Claims checked* read and plot;
* ``references.bib``: the book's bibliography, which *Claims checked* also reads.

They are package data (``pyproject.toml``), so a chapter downloaded from the built book runs in any
folder once fa_lib is installed, editable or not::

    import fa_lib.data
    sweep = fa_lib.data.load_json("sweep-nvidia-h200.json")
    bib = fa_lib.data.path("references.bib").read_text(encoding="utf-8")
"""
from __future__ import annotations

import json
from importlib import resources

__all__ = ["load_json", "names", "path"]


def path(name: str):
    """The packaged data file ``name`` (a ``pathlib.Path`` for an installed or editable fa_lib)."""
    file = resources.files(__name__).joinpath(name)
    if not file.is_file():
        raise FileNotFoundError(f"fa_lib has no data file {name!r}; it has: {', '.join(names())}")
    return file


def load_json(name: str):
    """The parsed contents of the packaged JSON file ``name``."""
    return json.loads(path(name).read_text(encoding="utf-8"))


def names() -> list[str]:
    """The names of the packaged data files, sorted."""
    return sorted(f.name for f in resources.files(__name__).iterdir()
                  if f.is_file() and not f.name.startswith(("_", ".")))
