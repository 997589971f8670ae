"""The ``dynatree`` command line.  Commands only parse flags and call the library."""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
import types
import warnings
from pathlib import Path

import click

from .config import DTYPE_ALIASES, DTYPE_NAMES, KERNELS, KV_DTYPES, METHODS, dtype_name, is_device_name, options_help


def _fail(msg: str) -> None:
    raise click.ClickException(msg)


def _margin(m: float | None) -> str:
    return "unknown (evicted by the cache window)" if m is None else f"{m:.3g}"


def _threads(n: int | None, device: str = "cpu") -> None:
    """--threads: the native kernel runs on torch's thread count (its OpenMP regions split work
    evenly, so a thread the OS pauses for another process stalls each forward) -- with a note,
    from a thread that measures while the command loads its models, when other processes leave
    fewer free CPUs than that."""
    import threading

    import torch

    if n:
        torch.set_num_threads(n)
    if device.startswith("cuda") or device == "auto" and torch.cuda.is_available():
        return
    threading.Thread(target=_note_shared_cores, args=(torch.get_num_threads(),), daemon=True).start()


def _note_shared_cores(threads: int) -> None:
    from .machine import busy_cpus, usable_cpus

    note = cores_note(busy_cpus(), threads, usable_cpus())  # (taskset: the CPUs this process may use)
    if note:
        click.echo(note, err=True)


def cores_note(busy: float | None, threads: int, cpus: int) -> str | None:
    """The note for ``threads`` forward threads where other processes keep ``busy`` of ``cpus``
    CPUs busy, or None when the threads fit in what they leave free (half a CPU of slack)."""
    if threads < 2 or threads + (busy or 0.0) <= cpus + 0.5:
        return None
    wait = (f"a forward on {threads} threads waits at every step for any thread {{}}, which can make decoding many "
            "times slower: give --threads {} (no more threads than free CPUs)")
    if threads > cpus:  # (more threads than CPUs, whatever else runs: a taskset, --threads 64)
        return "note: " + wait.format("that has no CPU of its own", cpus) + f"; this process may use {cpus} CPUs"
    return (f"note: other processes are using ~{busy:.1f} of this machine's {cpus} CPUs; "
            + wait.format("they displace", max(1, min(threads - 1, round(cpus - busy)))) + " if it runs slowly")


THREADS_HELP = "torch and kernel threads (default: torch's, one per core; fewer when other work shares the cores)"


class _Commands(click.Group):
    """Every command ends on Ctrl-C or SIGTERM as `run` and `bench` do: "interrupted" / "terminated
    (SIGTERM)" and the shell's 130 / 143 (click said "Aborted!" and exited 1, like a failure; a
    SIGTERM ended a command with no word and no cleanup -- a kernel build left its compilers and a
    temporary object behind).  Commands that say more (what was kept) catch it first."""

    def invoke(self, ctx):
        from .signals import ask, interrupted

        ask()
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            how, code = interrupted(e)
            click.echo(f"\n{how}", err=True)
            sys.exit(code)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dynatree")
def main() -> None:
    """Exact tree speculative decoding (DynaTree, DySpec) for batch generation."""
    warnings.formatwarning = _short_warning


_default_format = warnings.formatwarning


def _short_warning(message, category, filename, lineno, line=None) -> str:
    """dynatree's own warnings as one line for a command-line user (others as Python prints them)."""
    if Path(filename).resolve().is_relative_to(Path(__file__).resolve().parent):
        return f"warning: {message}\n"
    return _default_format(message, category, filename, lineno, line)


def _pair_options(f):
    """The model flags of every command, from JobSpec's fields (the same as `dynatree run`'s)."""
    import dataclasses

    from .jobs.spec import JobSpec

    fields = {fld.name: fld for fld in dataclasses.fields(JobSpec)}
    here = {"device": "auto (a CUDA GPU where there is one, else the CPU), cpu, cuda or cuda:N"}  # (no actors here)
    for name in reversed(("target", "draft", "device", "dtype", "kernel")):
        fld, choices = fields[name], fields[name].metadata.get("choices")
        f = click.option(f"--{name}", default=fld.default, show_default=fld.default is not None,
                         type=click.Choice(list(choices)) if choices else str,
                         callback=_device_checked if name == "device" else None,
                         help=here.get(name, fld.metadata["help"]))(f)
    return f


def _device_checked(_ctx, _param, value: str) -> str:
    """--device as a usage error where it names no device (exit 2, as --dtype's is: trial AM)."""
    if not is_device_name(value):
        raise click.BadParameter(f"choose auto, cpu, cuda or cuda:N, not {value!r}")
    return value


_METHOD_OPTIONS = "\b\nMethod options (--option key=value):\n" + options_help()  # (generate's only: trial AM)


@main.command(epilog=_METHOD_OPTIONS)
@_pair_options
@click.option("--method", default="dynatree", show_default=True, type=click.Choice(list(METHODS)),
              help="decoding method (ar: plain greedy or sampled decoding with the target alone)")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
              help="method option, repeatable (listed below)")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1),
              help="the most new tokens per completion (fewer at EOS or a stop)")
@click.option("--prompt", "prompts", multiple=True,
              help="prompt text (default: read stdin, less the newline that ends its last line); repeat it "
                   "to decode several prompts together, "
                   "many sequences per forward")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1),
              help="keep each prompt's last N tokens, a BOS the tokenizer adds among them (default: all; unlike "
                   "`dynatree run`, no cut to fit the context)")
@click.option("--ignore-eos", is_flag=True, help="generate exactly --max-new-tokens tokens")
@click.option("--chat-template", is_flag=True,
              help="send each prompt through the target tokenizer's chat template: a text as a user message, a "
                   "JSON list of {\"role\", \"content\"} messages (or one message) as that conversation")
@click.option("--stop", "stop", multiple=True, help="end where the generated text contains this string "
              "(repeatable; the text ends before it; a newline in a shell: $'\\n')")
@click.option("--stop-token-id", "stop_token_ids", multiple=True, type=click.IntRange(min=0),
              help="end when this token id is generated (repeatable)")
@click.option("--samples", default=1, show_default=True, type=click.IntRange(min=1),
              help="draws per prompt (needs --option temperature=T), each with its own seed, a prompt's together")
@click.option("--check-ar", is_flag=True, help="also decode with ar and report whether tokens match")
@click.option("--json", "as_json", is_flag=True,
              help="print a JSON object (token_ids, text, metrics); one per line for several prompts "
                   "(without it, several prompts' texts each follow a '--- prompt N ---' line)")
