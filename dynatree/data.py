"""Reading text columns from Parquet, Arrow IPC, JSONL, plain text or a `datasets` dataset."""
from __future__ import annotations

import bisect
import fnmatch
import glob
import hashlib
import itertools
import json
import os
import urllib.parse
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa

from .jsonl import JsonlPart
from .names import hub_problem
from .parts import ArrowPart, InputError, InputFile, ParquetPart, Part, TextPart, as_text, file_digest, py_values

IDS_CHECK_VERSION = 1  # of check_ids' rules (ids compared as id_strings makes them): a change re-checks

__all__ = ["BadIds", "InputError", "Uncastable", "InputSource", "id_strings", "input_root", "read_table", "read_texts", "would_read"]


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
    if os.path.islink(source):  # (a link to nothing, or a loop: no hub name either)
        raise InputError(f"{source!r} is a symbolic link to nothing that exists ({os.readlink(source)!r})")
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
    """A column's values as the file holds them (a JSONL number stays a number, not its text, so
    the caller can skip what is not a prompt, as `dynatree run` gives it an error)."""
    src = InputSource.open(source)
    src.require([column])
    return src.read(0, src.num_rows, [column], raw=[column])[1][column]


# ---------------------------------------------------------------------------------------------
# Streaming, planned input: row counts from file metadata, rows read by range on demand.

_MAX_CURSORS = 4  # files kept open for sequential reads (a retry may go back a file)


class DatasetPart(Part):
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
        return table, {c: py_values(table.column(c)) for c in raw if c in cols}


_PARTS = {"parquet": ParquetPart, "arrow": ArrowPart, "jsonl": JsonlPart, "txt": TextPart}


def jsonl_bytes(source: str) -> int:
    """Bytes of the JSONL files a file/directory/glob source reads (planning reads them whole, to
    count rows and type columns: Parquet and Arrow inputs plan from their metadata, a .txt file is
    one row); 0 where it names nothing readable (opening it says why)."""
    try:
        files = _plan_files(source) if _datasets_target(source) is None else []
    except (InputError, OSError):
        return 0
    return sum(os.path.getsize(f) for f in files if _FORMATS[Path(f).suffix] == "jsonl")


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


def _textual(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):  # (pandas' categoricals)
        t = t.value_type
    return (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_boolean(t) or pa.types.is_decimal(t))


def _stringlike(t: pa.DataType) -> bool:
    t = t.value_type if pa.types.is_dictionary(t) else t
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _int_and_float(a: pa.DataType, b: pa.DataType) -> bool:
    return {pa.types.is_integer(a), pa.types.is_integer(b)} == {True, False} and (
        pa.types.is_floating(a) or pa.types.is_floating(b))


