"""Input readers: Parquet file/dir/glob, Arrow IPC (file and stream), JSONL, datasets directories."""
import json
import re
import os

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from dynatree import data, jsonl, parts
from dynatree.data import InputError, InputSource, read_table, read_texts


def test_parquet_file_dir_and_glob(tmp_path):
    d = tmp_path / "parts"
    d.mkdir()
    pq.write_table(pa.table({"text": ["a", "b"]}), d / "p0.parquet")
    pq.write_table(pa.table({"text": ["c"]}), d / "p1.parquet")
    assert read_texts(str(d / "p0.parquet")) == ["a", "b"]
    assert read_texts(str(d)) == ["a", "b", "c"]
    assert read_texts(str(d / "p*.parquet")) == ["a", "b", "c"]


def test_arrow_file_and_stream_and_jsonl(tmp_path):
    t = pa.table({"text": ["x", "y"], "n": [1, 2]})
    with ipc.new_file(tmp_path / "f.arrow", t.schema) as w:
        w.write_table(t)
    with ipc.new_stream(tmp_path / "s.arrow", t.schema) as w:
        w.write_table(t)
    assert read_texts(str(tmp_path / "f.arrow")) == ["x", "y"]
    assert read_texts(str(tmp_path / "s.arrow")) == ["x", "y"]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps({"text": s}) for s in "pq") + "\n\n")
    assert read_texts(str(tmp_path / "r.jsonl")) == ["p", "q"]
    # values as the file holds them: a number is not a prompt (check and bench skip it; run: a row error)
    (tmp_path / "m.jsonl").write_text('{"text": 5}\n{"text": "a prompt"}\n{"text": null}\n')
    assert read_texts(str(tmp_path / "m.jsonl")) == [5, "a prompt", None]


