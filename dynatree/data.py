"""Reading text columns from Parquet, Arrow IPC, JSONL, plain text or a `datasets` dataset."""
from __future__ import annotations

import bisect
import fnmatch
import glob
import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from .names import hub_problem


class InputError(ValueError):
    """The input cannot be read, or lacks the requested column."""


_FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
            ".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt"}


def _hidden(path: str, base: str, pattern: str = "") -> bool:
    """Whether a file below ``base`` is one that readers skip (pyarrow.dataset, Spark, Hive):
    any name from ``base`` down starting with '.' or '_' (_SUCCESS, _temporary/, .ipynb_checkpoints/)
    that a glob ``pattern`` does not ask for by a part starting the same way (``_c*``)."""
    asked = [p for p in Path(pattern).parts if p.startswith((".", "_"))]
    return any(c.startswith((".", "_")) and not any(p[0] == c[0] and fnmatch.fnmatchcase(c, p) for p in asked)
               for c in Path(os.path.relpath(path, base)).parts)


def _is_pattern(source: str) -> bool:
    """A glob, not a path: it has wildcards and no file of that name exists (``prompts[2024].parquet``)."""
    return not os.path.exists(source) and any(c in source for c in "*?[")


def input_root(source: str) -> str | None:
    """The directory a file/directory/glob source reads below (None: one file, or a dataset name)."""
    if os.path.isdir(source):
        return source
    if _is_pattern(source):
        head = source[:min(source.index(c) for c in "*?[" if c in source)].rpartition(os.sep)[0]
        return head or (os.sep if source.startswith(os.sep) else ".")
    return None


