"""Input readers: Parquet file/dir/glob, Arrow IPC (file and stream), JSONL, datasets directories."""
import json

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from dynatree.data import InputError, read_table, read_texts


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


def test_datasets_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["u", "v"]}).save_to_disk(str(tmp_path / "ds"))
    assert read_texts(str(tmp_path / "ds")) == ["u", "v"]


def test_errors(tmp_path):
    with pytest.raises(InputError, match="no input files"):
        read_table(str(tmp_path / "*.parquet"))
    (tmp_path / "bad.jsonl").write_text("{not json")
    with pytest.raises(InputError, match="cannot read"):
        read_table(str(tmp_path / "bad.jsonl"))
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(InputError, match="no column 'text'"):
        read_texts(str(tmp_path / "t.parquet"))