@click.option("--threads", type=click.IntRange(min=1), help=THREADS_HELP)
def generate(target, draft, device, dtype, kernel, method, options, max_new_tokens, max_prompt_tokens, prompts,
             ignore_eos, chat_template, stop, stop_token_ids, samples, check_ar, as_json, threads):
    """Generate a continuation of one prompt, or of several decoded as one batch."""
    from . import engine
    from .config import ContextError, make_config, parse_options
    from .models import PairError, conversation, load_pair
    from .parts import file_text

    _threads(threads, device)
    # (`echo text | dynatree generate` must decode "text", not "text\n": another prompt, other tokens)
    if not prompts and sys.stdin.isatty():  # (it waited in silence at a terminal: trial AM)
        click.echo("reading the prompt from stdin: type it, then Ctrl-D (or give --prompt)", err=True)
    prompts = list(prompts) or [file_text(sys.stdin.read())]  # (as a .txt input reads)
    blank = [i for i, p in enumerate(prompts) if not p.strip()]
    if blank:
        _fail(f"{engine.prompt_name(blank[0], len(prompts))} is empty or only whitespace")
    try:
        cfg = make_config(method, parse_options(options))
        pair = load_pair(target, draft, device=device, dtype=dtype, load_draft=method != "ar", kernel=kernel)
        said = next((i for i, p in enumerate(prompts) if not chat_template and isinstance(conversation(p), list)), None)
        if said is not None:  # (the Python API applies the template to a message list itself)
            click.echo(f"note: {engine.prompt_name(said, len(prompts))} reads as a list of chat messages; without "
                       "--chat-template it is decoded as plain text (add --chat-template to apply the target's "
                       "chat template)", err=True)
        if chat_template or max_prompt_tokens:
            prompts = [_prompt_ids(pair, p, chat_template, max_prompt_tokens, engine.prompt_name(i, len(prompts)))
                       for i, p in enumerate(prompts)]
        limits = dict(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop=stop, stop_token_ids=stop_token_ids,
                      samples=samples)
        gens = engine.generate_batch(pair, prompts, method, cfg, **limits)
        # (the same keys for one generation as for several: a parser need not tell the cases apart)
        results = [{"prompt": i // samples, "sample": i % samples, **g.as_dict()} for i, g in enumerate(gens)]
        compared = _check_ar(pair, method, cfg, prompts, gens, results, limits) if check_ar else []
    except (PairError, ValueError) as e:
        cut = getattr(e, "prompt_problem", False) and isinstance(e, ContextError) and not chat_template
        _fail(_as_flags(f"{e}") + (" -- or --max-prompt-tokens N keeps its last N" if cut else ""))
    except (MemoryError, RuntimeError) as e:  # (torch's allocator: "can't allocate memory"; trial AE)
        if not isinstance(e, MemoryError) and "allocate" not in str(e):
            raise
        _fail(f"out of memory decoding {len(prompts)} prompt(s) x {samples} sample(s) together (one batch): fewer "
              "prompts or --samples per call, or --max-prompt-tokens, need less; `dynatree run` batches a file of "
              f"them within its actors' memory ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    _print_generations(pair, method, gens, results, compared, samples, as_json)
    if not as_json:
        _say_if_idle(method, cfg, gens)
    window = not as_json and any(g.finish_reason == "context" for g in gens) and engine.window_options(pair, cfg)
    if window:  # (where these models take a window)
        click.echo(f"note: finish=context: {pair.context_said} is full; a cache window "
                   "generates past it (StreamingLLM: the first tokens and the most recent are kept), e.g. "
                   + " ".join(f"--option {o}" for o in window.split()), err=True)


def _check_ar(pair, method: str, cfg, prompts: list, gens: list, results: list[dict], limits: dict) -> list[str]:
    """generate --check-ar: each generation against ar with its seed and cache window (matches_ar,
    and where it differs, how close the target's top two were); returns what each was compared with."""
    from . import engine
    from .check import divergence
    from .config import ar_reference, make_config, reference_label

    # (--method ar is its own reference: decoding it twice compared it with itself)
    refs = gens if method == "ar" else engine.generate_batch(pair, prompts, "ar", ar_reference(cfg), **limits)
    own = [ar_reference(make_config(method, g.options)) for g in gens]  # (each sample's own seed)
    compared = [" (--method ar is the reference itself)" if method == "ar" else _compared_with(pair, r) for r in own]
    for i, (res, ref, gen) in enumerate(zip(results, refs, gens)):
        res["matches_ar"] = ref.token_ids == gen.token_ids
        res["ar_reference"] = reference_label(own[i])  # (what --json readers compared with)
        if not res["matches_ar"]:
            ids = engine.prompt_token_ids(pair, prompts[i // limits["samples"]])
            res["first_divergence"], res["divergence_margin"] = divergence(
                pair, ids, ref.token_ids, gen.token_ids, make_config(method, gen.options))
    return compared


def _print_generations(pair, method: str, gens: list, results: list[dict], compared: list[str], samples: int,
                       as_json: bool) -> None:
    """The generations: JSON lines, or each text on stdout and its numbers on stderr."""
    forward = pair.forward_in_use("target")  # (the kernel a user asked for is not always the one that ran)
    drafted = pair.draft is not None and any(g.metrics.draft_forwards for g in gens)
    draft_forward = pair.forward_in_use("draft") if drafted else None
    if not as_json:
        click.echo(f"target forward: {forward}" + (f"\ndraft forward: {draft_forward}" if drafted else ""), err=True)
    for i, (gen, result) in enumerate(zip(gens, results)):
        if as_json:
            result["forward"] = forward
            result["draft_forward"] = draft_forward  # (null: no draft ran)
            click.echo(json.dumps(result))
            continue
        which = (f"prompt {result['prompt']}" + (f" sample {result['sample']}" if samples > 1 else "")
                 if len(gens) > 1 else "")
        if which:  # several texts on stdout: each under its own header (--json for a parser)
            click.echo(f"--- {which} ---")
        click.echo(gen.text)
        m = gen.metrics
        which += ": " if which else ""
        click.echo(f"\n[{method}] {which}{m.new_tokens} tokens in {m.wall_time_s:.2f}s = {m.tokens_per_s:.1f} tok/s, "
                   f"{m.iterations} iterations"
                   + (f", {m.tokens_per_iteration:.2f} tokens/iteration" if m.iterations else "") + ", "
                   f"finish={gen.finish_reason}" + (f", matches_ar={result['matches_ar']}{compared[i]}" if compared else "")
                   + (f" (first difference at token {result['first_divergence']}, target top-2 logit margin there "
                      f"{_margin(result['divergence_margin'])})" if result.get("first_divergence") is not None else ""),
                   err=True)


_THRESHOLDS = {"fixed_tree": "tau", "dynatree": "tau", "dyspec": "threshold"}  # (the option that prunes candidates)


def _say_if_idle(method: str, cfg, gens) -> None:
    """A method that drafted nothing ran as ar does: say so, and why it may have (a new pair's
    draft can sit below thresholds tuned for another: a user's trial saw 1.00 tokens/iteration)."""
    ran = [g.metrics for g in gens if g.metrics.iterations]
    if method == "ar" or not ran or any(m.mean_tree_size for m in ran) or sum(m.iterations for m in ran) < 8:
        return  # (a few iterations, or the last tokens of a generation, leave no room to draft)
    knob = None if getattr(cfg, "mode", None) == "heap" else _THRESHOLDS.get(method)  # (DySpec's heap: no threshold)
    why = [f"every candidate fell below its {knob} (the draft's probabilities are low here: thresholds suit one "
           f"pair, not every pair; try a lower --option {knob}=...)"] if knob else []
    if getattr(cfg, "budget_on", False):
        why.append("the hardware budget priced every tree out (--option hw_budget=off drafts regardless)")
    click.echo(f"note: {method} drafted no token in {sum(m.iterations for m in ran)} iterations, so it ran as ar "
               "does" + (": " + " or ".join(why) if why else ""), err=True)


def _as_flags(message: str) -> str:
    """The engine's "options kv_window=64 kv_evict=16" (the Python API's words) as flags."""
    return re.sub(r"(?<![-\w])options? ((?:\w+=\S+)(?: \w+=\S+)*)",
                  lambda m: " ".join(f"--option {o}" for o in m.group(1).split()), message)


def _compared_with(pair, ref) -> str:
    """What --check-ar compared with, where it is not plain float32-kernel ar: the ar with the
    method's cache window, cache dtype or sampling, and the bfloat16 kernel's ar under lean-bf16."""
    from .config import reference_label

    label = reference_label(ref)
    bf16 = _bf16_compute(pair)
    if label == "ar" and not bf16:
        return ""
    return f" (against {label}" + (" on this bfloat16-compute kernel, not float32's" if bf16 else "") + ")"


@main.command(epilog=_METHOD_OPTIONS)
@_pair_options
@click.option("--prompts", "prompt_files", multiple=True, required=True,
              help="prompt source: Parquet/Arrow/JSONL file, directory or glob (repeatable)")
@click.option("--prompt-column", default="text", show_default=True)
@click.option("--limit", type=click.IntRange(min=1),
              help="first N prompts of each file (rows that are null, empty, only whitespace or not text are skipped, not counted)")
@click.option("--methods", default="linear,fixed_tree,dynatree,dyspec", show_default=True,
              help="comma-separated methods; LABEL=METHOD runs a method under another name "
                   "(e.g. dyspec_heap=dyspec with --option dyspec_heap.mode=heap)")
@click.option("--option", "options", multiple=True, metavar="[LABEL.]KEY=VALUE",
              help="method option, repeatable: LABEL.KEY=VALUE one method's (e.g. dynatree.tau=0.01), "
                   "KEY=VALUE every method's (e.g. temperature=0.6)")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1),
              help="the most new tokens per prompt (fewer at EOS)")
@click.option("--max-prompt-tokens", default=200, show_default=True, type=click.IntRange(min=1),
              help="prompts keep their last L_max tokens (fewer if the context needs room for the new ones)")
@click.option("--chat-template", is_flag=True,
              help="render each prompt with the target tokenizer's chat template, as run's and generate's: text as "
                   "a user message (JSON messages as that conversation), a column of messages as conversations")
@click.option("--reference-dtype", type=click.Choice([*DTYPE_NAMES, *DTYPE_ALIASES]),
              help="also compare every row, ar's too, with ar on the target loaded in this dtype (e.g. float32 "
                   "beside a bfloat16 run: how far the precision moved the text, with the reference's top-2 "
                   "margin where it parts); the target is loaded a second time")
@click.option("--reference-kernel", type=click.Choice(KERNELS),
              help="the kernel of --reference-dtype's target (default lean; given alone, the reference is "
                   "--dtype's target on this kernel)")
@click.option("--threads", type=click.IntRange(min=1), help=THREADS_HELP)
def check(target, draft, device, dtype, kernel, prompt_files, prompt_column, limit, methods, options,
          max_new_tokens, max_prompt_tokens, chat_template, reference_dtype, reference_kernel, threads):
    """Decode prompts with ar and each method; report token-for-token equality and speed."""
    _threads(threads, device)
    from .actors.worker import prompt_ids
    from .check import all_windowed, check_methods, prompt_budget
    from .data import InputError, read_texts
    from .config import ARConfig, make_config, reference_label, unused_options_notes
    from .metrics import freeze_heap
    from .models import PairError, load_pair
    from .policies import make_policy
    from .signals import end_on_sigterm, interrupted

    try:
        from .bench import parse_methods
        cfgs = {m.label: make_config(m.method, m.options) for m in parse_methods(methods, options)}
        for note in unused_options_notes(cfgs):
            click.echo(f"note: {note}", err=True)
        # the references check_methods decodes anyway (parse_methods lists them for the bench)
        cfgs = {k: c for k, c in cfgs.items() if not (isinstance(c, ARConfig) and k == reference_label(c))}
        if not cfgs and not reference_dtype and not reference_kernel:  # (it checked ar against itself, exit 0: trial AM)
            raise ValueError(f"--methods {methods}: only the ar reference itself, nothing to compare with it; name a "
                             "method (e.g. dynatree), or ar with --reference-dtype to compare precisions")
        # every file read before the models load: a typo in the second path lost the first's results
        # (the measurement trial); with a template, --limit counts the conversations that render (_rendered)
        sources = [(path, *_usable_prompts(path, read_texts(path, prompt_column), None if chat_template else limit,
                                           chat_template)) for path in prompt_files]
        pair = load_pair(target, draft, device=device, dtype=dtype, kernel=kernel)
        if chat_template and not pair.has_chat_template:
            raise PairError("--chat-template: the target's tokenizer has no chat template")
        cfgs = pair.decodable(cfgs, lambda msg: click.echo(msg, err=True)) if cfgs else cfgs
        pair.check_methods(cfgs)
        pair.need_draft([label for label, c in cfgs.items() if make_policy(c).needs_draft])  # (before ar's decoding)
        reference = _reference_pair(pair, target, device, reference_dtype, reference_kernel)
        freeze_heap()  # (metrics.py: a full collection walked the loaded pair mid-decode)
        end_on_sigterm()  # (SIGTERM ends it as Ctrl-C does: with the table of what was checked)
    except (PairError, ValueError, InputError) as e:
        _fail(str(e))
    try:
        keep = prompt_budget(pair.max_context, all_windowed(cfgs.values()), max_prompt_tokens, max_new_tokens)
    except ValueError as e:
        _fail(str(e))
    _say_forwards(pair, drafted=any(make_policy(c).needs_draft for c in cfgs.values()))
    summary = []
    if chat_template:  # (a job's prompt policy for chat rows: actors/worker.prompt_ids), every file before any decoding
        sources = [(path, *_rendered(path, at, texts, lambda v: prompt_ids(
            pair, v, max_new_tokens, max_prompt_tokens, all_windowed(cfgs.values()), chat=True), limit))
            for path, at, texts in sources]
    else:  # (each prompt's last `keep` tokens: the prompt policy)
        sources = [(path, at, [pair.encode(t, last=keep) for t in texts]) for path, at, texts in sources]
    for path, at, prompts in sources:
        try:
            rows = check_methods(pair, prompts, cfgs, max_new_tokens=max_new_tokens, reference=reference,
                                 progress=lambda i, n: click.echo(f"  {path}: {i}/{n} prompts", err=True))
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: the table of what was checked whole
            summary += _check_summary(path, getattr(e, "partial_rows", []), at)
            how, code = interrupted(e)
            click.echo(f"\n{how}: the prompts checked so far" + (":" if summary else ": none"), err=True)
            _check_table(summary, reference)
            sys.exit(code)
        summary += _check_summary(path, rows, at)
    _check_table(summary, reference)
    if any(s[6] for s in summary):
        sys.exit(1)


def _reference_pair(pair, target, device, dtype, kernel):
    """check --reference-dtype/--reference-kernel's target (None without them): loaded a second time,
    without a draft; a reference in the run's own precision is refused (it would compare ar with itself)."""
    from .config import dtype_name
    from .models import PairError, load_pair

    if dtype is None and kernel is None:
        return None
    ref = load_pair(target, None, device=device, dtype=dtype_name(dtype) or str(pair.dtype).removeprefix("torch."),
                    kernel=kernel or "lean", load_draft=False)
    if ref.dtype == pair.dtype and ref.forward_in_use("target") == pair.forward_in_use("target"):
        raise PairError(f"--reference-dtype/--reference-kernel: the reference ({ref.forward_in_use('target')}, "
                        f"{str(ref.dtype).removeprefix('torch.')}) computes as the run does; give another dtype or kernel")
    click.echo(f"reference: ar on the target in {str(ref.dtype).removeprefix('torch.')}, {ref.forward_in_use('target')}",
               err=True)
    return ref


def _bf16_compute(pair) -> bool:
    """Whether the target's forward computes in bfloat16 (lean-bf16 on the native kernel)."""
    return pair.kernel == "lean-bf16" and pair.forward_in_use("target").startswith("native")


def _say_forwards(pair, drafted: bool) -> None:
    """check's line on what runs the forwards (the kernel asked for is not always the one that runs:
    float64 runs torch's ops), and on what its ar references compute in under lean-bf16."""
    said = f"target forward: {pair.forward_in_use('target')}"
    if drafted:
        said += f"\ndraft forward: {pair.forward_in_use('draft')}"
    if _bf16_compute(pair):
        said += "\nthe ar references run on this bfloat16-compute kernel, as every method does: not float32's"
    click.echo(said, err=True)


def _usable_prompts(path: str, values: list, limit: int | None, chat: bool = False) -> tuple[list[int], list]:
    """The first ``limit`` (all with None) values that are prompts, and their row numbers in the file;
    rows that are null, empty, only whitespace or not text are skipped and named, not counted (as bench's
    --prompts); with ``chat`` (--chat-template) chat messages (a list or a mapping) are prompts too."""
    at, bad = [], []
    for i, t in enumerate(values):
        if limit is not None and len(at) == limit:
            break
        usable = isinstance(t, str) and t.strip() or chat and isinstance(t, (list, tuple, dict)) and len(t) > 0
        (at if usable else bad).append(i)
    if bad:
        click.echo(f"  {path}: skipping {len(bad)} prompt(s) that are null, empty, only whitespace or not "
                   f"{'text or chat messages' if chat else 'text'} "
                   f"(rows {', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''})", err=True)
    chats = 0 if chat else sum(isinstance(values[i], (list, dict)) for i in bad)
    if chats:  # (a chat column: skipped as "not text" without a word on what to run instead)
        click.echo(f"  {path}: {chats} of them hold chat messages: add --chat-template to render them with the "
                   "target's chat template", err=True)
    if not at:
        _fail(f"{path}: no prompts to check")
    return at, [values[i] for i in at]


def _rendered(path: str, at: list[int], values: list, encode, limit: int | None = None) -> tuple[list[int], list]:
    """check --chat-template's first ``limit`` prompts (all with None): each value's ids by ``encode``
    (a job's prompt policy for chat rows); a conversation the template refuses, or one longer than the
    policy keeps (a rendered one is never cut: its last tokens would lose the template's header), is
    skipped and named, as a job makes it that row's error, and not counted."""
    kept, prompts, refused = [], [], []
    for i, value in zip(at, values):
        if limit is not None and len(kept) == limit:
            break
        try:
            prompts.append(encode(value))
            kept.append(i)
        except ValueError as e:
            refused.append(f"row {i}: {e}")
    if refused:
        click.echo(f"  {path}: skipping {len(refused)} prompt(s) that cannot be rendered to fit: "
                   + "; ".join(refused[:3]) + (" ..." if len(refused) > 3 else ""), err=True)
    if not kept:
        _fail(f"{path}: no prompts to check")
    return kept, prompts


def _check_summary(path: str, rows: list[dict], at: list[int]) -> list[tuple]:
    """check's table rows for one prompts file: (path, method, checked, matching or "ref", tok/s, tok/iter, mismatches,
    against the reference pair: None, or (identical, [(prompt, index, margin)]));
    ``at``: the file's row number of each prompt checked (what a mismatch is named by)."""
    from .metrics import defined_mean

    out = []
    for label in dict.fromkeys(r["method"] for r in rows):  # each once: references and methods
        rs = [r for r in rows if r["method"] == label]
        bad = [r for r in rs if r["matches_ar"] is False]
        ok = "ref" if all(r["matches_ar"] is None for r in rs) else len(rs) - len(bad)  # (a reference checks nothing)
        out.append((path, label, len(rs), ok, sum(r["tokens_per_s"] for r in rs) / len(rs),
                    defined_mean(r["tokens_per_iteration"] for r in rs),
                    [(at[r["prompt"]], r["first_divergence"], r["divergence_margin"] and round(r["divergence_margin"], 5))
                     for r in bad], _against_reference(rs, at)))
    return out


def _against_reference(rows: list[dict], at: list[int]) -> tuple | None:
    """One method's rows against the reference pair's ar: (identical, [(prompt, index, margin)]), or None."""
    if not rows or "reference_matches" not in rows[0]:
        return None
    parted = [(at[r["prompt"]], r["reference_divergence"], r["reference_margin"] and round(r["reference_margin"], 5))
              for r in rows if not r["reference_matches"]]
    return len(rows) - len(parted), parted


def _check_table(summary: list[tuple], reference=None) -> None:
    if not summary:
        return
    w = max(11, *(len(s[1]) for s in summary))
    pw = max(12, *(len(s[0]) for s in summary))  # whole paths: a cut one can name the wrong file
    click.echo(f"{'prompts file':<{pw}} {'method':<{w}} {'checked':>7} {'match':>6} {'tok/s':>7} {'tok/iter':>8}")
    for path, label, n, ok, tps, tpi, bad, _ in summary:
        click.echo(f"{path:<{pw}} {label:<{w}} {n:>7} {ok:>6} {tps:>7.1f} {'-' if tpi is None else f'{tpi:.2f}':>8}"
                   + (f"  mismatches (prompt, index, margin): {bad}" if bad else ""))
    if reference is None:
        return
    # (the rows against --reference-dtype's ar: a difference there is the precision's, not an error,
    # and does not change check's exit status)
    click.echo(f"\nagainst ar on the target in {str(reference.dtype).removeprefix('torch.')} -- where the text "
               f"parts, the reference's top-2 logit margin there; its forward: {reference.forward_in_use('target')}")
    click.echo(f"{'prompts file':<{pw}} {'method':<{w}} {'checked':>7} {'same':>6}")
    for path, label, n, *_, against in summary:
        same, parted = against if against is not None else ("-", [])
        click.echo(f"{path:<{pw}} {label:<{w}} {n:>7} {same:>6}"
                   + (f"  parted (prompt, index, margin): {parted}" if parted else ""))


def _spec_options(f):
    """``dynatree run``'s flags, one per JobSpec field (its type and help come from the field)."""
    import dataclasses

    from .jobs.spec import JobSpec

    for fld in reversed(dataclasses.fields(JobSpec)):
        name = fld.metadata.get("flag", fld.name).replace("_", "-")
        parts = [t.strip() for t in fld.type.split("|")]
        kind = "str" if "str" in parts else parts[0]
        shown = ("on" if fld.default else "off") if kind == "bool" and isinstance(fld.default, bool) else fld.default
        help_ = fld.metadata["help"] + (f" [default: {shown}]" if shown not in (None, "", dataclasses.MISSING) else "")
        if kind == "bool":
            f = click.option(f"--{name}/--no-{name}", fld.name, default=None, help=help_)(f)
        elif kind == "dict":  # (none given leaves the job file's)
            f = click.option(f"--{name}", fld.name, multiple=True, metavar="KEY=VALUE", help=fld.metadata["help"],
                             callback=lambda _ctx, _param, v: v or None)(f)
        elif fld.metadata.get("repeat"):  # given once per value; none given leaves the job file's
            f = click.option(f"--{name}", fld.name, multiple=True, type=fld.metadata.get("item", str),
                             callback=lambda _ctx, _param, v: v or None, help=fld.metadata["help"])(f)
        else:
            choices = fld.metadata.get("choices")
            kind = click.Choice(list(choices)) if choices else {"int": int, "float": float}.get(kind, str)
            if "None" in parts and kind in (int, float):  # (a job file's limit: 2 could not be undone: trial AM)
                kind, help_ = _OrNone(kind), help_ + " (none: unset, as if not given)"
            f = click.option(f"--{name}", fld.name, type=kind, default=None, help=help_)(f)
    return f


class _OrNone(click.ParamType):
    """A number, or ``none`` for the field's unset value (jobs.spec.CLEARED: a flag not given
    leaves a job file's value)."""

    def __init__(self, kind):
        self.kind, self.name = kind, f"{kind.__name__}|none"

    def convert(self, value, param, ctx):
        from .jobs.spec import CLEARED

        if isinstance(value, str) and value.strip().lower() in ("none", "null"):
            return CLEARED
        return click.types.convert_type(self.kind).convert(value, param, ctx)


def _how_to_go_on(spec, fields: dict, error: BaseException | None = None) -> str:
    """What a job ended early left and how to finish it (jobs/runs.py), with how far the run got."""
    from .jobs.runs import how_to_go_on

    out = spec.output if spec is not None else fields.get("output")
    overwrite = spec.overwrite if spec is not None else fields.get("overwrite")
    return how_to_go_on(out, bool(overwrite), getattr(error, "run_record", None))


@main.command(epilog=_METHOD_OPTIONS)
@click.option("--config", "config_file", type=click.Path(), help="job file (YAML or JSON); flags override it")
@_spec_options
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--dry-run", is_flag=True, help="check the job and print its plan (rows, shards to do, columns), "
                                             "without starting Ray or writing to the output")
def run(config_file, quiet, dry_run, **fields):
    """Run a batch generation job over Ray actors; write Parquet shards and a summary."""
    from .config import parse_options
    from .jobs.driver import ClusterLost, JobError, MismatchError, run_job
    from .signals import ask, interrupted, quiet_exit
    from .jobs.spec import SpecError, build_spec
    from .jobs.summary import every_row_failed

    ask()  # SIGTERM ends the job as Ctrl-C does, once Ray is up
    import importlib.util
    if importlib.util.find_spec("ray") is None:  # (a base install: the driver imports it at the first check)
        _fail("dynatree run needs Ray: pip install 'dynatree[ray]' (or '.[ray]' in a checkout)")
    spec = None
    try:  # (a bad flag or job file is a usage error, exit 2, as click's own are: a failed job's 1 it was, trial AM)
        spec = build_spec(config_file, **fields)  # (--option and --resource KEY=VALUE strings: parsed there)
    except SpecError as e:
        raise click.UsageError(str(e)) from e
    try:
        summary = run_job(spec, progress=not quiet, log=lambda m: click.echo(m, err=True), dry_run=dry_run)
    except ClusterLost as e:  # Ray's shutdown would wait a minute for the lost head, then abort
        if e.summary is not None:  # (the job finished: its table, and a note)
            _print_summary(e.summary, spec)
            click.echo(f"note: {e}", err=True)
        else:
            click.echo(f"Error: {e}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if e.summary is not None else 1)
    except MismatchError as e:  # the job finished: its table first, as for any finished job
        quiet_exit()
        _print_summary(e.summary, spec)
        _fail(str(e))
    except (JobError, ValueError) as e:
        _fail(str(e))
    except OSError as e:  # a full disk, a file gone from under the job: finished shards are whole
        _fail(str(e) if dry_run else f"{e}; once that is fixed -- {_how_to_go_on(spec, fields, e)}")  # (a read-only
        # shards/ or a full disk stays so: "the same command resumes" alone read as "run it again", trial AK)
    except KeyboardInterrupt as e:
        how, code = interrupted(e)
        click.echo(f"\n{how}: {_how_to_go_on(spec, fields, e)}", err=True)
        if getattr(e, "cluster_gone", False):  # (the local cluster died too: Ray's shutdown would wait for it)
            sys.stderr.flush()
            os._exit(code)
        sys.exit(code)
    if dry_run:
        click.echo("\n".join(f"{k:<22} {v}" for k, v in summary.items() if k != "options"))
        click.echo(f"{'options':<22} " + " ".join(f"{k}={v}" for k, v in summary["options"].items()))
        return
    quiet_exit()
    _print_summary(summary, spec)
    if (failed := every_row_failed(summary)) is not None:
        _fail(failed)


def _print_summary(summary: dict, spec) -> None:
    from .jobs.summary import format_table
    click.echo(format_table(summary))
    out = os.path.abspath(spec.output)  # (under `ray job submit` the working directory is Ray's)
    quote = shlex.quote  # (a path with spaces or $ broke when pasted into a shell: trial AK)
    click.echo(f"results: {quote(out + '/shards')} (a Parquet dataset: pyarrow.dataset.dataset or pandas.read_parquet "
               f"reads the directory)   summary: {quote(out + '/summary.json')}")


def _prompt_ids(pair, prompt: str | list | dict, chat: bool, keep: int | None, name: str) -> list[int]:
    """A generate prompt's ids under --chat-template / --max-prompt-tokens; a ValueError names the
    prompt among several."""
    from .check import truncate_prompt

    try:
        ids = pair.encode_chat(prompt) if chat else pair.encode(prompt, last=keep)
        return truncate_prompt(ids, keep, chat)
    except ValueError as e:
        raise type(e)(str(e) if name == "prompt" else f"{name}: {e}") from e


def _number_list(s: str | None, flag: str = "", lo: int = 1, kind: type = int) -> tuple:
    """A comma-separated flag's whole numbers (``kind`` float: numbers), each >= lo (a clear error otherwise)."""
    try:
        out = tuple(kind(x) for x in s.split(",") if x.strip()) if s else ()
    except ValueError:
        what = "whole numbers" if kind is int else "numbers"
        raise click.BadParameter(f"{s!r} is not a comma-separated list of {what}", param_hint=flag) from None
    if any(x < lo for x in out):
        raise click.BadParameter(f"{s!r}: every value must be >= {lo}", param_hint=flag)
    if len(set(out)) < len(out):  # (two rows of one setting would be compared as different ones)
        raise click.BadParameter(f"{s!r} names a value twice", param_hint=flag)
    return out


@main.command(epilog=_METHOD_OPTIONS)
@_pair_options
@click.option("--dataset", "datasets", multiple=True, required=True,
              help="wikitext, pg19 (hub), a file/dir/glob, or NAME=PATH; repeatable")
@click.option("--prompt-column", default="text", show_default=True)
@click.option("--prompts", "n_prompts", default=10, show_default=True, type=click.IntRange(min=1),
              help="N prompts per dataset: its first N texts of at least 200 characters (shorter ones are skipped)")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(min=0), help="first W prompts discarded")
@click.option("--max-prompt-tokens", default=200, show_default=True, type=click.IntRange(min=1),
              help="L_max: prompts keep their last L_max tokens (fewer if the context needs room for the T new ones)")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1), help="T (EOS ignored)")