def would_read(source: str, path: str) -> bool:
    """Whether the file/directory/glob ``source`` would read the file ``path`` (were it there)."""
    path = os.path.realpath(path)
    if os.path.isdir(source):
        return Path(path).is_relative_to(os.path.realpath(source)) and not _hidden(path, os.path.realpath(source))
    if not _is_pattern(source):
        return os.path.realpath(source) == path
    root = input_root(source)
    real_root = os.path.realpath(root)
    source = os.path.join(real_root, os.path.relpath(source, root))

    def match(pat: list[str], parts: list[str]) -> bool:  # glob's rules: ** any directories, * one name
        if not pat:
            return not parts
        if pat[0] == "**":
            return any(match(pat[1:], parts[i:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], pat[0]) and match(pat[1:], parts[1:])

    return match(Path(source).parts[1:], Path(path).parts[1:]) and not _hidden(path, real_root, source)


def _files(source: str) -> list[str]:
    if os.path.isdir(source):
        files = sorted(str(p) for p in Path(source).rglob("*") if p.is_file()
                       and p.suffix in _FORMATS and not _hidden(str(p), source))
    elif os.path.exists(source):  # (a name with [ ] in it is a file first, a pattern only if none)
        files = [source]
    elif _is_pattern(source):
        root = input_root(source)
        files = sorted(f for f in glob.glob(source, recursive=True) if not _hidden(f, root, source))
    else:
        files = []
    if not files:
        raise InputError(f"no input files found at {source!r}")
    return files


def read_table(source: str) -> pa.Table:
    """All rows of a file, directory, glob, or (if no such path exists) a `datasets` dataset.

    A `datasets` source may be a directory written by ``save_to_disk`` or a hub name with an
    optional config and split: ``NAME[:CONFIG]:SPLIT`` (``wikitext:wikitext-2-raw-v1:test``).
    """
    src = InputSource.open(source)  # one reader for every format: the job's, read whole
    return src.read(0, src.num_rows, src.column_names)[0]


def _datasets_target(source: str) -> tuple[str, str | None, str | None] | None:
    """(name, split, config) when `source` names a `datasets` dataset rather than files."""
    def saved(d: str) -> bool:  # a save_to_disk directory
        return os.path.isdir(d) and any((Path(d) / n).exists() for n in ("dataset_info.json", "dataset_dict.json"))

    if saved(source):
        return source, None, None
    base, colon, split = source.rpartition(":")
    if colon and saved(base):  # DIR:SPLIT, a split of a saved DatasetDict
        return base, split, None
    if os.path.exists(source) or _is_pattern(source):
        return None
    # A path-like name that does not exist is a missing file, not a hub dataset to download.
    if Path(source).suffix in _FORMATS or os.sep in source.rstrip(os.sep) and not source.count("/") == 1:
        raise InputError(f"no input files found at {source!r}")
    parts = source.split(":")
    if len(parts) > 3:
        raise InputError(f"{source!r}: expected NAME[:CONFIG]:SPLIT")
    problem = hub_problem(parts[0], "dataset")
    if problem:
        raise InputError(f"no input files found at {source!r}, and as a `datasets` hub name it is {problem}")
    return parts[0], parts[-1] if len(parts) > 1 else None, parts[1] if len(parts) == 3 else None


def _load_dataset(name: str, split: str | None, config: str | None = None):
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
        if split is None and len(ds) > 1:  # which one is the user's to say
            raise InputError(f"{name!r} holds splits {', '.join(ds)}: name one, e.g. {name}:{next(iter(ds))}")
        if split is not None and split not in ds:
            raise InputError(f"{name!r} has no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split or next(iter(ds))]
    return ds


def read_texts(source: str, column: str = "text") -> list:
    table = read_table(source)
    if column not in table.column_names:
        raise InputError(f"{source}: no column {column!r} (columns: {', '.join(table.column_names)})")
    return table.column(column).to_pylist()


# ---------------------------------------------------------------------------------------------
# Streaming, planned input: row counts from file metadata, rows read by range on demand.

JSONL_CHECKPOINT_EVERY = 4096  # rows between remembered byte offsets (10M lines -> ~2.5k offsets)
JSONL_INFER_ROWS = 10000       # rows whose types are inferred together (a JSONL file's schema: all its rows)
BATCH_ROWS = 1024              # rows decoded per step; bounds what a cursor holds between reads
_SCAN_BYTES = 4 << 20          # JSONL planning reads this much at a time
_MAX_CURSORS = 4               # files kept open for sequential reads (a retry may go back a file)
_WS = np.zeros(256, dtype=bool)
_WS[[9, 10, 13, 32]] = True    # the whitespace JSON allows around a value


def _json_hint(path: str) -> str:
    return " (a .json file is read as JSON Lines, one object per line)" if path.endswith(".json") else ""


def _json_row(line: str | bytes, path: str, n: int) -> dict:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise InputError(f"cannot read {path}: line {n}: invalid JSON ({getattr(e, 'msg', e)}{where})"
                         f"{_json_hint(path)}") from e
    if not isinstance(row, dict):
        raise InputError(f"cannot read {path}: line {n}: expected a JSON object, got {type(row).__name__}"
                         f"{_json_hint(path)}")
    return row


@dataclass(frozen=True)
class InputFile:
    path: str          # absolute (for a hub dataset: its name)
    format: str        # "parquet" | "arrow" | "jsonl" | "txt" | "datasets"
    rows: int
    size: int          # bytes (0 for datasets)
    mtime_ns: int      # (0 for datasets)


class _Part:
    """One input file.  Sequential range reads advance a forward cursor instead of re-decoding
    from the file start; between reads the cursor holds at most one undelivered batch."""

    def __init__(self, info: InputFile, schema: pa.Schema):
        self.info, self.schema = info, schema.remove_metadata()
        self._it = self._cur = self._cols = None
        self._pos = 0

    def anchor(self, row: int) -> int:
        """The nearest row <= `row` that batches() can start from without decoding earlier rows."""
        return 0

    def batches(self, row: int, columns: list[str]):
        """Items (len(), .slice(offset, length)) from `row`, an anchor(), to the end of the file."""
        raise NotImplementedError

    def convert(self, items: list, columns: list[str], raw: Sequence[str]) -> tuple[pa.Table, dict]:
        table = pa.Table.from_batches(items)
        return table, {c: table.column(c).to_pylist() for c in raw if c in columns}

    def read(self, lo: int, hi: int, need: list[str], raw: Sequence[str]) -> tuple[pa.Table, dict]:
        """Rows [lo, hi) of this file in its own types; `raw` values as Python objects."""
        cols = [c for c in need if c in self.schema.names]
        if not cols or lo >= hi:
            return pa.table({}), {}
        return self.convert(self._take(lo, hi, cols), cols, raw)

    def _take(self, start: int, end: int, columns: list[str]) -> list:
        anchor = self.anchor(start)
        buffered_end = self._pos + (len(self._cur) if self._cur is not None else 0)
        # Restart when going back, when the columns change, or when a later anchor is cheaper
        # to reach than decoding forward from where the cursor stands.
        if self._it is None or columns != self._cols or start < self._pos or anchor > buffered_end:
            self.close()
            self._it, self._pos, self._cols = self.batches(anchor, columns), anchor, columns
        out = []
        while self._pos < end:
            if self._cur is None:
                self._cur = next(self._it, None)
                if self._cur is None:
                    self.close()
                    raise InputError(f"{self.info.path}: ended at row {self._pos}, planned {self.info.rows} "
                                     "rows (was the file changed while the job ran?)")
            n = len(self._cur)
            lo, hi = max(start - self._pos, 0), min(end - self._pos, n)
            if lo < hi:
                out.append(self._cur.slice(lo, hi - lo))
            if self._pos + n > end:
                break
            self._pos, self._cur = self._pos + n, None
        return out

    def close(self) -> None:
        if hasattr(self._it, "close"):
            self._it.close()
        self._it = self._cur = self._cols = None
        self._pos = 0

    def locate(self, row: int) -> str:
        return f"row {row}"


def _stat(path: str, fmt: str, rows: int) -> InputFile:
    st = os.stat(path)
    return InputFile(path, fmt, rows, st.st_size, st.st_mtime_ns)


class _ParquetPart(_Part):
    def __init__(self, path: str):
        try:
            pf = pq.ParquetFile(path)
            meta, schema = pf.metadata, pf.schema_arrow
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"cannot read {path}: {e}") from e
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self._starts = [0, *itertools.accumulate(sizes)][:-1]
        super().__init__(_stat(path, "parquet", meta.num_rows), schema)

    def anchor(self, row: int) -> int:
        return self._starts[bisect.bisect_right(self._starts, row) - 1] if self._starts else 0

    def batches(self, row: int, columns: list[str]):
        # Without pre_buffer and with a read buffer, a column chunk is streamed page by page:
        # pyarrow's default reads a whole column chunk, which for a 1Mi-row group is the file.
        pf = pq.ParquetFile(self.info.path, pre_buffer=False, buffer_size=1 << 20)
        group = bisect.bisect_right(self._starts, row) - 1
        return pf.iter_batches(batch_size=BATCH_ROWS, columns=columns,
                               row_groups=range(group, len(self._starts)), use_threads=False)


class _ArrowPart(_Part):
    def __init__(self, path: str):
        try:
            with pa.memory_map(path) as src:  # zero-copy: counting rows touches only batch headers
                try:
                    reader, self._stream = ipc.open_file(src), False
                    sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
                except pa.ArrowInvalid:
                    src.seek(0)
                    reader, self._stream = ipc.open_stream(src), True
                    sizes = [b.num_rows for b in reader]
                schema = reader.schema
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"cannot read {path}: {e}") from e
        self._starts = [0, *itertools.accumulate(sizes)][:-1]
        super().__init__(_stat(path, "arrow", sum(sizes)), schema)

    def anchor(self, row: int) -> int:
        if self._stream or not self._starts:
            return 0
        return self._starts[bisect.bisect_right(self._starts, row) - 1]

    def batches(self, row: int, columns: list[str]):
        # A plain file (not a memory map) so pages already delivered do not stay resident.
        options = ipc.IpcReadOptions(included_fields=[self.schema.get_field_index(c) for c in columns])
        with pa.OSFile(self.info.path) as src:
            if self._stream:
                yield from ipc.open_stream(src, options=options)
                return
            reader = ipc.open_file(src, options=options)
            for i in range(bisect.bisect_right(self._starts, row) - 1, reader.num_record_batches):
                yield reader.get_batch(i)