def test_datasets_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["u", "v"]}).save_to_disk(str(tmp_path / "ds"))
    assert read_texts(str(tmp_path / "ds")) == ["u", "v"]
    src = InputSource.open(str(tmp_path / "ds"))
    assert src.num_rows == 2 and src.files[0].format == "datasets"
    assert src.read(1, 2, ["text"], raw=["text"])[1] == {"text": ["v"]}
    assert src.fingerprint()["dataset"]["fingerprint"]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b", "c"]}),
                               "test": datasets.Dataset.from_dict({"text": ["t"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert read_texts(f"{tmp_path / 'dd'}:train") == ["a", "b", "c"] and read_texts(f"{tmp_path / 'dd'}:test") == ["t"]
    with pytest.raises(InputError, match="holds splits train, test: name one"):  # it took test without a word
        read_texts(str(tmp_path / "dd"))
    with pytest.raises(InputError, match="has no split 'dev'"):
        read_texts(f"{tmp_path / 'dd'}:dev")


def test_errors(tmp_path):
    with pytest.raises(InputError, match="no input files"):
        read_table(str(tmp_path / "*.parquet"))
    (tmp_path / "bad.jsonl").write_text("{not json")
    with pytest.raises(InputError, match="cannot read"):
        read_table(str(tmp_path / "bad.jsonl"))
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(InputError, match="no column 'text'"):
        read_texts(str(tmp_path / "t.parquet"))


# --- InputSource: planned, streaming reads -------------------------------------------------

def _shards(src, size, columns, raw=()):
    return [src.read(s, s + size, columns, raw) for s in range(0, src.num_rows, size)]


@pytest.mark.parametrize("row_group_size", [7, None])  # several groups; one group (pyarrow's default)
def test_parquet_sequential_shards_match_read_table(tmp_path, monkeypatch, row_group_size):
    monkeypatch.setattr(parts, "BATCH_ROWS", 5)  # shards straddle decoded batches
    t = pa.table({"key": [f"k{i}" for i in range(50)], "text": [f"t{i}" * (i % 4) for i in range(50)],
                  "n": list(range(50))})
    pq.write_table(t, tmp_path / "a.parquet", row_group_size=row_group_size)
    src = InputSource.open(str(tmp_path / "a.parquet"))
    assert src.num_rows == 50 and src.column_names == ["key", "text", "n"]
    assert src.files[0].format == "parquet" and os.path.isabs(src.files[0].path)
    whole = pq.read_table(tmp_path / "a.parquet")  # pyarrow itself: an oracle independent of the reader
    starts = []
    batches = parts.ParquetPart.batches
    monkeypatch.setattr(parts.ParquetPart, "batches", lambda self, row, cols: starts.append(row) or batches(self, row, cols))
    for k, (part, raw) in enumerate(_shards(src, 8, ["key", "text"], raw=["text"])):
        assert part.equals(whole.slice(8 * k, 8).select(["key", "text"]))
        assert raw["text"] == whole.column("text").to_pylist()[8 * k:8 * k + 8]
    assert starts == [0]  # one streaming pass, never re-decoding earlier rows
    back, _ = src.read(3, 12, ["n"])  # a retry going backwards, then forwards again
    assert back.column("n").to_pylist() == list(range(3, 12))
    assert starts == [0, 0]
    assert src.read(30, 33, ["n"])[0].column("n").to_pylist() == [30, 31, 32]
    assert starts[-1] == (28 if row_group_size else 0)  # a jump restarts at its row group
    assert src.read(40, 60, ["n"])[0].column("n").to_pylist() == list(range(40, 50))
    assert src.read(50, 60, ["n"])[0].num_rows == 0
    with pytest.raises(InputError, match=r"no column 'body' \(columns: key, text, n\)"):
        src.read(0, 1, ["body"])


def test_directory_and_glob_order_and_schema_unification(tmp_path):
    d = tmp_path / "parts"
    (d / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["c"], "n": pa.array([3], pa.int32())}), d / "p1.parquet")
    pq.write_table(pa.table({"text": ["a", "b"], "n": [1, 2]}), d / "p0.parquet")
    pq.write_table(pa.table({"text": ["d"]}), d / "sub" / "p2.parquet")
    src = InputSource.open(str(d))
    assert [os.path.basename(f.path) for f in src.files] == ["p0.parquet", "p1.parquet", "p2.parquet"]
    assert src.schema.field("n").type == pa.int64()
    table, _ = src.read(1, 4, ["text", "n"])
    assert table.to_pylist() == [{"text": "b", "n": 2}, {"text": "c", "n": 3}, {"text": "d", "n": None}]
    glob_src = InputSource.open(str(d / "p*.parquet"))
    assert glob_src.read(0, 10, ["text"])[0].column("text").to_pylist() == ["a", "b", "c"]
    # types no type holds both of: text, as in one JSONL file (ids from two sources, int and string)
    pq.write_table(pa.table({"text": [1], "n": ["x"]}), d / "p3.parquet")
    mixed = InputSource.open(str(d / "p*.parquet"))
    assert mixed.schema.field("text").type == mixed.schema.field("n").type == pa.string()
    assert len(mixed.notes) == 2 and all("p3.parquet" in n and "read as text" in n for n in mixed.notes)
    table, raw = mixed.read(1, 4, ["text", "n"], raw=["text"])
    assert table.to_pylist() == [{"text": "b", "n": "2"}, {"text": "c", "n": "3"}, {"text": "1", "n": "x"}]
    assert raw["text"] == ["b", "c", 1]  # a job's prompt as the file holds it: not text, a per-row error
    assert not InputSource.open(str(d / "p0.parquet")).notes
    pq.write_table(pa.table({"text": ["e"], "n": [{"k": 1}]}), d / "p4.parquet")  # no text for a struct
    with pytest.raises(InputError, match="p4.parquet.*Field n"):
        InputSource.open(str(d / "p*.parquet"))


def test_hive_partition_directories_are_read_as_columns_as_pyarrow_reads_them(tmp_path):
    """A dataset written with partition columns keeps them only in its directories' key=value
    names: they were dropped without a word (a data engineer's trial)."""
    h = tmp_path / "h"
    t = pa.table({"id": [f"r{i}" for i in range(5)], "text": list("abcde"),
                  "lang": ["en", "fr/x", None, "en", "de"], "year": [2020, 2021, 2020, 2021, 2021]})
    pq.write_to_dataset(t, h, partition_cols=["lang", "year"])
    want = ds.dataset(h, partitioning="hive").to_table()
    for source in (h, h / "*" / "*" / "*.parquet"):
        src = InputSource.open(str(source))
        assert src.schema == want.schema  # (lang string, year int32, after the files' columns)
        rows = src.read(0, src.num_rows, src.column_names)[0].to_pylist()
        assert sorted(rows, key=lambda r: r["id"]) == sorted(want.to_pylist(), key=lambda r: r["id"])
        assert any("lang (string), year (int32)" in n for n in src.notes)
    assert "lang" not in InputSource.open(str(next(h.glob("lang=en/*/*.parquet")))).column_names  # (one file)
    pq.write_table(pa.table({"id": ["z"], "text": ["f"], "year": ["old"]}), h / "lang=en" / "year=2020" / "x.parquet")
    src = InputSource.open(str(h))  # a file's own column of a key's name: its type, the directories' values
    assert src.schema.field("year").type == pa.string() and any("'year'" in n for n in src.notes)
    rows = src.read(0, src.num_rows, ["id", "lang", "year"])[0].to_pylist()
    assert {"id": "z", "lang": "en", "year": "2020"} in rows and {"id": "r0", "lang": "en", "year": "2020"} in rows
    e = tmp_path / "e"  # a file without rows does not type a key (as for columns); a key only ever null: text
    for where, rows in (("k=1/n=__HIVE_DEFAULT_PARTITION__", ["a"]), ("k=x/n=__HIVE_DEFAULT_PARTITION__", [])):
        (e / where).mkdir(parents=True)
        pq.write_table(pa.table({"text": pa.array(rows, pa.string())}), e / where / "p.parquet")
    src = InputSource.open(str(e))
    assert src.schema == pa.schema([("text", pa.string()), ("k", pa.int32()), ("n", pa.string())])
    assert src.read(0, 1, ["k", "n"])[0].to_pylist() == [{"k": 1, "n": None}]


def test_a_file_without_rows_does_not_shape_the_inputs_columns(tmp_path):
    """An empty file in a directory added its columns (all null) to every row and turned the
    others' int ids into text (a data engineer's trial)."""
    pq.write_table(pa.table({"id": [1, 2], "text": ["a", "b"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "zzz": pa.array([], pa.float32())}),
                   tmp_path / "c.parquet")
    src = InputSource.open(str(tmp_path))
    assert src.schema == pa.schema([("id", pa.int64()), ("text", pa.string())]) and not src.notes
    assert src.read(0, 2, ["id", "text"])[0].to_pylist() == [{"id": 1, "text": "a"}, {"id": 2, "text": "b"}]
    (tmp_path / "a.parquet").unlink()  # every file empty: their columns, as before
    assert InputSource.open(str(tmp_path)).column_names == ["id", "zzz"]


def test_arrow_file_and_stream_formats(tmp_path):
    t = pa.table({"text": [f"x{i}" for i in range(10)], "n": list(range(10))})
    with ipc.new_file(tmp_path / "f.arrow", t.schema) as w:
        for b in t.to_batches(max_chunksize=3):
            w.write_batch(b)
    with ipc.new_stream(tmp_path / "s.arrow", t.schema) as w:
        for b in t.to_batches(max_chunksize=4):
            w.write_batch(b)
    for name in ("f.arrow", "s.arrow"):
        src = InputSource.open(str(tmp_path / name))
        assert src.num_rows == 10 and src.files[0].format == "arrow"
        got = [src.read(s, s + 3, ["text"])[0].column("text").to_pylist() for s in range(0, 10, 3)]
        assert sum(got, []) == t.column("text").to_pylist()
        assert src.read(2, 5, ["n"])[0].column("n").to_pylist() == [2, 3, 4]


def _jsonl(path, rows, blank_every=0):
    lines = []
    for i, r in enumerate(rows):
        lines.append(r if isinstance(r, str) else json.dumps(r))
        if blank_every and i % blank_every == 0:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n")


def test_jsonl_ranges_across_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "JSONL_CHECKPOINT_EVERY", 4)
    monkeypatch.setattr(parts, "BATCH_ROWS", 3)
    monkeypatch.setattr(jsonl, "_SCAN_BYTES", 64)  # lines straddle planning chunks
    rows = [{"id": i, "text": f"row {i}"} for i in range(37)]
    _jsonl(tmp_path / "r.jsonl", rows, blank_every=5)
    with open(tmp_path / "r.jsonl", "a") as f:
        f.write(json.dumps({"id": 37, "text": "last, no newline"}))
    rows.append({"id": 37, "text": "last, no newline"})
    starts = []
    batches = jsonl.JsonlPart.batches
    monkeypatch.setattr(jsonl.JsonlPart, "batches", lambda self, row, cols: starts.append(row) or batches(self, row, cols))
    src = InputSource.open(str(tmp_path / "r.jsonl"))
    assert src.num_rows == 38 and src.schema == pa.schema([("id", pa.int64()), ("text", pa.string())])
    assert len(src._parts[0]._marks) == 10  # a checkpoint per 4 rows, not an offset per line
    assert sum((src.read(s, s + 5, ["id", "text"])[0].to_pylist() for s in range(0, 38, 5)), []) == rows
    assert starts == [0]
    for s, e in [(9, 14), (0, 2), (33, 38), (4, 8), (21, 22)]:  # forwards, backwards, jumps
        assert src.read(s, e, ["id"])[0].column("id").to_pylist() == list(range(s, e))
    assert starts[1:] == [8, 0, 32, 4, 20]  # each restart seeks to the checkpoint at or before it


def test_jsonl_line_numbers_and_types(tmp_path, monkeypatch):
    lines = [{"text": f"t{i}", "n": i} for i in range(5)]
    _jsonl(tmp_path / "bad.jsonl", lines[:3] + ["", *lines[3:], "{not json"], blank_every=0)
    with pytest.raises(InputError, match=r"bad.jsonl: line 7: invalid JSON"):
        InputSource.open(str(tmp_path / "bad.jsonl"))
    with pytest.raises(InputError, match="line 7"):
        read_table(str(tmp_path / "bad.jsonl"))
    (tmp_path / "tab.jsonl").write_text('{"text": "a\tb"}\n')  # json's own message ends in "at"
    with pytest.raises(InputError, match=r"line 1: invalid JSON \(Invalid control character at column 12\)$"):
        InputSource.open(str(tmp_path / "tab.jsonl"))
    monkeypatch.setattr(jsonl, "JSONL_INFER_ROWS", 2)  # types inferred 2 rows at a time, then united
    with pytest.raises(InputError, match="line 7"):  # every line is read when the job is planned
        InputSource.open(str(tmp_path / "bad.jsonl"))
    late = [{"n": 1, "m": {"a": 1}}, {"n": 2}, {"n": 3}, {"n": 1.5, "m": {"a": 2, "b": "x"}}, {"k": "late"}]
    _jsonl(tmp_path / "late.jsonl", late)
    src = InputSource.open(str(tmp_path / "late.jsonl"))  # keys, struct fields and wider types seen late count
    assert src.schema == pa.schema([("n", pa.float64()), ("m", pa.struct([("a", pa.int64()), ("b", pa.string())])),
                                    ("k", pa.string())])
    assert src.read(0, 5, ["n", "m", "k"])[0].to_pylist()[3:] == [{"n": 1.5, "m": {"a": 2, "b": "x"}, "k": None},
                                                                   {"n": None, "m": None, "k": "late"}]
    _jsonl(tmp_path / "mixed.jsonl", [{"n": 1, "s": "a"}, {"n": 2, "s": None}, {"n": "three", "s": "c"}])
    for _ in range(2):  # inferred, then from the cache: the plan says so (they became text without a word)
        src = InputSource.open(str(tmp_path / "mixed.jsonl"))
        assert src.read(0, 3, ["n"])[0].column("n").to_pylist() == ["1", "2", "three"]
        assert len(src.notes) == 1 and "column 'n' holds values of several types" in src.notes[0]
    assert not InputSource.open(str(tmp_path / "late.jsonl")).notes  # ints widened to floats: no note ("s": none)
    for first, then in (([2**60, 7], [1.5, None]), ([1.5, None], [7, 2**60]),  # pyarrow casts no int past 2**53
                        ([{"a": 2**60}, None], [{"a": 1.5}, None]), ([[1.5]], [[2**60]])):  # nested too
        _jsonl(tmp_path / "big.jsonl", [{"n": v} for v in first + then])  # chunks of 2: int64 and double
        src = InputSource.open(str(tmp_path / "big.jsonl"))  # was double: reading 2**60 then failed the job
        got = src.read(0, len(first + then), ["n"])[0].column("n").to_pylist()
        assert got == [parts.as_text(v) for v in first + then]
        assert len(src.notes) == 1 and "column 'n'" in src.notes[0]
    _jsonl(tmp_path / "big.jsonl", [{"n": {"id": 2**60}}, {"n": {"id": 7}}, {"n": {"score": 0.5}}])  # apart: no text
    src = InputSource.open(str(tmp_path / "big.jsonl"))
    assert src.schema.field("n").type == pa.struct([("id", pa.int64()), ("score", pa.float64())]) and not src.notes
    _jsonl(tmp_path / "mixed.jsonl", [{"n": 1}, {"n": 2}, {"n": 3}])
    src = InputSource.open(str(tmp_path / "mixed.jsonl"))
    _jsonl(tmp_path / "mixed.jsonl", [{"n": 1}, {"n": 2}, {"n": 2.5}])  # changed after planning (a job refuses it)
    with pytest.raises(InputError, match=r"mixed.jsonl: changed since the job was planned"):  # (it read 2.5 as
        src.read(0, 3, ["n"])  # an int64 column's value: "line 3: column 'n' value 2.5 does not fit type int64")


def test_jsonl_mixed_prompt_column_gives_raw_values(tmp_path):
    texts = ["a string", None, "", 42, "x", {"k": 1}]
    _jsonl(tmp_path / "m.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)] + [{"id": 6}])
    src = InputSource.open(str(tmp_path / "m.jsonl"))
    assert src.schema.field("text").type == pa.string()
    table, raw = src.read(0, 7, ["id", "text"], raw=["text"])
    assert raw["text"] == texts + [None]
    assert table.column("text").to_pylist() == ["a string", None, "", "42", "x", '{"k": 1}', None]
    _, raw = src.read(0, 7, ["text"], raw=["text", "text"])  # the prompts as their own ids: read once
    assert raw["text"] == texts + [None]


def test_mixed_format_directory_and_txt_directory(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": ["a"]}), d / f"p{i}.parquet")
    (d / "notes.txt").write_text("stray")
    with pytest.raises(InputError, match=r"parquet: p0.parquet, p1.parquet; txt: notes.txt.*mixed/\*\.parquet"):
        InputSource.open(str(d))
    assert InputSource.open(str(d / "*.parquet")).num_rows == 2
    t = tmp_path / "texts"
    t.mkdir()
    (t / "b.txt").write_text("second\nprompt\n")  # (an editor's last line end: not the prompt's)
    (t / "a.txt").write_bytes("\ufefffirst\r\n".encode())  # (a byte-order mark neither)
    src = InputSource.open(str(t))
    assert src.column_names == ["text", "file"] and [f.format for f in src.files] == ["txt", "txt"]
    assert src.read(0, 2, ["text"], raw=["text"])[1] == {"text": ["first", "second\nprompt"]}
    table = src.read(0, 2, ["file", "text"], raw=[])[0]  # rows trace back to their files
    assert table.column("file").to_pylist() == [str(t / "a.txt"), str(t / "b.txt")]
    (t / "c.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: that row's error, not the job's
    table, raw = InputSource.open(str(t)).read(0, 3, ["text"], raw=["text"])
    assert table.column("text").to_pylist() == ["first", "second\nprompt", None] and raw["text"][2] == b"caf\xe9"


def test_empty_inputs(tmp_path):
    pq.write_table(pa.table({"key": pa.array([], pa.string()), "text": pa.array([], pa.string())}),
                   tmp_path / "e.parquet")
    src = InputSource.open(str(tmp_path / "e.parquet"))
    assert src.num_rows == 0 and src.column_names == ["key", "text"]
    table, raw = src.read(0, 64, ["text"], raw=["text"])
    assert table.num_rows == 0 and table.schema.names == ["text"] and raw == {"text": []}
    src.check_ids("key")
    (tmp_path / "e.jsonl").write_text("")
    src = InputSource.open(str(tmp_path / "e.jsonl"))
    assert src.num_rows == 0 and src.column_names == []


def test_fingerprint_follows_file_contents(tmp_path):
    f = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), f)
    fp = InputSource.open(str(f)).fingerprint()
    assert json.loads(json.dumps(fp)) == fp and fp["num_rows"] == 2 and fp["source"] == str(f)
    assert InputSource.open(str(f)).fingerprint() == fp
    pq.write_table(pa.table({"text": ["a", "c"]}), f)  # same size, new contents
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert InputSource.open(str(f)).fingerprint() != fp


def test_check_ids(tmp_path, monkeypatch):
    d = tmp_path / "ids"
    d.mkdir()
    pq.write_table(pa.table({"key": ["a", "b", "c"]}), d / "p0.parquet")
    pq.write_table(pa.table({"key": ["d", "b", "e", "a"]}), d / "p1.parquet")
    src = InputSource.open(str(d))
    with pytest.raises(InputError, match=r"duplicate ids in 'key' \(2 ids repeat\): 'a', 'b'.*p0.parquet row 0 .*p1.parquet row 3"):
        src.check_ids("key", chunk=2)
    InputSource.open(str(d / "p0.parquet")).check_ids("key", chunk=2)
    with pytest.raises(InputError, match=r"no column 'id' \(columns: key\)"):
        src.check_ids("id")
    pq.write_table(pa.table({"key": [1, 2, None]}), tmp_path / "n.parquet")
    with pytest.raises(InputError, match=r"n.parquet: id column 'key' is null at row 2"):
        InputSource.open(str(tmp_path / "n.parquet")).check_ids("key")
    monkeypatch.setattr(jsonl, "JSONL_CHECKPOINT_EVERY", 2)
    _jsonl(tmp_path / "n.jsonl", [{"id": i} for i in range(5)] + [{"text": "no id"}], blank_every=2)
    with pytest.raises(InputError, match=r"n.jsonl: id column 'id' is null at line 9"):
        InputSource.open(str(tmp_path / "n.jsonl")).check_ids("id", chunk=4)
    _jsonl(tmp_path / "i.jsonl", [{"id": 1}, {"id": "1"}, {"id": 2}])  # compared as str(value)
    with pytest.raises(InputError, match="duplicate ids in 'id'.*'1'"):
        InputSource.open(str(tmp_path / "i.jsonl")).check_ids("id")


def test_shard_ids_are_the_ids_the_duplicate_check_compared(tmp_path):
    """A mixed-type JSONL id column (true and "True"): the duplicate check and the shards' ids come
    from one conversion, so two ids the check let through stay two ids in the output."""
    from dynatree.jobs.driver import _read_shard
    from dynatree.jobs.plan import make_plan
    from dynatree.jobs.spec import build_spec

    (tmp_path / "in.jsonl").write_text('{"id": true, "text": "a b"}\n{"id": "True", "text": "c d"}\n{"id": 7, "text": "e"}\n')
    spec = build_spec(None, input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"), id_column="id")
    plan = make_plan(spec, log=lambda *a: None)
    rows, _ = _read_shard(spec, plan, 0)
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == 3 and ids == plan.source.id_strings(0, 3, "id")


def test_directories_skip_what_other_readers_skip_and_bracketed_names_are_files(tmp_path):
    """A Spark-style output directory: _temporary/ copies, .ipynb_checkpoints/, _SUCCESS are not
    input (pyarrow.dataset skips them too); read, they duplicated every row."""
    d = tmp_path / "spark"
    for sub in ("", "_temporary/0", ".ipynb_checkpoints"):
        (d / sub).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": ["a", "b"]}), d / sub / "part-0.parquet")
    (d / "_SUCCESS").write_text("")
    assert read_texts(str(d)) == ["a", "b"] and read_texts(str(d / "**" / "*.parquet")) == ["a", "b"]
    assert read_texts(str(d / "_temp*" / "*" / "*.parquet")) == ["a", "b"]  # asked for by name: read
    odd = tmp_path / "prompts[2024].parquet"  # an existing file, not a pattern
    pq.write_table(pa.table({"text": ["c"]}), odd)
    assert read_texts(str(odd)) == ["c"]


def test_files_that_cannot_be_read_as_one_input_are_refused_by_name(tmp_path):
    from dynatree.jobs.plan import JobError, make_plan
    from dynatree.jobs.spec import build_spec

    dup = tmp_path / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array([1])], names=["text", "text"]), dup)
    with pytest.raises(InputError, match="dup.parquet: two columns named 'text'"):
        InputSource.open(str(dup))
    d = tmp_path / "mixed"
    d.mkdir()
    pq.write_table(pa.table({"id": ["1"], "text": ["a"]}), d / "a.parquet")
    pq.write_table(pa.table({"id": ["2"], "prompt": ["b"]}), d / "b.parquet")  # no text: every row would fail
    pq.write_table(pa.table({"other": pa.array([], pa.string())}), d / "c.parquet")  # no rows: nothing to miss
    spec = build_spec(None, input=str(d), output=str(tmp_path / "out"))
    with pytest.raises(JobError, match=r"1 file\(s\) have no --prompt-column 'text' column: .*b.parquet"):
        make_plan(spec, log=lambda *a: None)


