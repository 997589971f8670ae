"""The bench runs end to end on tiny models; report rebuilds tables and plots from Parquet alone."""
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from dynatree.cli import main

TEXTS = ["The quick brown fox jumps over the lazy dog and keeps running far away. " * 3,
         "It was the best of times, it was the worst of times, it was the age of wisdom. " * 3,
         "Call me Ishmael. Some years ago, never mind how long precisely, having little money. " * 3]


def bench_args(pair_dirs, tmp_path, prompts: int, new_tokens: int) -> list[str]:
    """`dynatree bench` on the tiny pair over TEXTS written to a Parquet file (float64, CPU)."""
    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"text": TEXTS}), data)
    return ["bench", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
            "--device", "cpu", "--dtype", "float64", "--dataset", f"tiny={data}", "--prompts", str(prompts),
            "--warmup", "1", "--max-prompt-tokens", "16", "--max-new-tokens", str(new_tokens)]


def test_bench_and_report(pair_dirs, tmp_path):
    out = tmp_path / "bench"
    args = bench_args(pair_dirs, tmp_path, 10, 10) + [
            "--methods", "ar,linear,fixed=fixed_tree,dynatree,dt_fixed=dynatree,dt_recompute=dynatree,dyspec,hf_ar,hf_assisted,hf_assisted_heuristic,hf_prompt_lookup",
            "--option", "dt_fixed.dynamic_breadth=false", "--option", "dt_fixed.dynamic_depth=false",
            "--option", "dt_fixed.history=false", "--option", "dt_recompute.kv_update=recompute",
            "--sweep-tokens", "4,8", "--sweep-prompt-len", "8", "--grid-depth", "2,3", "--grid-branch", "2",
            "--grid-tau", "0.01,0.1", "--out", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    main_rows = [r for r in rows if json.loads(r["setting"])["sweep"] == "main"]
    assert {r["method"] for r in main_rows} >= {"ar", "linear", "fixed", "dynatree", "dyspec", "hf_ar", "hf_assisted"}
    assert len(main_rows) == 3 * 11
    ar_ids = {r["prompt_id"]: r["token_ids"] for r in main_rows if r["method"] == "ar"}
    for r in main_rows:  # float64: every method, HF's included, equals ar; ar is the reference, not a check
        assert r["matches_ar"] is (None if r["method"] == "ar" else True), r["method"]
        assert r["token_ids"] == ar_ids[r["prompt_id"]] and len(r["token_ids"]) == r["new_tokens"]  # (re-checkable)
        assert r["dataset"] == "tiny" and r["tokens_per_s"] > 0 and r["speedup"] > 0
    ar = {r["prompt_id"]: r["tokens_per_s"] for r in main_rows if r["method"] == "ar"}
    for r in main_rows:
        assert abs(r["speedup"] - r["tokens_per_s"] / ar[r["prompt_id"]]) < 1e-9
    md = (out / "summary.md").read_text()
    assert "3 tiny prompts (1 warm-up)" in md  # the prompts it had: 3 of the 10 asked for
    host = json.loads((out / "bench.json").read_text())["machine"]  # what it ran on, and how fast then
    assert json.loads((out / "bench.json").read_text())["versions"]["torch"]  # (and with what)
    assert host["cpu"]["cpus"] >= 1 and host["cpu"]["arch"] and host["cpu"]["model"]
    for when in ("start", "end"):
        assert host[f"fma_{when}"]["gflops"] > 0 and host[f"fma_{when}"]["one_thread_gflops"] > 0
    assert re.search(r"^machine: .+, \d+ CPUs; FMA probe \(\w+ kernel\) at the start [\d.]+ GFLOP/s .*at the end",
                     md, re.M), md
    for title in ("Main results", "Latency", "Verification efficiency", "Ablation", "KV update",
                  "Peak memory", "Generation length sweep", "Prompt length sweep", "Fixed-tree grid"):
        assert title in md
    grid = md.split("## Fixed-tree grid")[1].split("\n## ")[0].splitlines()[4:]  # its rows: each checked against ar
    assert len(grid) == 4 and all(re.search(r"\| ([1-9]\d*)/\1 \|$", line) for line in grid), grid
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["grid_tiny.png", "sweep_prompt_len.png", "sweep_tokens.png", "throughput.png"]
    # report rebuilds everything from the Parquet alone
    for p in out.glob("*.png"):
        p.unlink()
    (out / "summary.md").unlink()
    (out / "bench.json").unlink()
    mine = [out / "grid_mine.png", out / "sweep_holiday.png"]  # a user's files named like plots: kept
    for p in mine:
        p.write_bytes(b"\x89PNG\r\n\x1a\n")
    res = CliRunner().invoke(main, ["report", str(out)])
    assert res.exit_code == 0, res.output
    assert "Main results" in (out / "summary.md").read_text() and len(list(out.glob("*.png"))) == 6
    res = CliRunner().invoke(main, ["report", str(out)])  # its own plots redrawn, the user's left alone, and said
    assert res.exit_code == 0 and all(p.exists() for p in mine) and len(list(out.glob("*.png"))) == 6
    assert "note: grid_mine.png, sweep_holiday.png in" in res.output and "left as they are" in res.output
    from dynatree.report import old_plots  # (what a bench or report removes before drawing: its own marked ones)
    assert sorted(p.name for p in old_plots(out)) == pngs


def test_bench_sampled_with_shared_option(pair_dirs, tmp_path):
    """A bare KEY=VALUE option reaches every method (the HF peers' sampling too); our methods'
    samples are compared with ar's (the same seed and settings: dynatree's with an added
    top_p=0.9 reference), the HF peers' are not, and the report says so."""
    out = tmp_path / "bench"
    args = bench_args(pair_dirs, tmp_path, 2, 8) + [
            "--methods", "linear,dynatree,hf_assisted", "--option", "temperature=0.6",
            "--option", "seed=3", "--option", "dynatree.top_p=0.9", "--out", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert {r["method"] for r in rows} == {"ar", "ar_t0.6_p0.9_s3", "linear", "dynatree", "hf_assisted"}
    for r in rows:
        opts = json.loads(r["options"])
        assert opts["temperature"] == 0.6 and opts["seed"] == 3, r["method"]
        assert r["matches_ar"] is (None if r["method"] in ("hf_assisted", r["ref_method"]) else True), r["method"]
        assert r["new_tokens"] == 8
    assert {r["ref_method"] for r in rows if r["method"] == "dynatree"} == {"ar_t0.6_p0.9_s3"}
    assert json.loads(next(r["options"] for r in rows if r["method"] == "dynatree"))["top_p"] == 0.9
    assert "| sampled |" in (out / "summary.md").read_text()
    bad = CliRunner().invoke(main, args[:-2] + ["--option", "nonsense=1", "--out", str(tmp_path / "b2")])
    assert bad.exit_code != 0 and "nonsense" in bad.output


def test_bench_cuts_prompts_to_leave_the_context_room_for_the_new_tokens(pair_dirs, tmp_path):
    """A 128-token context, T = 120 and a sweep at T = 124: prompts keep 8 and 4 tokens, as
    `dynatree check` and `run` cut them, and every row generates all T tokens (it generated what
    was left of the context, under a summary naming the asked-for T); T = 128 is refused before
    any measurement.  The summary names the kernel and the forward that ran."""
    out = tmp_path / "cut"
    res = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 3, 120) + [
        "--methods", "ar,dynatree", "--sweep-tokens", "124", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "L_max=8 (cut from 16: the 128-token context holds the new tokens too), T=120" in res.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    main_rows = [r for r in rows if json.loads(r["setting"])["sweep"] == "main"]
    sweep = [r for r in rows if json.loads(r["setting"])["sweep"] == "tokens"]
    assert main_rows and all(r["prompt_tokens"] == 8 and r["new_tokens"] == 120 for r in main_rows)
    assert sweep and all(r["prompt_tokens"] == 4 and r["new_tokens"] == 124 for r in sweep)
    summary = (out / "summary.md").read_text()
    assert "T=120, L_max=8 (of 16: the context holds the new tokens too)" in summary
    assert "kernel lean; target: torch ops (not the native kernel" in summary  # float64 runs on torch
    bad = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 3, 128) + ["--out", str(tmp_path / "full")])
    assert bad.exit_code != 0 and "leaves no room for a prompt in the 128-token context" in bad.output
    assert not (tmp_path / "full" / "results.parquet").exists()
    # every method windowed (options without a label reach every method): prompts keep L_max, as in a job
    win = tmp_path / "win"
    res = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 3, 120) + [
        "--methods", "ar,dynatree", "--option", "kv_window=24", "--option", "kv_evict=4", "--out", str(win)])
    assert res.exit_code == 0, res.output
    assert {r["prompt_tokens"] for r in pq.read_table(win / "results.parquet").to_pylist()} == {16}
    # a prompt-length sweep point past what the context holds would measure the cut prompts again
    over = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 3, 120) + ["--sweep-prompt-len", "4,12",
                                                                               "--out", str(tmp_path / "over")])
    assert over.exit_code != 0 and "--sweep-prompt-len 12: the 128-token context holds 8 prompt tokens" in over.output