class _TextPart(_Part):
    """A plain-text file is one row: ``text`` (its contents) and ``file`` (its path, so output rows
    can be traced back to their files).  A file that is not UTF-8 is that row's problem, not the
    job's: its raw value is the bytes (the worker's per-row error), its text null."""

    def __init__(self, path: str):
        super().__init__(_stat(path, "txt", 1), pa.schema([("text", pa.string()), ("file", pa.string())]))

    def read(self, lo, hi, need, raw):
        cols = [c for c in need if c in self.schema.names]
        if not cols or lo >= hi:
            return pa.table({}), {}
        values, raws = {"file": [self.info.path]}, {"file": [self.info.path]}
        if "text" in cols:
            try:
                data = Path(self.info.path).read_bytes()
            except OSError as e:
                raise InputError(f"cannot read {self.info.path}: {e}") from e
            try:
                values["text"] = raws["text"] = [data.decode("utf-8")]
            except UnicodeDecodeError:
                values["text"], raws["text"] = [None], [data]
        return pa.table({c: values[c] for c in cols}), {c: raws[c] for c in raw if c in cols}


class _DatasetPart(_Part):
    """A `datasets` dataset is Arrow already (memory mapped), so a range is a zero-copy slice."""

    def __init__(self, name: str, split: str | None, config: str | None):
        ds = _load_dataset(name, split, config)
        if getattr(ds, "_indices", None) is not None:
            ds = ds.flatten_indices()  # a selection/shuffle mapping would make slices wrong
        self.table = ds.data.table if hasattr(ds.data, "table") else ds.with_format("arrow")[:]
        self.meta = {"name": name, "split": split, "config": config,
                     "fingerprint": getattr(ds, "_fingerprint", None)}
        path = os.path.abspath(name) if os.path.isdir(name) else name
        super().__init__(InputFile(path, "datasets", self.table.num_rows, 0, 0), self.table.schema)

    def read(self, lo, hi, need, raw):
        cols = [c for c in need if c in self.schema.names]
        table = self.table.slice(lo, max(hi - lo, 0)).select(cols)
        return table, {c: table.column(c).to_pylist() for c in raw if c in cols}