def test_kept_columns_of_view_and_run_end_types_are_stored_plain(tmp_path):
    """Parquet stores no run-end encoded column, and a sample's rows cannot be repeated (take) from
    a string_view one: they go to the output as their plain types (the driver crashed after decoding)."""
    import pyarrow.compute as pc
    from dynatree.jobs.driver import _read_shard, _shard_table
    from dynatree.jobs.plan import make_plan
    from dynatree.jobs.spec import build_spec

    t = pa.table({"text": ["a b", "c d"], "sv": pa.array(["x", "y"], pa.string_view()),
                  "ree": pc.run_end_encode(pa.array([7, 7]))})
    with ipc.new_file(tmp_path / "in.arrow", t.schema) as w:
        w.write_table(t)
    spec = build_spec(None, input=str(tmp_path / "in.arrow"), output=str(tmp_path / "out"), samples=2,
                      options={"temperature": 1.0})
    plan = make_plan(spec, log=lambda *a: None)
    assert plan.schema.field("sv").type == pa.large_string() and plan.schema.field("ree").type == pa.int64()
    rows, kept = _read_shard(spec, plan, 0)
    from dynatree.actors.worker import result_row
    results = [result_row(r["id"], "dynatree", sample=k) for r in rows for k in range(2)]
    out = _shard_table(plan, rows, results, kept)
    assert out.column("sv").to_pylist() == ["x", "x", "y", "y"] and out.column("ree").to_pylist() == [7] * 4
    pq.write_table(out, tmp_path / "o.parquet")