def test_profile_command(pair_dirs):
    res = CliRunner().invoke(main, ["profile", "--target", str(pair_dirs / "target"), "--draft",
                                    str(pair_dirs / "draft"), "--device", "cpu", "--prefix", "16",
                                    "--prefill", "64", "--repeats", "1", "--kernel", "hf"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "kernel hf" in lines[0]
    assert ("target: not on dynatree's kernel: transformers' forward (--kernel hf); batches joined, or padded "
            "where rows share a block") in lines
    assert any(line.startswith("target ") and "64:" in line for line in lines)
    assert any(line.startswith("draft ") and "16:" in line for line in lines)


def test_profile_command_times_a_target_alone(pair_dirs):
    res = CliRunner().invoke(main, ["profile", "--target", str(pair_dirs / "target"), "--device", "cpu",
                                    "--prefix", "16", "--prefill", "32", "--repeats", "1", "--kernel", "hf"])
    assert res.exit_code == 0, res.output
    assert "draft: none given, only the target is timed" in res.output
    assert not any(line.startswith("draft ") for line in res.output.splitlines())


def test_profile_says_when_noise_hides_the_extra_tokens_cost(pair_dirs, monkeypatch):
    """A larger forward timed faster than a smaller one (few repeats, a busy host): no negative
    cost and no infinite GFLOP/s."""
    from dynatree import budget
    noisy = budget.LatencyModel(verify_ms={1: 1.0, 16: 2.0, 64: 1.9}, draft_ms={1: 0.1, 4: 0.2, 16: 0.3})
    monkeypatch.setattr(budget, "profile", lambda *a, **k: noisy)
    res = CliRunner().invoke(main, ["profile", "--target", str(pair_dirs / "target"), "--draft",
                                    str(pair_dirs / "draft"), "--device", "cpu", "--prefill", "0", "--kernel", "hf"])
    assert res.exit_code == 0, res.output
    assert "target: the extra tokens at 16-64 tokens cost less than the timing noise" in res.output
    assert "inf GFLOP/s" not in res.output and "draft: 0.008 ms per extra token" in res.output


def test_profile_command_on_a_context_too_short_for_its_largest_forwards(pair_dirs, tmp_path):
    """A 48-token context: no 64-token forward and no 256-token prefix -- the command times what
    fits, says so, and reads the per-token cost between the largest sizes it timed."""
    for name in ("target", "draft"):
        m = AutoModelForCausalLM.from_pretrained(pair_dirs / name)
        m.config.max_position_embeddings = 48
        m.save_pretrained(tmp_path / name)
        AutoTokenizer.from_pretrained(pair_dirs / name).save_pretrained(tmp_path / name)
    res = CliRunner().invoke(main, ["profile", "--target", str(tmp_path / "target"), "--draft",
                                    str(tmp_path / "draft"), "--device", "cpu", "--repeats", "1"])
    assert res.exit_code == 0, res.output
    assert "leaves no room for a 32-token forward in the 48-token context: timing at 15" in res.output
    # (one repeat on a busy host may time 32 tokens under 16: then the noise message, same sizes)
    assert (re.search(r"target: [\d.]+ ms per extra token at 16-32 tokens", res.output)
            or "target: the extra tokens at 16-32 tokens cost less than the timing noise" in res.output), res.output
    assert "target prefill of 47 tokens" in res.output


def test_bench_batch_sizes(pair_dirs, tmp_path):
    """--batch-sizes: one row per (B, method) with tokens/s per actor and a check of every row
    against batch-1 ar (float64, so transformers' batched generate agrees too)."""
    out = tmp_path / "batch"
    res = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 3, 6) + [
        "--methods", "ar,linear,dynatree,hf_ar,hf_prompt_lookup", "--batch-sizes", "1,2,3", "--sweep-tokens", "4",
        "--out", str(out)])
    assert res.exit_code == 0, res.output
    table = pq.read_table(out / "results.parquet")
    sweep = [r for r in table.to_pylist() if json.loads(r["setting"])["sweep"] == "tokens"]
    rows = [r for r in table.to_pylist() if r not in sweep]
    # every row keeps its columns (a batch row's and a sweep row's differ), one warm-up prompt each
    assert {"rows_matching_ar", "ttft_s"} <= set(table.column_names)
    assert sorted((r["method"], r["warmup"]) for r in sweep) == [(m, w) for m in ("ar", "dynatree")
                                                               for w in (False, False, True)]
    assert {(json.loads(r["setting"])["B"], r["method"]) for r in rows} == {  # B = 3 ran as the 2 prompts there
        (b, m) for b in (1, 2) for m in ("ar", "linear", "dynatree", "hf_ar")}  # are, labelled so, and said
    assert "B = 3: only 2 prompts are measured, so the largest batch is 2" in res.output
    assert ("hf_prompt_lookup: transformers runs it one sequence at a time, outside dynatree's batched engine, so "
            "it gives no numbers in a batch sweep (B = 1 included)") in res.output  # (not silently)
    for r in rows:
        assert r["rows"] == 2 and r["rows_matching_ar"] == 2 and r["matches_ar"], r  # 3 prompts, 1 warm-up
        assert r["new_tokens"] == 12 and r["tokens_per_s"] > 0
    assert "Batched decoding" in (out / "summary.md").read_text() and (out / "batch.png").exists()
    assert {json.dumps(json.loads(r["setting"]).get("asked")) for r in rows} == {"null", "[3]"}  # (B = 2 stood for 3)
    assert "| 2 (also for B = 3: 2 prompts measured) | dynatree |" in (out / "summary.md").read_text()


