"""`dynatree profile`'s report: forward latencies as the budget profiles them, the rates against
the machine's measured peak, a batched step against a tree, a prefill, and the native kernel
against torch's MKL path.  Printed as it is measured (click.echo); cli.py loads the pair."""
from __future__ import annotations

import os

import statistics

import click
import torch

from . import budget, native  # (budget's functions looked up when called: tests stand in for them)


def report(pair, prefix: int, prefill: int, repeats: int, rounds: int, lengths: tuple[int, ...], kv_dtype: str,
           sequences: int) -> None:
    """The whole profile of a loaded pair (see `dynatree profile --help` for the arguments)."""
    if prefill >= pair.max_context:
        click.echo(f"--prefill {prefill}: the models' context is {pair.max_context} tokens; timing a prefill of "
                   f"{pair.max_context - 1}", err=True)
        prefill = pair.max_context - 1
    lat = budget.profile(pair, prefix_len=prefix, widths=(1, 2, 4, 8, 16), repeats=repeats, fresh=True,
                      kv_dtype=kv_dtype)
    if lat.short_at != prefix:  # the budget's profile keeps its largest forward inside the context
        click.echo(f"--prefix {prefix} leaves no room for a {max(lat.verify_ms)}-token forward in the "
                   f"{pair.max_context}-token context: timing at {lat.short_at}", err=True)
        prefix = lat.short_at
    cache = "" if kv_dtype == "model" else f" (keys and values stored as {kv_dtype})"
    click.echo(f"kernel {pair.kernel}, {pair.device}, {str(pair.dtype).replace('torch.', '')}, "
               f"{torch.get_num_threads()} threads, {prefix} cached tokens{cache}; ms per forward "
               f"(median of {repeats}; of fewer, an odd number, for a forward over {budget.PROFILE_MS / repeats:.0f} ms, "
               "as a job's start-up times them)")
    runner = pair.runner("target")
    timed = _forwards(pair, lat)
    _rates(pair, timed)
    if sequences:
        _sequences_line(runner, prefix, sequences, repeats, kv_dtype)
    if prefill:
        ms = budget.time_prefill(runner, prefill, repeats, kv_dtype)
        click.echo(f"target prefill of {prefill} tokens: {ms:.1f} ms")
    if getattr(runner, "native", False):
        _against_mkl(pair, prefill, prefix, repeats, kv_dtype, rounds)
    if lengths:
        _cache_sweep(runner, lengths, pair.max_context, repeats, kv_dtype)


def _forwards(pair, lat) -> list[tuple[str, dict]]:
    """Prints which forward runs each model and the profile's tables; returns (model, ms by size)."""
    if getattr(pair.runner("target"), "native", False):
        click.echo(f"native kernel: {native.status()}")
    for name in ("target", "draft"):
        why = pair.not_native(name)
        if why:  # (transformers' runner: how it takes trees and batches too)
            shown = why if hasattr(pair.runner(name), "native") else pair.forward_in_use(name)
            click.echo(f"{name}: not on dynatree's kernel: {shown}")
    measured = lat.measured or {"verify_ms": lat.verify_ms, "draft_ms": lat.draft_ms}  # as timed
    timed = [("target", measured["verify_ms"])] + ([("draft", measured["draft_ms"])] if pair.draft is not None else [])
    if pair.draft is None:
        click.echo("draft: none given, only the target is timed")
    for name, table in timed:
        fmt = getattr(pair.runner(name), "weight_format", None)
        store = "" if fmt is None else "  (bfloat16 compute)" if fmt == native.BF16_COMPUTE else \
            f"  (weights stored as {str(native.FORMATS[fmt]).replace('torch.', '')})"
        at = budget.within(pair, name, lat.short_at, table)  # (a draft with fewer positions: over fewer tokens)
        over = f"  (over {at} cached tokens: its {pair.context_of(name)}-token context)" if at < lat.short_at else ""
        click.echo(f"{name:<7}" + "".join(f"  {n:>3}: {ms:6.2f}" for n, ms in sorted(table.items())) + store + over)
    return timed