def test_which_files_an_input_would_read():
    from dynatree.data import would_read

    assert would_read("/d/*.parquet", "/d/a.parquet") and not would_read("/d/*.parquet", "/d/out/shards/a.parquet")
    assert would_read("/d/**/*.parquet", "/d/out/shards/a.parquet") and would_read("/d/**/*.parquet", "/d/a.parquet")
    assert not would_read("/d/**/*.parquet", "/d/_tmp/a.parquet") and not would_read("/d/**/*.parquet", "/e/a.parquet")
    assert would_read("/d/*/*/*.json", "/d/out/x/manifest.json") and not would_read("/d/[ab].parquet", "/d/c.parquet")
    assert data.input_root("/*.jsonl") == "/" and not data._hidden("/a.jsonl", "/", "/*.jsonl")  # a glob at the root


def test_an_output_through_a_symlink_is_still_where_the_input_reads(tmp_path):
    from dynatree.data import would_read

    (tmp_path / "real" / "in").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert would_read(str(tmp_path / "link" / "in"), str(tmp_path / "real" / "in" / "out" / "manifest.json"))
    assert would_read(str(tmp_path / "real" / "in"), str(tmp_path / "link" / "in" / "out" / "manifest.json"))
    assert would_read(str(tmp_path / "link" / "**" / "*.json"), str(tmp_path / "real" / "in" / "manifest.json"))