@click.option("--methods", default="ar,linear,fixed_tree,dynatree,dyspec,hf_ar,hf_assisted,hf_assisted_heuristic,hf_prompt_lookup",
              show_default=True, help="LABEL=METHOD runs a method under another name")
@click.option("--option", "options", multiple=True, metavar="[LABEL.]KEY=VALUE",
              help="LABEL.KEY=VALUE sets one method's option; KEY=VALUE every method's (e.g. temperature=0.6)")
@click.option("--sweep-tokens", help="comma-separated T values for the generation-length sweep")
@click.option("--sweep-prompt-len", help="comma-separated L_max values for the prompt-length sweep")
@click.option("--sweep-methods", default="ar,dynatree", show_default=True, help="labels run in the T/L sweeps ('all': every method); "
                                                                         "the ar each one is checked against runs too")
@click.option("--batch-sizes", help="comma-separated B values: tokens/s per actor decoding B prompts per forward "
                                    "(instead of the one-at-a-time main table; hf_ar runs transformers' batched generate)")
@click.option("--grid-depth", help="fixed-tree grid depths, e.g. 3,4,5,6,7,8")
@click.option("--grid-branch", help="fixed-tree grid branching, e.g. 2,3,4")
@click.option("--grid-tau", help="fixed-tree grid tau, e.g. 0.01,0.02,0.03,0.05,0.1")
@click.option("--threads", type=click.IntRange(min=1), help=THREADS_HELP)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False))
def bench(target, draft, device, dtype, kernel, datasets, prompt_column, n_prompts, warmup, max_prompt_tokens,
          max_new_tokens, methods, options, sweep_tokens, sweep_prompt_len, sweep_methods, batch_sizes, grid_depth,
          grid_branch, grid_tau, threads, out_dir):
    """Benchmark methods and transformers' peers with the paper's protocol; write Parquet, Markdown, PNG."""
    from .bench import BenchSpec, parse_methods, prepare, run_bench
    from .data import InputError
    from .signals import end_on_sigterm, interrupted
    from .metrics import freeze_heap
    from .models import PairError, load_pair
    from .report import report

    _threads(threads, device)
    try:
        grid = {}
        if grid_depth or grid_branch or grid_tau:
            grid = {"depth": list(_number_list(grid_depth, "--grid-depth") or (5,)),
                    "branch": list(_number_list(grid_branch, "--grid-branch") or (2,)),
                    "tau": list(_number_list(grid_tau, "--grid-tau", lo=0, kind=float) or (0.02,))}
        spec = BenchSpec(datasets=tuple(datasets), methods=tuple(parse_methods(methods, options)),
                         prompts=n_prompts, warmup=warmup, max_prompt_tokens=max_prompt_tokens,
                         max_new_tokens=max_new_tokens, prompt_column=prompt_column,
                         sweep_tokens=_number_list(sweep_tokens, "--sweep-tokens"),
                         sweep_prompt_len=_number_list(sweep_prompt_len, "--sweep-prompt-len"),
                         grid=grid, sweep_methods=tuple(m for m in sweep_methods.split(",") if m),
                         batch_sizes=_number_list(batch_sizes, "--batch-sizes"))
        log = lambda m: click.echo(m, err=True)  # noqa: E731
        loaded = prepare(spec, out_dir, log)  # (datasets, --out, --sweep-methods: before the models load)
        pair = load_pair(target, draft, device=device, dtype=dtype, kernel=kernel, transformers_models=spec.hf_peers)
        freeze_heap()  # (metrics.py: a full collection walked the loaded pair mid-measurement)
        end_on_sigterm()
        out = run_bench(pair, spec, out_dir, log=log, loaded=loaded)
    except (PairError, InputError, ValueError) as e:
        _fail(str(e))
    except OSError as e:  # (a disk that filled up while measuring: the checks at the start passed)
        _fail(f"--out {out_dir}: could not write the results: {e.strerror or e}")
    except KeyboardInterrupt as e:
        how, code = interrupted(e)
        saved = (f"the prompts measured so far are in {out_dir}/results.parquet (`dynatree report {out_dir}` "
                 "tables them)" if getattr(e, "saved", False) else "nothing was measured yet; nothing written")
        click.echo(f"\n{how}: {saved}", err=True)
        sys.exit(code)
    try:
        md, pngs = report(out)
    except KeyboardInterrupt as e:  # the measurements are whole; only the tables and plots are not
        how, code = interrupted(e)
        click.echo(f"\n{how} while writing the report: every measurement is in {out}/results.parquet; "
                   f"`dynatree report {out}` writes summary.md and the plots", err=True)
        sys.exit(code)
    except OSError as e:  # (the disk filled up: the measurements were written first)
        _fail(f"could not write the report in {out} ({e.strerror or e}); every measurement is in "
              f"{out}/results.parquet: `dynatree report {out}` writes summary.md and the plots once there is room")
    click.echo(md.read_text())
    click.echo(f"wrote {out}/results.parquet, {md}, " + ", ".join(str(p) for p in pngs))
    _say_unmarked(out)