def _rates(pair, timed: list[tuple[str, dict]]) -> None:
    """The CPU's measured peak (on the native kernel) and each model's per-extra-token rate against it."""
    runner = pair.runner("target")
    peak = fma_peak_line(torch.get_num_threads()) if getattr(runner, "native", False) else 0.0
    bf16 = getattr(runner, "weight_format", None) == native.BF16_COMPUTE  # (--kernel lean-bf16)
    dot = native.dot_peak(torch.get_num_threads()) if peak and (bf16 or runner.lib.dt_bf16_dot()) else 0.0
    if dot and runner.lib.dt_bf16_dot():  # (measured: the flag alone promised Intel's CPUs a speed they lack)
        _bf16_note(peak, dot, bf16)
    if bf16:
        peak = dot
        click.echo(f"bfloat16 compute on {native.bf16_compute(runner.lib)}: bfloat16 dot peak {peak:.0f} GFLOP/s, "
                   "measured")
    for name, table in timed:
        lo, hi = _slope_sizes(table, (16, 64) if name == "target" else (4, 16))
        ms = (table[hi] - table[lo]) / (hi - lo)
        flops = 2 * matmul_params(pair.runner(name))
        if ms <= 0:  # timing noise larger than the extra tokens' cost (few --repeats, a busy host)
            click.echo(f"{name}: the extra tokens at {lo}-{hi} tokens cost less than the timing noise "
                       f"({table[lo]:.3f} against {table[hi]:.3f} ms): not measurable, try more --repeats")
            continue
        rate = flops / ms / 1e6
        of_peak = f", {rate / peak:.0%} of the {'bfloat16 dot' if bf16 else 'FMA'} peak" if peak else ""
        if peak and rate > peak:  # (a slope of two noisy medians)
            of_peak += " -- above the peak: timing noise, try more --repeats"
        click.echo(f"{name}: {ms:.3f} ms per extra token at {lo}-{hi} tokens = {rate:.1f} GFLOP/s{of_peak} "
                   f"({flops / 1e6:.1f} MFLOP per token)")


def _bf16_note(fma: float, dot: float, chosen: bool) -> None:
    """Whether --kernel lean-bf16 pays on this CPU, from the two peaks measured: AVX512_BF16's dot
    products ran at twice the float32 FMA's rate on AMD Zen 4 and 5, and at half of it on Intel
    Emerald Rapids (2026-11-30), where bfloat16 compute is the slower kernel."""
    ratio = dot / fma if fma else 0.0
    if chosen and ratio < 1:
        click.echo(f"note: this CPU's bfloat16 dot products measured {dot:.0f} GFLOP/s against the float32 FMA's "
                   f"{fma:.0f} ({ratio:.2f}x): --kernel lean-bf16 is slower than --kernel lean here", err=True)
    elif not chosen:
        verdict = ("--kernel lean-bf16 computes in bfloat16 on it (its own numbers, exact against ar on it; README: "
                   "bfloat16 compute)" if ratio > 1.2 else "--kernel lean-bf16 would not be faster here")
        click.echo(f"note: this CPU's bfloat16 dot products measured {dot:.0f} GFLOP/s against the float32 FMA's "
                   f"{fma:.0f} ({ratio:.2f}x): {verdict}")


def fma_peak_line(threads: int) -> float:
    """Prints the CPU and the variant's FMA peak on ``threads`` threads beside one thread's (with a
    note when they share cores: every timing after it reads slow); returns the former."""
    from .machine import cpu, describe, describe_rates, fma_rates, shares_cores

    rates = fma_rates(threads)
    click.echo(f"CPU: {describe(cpu())}")
    click.echo(f"FMA peak of this variant, measured: {describe_rates(rates)}")
    if shares_cores(rates):
        click.echo(f"note: {threads} threads reach {rates['gflops'] / rates['one_thread_gflops']:.2f}x one "
                   f"thread's FMA rate, not ~{threads}x: these CPUs share cores (SMT siblings, or another "
                   "tenant's load on them), so the timings below read slow and vary between runs", err=True)
    return rates["gflops"]


