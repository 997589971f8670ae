"""A job's plan and output directory: shards from row counts, the manifest, finished shards.

Nothing here holds the prompts: shards are row ranges ``[k * shard_size, ...)`` of the input
(data.InputSource reads them on demand), the manifest holds the job identity, the input's
fingerprint and the shard count, and a shard file carries in its Parquet metadata the identity
and the range it covers.  So planning a 10M-row job reads file footers (JSONL: every line once,
for its schema), and a resume trusts a shard file only if it was written by this job for exactly
its planned rows, with the columns this run writes.
"""
from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dynatree.config import dtype_name
from dynatree.data import BadIds, InputError, InputSource, Uncastable
from dynatree.machine import ensure_writable, replaced
from dynatree.metrics import output_schema
from dynatree.names import model_files

from .runs import RUNS
from .spec import _LATER_FIELDS, PATH_FIELDS, JobSpec, canonical_options, canonical_path
from .summary import shard_tally

META_KEY = b"dynatree"


class JobError(RuntimeError):
    """The job cannot start or did not finish."""


@dataclass(frozen=True)
class Plan:
    source: InputSource
    shard_size: int
    keep: tuple[str, ...]  # input columns copied to the output
    schema: pa.Schema  # the output rows' schema: result columns, then the kept ones
    samples: int = 1  # output rows per input row (JobSpec.samples)
    limit: int | None = None  # only the input's first rows (JobSpec.limit)
    renamed: tuple = ()  # (input column, its name in the output) where they differ

    @property
    def kept_names(self) -> list[str]:
        """The kept columns' names in the output, in ``keep``'s order."""
        names = dict(self.renamed)
        return [names.get(c, c) for c in self.keep]

    @property
    def rows(self) -> int:
        """The input rows the job decodes."""
        n = self.source.num_rows
        return n if self.limit is None else min(n, self.limit)

    @property
    def num_shards(self) -> int:
        return -(-self.rows // self.shard_size)

    def shard(self, k: int) -> tuple[str, int, int]:
        s = k * self.shard_size
        return f"part-{k:06d}", s, min(s + self.shard_size, self.rows)


INPUT_ID = "input_id"  # the output's name for an input `id` column that is not the row id


def read_manifest(out: Path) -> dict | None:
    """The manifest of a job begun in ``out`` (None: none); JobError when it cannot be read."""
    path = out / "manifest.json"
    if not path.is_file():
        if os.path.lexists(path):  # (a directory there read as "no manifest": trial AK)
            raise JobError(f"{path} is not a file: move it, or use another --output")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise JobError(f"{path} cannot be read ({e}); use --overwrite to start again or another --output") from e


def _begun_schema(spec: JobSpec) -> pa.Schema | None:
    """The schema of the shards a job begun in ``spec.output`` wrote, when this run resumes it
    (None: nothing to resume) -- read from a shard, so outputs whose manifest predates its
    column list count too."""
    shards = Path(spec.output) / "shards"
    if spec.overwrite or not shards.is_dir():
        return None
    for p in sorted(shards.glob("part-*.parquet")):
        try:
            return pq.read_schema(p)
        except (OSError, pa.ArrowInvalid):
            continue  # a damaged shard is redone: another tells
    return None


def _id_renamed(spec: JobSpec, kept, columns) -> tuple:
    """((id, input_id),) when the ``kept`` columns hold an `id` that is not the row id (duplicates,
    nulls, --id-column another): the user's key to join on, under a name the output's result column
    `id` leaves free (input_id_2, ... where the input's ``columns`` have an input_id of their own,
    kept or not, so the name does not depend on --keep-columns); () otherwise."""
    if "id" not in kept or spec.id_column == "id":
        return ()
    name = next(n for n in (INPUT_ID, *(f"{INPUT_ID}_{k}" for k in range(2, len(columns) + 2))) if n not in columns)
    return (("id", name),)


def _kept_columns(spec: JobSpec, source: InputSource, log) -> tuple[tuple[str, ...], tuple]:
    """The input columns copied to the output, and those renamed there ((input, output) pairs)."""
    result_cols = set(output_schema(spec.samples > 1).names)
    if spec.keep_columns is not None:
        missing = [c for c in spec.keep_columns if c not in source.column_names]
        if missing:
            raise JobError(f"--keep-columns: no column(s) {', '.join(missing)} in {spec.input} "
                           f"(columns: {', '.join(source.column_names)})")
        renamed = _id_renamed(spec, spec.keep_columns, source.column_names)  # as when every column is kept
        # (the row-id column named `id` is the output's id already: asking to keep it asks for nothing more)
        keep = [c for c in spec.keep_columns if not (c == "id" == spec.id_column)]
        clash = [c for c in keep if c in result_cols and c not in dict(renamed)]
        if clash:
            raise JobError(f"--keep-columns: {', '.join(clash)} would overwrite result column(s) of the same name")
        return tuple(dict.fromkeys(keep)), renamed  # (a Python caller may repeat one)
    # -- unless an output begun without input_id resumes (its shards and new ones form one dataset)
    begun = _begun_schema(spec)
    renamed = _id_renamed(spec, source.column_names, source.column_names)
    if begun is not None and renamed and renamed[0][1] not in begun.names:
        renamed = ()
    if renamed:
        taken = f"; the input has a column {INPUT_ID}" if renamed[0][1] != INPUT_ID else ""
        whose = "the row index" if spec.id_column is None else f"column {spec.id_column!r}"
        log(f"input column id copied as {renamed[0][1]} (the output's id is {whose}{taken})")
    names = dict(renamed)
    skipped = [c for c in source.column_names if c in result_cols and c != spec.id_column and c not in names]
    if skipped:
        hint = " (--id-column id makes it the row id, if its values are unique)" if "id" in skipped else ""
        log(f"input column(s) {', '.join(skipped)} not copied: the output has result columns of that name{hint}")
    return tuple(c for c in source.column_names if c not in result_cols or c in names), renamed


def _nested(source: InputSource, column: str) -> pa.DataType | None:
    """The column's type if it is nested (struct, list, map: no id), else None."""
    kind = source.schema.field(column).type
    return kind if pa.types.is_nested(kind) else None


def default_ids(spec: JobSpec, log=print) -> tuple[JobSpec, InputSource | None]:
    """No --id-column: an input with an ``id`` column keeps its ids (the output's ``id`` is a
    result column, so it would be dropped for row indexes).  An output begun with row indexes
    before this default resumes with them.  Returns the spec and the input opened (for
    make_plan, so the input is opened and its ids checked once), or None."""
    if spec.id_column is not None:
        return spec, None
    try:
        source = InputSource.open(spec.input)
        begun = None if spec.overwrite else _own_manifest(Path(spec.output))
        if "id" not in source.column_names or (begun and begun.get("identity", {}).get("id_column", "id") is None):
            return spec, source
    except (InputError, OSError, ValueError, JobError):
        return spec, None  # make_plan (the input) or check_output (the manifest) says what is wrong
    try:
        nested = _nested(source, "id")
        if nested:
            raise BadIds(f"it holds {nested} values")
        source.check_ids("id")
    except (BadIds, Uncastable) as e:  # (its values: not the ids the files agree on)
        log(f"ids: row indexes, not the input's id column ({e})")
        return spec, source
    except InputError as e:  # (a file it cannot read: the job's ids must not change over it)
        raise JobError(str(e)) from e
    log("ids: the input's id column (set --id-column to use another)")
    return replace(spec, id_column="id"), source


def make_plan(spec: JobSpec, log=print, source: InputSource | None = None) -> Plan:
    """Open the input (metadata only; or take it opened), check its columns and ids; InputError
    becomes JobError."""
    try:
        source = source or InputSource.open(spec.input)
        cols = source.column_names
        if cols and spec.prompt_column not in cols:  # (an empty input without columns is just empty)
            raise JobError(f"input {spec.input}: no prompt column {spec.prompt_column!r} (columns: {', '.join(cols)})")
        if spec.id_column and cols and spec.id_column not in cols:
            raise JobError(f"input {spec.input}: no id column {spec.id_column!r} (columns: {', '.join(cols)})")
        for col, flag in ((spec.prompt_column, "--prompt-column"), (spec.id_column, "--id-column")):
            lacking = source.files_without(col) if col and cols else []
            if lacking:  # its rows would all be null: per-row errors, or a job refused for null ids
                raise JobError(f"input {spec.input}: {len(lacking)} file(s) have no {flag} {col!r} column: "
                               f"{', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''}")
        if cols and not spec.chat_template and _chat_type(source.schema.field(spec.prompt_column).type):
            raise JobError(f"input {spec.input}: the prompt column {spec.prompt_column!r} holds chat messages "
                           f"({source.schema.field(spec.prompt_column).type}): run with --chat-template")
        if cols and source.all_null(spec.prompt_column):
            raise JobError(f"input {spec.input}: the prompt column {spec.prompt_column!r} is null in every row: every "
                           "row would fail (--prompt-column names the text)")
        if cols and not _text_type(t := source.schema.field(spec.prompt_column).type, spec.chat_template):
            raise JobError(f"input {spec.input}: the prompt column {spec.prompt_column!r} holds {t} values, never "
                           "text" + (" or chat messages" if spec.chat_template else "") + ": every row would fail "
                           "(--prompt-column names the text)")
        if spec.id_column and cols:
            nested = _nested(source, spec.id_column)  # (its ids would be Python reprs of structs or lists)
            if nested:
                raise JobError(f"input {spec.input}: --id-column {spec.id_column!r} holds {nested} values; ids are "
                               "strings or numbers: name another column, or leave --id-column out (the row index)")
            source.check_ids(spec.id_column)
        keep, renamed = _kept_columns(spec, source, log)
        for note in source.notes:
            log(note)
    except InputError as e:
        raise JobError(str(e)) from e
    schema = output_schema(spec.samples > 1)
    for c in keep:
        field = source.schema.field(c)
        schema = schema.append(field.with_name(dict(renamed).get(c, c)).with_type(_storable(c, field.type)))
    return Plan(source, spec.shard_size, keep, schema, spec.samples, spec.limit, renamed)


def _chat_type(t: pa.DataType) -> bool:
    """Whether a column's values are chat messages: lists of structs with role and content (or one
    such struct), which only --chat-template renders -- every row would fail without it."""
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)
            or pa.types.is_fixed_size_list(t) or pa.types.is_large_list_view(t)):
        t = t.value_type
    return pa.types.is_struct(t) and {"role", "content"} <= {t.field(i).name for i in range(t.num_fields)}


