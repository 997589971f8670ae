"""Job throughput as a corpus user sees it: whole `dynatree run` jobs, measured side by side.

Each configuration runs a small and a large job on the same prompts; the *marginal* rate
(extra tokens / extra wall time between the two) cancels the start-up both pay, and the
start-up is reported on its own (a second marginal rate excludes it too, in case it differs
between the two jobs).  All configurations run one after another in one process on one Ray
cluster (the host drifts, so compare configurations from the same run only).

    python -m dynatree.jobs.throughput --input P.parquet --target T --draft D \\
        --configs dynatree:1,dynatree:16,ar:16,dynatree:auto --sizes 16,64 --out out/bench-jobs
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click
import pyarrow.parquet as pq

from dynatree.machine import cpu, describe

from .driver import run_job, start_local_ray
from .spec import build_spec
from .summary import startup_total


def _job(inp: str, n: int, work: Path, method: str, batch: str, actors: int, cpus: float, options: dict,
         base: dict) -> dict:
    rows = pq.read_table(inp).slice(0, n)
    path = work / f"in-{n}.parquet"
    if not path.exists():
        pq.write_table(rows, path)
    tag = f"{method}-{batch}-{actors}x{cpus:g}-{n}" + "".join(f"-{k}{v}" for k, v in options.items())
    options = dict(options)
    pair = {"kernel": options.pop("kernel")} if "kernel" in options else {}  # (the pair's, not the method's)
    spec = build_spec(None, input=str(path), output=str(work / f"out-{tag}"), method=method, batch_size=batch,
                      num_actors=actors, cpus_per_actor=cpus, options=options, overwrite=True, **{**base, **pair})
    s = run_job(spec, progress=False, log=lambda m: None)
    run = s["this_run"]
    st = s["startup"]
    return {"rows": n, "tokens": run["tokens_this_run"], "wall_s": run["wall_time_s"],
            "startup_s": startup_total(st),
            "startup": st, "batch_sizes": [a["batch_size"] for a in run.get("actors", [])],
            "machines": [a.get("machine") for a in run.get("actors", [])],  # (the CPU each actor's rate came from)
            "mismatches": s["equivalence"]["mismatches"], "checked": s["equivalence"]["checked"]}


def _parse_config(c: str) -> tuple[str, str, int, float, dict]:
    """METHOD:BATCH[:ACTORSxCPUS][+KEY=VALUE...] -> (method, batch, actors, cpus, options)."""
    head, *opts = c.split("+")
    parts = head.split(":")
    if len(parts) not in (2, 3) or not all(parts) or any("=" not in o for o in opts):
        raise click.BadParameter(f"{c!r}: expected METHOD:BATCH[:ACTORSxCPUS][+KEY=VALUE...]", param_hint="--configs")
    method, batch, *shape = parts
    try:
        actors, cpus = (int(shape[0].split("x")[0]), float(shape[0].split("x")[1])) if shape else (1, 2.0)
    except (ValueError, IndexError):
        raise click.BadParameter(f"{c!r}: ACTORSxCPUS such as 2x1", param_hint="--configs") from None
    return method, batch, actors, cpus, dict(o.split("=", 1) for o in opts)


def _parse_sizes(sizes: str, inp: str) -> tuple[int, int]:
    try:
        small, large = (int(x) for x in sizes.split(","))
    except ValueError:
        raise click.BadParameter(f"{sizes!r}: two prompt counts, SMALL,LARGE", param_hint="--sizes") from None
    rows = pq.ParquetFile(inp).metadata.num_rows
    if not 0 < small < large <= rows:
        raise click.BadParameter(f"{sizes!r}: need 0 < SMALL < LARGE <= the input's {rows} rows", param_hint="--sizes")
    return small, large


@click.command()
@click.option("--input", "inp", required=True, type=click.Path(exists=True, dir_okay=False),
              help="one Parquet file of prompts (its first SMALL and LARGE rows are the two jobs)")
@click.option("--target", required=True)
@click.option("--draft", required=True)
@click.option("--configs", default="dynatree:1,dynatree:16,ar:16,dynatree:auto", show_default=True,
              help="METHOD:BATCH[:ACTORSxCPUS][+KEY=VALUE...], comma-separated (e.g. ar:16+kv_dtype=bfloat16; "
                   "+kernel=K picks the pair's kernel, e.g. dynatree:16+kernel=lean-bf16)")
@click.option("--sizes", default="16,64", show_default=True, help="small,large job sizes (prompts)")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--verify-fraction", default=0.0, show_default=True)
@click.option("--shard-size", default=4, show_default=True,
              help="small enough that the small job reaches every actor (else its marginal rate flatters many actors)")
@click.option("--device", default="cpu", show_default=True)
@click.option("--out", default="out/bench-jobs", show_default=True, help="directory for results.json")
def main(inp, target, draft, configs, sizes, max_new_tokens, verify_fraction, shard_size, device, out):
    parsed = [(c, *_parse_config(c)) for c in configs.split(",")]  # (all checked before Ray starts)
    small, large = _parse_sizes(sizes, inp)
    base = dict(target=target, draft=draft, max_new_tokens=max_new_tokens, ignore_eos=True, device=device,
                verify_fraction=verify_fraction, shard_size=shard_size)
    results = []
    Path(out).mkdir(parents=True, exist_ok=True)
    start_local_ray(log_to_driver=False)
    click.echo(f"CPU: {describe(cpu())}")
    with tempfile.TemporaryDirectory(prefix="dt-jobs-") as tmp:
        # a first job pays the cold start (cluster, kernel build, budget profile) that later small jobs
        # do not, which would flatter the first configuration's marginal rate
        warm = _job(inp, 2, Path(tmp), *parsed[0][1:], {**base, "max_new_tokens": 4})
        click.echo(f"warm-up job (2 prompts, {parsed[0][0]}): start-up {warm['startup_s']:.1f} s, wall {warm['wall_s']:.1f} s")
        for c, method, batch, actors, cpus, options in parsed:
            a = _job(inp, small, Path(tmp), method, batch, actors, cpus, options, base)
            b = _job(inp, large, Path(tmp), method, batch, actors, cpus, options, base)
            rate = (b["tokens"] - a["tokens"]) / (b["wall_s"] - a["wall_s"])
            steady = (b["tokens"] - a["tokens"]) / (b["wall_s"] - b["startup_s"] - a["wall_s"] + a["startup_s"])
            results.append({"config": c, "small": a, "large": b, "marginal_tokens_per_s": rate,
                            "marginal_after_startup_tokens_per_s": steady})
            click.echo(f"{c:<22} marginal {rate:7.1f} tok/s (start-up excluded {steady:7.1f})   whole {large}-prompt "
                       f"job {b['tokens'] / b['wall_s']:7.1f}"
                       f" tok/s   start-up {a['startup_s']:.1f}/{b['startup_s']:.1f} s   batch {b['batch_sizes']}"
                       f"   mismatches {b['mismatches']}/{b['checked']}")
            (Path(out) / "results.json").write_text(json.dumps(results, indent=2))  # (each as it ends)


if __name__ == "__main__":
    main()
