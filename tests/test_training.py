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
    modes = {f.name: f.stat().st_mode & 0o777 for f in (out / "target").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"]  # (readable by whoever may read the pair)
    before = (out / "target" / "model.safetensors").read_bytes()
    again = CliRunner().invoke(main, ["train-pair", "--corpus", str(corpus), "--column", "body", "--out", str(out)])
    assert again.exit_code != 0 and "is not empty (a trained pair?)" in again.output and "--overwrite" in again.output
    assert (out / "target" / "model.safetensors").read_bytes() == before


def test_train_pair_missing_column(tmp_path):
    corpus = tmp_path / "c.parquet"
    pq.write_table(pa.table({"x": ["a"]}), corpus)
    res = CliRunner().invoke(main, ["train-pair", "--corpus", str(corpus), "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and "no column 'text'" in res.output


def test_heldout_split_is_a_share_of_the_characters_never_the_training_text():
    from dynatree.training import split_heldout
    assert split_heldout(["abcdefghij"], 0.3) == (["abc"], ["defghij"])  # one document: cut, not shared
    assert split_heldout(["ab", "cdefgh", "ij"], 0.3) == (["ab", "c"], ["defgh", "ij"])
    assert split_heldout(["abc", "defghij"], 0.3) == (["abc"], ["defghij"])


def test_bad_training_settings_fail_before_any_work(tmp_path):
    import pytest
    from dynatree.training import TrainConfig
    for bad, match in (({"batch_size": 0}, "batch_size must be at least 1"),
                       ({"seq_len": 2000}, "seq_len 2000 is longer than the models' context 1024"),
                       ({"vocab_size": 10}, "vocab_size 10: a byte-level BPE needs at least"),
                       ({"target_minutes": 0}, "must be positive"), ({"draft_minutes": -1}, "must be positive"),
                       ({"lr": -1.0}, "lr must be positive")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**bad)
    res = CliRunner().invoke(main, ["train-pair", "--corpus", str(tmp_path / "none.parquet"), "--out",
                                    str(tmp_path / "o"), "--batch-size", "0"])
    assert res.exit_code != 0 and "batch_size must be at least 1" in res.output
    res = CliRunner().invoke(main, ["train-pair", "--corpus", str(tmp_path / "none.parquet"), "--out",
                                    str(tmp_path / "o"), "--target-shape", "2,64,0"])
    assert res.exit_code != 0 and "hidden divisible by heads" in res.output and res.exception.__class__ is SystemExit


def test_a_heldout_text_shorter_than_one_window_is_scored_on_a_shorter_one(tmp_path):
    """Six short documents, 1% held out (~20 characters, fewer tokens than --seq-len): the run
    used to train to the end and then crash scoring it, saving nothing."""
    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": DOCS * 2}), corpus)
    out = tmp_path / "pair"
    res = CliRunner().invoke(main, [
        "train-pair", "--corpus", str(corpus), "--out", str(out), "--vocab-size", "300",
        "--target-shape", "1,32,2", "--draft-shape", "1,16,2", "--seq-len", "32", "--batch-size", "2",
        "--context", "128", "--target-minutes", "0.01", "--draft-minutes", "0.01"])
    assert res.exit_code == 0, res.output
    card = json.loads((out / "card.json").read_text())
    assert 0 < card["heldout_tokens"] < 33 and card["target"]["heldout_loss"] > 0
    assert 0 <= card["draft"]["heldout_top1_agreement_with_target"] <= 1