def test_jsonl_ids_past_two_to_the_63_beside_small_ones_are_kept_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "JSONL_INFER_ROWS", 1)
    _jsonl(tmp_path / "u.jsonl", [{"n": 1}, {"n": 2**64 - 1}, {"n": -3}])
    src = InputSource.open(str(tmp_path / "u.jsonl"))
    assert src.read(0, 3, ["n"])[0].column("n").to_pylist() == ["1", str(2**64 - 1), "-3"]  # pyarrow chose int64


def test_a_categorical_column_in_one_file_and_strings_in_the_next_read_as_one(tmp_path):
    pq.write_table(pa.table({"text": pa.array(["a", "b"]).dictionary_encode()}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": pa.array(["c"], pa.large_string())}), tmp_path / "b.parquet")
    src = InputSource.open(str(tmp_path))
    assert src.schema.field("text").type == pa.large_string() and read_texts(str(tmp_path)) == ["a", "b", "c"]


def test_a_jsonl_schema_is_inferred_once_per_file_version(tmp_path, monkeypatch):
    """Inferring reads every line: a dry run, resume or re-run of the same file takes it from the
    cache; a changed file (or one rewritten to the same size) is inferred again."""
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))
    calls = []
    infer = jsonl._infer_schema
    monkeypatch.setattr(jsonl, "_infer_schema", lambda rows: calls.append(1) or infer(rows))
    path = tmp_path / "r.jsonl"
    _jsonl(path, [{"id": i, "text": f"row {i}"} for i in range(5)])
    first = InputSource.open(str(path)).schema
    assert InputSource.open(str(path)).schema == first and len(calls) == 1
    _jsonl(path, [{"id": i, "text": f"row {i}", "n": 1.5} for i in range(5)])  # a new column
    assert "n" in InputSource.open(str(path)).schema.names and len(calls) == 2
    text = path.read_text()
    stat = path.stat()
    path.write_text(text.replace('"n": 1.5', '"n": "x"'))  # same size, same mtime: the contents tell
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert InputSource.open(str(path)).schema.field("n").type == pa.string() and len(calls) == 3


