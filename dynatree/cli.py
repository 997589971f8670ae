"""The ``dynatree`` command line.  Commands only parse flags and call the library."""
from __future__ import annotations

import json
import sys

import click

from .config import METHODS, options_help


def _fail(msg: str) -> None:
    raise click.ClickException(msg)


@click.group()
@click.version_option(package_name="dynatree")
def main() -> None:
    """Exact tree speculative decoding (DynaTree, DySpec) for batch generation."""


def _pair_options(f):
    f = click.option("--target", help="target model: hub name or local directory (default: bundled demo pair)")(f)
    f = click.option("--draft", help="draft model: hub name or local directory (default: bundled demo pair)")(f)
    f = click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N")(f)
    f = click.option("--dtype", default="float32", show_default=True,
                     type=click.Choice(["float32", "bfloat16", "float16", "float64"]))(f)
    return f


@main.command(epilog="\b\nMethod options (--option key=value):\n" + options_help())
@_pair_options
@click.option("--method", default="dynatree", show_default=True, type=click.Choice(list(METHODS)))
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
              help="method option, repeatable (listed below)")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--prompt", help="prompt text (default: read stdin)")
@click.option("--ignore-eos", is_flag=True, help="generate exactly --max-new-tokens tokens")
@click.option("--check-ar", is_flag=True, help="also decode with ar and report whether tokens match")
@click.option("--json", "as_json", is_flag=True, help="print a JSON object (token_ids, text, metrics)")
def generate(target, draft, device, dtype, method, options, max_new_tokens, prompt, ignore_eos,
             check_ar, as_json):
    """Generate a continuation of one prompt."""
    from . import engine
    from .config import make_config, parse_options
    from .models import PairError, load_pair

    if prompt is None:
        prompt = sys.stdin.read()
    if not prompt:
        _fail("empty prompt")
    try:
        cfg = make_config(method, parse_options(options))
        pair = load_pair(target, draft, device=device, dtype=dtype, load_draft=method != "ar")
        gen = engine.generate(pair, prompt, method, cfg, max_new_tokens=max_new_tokens,
                              ignore_eos=ignore_eos)
        result = gen.as_dict()
        if check_ar:
            ref = engine.generate(pair, prompt, "ar", None, max_new_tokens=max_new_tokens,
                                  ignore_eos=ignore_eos)
            result["matches_ar"] = ref.token_ids == gen.token_ids
    except (PairError, ValueError) as e:
        _fail(str(e))
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(gen.text)
    m = gen.metrics
    click.echo(f"\n[{method}] {m.new_tokens} tokens in {m.wall_time_s:.2f}s = {m.tokens_per_s:.1f} tok/s, "
               f"{m.iterations} iterations, {m.tokens_per_iteration:.2f} tokens/iteration, "
               f"finish={gen.finish_reason}" + (f", matches_ar={result['matches_ar']}" if check_ar else ""),
               err=True)


if __name__ == "__main__":
    main()