def _scan_jsonl(path: str, every: int) -> tuple[int, list[tuple[int, int]]]:
    """Non-blank lines of a file, and (byte offset, 1-based line) of rows 0, every, 2*every, ...

    Vectorised over large chunks: a Python loop over 10M lines would dominate planning."""
    rows = lines = pos = 0
    marks: list[tuple[int, int]] = []
    tail_start, tail_text = 0, False  # the line still open at a chunk boundary
    with open(path, "rb") as f:
        while chunk := f.read(_SCAN_BYTES):
            a = np.frombuffer(chunk, dtype=np.uint8)
            text = np.cumsum(~_WS[a], dtype=np.int32)
            nl = np.flatnonzero(a == 10)
            if len(nl):
                ends = text[nl]
                nonblank = np.diff(ends, prepend=0) > 0
                nonblank[0] |= tail_text
                starts = np.concatenate(([tail_start], pos + nl[:-1] + 1))
                idx = np.flatnonzero(nonblank)
                keep = idx[(rows + np.arange(len(idx))) % every == 0]
                marks.extend(zip(starts[keep].tolist(), (lines + keep + 1).tolist()))
                rows, lines = rows + len(idx), lines + len(nl)
                tail_start, tail_text = pos + int(nl[-1]) + 1, bool(text[-1] > ends[-1])
            else:
                tail_text = tail_text or bool(text[-1] > 0)
            pos += len(a)
    if tail_text:  # a last line without a newline
        if rows % every == 0:
            marks.append((tail_start, lines + 1))
        rows += 1
    return rows, marks


class _Rows:
    """Parsed JSONL rows with their 1-based line numbers (blank lines are not rows)."""

    def __init__(self, rows: list[dict], lines: list[int]):
        self.rows, self.lines = rows, lines

    def __len__(self) -> int:
        return len(self.rows)

    def slice(self, lo: int, n: int) -> "_Rows":
        return _Rows(self.rows[lo:lo + n], self.lines[lo:lo + n])