@main.command()
@_pair_options
@click.option("--prefix", default=256, show_default=True, type=click.IntRange(min=0),
              help="cached tokens before the timed forwards (at most the context less the largest forward timed, less 1)")
@click.option("--prefill", default=300, show_default=True, type=click.IntRange(min=0),
              help="prompt tokens of the timed prefill (0: skip; less than the context)")
@click.option("--repeats", default=9, show_default=True, type=click.IntRange(min=1),
              help="timings per size (the median is shown)")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="rounds of the native-against-MKL comparison, the two kernels taking turns (the ratios "
                   "are the rounds' medians; --kernel lean on the native kernel only)")
@click.option("--cache-lengths", help="comma-separated cached-token counts: target forwards of 1 and 16 tokens "
                                      "at each, to show where attention over a long cache takes over")
@click.option("--kv-dtype", type=click.Choice([*KV_DTYPES, "bf16"]), default="model", show_default=True,
              help="the caches' key/value storage (as the method option kv_dtype)")
@click.option("--sequences", default=16, show_default=True, type=click.IntRange(min=0),
              help="also time a decode step of this many sequences, each over its own cache, against one "
                   "sequence of as many tokens (0: skip)")
@click.option("--threads", type=click.IntRange(min=1), help=THREADS_HELP)
def profile(target, draft, device, dtype, kernel, prefix, prefill, repeats, rounds, cache_lengths, kv_dtype,
            sequences, threads):
    """Time target forwards over 1-64 new tokens and draft forwards over 1-16 (what hw_budget uses),
    a prompt prefill, and the throughput of each extra token.  DYNATREE_ISA=avx2|generic picks the
    native kernel's variant (see README)."""
    from .metrics import freeze_heap
    from .models import PairError, load_pair
    from .profiling import report

    _threads(threads, device)
    lengths = _number_list(cache_lengths, "--cache-lengths")
    try:
        pair = load_pair(target, draft, device=device, dtype=dtype, kernel=kernel)
    except (PairError, ValueError) as e:
        _fail(str(e))
    freeze_heap()  # (metrics.py: a full collection walked the loaded pair mid-timing)
    report(pair, prefix, prefill, repeats, rounds, lengths, dtype_name(kv_dtype), sequences)