def _text_type(t: pa.DataType, chat: bool) -> bool:
    """Whether a prompt column of this type may hold text (or, with a chat template, messages) in
    some row: one that cannot fails every row, so the job is refused when planned (trials AD and AH:
    an int64 column started the cluster and the models first).  Only types that never hold text are
    refused -- a wrong refusal stops a good job, a miss costs per-row errors."""
    while isinstance(t, pa.ExtensionType) or pa.types.is_dictionary(t) or pa.types.is_run_end_encoded(t):
        t = t.storage_type if isinstance(t, pa.ExtensionType) else t.value_type
    if pa.types.is_union(t):
        return any(_text_type(t.field(i).type, chat) for i in range(t.num_fields))
    never = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean, pa.types.is_temporal,
             pa.types.is_decimal, pa.types.is_null, pa.types.is_map)
    if any(is_(t) for is_ in never):
        return False
    if pa.types.is_nested(t):  # lists and structs: messages, with a chat template
        return chat and _chat_type(t)
    return True


_PLAIN = {pa.string_view(): pa.large_string(), pa.binary_view(): pa.large_binary()}


def _storable(name: str, t: pa.DataType) -> pa.DataType:
    """The type a kept column has in the output: its own where Parquet stores it and a sample's
    rows can be repeated from it (take), else the plain type it converts to (views -> large
    strings/binaries, run-end encoded -> its values); JobError when there is none."""
    plain = t.value_type if pa.types.is_run_end_encoded(t) else _PLAIN.get(t, t)
    try:
        empty = pa.array([], plain)
        empty.take(pa.array([], pa.int64()))
        pq.write_table(pa.table({name: empty}), io.BytesIO())
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise JobError(f"input column {name!r} ({t}) cannot be copied to the Parquet output ({e}); leave it out "
                       "with --keep-columns") from e
    return plain