_CONVERT_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)


def _infer_type(values: list) -> pa.DataType:
    """The pyarrow type of a JSONL column's values (null when all are null); string when they mix
    types (str and int...)."""
    try:
        return pa.array(values).type
    except _CONVERT_ERRORS:
        return pa.string()


def _merge_types(a: pa.DataType, b: pa.DataType) -> pa.DataType:
    """One type for values of types a and b: pyarrow's permissive promotion (int and float ->
    float, struct keys united, null -> the other); string when there is none (str and int)."""
    if a.equals(b):
        return a
    if pa.uint64() in (a, b) and pa.types.is_integer(a) and pa.types.is_integer(b):
        return pa.string()  # ids past 2**63 beside signed ones: no integer type holds both (pyarrow picks int64)
    try:
        return pa.unify_schemas([pa.schema([("x", a)]), pa.schema([("x", b)])], promote_options="permissive").field(0).type
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return pa.string()


def _infer_schema(rows) -> pa.Schema:
    """A JSONL file's schema from every row (``rows``: its parsed rows), chunk by chunk: a key,
    a struct field or a wider type first seen at row 9M is as much the file's as one in row 1
    (inferred from the first rows alone, they were dropped without a word)."""
    types: dict[str, pa.DataType] = {}
    while chunk := list(itertools.islice(rows, JSONL_INFER_ROWS)):
        for k in dict.fromkeys(k for row in chunk for k in row):
            t = _infer_type([row.get(k) for row in chunk])
            types[k] = _merge_types(types[k], t) if k in types else t
    # a column with no value anywhere: string, which takes any value as text
    return pa.schema([(k, pa.string() if pa.types.is_null(t) else t) for k, t in types.items()])


SCHEMA_CACHE_VERSION = 1  # raise when _infer_schema would infer differently (pyarrow's version is in the key too)


def _cached_schema(info: InputFile, infer) -> pa.Schema:
    """A JSONL file's inferred schema, kept in the cache directory under the file's path, size,
    mtime, rows and first and last 64 KiB: inferring it reads every line (~6 s per million), and
    a dry run, a resume or a re-run reads the same unchanged file again."""
    from .kbuild import cache_dir

    key = [os.path.abspath(info.path), info.size, info.mtime_ns, info.rows, SCHEMA_CACHE_VERSION, pa.__version__]
    h = hashlib.sha256(json.dumps(key).encode())
    with open(info.path, "rb") as f:
        h.update(f.read(1 << 16))
        f.seek(max(info.size - (1 << 16), 0))
        h.update(f.read(1 << 16))
    path = cache_dir() / "jsonl-schemas" / f"{h.hexdigest()[:24]}.arrows"
    try:
        return ipc.read_schema(pa.py_buffer(path.read_bytes()))
    except (OSError, pa.ArrowInvalid):
        pass
    schema = infer()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(schema.serialize().to_pybytes())
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache: inferred again next time
    return schema


def _truncates(v, t: pa.DataType) -> bool:
    # pyarrow silently truncates 1.5 into an integer column; count that as a value that does not fit
    return isinstance(v, float) and pa.types.is_integer(t) and not v.is_integer()


