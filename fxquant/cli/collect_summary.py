"""The collection summary of a capture directory: `DIR/collection_summary.{json,txt}`, one entry per collection.

Every `fxquant collect` appends its collection (mode, settings, one row per scheme) and never rewrites an
earlier one: the JSON is `{"collections": [...]}` in the order they ran (replaced atomically, earlier entries
kept as they were read), the text file gains one table per collection. A summary written before this layout
(one collection at the top level) becomes the first entry. `fxquant draw visualize` reads every entry.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

JSON_NAME = "collection_summary.json"
TEXT_NAME = "collection_summary.txt"


def read(root: Path) -> list[dict]:
    """The collections recorded under `root`, oldest first ([] when there is no summary)."""
    path = Path(root) / JSON_NAME
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); move it aside to start a new "
                         f"summary") from None
    if isinstance(data, dict) and isinstance(data.get("collections"), list):
        return data["collections"]
    if isinstance(data, dict) and isinstance(data.get("runs"), list):  # one collection at the top level
        return [data]
    raise ValueError(f"{path}: expected {{'collections': [...]}}, found {type(data).__name__} with keys "
                     f"{sorted(data) if isinstance(data, dict) else []}")


def append(root: Path, collection: dict, table: str) -> int:
    """Add `collection` (and its `table`) to the summary under `root`; returns its 1-based number."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    collections = [*read(root), collection]
    tmp = root / f".{JSON_NAME}.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"collections": collections}, indent=2))
    os.replace(tmp, root / JSON_NAME)
    number = len(collections)
    header = (f"collection {number}: {collection['mode']} at {collection['started']} ({collection['model']} "
              f"{collection['variant']}, dataset {collection['dataset']})")
    with open(root / TEXT_NAME, "a") as handle:
        handle.write(f"{header}\n{table}\n\n")
    return number


def run_dirs(root: Path) -> list[str]:
    """The training run directories of every collection under `root` that left a metrics file, each once."""
    seen: dict[str, None] = {}
    for collection in read(root):
        for row in collection.get("runs", []):
            run_dir = row.get("run_dir")
            if run_dir and (Path(run_dir) / "metrics.jsonl").is_file():
                seen.setdefault(run_dir)
    return list(seen)