def test_values_read_as_text_across_files_are_written_as_in_one_jsonl_file(tmp_path):
    """Ids of two sources (floats and bools in one file, strings in the next) read as text: their
    JSON text, as one JSONL file holding the same values is read (Arrow's cast wrote 1.0 as "1", a
    false duplicate of a string id "1"); a categorical column beside numbers too; one note per
    column, naming each type's first file."""
    d = tmp_path / "two"
    d.mkdir()
    pq.write_table(pa.table({"id": [1.0, 2.5], "flag": [True, False], "cat": [1, 2], "text": ["a", "b"]}), d / "a.parquet")
    pq.write_table(pa.table({"id": ["1", "x"], "flag": ["yes", None], "cat": pa.array(["u", "v"]).dictionary_encode(),
                             "text": ["c", "d"]}), d / "b.parquet")
    rows = [{"id": 1.0, "flag": True, "cat": 1, "text": "a"}, {"id": 2.5, "flag": False, "cat": 2, "text": "b"},
            {"id": "1", "flag": "yes", "cat": "u", "text": "c"}, {"id": "x", "flag": None, "cat": "v", "text": "d"}]
    _jsonl(tmp_path / "one.jsonl", rows)
    two, one = InputSource.open(str(d)), InputSource.open(str(tmp_path / "one.jsonl"))
    cols = ["id", "flag", "cat"]
    assert two.read(0, 4, cols)[0].to_pylist() == one.read(0, 4, cols)[0].to_pylist()
    assert two.read(0, 4, ["id"])[0].column("id").to_pylist() == ["1.0", "2.5", "1", "x"]
    two.check_ids("id")  # 1.0 and "1" are two ids
    assert [n.split(" is ")[0] for n in two.notes] == ["column 'cat'", "column 'flag'", "column 'id'"]
    assert "double in " + str(d / "a.parquet") + ", string in " + str(d / "b.parquet") in two.notes[2]
    # integers beside floats: text too (float64 turned ids 1 into "1.0" and could not read 2**60)
    pq.write_table(pa.table({"id": [1, 2**60], "text": ["a", "b"]}), tmp_path / "i.parquet")
    pq.write_table(pa.table({"id": [2.5], "text": ["c"]}), tmp_path / "j.parquet")
    both = InputSource.open(str(tmp_path / "[ij].parquet"))
    assert both.read(0, 3, ["id"])[0].column("id").to_pylist() == ["1", str(2**60), "2.5"] and len(both.notes) == 1