def _sequences_line(runner, prefix: int, n: int, repeats: int, kv_dtype: str) -> None:
    """A batched decode step against a tree of as many tokens: on the native kernel, what each
    sequence of a batch pays beyond its token's compute is reading its own keys and values, which a
    tree's nodes share -- the cost the per-token slope above leaves out, and where batched decoding
    meets the memory's bandwidth rather than the FMA peak.  Torch's paths say what they pay."""
    from .cmodel import Runner

    got = budget.time_sequences(runner, prefix, n, repeats, kv_dtype)
    if got is None:
        why = "needs at least 2" if n < 2 else "two of their caches would pass 1 GiB"
        click.echo(f"target, {n} sequences: not timed ({why})")
        return
    apart, together, kv, used = got
    fewer = f" (not {n}: {n} caches would pass 1 GiB)" if used < n else ""
    extra = (apart - together) / (used - 1)
    if getattr(runner, "native", False):
        rate = f", {kv / extra / 1e6:.0f} GB/s" if extra > 0 else ""
        what = f"reading its {kv / 2**20:.1f} MiB of keys and values{rate}"
    elif isinstance(runner, Runner):
        what = f"its attention, run apart on torch's path, over its {kv / 2**20:.1f} MiB of keys and values"
    elif runner.batch_problem and runner.joined_problem:
        what = f"this runner decodes each sequence in a forward of its own ({runner.batch_problem})"
    elif runner.batch_problem:
        what = f"transformers' joined forward, attention per sequence over its {kv / 2**20:.1f} MiB of keys and values"
    else:  # (the repeats meet again: their rows share one block, models.HFRunner.forward)
        what = (f"transformers' padded forward, attention over its {kv / 2**20:.1f} MiB of keys and values "
                "in the block the rows share")
    click.echo(f"target, {used} sequences of 1 token over {prefix} cached tokens each{fewer}: {apart:.2f} ms, "
               f"against {together:.2f} ms for one sequence of {used} tokens: {extra:+.3f} ms per extra sequence, "
               f"{what}")


def _slope_sizes(table: dict, wanted: tuple[int, int]) -> tuple[int, int]:
    """The two sizes the per-extra-token cost is read between: ``wanted`` when both were timed,
    else the two largest (a short context leaves out the large forwards)."""
    return wanted if set(wanted) <= set(table) else tuple(sorted(table)[-2:])


def _cache_sweep(runner, lengths: tuple[int, ...], context: int, repeats: int, kv_dtype: str) -> None:
    """Target forwards of 1 and 16 tokens against the cached length: what grows with the cache is
    attention (and the cache reads), what stays is the weight stream and the GEMMs."""
    base = None
    for n in lengths:
        if n + 17 > context:
            click.echo(f"cached {n}: skipped (past the {context}-token context)")
            continue
        ms = budget._profile_model(runner, n, (1, 16), repeats, kv_dtype)
        base = base or (n, ms)
        grow = "" if base[0] == n else (f"  ({ms[1] - base[1][1]:+.2f} / {ms[16] - base[1][16]:+.2f} ms over "
                                       f"{base[0]} cached: the longer cache's share "
                                       f"{(ms[1] - base[1][1]) / ms[1]:.0%} / {(ms[16] - base[1][16]) / ms[16]:.0%})")
        click.echo(f"cached {n:>5}: target 1 token {ms[1]:6.2f} ms, 16 tokens {ms[16]:6.2f} ms{grow}")


def _against_mkl(pair, prefill: int, prefix: int, repeats: int, kv_dtype: str, rounds: int) -> None:
    """The native kernel's target and draft forwards against the same forwards on torch's
    MKL/oneDNN GEMMs (--kernel lean-mkl), with the shapes where native is slower named (the
    portable-kernel bounds hold for both models)."""
    from . import kbuild
    models = [("target", budget.fitting((1, 4, 16, 64), pair.max_context), prefill)]
    if pair.draft is not None and getattr(pair.runner("draft"), "native", False):
        models.append(("draft", budget.fitting((1, 4, 16), pair.context_of("draft")), 0))
    for name, sizes, pre in models:
        _mkl_rounds(pair.runner(name), name, sizes, pre, budget.within(pair, name, prefix, sizes), repeats,
                    kv_dtype, rounds)
    if pair.kernel == "lean-bf16":
        click.echo("note: the native times above compute in bfloat16 (--kernel lean-bf16), lean-mkl's in float32")
    held = _mkl_held_to(kbuild.variant())
    if held and "MKL_ENABLE_INSTRUCTIONS" not in os.environ:
        # MKL picks its code path from the CPU, not from DYNATREE_ISA: here it runs wider FMAs than the
        # variant's (up to 2x or 4x its peak), which MKL on a CPU that has only the variant's cannot.
        wide, mkl, onednn = held
        click.echo(f"note: MKL runs {wide} on this CPU; for the comparison a CPU with only this variant's vectors "
                   f"sees, run with MKL_ENABLE_INSTRUCTIONS={mkl} ONEDNN_MAX_CPU_ISA={onednn}")