def as_stored(col: pa.ChunkedArray, t: pa.DataType) -> pa.ChunkedArray:
    """A kept column in its output type (_storable)."""
    if col.type.equals(t):
        return col
    if pa.types.is_run_end_encoded(col.type):
        col = pa.chunked_array([pc.run_end_decode(c) for c in col.chunks], col.type.value_type)
    return col.cast(t)


def _manifest(spec: JobSpec, plan: Plan) -> dict:
    models = {"target": model_files(spec.target, "target"),
              "draft": model_files(spec.draft, "draft") if spec.method != "ar" else None}
    return {"identity_hash": spec.identity_hash(), "identity": spec.identity(),
            "input_fingerprint": plan.source.fingerprint(), "model_files": models, "columns": plan.schema.names,
            "rows": plan.rows,
            "shard_size": plan.shard_size, "shards": plan.num_shards}


def _has_shards(out: Path) -> bool:
    return any(p.name.startswith("part-") for p in (out / "shards").iterdir())


def _ours(name: str) -> bool:
    """Whether a file in shards/ is one dynatree writes (a shard, or a shard being written)."""
    return (name.startswith("part-") and name.endswith(".parquet")
            or name.startswith(".part-") and name.endswith(".parquet.tmp"))


def _own_manifest(out: Path) -> dict | None:
    """The manifest of a job begun in ``out`` (read_manifest), refused where a run would replace a
    file dynatree did not write: a manifest.json without a job identity, or a summary.json with no
    manifest beside it (--overwrite replaces both)."""
    old = read_manifest(out)
    if old is not None and not (isinstance(old, dict) and "identity_hash" in old):
        raise JobError(f"{out / 'manifest.json'} is not a dynatree job's manifest (it holds no job identity) and a "
                       "run would replace it: move it, or use --overwrite to replace it, or another --output")
    if old is None and (out / "summary.json").is_file():
        raise JobError(f"{out} holds a summary.json but no manifest.json, so no dynatree job wrote it, and a run "
                       "would replace it: move it, or use --overwrite to replace it, or another --output")
    return old