@main.command()
@click.option("--isa", "isas", multiple=True,
              help="variant to build (native, avx2, generic; repeatable; default: the one jobs use here, "
                   "as DYNATREE_ISA selects, and a failure to build it is only a warning); 'all' builds "
                   "every variant this CPU runs")
def build(isas):
    """Compile the native CPU kernel for this machine now, so that the first job does not wait for
    it (run it where you install: an image build, a cluster's setup_commands).  Builds are kept in
    DYNATREE_CACHE (~/.cache/dynatree), keyed by sources, compiler, flags and CPU."""
    import time

    from . import kbuild

    requested = bool(isas)
    unknown = [i for i in isas if i != "all" and i not in kbuild.VARIANTS]
    if unknown:
        _fail(f"--isa {unknown[0]}: choose {', '.join(kbuild.VARIANTS)} or all")
    named = os.environ.get("DYNATREE_ISA")
    if not isas and named and named not in kbuild.VARIANTS:  # a typo there would leave every job on torch's
        _fail(f"DYNATREE_ISA={named!r}: choose {', '.join(kbuild.VARIANTS)} (or unset it: native)")
    if not isas and named and named not in kbuild.variants_here():  # (as would a variant this CPU cannot run)
        _fail(f"DYNATREE_ISA={named} cannot run on this CPU: choose {', '.join(kbuild.variants_here())} (or unset it)")
    isas = kbuild.variants_here() if "all" in isas else list(isas) or [kbuild.variant()]
    failed = False
    for isa in isas:
        t0 = time.perf_counter()
        path, why = kbuild.build(isa)
        if path is None:
            failed = True
            click.echo(f"{isa}: not built: {why}", err=True)
        else:
            click.echo(f"{isa}: {path} ({time.perf_counter() - t0:.1f} s)")
    if failed and requested:  # by default a machine without a compiler is not an error: jobs run on torch's kernels
        _fail("some kernels were not built; jobs fall back to torch's kernels where the native one is missing")