def test_bench_windowed_rows_use_the_windowed_ar(pair_dirs, tmp_path):
    """StreamingLLM rows (kv_window) are checked against `ar` with the same window, added when not
    listed; the length-sweep table reports their cache memory, which stays at the window's size."""
    out = tmp_path / "window"
    win = {"kv_window": 20, "kv_sinks": 2, "kv_evict": 4}
    opts = [f"{label}.{k}={v}" for label in ("sspec", "dyn_w") for k, v in win.items()]
    res = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 2, 8) + [
        "--methods", "ar,dynatree,sspec=linear,dyn_w=dynatree", *sum((["--option", o] for o in opts), []),
        "--sweep-tokens", "10,40", "--sweep-methods", "sspec,dyn_w", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    sweep = [r for r in rows if json.loads(r["setting"])["sweep"] == "tokens"]
    ref = "ar_window20_sinks2_evict4"  # the window's sinks and evictions are named too: they change the text
    assert {r["method"] for r in sweep} == {"ar", ref, "sspec", "dyn_w"}
    for r in rows:
        assert r["ref_method"] == (ref if r["method"] in ("sspec", "dyn_w", ref) else "ar")
        assert r["matches_ar"] is (None if r["method"] == r["ref_method"] else True), r["method"]
    cache = {(r["method"], json.loads(r["setting"])["T"]): r["kv_cache_mb"] for r in sweep}
    assert cache[(ref, 10)] == cache[(ref, 40)] < cache[("ar", 40)]
    assert {r["prompt_id"] for r in sweep} == {1}  # the dataset's numbers: prompt 0 was the warm-up
    assert "× ref" in (out / "summary.md").read_text()


def test_command_line_values_are_checked_before_any_work(pair_dirs, tmp_path):
    """Numbers and directories a command cannot use: one clear line (click's usage error or ours),
    no traceback -- before the models load where that is possible."""
    pair = ["--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--device", "cpu"]
    base = bench_args(pair_dirs, tmp_path, 2, 4) + ["--out", str(tmp_path / "b")]
    for flag, value in (("--prompts", "-1"), ("--warmup", "-1"), ("--threads", "-2"), ("--max-prompt-tokens", "0"),
                        ("--batch-sizes", "0"), ("--sweep-prompt-len", "-3"), ("--grid-depth", "x"), ("--grid-tau", "abc")):
        res = CliRunner().invoke(main, base + [flag, value])
        assert res.exit_code == 2 and flag in res.output, (flag, res.output)  # click's usage error
    for args, says in ((["profile", *pair, "--repeats", "0"], "--repeats"),
                       (["profile", *pair, "--cache-lengths", "abc"], "--cache-lengths"),
                       (["report", str(tmp_path)], "not a `dynatree bench` output directory"),
                       (["generate", "--prompt", "hi", "--device", "foo"], "choose auto, cpu, cuda or cuda:N, not 'foo'"),
                       (["generate", *pair, "--prompt", "hi", "--option", "temperature=1", "--option", f"seed={1 << 64}"],
                        "seed must be"),
                       (["check", *pair[:2], "--device", "cpu", "--prompts", str(tmp_path / "prompts.parquet")],
                        "linear, fixed_tree, dynatree, dyspec need a draft model: give --draft"),
                       (["check", *pair, "--prompts", str(tmp_path / "prompts.parquet"), "--methods", ""],
                        "--methods is empty"),
                       (["check", *pair, "--prompts", str(tmp_path / "prompts.parquet"), "--methods", "ar"],
                        "only the ar reference itself, nothing to compare with it"),  # (exit 0, checking nothing: AM)
                       (base[:-2] + ["--methods", "hf_foo", "--out", str(tmp_path / "b")],
                        "or (bench only) transformers' peers hf_ar"),
                       (base + ["--grid-tau", "2"], "tau must be within [0, 1]")):  # (not after the main table)
        res = CliRunner().invoke(main, args)
        assert res.exit_code != 0 and says in res.output and isinstance(res.exception, SystemExit), (args, res.output)
    from dynatree.bench import BenchSpec
    with pytest.raises(ValueError, match="tau must be within"):  # the spec itself: before the main table runs
        BenchSpec(datasets=(), methods=(), grid={"tau": [2.0]})
    (tmp_path / "results.parquet").write_text("not parquet")
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 1 and "cannot read its bench results" in res.output
    data = tmp_path / "prompts.parquet"  # (bench_args wrote it)
    res = CliRunner().invoke(main, base + ["--dataset", f"tiny={data}"])
    assert res.exit_code == 1 and "two datasets named 'tiny'" in res.output
    res = CliRunner().invoke(main, base + ["--dataset", f"x={tmp_path / 'missing.parquet'}", "--methods", "ar"])
    assert res.exit_code == 1 and "missing.parquet" in res.output and not (tmp_path / "b" / "results.parquet").exists()
    res = CliRunner().invoke(main, base + ["--methods", "x=ar,x=dynatree"])
    assert res.exit_code == 1 and "--methods names 'x' twice" in res.output
    res = CliRunner().invoke(main, base + ["--methods", "ar=dynatree,linear"])
    assert res.exit_code == 1 and "the label ar names the ar every method is compared with" in res.output
    for bad in ("ar,=dynatree", "ar,dynatree="):  # a blank label, a blank method
        res = CliRunner().invoke(main, base + ["--methods", bad])
        assert res.exit_code == 1 and "LABEL=METHOD with both parts" in res.output, res.output
    res = CliRunner().invoke(main, base + ["--methods", "ar,dynatree=dyspec"])  # rows would read as dynatree's
    assert res.exit_code == 1 and "'dynatree' is the name of another method" in res.output
    res = CliRunner().invoke(main, base + ["--methods", "ar,dynatree", "--option", "ar.kv_window=128"])
    assert res.exit_code == 1 and "give a configured ar a label of its own" in res.output
    res = CliRunner().invoke(main, base + ["--batch-sizes", "1,1"])
    assert res.exit_code == 2 and "names a value twice" in res.output
    res = CliRunner().invoke(main, base + ["--methods", "ar,linear", "--sweep-methods", "linear,lineer", "--sweep-tokens", "4"])
    assert res.exit_code == 1 and "--sweep-methods lineer: not among the methods (ar, linear" in res.output


def test_the_batch_sweep_leaves_out_a_sampled_hf_ar(pair_dirs, tmp_path):
    """transformers' batched generate is greedy: under a sampling option its rows would pass for
    samples identical to ar's."""
    out = tmp_path / "bench"
    args = bench_args(pair_dirs, tmp_path, 2, 6) + ["--methods", "ar,hf_ar", "--option", "temperature=0.6",
                                                    "--batch-sizes", "2", "--out", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    batch = [r for r in pq.read_table(out / "results.parquet").to_pylist() if '"sweep": "batch"' in r["setting"]]
    assert {r["method"] for r in batch} == {"ar"} and "runs greedy only" in res.output


def test_the_main_table_divides_by_each_methods_own_ar_reference():
    from dynatree.report import _ref_speedup, _results_table
    row = lambda tps, ref=None: {"tokens_per_s": tps, "ref_method": ref, "matches_ar": True}
    gd = {"ar": [row(100.0, "ar")], "ar_t0.8_s3": [row(50.0, "ar_t0.8_s3")], "dts": [row(75.0, "ar_t0.8_s3")],
          "dyn": [row(150.0, "ar")], "hf_ar": [row(20.0)]}
    assert [_ref_speedup(gd, m) for m in gd] == [1.0, 1.0, 1.5, 1.5, 0.2]
    assert "| dts | 75.0 (n = 1) | 1.50× | yes (1) |" in _results_table({"d": gd}, ["d"], list(gd), {"d": gd})  # (n = 1)


def earlier_plot(path):
    """A PNG marked as a bench's plot (report.old_plots), as an earlier bench would have left it."""
    import struct

    text = b"Software\0dynatree bench"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + struct.pack(">I4s", len(text), b"tEXt") + text + b"\0" * 4)


def test_an_interrupted_bench_keeps_the_prompts_it_finished(pair_dirs, tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM mid-bench: results.parquet holds every whole prompt measured (and what an
    earlier bench left in the directory is gone), bench.json says it was interrupted; exit 130."""
    import dynatree.bench

    out = tmp_path / "b"
    out.mkdir()
    earlier_plot(out / "sweep_tokens.png")
    real, calls = dynatree.bench.decode, []

    def decode(*a, **k):  # the 7th decode: prompt 2's first (prompt-major, 3 methods), after two whole prompts
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(dynatree.bench, "decode", decode)
    res = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 4, 4) + ["--methods", "ar,linear,dynatree",
                                                                            "--out", str(out)])
    assert res.exit_code == 130 and "the prompts measured so far are in" in res.output, res.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert sorted({r["prompt_id"] for r in rows}) == [0, 1] and len(rows) == 6
    meta = json.loads((out / "bench.json").read_text())
    assert meta["interrupted"] and meta["max_prompt_tokens_kept"] == 16 and not (out / "sweep_tokens.png").exists()
    # report on it says it was interrupted; on one stopped in its warm-up (prompt 0 alone), it refuses
    rep = CliRunner().invoke(main, ["report", str(out)])
    assert rep.exit_code == 0 and "**Interrupted**: the bench was stopped before the end" in rep.output
    warm = out / "warm"
    warm.mkdir()
    pq.write_table(pa.Table.from_pylist([r for r in rows if r["warmup"]]), warm / "results.parquet")
    earlier_plot(warm / "throughput.png")
    rep = CliRunner().invoke(main, ["report", str(warm)])
    assert rep.exit_code != 0 and "no measured prompts in its results, only warm-up ones" in rep.output


def test_an_interrupt_in_the_warm_up_or_a_batch_sweep_keeps_what_is_worth_keeping(pair_dirs, tmp_path, monkeypatch):
    """Stopped after its warm-up prompt, a bench had replaced an earlier bench's results with warm-up
    rows alone; stopped in a --batch-sizes sweep, it had dropped the batch sizes already measured
    (the bench trial)."""
    import dynatree.bench

    out = tmp_path / "b"
    out.mkdir()
    pq.write_table(pa.table({"earlier": [1]}), out / "results.parquet")
    real, calls = dynatree.bench.decode, []

    def decode(*a, **k):  # the 4th decode: prompt 1's first, after warm-up prompt 0's three
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(dynatree.bench, "decode", decode)
    args = bench_args(pair_dirs, tmp_path, 4, 4) + ["--methods", "ar,linear,dynatree", "--out", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 130 and "nothing was measured yet" in res.output, res.output
    assert pq.read_table(out / "results.parquet").column_names == ["earlier"]  # (kept)
    monkeypatch.setattr(dynatree.bench, "decode", real)
    sizes, one = [], dynatree.bench._size_rows

    def size_rows(*a, **k):
        sizes.append(a[4])
        if len(sizes) == 2:
            raise KeyboardInterrupt
        return one(*a, **k)

    monkeypatch.setattr(dynatree.bench, "_size_rows", size_rows)
    res = CliRunner().invoke(main, args + ["--batch-sizes", "1,2"])
    assert res.exit_code == 130 and "the prompts measured so far are in" in res.output, res.output
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert {json.loads(r["setting"])["B"] for r in rows} == {1} and len(rows) == 3


def test_prompt_length_sweep_points_past_the_prompts_are_left_out(pair_dirs, tmp_path):
    """L = 400 and 800 over prompts of ~330 tokens measured the same prompts as two points."""
    out = tmp_path / "b"
    args = bench_args(pair_dirs, tmp_path, 3, 4)
    short = tmp_path / "short.parquet"  # (51 tokens each)
    pq.write_table(pa.table({"text": ["The quick brown fox jumps over the lazy dog. " * 5] * 3}), short)
    args[args.index("--dataset") + 1] = f"tiny={short}"
    res = CliRunner().invoke(main, args + ["--methods", "ar", "--sweep-prompt-len", "4,100,110", "--out", str(out)])
    assert res.exit_code == 0 and "sweep L=110 left out: its prompts are at most" in res.output, res.output
    assert "the same prompts as L=100" in res.output
    rows = [r for r in pq.read_table(out / "results.parquet").to_pylist() if '"prompt_len"' in r["setting"]]
    assert {json.loads(r["setting"])["L"] for r in rows} == {4, 100}


def test_a_bench_interrupted_while_writing_its_report_says_the_measurements_are_whole(pair_dirs, tmp_path,
                                                                                       monkeypatch):
    import dynatree.report

    def report(out):
        raise KeyboardInterrupt

    monkeypatch.setattr(dynatree.report, "report", report)
    out = tmp_path / "late"
    res = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 3, 4) + ["--methods", "ar", "--out", str(out)])
    assert res.exit_code == 130 and "interrupted while writing the report: every measurement is in" in res.output
    assert len(pq.read_table(out / "results.parquet")) == 3 and f"`dynatree report {out}`" in res.output  # (warm-up too)


def test_report_redraws_only_what_the_results_hold(pair_dirs, tmp_path):
    """A plot an earlier report drew that this one does not (a sweep since dropped) is removed, and
    a missing tokens/s (a row that failed to time) leaves its bar's spread out instead of crashing."""
    out = tmp_path / "r"
    res = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 3, 4) + ["--methods", "ar,linear", "--out", str(out)])
    assert res.exit_code == 0, res.output
    table = pq.read_table(out / "results.parquet").to_pylist()
    table[-1]["tokens_per_s"] = None
    pq.write_table(pa.Table.from_pylist(table), out / "results.parquet")
    earlier_plot(out / "sweep_tokens.png")
    rep = CliRunner().invoke(main, ["report", str(out)])
    assert rep.exit_code == 0, rep.output
    assert not (out / "sweep_tokens.png").exists() and (out / "throughput.png").exists()
    (out / "bench.json").write_text("[]")  # valid JSON of the wrong shape: one line, no traceback
    rep = CliRunner().invoke(main, ["report", str(out)])
    assert rep.exit_code == 1 and "cannot read its bench results (TypeError" in rep.output, rep.output


