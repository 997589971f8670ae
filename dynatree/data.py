"""Reading text columns from Parquet, Arrow IPC, JSONL, plain text or a `datasets` dataset."""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pyarrow as pa


class InputError(ValueError):
    """The input cannot be read, or lacks the requested column."""


def _files(source: str) -> list[str]:
    if any(c in source for c in "*?["):
        files = sorted(glob.glob(source, recursive=True))
    elif os.path.isdir(source):
        files = sorted(str(p) for p in Path(source).rglob("*") if p.is_file()
                       and p.suffix in (".parquet", ".arrow", ".feather", ".ipc", ".jsonl", ".json", ".txt"))
    elif os.path.exists(source):
        files = [source]
    else:
        files = []
    if not files:
        raise InputError(f"no input files found at {source!r}")
    return files


def _read_one(path: str) -> pa.Table:
    suffix = Path(path).suffix
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq
            return pq.read_table(path)
        if suffix in (".arrow", ".feather", ".ipc"):
            import pyarrow.ipc as ipc
            with pa.memory_map(path) as src:
                try:
                    return ipc.open_file(src).read_all()
                except pa.ArrowInvalid:
                    src.seek(0)
                    return ipc.open_stream(src).read_all()
        if suffix in (".jsonl", ".json"):
            with open(path, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            return pa.Table.from_pylist(rows)
        if suffix == ".txt":
            return pa.table({"text": [Path(path).read_text(encoding="utf-8")]})
    except (pa.ArrowInvalid, OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from e
    raise InputError(f"unsupported input file type {suffix!r}: {path}")


def read_table(source: str) -> pa.Table:
    """All rows of a file, directory, glob, or (if no such path exists) a `datasets` dataset.

    A `datasets` source may be a directory written by ``save_to_disk`` or a hub name with an
    optional config and split: ``NAME[:CONFIG]:SPLIT`` (``wikitext:wikitext-2-raw-v1:test``).
    """
    if os.path.isdir(source) and (Path(source) / "dataset_info.json").exists() or \
            (os.path.isdir(source) and (Path(source) / "dataset_dict.json").exists()):
        return _read_datasets(source, None)
    if not os.path.exists(source) and not any(c in source for c in "*?["):
        if Path(source).suffix in (".parquet", ".arrow", ".feather", ".ipc", ".jsonl", ".json", ".txt") \
                or os.sep in source.rstrip(os.sep) and not source.count("/") == 1:
            raise InputError(f"no input files found at {source!r}")
        parts = source.split(":")
        if len(parts) > 3:
            raise InputError(f"{source!r}: expected NAME[:CONFIG]:SPLIT")
        name, config, split = parts[0], parts[1] if len(parts) == 3 else None, parts[-1] if len(parts) > 1 else None
        return _read_datasets(name, split, config)
    tables = [_read_one(f) for f in _files(source)]
    try:
        return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
    except pa.ArrowInvalid as e:
        raise InputError(f"input files under {source!r} have incompatible schemas: {e}") from e


def _read_datasets(name: str, split: str | None, config: str | None = None) -> pa.Table:
    try:
        import datasets
    except ImportError as e:
        raise InputError(f"{name!r} is not a file; reading a `datasets` dataset needs `pip install datasets`") from e
    try:
        if os.path.isdir(name):
            ds = datasets.load_from_disk(name)
        else:
            ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many types (FileNotFoundError, ConnectionError, ...)
        raise InputError(f"cannot load dataset {name!r}: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        key = split or ("test" if "test" in ds else next(iter(ds)))
        ds = ds[key]
    return ds.data.table if hasattr(ds.data, "table") else ds.with_format("arrow")[:]


def read_texts(source: str, column: str = "text") -> list:
    table = read_table(source)
    if column not in table.column_names:
        raise InputError(f"{source}: no column {column!r} (columns: {', '.join(table.column_names)})")
    return table.column(column).to_pylist()