def _text_columns(a: pa.Schema, b: pa.Schema) -> list[str]:
    """Columns of both schemas whose types no type holds (int64 ids in one file, strings in the
    next) but text does: those are read as strings, as mixed values in one JSONL file are.  So
    are integers in one file beside floats in another: a float64 would turn ids 1 into "1.0"
    and cannot hold 2**60."""
    names = []
    for f in a:
        if f.name not in b.names or b.field(f.name).type.equals(f.type):
            continue
        g = b.field(f.name)
        if _int_and_float(f.type, g.type):  # (Arrow would unite them as float64: ids 1 -> "1.0", 2**60 unreadable)
            names.append(f.name)
            continue
        pair = [_decoded(pa.schema([f])), _decoded(pa.schema([g]))]  # (categoricals as their values)
        try:
            pa.unify_schemas(pair, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            if _textual(f.type) and _textual(g.type):
                names.append(f.name)
    return names


def _texts(schema: pa.Schema, names) -> pa.Schema:
    """``schema`` with its ``names`` columns as text, where their type is one text holds (a struct
    stays itself, and the files' schemas then fail to unite)."""
    return pa.schema([f.with_type(pa.string()) if f.name in names and _textual(f.type) else f for f in schema])


def _unify(parts: list[Part]) -> tuple[pa.Schema, list[str]]:
    """The input's schema, and notes on columns read as text because files disagree on their type."""
    schema, text = parts[0].schema, set()
    for part in parts[1:]:
        if part.schema.equals(schema):
            continue
        text.update(_text_columns(schema, part.schema))
        schema = _texts(schema, text)
        try:
            try:
                schema = pa.unify_schemas([schema, _texts(part.schema, text)], promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                schema = pa.unify_schemas([_decoded(schema), _decoded(_texts(part.schema, text))],
                                          promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise InputError(f"{part.info.path}: schema does not match the files before it "
                             f"({parts[0].info.path}, ...): {e}") from e
    notes = []
    for c in sorted(text):
        kinds: dict[str, str] = {}  # type -> the first file holding it
        for p in parts:
            if c in p.schema.names:
                kinds.setdefault(str(p.schema.field(c).type), p.info.path)
        notes.append(f"column {c!r} is " + ", ".join(f"{t} in {path}" for t, path in kinds.items())
                     + " (the first file of each type): read as text (string) in every file")
    return schema, notes


_HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"  # (Hive's, Spark's and pyarrow's name for a null key)


def _hive_keys(path: str, root: str) -> dict[str, str | None]:
    """The ``key=value`` directories between ``root`` and a file -- a dataset written with
    partition columns (pyarrow's ``write_to_dataset(partition_cols=...)``, Spark, Hive) keeps
    them only there -- with their values URI-decoded, as pyarrow's hive partitioning reads them."""
    keys: dict[str, str | None] = {}
    for segment in Path(os.path.relpath(os.path.dirname(path), root)).parts:
        name, eq, value = segment.partition("=")
        if eq and name:
            value = urllib.parse.unquote(value)
            keys[name] = None if value == _HIVE_NULL else value
    return keys


def _partitioned(parts: list[Part], counted: list[Part], root: str | None,
                 schema: pa.Schema) -> tuple[pa.Schema, list[str]]:
    """``schema`` with the directories' partition keys as columns after the files' own, each part's
    values kept as ``part.keys``, as pyarrow's hive partitioning reads them: int32 where every value
    of the ``counted`` parts (those with rows, as for the files' own columns) is one, else string;
    for a key the files also hold as a column, the directory's value in its files (cast to the
    files' type)."""
    for part in parts:
        part.keys = _hive_keys(part.info.path, root) if root else {}
    names = list(dict.fromkeys(k for p in parts for k in p.keys))
    fields = []
    for name in (n for n in names if n not in schema.names):
        values = [p.keys.get(name) for p in counted]
        typed = pa.string()
        if any(v is not None for v in values):
            try:
                pa.array(values, pa.string()).cast(pa.int32())
                typed = pa.int32()
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                pass
        fields.append(pa.field(name, typed))
    notes = [f"partition column(s) from the directories' key=value names: {', '.join(f'{f.name} ({f.type})' for f in fields)}"
             ] if fields else []
    notes += [f"directories name a partition {n!r}, which the files hold as a column too: its files read the "
              "directory's value (as pyarrow does)" for n in names if n in schema.names]
    return pa.schema(list(schema) + fields), notes


def _text_of(col) -> pa.Array:
    """A column's values as text the way a JSONL column of mixed values is read (parts.as_text: 1.0,
    true), and as ids of one numeric type are written (id_strings: str(1.0)); Arrow's cast wrote 1.0
    as "1", a false duplicate of a string id "1"."""
    return pa.array([as_text(v) for v in col.to_pylist()], pa.string())


def _id_text(v) -> str:
    """One id value as text: booleans as JSON's (as a JSONL id reads), bytes as the UTF-8 text
    they hold (Parquet strings written without their UTF-8 annotation) or else as hex."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return v.hex()
    return str(v)


def id_strings(col) -> list[str | None]:
    """An id column as the output writes it: its values as Arrow reads them, as text (_id_text) --
    the one conversion the duplicate check (InputSource.check_ids) and the shards share."""
    ids = py_values(col)  # (invalid UTF-8 in a string column: those ids as bytes, then hex)
    return [v if v is None or isinstance(v, str) else _id_text(v) for v in ids]


class Uncastable(InputError):
    """A column's values that cannot take the type the input's files agree on (a fact about the
    values, as BadIds is: not a file that cannot be read)."""


class BadIds(InputError):
    """An id column with a null or repeated id (InputSource.check_ids): a job without --id-column
    numbers its rows instead, where a file it cannot read stops it (trial AD)."""


class InputSource:
    """A planned view of an input: row counts from file metadata, rows read by range on demand.

    Global row order is files in sorted path order, rows in file order.  Reading ranges in
    increasing order is cheap (each file keeps a forward cursor); going back restarts a cursor.
    """

    def __init__(self, source: str, parts: list[Part], schema: pa.Schema, dataset: dict | None = None,
                 notes: list[str] | tuple = ()):
        self.source, self._parts, self.schema, self._dataset = source, parts, schema, dataset
        self.notes = list(notes)  # what a reader should know about how the input is read (_unify)
        self.files = [p.info for p in parts]
        self._starts = [0, *itertools.accumulate(f.rows for f in self.files)]
        self.num_rows = self._starts[-1]
        self.column_names = list(schema.names)
        self._open: list[Part] = []  # parts holding a cursor, least recently used first
        self._ids_ok: set[str] = set()  # columns check_ids passed (it reads the whole column)

    @classmethod
    def open(cls, source: str) -> "InputSource":
        """A file, directory, glob, or `datasets` name/directory (as `read_table` accepts)."""
        target = _datasets_target(source)
        if target is not None:
            part = DatasetPart(*target)
            return cls(source, [part], part.schema, part.meta)
        parts = [_PARTS[_FORMATS[Path(f).suffix]](f) for f in _plan_files(source)]
        for part in parts:
            names = part.schema.names
            if len(set(names)) < len(names):
                dup = next(n for n in names if names.count(n) > 1)
                raise InputError(f"{part.info.path}: two columns named {dup!r}; rename one")
        # (files without rows add no columns nor types: a stray empty file turned int ids into text)
        counted = [p for p in parts if p.info.rows] or parts
        schema, notes = _unify(counted)
        schema, keyed = _partitioned(parts, counted, input_root(source), schema)
        return cls(source, parts, schema, notes=[n for p in parts for n in p.notes] + notes + keyed)

    def all_null(self, column: str) -> bool:
        """Whether every row's ``column`` is null by the files' metadata (False where any file's
        does not say: it is not read to find out)."""
        return bool(self.num_rows) and all(p.nulls.get(column) == p.info.rows for p in self._parts if p.info.rows)

    def files_without(self, column: str) -> list[str]:
        """The input's files with rows but no ``column`` (their rows would read it as null)."""
        return [p.info.path for p in self._parts
                if p.info.rows and column not in p.schema.names and column not in p.keys]

    def fingerprint(self) -> dict:
        fp = {"source": self.source, "num_rows": self.num_rows,
              "files": [{"path": f.path, "format": f.format, "size": f.size, "mtime_ns": f.mtime_ns,
                         "rows": f.rows} for f in self.files]}
        if self._dataset is not None:
            fp["dataset"] = dict(self._dataset)
        return fp

    def require(self, columns) -> None:
        """InputError naming the first of ``columns`` the input lacks (or saying it holds none: empty)."""
        for c in columns:
            if c not in self.column_names:
                raise InputError(f"{self.source}: no column {c!r} " + (
                    f"(columns: {', '.join(self.column_names)})" if self.column_names else
                    "(it has no columns: an empty file?)"))

    def read(self, start: int, end: int, columns: list[str], raw: Sequence[str] = ()) -> tuple[pa.Table, dict[str, list]]:
        """Rows [start, end) with only `columns`, typed with `self.schema`; plus, per name in
        `raw`, that column's values as Python objects exactly as the file holds them."""
        columns, raw = list(columns), list(dict.fromkeys(raw))  # one column can be both id and prompt
        self.require(columns + raw)
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

    def _touch(self, part: Part) -> None:
        if part in self._open:
            self._open.remove(part)
        self._open.append(part)
        while len(self._open) > _MAX_CURSORS:
            self._open.pop(0).close()

    def _conform(self, table: pa.Table, columns: list[str], n: int, part: Part) -> pa.Table:
        """One file's rows in the input's unified schema; columns the file lacks are null."""
        arrays = []
        for c in columns:
            field = self.schema.field(c)
            if c in part.keys:  # (its directory's partition value: pyarrow's reading, over a column of the file's)
                arrays.append(self._key_column(part, c, n, field.type))
                continue
            if c not in table.column_names:  # (a column the file lacks)
                arrays.append(pa.nulls(n, field.type))
                continue
            col = table.column(c)
            if pa.types.is_string(field.type) and _textual(col.type) and not _stringlike(col.type):
                col = _text_of(col)  # (a column read as text across files: _unify)
            elif col.type != field.type:
                try:
                    col = col.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
                    raise Uncastable(f"{part.info.path}: column {c!r} cannot be read as {field.type}: {e}") from e
            arrays.append(col)
        return pa.Table.from_arrays(arrays, schema=pa.schema([self.schema.field(c) for c in columns]))

    @staticmethod
    def _key_column(part: Part, column: str, n: int, type_: pa.DataType) -> pa.Array:
        value = part.keys[column]
        try:
            return pa.array([value] * n, pa.string()).cast(type_)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise Uncastable(f"{part.info.path}: its directory's {column}={value} cannot be read as the input's "
                             f"{type_}: {e}") from e

    def _where(self, row: int) -> tuple[Part, str]:
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
                raise BadIds(f"{part.info.path}: id column {column!r} is null at {where}")
            yield s, ids, np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids))

    def check_ids(self, column: str, chunk: int = 65536) -> None:
        """Null ids and duplicate ids (compared as str) raise InputError; a column that passed is
        not read again -- in this process, nor (a marker in the cache directory, keyed by every
        file's digest) by a later run, resume or dry run of the same unchanged files: the check reads
        the whole column, ~6.5 s per million JSONL rows each time."""
        if column in self._ids_ok:
            return
        self.require([column])
        marker = self._ids_marker(column)
        if marker is None or not marker.exists():
            self._check_ids(column, chunk)
            try:
                if marker is not None:
                    marker.parent.mkdir(parents=True, exist_ok=True)
                    marker.touch()
            except OSError:
                pass  # an unwritable cache: checked again next time
        self._ids_ok.add(column)

    def _ids_marker(self, column: str) -> Path | None:
        """The cache file saying ``column`` of these very files passed check_ids (None: a `datasets`
        input, or files that cannot be read)."""
        from .kbuild import cache_dir

        if self._dataset is not None or not self._parts:
            return None
        try:
            digests = [file_digest(p.info) for p in self._parts]
        except OSError:
            return None
        key = hashlib.sha256(json.dumps([IDS_CHECK_VERSION, column, str(self.schema.field(column).type),
                                         digests]).encode()).hexdigest()[:24]
        return cache_dir() / "id-checks" / key

    def _check_ids(self, column: str, chunk: int) -> None:
        """Memory is 8 bytes per row (a hash), not a set of id strings: repeated hashes are found by
        sorting, and a second pass confirms only the ids behind them."""
        self.require([column])
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
            raise BadIds(f"{self.source}: duplicate ids in {column!r} ({len(repeated)} ids repeat): "
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