def test_report_tables_a_batch_row_against_its_own_reference_and_ranks_the_ablation_by_mechanisms():
    """A sampled method at batch B is divided by the sampled ar at B (its reference), beside plain
    ar; the ablation lists the variant with the budget and lookup off before the full method."""
    from dynatree.report import _ablation_table, _batch_table

    def brow(m, tps, ref):
        return {"setting": json.dumps({"sweep": "batch", "B": 2}), "dataset": "d", "method": m, "tokens_per_s": tps,
                "ref_method": ref, "tokens_per_iteration": None, "mean_tree_size": None, "rows_matching_ar": 2, "rows": 2}
    table = _batch_table([brow("ar", 100.0, "ar"), brow("ar_t0.8", 50.0, "ar_t0.8"), brow("dts", 75.0, "ar_t0.8")])[0]
    assert "| d | 2 | dts | 75.0 | 0.75× | 1.50× |" in table, table
    row = lambda opts: {"tokens_per_s": 1.0, "tokens_per_iteration": 1.0, "base_method": "dynatree",
                        "options": json.dumps(opts), "ref_method": "ar", "matches_ar": True}
    g = {"d": {"dynatree": [row({})], "paper": [row({"hw_budget": "off", "lookup": 0})]}}
    lines = _ablation_table(g, ["d"], ["dynatree", "paper"]).splitlines()
    assert [ln.split("|")[1].strip() for ln in lines[4:]] == ["paper", "dynatree"], lines


def test_bench_reads_a_path_with_an_equals_sign_and_refuses_drafted_methods_without_a_draft(pair_dirs, tmp_path):
    """A hive-style path (lang=en/...) is a path, not NAME=PATH; a target alone refuses the methods
    that draft (ours and transformers' assisted peers) before any measuring, leaving no --out behind."""
    from dynatree.bench import load_bench_prompts

    (tmp_path / "lang=en").mkdir()
    pq.write_table(pa.table({"text": TEXTS}), tmp_path / "lang=en" / "part.parquet")
    assert load_bench_prompts(str(tmp_path / "lang=en" / "part.parquet"), n=2) == ("part", TEXTS[:2])
    args = bench_args(pair_dirs, tmp_path, 2, 4)
    alone = args[:3] + args[5:]  # (no --draft)
    assert "--draft" not in alone
    for methods, says in (("ar,linear", "linear needs a draft model"),
                          ("ar,hf_assisted,dynatree", "hf_assisted, dynatree need a draft model")):
        res = CliRunner().invoke(main, alone + ["--methods", methods, "--out", str(tmp_path / "o")])
        assert res.exit_code != 0 and says in res.output, res.output
        assert not (tmp_path / "o").exists()


