"""Chat templates: prompts as chat messages, through the API, the worker's prompt policy and a job."""
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynatree import generate, generate_batch, load_pair
from dynatree.jobs.driver import JobError, run_job
from dynatree.jobs.summary import read_rows
from dynatree.actors.worker import prompt_ids
from test_runner import quiet, ray_cluster, spec  # noqa: F401 - the module's Ray cluster fixture

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}],
         "It was the best of times", [{"role": "user", "content": "Call me Ishmael."}]]


@pytest.fixture(scope="module")
def chat_dirs(pair_dirs, tmp_path_factory):
    """The test pair with a chat template in both tokenizers."""
    root = tmp_path_factory.mktemp("chat")
    for name in ("target", "draft"):
        shutil.copytree(pair_dirs / name, root / name)
        (root / name / "chat_template.jinja").write_text(TEMPLATE)
    return root


@pytest.fixture(scope="module")
def chat_pair(chat_dirs):
    return load_pair(str(chat_dirs / "target"), str(chat_dirs / "draft"), device="cpu", dtype="float64")


def rendered(pair, prompt) -> list[int]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return pair.encode(pair.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_messages_render_with_the_template(chat_pair):
    ids = chat_pair.encode_chat(CHATS[0])
    assert chat_pair.decode(ids) == "<|system|>Be brief.\n<|user|>The quick brown fox\n<|assistant|>"
    by_messages = generate_batch(chat_pair, [CHATS[0], CHATS[2]], "dynatree", max_new_tokens=8)
    by_ids = generate_batch(chat_pair, [ids, rendered(chat_pair, CHATS[2])], "ar", max_new_tokens=8)
    assert [g.token_ids for g in by_messages] == [g.token_ids for g in by_ids]
    assert by_messages[0].metrics.prompt_tokens == len(ids)


def test_generate_on_the_command_line_takes_a_conversation(chat_dirs, chat_pair):
    """generate --chat-template: a JSON list of messages is that conversation (a system message,
    turns), as generate_batch takes it; other text (even starting with '[') one user message."""
    import json

    from click.testing import CliRunner

    from dynatree.cli import main

    args = ["generate", "--target", str(chat_dirs / "target"), "--draft", str(chat_dirs / "draft"), "--device", "cpu",
            "--dtype", "float64", "--chat-template", "--max-new-tokens", "6", "--json", "--method", "ar"]
    for prompt, as_api in ((json.dumps(CHATS[0]), CHATS[0]), ("[not json] hi", "[not json] hi")):
        res = CliRunner().invoke(main, args + ["--prompt", prompt])
        assert res.exit_code == 0, res.output
        got = json.loads(res.output.strip().splitlines()[-1])
        want = generate_batch(chat_pair, [as_api if isinstance(as_api, list) else [{"role": "user", "content": as_api}]],
                              "ar", max_new_tokens=6)[0]
        assert got["token_ids"] == want.token_ids and got["metrics"]["prompt_tokens"] == want.metrics.prompt_tokens
    one = CliRunner().invoke(main, args + ["--prompt", json.dumps(CHATS[0][-1])])  # one message: a conversation of it
    assert json.loads(one.output.strip().splitlines()[-1])["token_ids"] == generate_batch(
        chat_pair, [[CHATS[0][-1]]], "ar", max_new_tokens=6)[0].token_ids
    for meant in ("[]", '[{"role": "user"}]', '[{"role": "user", "content": "hi"}, 3]', '{"content": "hi"}'):  # meant as messages
        res = CliRunner().invoke(main, args + ["--prompt", meant])
        assert res.exit_code == 1 and "list of {role, content} messages" in res.output, (meant, res.output)
    assert CliRunner().invoke(main, args + ["--prompt", "[1, 2]"]).exit_code == 0  # numbers: text
    two = CliRunner().invoke(main, args + ["--prompt", "hi", "--prompt", "[]"])  # which of several
    assert two.exit_code == 1 and "prompt 1 (of 0..1): prompt is not a list of {role, content}" in two.output, two.output
    plain = [a for a in args if a != "--chat-template"]  # messages without the flag: text, and a note says so
    res = CliRunner().invoke(main, plain + ["--prompt", json.dumps(CHATS[0])])
    assert res.exit_code == 0 and "note: prompt reads as a list of chat messages; without --chat-template" in res.output
    assert "note:" not in CliRunner().invoke(main, plain + ["--prompt", "[1, 2]"]).output


def test_prompt_policy_with_chat(chat_pair, close_pair):
    assert prompt_ids(chat_pair, "hello", 8, None, chat=True) == rendered(chat_pair, "hello")
    assert prompt_ids(chat_pair, CHATS[0], 8, 50, chat=True) == rendered(chat_pair, CHATS[0])
    for bad in ([], [{"role": "user"}], [{"role": "user", "content": 3}], ["hi"]):
        with pytest.raises(ValueError, match="list of {role, content} messages"):
            prompt_ids(chat_pair, bad, 8, None, chat=True)
    with pytest.raises(ValueError, match="not a string .*run with --chat-template"):
        prompt_ids(chat_pair, CHATS[0], 8, None)
    with pytest.raises(ValueError, match="no chat template"):
        close_pair.encode_chat(CHATS[0])
    # one message object (a JSONL row's {"role", "content"}): a conversation of one, as generate takes it
    assert prompt_ids(chat_pair, {"role": "user", "content": "hello"}, 8, None, chat=True) == rendered(chat_pair, "hello")


def test_refused_and_long_conversations_are_row_errors(chat_dirs, chat_pair, tmp_path):
    """A template that raises (Llama-2 style: roles must alternate) or a conversation longer than a
    prompt may keep (cutting it would drop the header) fails that prompt with a ValueError only."""
    import numpy as np
    strict = tmp_path / "strict"
    shutil.copytree(chat_dirs / "target", strict)
    (strict / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index0 % 2 == 0 and m['role'] != 'user' %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")
    pair = load_pair(str(strict), None, device="cpu", dtype="float64", load_draft=False)
    with pytest.raises(ValueError, match="roles must alternate"):
        prompt_ids(pair, CHATS[0], 8, None, chat=True)
    assert prompt_ids(pair, CHATS[2], 8, None, chat=True)
    n = len(rendered(chat_pair, CHATS[0]))
    with pytest.raises(ValueError, match=f"chat prompt of {n} tokens is longer than the 5"):
        prompt_ids(chat_pair, CHATS[0], 8, 5, chat=True)
    with pytest.raises(ValueError, match="list of {role, content} messages"):
        generate_batch(chat_pair, [[{"role": "user", "content": None}]], "ar", max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^prompt 1 \(of 0..1\): .*list of {role, content} messages"):  # (which one)
        generate_batch(chat_pair, ["Hi", [{"role": "user", "content": None}]], "ar", max_new_tokens=2)
    one = {"role": "user", "content": "Call me"}  # one message: a conversation of one, as a job's cell reads
    assert generate(chat_pair, one, "ar", max_new_tokens=3).token_ids == \
        generate(chat_pair, [one], "ar", max_new_tokens=3).token_ids == \
        generate_batch(chat_pair, ["Call me", one], "ar", max_new_tokens=3)[1].token_ids
    with pytest.raises(ValueError, match=r"this is one conversation \(messages\): pass \[messages\]"):
        generate_batch(chat_pair, [one], "ar", max_new_tokens=2)
    with pytest.raises(ValueError, match="messages are all empty or only whitespace"):  # (as a blank text is)
        prompt_ids(chat_pair, [{"role": "system", "content": ""}, {"role": "user", "content": " \n"}], 8, None, chat=True)
    assert prompt_ids(chat_pair, [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}], 8, None, chat=True)
    ids = rendered(chat_pair, CHATS[2])  # token ids as an array still read as ids, not as messages
    assert generate_batch(chat_pair, [np.array(ids)], "ar", max_new_tokens=4)[0].token_ids == \
        generate_batch(chat_pair, [CHATS[2]], "ar", max_new_tokens=4)[0].token_ids


def test_a_job_cell_of_json_messages_is_that_conversation(chat_pair):
    """A string column holding message lists as JSON text went to the model as one user message
    holding the JSON (37 prompt tokens instead of 16, no word; the chat trial), where `generate
    --chat-template` read it as the conversation: both read it so now (models.conversation)."""
    import json
    assert prompt_ids(chat_pair, json.dumps(CHATS[0]), 8, None, chat=True) == rendered(chat_pair, CHATS[0])
    assert prompt_ids(chat_pair, json.dumps(CHATS[0][1]), 8, None, chat=True) == \
        rendered(chat_pair, [CHATS[0][1]])  # (one message object: a conversation of one)
    for text in ('["hi", "there"]', "[not json", "The quick brown fox"):  # (not messages: one user message)
        assert prompt_ids(chat_pair, text, 8, None, chat=True) == rendered(chat_pair, [{"role": "user", "content": text}])


def test_chat_job_matches_ar(ray_cluster, chat_dirs, chat_pair, tmp_path):
    rows = [{"role": m["role"], "content": m["content"]} for m in CHATS[0]]
    table = pa.table({"key": ["a", "b", "c", "d"],
                      "text": pa.array([rows, CHATS[2], None, []],
                                       pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))})
    pq.write_table(table, tmp_path / "in.parquet")
    s = run_job(spec(chat_dirs, tmp_path, chat_template=True, num_actors=1), progress=False, log=quiet)
    out = read_rows(tmp_path / "out")
    assert s["equivalence"]["checked"] == 2 and s["equivalence"]["mismatches"] == 0
    assert [r["prompt_tokens"] for r in out[:2]] == [len(rendered(chat_pair, c)) for c in (CHATS[0], CHATS[2])]
    assert "null" in out[2]["error"] and "messages" in out[3]["error"]


def test_chat_job_without_a_template_fails_before_actors(pair_dirs, tmp_path):
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    pq.write_table(pa.table({"key": ["a"], "text": pa.array([CHATS[2]], messages)}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match="the prompt column 'text' holds chat messages .*run with --chat-template"):
        run_job(spec(pair_dirs, tmp_path), progress=False, log=quiet, dry_run=True)  # (planned: no Ray)
    for values, chat in (([1], False), ([["a", "b"]], False), ([1], True), ([["a"]], True), ([None], False)):
        pq.write_table(pa.table({"key": ["a"], "text": values}), tmp_path / "in.parquet")  # (every row would fail)
        with pytest.raises(JobError, match=r"the prompt column 'text' holds (int64|list<element: string>|null) "
                                           r"values, never text"):
            run_job(spec(pair_dirs, tmp_path, chat_template=chat), progress=False, log=quiet, dry_run=True)
    pq.write_table(pa.table({"key": ["a", "b"], "text": pa.array([None, None], pa.string())}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match="the prompt column 'text' is null in every row"):  # (trial AI)
        run_job(spec(pair_dirs, tmp_path), progress=False, log=quiet, dry_run=True)
    pq.write_table(pa.table({"key": ["a", "b"], "text": pa.array([None, "hi"], pa.string())}), tmp_path / "in.parquet")
    run_job(spec(pair_dirs, tmp_path), progress=False, log=quiet, dry_run=True)  # (one row may decode)
    for t in (pa.binary(), pa.large_string(), pa.dictionary(pa.int32(), pa.string()), pa.string_view(), pa.json_()):
        pq.write_table(pa.table({"key": ["a"], "text": pa.array(["hello"]).cast(t)}), tmp_path / "in.parquet")
        run_job(spec(pair_dirs, tmp_path), progress=False, log=quiet, dry_run=True)  # (text, and planned)
    pq.write_table(pa.table({"key": ["a"], "text": ["hello"]}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match="has no chat template"):
        run_job(spec(pair_dirs, tmp_path, chat_template=True), progress=False, log=quiet)
    with pytest.raises(JobError, match="demo pair.* has no chat template"):  # no --target: the bundled pair's
        run_job(spec(pair_dirs, tmp_path, chat_template=True, target=None, draft=None), progress=False, log=quiet)


def test_check_says_what_to_run_for_a_chat_column(capsys):
    """check skipped a messages column as "not text" and said no more (the chat trial)."""
    from dynatree import cli

    at, prompts = cli._usable_prompts("p.jsonl", ["Hi", [{"role": "user", "content": "x"}], {"role": "user"}, None], None)
    assert (at, prompts) == ([0], ["Hi"])
    err = capsys.readouterr().err
    assert "skipping 3 prompt(s)" in err and "2 of them hold chat messages" in err and "--chat-template" in err


def test_check_renders_a_chat_column_with_the_template(chat_dirs, chat_pair, pair_dirs, tmp_path):
    """check --chat-template checks conversations against ar as a job decodes them; a conversation
    the template cannot fit in the prompt policy is skipped and named (check had no such flag)."""
    import json

    from click.testing import CliRunner

    from dynatree import cli

    kept, ids = cli._rendered("p", [0, 2], [CHATS[0], "hi"], lambda v: prompt_ids(chat_pair, v, 5, 60, chat=True))
    assert kept == [0, 2] and ids == [chat_pair.encode_chat(CHATS[0]), chat_pair.encode_chat("hi")]
    kept, _ = cli._rendered("p", [0, 1, 2], ["word " * 300, "a", "b"], lambda v: prompt_ids(chat_pair, v, 5, 60, chat=True),
                            limit=2)  # (--limit counts what renders to fit: a refused one took a place)
    assert kept == [1, 2]
    path = tmp_path / "chats.jsonl"
    rows = [CHATS[0], "It was the best of times", json.dumps(CHATS[2]), None, "word " * 300]
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    args = ["check", "--target", str(chat_dirs / "target"), "--draft", str(chat_dirs / "draft"), "--device", "cpu",
            "--dtype", "float64", "--methods", "dynatree", "--max-new-tokens", "5", "--max-prompt-tokens", "60",
            "--prompts", str(path), "--chat-template"]
    res = CliRunner().invoke(cli.main, args)
    assert res.exit_code == 0, res.output
    table = [ln.split() for ln in res.output.splitlines() if ln.startswith(str(path))]
    assert [r[1:4] for r in table] == [["ar", "3", "ref"], ["dynatree", "3", "3"]], res.output
    assert "skipping 1 prompt(s) that are null" in res.output and "row 4: chat prompt of" in res.output
    # what ran the forwards: a float64 check fell back to torch's ops without a word (the precision trial)
    assert "target forward: torch ops (not the native kernel: a float64 model on cpu" in res.output
    plain = [a.replace(str(chat_dirs), str(pair_dirs)) for a in args]  # a tokenizer without a template
    res = CliRunner().invoke(cli.main, plain)
    assert res.exit_code == 1 and "has no chat template" in res.output, res.output
