"""Stop strings and stop token ids: the rule itself, and every method stopping where ar stops."""
import random

import numpy as np
import pytest
from click.testing import CliRunner

from dynatree import BatchDecoder, Stop, generate, generate_batch, load_pair, make_config
from dynatree.cli import main
from dynatree.jobs.spec import SpecError, build_spec
from dynatree.tokenizer import train_bpe_tokenizer

METHODS = ["ar", "linear", "fixed_tree", "dynatree", "dyspec"]
PROMPT = "The history of the city"


@pytest.fixture(scope="module")
def demo():
    return load_pair(device="cpu")


@pytest.fixture(scope="module")
def free_run(demo):
    """ar's 60 tokens with no stop rule (the demo pair, greedy)."""
    return generate(demo, PROMPT, "ar", max_new_tokens=60, ignore_eos=True)


def first_stop(decode, ids, strings=(), token_ids=()) -> int | None:
    """The oracle: tokens kept under the rule, by decoding every prefix in full."""
    for n in range(1, len(ids) + 1):
        if ids[n - 1] in token_ids or any(s in decode(ids[:n]) for s in strings):
            return n
    return None


def test_cut_and_validation():
    stop = Stop(("ab", "c"))
    assert stop.cut("xxcab") == "xx" and stop.cut("xabc") == "x" and stop.cut("none") == "none"
    assert Stop.of("ab").strings == ("ab",) and Stop.of(None, []) is None
    assert Stop.of(None, 5) == Stop.of(None, [np.int64(5)]) == Stop((), (5,)) and Stop.of(stop := Stop(("a",))) is stop
    assert Stop.of(stop, [5]) == Stop(("a",), (5,))  # a Stop and more ids: both
    with pytest.raises(ValueError, match="stop must be a string or strings, got 123"):
        Stop.of(123)
    for bad in (dict(strings=("",)), dict(strings="ab"), dict(token_ids=(-1,)), dict(token_ids=(True,))):
        with pytest.raises(ValueError):
            Stop(**bad)
    assert Stop(("ab",)).cut("abxab") == ""  # a stop string at the very start leaves no text
    assert Stop.of(None, 0).token_ids == (0,)  # id 0 is a token like any other (Pythia's <|endoftext|>)
    with pytest.raises(ValueError, match="whole numbers"):  # True is no token id, whichever way it comes
        Stop.of(None, True)


def test_watch_agrees_with_decoding_every_prefix():
    """The watch decodes only a tail of the tokens; on random byte-level BPE sequences (multi-byte
    characters split across tokens included) it stops exactly where decoding whole prefixes does."""
    tok = train_bpe_tokenizer(["naïve café — déjà vu, 東京 and more words " * 4, "plain ascii text here"], 300)
    rng = random.Random(0)
    for trial in range(200):
        ids = [rng.randrange(1, len(tok)) for _ in range(30)]
        text = tok.decode(ids)
        a = rng.randrange(len(text) - 3)
        strings = (text[a:a + rng.randint(1, 3)],) if "\ufffd" not in text[a:a + 3] else ("é",)
        token_ids = (ids[rng.randrange(30)],) if trial % 3 == 0 else ()
        hit = Stop(strings, token_ids).watch(tok.decode)
        got = next((n for n in range(1, 31) if hit(ids[:n])), None)
        assert got == first_stop(tok.decode, ids, strings, token_ids), (trial, strings)