def test_options_given_to_every_method_reach_the_grid_and_are_named_and_peers_refuse_a_window(pair_dirs, tmp_path):
    """A bare --option configures every method, `ar` included: the fixed-tree grid's `ar` and trees
    get it too (they ran plain beside a configured `ar`), the summary says it, and transformers'
    peers, which have no cache window, refuse one instead of running without it."""
    out = tmp_path / "g"
    res = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 3, 6) + [
        "--methods", "ar,linear", "--option", "kv_window=24", "--option", "kv_evict=4", "--grid-depth", "2",
        "--grid-branch", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    grid = [r for r in pq.read_table(out / "results.parquet").to_pylist() if json.loads(r["setting"])["sweep"] == "grid"]
    assert grid and all(json.loads(r["options"])["kv_window"] == 24 for r in grid)
    assert 'options given to every method (as `ar` takes them): {"kv_evict": 4, "kv_window": 24}' in \
        (out / "summary.md").read_text()
    bad = CliRunner().invoke(main, bench_args(pair_dirs, tmp_path, 3, 6) + [
        "--methods", "ar,hf_ar", "--option", "kv_window=100", "--out", str(tmp_path / "p")])
    assert bad.exit_code != 0 and "--option kv_window (given to every method) does not apply" in bad.output
    from dynatree.bench import parse_methods  # an option ar does not take either is no reason to refuse them
    assert [m.options for m in parse_methods("ar,linear,hf_ar", ["k=4"])] == [{}, {"k": 4}, {}]
    # a window's shape given to every method reaches the methods with a window, not the plain ar
    specs = {m.label: m.options for m in parse_methods("ar,streaming_spec", ["kv_evict=32"])}
    assert specs["ar"] == {} and specs["streaming_spec"]["kv_evict"] == 32 == specs["ar_window1024_evict32"]["kv_evict"]
    with pytest.raises(ValueError, match="--option kv_evict: no method in --methods has a cache window"):
        parse_methods("ar,dynatree", ["kv_evict=8"])
    assert parse_methods("streaming_spec,hf_ar", ["kv_evict=32"])[2].options == {}  # a peer is not refused for it


def test_a_bench_that_cannot_write_its_out_fails_before_measuring(pair_dirs, tmp_path, monkeypatch):
    """A read-only or full --out: one line before the first prompt (it measured everything, then
    lost it to a traceback); an earlier bench's results there are said to be replaced."""
    import dynatree.bench

    args = bench_args(pair_dirs, tmp_path, 3, 1) + ["--methods", "ar"]
    (tmp_path / "a-file").write_text("")
    res = CliRunner().invoke(main, args + ["--out", str(tmp_path / "a-file" / "b")])
    assert res.exit_code == 1 and f"--out {tmp_path / 'a-file' / 'b'} cannot take the results" in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output  # (no traceback)
    measured = []
    monkeypatch.setattr(dynatree.bench, "_measure", lambda *a, **k: measured.append(1))
    real_open = open

    def full(path, mode="r", *a, **k):  # a disk with no room left for the probe's megabyte
        if ".write-probe" in str(path):
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", full)
    res = CliRunner().invoke(main, args + ["--out", str(tmp_path / "full")])
    assert res.exit_code == 1 and "cannot take the results: No space left on device" in res.output, res.output
    assert not measured
    monkeypatch.setattr("builtins.open", real_open)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.parquet").write_text("")
    from dynatree.machine import ensure_writable
    ensure_writable(tmp_path / "old", room=1 << 20)
    assert not any((tmp_path / "old").glob(".write-probe*"))


def test_an_interrupted_check_prints_the_prompts_it_finished(pair_dirs, tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM mid-check: the table of the prompts checked whole, then exit 130 (it
    printed only click's "Aborted!")."""
    import dynatree.engine

    bench_args(pair_dirs, tmp_path, 1, 1)  # (writes prompts.parquet)
    real, calls = dynatree.engine.decode, []

    def decode(*a, **k):  # the 5th decode: prompt 2's first (ar, linear: 2 per prompt), after two whole prompts
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(dynatree.engine, "decode", decode)  # (check imports it when it runs)
    res = CliRunner().invoke(main, ["check", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
                                    "--device", "cpu", "--dtype", "float64", "--prompts", str(tmp_path / "prompts.parquet"),
                                    "--methods", "linear", "--max-new-tokens", "4", "--max-prompt-tokens", "16"])
    assert res.exit_code == 130 and "interrupted: the prompts checked so far:" in res.output, res.output
    table = [line.split() for line in res.output.splitlines() if line.startswith(str(tmp_path))]
    assert [(t[1], t[2], t[3]) for t in table] == [("ar", "2", "ref"), ("linear", "2", "2")], res.output


def test_check_limit_counts_prompts_and_names_rows_by_their_file_row(pair_dirs, tmp_path, monkeypatch):
    """`check --limit N` checks N usable prompts (rows that are null, empty, only whitespace or not
    text are skipped and named, as bench's --prompts skips them), and a mismatch names the prompt's
    row in the file, not its place among the usable ones."""
    import dynatree.check

    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"text": [TEXTS[0], "", None, TEXTS[1], TEXTS[2]]}), data)
    real = dynatree.check.check_methods

    def flagged(*a, **k):  # the second usable prompt (file row 3) made to mismatch under linear
        rows = real(*a, **k)
        for r in rows:
            if r["prompt"] == 1 and r["method"] == "linear":
                r.update(matches_ar=False, first_divergence=2, divergence_margin=None)
        return rows

    monkeypatch.setattr(dynatree.check, "check_methods", flagged)
    res = CliRunner().invoke(main, ["check", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
                                    "--device", "cpu", "--dtype", "float64", "--prompts", str(data), "--limit", "2",
                                    "--methods", "linear", "--max-new-tokens", "4", "--max-prompt-tokens", "16"])
    assert res.exit_code == 1, res.output
    assert "skipping 2 prompt(s) that are null, empty, only whitespace or not text (rows 1, 2)" in res.output
    table = [line.split(maxsplit=6) for line in res.output.splitlines() if line.startswith(str(data))]
    assert [(t[1], t[2], t[3]) for t in table] == [("ar", "2", "ref"), ("linear", "2", "1")], res.output
    assert "(3, 2, None)" in table[1][6], res.output


def test_the_job_throughput_harness_checks_its_flags_before_ray_starts(tmp_path, monkeypatch):
    """A malformed --configs item or --sizes the input cannot hold: click's usage error, before
    any cluster or job (a traceback after Ray started, or a job of fewer rows labelled as more)."""
    from dynatree.jobs import throughput

    monkeypatch.setattr(throughput, "start_local_ray", lambda **k: pytest.fail("Ray started"))
    data = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": TEXTS}), data)
    base = ["--input", str(data), "--target", "t", "--draft", "d", "--out", str(tmp_path / "o")]
    for extra, says in ((["--configs", "dynatree:1,dynatree"], "expected METHOD:BATCH"),
                        (["--configs", "ar:16:2"], "ACTORSxCPUS"), (["--sizes", "abc"], "SMALL,LARGE"),
                        (["--sizes", "2,1"], "need 0 < SMALL < LARGE <= the input's 3 rows"),
                        (["--sizes", "2,100"], "the input's 3 rows")):
        res = CliRunner().invoke(throughput.main, base + extra)
        assert res.exit_code == 2 and says in res.output, (extra, res.output)


def test_report_says_when_the_hosts_fma_rate_moved_or_threads_shared_cores():
    """summary.md's machine line warns where the FMA probe moved > 20% between the bench's start
    and end, or where N threads reached well under N times one thread's rate; older bench.json
    files (no machine) get no line."""
    from dynatree.report import _machine_line

    cpu = {"arch": "x86_64", "cpus": 2, "model": "Some CPU", "family": "6", "model_number": "207", "flags": ["avx2"]}
    rate = lambda many, one: {"variant": "avx2", "threads": 2, "gflops": many, "one_thread_gflops": one}  # noqa: E731
    steady = _machine_line({"cpu": cpu, "fma_start": rate(260.0, 131.0), "fma_end": rate(250.0, 130.0)})
    assert steady.startswith("machine: Some CPU (x86_64, family 6 model 207; avx2), 2 CPUs; FMA probe (avx2 kernel) "
                             "at the start 260.0 GFLOP/s on 2 threads (1.98x one thread's 131.0), at the end 250.0")
    assert "**Note**" not in steady
    moved = _machine_line({"cpu": cpu, "fma_start": rate(260.0, 131.0), "fma_end": rate(200.0, 165.0)})
    assert "moved by more than 20%" in moved and "shared cores" in moved
    assert _machine_line(None) == "" and "FMA" not in _machine_line({"cpu": cpu})  # (a GPU run: no probe)