def _refuse_foreign(out: Path) -> None:
    """shards/ is the dataset users read (pyarrow.dataset(out/"shards")): a file dynatree did not
    write there would be read as output, and --overwrite must never delete it."""
    foreign = sorted(p.name for p in (out / "shards").iterdir()  # pyarrow skips hidden and _ names
                     if not _ours(p.name) and not p.name.startswith((".", "_")))
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise JobError(f"{out / 'shards'} holds files dynatree did not write ({', '.join(foreign[:3])}{more}); "
                       "move them or choose another --output")


def _footers(out: Path) -> dict[str, dict | None]:
    """Each shard file's dynatree metadata (write_shard) by file name; None where the file does not
    read as Parquet (a damaged shard: redone, or deleted by --overwrite).  A part-*.parquet that
    reads but carries none was put there by someone else: JobError, so that no run overwrites it
    and --overwrite does not delete it."""
    metas, foreign = {}, []
    for p in sorted((out / "shards").glob("part-*.parquet")):
        try:
            meta = pq.read_metadata(p).metadata or {}
        except Exception:
            metas[p.name] = None
            continue
        if META_KEY not in meta:
            foreign.append(p.name)
            continue
        try:
            metas[p.name] = json.loads(meta[META_KEY])
        except ValueError:
            metas[p.name] = None
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise JobError(f"{out / 'shards'} holds Parquet files dynatree did not write ({', '.join(foreign[:3])}{more}: "
                       "no dynatree shard metadata), which a run would overwrite or --overwrite delete; move them "
                       "or choose another --output")
    return metas


def _refuse_strays(out: Path, plan: Plan) -> None:
    """A shard file numbered past this job's shards (copied in, or left by another job) would be
    read as output (and counted in the summary): refuse, as for foreign files."""
    names = {f"part-{k:06d}.parquet" for k in range(plan.num_shards)}
    strays = sorted(p.name for p in (out / "shards").glob("part-*.parquet") if p.name not in names)
    if strays:
        raise JobError(f"{out / 'shards'} holds shard file(s) this job does not plan ({', '.join(strays[:3])}; it has "
                       f"{plan.num_shards} shards): move them, or --overwrite to start again")


def _clear(out: Path) -> None:
    """--overwrite: remove what dynatree wrote, and only that."""
    for p in (out / "shards").iterdir():
        if _ours(p.name):
            p.unlink()
    for p in [out / "summary.json", out / RUNS, *out.glob(".fault-*")]:  # (the runs of the job it replaces)
        p.unlink(missing_ok=True)


def _legacy(old: dict) -> dict:
    """An older manifest's identity and input fingerprint with paths as this version keeps them:
    absolute (they were stored as typed, resolved here from the current directory)."""
    ident = {k: canonical_path(k, v) if k in PATH_FIELDS else v for k, v in old.get("identity", {}).items()}
    if "dtype" in ident:  # (an alias, fp16, was kept as typed until 2026-11-30)
        ident["dtype"] = dtype_name(ident["dtype"])
    if isinstance(ident.get("options"), dict) and isinstance(ident.get("method"), str):  # (kept as typed until 2026-11-28)
        ident["options"] = json.loads(json.dumps(canonical_options(ident["method"], ident["options"]), default=str))
    fp = json.loads(json.dumps(old.get("input_fingerprint")))
    if isinstance(fp, dict):
        fp["source"] = canonical_path("input", fp.get("source"))
        for f in fp.get("files", []):
            f["path"] = canonical_path("input", f.get("path"))
    return {**old, "identity": ident, "input_fingerprint": fp}


def _same_identity(old: dict, new: dict) -> bool:
    """Same job: the same identity, or one that names the kept columns otherwise (every column by
    default, or each by name) with the same output columns."""
    same = lambda a, b: json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
    unkept = lambda ident: {k: v for k, v in ident.items() if k != "keep_columns"}
    return (old.get("identity_hash") == new["identity_hash"] or same(old["identity"], new["identity"])
            or same(unkept(old["identity"]), unkept(new["identity"])) and old.get("columns") == new["columns"])


def _seconds(ns: int) -> str:
    """A file time as `touch -d @SECONDS` takes it back, exactly (v / 1e9 was ~100 ns off: trial AI)."""
    return f"{ns // 10**9}.{ns % 10**9:09d}"


