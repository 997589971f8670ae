"""dynatree as the decoding stage of a Ray Data pipeline: prompts in (JSONL or Parquet), Parquet out.

    python jobs/examples/ray_data_stage.py --input jobs/examples/demo-prompts.jsonl --output out/ray-data

(from the repository root; without --target/--draft the bundled demo pair).  Any other stages --
filters, prompt templates, a dedup -- go before or after ``map_batches`` as in any Ray Data
pipeline; ``dynatree run`` is the tool when you want resume, atomic shards and a summary.
"""
from __future__ import annotations

import argparse
import os

import ray

from dynatree.actors.ray_data import Generate, check


def pipeline(input: str, output: str, *, actors: int = 1, cpus: float = 1, threads: int = 2, batch_rows: int = 16,
             **options) -> None:
    """Read ``input``, decode every row with ``options`` (dynatree run's: method, max_new_tokens, ...), write
    ``output``.  ``batch_rows``: rows per Ray Data batch (the engine's own batch is the batch_size
    option); ``cpus`` per actor stays below a node's CPUs so Ray Data's read and write tasks can run."""
    pool = dict(num_cpus=cpus, compute=ray.data.ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=4))
    check(pool, **options)  # bad paths, tokenizers, options or a pool too big fail here, not in every actor
    ds = ray.data.read_json(input) if input.endswith((".jsonl", ".json")) else ray.data.read_parquet(input)
    ds = ds.map_batches(Generate, fn_constructor_kwargs=dict(options, threads=threads), batch_size=batch_rows,
                        batch_format="pyarrow", **pool)
    ds.write_parquet(output)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--method", default="dynatree")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--verify-fraction", type=float, default=1.0)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--chat-template", action="store_true", help="render prompts with the target's chat template")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="a method option, repeatable")
    ap.add_argument("--actors", type=int, default=1)
    ap.add_argument("--cpus", type=float, default=1, help="CPUs each actor reserves")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per actor")
    ap.add_argument("--address", help="a running Ray cluster (default: RAY_ADDRESS's, else a new local one)")
    a = ap.parse_args()
    # (not ray.init(): it joins the last `ray start` head on this machine, whatever its size)
    ray.init(address=a.address or os.environ.get("RAY_ADDRESS") or "local")
    try:
        pipeline(a.input, a.output, actors=a.actors, cpus=a.cpus, threads=a.threads, target=a.target, draft=a.draft,
                 method=a.method, max_new_tokens=a.max_new_tokens, verify_fraction=a.verify_fraction,
                 max_prompt_tokens=a.max_prompt_tokens, ignore_eos=a.ignore_eos, chat_template=a.chat_template,
                 options=a.option)  # (KEY=VALUE strings, as a job file may give them)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