def test_watch_sees_a_stop_string_that_begins_with_a_space_under_a_sentencepiece_decoder():
    """SentencePiece-style decoders (Metaspace: Llama, Mistral) drop the leading space of the first
    token they decode, so a tail of exactly the string's length in bytes, each a token, decodes
    without the space the string begins with: the watch must look further back."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", "\u2581", "t", "h", "e", "\u2581cat", "s", "\u2581a"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    ids = [5, 1, 2, 3, 4, 6]  # "cat the" spelled one character a token, then "s"
    assert tok.decode(ids[1:5]) == "the" and tok.decode(ids) == "cat thes"  # (the slice lost its space)
    hit = Stop((" the",)).watch(tok.decode)
    assert next(n for n in range(1, 7) if hit(ids[:n])) == 5
    rng = random.Random(1)
    for _ in range(100):  # and wherever such a string turns up, where decoding every prefix stops
        seq = [rng.choice([1, 2, 3, 4, 5, 6, 7]) for _ in range(20)]
        hit = Stop((" the", " at")).watch(tok.decode)
        got = next((n for n in range(1, 21) if hit(seq[:n])), None)
        assert got == first_stop(tok.decode, seq, (" the", " at")), seq


def test_a_stop_string_the_tail_shows_but_the_text_does_not_contain_is_no_stop():
    """The watch decodes a tail first, but the whole text decides: a WordPiece decoder writes a
    tail's first token as "##ing" where the text reads "playing", and a stop at "#" (a markdown
    heading) must not fire on that."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["[UNK]", "play", "##ing", "go", "#"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece(prefix="##")
    ids = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 4]
    assert "#" not in tok.decode(ids[:-1]) and tok.decode(ids[1:6]).startswith("##ing")  # (a tail can)
    hit = Stop(("#",)).watch(tok.decode)
    assert [n for n in range(1, 13) if hit(ids[:n])] == [12]  # only the real "#"


class _Strip:
    """A tokenizer whose decode drops the text's leading space, as SentencePiece's Metaspace (and
    Llama 2's Strip) decoders do for the first token they decode."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *args, **kwargs):
        return self._tok(*args, **kwargs)

    def decode(self, ids, **kwargs):
        return self._tok.decode(ids, **kwargs).removeprefix(" ")


@pytest.mark.parametrize("method", ["ar", "dynatree"])
def test_a_continuation_keeps_its_leading_space_under_a_sentencepiece_decoder(demo, method):
    """Llama 2's "▁the ▁man" after "Once upon a time" read "the man", and a stop string " the"
    never fired (the text trial): a continuation is decoded after the prompt's last tokens."""
    import copy

    prompt = PROMPT + ","  # (the demo pair goes on " and\nthe ...": a first token with a leading space)
    free = generate(demo, prompt, "ar", max_new_tokens=12, ignore_eos=True)
    assert free.text.startswith(" and")
    spm = copy.copy(demo)
    spm.tokenizer = _Strip(demo.tokenizer)
    assert spm.decode(free.token_ids).startswith("and")  # (what the text had been)
    from dynatree.stops import texts_changed
    assert texts_changed(spm, None) and not texts_changed(demo, None)  # (a job begun before: not resumed)
    g = generate(spm, prompt, method, max_new_tokens=12, ignore_eos=True)
    assert g.text == free.text and g.token_ids == free.token_ids
    g = generate(spm, prompt, method, max_new_tokens=12, ignore_eos=True, stop=" and")
    assert (g.text, g.finish_reason, len(g.token_ids)) == ("", "stop", 1)


def test_the_decoder_falls_back_where_the_prompt_ends_inside_a_character(demo):
    """Byte-level tokens of one emoji split between the prompt and the generation: the prompt's
    text (ending in U+FFFD) does not begin the joint text, so the ids decode alone, as before."""
    ids = demo.encode("smile 😀 now")
    cut = next(i for i in range(1, len(ids)) if demo.decode(ids[:i]).endswith("\ufffd"))
    assert demo.decoder(ids[:cut])(ids[cut:]) == demo.decode(ids[cut:])
    assert demo.decoder(ids[:2])(ids[2:]) == demo.decode(ids)[len(demo.decode(ids[:2])):]
    assert demo.decoder([])(ids) == demo.decode(ids)