def _mkl_rounds(native, name: str, sizes: list[int], prefill: int, prefix: int, repeats: int, kv_dtype: str,
                rounds: int) -> None:
    """One model's forwards on the native kernel and on MKL, taking turns for ``rounds`` rounds;
    each ratio is the median of the rounds' ratios: timed one after the other, a drift of the host
    between them (±20% over seconds on the shared 2-vCPU VMs) read as a kernel difference -- the
    same code's 300-token prefill came out 1.09x and 1.44x MKL's in two runs minutes apart (Intel
    Emerald Rapids, 2026-11-28)."""
    mkl = type(native)(native.model, gemm=False)  # the same architecture's torch path
    pairs: dict[str, list[tuple[float, float]]] = {}  # label -> (native ms, mkl ms) per round
    for _ in range(rounds):
        a, b = (budget._profile_model(m, prefix, sizes, repeats, kv_dtype) for m in (native, mkl))
        for n in sizes:
            pairs.setdefault(f"{n} token{'s' if n > 1 else ''}", []).append((a[n], b[n]))
        if prefill:
            pairs.setdefault(f"{prefill}-token prefill", []).append(
                tuple(budget.time_prefill(m, prefill, repeats, kv_dtype) for m in (native, mkl)))
    mid = statistics.median  # (of an even count, the mean of the middle two: the upper one read as a verdict)
    ratios = {k: sorted(x / y for x, y in v) for k, v in pairs.items()}
    click.echo(f"lean-mkl {name:<6}" + "".join(f"  {k.split()[0]:>3}: {mid([y for _, y in v]):6.2f}"
                                                 for k, v in pairs.items() if "prefill" not in k)
               + "".join(f"  (prefill of {prefill} tokens: {mid([y for _, y in v]):.1f} ms)"
                         for k, v in pairs.items() if "prefill" in k))
    spread = (lambda r: f" ({r[0]:.2f}-{r[-1]:.2f})") if rounds > 1 else (lambda r: "")
    slower = [k for k, r in ratios.items() if mid(r) > 1.0]
    click.echo(f"{name}, native ÷ lean-mkl time (median of {rounds} alternating round{'s' if rounds > 1 else ''}"
               f"{', range' if rounds > 1 else ''}): "
               + ", ".join(f"{k} {mid(r):.2f}x{spread(r)}" for k, r in ratios.items())
               + (f" -- native is SLOWER than MKL at {', '.join(slower)} on this CPU" if slower else ""))


def _mkl_held_to(variant: str) -> tuple[str, str, str] | None:
    """For a kernel variant narrower than this x86 CPU's vectors: (what MKL runs here, and the
    MKL_ENABLE_INSTRUCTIONS and ONEDNN_MAX_CPU_ISA values that hold torch's MKL and oneDNN to the
    variant's width); None otherwise.  (The generic build's 128-bit GEMM ran 0.44-0.54x MKL's time
    at 16-300 rows with MKL held to SSE4.2, 1.3-3.1x against MKL's AVX-512: Emerald Rapids.)"""
    from . import kbuild
    wide = "AVX-512" if kbuild.has_avx512() else "AVX2" if "avx2" in kbuild.variants_here() else None
    if variant == "avx2" and wide == "AVX-512":
        return wide, "AVX2", "AVX2"
    if variant == "generic" and wide:
        return wide, "SSE4_2", "SSE41"
    return None


def matmul_params(runner) -> int:
    """Weights a token multiplies (every Linear's, the LM head's too when it shares the embedding's
    matrix; not the embedding lookup), for GFLOP/s."""
    model = runner if isinstance(runner, torch.nn.Module) else runner.model  # a runner's whole causal LM
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
