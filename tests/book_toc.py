"""The book's table of contents, read once for the structure and browser tests."""
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def toc_documents() -> list[str]:
    """Every document of _toc.yml (root, then parts/chapters/sections in order), without suffix."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf8"))
    docs = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                docs.append(entry["file"])
            walk(entry.get("sections"))

    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    walk(toc.get("chapters"))
    return [str(Path(d).with_suffix("")) for d in docs]
