"""Job summary: computed from the shard files alone (so a resumed job summarizes every row)."""
from __future__ import annotations

import json
import os
import platform
import statistics
from importlib import metadata
from pathlib import Path

import pyarrow.parquet as pq


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("dynatree", "torch", "transformers", "ray", "pyarrow", "tokenizers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _mean_std(values: list[float]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "n": len(vals)}


def read_rows(out: Path) -> list[dict]:
    files = sorted((Path(out) / "shards").glob("part-*.parquet"))
    rows: list[dict] = []
    for f in files:
        rows.extend(pq.read_table(f).to_pylist())
    return rows


def summarize(out: Path, spec, run_stats: dict) -> dict:
    rows = read_rows(out)
    ok = [r for r in rows if r["error"] is None]
    checked = [r for r in ok if r["matches_ar"] is not None]
    mismatched = [r for r in checked if not r["matches_ar"]]
    speedups = [r["tokens_per_s"] / r["ar_tokens_per_s"] for r in checked
                if r["ar_tokens_per_s"] and r["tokens_per_s"]]
    wall = run_stats.get("wall_time_s") or 0.0
    return {
        "rows": len(rows),
        "errors": len(rows) - len(ok),
        "generated_tokens": sum(r["num_generated_tokens"] or 0 for r in ok),
        "finish_reasons": {k: sum(1 for r in rows if r["finish_reason"] == k)
                           for k in sorted({r["finish_reason"] for r in rows if r["finish_reason"]})},
        "this_run": {**run_stats,
                     "job_tokens_per_s": run_stats.get("tokens_this_run", 0) / wall if wall else None},
        "tokens_per_s_per_prompt": _mean_std([r["tokens_per_s"] for r in ok]),
        "tokens_per_iteration": _mean_std([r["tokens_per_iteration"] for r in ok]),
        "acceptance_rate": _mean_std([r["acceptance_rate"] for r in ok]),
        "lookup_tokens": sum(r.get("lookup_tokens") or 0 for r in ok),
        "ttft_s": _mean_std([r["ttft_s"] for r in ok]),
        "tpot_s": _mean_std([r["tpot_s"] for r in ok]),
        "speedup_vs_ar": _mean_std(speedups),
        "equivalence": {
            "checked": len(checked), "matched": len(checked) - len(mismatched),
            "mismatches": len(mismatched),
            "pass_rate": (len(checked) - len(mismatched)) / len(checked) if checked else None,
            "mismatched_rows": [{"id": r["id"], "first_divergence": r["first_divergence"],
                                 "divergence_margin": r["divergence_margin"]} for r in mismatched[:50]],
        },
        "config": spec.to_dict(),
        "versions": _versions(),
    }


def write_summary(out: Path, summary: dict) -> None:
    path = Path(out) / "summary.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    os.replace(tmp, path)


def format_table(s: dict) -> str:
    def ms(d, fmt="{:.2f}"):
        if d["mean"] is None:
            return "-"
        return f"{fmt.format(d['mean'])} ± {fmt.format(d['std'])}"

    eq = s["equivalence"]
    run = s["this_run"]
    lines = [
        f"rows                     {s['rows']}  (errors {s['errors']})",
        f"generated tokens         {s['generated_tokens']}",
        "job tokens/s (this run)  " + (f"{run['job_tokens_per_s']:.1f}" if run.get("job_tokens_per_s") else "-")
        + f"  ({run.get('tokens_this_run', 0)} tokens in {run.get('wall_time_s', 0):.1f}s, "
          f"{run.get('shards_this_run', 0)} shards, {run.get('retries', 0)} retries)",
        f"tokens/s per prompt      {ms(s['tokens_per_s_per_prompt'], '{:.1f}')}",
        f"tokens / iteration       {ms(s['tokens_per_iteration'])}",
        f"acceptance rate          {ms(s['acceptance_rate'])}",
        f"tokens from lookup       {s.get('lookup_tokens', 0)}",
        f"speedup vs ar            {ms(s['speedup_vs_ar'])}  (rows re-decoded with ar: {s['speedup_vs_ar']['n']})",
        "matches ar               " + (f"{eq['matched']}/{eq['checked']}" if eq["checked"] else "not checked"),
    ]
    return "\n".join(lines)
