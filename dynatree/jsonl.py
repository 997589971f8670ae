"""JSON Lines input: rows counted and checkpointed by byte offset in one vectorised scan, the
schema inferred from every row (and cached per file version), rows parsed by range on demand."""
from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from . import parts
from .machine import replaced
from .parts import CONVERT_ERRORS, SURROGATE, InputError, InputFile, Part, as_text, file_digest, stat

JSONL_CHECKPOINT_EVERY = 4096  # rows between remembered byte offsets (10M lines -> ~2.5k offsets)
JSONL_INFER_ROWS = 10000       # rows whose types are inferred together (a JSONL file's schema: all its rows)
_SCAN_BYTES = 4 << 20          # planning reads this much at a time
_WS = np.zeros(256, dtype=bool)
_WS[[9, 10, 13, 32]] = True    # the whitespace JSON allows around a value


def _json_hint(path: str) -> str:
    return " (a .json file is read as JSON Lines, one object per line)" if path.endswith(".json") else ""


def _json_row(line: str | bytes, path: str, n: int) -> dict:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        msg = str(getattr(e, "msg", e)).removesuffix(" at")  # ("Invalid control character at" + where)
        raise InputError(f"cannot read {path}: line {n}: invalid JSON ({msg}{where})"
                         f"{_json_hint(path)}") from e
    if not isinstance(row, dict):
        raise InputError(f"cannot read {path}: line {n}: expected a JSON object, got {type(row).__name__}"
                         f"{_json_hint(path)}")
    return row


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



def _infer_type(values: list) -> pa.DataType:
    """The pyarrow type of a JSONL column's values (null when all are null); string when they mix
    types (str and int...)."""
    try:
        return pa.array(values).type
    except UnicodeEncodeError:
        return _infer_type([_unicode(v) for v in values])
    except CONVERT_ERRORS:
        return pa.string()


def _unicode(v):
    """``v`` with each lone surrogate -- a JSON ``"\\ud800"`` escape without its pair: not Unicode
    text, so Arrow cannot hold it -- as U+FFFD, nested values included.  Only the Arrow columns
    (ids, kept columns) get the replacement; a prompt's raw value keeps the surrogate and its row
    gets an error (worker.prompt_ids) rather than a silently changed prompt."""
    if isinstance(v, str):
        return SURROGATE.sub("\ufffd", v)
    if isinstance(v, list):
        return [_unicode(x) for x in v]
    if isinstance(v, dict):
        return {_unicode(k): _unicode(x) for k, x in v.items()}
    return v


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


def _holds(t: pa.DataType, kind) -> bool:
    """Whether type t is of ``kind`` (a pa.types predicate) or holds one (struct fields, list items)."""
    if kind(t):
        return True
    if pa.types.is_struct(t):
        return any(_holds(t.field(i).type, kind) for i in range(t.num_fields))
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and _holds(t.value_type, kind)


def _big(v) -> bool:
    """Whether a JSON value is or holds an integer past 2**53 (pyarrow casts none to double)."""
    if isinstance(v, dict):
        return any(map(_big, v.values()))
    if isinstance(v, list):
        return any(map(_big, v))
    return type(v) is int and abs(v) > 2**53


def _infer_schema(rows) -> pa.Schema:
    """A JSONL file's schema from every row (``rows``: its parsed rows), chunk by chunk: a key,
    a struct field or a wider type first seen at row 9M is as much the file's as one in row 1
    (inferred from the first rows alone, they were dropped without a word)."""
    types: dict[str, pa.DataType] = {}
    not_text: set[str] = set()  # columns with a value that is not a string
    big: dict[str, list] = {}  # values holding an integer past 2**53 (which pyarrow casts to no double), per column
    while chunk := list(itertools.islice(rows, JSONL_INFER_ROWS)):
        for k in dict.fromkeys(k for row in chunk for k in row):
            values = [row.get(k) for row in chunk]
            t = _infer_type(values)
            types[k] = _merge_types(types[k], t) if k in types else t
            if k not in not_text and any(v is not None and not isinstance(v, str) for v in values):
                not_text.add(k)
            if _holds(t, pa.types.is_integer) and len(big.get(k, ())) < BIG_SAMPLES:
                big.setdefault(k, []).extend(v for v in values if _big(v))
    for k, values in big.items():  # where floats from other chunks made their field a double: text, as
        try:  # pyarrow makes such a column within one chunk
            pa.array(values[:BIG_SAMPLES], type=types[k])
        except CONVERT_ERRORS:
            types[k] = pa.string()
    for k in types:  # (Arrow cannot name a column with one)
        if SURROGATE.search(k):
            raise InputError(f"the key {k!r} (a column's name) holds a lone surrogate -- a \\ud800-style escape "
                             "without its pair -- which is not Unicode text; rename it")
    # a column with no value anywhere: string, which takes any value as text
    schema = pa.schema([(k, pa.string() if pa.types.is_null(t) else t) for k, t in types.items()])
    mixed = [k for k in not_text if pa.types.is_string(types[k])]  # values of several types, read as text
    return schema.with_metadata({MIXED_KEY: json.dumps(sorted(mixed))}) if mixed else schema