def _unfinished(out_dir: str) -> str | None:
    """What an output whose job has not finished holds, and how it goes on: a job writing it now, or
    the last run's record (jobs/runs.py: how it ended, which shards failed), or the shard count."""
    from .jobs import runs
    from .jobs.plan import JobError, check_unlocked

    try:
        planned = json.loads((Path(out_dir) / "manifest.json").read_text()).get("shards")
    except ValueError:
        planned = None
    held = len(list(Path(out_dir, "shards").glob("part-*.parquet")))
    try:
        check_unlocked(out_dir)
    except JobError:  # (it read "re-run its command", which the lock then refused)
        try:
            who = Path(out_dir, ".dynatree.lock").read_text().strip() or "pid unknown"
        except OSError:  # (it finished meanwhile)
            who = "pid unknown"
        return (f"a dynatree job is writing {out_dir} now ({who}): {held} of {planned if planned else '?'} shard "
                "files so far; its summary comes when it finishes")
    last = (runs.read(out_dir) or [None])[-1]
    if last is not None and last.get("status") != "complete":
        return runs.describe(out_dir, last)
    if last is not None and Path(out_dir, "summary.json").is_file():
        return None  # (it finished between report_cmd's look and this one: trial AN)
    return (f"{out_dir} is a `dynatree run` output whose job has not finished ({held} of "
            f"{planned if planned else '?'} shards written, no summary.json yet): re-run its command to resume it "
            "(without --overwrite; with --dry-run: its plan, nothing decoded)")