class _JsonlPart(_Part):
    def __init__(self, path: str):
        self._path = path
        try:
            rows, self._marks = _scan_jsonl(path, JSONL_CHECKPOINT_EVERY)
        except OSError as e:
            raise InputError(f"cannot read {path}: {e}") from e
        self._every = JSONL_CHECKPOINT_EVERY
        info = _stat(path, "jsonl", rows)
        super().__init__(info, _cached_schema(info, lambda: _infer_schema(row for _, row in self._lines(0))))

    def _lines(self, row: int):
        """(line number, parsed row) from `row`, a multiple of the checkpoint interval."""
        if row >= len(self._marks) * self._every:
            return
        offset, line = self._marks[row // self._every]
        with open(self._path, "rb") as f:
            f.seek(offset)
            for n, text in enumerate(f, line):
                if text.strip():
                    yield n, _json_row(text, self._path, n)

    def anchor(self, row: int) -> int:
        return row // self._every * self._every

    def batches(self, row: int, columns: list[str]):
        lines = self._lines(row)
        try:
            while chunk := list(itertools.islice(lines, BATCH_ROWS)):
                yield _Rows([r for _, r in chunk], [n for n, _ in chunk])
        finally:
            lines.close()

    def convert(self, items, columns, raw):
        rows = [r for item in items for r in item.rows]
        lines = [n for item in items for n in item.lines]
        arrays = [self._column(c, [r.get(c) for r in rows], lines) for c in columns]
        return (pa.Table.from_arrays(arrays, names=columns),
                {c: [r.get(c) for r in rows] for c in raw if c in columns})

    def _column(self, name: str, values: list, lines: list[int]) -> pa.Array:
        t = self.schema.field(name).type
        if pa.types.is_string(t):
            # A string column takes any value: non-strings as their JSON text, so a mixed
            # prompt column still reads and the caller can reject single rows.
            return pa.array([v if v is None or isinstance(v, str) else json.dumps(v) for v in values], t)
        try:
            if not any(_truncates(v, t) for v in values):
                return pa.array(values, t)
        except _CONVERT_ERRORS:
            pass
        for v, n in zip(values, lines):  # the slow path only runs to name the offending line
            try:
                if _truncates(v, t):
                    raise pa.ArrowInvalid(v)
                pa.array([v], t)
            except _CONVERT_ERRORS:
                raise InputError(f"{self.info.path}: line {n}: column {name!r} value {v!r:.80} "
                                 f"does not fit type {t} (inferred from the file when the job was planned)") from None
        raise InputError(f"{self.info.path}: lines {lines[0]}-{lines[-1]}: column {name!r} does not fit type {t}")

    def locate(self, row: int) -> str:
        base = self.anchor(row)
        for i, (n, _) in enumerate(self._lines(base)):
            if base + i == row:
                return f"line {n}"
        return f"row {row}"


_PARTS = {"parquet": _ParquetPart, "arrow": _ArrowPart, "jsonl": _JsonlPart, "txt": _TextPart}


def _plan_files(source: str) -> list[str]:
    """The data files of a file/directory/glob source, all of one format."""
    files = [os.path.abspath(f) for f in _files(source)]
    by_format: dict[str, list[str]] = {}
    for f in files:
        fmt = _FORMATS.get(Path(f).suffix)
        if fmt is None:
            hint = {".gz": "decompress it first", ".zst": "decompress it first", ".bz2": "decompress it first",
                    ".csv": "convert it with pyarrow.csv", ".tsv": "convert it with pyarrow.csv"}.get(Path(f).suffix)
            raise InputError(f"unsupported input file type {Path(f).suffix!r}: {f} (readable: "
                             f"{', '.join(_FORMATS)}{'; ' + hint if hint else ''})")
        by_format.setdefault(fmt, []).append(f)
    if len(by_format) > 1:
        main = max(by_format, key=lambda k: len(by_format[k]))
        found = "; ".join(f"{k}: {', '.join(Path(f).name for f in v[:3])}{', ...' if len(v) > 3 else ''}"
                          for k, v in sorted(by_format.items()))
        suffix = Path(by_format[main][0]).suffix
        base = source.rstrip(os.sep) if os.path.isdir(source) else os.path.dirname(source) or "."
        nested = any(os.path.dirname(f) != os.path.abspath(base) for f in by_format[main])
        hint = os.path.join(base, *(["**"] if nested else []), f"*{suffix}")
        raise InputError(f"{source!r} mixes input formats ({found}); read one format, e.g. {hint!r}")
    return files


def _decoded(schema: pa.Schema) -> pa.Schema:
    """Dictionary-encoded columns as their values' type (pandas' categoricals in one file, plain
    strings in the next: the same column)."""
    return pa.schema([f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in schema])


def _unify(parts: list[_Part]) -> pa.Schema:
    schema = parts[0].schema
    for part in parts[1:]:
        if part.schema.equals(schema):
            continue
        try:
            try:
                schema = pa.unify_schemas([schema, part.schema], promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                schema = pa.unify_schemas([_decoded(schema), _decoded(part.schema)], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise InputError(f"{part.info.path}: schema does not match the files before it "
                             f"({parts[0].info.path}, ...): {e}") from e
    return schema


def id_strings(col) -> list[str | None]:
    """An id column as the output writes it: str of its values as Arrow reads them -- the one
    conversion the duplicate check (InputSource.check_ids) and the shards share."""
    ids = col.to_pylist()
    if not pa.types.is_string(col.type) and not pa.types.is_large_string(col.type):
        ids = [None if v is None else str(v) for v in ids]
    return ids


class InputSource:
    """A planned view of an input: row counts from file metadata, rows read by range on demand.

    Global row order is files in sorted path order, rows in file order.  Reading ranges in
    increasing order is cheap (each file keeps a forward cursor); going back restarts a cursor.
    """

    def __init__(self, source: str, parts: list[_Part], schema: pa.Schema, dataset: dict | None = None):
        self.source, self._parts, self.schema, self._dataset = source, parts, schema, dataset
        self.files = [p.info for p in parts]
        self._starts = [0, *itertools.accumulate(f.rows for f in self.files)]
        self.num_rows = self._starts[-1]
        self.column_names = list(schema.names)
        self._open: list[_Part] = []  # parts holding a cursor, least recently used first
        self._ids_ok: set[str] = set()  # columns check_ids passed (it reads the whole column)

    @classmethod
    def open(cls, source: str) -> "InputSource":
        """A file, directory, glob, or `datasets` name/directory (as `read_table` accepts)."""
        target = _datasets_target(source)
        if target is not None:
            part = _DatasetPart(*target)
            return cls(source, [part], part.schema, part.meta)
        parts = [_PARTS[_FORMATS[Path(f).suffix]](f) for f in _plan_files(source)]
        for part in parts:
            names = part.schema.names
            if len(set(names)) < len(names):
                dup = next(n for n in names if names.count(n) > 1)
                raise InputError(f"{part.info.path}: two columns named {dup!r}; rename one")
        return cls(source, parts, _unify(parts))

    def files_without(self, column: str) -> list[str]:
        """The input's files with rows but no ``column`` (their rows would read it as null)."""
        return [p.info.path for p in self._parts if p.info.rows and column not in p.schema.names]

    def fingerprint(self) -> dict:
        fp = {"source": self.source, "num_rows": self.num_rows,
              "files": [{"path": f.path, "format": f.format, "size": f.size, "mtime_ns": f.mtime_ns,
                         "rows": f.rows} for f in self.files]}
        if self._dataset is not None:
            fp["dataset"] = dict(self._dataset)
        return fp

    def _require(self, columns) -> None:
        for c in columns:
            if c not in self.column_names:
                raise InputError(f"{self.source}: no column {c!r} (columns: {', '.join(self.column_names)})")

    def read(self, start: int, end: int, columns: list[str], raw: Sequence[str] = ()) -> tuple[pa.Table, dict[str, list]]:
        """Rows [start, end) with only `columns`, typed with `self.schema`; plus, per name in
        `raw`, that column's values as Python objects exactly as the file holds them."""
        columns, raw = list(columns), list(dict.fromkeys(raw))  # one column can be both id and prompt
        self._require(columns + raw)
        need = list(dict.fromkeys(columns + raw))
        start, end = max(start, 0), min(end, self.num_rows)
        tables, raws = [], {c: [] for c in raw}
        k = bisect.bisect_right(self._starts, start) - 1
        while start < end:
            part, base = self._parts[k], self._starts[k]
            hi = min(end, self._starts[k + 1])
            if hi > start:
                self._touch(part)
                t, r = part.read(start - base, hi - base, need, raw)
                tables.append(self._conform(t, columns, hi - start, part))
                for c in raw:
                    raws[c].extend(r.get(c) or [None] * (hi - start))
            start, k = hi, k + 1
        sub = pa.schema([self.schema.field(c) for c in columns])
        return (pa.concat_tables(tables) if tables else sub.empty_table()), raws

    def _touch(self, part: _Part) -> None:
        if part in self._open:
            self._open.remove(part)
        self._open.append(part)
        while len(self._open) > _MAX_CURSORS:
            self._open.pop(0).close()

    def _conform(self, table: pa.Table, columns: list[str], n: int, part: _Part) -> pa.Table:
        """One file's rows in the input's unified schema; columns the file lacks are null."""
        arrays = []
        for c in columns:
            field = self.schema.field(c)
            if c not in table.column_names:
                arrays.append(pa.nulls(n, field.type))
                continue
            col = table.column(c)
            if col.type != field.type:
                try:
                    col = col.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
                    raise InputError(f"{part.info.path}: column {c!r} cannot be read as {field.type}: {e}") from e
            arrays.append(col)
        return pa.Table.from_arrays(arrays, schema=pa.schema([self.schema.field(c) for c in columns]))

    def _where(self, row: int) -> tuple[_Part, str]:
        k = bisect.bisect_right(self._starts, row) - 1
        part = self._parts[k]
        return part, part.locate(row - self._starts[k])

    def id_strings(self, start: int, stop: int, column: str) -> list[str | None]:
        """Rows start..stop-1's ids as the output writes them (:func:`id_strings`)."""
        return id_strings(self.read(start, stop, [column])[0].column(0))

    def _id_hashes(self, column: str, chunk: int):
        """(first global row, int64 hashes of str(id)) per chunk; a null id raises."""
        for s in range(0, self.num_rows, chunk):
            ids = self.id_strings(s, s + chunk, column)
            if None in ids:
                part, where = self._where(s + ids.index(None))
                raise InputError(f"{part.info.path}: id column {column!r} is null at {where}")
            yield s, ids, np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids))

    def check_ids(self, column: str, chunk: int = 65536) -> None:
        """Null ids and duplicate ids (compared as str) raise InputError; a column that passed is
        not read again."""
        if column not in self._ids_ok:
            self._check_ids(column, chunk)
            self._ids_ok.add(column)

    def _check_ids(self, column: str, chunk: int) -> None:
        """Memory is 8 bytes per row (a hash), not a set of id strings: repeated hashes are found by
        sorting, and a second pass confirms only the ids behind them."""
        self._require([column])
        hashes = [h for _, _, h in self._id_hashes(column, chunk)]
        if not hashes:
            return
        h = np.sort(np.concatenate(hashes))
        del hashes
        repeated = np.unique(h[1:][h[1:] == h[:-1]])
        del h
        if not len(repeated):
            return
        dups = self._confirm_dups(column, chunk, repeated)
        if dups:
            shown = sorted(dups)[:10]
            (part_a, a), (part_b, b) = (self._where(r) for r in dups[shown[0]])
            raise InputError(f"{self.source}: duplicate ids in {column!r} ({len(repeated)} ids repeat): "
                             f"{', '.join(map(repr, shown))} (e.g. {shown[0]!r} at {part_a.info.path} {a} "
                             f"and {part_b.info.path} {b})")

    def _confirm_dups(self, column: str, chunk: int, repeated: np.ndarray) -> dict[str, tuple[int, int]]:
        """Duplicated ids among those whose hash repeats, with two global rows each.

        Candidates are checked 1000 hashes at a time, stopping once 10 duplicates are known, so a
        heavily duplicated input cannot make this pass hold every id."""
        dups: dict[str, tuple[int, int]] = {}
        for i in range(0, len(repeated), 1000):
            wanted, seen = repeated[i:i + 1000], {}
            for s, ids, h in self._id_hashes(column, chunk):
                for j in np.flatnonzero(np.isin(h, wanted)).tolist():
                    first = seen.setdefault(ids[j], s + j)
                    if first != s + j and ids[j] not in dups:
                        dups[ids[j]] = (first, s + j)
            if len(dups) >= 10:
                break
        return dups