def _model_change(old: dict, new: dict) -> str:
    """The first model file whose size or time differs, said with the time the job began with."""
    for role in ("target", "draft"):
        was = {f[0]: f for f in (old["model_files"] or {}).get(role) or []}
        now = {f[0]: f for f in (new["model_files"] or {}).get(role) or []}
        for name in sorted(was.keys() | now.keys()):
            a, b = was.get(name), now.get(name)
            if a is None or b is None:
                return f"{role} {name} {'added' if a is None else 'gone'}"
            if list(a) != list(b):
                size = "" if a[1] == b[1] else f"size {a[1]} -> {b[1]}, "
                return f"{role} {name}: {size}time {_seconds(a[2])} -> {_seconds(b[2])}"
    return "sizes or times differ"


def _refuse_change(out: Path, old: dict, new: dict) -> None:
    old = _legacy(old)
    if not _same_identity(old, new):
        before = old.get("identity", {})
        changed = sorted(k for k in {*new["identity"], *before} if json.dumps(new["identity"].get(k), default=str)
                         != json.dumps(before.get(k), default=str))
        if "options" in changed and isinstance(before.get("options"), dict):
            was, now = before["options"], json.loads(json.dumps(new["identity"]["options"], default=str))
            keys = sorted(k for k in {*was, *now} if was.get(k) != now.get(k))
            changed[changed.index("options")] = "options " + ", ".join(
                f"{k}: {was.get(k, 'default')} -> {now.get(k, 'default')}" for k in keys)
        # each field with its values ("changed: samples" said too little: the upgrade trial)
        changed = [k if k.startswith("options") else f"{k}: {_said(k, before)} -> {_said(k, new['identity'])}"
                   for k in changed]
        raise JobError(f"{out} holds a job with a different config (changed: {', '.join(changed)}); "
                       "use --overwrite to replace it or another --output")
    if "model_files" in old and json.dumps(old["model_files"]) != json.dumps(new["model_files"]):  # older manifests lack it
        raise JobError(f"the models' files changed since {out} was started ({_model_change(old, new)}: retrained or "
                       "replaced in place?), so its finished shards may come from other weights; use --overwrite "
                       "to start again or another --output (a byte-identical copy restored from a backup: give it "
                       "back its time, `touch -d @SECONDS FILE`, and the same command resumes)")
    if json.dumps(old.get("input_fingerprint"), sort_keys=True) != json.dumps(new["input_fingerprint"], sort_keys=True) \
            and not _changed_only_unfinished(out, old, new["input_fingerprint"]):
        _refuse_changed_input(out, new["identity"]["input"],
                              input_change(old.get("input_fingerprint"), new["input_fingerprint"]))


def _said(field: str, identity: dict) -> str:
    """A job identity's field as a refusal says it: an absent one at its default (_LATER_FIELDS), no id
    column as row indexes (an input whose ids gained duplicates falls back to them)."""
    v = identity[field] if field in identity else _LATER_FIELDS.get(field)
    if field == "id_column":
        return "row indexes" if v is None else repr(v)
    return json.dumps(v, default=str) if isinstance(v, (list, tuple, dict)) else str(v)


def input_change(was: dict | None, now: dict | None) -> str:
    """The first difference of two input fingerprints, said for a user: a file gone, added, resized,
    touched or of other row counts (or the rows in all)."""
    if not isinstance(was, dict) or not isinstance(now, dict):
        return "its fingerprint differs"
    if was.get("dataset") != now.get("dataset"):  # (a `datasets` dataset: its files are its revision's)
        return "the datasets dataset's fingerprint (its revision) differs"
    files = lambda fp: {f.get("path"): f for f in fp.get("files", []) if isinstance(f, dict)}
    a, b = files(was), files(now)
    for path in sorted(a.keys() | b.keys(), key=str):
        x, y = a.get(path), b.get(path)
        if x is None or y is None:
            return f"{path} {'added' if x is None else 'gone'}"
        for key, what in (("size", "size"), ("rows", "rows"), ("mtime_ns", "time")):
            if x.get(key) != y.get(key):
                show = (lambda v: _seconds(v) if isinstance(v, int) else str(v)) if key == "mtime_ns" else str
                return f"{path}: {what} {show(x.get(key))} -> {show(y.get(key))}"
    if was.get("num_rows") != now.get("num_rows"):
        return f"rows {was.get('num_rows')} -> {now.get('num_rows')}"
    return "file sizes, times and row counts alike: this dynatree version reads another set of its files or another way"


def _refuse_changed_input(out: Path, source: str, change: str) -> None:
    restored = (" (a byte-identical copy restored from a backup: give it back its time, `touch -d @SECONDS FILE`)"
                if ": time " in change else "")
    raise JobError(f"the input {source} changed since {out} was started ({change}), so its finished shards may not "
                   f"match the rows they were planned for; use --overwrite to start again or another --output{restored}")


