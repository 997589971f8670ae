"""A seconds-long training run produces directories that load and generate with every decoder."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from dynatree import generate, load_pair
from dynatree.cli import main

DOCS = ["It was a dark and stormy night; the rain fell in torrents, except at occasional intervals. " * 4,
        "The old man and the sea were both grey, and the boat drifted slowly toward the shore. " * 4,
        "She opened the letter, read it twice, and then laid it down upon the table without a word. " * 4]


def test_train_pair_tiny(tmp_path):
    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"body": DOCS * 20}), corpus)
    out = tmp_path / "pair"
    res = CliRunner().invoke(main, [
        "train-pair", "--corpus", str(corpus), "--column", "body", "--out", str(out),
        "--vocab-size", "300", "--target-shape", "1,32,2", "--draft-shape", "1,16,2",
        "--seq-len", "32", "--batch-size", "4", "--context", "128",
        "--target-minutes", "0.05", "--draft-minutes", "0.03"])
    assert res.exit_code == 0, res.output
    card = json.loads((out / "card.json").read_text())
    assert card["target"]["steps"] > 0 and card["draft"]["steps"] > 0
    assert card["target"]["heldout_loss"] > 0 and 0 <= card["draft"]["heldout_top1_agreement_with_target"] <= 1
    pair = load_pair(out / "target", out / "draft", device="cpu")
    ref = generate(pair, "It was a dark", "ar", max_new_tokens=8, ignore_eos=True)
    for method in ("linear", "fixed_tree", "dynatree", "dyspec"):
        assert generate(pair, "It was a dark", method, max_new_tokens=8, ignore_eos=True).token_ids == ref.token_ids


def test_train_pair_missing_column(tmp_path):
    corpus = tmp_path / "c.parquet"
    pq.write_table(pa.table({"x": ["a"]}), corpus)
    res = CliRunner().invoke(main, ["train-pair", "--corpus", str(corpus), "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and "no column 'text'" in res.output