def _report_row(method, tps, matches, *, warmup=False, ref="ar", sweep=None):
    return {"warmup": warmup, "setting": json.dumps(sweep or {"sweep": "main"}), "dataset": "d", "method": method,
            "tokens_per_s": tps, "ref_method": ref, "matches_ar": matches, "tokens_per_iteration": 2.0,
            "kv_cache_mb": 1.0, "peak_memory_mb": 1.0, "iterations": None}


def test_main_table_times_measured_rows_but_checks_every_output():
    """Speed from the *measured* rows; exactness from every row, warm-up included (a warm-up row that
    differed from ar read "yes": the bench trial), and a mismatch says how many rows differ."""
    from dynatree.report import _groups, _results_table
    rows = [_report_row("ar", 1.0, None, warmup=True), _report_row("ar", 100.0, None), _report_row("ar", 100.0, None),
            _report_row("dyn", 1000.0, True, warmup=True), _report_row("dyn", 150.0, True), _report_row("dyn", 150.0, True),
            _report_row("warm", 1000.0, False, warmup=True), _report_row("warm", 130.0, True),
            _report_row("bad", 120.0, True), _report_row("bad", 120.0, False)]
    g = _groups(rows)
    table = _results_table(g, ["d"], list(g["d"]), every=_groups(rows, warmup=True))
    assert "| dyn | 150.0 ± 0.0 | 1.50× | yes (3) |" in table, table
    assert "| warm | 130.0 (n = 1) | 1.30× | NO: 1 of 2 differ |" in table, table
    assert "| bad | 120.0 ± 0.0 | 1.20× | NO: 1 of 2 differ |" in table, table
    assert "**warm, bad: outputs differ from `ar`**" in table
    from dynatree.report import _mixed  # two benches' rows put together: said, not pooled silently
    assert _mixed(rows) == []
    other = [{**r, "max_new_tokens": 32, "max_prompt_tokens": 200} for r in rows[:3]]
    assert _mixed(rows + other)[0].startswith("**Mixed runs**: the main setting's rows were measured at T=32 "
                                              "L_max=200, T=None L_max=None")


def test_sweep_tables_leave_out_warm_up_rows_and_references_from_identical_counts():
    from dynatree.report import tables
    sw = {"sweep": "tokens", "T": 4}
    rows = [_report_row("ar", 1.0, None, warmup=True, sweep=sw), _report_row("ar", 100.0, None, sweep=sw),
            _report_row("dyn", 1.0, False, warmup=True, sweep=sw), _report_row("dyn", 150.0, True, sweep=sw)]
    lines = {ln.split("|")[3].strip(): ln for ln in tables(rows).splitlines() if ln.startswith("| d | 4 |")}
    assert lines["ar"].rstrip().endswith("| - |"), lines["ar"]  # the reference checks nothing
    assert lines["dyn"].rstrip().endswith("| 1/1 |") and "| 150.0 (n = 1) | 1.50× |" in lines["dyn"], lines["dyn"]


def test_the_main_table_calls_ar_the_reference_and_an_unchecked_peer_sampled():
    """'exact' names the row that is the reference (checks nothing) apart from a sampled peer's
    rows (compared with nothing): a swap would read the sampled peer as the run's reference."""
    from dynatree.report import _results_table
    row = lambda tps, ref: {"tokens_per_s": tps, "ref_method": ref, "matches_ar": None}  # noqa: E731
    gd = {"ar": [row(100.0, "ar")], "hf_assisted": [row(80.0, "ar")]}
    lines = {ln.split("|")[1].strip(): ln for ln in _results_table({"d": gd}, ["d"], list(gd), {"d": gd}).splitlines()[4:]}
    assert lines["ar"].endswith("| reference |") and lines["hf_assisted"].endswith("| sampled |"), lines


def test_the_batch_table_divides_by_the_ar_of_the_same_batch_size_and_counts_the_identical_rows():
    """× ar at B and × ref at B divide by the ar rows at that B only (not at every B), and the
    last column is rows_matching_ar of rows."""
    from dynatree.report import _batch_table

    def brow(m, b, tps, ref, same=2):
        return {"setting": json.dumps({"sweep": "batch", "B": b}), "dataset": "d", "method": m, "tokens_per_s": tps,
                "ref_method": ref, "tokens_per_iteration": None, "mean_tree_size": None,
                "rows_matching_ar": same, "rows": 2}
    table = _batch_table([brow("ar", 1, 50.0, "ar"), brow("dyn", 1, 40.0, "ar", same=1),
                          brow("ar", 2, 100.0, "ar"), brow("dyn", 2, 150.0, "ar")])[0]
    assert "| d | 1 | dyn | 40.0 | 0.80× | 0.80× | - | - | 1/2 |" in table, table
    assert "| d | 2 | dyn | 150.0 | 1.50× | 1.50× | - | - | 2/2 |" in table, table


def test_sweep_tables_divide_by_plain_ar_and_by_the_reference_at_each_swept_value():
    """× ar is against plain ar, × ref against the row's own reference, both at the same T."""
    from dynatree.report import tables
    rows = []
    for t, (ar, ref, dts) in ((4, (100.0, 50.0, 75.0)), (8, (200.0, 100.0, 100.0))):
        sw = {"sweep": "tokens", "T": t}
        rows += [_report_row("ar", ar, None, sweep=sw), _report_row("ar_t0.8", ref, None, ref="ar_t0.8", sweep=sw),
                 _report_row("dts", dts, True, ref="ar_t0.8", sweep=sw)]
    md = tables(rows)
    assert "| d | 4 | dts | 75.0 (n = 1) | 0.75× | 1.50× |" in md, md
    assert "| d | 8 | dts | 100.0 (n = 1) | 0.50× | 1.00× |" in md, md
    assert "× ar = speedup vs plain ar at the same T" in md, md
    for r in rows:  # a bare --option kv_window=N windows every method, the one labelled ar too: said
        r["options"] = json.dumps({"kv_window": 512})
    assert "× ar = speedup vs ar (kv_window=512) at the same T" in tables(rows)


def test_the_grid_table_lists_the_fastest_tree_first():
    from dynatree.report import tables
    grid = {"sweep": "grid"}
    rows = [_report_row(m, tps, None if m == "ar" else True, sweep=grid)
            for m, tps in (("ar", 100.0), ("fixed_tree[depth=2]", 120.0), ("fixed_tree[depth=3]", 150.0),
                           ("fixed_tree[depth=4]", 90.0))]
    order = [ln.split("|")[2].strip() for ln in tables(rows).splitlines() if ln.startswith("| d | fixed_tree")]
    assert order == ["fixed_tree[depth=3]", "fixed_tree[depth=2]", "fixed_tree[depth=4]"], order


def test_the_ablation_needs_two_greedy_dynatree_variants():
    """One dynatree is no ablation, and a sampled variant changes more than its mechanisms."""
    from dynatree.report import _ablation_table
    row = lambda opts: {"tokens_per_s": 1.0, "tokens_per_iteration": 1.0, "base_method": "dynatree",  # noqa: E731
                        "options": json.dumps(opts), "ref_method": "ar", "matches_ar": True}
    assert _ablation_table({"d": {"dynatree": [row({})]}}, ["d"], ["dynatree"]) is None
    g = {"d": {"dynatree": [row({})], "dts": [row({"temperature": 0.8})]}}
    assert _ablation_table(g, ["d"], ["dynatree", "dts"]) is None


def test_the_latency_table_has_no_time_per_output_token_for_one_token():
    from dynatree.report import _latency_table
    one = {"ttft_s": 0.01, "tpot_s": 0.5, "new_tokens": 1}
    two = {"ttft_s": 0.01, "tpot_s": 0.5, "new_tokens": 2}
    lines = _latency_table({"d": {"one": [one], "two": [two]}}, ["d"], ["one", "two"]).splitlines()
    assert lines[4:] == ["| one | 10.0 (n = 1) | - |", "| two | 10.0 (n = 1) | 500.0 (n = 1) |"], lines


