"""Loading pairs from directories, pair checks, the Python API and the CLI."""
import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dynatree import ContextError, PairError, bench, decode, generate, load_pair, make_config, pair_from_models
from dynatree.cli import main

from conftest import hf_cache, random_prompts, tiny_neox

def test_load_pair_from_directories_and_generate(pair_dirs):
    pair = load_pair(pair_dirs / "target", pair_dirs / "draft", device="cpu", dtype="float64")
    assert pair.dtype == torch.float64 and pair.vocab == len(pair.tokenizer)
    ref = generate(pair, "The quick brown", "ar", max_new_tokens=12, ignore_eos=True)
    for method in ("linear", "fixed_tree", "dynatree", "dyspec"):
        g = generate(pair, "The quick brown", method, max_new_tokens=12, ignore_eos=True)
        assert g.token_ids == ref.token_ids and g.text == ref.text
        assert g.metrics.new_tokens == 12 and g.metrics.tokens_per_s > 0


def test_the_generation_configs_eos_ids_are_read_from_disk(pair_dirs, tmp_path):
    """A chat model's end of turn, listed in generation_config.json only, ends generations."""
    import json
    import shutil
    shutil.copytree(pair_dirs / "target", tmp_path / "t")
    eos = load_pair(tmp_path / "t", None, device="cpu").eos_token_id
    (tmp_path / "t" / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 42]}))
    pair = load_pair(tmp_path / "t", None, device="cpu")
    assert pair.eos_token_ids == (eos, 42) and pair.eos_token_id == eos


