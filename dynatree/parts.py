"""One input file each (Parquet, Arrow IPC, plain text; JSONL in jsonl.py): its row count from
file metadata, rows by range through a forward cursor.  data.InputSource joins them into a job's
input."""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq


class InputError(ValueError):
    """The input cannot be read, or lacks the requested column."""


BATCH_ROWS = 1024  # rows decoded per step; bounds what a cursor holds between reads
CONVERT_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)
# a lone surrogate code point: what a JSON "\ud800" escape without its pair reads as -- not Unicode
# text (no UTF-8 encoding, no tokenizer reads it)
SURROGATE = re.compile("[\ud800-\udfff]")


def each_repeated(table: pa.Table, n: int) -> pa.Table:
    """Every row of ``table`` n times in a row (a prompt's columns beside each of its n samples)."""
    return table if n == 1 else table.take(pa.array([i for i in range(table.num_rows) for _ in range(n)], pa.int64()))


def py_values(col) -> list:
    """A column's values as Python objects.  A string column holding invalid UTF-8 (Parquet writers
    that do not check it) gives those values as bytes -- each prompt's own error, as in a binary
    column -- where converting the column whole failed the job."""
    try:
        return col.to_pylist()
    except UnicodeDecodeError:
        big = pa.types.is_large_string(col.type)
        return [v if v is None else _utf8_or_bytes(v)
                for v in col.cast(pa.large_binary() if big else pa.binary()).to_pylist()]


def _utf8_or_bytes(b: bytes):
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return b


def as_text(v):
    """A value read into a text column: a string as itself, anything else as its JSON text (1.0,
    true, [1, 2]) -- how a JSONL column of mixed values and a column whose files disagree on its
    type (data.py) are both read; str() where JSON has no form (a Decimal)."""
    if v is None or isinstance(v, str):
        return v
    try:
        return json.dumps(v)
    except TypeError:
        return str(v)


@dataclass(frozen=True)
class InputFile:
    path: str          # absolute (for a hub dataset: its name)
    format: str        # "parquet" | "arrow" | "jsonl" | "txt" | "datasets"
    rows: int
    size: int          # bytes (0 for datasets)
    mtime_ns: int      # (0 for datasets)


def file_digest(info: InputFile, *extra) -> str:
    """A key for what is known about an unchanged file (jsonl's inferred schema, an id column's
    check): its path, size, mtime and rows, and its first and last 64 KiB (a rewrite within one
    mtime tick, at the same size, still changes the key where it changes either end), plus ``extra``."""
    key = [os.path.abspath(info.path), info.size, info.mtime_ns, info.rows, pa.__version__, *extra]
    h = hashlib.sha256(json.dumps(key).encode())
    with open(info.path, "rb") as f:
        h.update(f.read(1 << 16))
        f.seek(max(info.size - (1 << 16), 0))
        h.update(f.read(1 << 16))
    return h.hexdigest()[:24]


class Part:
    """One input file.  Sequential range reads advance a forward cursor instead of re-decoding
    from the file start; between reads the cursor holds at most one undelivered batch."""

    def __init__(self, info: InputFile, schema: pa.Schema):
        self.info, self.schema = info, schema.remove_metadata()
        self.notes: list[str] = []  # how the file is read, for the job's plan (values read as text)
        self.nulls: dict[str, int] = {}  # top-level columns' null counts where the file's metadata says them
        self.keys: dict = {}  # its directories' partition values (data._partitioned)
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
        return table, {c: py_values(table.column(c)) for c in raw if c in columns}

    def read(self, lo: int, hi: int, need: list[str], raw: Sequence[str]) -> tuple[pa.Table, dict]:
        """Rows [lo, hi) of this file in its own types; `raw` values as Python objects."""
        cols = [c for c in need if c in self.schema.names]
        if not cols or lo >= hi:
            return pa.table({}), {}
        self.refuse_if_changed()
        try:
            return self.convert(self._take(lo, hi, cols), cols, raw)
        except InputError:
            raise
        except (OSError, pa.ArrowException) as e:  # (pyarrow's own words name no file: "Couldn't deserialize thrift")
            self.close()
            raise InputError(f"{self.info.path}: cannot read rows {lo}-{hi - 1}: {e}"
                             + (f"; {self._change()}" if self._change() else "")) from e

    def refuse_if_changed(self) -> None:
        """InputError if the file is not the one planned: rewritten in place, a Parquet file's rows
        at the planned offsets read as the new file's without an error (the corpus trial's worry,
        seen here); one stat per read."""
        change = self._change()
        if change:
            self.close()
            raise InputError(f"{self.info.path}: {change}, so its rows are not the planned ones and the job cannot "
                             "resume on it: finished shards are kept; --overwrite starts again on the input as it is now")

    def _change(self) -> str | None:
        """How the file differs from the planned one (gone, or its size or time), or None; a
        `datasets` dataset (no file of its own: size and time 0) never does."""
        if not self.info.size and not self.info.mtime_ns:
            return None
        try:
            st = os.stat(self.info.path)
        except OSError:
            return "gone since the job was planned"
        if (st.st_size, st.st_mtime_ns) != (self.info.size, self.info.mtime_ns):
            return "changed since the job was planned (its size or time differ)"
        return None

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