def test_the_summary_names_l_max_as_asked_when_no_prompt_was_cut(tmp_path):
    """'(of N: ...)' only where the context cut the prompts below --max-prompt-tokens."""
    from dynatree.report import report
    row = {**_report_row("ar", 100.0, None), "ttft_s": 0.01, "tpot_s": 0.01, "new_tokens": 8, "base_method": "ar",
           "options": "{}", "target_forwards": 8}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "results.parquet")
    spec = {"prompts": 3, "warmup": 1, "max_new_tokens": 8, "max_prompt_tokens": 16,
            "methods": [{"label": "ar", "method": "ar", "options": {}}]}
    for kept, says in ((16, "T=8, L_max=16; EOS ignored."),
                       (8, "T=8, L_max=8 (of 16: the context holds the new tokens too); EOS ignored.")):
        (tmp_path / "bench.json").write_text(json.dumps({"spec": spec, "pair": "p", "device": "cpu", "dtype": "float64",
                                                         "threads": 1, "max_prompt_tokens_kept": kept}))
        md, _ = report(tmp_path)
        assert says in md.read_text(), md.read_text()


def test_speedups_divide_by_plain_ar_and_by_the_reference_of_the_same_prompt():
    from dynatree.bench import _speedups
    row = lambda p, m, tps, ref: {"prompt_id": p, "method": m, "tokens_per_s": tps, "ref_method": ref}  # noqa: E731
    rows = _speedups([row(0, "ar", 100.0, "ar"), row(0, "ar_t0.8", 50.0, "ar_t0.8"), row(0, "dts", 75.0, "ar_t0.8"),
                      row(1, "ar", 200.0, "ar"), row(1, "ar_t0.8", 100.0, "ar_t0.8"), row(1, "dts", 50.0, "ar_t0.8")])
    assert [(r["speedup"], r["speedup_ref"]) for r in rows if r["method"] == "dts"] == [(0.75, 1.5), (0.25, 0.5)]


def test_a_batch_row_counts_its_identical_rows_and_divides_all_tokens_by_all_wall_time():
    from dynatree.bench import MethodSpec, _batch_row
    r = _batch_row("d", MethodSpec("dyn", "dynatree"), 2, [[1, 2, 3], [4, 5]], [([7, 8, 9], None), ([7, 7, 7], None)],
                   2.0, [[7, 8, 9], [7, 8, 9]], "ar", 3, 16)
    assert (r["rows_matching_ar"], r["rows"], r["matches_ar"]) == (1, 2, False)
    assert (r["new_tokens"], r["wall_time_s"], r["tokens_per_s"], r["prompt_tokens"]) == (6, 2.0, 3.0, 5)
    whole = _batch_row("d", MethodSpec("dyn", "dynatree"), 2, [[1], [2]], [([7], None), ([8], None)], 1.0, [[7], [8]],
                       "ar", 1, 16)
    assert (whole["rows_matching_ar"], whole["matches_ar"]) == (2, True)


def test_the_batch_sweep_warms_up_untimed_takes_turns_and_times_each_method_over_all_its_batches(close_pair,
                                                                                                  monkeypatch):
    """A clock that ticks once per reading: each timed batch is 1 s, so each method's wall time is
    its number of batches (the warm-up, 4 tokens, is not timed), and methods rotate batch by batch."""
    import types

    import dynatree.bench as bench
    import dynatree.engine as engine
    from dynatree.bench import batch_rows, parse_methods

    ticks = iter(range(10**6))
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    real, calls = engine.decode_batch, []

    def decode_batch(pair, prompts, cfg, **k):
        calls.append((type(cfg).__name__, k["max_new_tokens"], len(prompts)))
        return real(pair, prompts, cfg, **k)

    monkeypatch.setattr(engine, "decode_batch", decode_batch)
    prompts = [[5 + i, 9, 13 + i, 20, 31] for i in range(3)]
    rows = batch_rows(close_pair, "d", prompts, parse_methods("ar,linear"), (2,), max_new_tokens=3,
                      max_prompt_tokens=5, log=lambda m: None)
    assert calls[:6] == [("ARConfig", 4, 2), ("LinearConfig", 4, 2),  # warm-ups, then batches [0:2], [2:3] in turns
                         ("ARConfig", 3, 2), ("LinearConfig", 3, 2), ("LinearConfig", 3, 1), ("ARConfig", 3, 1)], calls
    # (then batch-1 ar's reference tokens, one prompt at a time)
    for r in rows:
        assert (r["wall_time_s"], r["new_tokens"], r["tokens_per_s"]) == (2.0, 9, 4.5), r


def test_windowed_batch_rows_are_checked_against_the_windowed_ar(close_pair):
    """A StreamingLLM row at B is compared with batch-1 ar of the same window (its tokens differ
    from plain ar's here), and names that ar as its reference."""
    from dynatree.bench import batch_rows, parse_methods
    from dynatree.config import make_config
    from dynatree.engine import decode

    prompts = [[5 + i, 9, 13 + i, 20, 31, 40 + i, 7, 8, 60, 61, 62, 11, 12 + i, 70, 71, 72] for i in range(2)]
    win = {"kv_window": 20, "kv_evict": 4}
    plain, windowed = ([decode(close_pair, p, make_config("ar", o), max_new_tokens=12, ignore_eos=True)[0]
                        for p in prompts] for o in ({}, win))
    assert all(a != w for a, w in zip(plain, windowed))  # (what makes the check below tell the references apart)
    methods = parse_methods("ar,sspec=linear", [f"sspec.{k}={v}" for k, v in win.items()])
    rows = batch_rows(close_pair, "d", prompts, methods, (2,), max_new_tokens=12, max_prompt_tokens=16,
                      log=lambda m: None)
    assert {r["method"]: (r["ref_method"], r["rows_matching_ar"]) for r in rows} == {
        "ar": ("ar", 2), "sspec": ("ar_window20_evict4", 2), "ar_window20_evict4": ("ar_window20_evict4", 2)}


def test_methods_take_presets_under_any_label_and_options_given_override_the_preset():
    """LABEL=PRESET is the preset's method and options; options given to every method override the
    preset's, a method's own override both; a window's shape with no window, and a peer's own
    option, are refused."""
    from dynatree.bench import parse_methods
    specs = {m.label: m for m in parse_methods("ar,ss=streaming_spec,plain=streaming_spec", ["ss.k=4", "kv_window=512"])}
    assert (specs["ss"].method, specs["ss"].options) == ("linear", {"k": 4, "kv_window": 512})
    assert specs["plain"].options == {"k": 6, "kv_window": 512}
    with pytest.raises(ValueError, match="--option kv_sinks: no method in --methods has a cache window"):
        parse_methods("ar,dynatree", ["kv_sinks=2"])
    with pytest.raises(ValueError, match="transformers peers take no options of their own"):
        parse_methods("ar,hf_ar", ["hf_ar.temperature=0.5"])


def test_bench_says_how_many_prompts_it_measures_and_refuses_a_warm_up_of_them_all(pair_dirs, tmp_path):
    args = bench_args(pair_dirs, tmp_path, 5, 2) + ["--methods", "ar", "--out", str(tmp_path / "o")]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "has 3 usable prompts (texts of at least 200 characters), fewer than --prompts 5: measuring 2" in res.output
    at = args.index("--warmup") + 1
    res = CliRunner().invoke(main, args[:at] + ["3"] + args[at + 1:])
    assert res.exit_code == 1 and "3 usable prompts (texts of at least 200 characters) leave none to measure " \
        "after --warmup 3" in res.output, res.output


