"""The job spec: one validated object built from a YAML/JSON file and/or CLI flags.

Fields that change what is generated (models, method, options, lengths, prompt handling) form
the *output identity*: a re-run on the same output directory must have the same identity, or
it is refused unless ``overwrite`` is set.  Fields that only change how the work is spread
(actors, CPUs, address, shard concurrency) may differ between a run and its resume.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from dynatree.config import make_config


class SpecError(ValueError):
    """The job spec is invalid."""


OUTPUT_IDENTITY = ("input", "prompt_column", "id_column", "target", "draft", "method", "options",
                   "max_new_tokens", "max_prompt_tokens", "ignore_eos", "dtype", "batch_size",
                   "shard_size", "verify_fraction")


@dataclass(frozen=True)
class JobSpec:
    input: str
    output: str
    prompt_column: str = "text"
    id_column: str | None = None
    target: str | None = None  # None: the bundled demo pair
    draft: str | None = None
    method: str = "dynatree"
    options: dict = field(default_factory=dict)
    max_new_tokens: int = 128
    max_prompt_tokens: int | None = 512  # L_max: prompts keep their last L_max tokens
    ignore_eos: bool = False
    device: str = "auto"
    dtype: str = "float32"
    batch_size: int = 1  # prompts decoded together (method ar only)
    num_actors: int | None = None  # None: one per GPU, else CPUs // cpus_per_actor
    cpus_per_actor: float = 2
    gpus_per_actor: float | None = None  # None: 1 when the cluster has GPUs, else 0
    shard_size: int = 16
    max_inflight_per_actor: int = 2
    max_retries: int = 3  # attempts per shard after actor failures
    verify_fraction: float = 0.0
    fail_on_mismatch: bool = False
    address: str | None = None  # Ray address; None starts a local cluster
    resume: bool = True
    overwrite: bool = False
    fault_injection: dict = field(default_factory=dict)  # tests only: {"die_once_on_shard": name}

    def __post_init__(self):
        problems = []
        if not self.input:
            problems.append("input is required")
        if not self.output:
            problems.append("output is required")
        if self.max_new_tokens < 1:
            problems.append("max_new_tokens must be >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            problems.append("max_prompt_tokens must be >= 1")
        if self.shard_size < 1:
            problems.append("shard_size must be >= 1")
        if self.batch_size < 1:
            problems.append("batch_size must be >= 1")
        if self.batch_size > 1 and self.method != "ar":
            problems.append("batch_size > 1 is only supported with method ar (tree decoders are one prompt at a time)")
        if not 0.0 <= self.verify_fraction <= 1.0:
            problems.append("verify_fraction must be within [0, 1]")
        if self.num_actors is not None and self.num_actors < 1:
            problems.append("num_actors must be >= 1")
        if self.cpus_per_actor <= 0:
            problems.append("cpus_per_actor must be > 0")
        if self.max_inflight_per_actor < 1:
            problems.append("max_inflight_per_actor must be >= 1")
        if (self.target is None) != (self.draft is None) and self.method != "ar":
            problems.append("give both target and draft, or neither (the bundled demo pair)")
        try:
            cfg = make_config(self.method, self.options)
            if cfg.temperature > 0 and self.batch_size > 1:
                problems.append("batch_size > 1 decodes greedily; use batch_size 1 with temperature > 0")
            if cfg.temperature > 0 and self.fail_on_mismatch:
                problems.append("fail_on_mismatch compares with greedy ar, which a sampled job (temperature > 0) "
                                "does not reproduce")
        except (ValueError, TypeError) as e:
            problems.append(str(e))
        if problems:
            raise SpecError("invalid job spec: " + "; ".join(problems))

    @property
    def method_config(self):
        return make_config(self.method, self.options)

    def identity(self) -> dict:
        return {k: getattr(self, k) for k in OUTPUT_IDENTITY}

    def identity_hash(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _load_file(path: str) -> dict:
    p = Path(path)
    if not p.exists():
        raise SpecError(f"job file {path} does not exist")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as e:  # yaml and json raise different types
        raise SpecError(f"cannot parse job file {path}: {e}") from e
    if not isinstance(data, dict):
        raise SpecError(f"job file {path} must hold a mapping of fields")
    return data


def build_spec(config_file: str | None = None, **overrides) -> JobSpec:
    """Job file fields, then non-None overrides (CLI flags); unknown fields are errors."""
    data = _load_file(config_file) if config_file else {}
    names = {f.name for f in dataclasses.fields(JobSpec)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SpecError(f"unknown job field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    options = dict(data.get("options") or {})
    options.update(overrides.pop("options", None) or {})
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:  # typed values, so "8" from a flag and 8 from YAML are the same job
        cfg = make_config(data.get("method", "dynatree"), options)
        data["options"] = {k: getattr(cfg, k) for k in options}
    except (ValueError, TypeError) as e:
        raise SpecError(f"invalid job spec: {e}") from e
    missing = [k for k in ("input", "output") if not data.get(k)]
    if missing:
        raise SpecError(f"missing required field(s): {', '.join(missing)}")
    try:
        return JobSpec(**data)
    except TypeError as e:
        raise SpecError(f"invalid job spec: {e}") from e