def stat(path: str, fmt: str, rows: int) -> InputFile:
    st = os.stat(path)
    return InputFile(path, fmt, rows, st.st_size, st.st_mtime_ns)


class ParquetPart(Part):
    def __init__(self, path: str):
        try:
            pf = pq.ParquetFile(path)
            meta, schema = pf.metadata, pf.schema_arrow
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"cannot read {path}: {e}") from e
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self._starts = [0, *itertools.accumulate(sizes)][:-1]
        super().__init__(stat(path, "parquet", meta.num_rows), schema)
        self.nulls = _null_counts(meta)

    def anchor(self, row: int) -> int:
        return self._starts[bisect.bisect_right(self._starts, row) - 1] if self._starts else 0

    def batches(self, row: int, columns: list[str]):
        # Without pre_buffer and with a read buffer, a column chunk is streamed page by page:
        # pyarrow's default reads a whole column chunk, which for a 1Mi-row group is the file.
        pf = pq.ParquetFile(self.info.path, pre_buffer=False, buffer_size=1 << 20)
        group = bisect.bisect_right(self._starts, row) - 1
        return pf.iter_batches(batch_size=BATCH_ROWS, columns=columns,
                               row_groups=range(group, len(self._starts)), use_threads=False)


def _null_counts(meta) -> dict[str, int]:
    """Each flat top-level column's nulls from the row groups' statistics (where every group has
    them): a prompt column null in every row is refused when planned (trial AI)."""
    out = {}
    for j in range(meta.num_columns):
        path = meta.schema.column(j).path
        if "." in path:
            continue
        stats = [meta.row_group(i).column(j).statistics for i in range(meta.num_row_groups)]
        if all(st is not None and st.has_null_count for st in stats):
            out[path] = sum(st.null_count for st in stats)
    return out


class ArrowPart(Part):
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
        super().__init__(stat(path, "arrow", sum(sizes)), schema)

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


def file_text(text: str) -> str:
    """A file's text as a prompt: without a UTF-8 byte-order mark or the line end its last line
    carries (one, as editors and a shell's echo add) -- a .txt input's and generate's stdin alike."""
    text = text.removeprefix("\ufeff")
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


class TextPart(Part):
    """A plain-text file is one row: ``text`` (its contents, as ``dynatree generate`` reads a
    file from stdin: without a UTF-8 byte-order mark or the line end of its last line) and
    ``file`` (its path, so output rows can be traced back to their files).  A file that is not
    UTF-8 is that row's problem, not the job's: its raw value is the bytes (the worker's per-row
    error), its text null."""

    def __init__(self, path: str):
        super().__init__(stat(path, "txt", 1), pa.schema([("text", pa.string()), ("file", pa.string())]))

    def read(self, lo, hi, need, raw):
        cols = [c for c in need if c in self.schema.names]
        if not cols or lo >= hi:
            return pa.table({}), {}
        values, raws = {"file": [self.info.path]}, {"file": [self.info.path]}
        self.refuse_if_changed()  # (the text a job planned: Part.read's check, which this read replaces)
        if "text" in cols:
            try:
                data = Path(self.info.path).read_bytes()
            except OSError as e:
                raise InputError(f"cannot read {self.info.path}: {e}") from e
            try:
                values["text"] = raws["text"] = [file_text(data.decode("utf-8"))]
            except UnicodeDecodeError:
                values["text"], raws["text"] = [None], [data]
        return pa.table({c: values[c] for c in cols}), {c: raws[c] for c in raw if c in cols}