def refuse_changed_input_early(spec: JobSpec) -> None:
    """The input files a begun job's manifest records, against their sizes and times now: a changed
    one is refused before the scan that would only find it again (a JSONL input's reads every row:
    a 1 GB one took 166 s, without a word, to be refused: the corpus trial)."""
    out = Path(spec.output)
    if spec.overwrite or not (out / "shards").is_dir() or not _has_shards(out):
        return
    old = _own_manifest(out)  # (refuses a manifest.json that is no job's)
    old = _legacy(old) if isinstance(old.get("identity") if old else None, dict) else {}
    fp = old.get("input_fingerprint")
    if not isinstance(fp, dict) or old["identity"].get("input") != canonical_path("input", spec.input):
        return  # (another job, or none: check_output says so)
    now = json.loads(json.dumps(fp))
    for f in now.get("files", []):
        if not isinstance(f, dict) or f.get("format") == "datasets" or not isinstance(f.get("path"), str):
            return  # (a hub dataset, an older manifest's shape: the full check decides)
        try:
            st = os.stat(f["path"])
        except OSError:
            _refuse_changed_input(out, spec.input, f"{f['path']} gone")
        f["size"], f["mtime_ns"] = st.st_size, st.st_mtime_ns
    if json.dumps(fp, sort_keys=True) != json.dumps(now, sort_keys=True) and not _changed_only_unfinished(out, old, now):
        _refuse_changed_input(out, spec.input, input_change(fp, now))


def _changed_only_unfinished(out: Path, old: dict, now: dict) -> bool:
    """Whether the input's files that changed -- in size or time only, their row counts kept -- hold
    no row of a shard file in ``out``: a damaged file repaired in place after its shards failed
    (trial AI: the resume was refused, and --overwrite redid every finished shard).  The finished
    shards' rows are still the rows they were planned for; the new manifest takes the new files."""
    was, size = old.get("input_fingerprint"), old.get("shard_size")
    if not (isinstance(was, dict) and isinstance(now, dict) and isinstance(size, int) and size > 0):
        return False
    a, b = was.get("files") or [], now.get("files") or []
    if (was.get("num_rows"), was.get("dataset")) != (now.get("num_rows"), now.get("dataset")) or \
            [(f.get("path"), f.get("rows")) for f in a] != [(f.get("path"), f.get("rows")) for f in b]:
        return False
    held = [k for p in (out / "shards").glob("part-*.parquet") if (k := shard_number(p.name)) is not None]
    start = 0
    for x, y in zip(a, b):
        end = start + (x.get("rows") or 0)
        if x != y and any(k * size < end and (k + 1) * size > start for k in held):
            return False
        start = end
    return True


def _refuse_other_schema(out: Path, spec: JobSpec, plan: Plan) -> None:
    """Shards of other columns or column types (another dynatree version read the input
    differently) and new ones would not read as one dataset."""
    begun = _begun_schema(spec)
    if begun is None:
        return
    buf = io.BytesIO()  # this run's schema as Parquet reads it back (list<item> -> list<element>, ...)
    pq.write_table(plan.schema.empty_table(), buf)
    written = pq.read_schema(pa.BufferReader(buf.getvalue()))
    was, now = [(f.name, str(f.type)) for f in begun], [(f.name, str(f.type)) for f in written]
    if was != now:
        diff = [f"{n}: {t}" for n, t in now if (n, t) not in was] + [f"no {n}" for n, _ in was if n not in dict(now)]
        raise JobError(f"{out} was written with other output columns ({', '.join(diff[:4])} in this run; another "
                       "dynatree version?): its shards and new ones would not read as one dataset; use --overwrite "
                       "to start again or another --output")


class OutputHeld(JobError):
    """Another job's driver holds the output: nothing of it is this job's to clean up."""


def _held(output, f) -> OutputHeld:
    """The refusal of a job whose output another job's driver holds (its lock file names it)."""
    f.seek(0)
    return OutputHeld(f"another dynatree job is writing {output} ({f.read().strip() or 'pid unknown'}); "
                    "wait for it, or choose another --output")


def check_unlocked(output: str) -> None:
    """What output_lock would refuse, asked without writing (a dry run): JobError while another
    job's driver holds ``output``."""
    path = Path(output) / ".dynatree.lock"
    try:
        f = open(path)
    except OSError:
        return  # none yet (or unreadable: the run's own lock says so)
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _held(output, f) from None


