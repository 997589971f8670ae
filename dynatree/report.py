"""``dynatree report DIR``: tables (Markdown) and plots (PNG) from ``results.parquet`` alone."""
from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path

from .metrics import defined_mean


def _load(out: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(Path(out) / "results.parquet").to_pylist()


def _ms(vals, fmt="{:.1f}") -> str:
    vals = [v for v in vals if v is not None]
    if len(vals) < 2:  # (one prompt has no spread to show)
        return fmt.format(vals[0]) + " (n = 1)" if vals else "-"
    return f"{fmt.format(statistics.fmean(vals))} ± {fmt.format(_sd(vals))}"


def _sd(vals) -> float:
    vals = [v for v in vals if v is not None]
    return statistics.stdev(vals) if len(vals) > 1 else 0.0


def _groups(rows, sweep="main", warmup: bool = False):
    """{dataset: {method: [measured rows]}} in first-seen order, warm-up dropped (kept with ``warmup``)."""
    out: dict = {}
    for r in rows:
        if (r["warmup"] and not warmup) or json.loads(r["setting"]).get("sweep") != sweep:
            continue
        out.setdefault(r["dataset"], {}).setdefault(r["method"], []).append(r)
    return out


def _speedup(rs, ar_rs) -> float | None:
    a, b = defined_mean([r["tokens_per_s"] for r in rs]), defined_mean([r["tokens_per_s"] for r in ar_rs])
    return a / b if a and b else None


def _ref_speedup(gd: dict, m: str) -> float | None:
    """Method m's speedup against its `ar` reference (plain `ar`, or the `ar` with its sampling and
    cache options: a sampled label against greedy `ar` would mix two different generations)."""
    rs = gd.get(m, [])
    ref = (rs[0].get("ref_method") if rs else None) or "ar"
    return _speedup(rs, gd.get(ref, []))


def _main_tables(g: dict, every: dict) -> list[str]:
    """The tables of the main setting (every method on every prompt, one at a time); ``every``: its
    rows with the warm-up ones, whose outputs are checked as well."""
    datasets = list(g)
    methods = list(dict.fromkeys(m for d in datasets for m in g[d]))
    tables = (functools.partial(_results_table, every=every), _latency_table, _efficiency_table, _ablation_table,
              _kv_update_table, _memory_table)
    return [t for t in (table(g, datasets, methods) for table in tables) if t]


def _results_table(g: dict, datasets: list, methods: list, every: dict) -> str:
    head = "| method | " + " | ".join(f"{d} tokens/s | {d} speedup" for d in datasets) + \
        " | identical to `ar` (rows checked, warm-up included, all datasets) |"
    sep = "|---" * (1 + 2 * len(datasets) + 1) + "|"
    lines = ["## Main results (tokens/s mean ± std over measured prompts; speedup = mean tokens/s ÷ its `ar` "
             "reference's: plain `ar`, or the `ar` with the method's sampling and cache options)", "", head, sep]
    wrong = []
    for m in methods:
        cells = []
        for d in datasets:
            rs = g[d].get(m, [])
            sp = _ref_speedup(g[d], m)
            cells += [_ms([r["tokens_per_s"] for r in rs]), f"{sp:.2f}×" if sp else "-"]
        # (a warm-up row's output counts: one that differed had read "yes")
        differ, n = _checked([r for d in datasets for r in every.get(d, {}).get(m, [])])
        refs = all(r.get("ref_method") == m for d in datasets for r in g[d].get(m, []))
        if differ:
            wrong.append(m)
        verdict = (f"NO: {differ} of {n} differ" if differ else f"yes ({n})") if n else \
            "reference" if refs else "sampled"
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {verdict} |")
    if wrong:
        lines += ["", f"**{', '.join(wrong)}: outputs differ from `ar`** — a speed of other tokens, not a speedup of "
                      "the same generation (see results.parquet's first_divergence and divergence_margin)."]
    return "\n".join(lines)


def _latency_table(g: dict, datasets: list, methods: list) -> str:
    lines = ["## Latency (ms)", "", "| method | " + " | ".join(f"{d} TTFT | {d} TPOT" for d in datasets) + " |",
             "|---" * (1 + 2 * len(datasets)) + "|"]
    for m in methods:
        cells = []
        for d in datasets:
            rs = g[d].get(m, [])
            cells += [_ms([r["ttft_s"] * 1e3 if r["ttft_s"] is not None else None for r in rs]),
                      _ms([r["tpot_s"] * 1e3 if r["tpot_s"] is not None and (r.get("new_tokens") or 0) > 1
                           else None for r in rs])]  # (one new token has no time per output token)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _efficiency_table(g: dict, datasets: list, methods: list) -> str:
    lines = ["## Verification efficiency", "",
             "| dataset | method | acceptance | L̄ tokens/iter | ℓ̄ accepted/iter | iterations | tree nodes | draft ms | verify ms | outside forwards |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for d in datasets:
        for m in methods:
            rs = g[d].get(m, [])
            if not rs or rs[0]["iterations"] is None:
                continue
            lines.append(f"| {d} | {m} | {_ms([r['acceptance_rate'] for r in rs], '{:.2f}')} | "
                         f"{_ms([r['tokens_per_iteration'] for r in rs], '{:.2f}')} | "
                         f"{_ms([r['avg_path_length'] for r in rs], '{:.2f}')} | "
                         f"{_ms([r['iterations'] for r in rs])} | {_ms([r['mean_tree_size'] for r in rs])} | "
                         f"{_ms([_ms_of(r['draft_time_s']) for r in rs])} | {_ms([_ms_of(r['verify_time_s']) for r in rs])} | "
                         f"{_ms([100 * r['overhead_fraction'] if r.get('overhead_fraction') is not None else None for r in rs], '{:.1f}%')} |")
    return "\n".join(lines)


def _ms_of(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _options_of(g: dict, datasets: list, m: str) -> tuple[str, dict]:
    """A labelled method's base method and options (the same on every row of it)."""
    r = next(r for d in datasets for r in g[d].get(m, [])[:1])
    return r["base_method"], json.loads(r["options"])


def _ablation_table(g: dict, datasets: list, methods: list) -> str | None:
    """Whichever labelled greedy dynatree variants the run contains, fewest mechanisms on first
    (a sampled one, or one with another cache, changes more than its mechanisms)."""
    opts = {m: _options_of(g, datasets, m) for m in methods}
    other = ("kv_update", "kv_window", "kv_dtype", "temperature")
    abl = [m for m in methods if opts[m][0] == "dynatree" and not any(opts[m][1].get(k) not in (None, 0, "model", "gather")
                                                                          for k in other)]
    if len(abl) < 2:  # one dynatree is no ablation
        return None

    def rank(m):  # (the mechanisms on: dynamic breadth, dynamic depth, history, hardware budget, context lookup)
        from .config import make_config

        c = make_config("dynatree", opts[m][1])
        return c.dynamic_breadth + c.dynamic_depth + c.history + c.budget_on + (c.lookup_length > 0), m

    lines = ["## Ablation (greedy dynatree variants, fewest mechanisms on first: dynamic breadth, dynamic depth, "
             "history, hardware budget, context lookup; speedup as in Main results)", "",
             "| method | " + " | ".join(f"{d} tokens/s | {d} speedup | {d} L̄" for d in datasets) + " |",
             "|---" * (1 + 3 * len(datasets)) + "|"]
    for m in sorted(abl, key=rank):
        cells = []
        for d in datasets:
            rs = g[d].get(m, [])
            sp = _ref_speedup(g[d], m)
            cells += [_ms([r["tokens_per_s"] for r in rs]), f"{sp:.2f}×" if sp else "-",
                      _ms([r["tokens_per_iteration"] for r in rs], "{:.2f}")]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _kv_update_table(g: dict, datasets: list, methods: list) -> str | None:
    """Each recompute variant beside its gather twin (otherwise equal options)."""
    def rest(m):
        base, o = _options_of(g, datasets, m)
        return base, {k: v for k, v in o.items() if k != "kv_update"}

    kind = {m: _options_of(g, datasets, m)[1].get("kv_update", "gather") for m in methods}
    pairs = [(t, m) for m in methods if kind[m] == "recompute"
             for t in [next((t for t in methods if kind[t] == "gather" and rest(t) == rest(m)), None)] if t]
    if not pairs:
        return None
    lines = ["## KV update (gather accepted keys/values vs crop and recompute)", "",
             "| method | kv_update | " + " | ".join(f"{d} tokens/s | {d} target forwards" for d in datasets) + " |",
             "|---" * (2 + 2 * len(datasets)) + "|"]
    for m in [x for p in pairs for x in p]:
        cells = []
        for d in datasets:
            rs = g[d].get(m, [])
            cells += [_ms([r["tokens_per_s"] for r in rs]), _ms([r["target_forwards"] for r in rs])]
        lines.append(f"| {m} | {kind[m]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _memory_table(g: dict, datasets: list, methods: list) -> str:
    lines = ["## Peak memory during generation (MB above the process level at start)", "",
             "| method | " + " | ".join(datasets) + " |", "|---" * (1 + len(datasets)) + "|"]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(_ms([r["peak_memory_mb"] for r in g[d].get(m, [])]) for d in datasets) + " |")
    return "\n".join(lines)


def _ar_said(rows: list[dict]) -> str:
    """What the rows labelled ``ar`` ran: plain ar, or ar with options every method was given (a
    bare ``--option kv_window=N`` windows ``ar`` too)."""
    opts = next((json.loads(r["options"]) for r in rows if r["method"] == "ar" and r.get("options")), {})
    return "ar (" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "plain ar"


def _batch_table(rows: list[dict]) -> list[str]:
    """Throughput per actor against batch size (``--batch-sizes``)."""
    brows = [r for r in rows if json.loads(r["setting"]).get("sweep") == "batch"]
    if not brows:
        return []
    lines = ["## Batched decoding (tokens/s per actor: all tokens ÷ all wall time, prefill included; "
             f"× ar / × ref: against batched {_ar_said(brows)} / the ar with the row's sampling and cache options, at the "
             "same B; rows identical to batch-1 ref)", "",
             "| dataset | B | method | tokens/s | × ar at B | × ref at B | L̄ | tree nodes | identical to ref |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d in dict.fromkeys(r["dataset"] for r in brows):
        for b in sorted({json.loads(r["setting"])["B"] for r in brows if r["dataset"] == d}):
            sub = [r for r in brows if r["dataset"] == d and json.loads(r["setting"])["B"] == b]
            for r in sub:  # (rows written before ref_method was: plain ar's)
                sp, spr = (_speedup([r], [x for x in sub if x["method"] == ref]) for ref in ("ar", r.get("ref_method") or "ar"))
                asked = json.loads(r["setting"]).get("asked")  # (B larger than the prompts measured: all of them)
                shown = f"{b} (also for B = {', '.join(map(str, asked))}: {b} prompts measured)" if asked else b
                lines.append(f"| {d} | {shown} | {r['method']} | {r['tokens_per_s']:.1f} | {f'{sp:.2f}×' if sp else '-'} | "
                             f"{f'{spr:.2f}×' if spr else '-'} | "
                             + " | ".join(f"{v:.2f}" if v is not None else "-" for v in (r["tokens_per_iteration"], r["mean_tree_size"]))
                             + f" | {r['rows_matching_ar']}/{r['rows']} |")
    return ["\n".join(lines)]


def _per_iteration_ms(rs) -> str:
    """Mean draft / verify / other ms per iteration (other: wall minus prefill, draft, verify)."""
    its = [r for r in rs if r.get("iterations")]
    if not its or not any(r.get("draft_forwards") for r in its):
        return "-"
    parts = [defined_mean([1e3 * f(r) / r["iterations"] for r in its]) for f in (
        lambda r: r["draft_time_s"], lambda r: r["verify_time_s"],
        lambda r: r["wall_time_s"] - r["prefill_time_s"] - r["draft_time_s"] - r["verify_time_s"])]
    return " / ".join(f"{v:.2f}" for v in parts)


def _sweep_table(srows: list[dict], key: str, title: str) -> str:
    """One row per (dataset, sweep value, method): the seeds' length table (baseline and method
    tokens/s, speedup, tokens per iteration) plus memory, the iteration's time split and exactness."""
    lines = [f"## {title} (tokens/s; × ar = speedup vs {_ar_said(srows)} at the same {key}; × ref = vs the ar with the "
             "same cache window, which greedy tokens must equal)", "",
             f"| dataset | {key} | method | tokens/s | × ar | × ref | L̄ | KV cache MB | peak MB above start "
             "| draft / verify / other ms per iteration | identical to ref |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in dict.fromkeys(r["dataset"] for r in srows):
        for v in sorted({json.loads(r["setting"])[key] for r in srows if r["dataset"] == d}):
            sub = [r for r in srows if r["dataset"] == d and json.loads(r["setting"])[key] == v]
            by = {m: [r for r in sub if r["method"] == m] for m in dict.fromkeys(r["method"] for r in sub)}
            for m, rs in by.items():
                ref = rs[0].get("ref_method") or "ar"
                sp, spr = _speedup(rs, by.get("ar", [])), _speedup(rs, by.get(ref, []))
                lines.append(f"| {d} | {v} | {m} | {_ms([r['tokens_per_s'] for r in rs])} | "
                             f"{f'{sp:.2f}×' if sp else '-'} | {f'{spr:.2f}×' if spr else '-'} | "
                             f"{_ms([r.get('tokens_per_iteration') for r in rs], '{:.2f}')} | "
                             f"{_ms([r.get('kv_cache_mb') for r in rs])} | {_ms([r.get('peak_memory_mb') for r in rs])} | "
                             f"{_per_iteration_ms(rs)} | {_exact(rs)} |")
    return "\n".join(lines)


def _mixed(rows: list[dict]) -> list[str]:
    """A note where the main setting's rows were measured at more than one T or L_max (results of two
    benches put together): its cells pool them, and the header names one."""
    main = [r for r in rows if json.loads(r["setting"]).get("sweep") == "main"]
    lengths = sorted({(r.get("max_new_tokens"), r.get("max_prompt_tokens")) for r in main}, key=str)
    if len(lengths) < 2:
        return []
    said = ", ".join(f"T={t} L_max={lp}" for t, lp in lengths)
    return [f"**Mixed runs**: the main setting's rows were measured at {said} — each cell below pools them; "
            "report each bench's results.parquet on its own."]


def tables(rows: list[dict]) -> str:
    g = _groups(rows)
    parts = _mixed(rows) + _warm_up_mismatches(rows) + (_main_tables(g, _groups(rows, warmup=True)) if g else [])
    parts += _batch_table(rows)
    for sweep, key, title in (("tokens", "T", "Generation length sweep"), ("prompt_len", "L", "Prompt length sweep")):
        srows = [r for r in rows if not r["warmup"] and json.loads(r["setting"]).get("sweep") == sweep]
        if srows:
            parts.append(_sweep_table(srows, key, title))

    grid = _groups(rows, "grid")
    if grid:
        lines = ["## Fixed-tree grid (speedup vs ar; best first)", "",
                 "| dataset | setting | tokens/s | speedup | L̄ | identical to `ar` |", "|---|---|---|---|---|---|"]
        for d, by in grid.items():
            res = [(m, _speedup(rs, by.get("ar", [])), rs) for m, rs in by.items() if m != "ar"]
            for m, sp, rs in sorted(res, key=lambda x: -(x[1] or 0)):
                lines.append(f"| {d} | {m} | {_ms([r['tokens_per_s'] for r in rs])} | {sp:.2f}× | "
                             f"{_ms([r['tokens_per_iteration'] for r in rs], '{:.2f}')} | {_exact(rs)} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def _checked(rs: list[dict]) -> tuple[int, int]:
    """(rows that differ from their ar reference, rows checked)."""
    checked = [r["matches_ar"] for r in rs if r["matches_ar"] is not None]
    return checked.count(False), len(checked)


def _exact(rs: list[dict]) -> str:
    """Rows identical to their ar reference, of those checked ("-": none was)."""
    differ, n = _checked(rs)
    return f"{n - differ}/{n}" if n else "-"


def _warm_up_mismatches(rows: list[dict]) -> list[str]:
    """A note naming the sweeps' warm-up rows that differ from ar: their tables count measured rows."""
    bad = sorted({f"{r['method']} ({r['setting']})" for r in rows if r["warmup"] and r["matches_ar"] is False
                  and json.loads(r["setting"]).get("sweep") != "main"})
    return [f"**Warm-up rows that differ from `ar`**: {', '.join(bad)}."] if bad else []


def plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:  # (a base install: the tables are the results; the plots an extra)
        import warnings

        warnings.warn("no plots: matplotlib is not installed (pip install 'dynatree[plot]')", stacklevel=2)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = [p for p in (_throughput_plot(rows, out, plt),) if p]
    made += _sweep_plots(rows, out, plt)
    made += [p for p in (_batch_plot(rows, out, plt),) if p]
    grid = _groups(rows, "grid")
    return made + [_grid_plot(d, by, out, plt) for d, by in grid.items()]


def _save_fig(fig, path: Path, plt, **kw) -> Path:
    fig.savefig(path, dpi=110, metadata={"Software": _MARK}, **kw)  # (the mark old_plots looks for)
    plt.close(fig)
    return path


def _throughput_plot(rows: list[dict], out: Path, plt) -> Path | None:
    """The main setting: tokens/s and speedup per method, one bar per dataset."""
    g = _groups(rows)
    datasets = list(g)
    if not datasets:
        return None
    methods = list(dict.fromkeys(m for d in datasets for m in g[d]))
    fig, axes = plt.subplots(2, 1, figsize=(min(14, max(7, 0.6 * len(methods) * len(datasets))), 7.5))
    width = 0.8 / len(datasets)
    for k, d in enumerate(datasets):
        xs = [i + k * width for i in range(len(methods))]
        tps = [defined_mean([r["tokens_per_s"] for r in g[d].get(m, [])]) or 0 for m in methods]
        sds = [_sd([r["tokens_per_s"] for r in g[d].get(m, [])]) for m in methods]
        sps = [_ref_speedup(g[d], m) or 0 for m in methods]
        axes[0].bar(xs, tps, width, yerr=sds, label=d, capsize=2)
        axes[1].bar(xs, sps, width, label=d)
    for ax, title in zip(axes, ("tokens/s (mean ± std)", "speedup vs its ar reference")):
        ax.set_xticks([i + width * (len(datasets) - 1) / 2 for i in range(len(methods))])
        ax.set_xticklabels(methods, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    fig.tight_layout()
    return _save_fig(fig, out / "throughput.png", plt)


def _batch_plot(rows: list[dict], out: Path, plt) -> Path | None:
    """tokens/s per actor against B: one colour per method, one line style and marker per dataset."""
    brows = [r for r in rows if json.loads(r["setting"]).get("sweep") == "batch"]
    if not brows:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    methods = list(dict.fromkeys(r["method"] for r in brows))
    styles, markers = ["-", "--", ":", "-."], "os^D"  # (a marker too: a single B draws points, no line)
    for i, d in enumerate(dict.fromkeys(r["dataset"] for r in brows)):
        for j, m in enumerate(methods):
            pts = sorted((json.loads(r["setting"])["B"], r["tokens_per_s"]) for r in brows
                         if r["dataset"] == d and r["method"] == m)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], color=f"C{j % 10}",
                        linestyle=styles[i % len(styles)], label=f"{d} {m}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B (sequences per forward)")
    ax.set_ylabel("tokens/s per actor")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save_fig(fig, out / "batch.png", plt)


def _grid_plot(d: str, by: dict, out: Path, plt) -> Path:
    """The depth x branch x tau grid's speedups, one heat map per tau."""
    import re

    cells = {}
    for m, rs in by.items():
        if m != "ar":
            opts = json.loads(rs[0]["options"])
            cells[(opts.get("depth", 5), opts.get("branch", 2), opts.get("tau", 0.02))] = _speedup(rs, by.get("ar", []))
    taus, depths, branches = (sorted({k[i] for k in cells}) for i in (2, 0, 1))
    fig, axes = plt.subplots(1, len(taus), figsize=(3.2 * len(taus), 3.2), squeeze=False)
    vmax = max(v for v in cells.values() if v) if cells else 1
    vmin = min(v for v in cells.values() if v) if cells else 0
    for ax, tau in zip(axes[0], taus):
        mat = [[cells.get((dd, bb, tau)) or float("nan") for dd in depths] for bb in branches]
        im = ax.imshow(mat, vmin=vmin, vmax=vmax, cmap="viridis", origin="lower", aspect="auto")
        ax.set_xticks(range(len(depths)), depths)
        ax.set_yticks(range(len(branches)), branches)
        ax.set_xlabel("depth D")
        ax.set_ylabel("branch B")
        ax.set_title(f"τ={tau}", fontsize=9)
        for i, row in enumerate(mat):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="speedup vs ar")
    return _save_fig(fig, out / f"grid_{re.sub(r'[^A-Za-z0-9_-]', '_', d)}.png", plt, bbox_inches="tight")


def _sweep_plots(rows: list[dict], out: Path, plt) -> list[Path]:
    """One PNG per sweep (T, L): tokens/s, speedup vs ar and KV cache MB against the swept value."""
    made = []
    for sweep, key, xlabel in (("tokens", "T", "new tokens T"), ("prompt_len", "L", "prompt length L_max")):
        srows = [r for r in rows if not r["warmup"] and json.loads(r["setting"]).get("sweep") == sweep]
        if not srows:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        methods = list(dict.fromkeys(r["method"] for r in srows))
        for d, style in zip(dict.fromkeys(r["dataset"] for r in srows), ("-", "--", ":", "-.")):
            vs = sorted({json.loads(r["setting"])[key] for r in srows if r["dataset"] == d})
            at = {v: [r for r in srows if r["dataset"] == d and json.loads(r["setting"])[key] == v] for v in vs}
            for i, m in enumerate(methods):  # a colour per method, a line style per dataset
                mine = {v: [r for r in at[v] if r["method"] == m] for v in vs}
                line = dict(marker="o", ls=style, color=f"C{i % 10}", label=f"{d} {m}")
                axes[0].plot(vs, [defined_mean([r["tokens_per_s"] for r in mine[v]]) or 0 for v in vs], **line)
                axes[1].plot(vs, [_speedup(mine[v], [r for r in at[v] if r["method"] == "ar"]) or 0 for v in vs], **line)
                axes[2].plot(vs, [defined_mean([r.get("kv_cache_mb") for r in mine[v]]) or 0 for v in vs], **line)
        for ax, ylabel in zip(axes, ("tokens/s", "speedup vs ar", "KV cache MB (target + draft)")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
        axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
        axes[2].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.tight_layout()
        made.append(_save_fig(fig, out / f"sweep_{sweep}.png", plt))
    return made


PLOTS = ("throughput.png", "batch.png", "grid_*.png", "sweep_*.png")  # the file names plots() writes
_MARK = "dynatree bench"  # each plot's PNG "Software" text


def old_plots(out: Path) -> list[Path]:
    """The plots an earlier bench or report drew in ``out`` (a plot this run does not redraw would be
    stale): files named as plots() names them *and* marked as its own, so a user's grid_mine.png in
    --out is never removed (the measurement trial lost two)."""
    return [p for pat in PLOTS for p in out.glob(pat) if _png_text(p, "Software") == _MARK]


def unmarked_plots(out: Path) -> list[Path]:
    """Files named as plots() names them but not marked as its own: an older dynatree's plots (drawn
    before the mark) or the user's, which a bench leaves alone -- and says so (the upgrade trial)."""
    return [p for pat in PLOTS for p in sorted(out.glob(pat)) if _png_text(p, "Software") != _MARK]


def _png_text(path: Path, key: str) -> str | None:
    """A PNG's tEXt value for ``key`` (read up to its image data), or None."""
    import struct

    try:
        with open(path, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                return None
            while head := f.read(8):
                size, kind = struct.unpack(">I4s", head)
                if kind == b"IDAT" or size > 1 << 20:
                    return None
                data = f.read(size + 4)[:size]  # (and the CRC)
                if kind == b"tEXt" and data.split(b"\0", 1)[0] == key.encode():
                    return data.split(b"\0", 1)[1].decode("latin-1")
    except (OSError, struct.error):
        return None
    return None


class NothingMeasured(ValueError):
    """A bench directory whose results hold warm-up rows only."""


def _machine_line(host: dict | None) -> str:
    """The CPU a bench ran on and its FMA probe at the start and the end (bench._machine), with a
    warning where the host's speed moved or its threads shared cores -- or nothing for a bench.json
    of an older version."""
    if not host:
        return ""
    from .machine import describe, describe_rates, shares_cores

    line = f"machine: {describe(host['cpu'])}"
    rates = [(when, host.get(f"fma_{when}")) for when in ("start", "end")]
    rates = [(when, r) for when, r in rates if r]
    if rates:
        line += f"; FMA probe ({rates[0][1]['variant']} kernel) " + ", ".join(
            f"at the {when} {describe_rates(r)}" for when, r in rates)
    warn = []
    if len(rates) == 2 and abs(rates[1][1]["gflops"] / rates[0][1]["gflops"] - 1) > 0.2:
        warn.append("the host's FMA rate moved by more than 20% during the bench: compare numbers of one run "
                    "(methods take turns on each batch), not rates across runs")
    if any(shares_cores(r) for _, r in rates):
        warn.append("the threads reached well under their count times one thread's FMA rate: they shared cores "
                    "(SMT siblings, or another tenant's load), so rates read slow")
    return line + ".\n\n" + "".join(f"**Note**: {w}.\n\n" for w in warn)


def report(out_dir: str | Path) -> tuple[Path, list[Path]]:
    out = Path(out_dir)
    rows = _load(out)
    if not any(not r["warmup"] for r in rows):
        raise NothingMeasured("no measured prompts in its results, only warm-up ones (was the bench stopped "
                              "during its warm-up?): nothing to tabulate")
    md = tables(rows)
    meta = out / "bench.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        s = m["spec"]
        if m.get("interrupted"):
            have = {r["dataset"] for r in rows if not r["warmup"]}
            md = (f"**Interrupted**: the bench was stopped before the end; the tables hold the prompts every "
                  f"method finished ({sum(not r['warmup'] for r in rows)} measured rows, from "
                  f"{', '.join(sorted(have))}).\n\n") + md
        used = m.get("prompts_used") or {}  # a file may hold fewer usable prompts than asked for
        counts = ", ".join(f"{n} {name}" for name, n in used.items()) + " prompts" if used else \
            f"{s['prompts']} prompts per dataset" + (" planned" if m.get("interrupted") else "")
        kept = m.get("max_prompt_tokens_kept") or s["max_prompt_tokens"]
        lmax = f"{kept} (of {s['max_prompt_tokens']}: the context holds the new tokens too)" \
            if kept < s["max_prompt_tokens"] else kept
        forward = "".join(f"; {w}: {f}" for w, f in (m.get("forward") or {}).items())
        peers = any(str(r.get("base_method") or r["method"]).startswith("hf_") for r in rows)
        if peers and m.get("kernel", "lean") != "hf":
            # (the peers run another forward on other weights: their "× ar" is not the algorithm's alone)
            forward += ("; hf_* peers: transformers' own forward and weights, not the kernel above (--kernel hf runs "
                        "every row on transformers' forward, for a comparison of the algorithms alone)")
        shared = next((x["options"] for x in s["methods"] if x["label"] == "ar"), None)  # options given to all
        forward += f"; options given to every method (as `ar` takes them): {json.dumps(shared, sort_keys=True)}" \
            if shared else ""
        md = (f"# dynatree bench\n\npair: {m['pair']}; device {m['device']}, {m['dtype']}, {m['threads']} threads, "
              f"kernel {m.get('kernel', 'lean')}{forward}; "
              f"{counts} ({s['warmup']} warm-up), T={s['max_new_tokens']}, L_max={lmax}; EOS ignored.\n\n"
              + _machine_line(m.get("machine"))) + md
    path = out / "summary.md"
    path.write_text(md)
    for old in old_plots(out):  # (a plot this run does not redraw would be stale)
        old.unlink()
    return path, plots(rows, out)
