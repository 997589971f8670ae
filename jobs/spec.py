"""The job spec: one validated object built from a YAML/JSON file and/or CLI flags.

``JobSpec``'s fields are the job's schema: ``dynatree run``'s flags are generated from them
(cli.py; each field's ``help``), job files use their names, and the actors receive the spec itself.

Fields that change what is generated (models, kernel, method, options, lengths, prompt
handling, input, shard size) form the *output identity*: a re-run on the same output directory
must have the same identity, or it is refused unless ``overwrite`` is set.  Fields that only
change how the work is spread (actors, CPUs, batch size, address, deadlines) may differ between
a run and its resume: outputs do not depend on them (the batched engine is batch invariant).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path

from dynatree.config import (ANNOTATION_TYPES, DTYPE_ALIASES, DTYPE_NAMES, KERNELS, METHODS, check_samples,
                             did_you_mean, dtype_name, is_device_name, make_config, non_default_options, parse_options,
                             unused_fields)
from dynatree.names import looks_local
from dynatree.stops import Stop

from .placement import RESOURCE_UNIT  # (an amount below it: placement divided by zero)

# tests only, read by actors: {"die_once_on_shard": name} or {"die_always_on_shard": name} as JSON
FAULTS_ENV = "DYNATREE_FAULT_INJECTION"
MAX_INFLIGHT = 256  # shards queued per actor at most: each is a thread of the actor (trial AE: 10k threads)


class SpecError(ValueError):
    """The job spec is invalid."""


OUTPUT_IDENTITY = ("input", "prompt_column", "id_column", "keep_columns", "target", "draft", "kernel",
                   "method", "options", "max_new_tokens", "max_prompt_tokens", "ignore_eos", "dtype",
                   "shard_size", "verify_fraction", "stop", "stop_token_ids", "chat_template", "samples", "limit")
# identity fields left out of identity() while they hold their default, so that jobs started before
# the field existed keep their identity (and resume)
_LATER_FIELDS = {"stop": (), "stop_token_ids": (), "chat_template": False, "samples": 1, "limit": None}


def _f(default, help: str, **meta):
    """A JobSpec field; ``help`` is its ``dynatree run`` flag's help (cli.py builds the flags)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class JobSpec:
    input: str = _f("", "Parquet/Arrow/JSONL file, directory or glob, or a datasets name/dir")
    output: str = _f("", "output directory (shards/, manifest.json, summary.json)")
    prompt_column: str = _f("text", "column holding prompts")
    id_column: str | None = _f(None, "column holding ids (default: the input's id column when it has one without "
                                     "nulls or duplicates, else the row index)")
    limit: int | None = _f(None, "decode only the input's first N rows: a trial run before the whole corpus (part of "
                                 "the output's identity: the full job goes to another --output, or --overwrite)")
    keep_columns: tuple | None = _f(None, "input columns copied to every output row, comma-separated "
                                          "(default: all; 'none' for none)")
    target: str | None = _f(None, "target model: hub name or local directory (default: the bundled demo pair)")
    draft: str | None = _f(None, "draft model: hub name or local directory (default: the bundled demo pair's, "
                                 "with no --target; with one, none: only ar runs without a draft)")
    kernel: str = _f("lean", "forward the engine runs: lean (dynatree's CPU kernels), lean-bf16 (the same in "
                             "bfloat16 compute), lean-mkl (the same forward on torch's GEMMs) or hf (transformers')", choices=KERNELS)
    method: str = _f("dynatree", "decoding method", choices=METHODS)
    options: dict = _f({}, "method option KEY=VALUE, repeatable", flag="option")
    max_new_tokens: int = _f(128, "new tokens per prompt (T)")
    max_prompt_tokens: int | None = _f(512, "L_max: prompts keep their last L_max tokens (a BOS the tokenizer adds among them)")
    ignore_eos: bool = _f(False, "generate max_new_tokens even past EOS")
    samples: int = _f(1, "completions drawn per prompt, each an output row (its number in column sample, "
                         "its own seed); needs sampling (--option temperature=...)")
    chat_template: bool = _f(False, "render each prompt with the target tokenizer's chat template: a string as "
                                    "one user message, or a list of {role, content} messages")
    stop: tuple = _f((), "end a row where its generated text contains this string; the text ends before "
                         "it (repeatable; a newline in a shell: $'\\n')", repeat=True)
    stop_token_ids: tuple = _f((), "end a row when it generates this token id, kept like EOS (repeatable)",
                               repeat=True, flag="stop_token_id", item=int)
    device: str = _f("auto", "auto, cpu or cuda (each actor is given its own GPU, which it sees as cuda:0)")
    dtype: str = _f("float32", "weights' dtype (fp32, bf16, fp16, fp64: their short names)",
                    choices=(*DTYPE_NAMES, *DTYPE_ALIASES))
    batch_size: int | str = _f("auto", "rows each actor decodes together: a number, or auto (tuned "
                                       "from measured throughput)")
    max_batch_size: int = _f(64, "the largest batch auto may pick")
    num_actors: int | None = _f(None, "actors (default: as many as the cluster's nodes hold at this shape)")
    cpus_per_actor: float = _f(2.0, "CPUs (and threads) per actor")
    gpus_per_actor: float | None = _f(None, "GPUs per actor (default: 1 when the cluster has GPUs)")
    memory_per_actor: float | None = _f(None, "GB of memory each actor reserves (Ray's memory resource: "
                                              "actors go only where it is free; default: none reserved)")
    resources_per_actor: dict = _f({}, "a custom Ray resource each actor asks for, KEY=VALUE (repeatable): actors go "
                                       "only to nodes that offer it (`ray start --resources '{\"KEY\": N}'`)",
                                   flag="resource")
    prefix_cache_gb: float = _f(1.0, "GB per model (target and draft: up to twice this per actor) for the "
                                     "keys/values of prompt beginnings that several prompts share (a template, "
                                     "few-shot examples): computed once, copied after; 0 turns it off")
    shard_size: int = _f(64, "rows per output file (the unit of resume and retry)")
    max_inflight_per_actor: int | None = _f(None, "shards queued per actor (default: enough to keep "
                                                  "its batch full)")
    max_retries: int = _f(3, "attempts per shard after actor failures (a shard that failed beside others "
                                    "first runs alone, uncharged: only a failure alone counts)")
    verify_fraction: float = _f(0.0, "fraction of output rows (a prompt, or with --samples a prompt's sample) "
                                         "re-decoded with ar to check equality, picked by id hash")
    fail_on_mismatch: bool = _f(False, "exit non-zero if a checked row differs from ar")
    address: str | None = _f(None, "Ray cluster to run on: its GCS address HOST:PORT (the port of `ray "
                                       "start --head --port`, 6379 unless set; not the dashboard's), "
                                       "ray://HOST:10001 (its Ray client server) or auto (default: start "
                                       "a local cluster)")
    placement_timeout_s: float = _f(60.0, "give up if the actors cannot be placed within this time")
    ready_timeout_s: float = _f(900.0, "give up if actors have not loaded the models within this time")
    resume: bool = _f(True, "continue a job found in output")
    overwrite: bool = _f(False, "discard what output holds")

    def __post_init__(self):
        wrong = _type_problems(self)
        if wrong:  # before any comparison: "16" < 1 would raise a TypeError, not say which field
            raise SpecError("invalid job spec: " + "; ".join(wrong))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))  # one name per dtype: in checks and the identity
        problems = []
        if self.dtype not in DTYPE_NAMES:
            problems.append(f"dtype must be one of {', '.join(DTYPE_NAMES)} (or {', '.join(DTYPE_ALIASES)}), "
                            f"got {self.dtype!r}")
        if not self.input:
            problems.append("input is required")
        if not self.output:
            problems.append("output is required")
        if self.max_new_tokens < 1:
            problems.append("max_new_tokens must be >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            problems.append("max_prompt_tokens must be >= 1")
        if self.limit is not None and self.limit < 1:
            problems.append("limit must be >= 1")
        if self.max_retries < 0:
            problems.append("max_retries must be >= 0")
        if self.shard_size < 1:
            problems.append("shard_size must be >= 1")
        if self.batch_size != "auto" and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            problems.append(f"batch_size must be a number >= 1 or auto, got {self.batch_size!r}")
        if self.max_batch_size < 1:
            problems.append("max_batch_size must be >= 1")
        if not 0.0 <= self.verify_fraction <= 1.0:
            problems.append("verify_fraction must be within [0, 1]")
        elif self.fail_on_mismatch and self.verify_fraction == 0:  # (a CI gate that checked nothing: trial AM)
            problems.append("fail_on_mismatch fails the job on a row verify_fraction checks, and verify_fraction is 0: "
                            "no row would be checked (set verify_fraction, e.g. 0.1 or 1)")
        for name in ("target", "draft", "id_column", "prompt_column", "address"):
            if getattr(self, name) is not None and not str(getattr(self, name)).strip():
                problems.append(f"{name} is empty (an unset shell variable?): name it, or leave it out for its default")
        if self.num_actors is not None and self.num_actors < 1:
            problems.append("num_actors must be >= 1")
        for name in ("placement_timeout_s", "ready_timeout_s"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0 (seconds)")
        if self.cpus_per_actor <= 0:
            problems.append("cpus_per_actor must be > 0")
        if self.max_inflight_per_actor is not None and not 1 <= self.max_inflight_per_actor <= MAX_INFLIGHT:
            problems.append(f"max_inflight_per_actor must be within [1, {MAX_INFLIGHT}] (each is a thread of the actor)")
        if not is_device_name(self.device):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        elif self.device.startswith("cuda:") and self.device != "cuda:0":
            problems.append(f"device {self.device}: a Ray actor sees only the GPUs it was given, numbered "
                            "from 0; use device cuda (each actor gets its own GPU)")
        if self.prefix_cache_gb < 0:
            problems.append("prefix_cache_gb must be >= 0 (0 turns prefix caching off)")
        if self.memory_per_actor is not None and self.memory_per_actor <= 0:
            problems.append("memory_per_actor must be > 0 (GB)")
        problems += _resource_problems(self.resources_per_actor)
        if self.gpus_per_actor is not None and not 0 <= self.gpus_per_actor <= 1:
            problems.append("gpus_per_actor must be within [0, 1]: an actor runs its pair on one GPU "
                            "(start more actors to use more GPUs)")
        elif self.gpus_per_actor == 0 and self.device.startswith("cuda"):
            problems.append(f"device {self.device} with gpus_per_actor 0: Ray gives such actors no GPU (or "
                            "the same one, unaccounted); use gpus_per_actor > 0, or device cpu")
        if self.kernel not in KERNELS:
            problems.append(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}"
                            f"{did_you_mean([str(self.kernel).replace('_', '-').lower()], KERNELS)}")
        elif self.kernel == "lean-bf16" and (self.dtype != "float32" or self.device.startswith("cuda")):
            problems.append("kernel lean-bf16 is dynatree's CPU kernel computing in bfloat16: it loads the models "
                            "as float32 on a CPU (dtype float32, device cpu; auto is the CPU for it)")
        if (self.target is None) != (self.draft is None) and (self.method != "ar" or self.target is None) \
                and all(str(m).strip() for m in (self.target, self.draft) if m is not None):  # (said above)
            problems.append("give both target and draft, or neither (the bundled demo pair); ar needs only a target"
                            if self.target is None else
                            f"method {self.method} needs a draft: add --draft, or run --method ar with a target alone")
        try:
            check_samples(make_config(self.method, self.options), self.samples)
        except (ValueError, TypeError) as e:
            problems.append(str(e))
        try:
            Stop(self.stop, self.stop_token_ids)
        except ValueError as e:
            problems.append(str(e))
        if problems:
            raise SpecError("invalid job spec: " + "; ".join(problems))

    @property
    def cpu_only(self) -> bool:
        """Actors that run on CPUs whatever the cluster has: device cpu, or the CPU-only kernel
        lean-bf16 (device auto there is the CPU: given a GPU, every actor refused to load)."""
        return self.device == "cpu" or self.kernel == "lean-bf16"

    @property
    def batch_rows(self) -> int:
        """The most rows an actor holds in flight."""
        return self.max_batch_size if self.batch_size == "auto" else int(self.batch_size)

    @property
    def inflight_shards(self) -> int:
        """Shards queued per actor: enough rows for a full batch plus one shard to refill from, at
        most MAX_INFLIGHT (a batch bigger than that many shards hold needs a bigger --shard-size)."""
        if self.max_inflight_per_actor is not None:
            return self.max_inflight_per_actor
        return min(-(-self.batch_rows // self.shard_size) + 1, MAX_INFLIGHT)

    @property
    def method_config(self):
        return make_config(self.method, self.options)

    @property
    def stop_rule(self) -> Stop | None:
        return Stop.of(self.stop, self.stop_token_ids)

    def identity(self) -> dict:
        out = {k: getattr(self, k) for k in OUTPUT_IDENTITY
               if k not in _LATER_FIELDS or getattr(self, k) != _LATER_FIELDS[k]}
        out["options"] = canonical_options(self.method, self.options)
        for k in ("stop", "stop_token_ids"):  # a rule's order and repeats do not change the output
            if k in out:
                out[k] = sorted(set(out[k]))
        return out

    def identity_hash(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_BUILT_IN = {"CPU": "give it as --cpus-per-actor (cpus_per_actor in a job file)",
             "GPU": "give it as --gpus-per-actor (gpus_per_actor)", "memory": "give it as --memory-per-actor "
             "(memory_per_actor)",
             # (Ray refused such an actor and every node holding a share of its group crashed: the resource trial)
             "object_store_memory": "Ray's object store is no resource an actor can reserve"}


def _resource_problems(resources: dict) -> list[str]:
    """resources_per_actor's problems: a name Ray's own resources have (their fields say it), or an
    amount that is not a positive number Ray can hold."""
    out = []
    for k, v in resources.items():
        if k in _BUILT_IN:
            out.append(f"resources_per_actor {k}: {_BUILT_IN[k]}")
        elif not isinstance(k, str) or not k:
            out.append(f"resources_per_actor: a resource's name is a non-empty string, got {k!r}")
        elif not _is(v, float) or not math.isfinite(v) or v < RESOURCE_UNIT:
            out.append(f"resources_per_actor {k}: the amount must be a number of at least {RESOURCE_UNIT:g} (Ray's "
                       f"resolution), got {v!r}")
    return out


def canonical_options(method: str, options: dict | None) -> dict:
    """A method's options as its config resolves them, only those away from their defaults: an
    option given at its default (``d_max=8``, ``temperature=0``) or spelled as a string (``"8"``)
    is the same job as one left out, so a resume that spells it otherwise is not refused; so is an
    option that changes nothing (config.unused_fields: ``top_k`` at temperature 0, ``kv_sinks`` with
    no window).  Options the method does not take are kept as given (the spec's check reports them)."""
    try:
        cfg = make_config(method, options)
    except (ValueError, TypeError):
        return dict(options or {})
    unused = unused_fields(cfg)  # (top_k at temperature 0, kv_sinks without a window: the same output)
    return {k: v for k, v in non_default_options(cfg).items() if k not in unused}


def _is(value, t: type) -> bool:
    if isinstance(value, bool) and t is not bool:  # YAML's true/yes is no number
        return False
    return isinstance(value, (int, float)) if t is float else isinstance(value, t)


def _type_problems(spec: JobSpec) -> list[str]:
    """Fields whose value is not of the annotated type (a job file's or a Python caller's)."""
    out = []
    for f in dataclasses.fields(spec):
        value, names = getattr(spec, f.name), [t.strip() for t in str(f.type).split("|")]
        if not any(_is(value, ANNOTATION_TYPES[t]) for t in names):  # (reprlib: a YAML alias bomb's value is huge)
            out.append(f"{f.name} must be {' or '.join(n for n in names if n != 'None')}, got {reprlib.repr(value)}")
        elif f.name == "keep_columns" and value and not all(isinstance(c, str) for c in value):
            out.append(f"keep_columns must be column names, got {reprlib.repr(list(value))}")
        elif isinstance(value, float) and not math.isfinite(value):  # (nan passes every comparison check)
            out.append(f"{f.name} must be a finite number, got {value!r}")
    return out


_EXAMPLES = Path(__file__).resolve().parent / "examples"  # (the bundled job files: a checkout's, or a wheel's)


def _check_file_relative(config_file: str | None, data: dict, overrides: dict) -> None:
    """A job file's relative paths are read from the directory dynatree runs in, not the file's;
    where one is missing from there but found from the file's directory or one above it (the
    repository's examples are relative to its root), say where to run (the later error named only
    the missing path) -- or, in a bundled example, read it from there: from an installed wheel the
    advice was to run inside site-packages, where the output then went (the install trial)."""
    if not config_file:
        return
    base = Path(config_file).resolve().parent
    bundled = base == _EXAMPLES or _EXAMPLES in base.parents
    for k in PATH_FIELDS:
        value = data.get(k)
        if (overrides.get(k) is not None or not isinstance(value, str) or os.path.isabs(value)
                or any(c in value for c in "*?[") or os.path.exists(value)):
            continue
        found = next((d for d in (base, *base.parents) if (d / value).exists()), None)
        if found is not None and bundled:  # (a bundled example, run from anywhere: an installed wheel's too)
            data[k] = str(found / value)
        elif found is not None:
            raise SpecError(f"{k} {value!r} of {config_file} is not found from here ({os.getcwd()}): a job file's "
                            f"relative paths are read from where dynatree runs, not from the file's directory; "
                            f"run from {found}, or give {found / value}")


def _unique_keys(pairs: list) -> dict:
    """A mapping whose keys are each given once: a job file naming a field twice (a pasted line
    left in) would silently take the last value."""
    seen = [k for k, _ in pairs]
    twice = sorted({str(k) for k in seen if seen.count(k) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} given twice")
    return dict(pairs)


def _yaml(text: str):
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):  # (a merge key << may be overridden: not a repeat)
            _unique_keys([(self.construct_object(k, deep=deep), None) for k, _ in node.value
                          if k.tag != "tag:yaml.org,2002:merge"])
            return super().construct_mapping(node, deep=deep)
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader


def _load_file(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise SpecError(f"job file {path} does not exist")
    try:  # (utf-8-sig: a byte-order mark, as Windows editors write one, read as YAML's reader does)
        text = p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise SpecError(f"job file {path} is not UTF-8 text ({e})") from e
    except OSError as e:
        raise SpecError(f"cannot read job file {path}: {e.strerror or e}") from e
    # (.json is JSON; any other name YAML, which reads JSON too: job.YAML or a name without a
    # suffix had been read as JSON and refused with "Expecting value")
    kind = "JSON" if p.suffix.lower() == ".json" else "YAML"
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys) if kind == "JSON" else _yaml(text) or {}
    except Exception as e:  # yaml and json raise different types
        raise SpecError(f"cannot parse job file {path} (read as {kind}): {e}") from e
    if not isinstance(data, dict):
        raise SpecError(f"job file {path} must hold a mapping of fields")
    odd = [k for k in data if not isinstance(k, str)]
    if odd:  # (YAML reads `1:` as a number and `~:` as null)
        raise SpecError(f"job file {path}: a field name {odd[0]!r} is not a name (a stray line?)")
    return data


FLAG_FIELDS = {f.metadata["flag"]: f.name for f in dataclasses.fields(JobSpec) if "flag" in f.metadata}  # resource ->
# resources_per_actor: the flags spelt other than their fields
CLEARED = type("Cleared", (), {"__repr__": lambda self: "none"})()  # a flag's `none`: the field unset
CLI_ONLY = ("config", "quiet", "dry_run")  # `dynatree run` flags that are not job fields


def _field_hint(unknown: list[str], names) -> str:
    """Where a job file's unknown fields went: a flag's spelling of a field (resource for
    resources_per_actor: trial AM), a command-line-only flag, else the closest names."""
    said = []
    for u in unknown:
        key = u.lower().replace("-", "_")
        field_ = FLAG_FIELDS.get(key) or FLAG_FIELDS.get(key.removesuffix("s")) or (key if key in names else None)
        if field_ is not None:
            said.append(f"{u} is spelt {field_} in a job file")
        elif key in CLI_ONLY:
            said.append(f"{u} is a command-line flag (--{key.replace('_', '-')}), not a job field")
    return f" ({'; '.join(said)})" if said else did_you_mean(unknown, names)


def build_spec(config_file: str | None = None, **overrides) -> JobSpec:
    """Job file fields, then non-None overrides (CLI flags); unknown fields are errors."""
    data = _load_file(config_file) if config_file else {}
    _check_file_relative(config_file, data, overrides)
    names = {f.name for f in dataclasses.fields(JobSpec)}
    unknown = sorted((set(data) | set(overrides)) - names)  # (overrides: a Python caller's keywords)
    if unknown:
        raise SpecError(f"unknown job field(s): {', '.join(unknown)}{_field_hint(unknown, names)}; known: "
                        f"{', '.join(sorted(names))}")
    options = _file_options(data.get("options"))
    options.update(_file_options(overrides.pop("options", None)))  # (a Ray Data stage's options= as a file's)
    data.update({k: v for k, v in overrides.items() if v is not None})
    data = {k: None if v is CLEARED else v for k, v in data.items()}  # (`--limit none` over a job file's limit)
    try:  # typed values, so "8" from a flag and 8 from YAML are the same job
        cfg = make_config(data.get("method", "dynatree"), options)
        data["options"] = {k: getattr(cfg, k) for k in options}
    except (ValueError, TypeError) as e:
        raise SpecError(f"invalid job spec: {e}") from e
    data = _coerce(data)
    missing = [k for k in ("input", "output") if not data.get(k)]
    if missing:
        raise SpecError(f"missing required field(s): {', '.join(missing)} "
                        f"(on the command line {', '.join('--' + k for k in missing)})")
    try:
        return JobSpec(**data)
    except TypeError as e:
        raise SpecError(f"invalid job spec: {e}") from e


def _file_options(value) -> dict:
    """A job file's ``options``: a mapping KEY: VALUE, or a list of "KEY=VALUE" strings as the
    --option flag takes them (or one such string); anything else is a SpecError saying so."""
    if value is None or isinstance(value, dict):
        return dict(value or {})
    if isinstance(value, str):  # (one, as one --option)
        if "," in value:
            raise SpecError(f"invalid job spec: options {value!r}: one KEY=VALUE per string; several as a list "
                            "(e.g. ['tau=0.05', 'd_max=6']) or a mapping")
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        try:
            return parse_options(value)
        except ValueError as e:
            raise SpecError(f"invalid job spec: options: {e}") from None
    raise SpecError(f"invalid job spec: options must be a mapping KEY: VALUE (e.g. options: {{d_max: 8}}) or a list "
                    f"of KEY=VALUE strings (or one), got {type(value).__name__} {value!r}")


def _coerce(data: dict) -> dict:
    """Flag strings and YAML values to the field types: "8" and 8 are the same batch size."""
    data = dict(data)
    b = data.get("batch_size")
    if isinstance(b, str) and b.strip().lower() == "auto":
        b = data["batch_size"] = "auto"
    if isinstance(b, str) and b != "auto":
        try:
            data["batch_size"] = int(b)
        except ValueError:
            raise SpecError(f"invalid job spec: batch_size must be a number or auto, got {b!r}") from None
    res = data.get("resources_per_actor")
    if "resources_per_actor" in data and res is None:  # (`resources_per_actor:` left empty in a job file)
        res = data["resources_per_actor"] = {}
    if isinstance(res, (str, list, tuple)):  # --resource KEY=VALUE flags, or a job file's list of them
        try:
            res = parse_options([res] if isinstance(res, str) else list(res))
        except (ValueError, TypeError) as e:
            raise SpecError(f"invalid job spec: resources_per_actor: {e}") from None
    if isinstance(res, dict):
        data["resources_per_actor"] = {k: _number(v) for k, v in res.items()}
    keep = data.get("keep_columns")
    if isinstance(keep, str):
        data["keep_columns"] = () if keep.strip().lower() == "none" else \
            tuple(dict.fromkeys(c.strip() for c in keep.split(",") if c.strip()))  # a repeat is one column
        if not data["keep_columns"] and keep.strip().lower() != "none":
            raise SpecError(f"keep_columns {keep!r} names no column: give column names, or none to keep no columns")
    elif isinstance(keep, list):  # (names only: a list in it is no key, and the type check names it)
        data["keep_columns"] = tuple(dict.fromkeys(keep) if all(isinstance(c, str) for c in keep) else keep)
    for k in ("stop", "stop_token_ids"):  # YAML/JSON lists, or one value
        v = data.get(k)
        if k in data and v is None:  # `stop:` left empty in a job file
            data[k] = ()
        elif isinstance(v, list):
            data[k] = tuple(v)
        elif isinstance(v, (str, int)) and not isinstance(v, bool):
            data[k] = (v,)
    for k in PATH_FIELDS:  # one spelling per path, so a resume typed differently is the same job
        data[k] = canonical_path(k, data.get(k))
    if isinstance(data.get("output"), str):  # (~ as the shell would, a job file's too; kept relative when
        data["output"] = os.path.expanduser(data["output"])  # given so: `ray job submit` warns of it)
    return data


def _number(v):
    """A flag's "1" or "0.5" as a number (anything else as given: the spec's check names it)."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


PATH_FIELDS = ("input", "target", "draft")


def canonical_path(field: str, value):
    """A local path (or an input glob) made absolute; hub names and anything else as given."""
    if isinstance(value, str) and (looks_local(value) or os.path.exists(os.path.expanduser(value))
                                   or field == "input" and any(c in value for c in "*?[")):
        return os.path.abspath(os.path.expanduser(value))
    return value