def unwritable(out: Path, e: OSError) -> str:
    """Why the output directory cannot be written, said for what is in the way ("not writable:
    File exists" was said for a file named shards and for a link to nothing: trial AK)."""
    if isinstance(e, FileExistsError):
        where = Path(e.filename) if e.filename else out
        if where.is_symlink() and not where.exists():
            return f"--output {out}: {where} is a symbolic link to nothing that exists: point it at a directory, or remove it"
        return f"--output {out}: {where} is a file where a directory goes: move it, or use another --output"
    return f"output directory {out} is not writable: {e}"


@contextlib.contextmanager
def output_lock(output: str):
    """Held by the job's driver while it writes ``output``: a second job on the same directory
    (another config, or the same one twice) would interleave shards with a manifest that is not
    theirs.  An advisory lock on ``.dynatree.lock`` (flock: released if the driver dies)."""
    out = Path(output)
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / ".dynatree.lock", "a+")
    except OSError as e:
        raise JobError(unwritable(out, e)) from e
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _held(out, f) from None
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # (the pid left behind read as a job still running)
                f.truncate(0)


def check_output(spec: JobSpec, plan: Plan) -> dict:
    """What this job may do with ``spec.output`` (read only): JobError where it must not (files
    dynatree did not write, another job's shards); else the manifest it will write."""
    out, manifest = Path(spec.output), _manifest(spec, plan)
    old = None if spec.overwrite else _own_manifest(out)
    if not (out / "shards").is_dir():
        return manifest
    _refuse_foreign(out)
    if spec.overwrite:
        _footers(out)  # (a resume reads them in finished_shards)
        return manifest
    if old is not None and _has_shards(out):  # an identity is pinned only once a shard exists
        _refuse_change(out, old, manifest)
        _refuse_other_schema(out, spec, plan)
        _refuse_strays(out, plan)
        # shards an older version wrote carry the hash of its spelling of the paths: still this job's
        aliases = set(old.get("aliases", [])) | {old.get("identity_hash")}
        manifest["aliases"] = sorted(a for a in aliases if a and a != manifest["identity_hash"])
        # what the first run's actors pinned (pin_prompt_start, pin_context, pin_text_rule): dropped here, the
        # context and the text rule read as an older version's and refused the job's own resume (the text trial)
        manifest.update({k: old[k] for k in _PINNED if k in old})
        if not spec.resume:
            raise JobError(f"{out} already holds this job; pass --resume to continue it or --overwrite")
    elif _has_shards(out):
        raise JobError(f"{out}/shards has files but no manifest; refusing to mix outputs (use --overwrite)")
    return manifest


def prepare_output(spec: JobSpec, plan: Plan) -> Path:
    out = Path(spec.output)
    try:
        ensure_writable(out)
        ensure_writable(out / "shards")  # (its own: an immutable shards/ failed the job only at its first shard)
    except OSError as e:
        raise JobError(unwritable(out, e)) from e
    manifest = check_output(spec, plan)
    if not spec.overwrite:  # (an overwrite clears and pins its manifest once its actors are ready: start_over)
        _write_manifest(out, manifest)
    return out


def start_over(spec: JobSpec, plan: Plan) -> None:
    """--overwrite, once the job can decode (its actors ready): what dynatree wrote there goes and
    this job's manifest comes -- so a job that fails to start (placement, loading) leaves the old
    output whole."""
    out = Path(spec.output)
    _clear(out)
    _write_manifest(out, _manifest(spec, plan))  # (check_output's for an overwrite; it read every footer already)


def pin_prompt_start(out: Path, leading: list[int]) -> None:
    """Keep in the manifest the ids every text prompt starts with (ModelPair.leading_ids: the BOS a
    Llama tokenizer puts before a text), known once an actor has loaded the tokenizer; refuse an
    output whose shards began otherwise -- dynatree before 2026-11-30 prompted without the BOS, and
    a resume would mix prompts with and without it."""
    manifest, begun = read_manifest(out) or {}, _has_shards(out)
    had = manifest.get("leading_ids", [])  # (shards of an older version: none)
    if begun and had != leading:
        how = lambda ids: f"with the ids {ids}" if ids else "with no special token"  # noqa: E731
        raise JobError(f"{out}'s finished shards were prompted {how(had)} before each text (dynatree before "
                       f"2026-11-30 put no BOS there); this run would start them {how(leading)}, the tokenizer's "
                       "BOS -- mixing the two: --overwrite to redo the job, or another --output")
    if manifest and manifest.get("leading_ids") != leading:
        _write_manifest(out, {**manifest, "leading_ids": leading})


_PINNED = ("leading_ids", "context", "text_rule")  # manifest fields the actors pin once they know the pair
TEXT_RULE = 2  # since 2026-12-01: text decoded after the prompt, a stop string an EOS completes cut (stops.py)