def test_ids_of_every_arrow_type_read_as_text_the_way_a_jsonl_id_does():
    """Booleans as JSON text (a JSONL `true` reads `true`, not Python's `True`); bytes as the UTF-8
    they hold (strings stored without their annotation) or as hex; numbers as str."""
    from dynatree.data import id_strings

    assert id_strings(pa.array([True, False, None])) == ["true", "false", None]
    assert id_strings(pa.array([b"row-7", b"\x00\xff"], pa.binary())) == ["row-7", "00ff"]
    assert id_strings(pa.array([1, 2**60 + 1])) == ["1", str(2**60 + 1)]
    assert id_strings(pa.array(["a"], pa.large_string())) == ["a"]


def test_text_that_is_not_unicode_is_its_rows_error_not_the_jobs(tmp_path):
    """Invalid UTF-8 in a Parquet *string* column (writers that do not check it) and a JSON
    "\\ud800" escape without its pair (valid JSON, not Unicode text): reading the rows gave the
    whole job one bare codec error -- after Ray started, or mid-job with every resume dying at the
    same shard.  Now each such prompt is its row's error (bytes, as in a binary column; the
    surrogate kept), ids and other columns still read."""
    from dynatree import load_pair
    from dynatree.actors.worker import prompt_ids
    from dynatree.data import id_strings

    raw = pa.array([b"good one", b"bad \xff\xfe", None, b"\xc3"], pa.binary())
    bad = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())  # a string column, unchecked
    pq.write_table(pa.table({"id": bad, "text": bad}), tmp_path / "bad.parquet")
    src = InputSource.open(str(tmp_path / "bad.parquet"))
    table, texts = src.read(0, 4, ["id"], raw=["text"])
    assert texts["text"] == ["good one", b"bad \xff\xfe", None, b"\xc3"]
    assert id_strings(table.column("id")) == ["good one", b"bad \xff\xfe".hex(), None, "c3"]
    (tmp_path / "s.jsonl").write_text('{"id": "a", "text": "fine", "k": ["x"]}\n'
                                      '{"id": "b\\ud800", "text": "lone \\ud800 here", "k": ["\\udfff"]}\n'
                                      '{"id": "c", "text": "pair \\ud83d\\ude00 ok", "k": []}\n')
    src = InputSource.open(str(tmp_path / "s.jsonl"))
    table, texts = src.read(0, 3, ["id", "text", "k"], raw=["text"])
    assert texts["text"] == ["fine", "lone \ud800 here", "pair \U0001F600 ok"]  # raw: the prompt as written
    assert table.column("id").to_pylist() == ["a", "b\ufffd", "c"]  # Arrow's copy: U+FFFD
    assert table.column("k").to_pylist() == [["x"], ["\ufffd"], []]
    (tmp_path / "key.jsonl").write_text('{"id": "a", "text": "fine", "na\\ud800me": 1}\n')  # a column's name
    with pytest.raises(InputError, match=r"key\.jsonl: the key .* holds a lone surrogate"):
        InputSource.open(str(tmp_path / "key.jsonl"))
    pair = load_pair()  # (the bundled demo pair: its tokenizer)
    for text, why in ((b"bad \xff\xfe", "not UTF-8 text"), ("lone \ud800 here", "lone surrogate")):
        with pytest.raises(ValueError, match=why):
            prompt_ids(pair, text, 8, None)
    assert prompt_ids(pair, "pair \U0001F600 ok", 8, None)