def _byte_fallback():
    """A Llama 2-style decoder (byte-fallback pieces, Metaspace): a run of byte tokens that starts
    inside a character decodes as U+FFFDs, the whole run."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", "\u2581ok", "\u2581and"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="\u2581")])
    return tok, lambda text: [3 + b for b in text.encode()]


def test_a_continuation_after_a_prompt_ending_in_multi_byte_characters_is_whole():
    """The prompt's last four tokens began inside "😀": the continuation "é and" read "��..." (the
    text trial); the seam now starts on a whole character."""
    import types

    from dynatree.models import ModelPair

    tok, byte = _byte_fallback()
    pair = types.SimpleNamespace(tokenizer=tok, decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    pair._seam = lambda ids: ModelPair._seam(pair, ids)
    prompt, gen = [1] + byte("😀€"), byte("é") + [2]
    want = pair.decode(prompt + gen)[len(pair.decode(prompt)):]
    assert want == "é and" and ModelPair.decoder(pair, prompt)(gen) == want
    assert ModelPair.decoder(pair, byte("😀")[:2])(byte("😀")[2:]) == pair.decode(byte("😀")[2:])  # (inside one)
    # the stop watch's first look at the last few tokens saw those U+FFFDs too: "€" fired tokens late
    gen = byte("x😀é😀é😀é€€") + [2]
    hit = Stop(("€",)).watch(pair.decode)
    assert next(n for n in range(1, len(gen) + 1) if hit(gen[:n])) == len(byte("x😀é😀é😀é€"))


def test_a_stop_string_is_cut_where_an_eos_token_completes_it(demo):
    """--stop '<|endoftext|>': EOS is tested first (finish reason eos), and the string had stayed in
    the text; a stop string "\ufffd" fired halfway through an emoji (its first byte's decode)."""
    from dynatree.stops import text_of

    eos = demo.eos_token_ids[0]
    ids = demo.encode(" the end") + [eos]
    rule = Stop((demo.decode([eos]),))
    assert text_of(demo.decode, ids, "eos", rule) == " the end"
    assert text_of(demo.decode, ids, "length", rule) == demo.decode(ids)  # (not the rule's end: kept whole)
    for inside in ("endoftext", ">", "|"):  # a string inside the EOS text alone leaves the special token whole
        assert text_of(demo.decode, ids, "eos", Stop((inside,))) == demo.decode(ids), inside
    emoji = demo.encode("a😀b")
    assert len(emoji) > 3  # (the emoji is several byte tokens)
    hit = Stop(("\ufffd",)).watch(demo.decode)
    assert not any(hit(emoji[:n]) for n in range(1, len(emoji) + 1))
    assert hit(demo.encode("a😀")[:-1] + demo.encode("b"))  # (a character that never completes is U+FFFD)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_stops_where_ar_stops(demo, free_run, method):
    ids, text = free_run.token_ids, free_run.text
    s = text[40:47]  # spans several tokens; its first appearance is where ar must stop
    n = first_stop(demo.decode, ids, (s,))
    g = generate(demo, PROMPT, method, max_new_tokens=60, ignore_eos=True, stop=s)
    assert g.finish_reason == "stop" and g.token_ids == ids[:n]
    assert g.text == demo.decode(ids[:n])[:demo.decode(ids[:n]).find(s)] and s not in g.text
    t = generate(demo, PROMPT, method, max_new_tokens=60, ignore_eos=True, stop_token_ids=[ids[9]])
    assert t.finish_reason == "stop" and t.token_ids == ids[:ids.index(ids[9]) + 1]


def test_rows_with_different_rules_in_one_batch(demo, free_run):
    """Batched, each row stops by its own rule, as it does alone."""
    ids, text = free_run.token_ids, free_run.text
    rules = [Stop((text[40:47],)), Stop(token_ids=(ids[9],)), None, Stop(("\n",), (ids[30],))]
    dec = BatchDecoder(demo)
    for i, rule in enumerate(rules):
        dec.add(demo.encode(PROMPT), make_config("dynatree"), max_new_tokens=60, ignore_eos=True, stop=rule, key=i)
    got = {}
    while dec:
        got.update({k: (toks, reason) for k, toks, reason, _ in dec.step()})
    for i, rule in enumerate(rules):
        n = first_stop(demo.decode, ids, rule.strings, rule.token_ids) if rule else None
        assert got[i] == (ids[:n], "stop") if n else got[i] == (ids, "length")


def test_sampled_rows_stop_where_ar_stops(demo):
    opts = {"temperature": 0.9, "seed": 5}
    free = generate(demo, PROMPT, "ar", opts, max_new_tokens=50, ignore_eos=True)
    s = free.text[30:34]
    ref = generate(demo, PROMPT, "ar", opts, max_new_tokens=50, ignore_eos=True, stop=s)
    got = generate_batch(demo, [PROMPT, "Once upon a time"], "dynatree", opts, max_new_tokens=50, ignore_eos=True,
                         stop=s)[0]
    assert ref.finish_reason == got.finish_reason == "stop" and got.token_ids == ref.token_ids
    assert ref.token_ids == free.token_ids[:len(ref.token_ids)] and got.text == ref.text


def test_api_forms_and_bad_ids(demo, free_run):
    """A plain string reaches BatchDecoder.add / decode too; ids the models cannot produce are refused."""
    from dynatree import decode
    s = free_run.text[40:47]
    toks, reason, _ = decode(demo, demo.encode(PROMPT), make_config("dynatree"), max_new_tokens=60, ignore_eos=True,
                             stop=s)
    assert reason == "stop" and toks == generate(demo, PROMPT, "ar", max_new_tokens=60, ignore_eos=True,
                                                 stop=[s]).token_ids
    with pytest.raises(ValueError, match="outside the models' vocabulary"):
        generate(demo, PROMPT, "ar", stop_token_ids=[demo.vocab])
    with pytest.raises(ValueError, match="a stop string is bytes \\(b'the'\\): pass text"):
        generate(demo, PROMPT, "ar", stop=b"the")
    with pytest.raises(ValueError, match="ignore_eos must be True or False, got 'no'"):  # ("no" is truthy)
        generate(demo, PROMPT, "ar", max_new_tokens=4, ignore_eos="no")


def test_a_stop_built_directly_says_what_it_takes():
    for kw in ({"strings": "pim"}, {"token_ids": 390}):
        with pytest.raises(ValueError, match="Stop takes a tuple of strings and a tuple of token ids"):
            Stop(**kw)
    assert Stop(("pim",), (390,)) == Stop.of("pim", 390) == Stop(["pim"], [390])
    assert Stop.of(Stop(["pim"], [390]), 5).token_ids == (390, 5)


def test_stop_strings_need_a_tokenizer(close_pair):
    with pytest.raises(ValueError, match="need a tokenizer"):
        generate(close_pair, [5, 6, 7], "ar", stop="x")
    g = generate(close_pair, [5, 6, 7], "dynatree", max_new_tokens=20, ignore_eos=True)
    t = generate(close_pair, [5, 6, 7], "dynatree", max_new_tokens=20, ignore_eos=True,
                 stop_token_ids=[g.token_ids[4]])
    assert t.token_ids == g.token_ids[:g.token_ids.index(g.token_ids[4]) + 1]


def test_job_spec_and_cli_flags(tmp_path, free_run):
    job = tmp_path / "job.yaml"
    job.write_text('input: a.parquet\noutput: out\nstop: ["\\n\\n", "THE END"]\nstop_token_ids: 7\n')
    spec = build_spec(str(job))
    assert spec.stop == ("\n\n", "THE END") and spec.stop_token_ids == (7,)
    assert spec.stop_rule == Stop(("\n\n", "THE END"), (7,))
    plain = build_spec(None, input="a.parquet", output="out")
    assert "stop" not in plain.identity() and plain.stop_rule is None  # jobs from before stops keep their identity
    assert spec.identity_hash() != build_spec(str(job), stop=("other",)).identity_hash()
    assert spec.identity_hash() == build_spec(str(job), stop=("THE END", "\n\n", "THE END")).identity_hash()
    job.write_text("input: a.parquet\noutput: out\nstop:\n")
    assert build_spec(str(job)).stop_rule is None
    for bad, msg in (({"stop": ("",)}, "non-empty strings"), ({"stop_token_ids": (-2,)}, "whole numbers")):
        with pytest.raises(SpecError, match=msg):
            build_spec(None, input="a.parquet", output="out", **bad)
    s = free_run.text[40:47]
    r = CliRunner().invoke(main, ["generate", "--prompt", PROMPT, "--method", "dynatree", "--max-new-tokens", "60",
                                  "--ignore-eos", "--device", "cpu", "--stop", s, "--check-ar", "--json"])
    assert r.exit_code == 0, r.output
    assert '"finish_reason": "stop"' in r.output and '"matches_ar": true' in r.output