@pytest.mark.parametrize("kernel", ["lean", "hf"])  # dynatree's checkpoint reader, transformers'
def test_a_corrupt_or_truncated_weights_file_is_a_clear_error(pair_dirs, tmp_path, kernel):
    import shutil
    shutil.copytree(pair_dirs / "target", tmp_path / "t")
    weights = tmp_path / "t" / "model.safetensors"
    data = weights.read_bytes()
    for bad in (b"not a safetensors file at all", data[:len(data) // 2]):
        weights.write_bytes(bad)
        with pytest.raises(PairError, match="cannot load model"):
            load_pair(tmp_path / "t", None, device="cpu", kernel=kernel)


def test_a_model_directory_without_tokenizer_files_is_a_clear_error(pair_dirs, tmp_path):
    import shutil
    shutil.copytree(pair_dirs / "target", tmp_path / "t")
    (tmp_path / "t" / "tokenizer.json").unlink()  # tokenizer_config.json alone is no tokenizer
    pair = load_pair(tmp_path / "t", None, device="cpu")  # (token ids still decode: profile needs no text)
    assert pair.tokenizer is None and decode(pair, [5, 6, 7], make_config("ar"), max_new_tokens=2)[1] == "length"
    with pytest.raises(PairError, match="no tokenizer .*none of tokenizer.json, tokenizer.model"):
        generate(pair, "some text", "ar", max_new_tokens=2)


def test_a_prompt_that_is_not_utf8_text_is_a_clear_error(pair_dirs):
    """Bad bytes on a command line or a pipe reach Python as lone surrogates."""
    pair = load_pair(pair_dirs / "target", None, device="cpu")
    with pytest.raises(PairError, match="not valid UTF-8 text"):
        generate(pair, "abc\udcff def", "ar", max_new_tokens=2)


def test_a_long_prompts_last_tokens_come_from_its_end(pair_dirs):
    """encode(text, last=n) is the whole text's last n tokens, read from suffixes of the text (a 40
    MB prompt took a minute to tokenize whole for the 512 tokens a job keeps): on words, on a
    run without whitespace (whose pieces depend on where the run starts) and on mixed scripts;
    the suffixes it tokenizes are far shorter than the text."""
    pair = load_pair(pair_dirs / "target", None, device="cpu")
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "über", "日本語", "\n\n", "42,", "'s", "  "]
    book = " ".join(rng.choice(words, 40000))
    texts = [book, "x" * 50001 + " y" + "a" * 120001, "word " * 30000 + "b" * 99999,
             # a long run of one character near the end (padding, blank lines): a cut inside it at the
             # same phase for both suffixes split it unlike the whole text
             book + " " * 100001 + "The end", book + "\n" * 30001 + "The end", book + " " * 100001,
             "x" + " " * 100001 + "end"]
    from transformers import AutoTokenizer

    from dynatree.names import default_pair_dir

    seen, kept = [], pair.tokenizer
    tok = AutoTokenizer.from_pretrained(default_pair_dir() / "target")  # byte-level BPE that merges space runs

    def counting(text, **kw):
        seen.append(len(text))
        return tok(text, **kw)

    pair.tokenizer = counting
    try:
        for text in texts:
            full = tok(text, add_special_tokens=False)["input_ids"]
            for n in (1, 16, 300):
                seen.clear()
                assert pair.encode(text, last=n) == full[-n:]
                if text is book:  # word boundaries near its end: read from the end
                    assert max(seen) <= len(text) // 4, (n, seen)
        assert pair.encode("short text", last=100) == tok("short text", add_special_tokens=False)["input_ids"]
    finally:
        pair.tokenizer = kept


def test_a_bos_the_tokenizer_adds_starts_every_text_prompt(pair_dirs, tmp_path):
    """A Llama-style tokenizer puts a BOS before a text (transformers' tokenizer(text) and vLLM
    prompt with it; a model trained so reads a text without it poorly): a text prompt starts with
    it, a cut prompt keeps it before the text's last tokens, a chat template's text (which writes
    its own) and a trailing special token (an EOS some tokenizers add) get none."""
    import shutil

    from tokenizers import processors
    from transformers import AutoTokenizer

    from dynatree.check import truncate_prompt

    for name in ("target", "draft"):
        shutil.copytree(pair_dirs / name, tmp_path / name)
    tok = AutoTokenizer.from_pretrained(pair_dirs / "target")
    bos = tok.eos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(  # BOS before, EOS after
        single=f"{tok.eos_token} $A {tok.eos_token}", special_tokens=[(tok.eos_token, bos)])
    for name in ("target", "draft"):
        tok.save_pretrained(tmp_path / name)
    text = "It was the best of times, it was the worst of times"
    body = tok(text, add_special_tokens=False)["input_ids"]
    assert tok(text)["input_ids"] == [bos, *body, bos]  # (what the tokenizer does)
    pair = load_pair(tmp_path / "target", tmp_path / "draft", device="cpu", dtype="float64")
    assert pair.leading_ids == [bos] and pair.encode(text) == [bos, *body]
    assert pair.encode(text, last=4) == [bos, *body[-3:]] and pair.encode(text, last=1) == body[-1:]
    assert pair.encode(text, specials=False) == body
    rendered = tok.eos_token + text  # (a chat template's text rendered beforehand, BOS and all: one BOS, not two)
    assert pair.encode(rendered) == tok(rendered, add_special_tokens=False)["input_ids"] == [bos, *body]
    assert truncate_prompt([bos, *body], 4, lead=1) == [bos, *body[-3:]] and truncate_prompt(body, 4) == body[-4:]
    assert truncate_prompt([bos, *body], 1, lead=1) == body[-1:]  # (no room for the text after it: the last token)
    gen = generate(pair, text, "dynatree", max_new_tokens=8, ignore_eos=True)
    assert gen.metrics.prompt_tokens == len(body) + 1  # (the BOS counted)
    assert gen.token_ids == generate(pair, [bos, *body], "ar", max_new_tokens=8, ignore_eos=True).token_ids
    res = CliRunner().invoke(main, ["generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                                    "--device", "cpu", "--dtype", "float64", "--prompt", text, "--max-prompt-tokens",
                                    "4", "--max-new-tokens", "8", "--ignore-eos", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["token_ids"] == generate(
        pair, [bos, *body[-3:]], "ar", max_new_tokens=8, ignore_eos=True).token_ids
    plain = load_pair(pair_dirs / "target", None, device="cpu")  # (GPT-NeoX's tokenizer adds nothing)
    assert plain.leading_ids == [] and plain.encode(text) == body


def test_mismatched_tokenizers_are_a_clear_error(pair_dirs):
    with pytest.raises(PairError, match="do not share a tokenizer"):
        load_pair(pair_dirs / "target", pair_dirs / "foreign", device="cpu")


def test_draft_scoring_fewer_tokens_than_the_tokenizer_is_an_error(pair_dirs, tmp_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(pair_dirs / "target")
    small = tiny_neox(4, vocab=len(tok) - 20, layers=1, dtype=torch.float32)
    small.save_pretrained(tmp_path / "small")
    tok.save_pretrained(tmp_path / "small")
    with pytest.raises(PairError, match="vocabularies do not match: .* but the draft scores only"):
        load_pair(pair_dirs / "target", tmp_path / "small", device="cpu")
    with pytest.raises(PairError, match="but target and draft score only"):  # (it blamed one of them)
        load_pair(tmp_path / "small", tmp_path / "small", device="cpu")


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(PairError, match=f"target {tmp_path / 'nope'}: no such file or directory"):
        load_pair(tmp_path / "nope", tmp_path / "nope2", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PairError, match="empty: no config.json in this directory"):
        load_pair(tmp_path / "empty", tmp_path / "empty", device="cpu")


def test_bad_options_are_clear_errors():
    from dynatree import make_config
    from dynatree.config import parse_options
    with pytest.raises(ValueError, match="no option 'depht'"):
        make_config("fixed_tree", {"depht": "3"})
    with pytest.raises(ValueError, match="expected int"):
        make_config("fixed_tree", {"depth": "deep"})
    with pytest.raises(ValueError, match="d0 < d_max"):
        make_config("dynatree", {"d0": "9"})
    assert make_config("dynatree", {"history": "off"}).history is False
    with pytest.raises(ValueError, match="linear option k must be within \\[1, 16777216\\], got 0"):
        make_config("linear", {"k": "0"})
    with pytest.raises(ValueError, match="option max_nodes must be within .*got 2147483647"):  # (torch sized a cache by it)
        make_config("dynatree", {"max_nodes": "2147483647"})
    for method, name in (("dynatree", "max_nodes"), ("fixed_tree", "max_nodes"), ("dyspec", "budget"), ("linear", "k")):
        with pytest.raises(ValueError, match=f"{method} option {name} must be at most 4096, got 100000: a tree's"):
            make_config(method, {name: 100000})  # (a MemoryError, or the native kernel's abort: trials AE, AG)
    assert make_config("dynatree", {"max_nodes": 4096}).node_budget == 4096
    with pytest.raises(ValueError, match="tau must be within"):
        make_config("fixed_tree", {"tau": "2"})
    with pytest.raises(ValueError, match="draft_context must be >= 0"):
        make_config("dyspec", {"draft_context": "-1"})
    # typed values (a job file, the Python API) are checked as strings are parsed
    for method, bad in (("linear", {"k": 3.7}), ("ar", {"seed": 1.5}), ("dynatree", {"tau": True}),
                        ("dynatree", {"history": 1}), ("ar", {"kv_dtype": 3})):
        with pytest.raises(ValueError, match="expected (int|float|bool|str), got"):
            make_config(method, bad)
    assert make_config("linear", {"k": 3.0}).k == 3 and make_config("ar", {"temperature": 1}).temperature == 1.0
    assert make_config("dynatree", {"hw_budget": False}).hw_budget == "off"  # YAML's `hw_budget: off`
    assert make_config("dynatree", {"hw_budget": True}).hw_budget == "auto"  # YAML's `on`: the budget on
    # a switch option's spellings too (prefix_cache took 'false', hw_budget refused it: the Python API trial)
    assert [make_config("dynatree", {"hw_budget": v}).hw_budget for v in ("false", "No", "true", "1")] == [
        "off", "off", "auto", "auto"]
    with pytest.raises(ValueError, match="hw_budget must be 'auto' \\(or on, true\\) or 'off' \\(or false\\), got 'sometimes'"):
        make_config("dynatree", {"hw_budget": "sometimes"})
    with pytest.raises(ValueError, match="a cache window needs kv_sinks >= 0 and kv_evict >= 1, got kv_sinks=4, kv_evict=0"):
        make_config("ar", {"kv_window": 100, "kv_evict": 0})  # (not the window's size, which is fine)
    with pytest.raises(ValueError, match="option k given twice"):
        parse_options(["k=3", "k=4"])
    for t in ("nan", "inf", float("nan")):
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            make_config("ar", {"temperature": t})


def test_configs_built_directly_are_checked_as_make_config_checks():
    """generate_batch takes a config object, BatchDecoder.add needs one: a bad value fails where
    it is made, not deep in the engine."""
    from dynatree.config import ARConfig, DySpecConfig, FixedTreeConfig, LinearConfig

    for build, msg in ((lambda: LinearConfig(k=0), "linear option k must be within"),
                       (lambda: LinearConfig(lookup=-3), "lookup must be >= 0"),
                       (lambda: LinearConfig(kv_update="bogus"), "kv_update must be"),
                       (lambda: FixedTreeConfig(tau=5.0), "fixed_tree option tau must be within"),
                       (lambda: DySpecConfig(mode="bogus"), "dyspec mode must be"),
                       (lambda: DySpecConfig(max_branch=0), "max_branch must be within"),
                       (lambda: ARConfig(temperature="1"), "option temperature: expected float, got '1'"),
                       (lambda: LinearConfig(k=True), "option k: expected int")):
        with pytest.raises(ValueError, match=msg):
            build()
    assert LinearConfig(k=np.int64(3)).k == 3 and ARConfig(temperature=np.float32(0.5)).temperature == 0.5


def test_cli_generate_json(pair_dirs):
    runner = CliRunner()
    args = ["generate", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
            "--device", "cpu", "--method", "dynatree", "--option", "d0=3", "--option", "tau=0.01",
            "--max-new-tokens", "10", "--prompt", "It was the best", "--ignore-eos", "--check-ar", "--json"]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 10 and isinstance(out["text"], str)
    assert out["matches_ar"] is True
    assert out["options"]["d0"] == 3 and out["metrics"]["new_tokens"] == 10
    assert (out["prompt"], out["sample"]) == (0, 0)  # the keys several generations have
    assert out["forward"] and out["draft_forward"]  # (what ran each model's forward: the draft's may differ)
    plain = ["generate", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--device", "cpu",
             "--max-new-tokens", "4", "--prompt", "It was the best", "--method", "ar"]
    res = runner.invoke(main, plain)
    assert res.exit_code == 0 and "target forward: " in res.output and "draft forward" not in res.output  # (none ran)
    res = runner.invoke(main, args[:-2])
    assert res.exit_code == 0 and "\ndraft forward: " in res.output, res.output
    res = runner.invoke(main, [*plain, "--check-ar"])  # (it compared ar, decoded twice, with itself)
    assert res.exit_code == 0 and "matches_ar=True (--method ar is the reference itself)" in res.output, res.output
    idle = plain[:-1] + ["fixed_tree", "--option", "tau=0.999"]  # (no candidate that likely)
    res = runner.invoke(main, idle + ["--max-new-tokens", "12", "--ignore-eos"])
    assert res.exit_code == 0 and "note: fixed_tree drafted no token in 11 iterations, so it ran as ar does: every " \
        "candidate fell below its tau" in res.output, res.output
    res = runner.invoke(main, idle)  # (3 iterations: too few to say)
    assert res.exit_code == 0 and "drafted no token" not in res.output, res.output
    res = runner.invoke(main, plain[:-1] + ["fixed_tree", "--option", "tau=0"])  # (it drafts: no note)
    assert res.exit_code == 0 and "drafted no token" not in res.output, res.output
    bad = ["generate", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
           "--device", "cpu", "--method", "dynatree", "--option", "depth=3", "--prompt", "x"]
    res = runner.invoke(main, bad)
    assert res.exit_code != 0 and "no option 'depth'" in res.output
    long = args[:-5] + ["--prompt", "It was the best of times. " * 60, "--json"]  # past the 128-token context
    res = runner.invoke(main, long)
    assert res.exit_code != 0 and "leaves no room" in res.output
    hint = "decode with a cache window: --option kv_window=64 --option kv_evict=16"  # fits the context, as flags
    assert hint in res.output
    res = runner.invoke(main, long + ["--option", "kv_window=64", "--option", "kv_evict=16"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, long + ["--max-prompt-tokens", "50"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["metrics"]["prompt_tokens"] == 50


def test_cli_help_lists_method_options():
    res = CliRunner().invoke(main, ["generate", "--help"])
    assert res.exit_code == 0
    for key in ("rho_stop", "kv_update", "max_branch", "branch"):
        assert key in res.output


def test_a_token_the_draft_cannot_read_ends_that_rows_drafting_only():
    """A target wider than its draft (no tokenizer to bound them) may choose an id the draft has
    no embedding for: that row goes on as `ar` -- the same tokens --
    and its batch neighbours keep drafting (it failed the whole batch before, and on a GPU the
    embedding lookup would be a device-side assert that ends the process)."""
    from dynatree import decode, make_config, pair_from_models
    from dynatree.engine import decode_batch
    target, draft = tiny_neox(1, vocab=48), tiny_neox(2, vocab=40)
    pair = pair_from_models(target, draft, None, eos_token_id=None)
    prompts = random_prompts(8, seed=3, lo=3, hi=8, vocab=40)
    first = [decode(pair, p, make_config("ar"), max_new_tokens=1)[0][0] for p in prompts]
    with torch.no_grad():  # id 45 outscores the token some prompts choose first, not the others'
        target.lm_head.weight[45] = 1.5 * target.lm_head.weight[first[0]]
    pair = pair_from_models(target, draft, None, eos_token_id=None)
    ar = [decode(pair, p, make_config("ar"), max_new_tokens=6)[0] for p in prompts]
    wide, narrow = [i for i, a in enumerate(ar) if 45 in a], [i for i, a in enumerate(ar) if 45 not in a]
    assert wide and narrow
    outs = decode_batch(pair, prompts, make_config("dynatree", {"hw_budget": "off"}), max_new_tokens=6)
    assert [o[0] for o in outs] == ar
    assert all(outs[i][2].draft_forwards > 0 for i in narrow)


def test_rows_that_lost_their_draft_leave_the_batched_budget():
    """Rows whose first token the draft cannot embed go on as `ar`; the batch's Governor, which
    weighs drafted against plain iterations, has no budgeted row left to probe or observe."""
    from dynatree import decode, make_config, pair_from_models
    from dynatree.engine import BatchDecoder
    target, draft = tiny_neox(1, vocab=48), tiny_neox(2, vocab=40)
    with torch.no_grad():  # every position's final hidden state is all ones, and only id 45 scores it
        target.gpt_neox.final_layer_norm.weight.zero_()
        target.gpt_neox.final_layer_norm.bias.fill_(1.0)
        target.lm_head.weight.zero_()
        target.lm_head.weight[45] = 1.0
    pair = pair_from_models(target, draft, None, eos_token_id=None)
    dec = BatchDecoder(pair)
    for i, p in enumerate(random_prompts(4, seed=5, lo=3, hi=8, vocab=40)):
        dec.add(p, make_config("dynatree"), max_new_tokens=6, key=i)
    done = {}
    while dec:
        done.update({key: out for key, out, *_ in dec.step()})
    assert done == {i: [45] * 6 for i in range(4)}
    assert all(g.iteration == 0 and g.ar_rate is None for g in dec.governors.values())


def test_cli_generate_out_of_memory_says_how_to_need_less(pair_dirs, monkeypatch):
    """A batch of prompts and samples too big for memory printed torch's allocator traceback (trial AE)."""
    from dynatree import engine

    def full(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried "
                           "to allocate 2078720 bytes")

    monkeypatch.setattr(engine, "generate_batch", full)
    res = CliRunner().invoke(main, ["generate", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
                                    "--device", "cpu", "--prompt", "It was", "--samples", "3", "--option",
                                    "temperature=1", "--max-new-tokens", "4"])
    assert res.exit_code == 1 and "out of memory decoding 1 prompt(s) x 3 sample(s) together (one batch): fewer" \
        in res.output and "DefaultCPUAllocator" in res.output and "Traceback" not in res.output, res.output


def test_generate_needs_at_least_one_new_token():
    from dynatree import pair_from_models
    pair = pair_from_models(tiny_neox(1, vocab=48), None, None, eos_token_id=None)
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number >= 1, got 0"):
        generate(pair, [1, 2, 3], "ar", max_new_tokens=0)


def test_an_unreachable_hub_name_fails_in_seconds(monkeypatch, tmp_path):
    """A hub id that is not cached, with the hub out of reach, is named at once (transformers and
    datasets would retry for 20-60 s); a cached one, a proxy or a reachable hub leave it to them."""
    import socket
    from dynatree import names
    from dynatree.data import InputError, read_table

    def refuse(*a, **k):
        raise OSError("unreachable")

    for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
              "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    monkeypatch.setattr(names, "_cached", lambda name, kind: name == "org/cached")
    monkeypatch.setattr(socket, "create_connection", refuse)
    with pytest.raises(PairError, match="target org/model: no such file or directory, and as a hub id not in the "
                                        "Hugging Face cache, and the hub .* is unreachable"):
        load_pair("org/model", "org/model", device="cpu")
    with pytest.raises(InputError, match="no input files found at 'promts'.*unreachable"):
        read_table("promts")
    assert names.hub_problem("org/cached") is None and names.hub_problem("/a/path") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert names.hub_problem("org/model") is None
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the loaders fail fast themselves, or use a copy
    assert names.hub_problem("org/model") is None


def test_dataset_cache_detection(monkeypatch, tmp_path):
    """A dataset `datasets` cached (under its snake-cased name) or the hub cache holds is never
    refused for an unreachable hub."""
    from datasets import config
    from huggingface_hub import constants
    from dynatree import names
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", str(tmp_path / "ds"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "ds" / "allenai___wild_chat").mkdir(parents=True)
    (tmp_path / "hub" / "datasets--org--thing").mkdir(parents=True)
    assert names._cached("allenai/WildChat", "dataset") and names._cached("org/thing", "dataset")
    assert not names._cached("org/other", "dataset")


def test_cli_generate_check_ar_says_where_and_how_close(pair_dirs, monkeypatch):
    """A generation that parts from ar (low precision can) carries the first differing index and
    the target's top-2 logit margin there, as a job's rows do."""
    from dynatree import engine

    real = engine.generate_batch

    def parted(pair, prompts, method, *a, **k):
        gens = real(pair, prompts, method, *a, **k)
        if method != "ar":
            for g in gens:
                g.token_ids = g.token_ids[:4] + [(g.token_ids[4] + 1) % 50] + g.token_ids[5:]
        return gens

    monkeypatch.setattr(engine, "generate_batch", parted)
    args = ["generate", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--device", "cpu",
            "--max-new-tokens", "8", "--prompt", "It was the best", "--ignore-eos", "--check-ar"]
    out = json.loads(CliRunner().invoke(main, args + ["--json"]).stdout.strip().splitlines()[-1])
    assert out["matches_ar"] is False and out["first_divergence"] == 4 and out["divergence_margin"] > 0
    res = CliRunner().invoke(main, args)
    assert "matches_ar=False (first difference at token 4, target top-2 logit margin there" in res.output


def test_every_command_ends_on_ctrl_c_and_sigterm_with_the_shells_codes(pair_dirs, monkeypatch):
    """generate (and any command that says nothing more itself) ends on Ctrl-C with "interrupted"
    and 130, on SIGTERM with "terminated (SIGTERM)" and 143 -- click said "Aborted!" and exited 1,
    as a failure does, and a SIGTERM ended it with no word."""
    from dynatree import engine
    from dynatree.signals import Terminated

    args = ["generate", "--target", str(pair_dirs / "target"), "--device", "cpu", "--method", "ar",
            "--max-new-tokens", "4", "--prompt", "It was"]
    for signal_, (code, said) in ((KeyboardInterrupt, (130, "interrupted")),
                                  (Terminated, (143, "terminated (SIGTERM)"))):
        def stopped(*a, **k):
            raise signal_()

        monkeypatch.setattr(engine, "generate_batch", stopped)
        res = CliRunner().invoke(main, args)
        assert res.exit_code == code and res.output.rstrip().endswith(said) and "Aborted" not in res.output, res.output


def test_a_base_install_says_which_extra_a_command_needs(monkeypatch, tmp_path):
    """Without the `ray` extra `dynatree run` names it (a ModuleNotFoundError traceback); without
    `plot` a report has its tables and says why it has no plots; `python -m dynatree -h` works."""
    import importlib.util
    import subprocess
    import sys

    from dynatree import report

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    res = CliRunner().invoke(main, ["run", "--input", "x.parquet", "--output", str(tmp_path / "o")])
    assert res.exit_code == 1 and "dynatree run needs Ray: pip install 'dynatree[ray]'" in res.output, res.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib: ImportError)
    with pytest.warns(UserWarning, match=r"no plots: matplotlib is not installed \(pip install 'dynatree\[plot\]'\)"):
        assert report.plots([], tmp_path) == []
    res = subprocess.run([sys.executable, "-m", "dynatree", "-h"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.startswith("Usage: dynatree "), res.stderr


def test_several_prompts_texts_are_told_apart_on_stdout(pair_dirs):
    args = ["generate", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--device", "cpu",
            "--max-new-tokens", "4", "--prompt", "It was the best", "--prompt", "The quick brown", "--ignore-eos"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == "--- prompt 0 ---" and "--- prompt 1 ---" in lines[1:]


def test_generate_refuses_a_blank_prompt_before_loading_the_models(tmp_path):
    res = CliRunner().invoke(main, ["generate", "--target", str(tmp_path / "none"), "--device", "cpu",
                                    "--prompt", "fine", "--prompt", " \n\t"])
    assert res.exit_code == 1 and "prompt 1 (of 0..1) is empty or only whitespace" in res.output, res.output


def test_generate_numbers_each_prompts_samples_and_ar_loads_no_draft(pair_dirs, tmp_path):
    """--samples N: a prompt's draws together, numbered 0..N-1 within it; --method ar never reads
    the draft (here a directory that does not exist)."""
    args = ["generate", "--target", str(pair_dirs / "target"), "--draft", str(tmp_path / "missing"), "--device", "cpu",
            "--method", "ar", "--option", "temperature=0.8", "--samples", "2", "--max-new-tokens", "3",
            "--prompt", "It was the best", "--prompt", "The quick brown", "--json"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [(g["prompt"], g["sample"]) for g in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # --check-ar names each sample's own reference: its derived seed, written whole (every sample
    # was said to be checked against the first one's seed, and 1.31965e+19 could not be re-drawn)
    res = CliRunner().invoke(main, args[:4] + [str(pair_dirs / "draft")] + args[5:] + ["--option", "seed=3", "--check-ar"])
    got = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert all(g["matches_ar"] and g["ar_reference"] == f"ar_t0.8_s{g['options']['seed']}" for g in got), got
    assert len({g["options"]["seed"] for g in got}) == 4


def test_one_prompts_text_is_printed_alone_on_stdout(pair_dirs):
    """One prompt: stdout is its text alone, no '--- prompt 0 ---' header (a pipe gets just the text)."""
    args = ["generate", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--device", "cpu",
            "--max-new-tokens", "4", "--prompt", "It was the best", "--ignore-eos"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "---" not in res.stdout and res.stdout.strip(), res.stdout


def test_a_prompt_past_the_context_names_max_prompt_tokens_as_a_way_out(pair_dirs):
    args = ["generate", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--device", "cpu",
            "--max-new-tokens", "10", "--prompt", "It was the best of times. " * 60]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1 and "leaves no room" in res.output, res.output
    assert "-- or --max-prompt-tokens N keeps its last N" in res.output, res.output


def test_float16_on_a_cpu_warns_at_load_and_in_one_line_on_the_command_line(pair_dirs):
    """torch's float16 CPU kernels are ~18x slower than float32 and the native kernel never runs
    them: loading says so (a user's trial found it only by its speed)."""
    with pytest.warns(UserWarning, match="float16 on a CPU runs torch's slow float16 kernels"):
        load_pair(pair_dirs / "target", pair_dirs / "draft", device="cpu", dtype="float16")
    # a model loaded with transformers' default dtype comes in the dtype it was saved in: wrapped,
    # it ran 5.4x slower than float32 without a word (the Python API trial)
    import warnings

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair_dirs / "target", dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="bfloat16 on a CPU runs torch's bfloat16 ops.*dtype=torch.float32"):
        pair_from_models(model, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pair_from_models(model.float(), None)
    from dynatree import cli  # (pytest takes warnings over; the command line's format is checked alone)
    assert cli._short_warning("slow", UserWarning, cli.__file__, 1) == "warning: slow\n"
    assert "UserWarning: slow\n" in cli._short_warning("slow", UserWarning, pytest.__file__, 1)


def test_context_length_read_from_every_config_spelling():
    """MPT and DBRX say max_seq_len: without it a context of 2^30 was assumed, so the budget's profile
    and every method ran past the model's positions instead of stopping with reason "context"."""
    from transformers import MptConfig

    from dynatree.names import context_len

    assert context_len(MptConfig(max_seq_len=96)) == 96
    assert context_len({"n_positions": 64}) == 64 and context_len({}) == 1 << 30


def _auto(model_type: str, seed: int, **kw):
    """A tiny float64 model of any architecture transformers has, sharp enough (initializer 0.25)
    that a wrong key or position shows in its greedy tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.initializer_range = 0.25
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).double().eval()


MPT = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, max_seq_len=128)
GPT2 = dict(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=128)


def test_a_target_that_cannot_verify_trees_verifies_chains(monkeypatch):
    """MPT reads its ALiBi bias by cache slot, so a tree's nodes (at slots past their positions) are
    not AR steps: the load-time probe (models._tree_problem) finds it (MPT is also named, for
    16-bit models whose probe allows for rounding) and the engine verifies each tree's best chain
    -- every method equal to transformers' greedy decoding (float64), a GPT-2 draft proposing
    trees.  BLOOM's forward fails on a tree's mask: found the same way.  A draft that cannot
    expand trees is refused for the tree methods; linear (chains) runs."""
    from dynatree import models
    from dynatree.engine import decode_batch

    target = _auto("mpt", 0, **MPT)
    with monkeypatch.context() as m:
        m.delitem(models.SLOT_BOUND, "mpt")
        probed = pair_from_models(target, None, None, eos_token_id=None).runner("target").tree_problem
    assert "a token tree's logits part from AR's" in probed
    pair = pair_from_models(target, _auto("gpt2", 1, **GPT2), None, eos_token_id=None)
    assert pair.runner("target").tree_problem == "MPT's ALiBi bias follows cache slots" and pair.max_context == 128
    assert "token trees verified as chains (MPT's ALiBi" in pair.forward_in_use("target")
    assert pair.runner("draft").tree_problem == ""
    prompts = random_prompts(3, seed=3, lo=5, hi=40, vocab=96)
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = target(torch.tensor([p]), use_cache=True)
            ids = [int(out.logits[0, -1].argmax())]
            for _ in range(15):
                out = target(torch.tensor([ids[-1:]]), **hf_cache(target, out.past_key_values), use_cache=True)
                ids.append(int(out.logits[0, -1].argmax()))
        refs.append(ids)
    run, masks = pair.runner("target"), []
    forward = run.forward

    def watch(seqs, **kw):  # every verified sequence: a chain is a plain cached step, no mask
        masks.extend(s.mask for s in seqs)
        return forward(seqs, **kw)

    run.forward = watch
    for method, opts in (("fixed_tree", {"tau": 0.001}), ("dynatree", {"hw_budget": False}),
                         ("dyspec", {"threshold": 0.001}), ("dynatree", {"hw_budget": False, "lookup": 8})):
        got = decode_batch(pair, prompts + [[5, 6, 7, 8] * 6], make_config(method, opts), max_new_tokens=16,
                           ignore_eos=True)  # (a repeating prompt: lookup chains grafted, then cut)
        assert [toks for toks, _, _ in got][:3] == refs, method
        assert max(m.mean_tree_size for _, _, m in got) > 1  # trees were drafted, chains verified
    assert masks and all(m is None for m in masks)
    run.forward = forward
    neo = _auto("gpt_neo", 0, vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, window_size=16,
                attention_types=[[["global", "local"], 1]], max_position_embeddings=128)
    assert "GPT-Neo's local attention window" in pair_from_models(neo, None, None, eos_token_id=None).runner("target").tree_problem
    bloom = pair_from_models(_auto("bloom", 0, vocab_size=96, hidden_size=32, n_layer=2, n_head=4),
                             _auto("bloom", 1, vocab_size=96, hidden_size=32, n_layer=2, n_head=4), None,
                             eos_token_id=None)
    assert bloom.runner("target").tree_problem.startswith("BLOOM's ALiBi attention takes no tree mask: a token tree's")
    assert "it drafts chains only: methods that grow trees are refused" in bloom.forward_in_use("draft")
    notes = []  # dynatree check runs what it can, saying what it skips (it ran nothing)
    assert list(bloom.decodable({"linear": make_config("linear"), "dyspec": make_config("dyspec")}, notes.append)) == ["linear"]
    assert notes == [f"note: skipping dyspec: {bloom.method_problem(make_config('dyspec'))}"]
    with pytest.raises(ValueError, match="^dyspec, dynatree: the draft model cannot expand token trees"):
        bloom.decodable({"dyspec": make_config("dyspec"), "dynatree": make_config("dynatree")}, notes.append)
    notes.clear()  # dynatree bench too: its spec keeps the rest
    spec = bench._decodable(bloom, bench.BenchSpec(("x",), tuple(bench.parse_methods("ar,linear,dynatree")),
                                                   grid={"depth": [2]}), notes.append)
    assert [m.label for m in spec.methods] == ["ar", "linear"] and spec.grid == {}
    assert len(notes) == 2 and "skipping dynatree" in notes[0] and "skipping the --grid" in notes[1]
    peers = bench.BenchSpec(("x",), tuple(bench.parse_methods("hf_assisted,dynatree")))  # a peer decodes on its own
    assert [m.label for m in bench._decodable(bloom, peers, notes.append).methods] == ["ar", "hf_assisted"]
    # a GPT-2 draft (128 learned positions: one past them is an IndexError) beside an unbounded target
    # (ALiBi): the pair is not held to 128 tokens, the draft restarts within its positions
    bloom_gpt2 = pair_from_models(bloom.target, _auto("gpt2", 1, **GPT2), None, eos_token_id=None)
    assert bloom_gpt2.max_context > 1 << 20 and bloom_gpt2.draft_positions == 128
    notes.clear()  # transformers' assisted generation feeds its assistant the whole text: left out of a bench
    peers = bench.BenchSpec(("x",), tuple(bench.parse_methods("hf_assisted,linear")))
    assert [m.label for m in bench._decodable(bloom_gpt2, peers, notes.append).methods] == ["ar", "linear"]
    assert notes and notes[-1].startswith("note: skipping hf_assisted: transformers' assisted generation runs the "
                                          "draft over the whole text, and the draft's 128 positions are fewer")
    long = (prompts[0] * 40)[:150]
    for p in (prompts[0], long):  # (dynatree's defaults: the budget's profile times chains on such a target)
        ref = decode(bloom_gpt2, p, make_config("ar"), max_new_tokens=60, ignore_eos=True)[0]
        for cfg in (make_config("dynatree", {"hw_budget": "off"}), make_config("linear", {"draft_context": 0})):
            assert decode(bloom_gpt2, p, cfg, max_new_tokens=60, ignore_eos=True)[0] == ref
    with pytest.raises(ValueError, match="the draft model cannot expand token trees.*use method linear"):
        decode(bloom, prompts[0], make_config("dynatree"), max_new_tokens=4)
    assert "cannot expand token trees" in bloom.method_problem(make_config("fixed_tree"))  # (check, bench, jobs)
    assert bloom.method_problem(make_config("linear")) == bloom.method_problem(make_config("ar")) == ""
    mpt_draft = pair_from_models(_auto("gpt2", 1, **GPT2), target, None, eos_token_id=None)  # inexact trees: fine
    assert len(decode(mpt_draft, prompts[0], make_config("dynatree"), max_new_tokens=4, ignore_eos=True)[0]) == 4
    assert len(decode(bloom, prompts[0], make_config("linear"), max_new_tokens=4, ignore_eos=True)[0]) == 4


def test_transformers_forward_scores_a_batch_in_one_forward(monkeypatch):
    """Models no packed runner takes (and --kernel hf) score a batch in one forward, joined
    (joined.py: the default where widths differ) or padded (padded.py): on either path the mixed
    batch -- a tree, a chain, one token, a prompt joining with an empty cache -- gets each
    sequence's logits, heads and cache keys as alone (float64), in one model call, on learned
    positions (GPT-2), softcapped sliding layers through the model's eager attention (Gemma 2)
    and a per-layer-kind mask (Qwen2's max_window_layers); and a batch of GPT-2 rows decodes as
    each row alone.  A model whose attention follows cache slots (GPT-Neo's window, Llama 4's
    chunks: named, and GPT-Neo's found by the probe too where its window is short enough) or
    that takes no 4-D mask (BLOOM) keeps one forward per sequence, saying so."""
    from conftest import alone_and_packed, assert_same_runs
    from dynatree import joined, models
    from dynatree.engine import decode_batch

    small = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    archs = [_auto("gpt2", 0, **GPT2), _auto("gemma2", 0, head_dim=8, sliding_window=4, **small),
              _auto("qwen2", 0, sliding_window=5, use_sliding_window=True, max_window_layers=1, **small)]
    real_join = joined.forward_join
    for model, path in itertools.product(archs, ("joined", "padded")):
        run = pair_from_models(model, None, None, eos_token_id=None, kernel="hf").runner("target")
        assert run.batch_problem == run.joined_problem == "", model.config.model_type
        assert pair_from_models(model, None, None, eos_token_id=None, kernel="hf").forward_in_use().endswith(
            "transformers' forward (--kernel hf); batches joined, or padded where rows share a block")
        if path == "padded":
            run.joined_problem = "(this test's padded half)"
        calls, joins = [], []
        hook = model.register_forward_hook(lambda *a: calls.append(1))
        monkeypatch.setattr(joined, "forward_join", lambda r, s: joins.append(1) or real_join(r, s))
        alone, alone_caches, packed, packed_caches = alone_and_packed(model, run)
        hook.remove()
        assert_same_runs(alone, alone_caches, packed, packed_caches, atol=1e-12)
        assert len(calls) == 2 * 3 + 4 + 1  # two sets of prefills, the four alone, the batch in one
        assert len(joins) == (path == "joined"), (model.config.model_type, path)
    pair = pair_from_models(archs[0], _auto("gpt2", 1, **GPT2), None, eos_token_id=None, kernel="hf")
    prompts = random_prompts(5, seed=8, lo=2, hi=30, vocab=96)
    for method in ("ar", "dynatree"):
        alone = [decode(pair, p, make_config(method), max_new_tokens=12, ignore_eos=True)[0] for p in prompts]
        assert [t for t, _, _ in decode_batch(pair, prompts, make_config(method), max_new_tokens=12,
                                              ignore_eos=True)] == alone
    neo = _auto("gpt_neo", 0, vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, window_size=4,
                attention_types=[[["global", "local"], 1]], max_position_embeddings=128)
    neo_pair = pair_from_models(neo, None, None, eos_token_id=None, kernel="hf")
    assert neo_pair.runner("target").batch_problem == "GPT-Neo's local attention window follows cache slots"
    assert neo_pair.runner("target").joined_problem == neo_pair.runner("target").batch_problem
    assert "one sequence per forward (GPT-Neo's local attention window" in neo_pair.forward_in_use("target")
    alone, alone_caches, packed, packed_caches = alone_and_packed(neo, neo_pair.runner("target"))
    assert_same_runs(alone, alone_caches, packed, packed_caches, atol=0)  # the same forwards, one by one
    with monkeypatch.context() as m:  # unnamed, the probe finds a window it reaches (4 keys) by trying
        m.delitem(models.SLOT_BOUND, "gpt_neo")
        m.setattr(models, "SLOT_WINDOWS", ())
        probed = pair_from_models(neo, None, None, eos_token_id=None, kernel="hf").runner("target").batch_problem
    assert "a padded forward's logits part from each sequence's own" in probed
    bloom = pair_from_models(_auto("bloom", 0, vocab_size=96, hidden_size=32, n_layer=2, n_head=4), None, None,
                             eos_token_id=None)
    assert bloom.runner("target").batch_problem == bloom.runner("target").joined_problem == (
        "its forward takes no 4-D mask")
    llama4 = _auto("llama4_text", 0, vocab_size=96, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                   attention_chunk_size=16, floor_scale=32, no_rope_layers=[1, 1, 1, 0], max_position_embeddings=128)
    assert (pair_from_models(llama4, None, None, eos_token_id=None).runner("target").batch_problem
            == "Llama 4's attention chunks and temperature follow cache slots")  # (its 16-token chunks: past the probe)


def test_a_joined_forward_is_probed_and_split():
    """The joined forward's probe catches a joined forward that parts from the sequences' own (here
    one that drops each tree's mask), and the model then pads; a model whose attention is neither
    SDPA nor eager is not joined; joined forwards split at a LongRoPE switch and where the masks
    would pass PAD_BYTES together, keeping order -- by hand."""
    from dynatree import joined, models, padded
    from dynatree.kvcache import new_cache
    from dynatree.runtime import Seq

    model = _auto("gpt2", 0, **GPT2)
    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        m.setattr(joined, "_mask", lambda runner, s, positions: None)  # (causal SDPA, not the tree's mask)
        broken = pair_from_models(model, None, None, eos_token_id=None, kernel="hf")
        run = broken.runner("target")
    assert "a joined forward's logits part from each sequence's own by" in run.joined_problem
    assert "; batches padded (not joined: a joined forward's logits part" in broken.forward_in_use()
    assert run.batch_problem == ""
    assert pair_from_models(model, None, None, eos_token_id=None, kernel="hf").runner("target").joined_problem == ""

    class Cfg:
        _attn_implementation = "flash_attention_2"

    assert joined.inner_implementation(type("M", (), {"config": Cfg()})()) is None
    with mp.context() as m:
        m.setattr(joined, "inner_implementation", lambda model: None)
        run = pair_from_models(model, None, None, eos_token_id=None, kernel="hf").runner("target")
    assert run.joined_problem == "its attention (sdpa) is neither SDPA nor eager"
    assert pair_from_models(model, None, None, eos_token_id=None, kernel="hf").forward_in_use().endswith(
        "batches joined, or padded where rows share a block")

    def seq(n: int, cached: int) -> Seq:
        cache = new_cache(run, 64)
        for layer in cache.layers:
            layer.length = cached
        return Seq(torch.zeros(n, dtype=torch.long), cache)

    seqs = [seq(1, 30), seq(4, 10), seq(3, 0), seq(1, 5), seq(2, 2)]
    assert joined.parts(seqs, None, 4) == [[0, 1, 2, 3, 4]]
    assert joined.parts(seqs, [0, 1, 0, 1, 0], 4) == [[0, 2, 4], [1, 3]]
    with mp.context() as m:  # masks of 4*14, 3*3, 2*4 entries: 56 + 9 would pass 64 bytes
        m.setattr(joined, "PAD_BYTES", 64)
        assert joined.parts(seqs, None, 1) == [[0, 1], [2, 3, 4]]
    assert padded.PAD_BYTES == joined.PAD_BYTES


def test_a_joined_forward_holds_its_model_against_other_threads():
    """A joined forward names its attention implementation in the model's config while it runs: a
    forward of the same model object in another thread (a second pair built on it) waits for it
    (models.model_lock) rather than read that name mid-flight -- each gets its own logits; and the
    model still deep-copies (the lock lives beside it)."""
    import copy
    import threading

    from dynatree import joined, models
    from dynatree.kvcache import new_cache
    from dynatree.runtime import Seq

    model = _auto("gpt2", 0, **GPT2)
    run_a, run_b = (pair_from_models(model, None, None, eos_token_id=None, kernel="hf").runner("target")
                    for _ in range(2))
    assert run_a.lock is run_b.lock and not run_a.joined_problem
    prompts, news = [[5, 9, 11, 40, 2], [3, 4, 8], [44, 45, 46, 47]], [[6, 7, 8], [9], [10, 11]]

    def caches():
        out = [new_cache(run_a, 12) for _ in prompts]
        with torch.inference_mode():
            for p, c in zip(prompts, out):
                run_a.forward([Seq(torch.tensor(p), c)])
        return out

    with torch.inference_mode():
        want = [run_a.forward([Seq(torch.tensor(t), c)])[0].logits for t, c in zip(news, caches())]
        lone = run_b.forward([Seq(torch.tensor([1, 2]), new_cache(run_b, 4))])[0].logits
    paused, resume, got = threading.Event(), threading.Event(), {}

    def hold(module, args):  # (thread A, inside its joined forward's second layer)
        if model.config._attn_implementation == joined.NAME and threading.current_thread().name == "A":
            paused.set()
            resume.wait(10)

    def a():
        seqs = [Seq(torch.tensor(t), c) for t, c in zip(news, caches())]
        with torch.inference_mode():
            got["a"] = run_a.forward(seqs)

    def b():
        with torch.inference_mode():
            got["b"] = run_b.forward([Seq(torch.tensor([1, 2]), new_cache(run_b, 4))])

    hook = model.transformer.h[1].register_forward_pre_hook(hold)
    ta, tb = threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")
    ta.start()
    assert paused.wait(10)
    tb.start()
    tb.join(0.3)
    assert tb.is_alive()  # (waiting for A's forward)
    resume.set()
    ta.join(10), tb.join(10)
    hook.remove()
    for out, w in zip(got["a"], want):
        assert torch.allclose(out.logits, w, rtol=0, atol=1e-12)
    assert torch.allclose(got["b"][0].logits, lone, rtol=0, atol=1e-12)
    assert model.config._attn_implementation == "sdpa"
    twin = copy.deepcopy(model)  # (the lock is kept beside the model: it still copies and pickles)
    assert models.model_lock(twin) is not run_a.lock is models.model_lock(model)


def test_padded_forwards_of_the_same_rows_share_one_block(monkeypatch):
    """The second padded forward of the same rows makes a block of their keys and values their
    caches' storage (each row's buffers view its block row), and later forwards of those rows read
    it in place, copying nothing; a row that outgrows it, a bfloat16 cache, or rows whose capacities
    differ so that a block at the largest would multiply their memory, go back to copies -- each
    row's logits and keys as alone throughout (float64).  Joined forwards between padded ones
    (joined.py, where widths differ) write into the block and keep it."""
    from dynatree import padded
    from dynatree.kvcache import new_cache
    from dynatree.runtime import Seq

    model = _auto("gpt2", 0, **GPT2)
    run = pair_from_models(model, None, None, eos_token_id=None, kernel="hf").runner("target")
    run.joined_problem = "(padded forwards only, until the end)"
    modes = []  # each padded forward's

    class Logged(padded._RowsCache):
        def __init__(self, *args):
            super().__init__(*args)
            modes.append(args[-1])

    monkeypatch.setattr(padded, "_RowsCache", Logged)
    prompts = [[5, 9, 11, 40, 2], [3, 4, 8, 8, 1, 7, 30, 31, 2], [44, 45]]
    steps = [[[6], [7], [8]], [[9], [10, 11], [12]], [[13], [14], [15]], [list(range(50, 58)), [19], [20]],
             [[21], [22], [23]]]

    def run_all(together: bool, kv_dtype: str = "model") -> list:
        caches = [new_cache(run, len(p) + 6, kv_dtype) for p in prompts]  # (the block: 15 slots; row 0 needs 16 at step 4)
        out = []
        for news in [prompts] + steps:
            seqs = [Seq(torch.tensor(t), c) for t, c in zip(news, caches)]
            out += [o.logits for o in (run.forward(seqs) if together else [run.forward([q])[0] for q in seqs])]
        return out + [l.keys[0, :, :l.length] for c in caches for l in c.layers]

    alone = run_all(False)
    assert modes == []  # (one sequence a forward: no padding)
    for got, want in zip(run_all(True), alone):
        assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-12)
    assert modes == ["copy", "adopt", "shared", "shared", "adopt", "shared"]
    modes.clear()
    for got, want in zip(run_all(True, "bfloat16"), run_all(False, "bfloat16")):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert set(modes) == {"copy"}  # (a block holds the model's dtype)
    modes.clear()
    prompts[1] = prompts[1] * 4  # (36 tokens: a block at its capacity would hold 3 x 42 slots, over 1.5 x (11 + 42 + 8))
    for got, want in zip(run_all(True), run_all(False)):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert set(modes) == {"copy"}
    prompts[1] = prompts[1][:9]
    run.joined_problem, modes[:] = "", []  # joined forwards where widths differ: they write into the block
    for got, want in zip(run_all(True), alone):
        assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-12)
    assert modes == ["adopt", "shared", "adopt"]  # (the joined prompts count as met; row 0 outgrows at step 4)
    modes.clear()
    steps[:] = [[[6], [7]], [[9], [10], [12]], [[13], [14], [15]]]  # two rows, then all three, twice
    for got, want in zip(run_all(True), run_all(False)):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert modes == ["adopt"]  # (padded, the first two steps would copy: joined; the third's rows met in the second)
    for got, want in zip(run_all(True, "bfloat16"), run_all(False, "bfloat16")):  # joined rows read bfloat16, widened
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_padded_forwards_run_only_where_they_copy_nothing(monkeypatch):
    """padded.in_place, which picks padded over joined forwards: equal widths whose groups (as
    forward_padded forms them) share or adopt a block -- not rows its byte cap splits apart (each
    part would copy), not uneven widths, and never on eager attention (its float32 softmax over a
    padded block rounds a row differently from its own forward; a joined row is exact)."""
    from dynatree import padded
    from dynatree.kvcache import new_cache
    from dynatree.runtime import Seq

    small = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    run = pair_from_models(_auto("gpt2", 0, **GPT2), None, None, eos_token_id=None, kernel="hf").runner("target")
    caches = [new_cache(run, 16) for _ in range(3)]
    with torch.inference_mode():
        run.forward([Seq(torch.tensor(p), c) for p, c in zip([[5, 9, 11], [3, 4], [7]], caches)])  # (joined)
        seqs = [Seq(torch.tensor([t]), c) for t, c in zip([1, 2, 3], caches)]
        assert padded.in_place(run, seqs)  # (these rows met in the joined prefill: they adopt)
        run.forward(seqs)
        seqs = [Seq(torch.tensor([t]), c) for t, c in zip([4, 5, 6], caches)]
        assert padded.in_place(run, seqs)  # (shared)
        assert not padded.in_place(run, [seqs[0], dataclasses.replace(seqs[1], ids=torch.tensor([5, 6])), seqs[2]])
        with monkeypatch.context() as m:
            m.setattr(padded, "PAD_BYTES", 1)  # (each row a group of its own: copies)
            assert not padded.in_place(run, seqs)
    gemma = pair_from_models(_auto("gemma2", 0, head_dim=8, sliding_window=4, **small), None, None,
                             eos_token_id=None, kernel="hf").runner("target")
    assert gemma.joined == "eager" and not gemma.joined_problem
    caches = [new_cache(gemma, 16) for _ in range(2)]
    with torch.inference_mode():
        gemma.forward([Seq(torch.tensor(p), c) for p, c in zip([[5, 9, 11], [3, 4]], caches)])
        assert not padded.in_place(gemma, [Seq(torch.tensor([t]), c) for t, c in zip([1, 2], caches)])


def test_padded_forwards_group_sequences_so_padding_stays_bounded():
    """padded.groups: the longest sequences first, a forward padding at most PAD_SLACK x its real
    rows or PAD_FREE rows, one layer's padded keys and values within PAD_BYTES, and sequences on
    either side of a LongRoPE switch apart (tests/test_packed.py's Phi-3 test decodes across one);
    the rest take further forwards."""
    from dynatree.padded import PAD_BYTES, PAD_FREE, PAD_SLACK, groups
    from dynatree.runtime import Seq

    def seqs(*lengths):
        return [Seq(torch.zeros(n, dtype=torch.long), None) for n in lengths]

    assert (PAD_SLACK, PAD_FREE) == (2.0, 64)
    assert groups(seqs(1, 30, 1, 1, 2)) == [[1, 4], [0, 2, 3]]  # 3 x 30 = 90 rows > max(2 x 33, 64)
    assert groups(seqs(300, 20, 5)) == [[0, 1], [2]]  # 2 x 300 <= 2 x 320; 3 x 300 > 2 x 325
    assert groups(seqs(*[1] * 40)) == [list(range(40))]
    assert groups(seqs(4, 9)) == [[1, 0]]
    assert groups(seqs(1, 30, 1, 1, 2), sides=[0, 1, 0, 1, 0]) == [[4, 0, 2], [1, 3]]  # a LongRoPE switch apart
    held = [Seq(torch.zeros(1, dtype=torch.long), type("C", (), {"length": n})()) for n in (99, 200, 155)]
    per = PAD_BYTES // (3 * 201)  # bytes a token: the three fit one block just
    assert groups(held, per) == [[0, 1, 2]] and groups(held, per + 1) == [[0, 1], [2]]
    prompts = [Seq(torch.zeros(4096, dtype=torch.long), type("C", (), {"length": 0})()) for _ in range(16)]
    assert groups(prompts) == [list(range(16))]  # (no cap asked for)
    assert groups(prompts, 0, None, 4) == [list(range(8)), list(range(8, 16))]  # 8 float32 masks of 64 MiB each


def test_a_model_that_cannot_use_dynatree_caches_is_refused_at_load():
    """A hybrid model (state-space layers: Falcon-H1) keeps a cache of its own kind: said when its
    runner is built, not as a traceback from the first forward; one whose recurrent layers keep
    state beside the cache (RecurrentGemma) decodes without an error but not as its own forward
    does: refused the same way.  A config whose vocab_size exceeds the embedding's rows loads."""
    gemma = _auto("recurrent_gemma", 0, vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=1, lru_width=32, attention_window_size=16)
    with pytest.raises(PairError, match="parts from its own forward .* keeps state outside the key/value cache"):
        pair_from_models(gemma, None, None, eos_token_id=None).runner("target")
    wide = _auto("gpt2", 0, **GPT2)
    wide.config.vocab_size = 128  # (padded configs: ids 96..127 have no embedding row)
    wide_run = pair_from_models(wide, None, None, eos_token_id=None).runner("target")
    assert wide_run.tree_problem == wide_run.batch_problem == ""
    model = _auto("falcon_h1", 0, vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    pair = pair_from_models(model, None, None, eos_token_id=None)
    for _ in range(2):  # and again: no runner is left behind to fail later with transformers' own error
        with pytest.raises(PairError, match=r"the target model \(falcon_h1\) cannot run on dynatree's KV caches"):
            pair.runner("target")
    moe = _auto("phimoe", 0, vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2).double()
    with pytest.raises(PairError, match=r"\(phimoe\) does not run in float64 on cpu: transformers' own forward fails"):
        pair_from_models(moe, None, None, eos_token_id=None).runner("target")  # (its experts take no float64)


def test_a_draft_is_asked_for_a_cache_window_only_where_the_method_drafts():
    """check and bench build every method's windows upfront (ModelPair.windows): ar's does not
    involve the draft, so a draft that takes no window (GPT-2: absolute positions) refuses only
    the methods that draft."""
    from dynatree.config import check_windows

    pair = pair_from_models(tiny_neox(1, vocab=96), _auto("gpt2", 1, **GPT2), None, eos_token_id=None)
    window = {"kv_window": 64, "kv_evict": 8}
    check_windows({"ar": make_config("ar", window)}, pair.max_context, pair.windows)
    with pytest.raises(ValueError, match="^linear: kv_window runs on gpt_neox, llama.*'gpt2' is not one of them"):
        check_windows({"linear": make_config("linear", window)}, pair.max_context, pair.windows)


def test_an_architecture_without_sdpa_loads_with_its_own_attention(tmp_path):
    """load_pair asks transformers for SDPA; BLOOM has none and raised ValueError: it loads with
    its own (eager) attention instead."""
    _auto("bloom", 0, vocab_size=96, hidden_size=32, n_layer=2, n_head=4).save_pretrained(tmp_path / "bloom")
    pair = load_pair(str(tmp_path / "bloom"), None, device="cpu", dtype="float32")
    assert len(decode(pair, [1, 2, 3], make_config("ar"), max_new_tokens=3, ignore_eos=True)[0]) == 3


def test_options_help_lists_shared_options_once():
    """generate/check/bench's method-option help: options every method takes alike appear once."""
    from dynatree.config import options_help

    text = options_help()
    for name in ("temperature", "seed", "kv_window", "kv_update", "draft_context"):
        assert text.count(f"    {name}=") == 1, name
    assert text.count("    lookup=") == 4  # (defaults differ: 0 for linear, fixed_tree, dyspec; -1 for dynatree)
    assert "    d_max=8" in text and "    k=5" in text and "    mode=threshold" in text


def test_ids_the_target_produces_past_the_drafts_vocabulary_are_prompt_and_stop_ids():
    """A target scoring more columns than its draft (Qwen2.5-7B / 0.5B: 152064 / 151936) may pick
    an id the draft cannot read: fed back as a prompt (a continued text) or named as a stop id it is
    accepted, and every method's drafter retires on it, still equal to ar."""
    pair = pair_from_models(tiny_neox(1, vocab=96), tiny_neox(5, vocab=90), None, eos_token_id=3)
    assert (pair.vocab, pair.id_limit) == (90, 96)
    high = [4, 60, 92, 95, 7, 93, 11]  # ids 92, 93, 95: the target's alone
    for method in ("linear", "dynatree", "dyspec", "fixed_tree"):
        ref = decode(pair, high, make_config("ar"), max_new_tokens=12, ignore_eos=True)[0]
        assert decode(pair, high, make_config(method), max_new_tokens=12, ignore_eos=True)[0] == ref, method
    assert generate(pair, high, "dynatree", max_new_tokens=12, stop_token_ids=[95]).finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match=r"token id 96 is outside the vocabulary \(0..95\)"):
        generate(pair, [4, 96], "ar", max_new_tokens=2)


def test_a_gpu_index_past_the_visible_ones_is_refused_clearly(monkeypatch):
    """`cuda:N` past the GPUs this process sees fails naming them, not at the first tensor moved."""
    from dynatree.models import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    assert resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(PairError, match="'cuda:1' requested but this process sees 1 GPU"):
        resolve_device("cuda:1")


def test_device_and_dtype_objects_are_checked_as_their_names_and_before_any_load(pair_dirs, monkeypatch):
    """torch.device("mps") failed inside torch, "meta" after 10 s, torch.int8 as a broken checkpoint;
    lean-bf16 with bfloat16 (and a kernel typo) only after both models loaded (the precision trial)."""
    from dynatree import models
    from dynatree.models import resolve_device, resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in (torch.device("mps"), torch.device("meta"), "cudax", "cuda:abc"):
        with pytest.raises(PairError, match="device must be auto, cpu, cuda or cuda:N"):
            resolve_device(dev)
    with pytest.raises(PairError, match="'cuda:1' requested but CUDA is not available"):
        resolve_device(torch.device("cuda", 1))
    assert resolve_device(torch.device("cpu")) == torch.device("cpu") == resolve_device(torch.device("cpu", 0))
    assert resolve_dtype(torch.float64) is torch.float64 and resolve_dtype("bf16") is torch.bfloat16
    for dt in (torch.int8, torch.complex64, None):
        with pytest.raises(PairError, match="unknown dtype"):
            resolve_dtype(dt)
    def loading(name, dev, *a):  # lean-bf16 is a CPU kernel: auto is the CPU on a CUDA machine too (it refused
        raise RuntimeError(f"loading on {dev}")  # "device cpu or auto" to a user who gave auto: the review)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(models, "load_model", loading)
    with pytest.raises(RuntimeError, match="loading on cpu"):
        load_pair(pair_dirs / "target", pair_dirs / "draft", device="auto", kernel="lean-bf16")
    from dynatree.jobs.driver import _actor_shape
    from dynatree.jobs.spec import build_spec

    job = build_spec(None, input="x", output="y", kernel="lean-bf16")  # (and its actors ask for no GPU)
    assert job.cpu_only and _actor_shape(job, {"GPU": 2.0})[2] == 0.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded before the refusal"))
    for kw, said in ((dict(kernel="lean-bf16", dtype="bfloat16"), "lean-bf16 .* not bfloat16 on cpu"),
                     (dict(kernel="garbage"), "kernel must be one of")):
        with pytest.raises(PairError, match=said):
            load_pair(pair_dirs / "target", pair_dirs / "draft", device="cpu", **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # (float32: the native kernel's rotary table)
def test_a_draft_with_a_shorter_context_restarts_within_it(dtype):
    """A draft of 16 positions beside a target of 128 held the pair to 16 tokens (every method, ar too):
    now the target reads the whole text and the draft restarts on its latest tokens, its positions
    (a table of 16 rows on the native kernel) never passed; outputs stay ar's at every batch size."""
    from conftest import noisy_copy, tiny_neox
    from dynatree import generate_batch
    from dynatree.drafting import Drafter

    target = tiny_neox(1, dtype=dtype)
    draft = noisy_copy(target, 3, 0.1)  # (proposals the target often takes)
    draft.config.max_position_embeddings = 16
    pair = pair_from_models(target, draft, None, eos_token_id=None)
    assert (pair.max_context, pair.draft_positions) == (128, 16)
    assert pair.window_limit(make_config("dynatree"))[0] == 16 and pair.window_limit(make_config("ar"))[0] == 128
    with pytest.raises(ValueError, match=r"kv_window 32 \+ kv_evict 8 exceed the draft's 16-token context \(a draft's "
                                         r"tree positions can reach their sum; a drafting method keeps the window in "
                                         r"the draft too, while ar's may fill the target's 128\)"):
        generate_batch(pair, [[5, 6, 7]], "dynatree", {"kv_window": 32, "kv_evict": 8}, max_new_tokens=2)
    windowed = {"kv_window": 64, "kv_evict": 8}  # (ar runs no draft: the target's context holds its window)
    assert len(generate_batch(pair, [[5, 6, 7]], "ar", windowed, max_new_tokens=2)[0].token_ids) == 2
    four = noisy_copy(target, 3, 0.1)
    four.config.max_position_embeddings = 4  # (the budget's profile kept one draft width: an IndexError)
    tiny = pair_from_models(target, four, None, eos_token_id=None)
    assert generate_batch(tiny, [[5, 6, 7]], "dynatree", max_new_tokens=10)[0].token_ids == \
        generate_batch(tiny, [[5, 6, 7]], "ar", max_new_tokens=10)[0].token_ids
    seen = []
    real, real_feed = Drafter.expand, Drafter._feed

    def expand(self, tree, nodes, k):  # every node's position inside the draft's 16
        seen.extend(self.root_pos + tree.depths[u] for u in nodes)
        return (yield from real(self, tree, nodes, k))

    def feed(self, tokens, k=0, perturb=None):  # and every committed token's (prefills, catch-ups, roots)
        seen.append(self.cache.length + len(tokens) - 1)
        return (yield from real_feed(self, tokens, k, perturb))

    prompts = [list(range(1, 21)), [7, 8, 9], list(range(30, 41))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Drafter, "expand", expand)
        mp.setattr(Drafter, "_feed", feed)
        ref = [g.token_ids for g in generate_batch(pair, prompts, "ar", max_new_tokens=60, ignore_eos=True)]
        for method, opts in (("dynatree", {"hw_budget": "off", "draft_context": 0}), ("linear", {"k": 4}),
                             ("fixed_tree", {}), ("dyspec", {})):
            got = generate_batch(pair, prompts, method, opts, max_new_tokens=60, ignore_eos=True)
            assert [g.token_ids for g in got] == ref, method
            assert sum(g.metrics.draft_forwards for g in got) > 0 and sum(g.metrics.mean_tree_size for g in got) > 0
            assert [g.token_ids for g in generate_batch(pair, prompts[:1], method, opts, max_new_tokens=60,
                                                        ignore_eos=True)] == ref[:1]
    assert seen and max(seen) <= 15
    # a row whose tokens since it joined would make the catch-up restart is not first fed its prompt (the
    # review: the prompt's length was left out of the rule, and 10 prompt tokens went through the draft for nothing)
    from dynatree.engine import BatchDecoder
    for extra, fed in ((1, 10), (4, 0)):  # 10 + 1 + extra tokens against the 12 that leave a tree room
        dec = BatchDecoder(pair)
        dec.add(list(range(1, 11)), make_config("dynatree", {"hw_budget": "off", "draft_context": 0}),
                max_new_tokens=8, ignore_eos=True)
        dec._prefill(dec.joining)
        row = dec.joining[0]
        row.drafter.pending += [5] * extra  # (as if plain iterations had committed them)
        dec._draft_prefill([row])
        assert row.drafter.fed_tokens == fed, extra
    assert pair_from_models(tiny_neox(1), None, None).context_said == "the 128-token context"


def test_a_float64_model_is_not_pointed_at_bfloat16_compute():
    """The forward line of a float64 model suggested --kernel lean-bf16 (bfloat16 products) to a user
    who asked for float64's precision; a 16-bit model is pointed at it."""
    import warnings

    from conftest import tiny_neox

    for dtype, hinted in ((torch.float64, False), (torch.bfloat16, True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (bfloat16 on a CPU: slow, and said so)
            said = pair_from_models(tiny_neox(1, dtype=dtype), None).forward_in_use()
        assert said.startswith("torch ops") and ("lean-bf16" in said) == hinted, said