BIG_SAMPLES = 4096  # values with integers past 2**53 kept per column to try against its united type
MIXED_KEY = "dynatree.mixed_as_text"  # the inferred schema's note of columns whose mixed values are read as text
SCHEMA_CACHE_VERSION = 4  # raise when _infer_schema would infer differently (pyarrow's version is in the key too)


def _cached_schema(info: InputFile, infer) -> pa.Schema:
    """A JSONL file's inferred schema, kept in the cache directory under the file's path, size,
    mtime, rows and first and last 64 KiB: inferring it reads every line (~6 s per million), and
    a dry run, a resume or a re-run reads the same unchanged file again."""
    from .kbuild import cache_dir

    path = cache_dir() / "jsonl-schemas" / f"{file_digest(info, SCHEMA_CACHE_VERSION)}.arrows"
    try:
        return ipc.read_schema(pa.py_buffer(path.read_bytes()))
    except (OSError, pa.ArrowInvalid):
        pass
    schema = infer()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced(path, path.with_suffix(f".{os.getpid()}.tmp")) as tmp:
            tmp.write_bytes(schema.serialize().to_pybytes())
    except OSError:
        pass  # an unwritable cache: inferred again next time
    return schema


def _truncates(v, t: pa.DataType) -> bool:
    # pyarrow silently truncates 1.5 into an integer column; count that as a value that does not fit
    return isinstance(v, float) and pa.types.is_integer(t) and not v.is_integer()


class JsonlPart(Part):
    def __init__(self, path: str):
        self._path = path
        try:
            rows, self._marks = _scan_jsonl(path, JSONL_CHECKPOINT_EVERY)
        except OSError as e:
            raise InputError(f"cannot read {path}: {e}") from e
        self._every = JSONL_CHECKPOINT_EVERY
        info = stat(path, "jsonl", rows)
        try:
            schema = _cached_schema(info, lambda: _infer_schema(row for _, row in self._lines(0)))
        except InputError as e:
            raise e if str(e).startswith(path) else InputError(f"{path}: {e}") from None
        super().__init__(info, schema)
        mixed = json.loads((schema.metadata or {}).get(MIXED_KEY.encode(), b"[]"))
        self.notes = [f"{path}: column {c!r} holds values of several types (numbers beside strings, lists or "
                      "objects beside text, integers past 64 bits, integers past 2**53 beside floats, ...): read as "
                      "text (string)" for c in mixed]

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
            while chunk := list(itertools.islice(lines, parts.BATCH_ROWS)):
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
        try:
            return self._typed(name, values, lines)
        except UnicodeEncodeError:  # (the fast path first: a lone surrogate is rare)
            return self._typed(name, [_unicode(v) for v in values], lines)

    def _typed(self, name: str, values: list, lines: list[int]) -> pa.Array:
        t = self.schema.field(name).type
        if pa.types.is_string(t):
            # A string column takes any value: non-strings as their JSON text, so a mixed
            # prompt column still reads and the caller can reject single rows.
            return pa.array([as_text(v) for v in values], t)
        try:
            if not any(_truncates(v, t) for v in values):
                return pa.array(values, t)
        except CONVERT_ERRORS:
            pass
        for v, n in zip(values, lines):  # the slow path only runs to name the offending line
            try:
                if _truncates(v, t):
                    raise pa.ArrowInvalid(v)
                pa.array([v], t)
            except CONVERT_ERRORS:
                raise InputError(f"{self.info.path}: line {n}: column {name!r} value {v!r:.80} "
                                 f"does not fit type {t} (inferred from the file when the job was planned)") from None
        raise InputError(f"{self.info.path}: lines {lines[0]}-{lines[-1]}: column {name!r} does not fit type {t}")

    def locate(self, row: int) -> str:
        base = self.anchor(row)
        for i, (n, _) in enumerate(self._lines(base)):
            if base + i == row:
                return f"line {n}"
        return f"row {row}"