def pin_text_rule(out: Path, changed: bool) -> None:
    """Keep in the manifest the rule the shards' texts were written under; refuse an output whose
    shards an older rule wrote where this job's texts would read otherwise (stops.texts_changed:
    the actors know it once the tokenizer is loaded) -- a resume would mix the two."""
    manifest, begun = read_manifest(out) or {}, _has_shards(out)
    if begun and manifest.get("text_rule", 1) != TEXT_RULE and changed:
        raise JobError(f"{out}'s finished shards were written by dynatree before 2026-12-01, whose generated_text "
                       "and stop strings read this job's tokenizer or stops otherwise (a continuation's leading space "
                       "under a SentencePiece tokenizer; a stop string in an EOS token's text) -- mixing the two: "
                       "--overwrite to redo the job, or another --output")
    if manifest and manifest.get("text_rule") != TEXT_RULE:
        _write_manifest(out, {**manifest, "text_rule": TEXT_RULE})


def pin_context(out: Path, spec: JobSpec, context: int, draft_positions: int = 0) -> None:
    """Keep in the manifest the context the actors hold rows to (ModelPair.max_context: their prompts
    keep at most it less --max-new-tokens); refuse an output whose shards were held to another where
    that cuts prompts differently -- dynatree before 2026-12-01 held a pair whose draft has fewer
    positions than its target to the draft's (the upgrade trial: shards of 64- and 200-token prompts
    mixed in one job)."""
    manifest, begun = read_manifest(out) or {}, _has_shards(out)
    legacy = min(context, draft_positions or context)  # (an older version's shards: the smaller one)
    had = manifest.get("context", legacy if begun else context)
    windowed = bool(getattr(spec.method_config, "kv_window", 0))  # (its prompts are not cut by the context)
    cuts = not windowed and (spec.max_prompt_tokens is None or
                             spec.max_prompt_tokens + spec.max_new_tokens > min(had, context))
    if begun and had != context and cuts:
        raise JobError(f"{out}'s finished shards were decoded with rows held to a {had}-token context (dynatree "
                       "before 2026-12-01 held a pair to a shorter draft's); this run holds them to the target's "
                       f"{context}, which keeps more of each prompt beside --max-new-tokens {spec.max_new_tokens} -- "
                       "mixing the two: --overwrite to redo the job, or another --output")
    if manifest and manifest.get("context") != context:
        _write_manifest(out, {**manifest, "context": context})


def _write_manifest(out: Path, manifest: dict) -> None:
    with replaced(out / "manifest.json") as tmp:
        tmp.write_text(json.dumps(manifest, indent=2, default=str))


def shard_number(name: str) -> int | None:
    """The shard number of a file name in shards/ (``part-000012.parquet`` or its stem), or None."""
    digits = name.removesuffix(".parquet")[len("part-"):]
    return int(digits) if name.startswith("part-") and digits.isdigit() else None


def finished_shards(out: Path, spec: JobSpec, plan: Plan) -> set[int]:
    """Shard numbers whose file this job wrote for exactly its planned range (footers only);
    JobError for a shard-named file someone else put there (_footers)."""
    manifest = read_manifest(out) or {}
    idents = {spec.identity_hash(), *manifest.get("aliases", [])}
    if isinstance(manifest.get("identity"), dict) and _same_identity(_legacy(manifest), _manifest(spec, plan)):
        idents.add(manifest.get("identity_hash"))  # (another spelling of this job -- fp16 for float16, a relative
        # path, its kept columns named -- that a dry run, which rewrites no manifest, did not yet know as an alias)
    done = set()
    for name, meta in _footers(out).items():
        k = shard_number(name)
        if k is not None and meta is not None and k < plan.num_shards and meta.get("identity") in idents and \
                meta.get("range") == list(plan.shard(k)[1:]):
            done.add(k)  # (anything else is redone, its file overwritten)
    return done


def write_shard(out: Path, spec: JobSpec, plan: Plan, k: int, table: pa.Table, run: dict | None = None) -> None:
    """Shard ``k``'s rows, whole or not at all; its footer says the job, its input rows, its tally and
    the ``run`` that wrote it (runs.run_ref: which line of runs.jsonl -- after a resume nothing said
    which run made which rows, trial AJ)."""
    name, s, e = plan.shard(k)
    meta = json.dumps({"identity": spec.identity_hash(), "range": [s, e],
                       "tally": shard_tally(table, plan.samples > 1),  # (summaries read the footer)
                       **({"run": run} if run else {})}).encode()
    table = table.replace_schema_metadata({META_KEY: meta})
    final = out / "shards" / f"{name}.parquet"
    with replaced(final, final.with_name(f".{name}.parquet.tmp")) as tmp:  # a shard file is absent or complete
        pq.write_table(table, tmp)