@main.command("report")
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
def report_cmd(out_dir):
    """Rebuild summary.md and PNG plots from a bench directory's results.parquet (or print a
    `dynatree run` output's summary table)."""
    from .report import NothingMeasured, report

    if not (Path(out_dir) / "results.parquet").is_file():
        job = Path(out_dir) / "summary.json"
        if (Path(out_dir) / "manifest.json").is_file() and not job.is_file():  # (a job stopped or failed before its
            unfinished = _unfinished(out_dir)  # summary: said as such)
            if unfinished is not None:
                _fail(unfinished)
        if job.is_file() and (Path(out_dir) / "manifest.json").is_file():  # a run's output: its table, as run printed it
            try:
                summary = json.loads(job.read_text())
                _print_summary(summary, types.SimpleNamespace(output=out_dir))
                planned = json.loads((Path(out_dir) / "manifest.json").read_text()).get("shards")
                held = len(list(Path(out_dir, "shards").glob("part-*.parquet")))
                if planned and held < planned:
                    click.echo(f"warning: {out_dir}/shards holds {held} of the job's {planned} shards now: rows this "
                               "summary counts were moved or deleted (re-running the job redoes them)", err=True)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                _fail(f"cannot read {job} ({type(e).__name__}: {e}); re-running the job's `dynatree run` command "
                      "rewrites it without decoding what is done")
            return
        _fail(f"{out_dir} is not a `dynatree bench` output directory (it has no results.parquet) nor a finished "
              "`dynatree run` output (no summary.json and manifest.json)")
    try:
        md, pngs = report(out_dir)
    except NothingMeasured as e:
        _fail(f"{out_dir}: {e}")
    except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged or foreign results.parquet / bench.json
        _fail(f"{out_dir}: cannot read its bench results ({type(e).__name__}: {e})")
    click.echo(md.read_text())
    click.echo(f"wrote {', '.join(map(str, [md, *pngs]))}")
    _say_unmarked(Path(out_dir))


