"""The GPU measurements of this repository, which the book's chapters read and plot.

Each JSON file is one run of ``python -m benchmarks`` (or of a probe under ``benchmarks/probes``) on one GPU, with
the device, the software versions, the date and the command. They live in the repository, not in the ``fa_lib``
wheel::

    import benchmarks.data
    sweep = benchmarks.data.load_json("sweep-nvidia-h200.json")
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

__all__ = ["bibliography", "load_json", "names", "path"]


def path(name: str):
    """The packaged data file ``name`` (a ``pathlib.Path`` for an installed or editable fa_lib)."""
    file = resources.files(__name__).joinpath(name)
    if not file.is_file():
        raise FileNotFoundError(f"benchmarks/data has no file {name!r}; it has: {', '.join(names())}")
    return file


def load_json(name: str):
    """The parsed contents of the packaged JSON file ``name``."""
    return json.loads(path(name).read_text(encoding="utf-8"))


def names() -> list[str]:
    """The names of the packaged data files, sorted."""
    return sorted(f.name for f in resources.files(__name__).iterdir()
                  if f.is_file() and not f.name.startswith(("_", ".")))


def bibliography() -> str:
    """The text of the book's bibliography, ``book/references.bib`` (which ``_config.yml`` names too)."""
    return (Path(__file__).resolve().parents[2] / "book" / "references.bib").read_text(encoding="utf-8")