def test_an_id_check_passed_is_remembered_for_the_same_files(tmp_path, monkeypatch):
    """The id check reads the whole column (~6.5 s per million JSONL rows): a later run, resume or
    dry run of the same unchanged files trusts it; changed files are checked again."""
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"id": f"r{i}", "text": "x"}) + "\n" for i in range(50)))
    calls, real = [], InputSource._check_ids
    monkeypatch.setattr(InputSource, "_check_ids", lambda self, c, chunk: calls.append(c) or real(self, c, chunk))
    for _ in range(2):
        InputSource.open(str(f)).check_ids("id")
    assert calls == ["id"]  # the second open trusted the first's check
    f.write_text("".join(json.dumps({"id": f"r{i % 40}", "text": "x"}) + "\n" for i in range(50)))
    with pytest.raises(InputError, match="duplicate ids"):  # another file at that path: checked again
        InputSource.open(str(f)).check_ids("id")
    assert calls == ["id", "id"]


def test_input_fingerprint_follows_a_size_change_at_the_same_mtime(tmp_path):
    """A file replaced by one of another size but the same mtime (cp -p, rsync -t, a coarse clock)
    is another input: the fingerprint must change, or a resume mixes old and new rows."""
    f = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), f)
    st = os.stat(f)
    fp = InputSource.open(str(f)).fingerprint()
    pq.write_table(pa.table({"text": ["a", "b" * 500]}), f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(f).st_size != st.st_size
    assert InputSource.open(str(f)).fingerprint() != fp


def test_jsonl_rows_are_counted_wherever_a_planning_chunk_ends(tmp_path, monkeypatch):
    """Planning counts JSONL rows chunk by chunk: a row whose text ends one chunk and whose newline
    begins the next is still a row (it was dropped: the job planned, read and wrote one row fewer)."""
    monkeypatch.setattr(jsonl, "_SCAN_BYTES", 64)
    for pad in range(70):  # the first line's end at every offset around the chunk boundary
        rows = [{"text": "x" * pad}, {"text": "y"}, {"text": "z" * 50}]
        (tmp_path / f"p{pad}.jsonl").write_text("\n".join(json.dumps(r) + " " * (pad % 3) for r in rows) + "\n")
        src = InputSource.open(str(tmp_path / f"p{pad}.jsonl"))
        assert src.num_rows == 3, pad
        assert src.read(0, 3, ["text"])[0].column("text").to_pylist() == [r["text"] for r in rows], pad


def test_a_lone_surrogate_inside_a_jsonl_object_is_replaced_not_fatal(tmp_path):
    """A struct column's value holding a lone surrogate (a JSON "\\ud800" escape) reads as U+FFFD,
    as in a string or a list column -- it made planning recurse until RecursionError."""
    (tmp_path / "s.jsonl").write_text('{"id": "a", "text": "hi", "meta": {"note": "bad \\ud800 here"}}\n'
                                      '{"id": "b", "text": "yo", "meta": {"note": "fine"}}\n')
    table, _ = InputSource.open(str(tmp_path / "s.jsonl")).read(0, 2, ["meta"])
    assert table.column("meta").to_pylist() == [{"note": "bad \ufffd here"}, {"note": "fine"}]


def test_a_file_rewritten_in_place_while_read_is_refused_not_read_as_planned(tmp_path):
    """Overwritten in place mid-job (same path, same layout), a Parquet file's later row groups read
    as the new file's rows under the old plan without an error, and a damaged read said only
    pyarrow's "Couldn't deserialize thrift" (the corpus trial): a read checks the file is the
    planned one, and names it."""
    import time

    a = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 5 for i in range(4000)]}), a, row_group_size=500)
    src = InputSource.open(str(a))
    assert src.read(0, 10, ["text"])[0].num_rows == 10
    time.sleep(0.01)
    other = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": [f"other {i} " * 5 for i in range(4000)]}), other, row_group_size=500)
    with a.open("r+b") as f:  # (the same inode: what `cp` over it does)
        f.write(other.getvalue().to_pybytes())
        f.truncate()
    with pytest.raises(InputError, match=f"{re.escape(str(a))}: changed since the job was planned"):
        src.read(2000, 2010, ["text"])
    (tmp_path / "t").mkdir()  # a .txt input's own read, a time-only change, a file gone
    for name in ("x", "y"):
        (tmp_path / "t" / f"{name}.txt").write_text(f"hello {name}")
    src = InputSource.open(str(tmp_path / "t"))
    assert src.read(0, 2, ["text"])[0].column("text").to_pylist() == ["hello x", "hello y"]
    st = os.stat(tmp_path / "t" / "x.txt")
    os.utime(tmp_path / "t" / "x.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(InputError, match="x.txt: changed since the job was planned"):
        src.read(0, 1, ["text"])
    (tmp_path / "t" / "y.txt").unlink()
    with pytest.raises(InputError, match="y.txt: gone since the job was planned"):
        src.read(1, 2, ["text"])