def test_bench_defaults_and_threads_reach_the_run(pair_dirs, tmp_path):
    """Without --prompts, --warmup and --max-prompt-tokens the bench runs the paper's 10 prompts,
    2 warm-up and L_max = 200 (cut to what the 128-token context holds beside T); a --grid-* flag
    alone takes the other two axes' defaults (depth 5, branch 2, tau 0.02); --threads sets torch's."""
    import torch

    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"text": TEXTS}), data)
    was = torch.get_num_threads()
    want = 1 if was != 1 else 2
    out = tmp_path / "d"
    try:
        res = CliRunner().invoke(main, ["bench", "--target", str(pair_dirs / "target"),
                                        "--draft", str(pair_dirs / "draft"), "--device", "cpu", "--dtype", "float64", "--dataset", f"tiny={data}",
                                        "--max-new-tokens", "2", "--methods", "ar", "--grid-branch", "3",
                                        "--threads", str(want), "--out", str(out)])
    finally:
        torch.set_num_threads(was)
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "bench.json").read_text())
    s = meta["spec"]
    assert (s["prompts"], s["warmup"], s["max_prompt_tokens"]) == (10, 2, 200) and meta["max_prompt_tokens_kept"] == 126
    assert s["grid"] == {"depth": [5], "branch": [3], "tau": [0.02]} and meta["threads"] == want


def test_check_summary_counts_matches_and_averages_tokens_per_second():
    """`dynatree check`'s table row per method: prompts checked, matching (or "ref"), the mean
    tok/s and tok/iter over the prompts, and each mismatch named by its file row."""
    from dynatree.cli import _check_summary

    def row(m, p, tps, match, tpi=None):
        return {"method": m, "prompt": p, "tokens_per_s": tps, "matches_ar": match, "tokens_per_iteration": tpi,
                "first_divergence": None if match is not False else 3, "divergence_margin": None}
    rows = [row("ar", 0, 10.0, None), row("ar", 1, 20.0, None), row("dyn", 0, 30.0, True, 2.0),
            row("dyn", 1, 60.0, False, 3.0)]
    assert _check_summary("p", rows, [4, 7]) == [("p", "ar", 2, "ref", 15.0, None, [], None),
                                                 ("p", "dyn", 2, 1, 45.0, 2.5, [(7, 3, None)], None)]


def test_check_keeps_an_ar_under_a_label_of_its_own(pair_dirs, tmp_path):
    """`check` leaves out only the references it decodes anyway (listed once): an ar listed under
    a label of its own keeps its row."""
    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"text": TEXTS[:2]}), data)
    res = CliRunner().invoke(main, ["check", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"),
                                    "--device", "cpu", "--dtype", "float64", "--prompts", str(data),
                                    "--methods", "mine=ar,linear", "--max-new-tokens", "4", "--max-prompt-tokens", "16"])
    assert res.exit_code == 0, res.output
    table = [line.split() for line in res.output.splitlines() if line.startswith(str(data))]
    assert {t[1]: t[2] for t in table} == {"ar": "2", "mine": "2", "linear": "2"}, res.output


def test_the_sweep_tables_split_an_iteration_into_draft_verify_and_the_rest_after_prefill():
    from dynatree.report import _per_iteration_ms
    r = {"iterations": 2, "draft_forwards": 3, "draft_time_s": 0.002, "verify_time_s": 0.004, "prefill_time_s": 0.002,
         "wall_time_s": 0.010}
    assert _per_iteration_ms([r]) == "1.00 / 2.00 / 1.00"


def test_profile_times_a_prefill_the_context_holds(pair_dirs):
    """--prefill at the context's length: one token less is timed, and said."""
    res = CliRunner().invoke(main, ["profile", "--target", str(pair_dirs / "target"), "--device", "cpu",
                                    "--prefix", "16", "--prefill", "128", "--repeats", "1", "--kernel", "hf"])
    assert res.exit_code == 0, res.output
    assert "--prefill 128: the models' context is 128 tokens; timing a prefill of 127" in res.output
    assert "target prefill of 127 tokens" in res.output


def test_commands_say_sampling_options_change_nothing_at_temperature_zero(pair_dirs, tmp_path):
    """generate, check, bench and a job's driver each say it once (not per method or actor)."""
    from dynatree.jobs.driver import run_job
    from dynatree.jobs.spec import build_spec

    pair = ["--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--device", "cpu",
            "--dtype", "float64"]
    said = "top_p=0.9 changes nothing at temperature 0 (greedy decoding)"
    with pytest.warns(UserWarning, match=re.escape(said)) as warned:  # (printed as "warning: ..." by the command: cli.main)
        res = CliRunner().invoke(main, ["generate", *pair, "--prompt", "hi", "--max-new-tokens", "2", "--option",
                                        "top_p=0.9"])
    assert res.exit_code == 0 and len(warned) == 1, res.output
    args = bench_args(pair_dirs, tmp_path, 2, 2)
    res = CliRunner().invoke(main, args + ["--methods", "ar,linear", "--option", "top_p=0.9", "--out", str(tmp_path / "b")])
    assert res.exit_code == 0 and res.output.count(f"note: ar, linear: {said}") == 1, res.output
    res = CliRunner().invoke(main, ["check", *pair, "--prompts", str(tmp_path / "prompts.parquet"), "--limit", "1",
                                    "--methods", "linear", "--option", "top_p=0.9", "--max-new-tokens", "2"])
    assert res.exit_code == 0 and res.output.count(f"note: ar, linear: {said}") == 1, res.output
    pq.write_table(pa.table({"text": TEXTS[:2]}), tmp_path / "in.parquet")
    logged = []
    run_job(build_spec(None, input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out"), method="linear",
                       target=str(pair_dirs / "target"), draft=str(pair_dirs / "draft"), device="cpu",
                       dtype="float64", max_new_tokens=4, options={"top_p": "0.9"}), progress=False, log=logged.append,
            dry_run=True)
    assert f"note: {said}; sampling needs a temperature above 0 (e.g. temperature=0.8)" in logged, logged


def test_input_problems_are_found_before_the_models_load(pair_dirs, tmp_path, monkeypatch):
    """check read each --prompts file after decoding the ones before it (a typo in the second path
    lost the first's results), and check's and bench's input errors waited for the models to load
    (the measurement trial): both now fail first, nothing decoded."""
    import dynatree.models

    monkeypatch.setattr(dynatree.models, "load_pair", lambda *a, **k: pytest.fail("the models loaded first"))
    pair = ["--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--device", "cpu"]
    args = bench_args(pair_dirs, tmp_path, 2, 2)  # (writes prompts.parquet)
    good = str(tmp_path / "prompts.parquet")
    for extra, said in (([good, "--prompts", str(tmp_path / "nope.parquet")], "no input files found"),
                        ([good, "--prompt-column", "txt"], "no column 'txt'")):
        res = CliRunner().invoke(main, ["check", *pair, "--prompts", *extra, "--max-new-tokens", "2"])
        assert res.exit_code == 1 and said in res.output, res.output
    for extra, said in ((["--dataset", f"bad={tmp_path / 'nope.parquet'}"], "no input files found"),
                        (["--out", f"{good}/sub"], "cannot take the results"),
                        (["--sweep-tokens", "2", "--sweep-methods", "dynatre"], "--sweep-methods dynatre: not among")):
        res = CliRunner().invoke(main, args + extra + ([] if "--out" in extra else ["--out", str(tmp_path / "b")]))
        assert res.exit_code == 1 and said in res.output, res.output
        assert not (tmp_path / "b").exists()


def test_the_fma_probe_runs_no_more_threads_than_cpus(monkeypatch):
    """--threads 64 on 2 CPUs recorded "656 GFLOP/s on 64 threads (3.71x one thread's)": no machine's
    peak. The probe runs on the CPUs there are and says the run asked for more."""
    from dynatree import machine, native

    calls = []
    monkeypatch.setattr(native, "fma_peak", lambda n: calls.append(n) or 100.0 * n)
    monkeypatch.setattr(native, "variant", lambda: "avx2")
    monkeypatch.setattr(machine, "usable_cpus", lambda: 2)
    rates = machine.fma_rates(64)
    assert calls == [2, 1] and (rates["threads"], rates["run_threads"], rates["gflops"]) == (2, 64, 200.0)
    assert machine.describe_rates(rates).endswith("on 2 threads (2.00x one thread's 100.0) (the run's 64 threads "
                                                  "exceed the CPUs)")
    assert "run_threads" not in machine.fma_rates(2)