def _say_unmarked(out: Path) -> None:
    """Plot-named files this bench or report did not draw and left alone (report.unmarked_plots)."""
    from .report import unmarked_plots

    left = unmarked_plots(out)
    if left:
        click.echo(f"note: {', '.join(p.name for p in left)} in {out}: named like plots, but not drawn by this "
                   "bench or report (an older dynatree's, or yours): left as they are", err=True)


@main.command("train-pair")
@click.option("--corpus", required=True, help="Parquet/Arrow/JSONL/text file, directory, glob or dataset")
@click.option("--column", default="text", show_default=True, help="the corpus column holding text")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="directory for the pair: target/ and draft/ (each with the tokenizer), card.json")
@click.option("--vocab-size", default=4096, show_default=True, help="the byte-level BPE tokenizer's size")
@click.option("--target-shape", default="4,192,4", show_default=True, help="layers,hidden,heads")
@click.option("--draft-shape", default="2,96,2", show_default=True, help="layers,hidden,heads")
@click.option("--seq-len", default=256, show_default=True, help="tokens per training window")
@click.option("--batch-size", default=16, show_default=True, help="windows per training step")
@click.option("--context", default=1024, show_default=True, help="max_position_embeddings")
@click.option("--target-minutes", default=10.0, show_default=True, help="the target's training time (wall clock)")
@click.option("--draft-minutes", default=5.0, show_default=True,
              help="the draft's training time, distilled toward the target (KL + cross-entropy)")
@click.option("--lr", default=2e-3, show_default=True, help="learning rate of both models")
@click.option("--max-chars", default=40_000_000, show_default=True, help="corpus size cap")
@click.option("--bf16/--no-bf16", default=True, show_default=True, help="bfloat16 autocast")
@click.option("--seed", default=0, show_default=True, help="initialisation and data order")
@click.option("--overwrite", is_flag=True, help="replace what --out holds (a pair trained before)")
def train_pair_cmd(corpus, column, out_dir, vocab_size, target_shape, draft_shape, seq_len, batch_size,
                   context, target_minutes, draft_minutes, lr, max_chars, bf16, seed, overwrite):
    """Train a small Pythia-architecture target/draft pair on CPU (tokenizer, target, distilled draft)."""
    from .data import InputError
    from .training import ModelShape, TrainConfig, train_pair

    def shape(s):
        try:
            layers, hidden, heads = (int(x) for x in s.split(","))
        except ValueError:
            _fail(f"shape {s!r} is not layers,hidden,heads")
        return ModelShape(layers, hidden, heads)  # (TrainConfig checks the sizes)

    try:
        cfg = TrainConfig(vocab_size=vocab_size, target=shape(target_shape), draft=shape(draft_shape),
                          seq_len=seq_len, batch_size=batch_size, context=context,
                          target_minutes=target_minutes, draft_minutes=draft_minutes, lr=lr,
                          max_chars=max_chars, bf16=bf16, seed=seed)
        train_pair(corpus, column, out_dir, cfg, log=lambda m: click.echo(m, err=True), overwrite=overwrite)
    except (InputError, ValueError) as e:
        _fail(str(e))


@main.command("widen")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--factor", default=2, show_default=True, help="width multiple: hidden size, heads and MLP")
@click.option("--layers", type=int, default=None, help="layers in all (identities past SRC's own) [default: SRC's]")
@click.option("--vocab", type=int, default=None, help="LM-head rows (extra ones never chosen) [default: SRC's]")
def widen_cmd(src, out, factor, layers, vocab):
    """Grow a GPT-NeoX model to a larger model's cost with the same function (a benchmark pair at
    the paper's sizes: e.g. the bench pair's target with --factor 5 --layers 32 --vocab 50304 has
    Pythia-2.8B's matrices and the bench target's greedy choices)."""
    from .widen import widen_dir

    try:
        click.echo(widen_dir(src, out, factor, layers, vocab))
    except (ValueError, OSError) as e:  # (not a GPT-NeoX model, no weights there, an unwritable OUT)
        _fail(str(e))


if __name__ == "__main__":
    main()
