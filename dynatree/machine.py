"""What a measurement ran on: the CPU as `lscpu` names it, and how fast its FMAs ran at the time.

Why: the same code measures up to ~2x apart on two CPUs of one cloud's "2 vCPU" size, and on one
VM over an afternoon (two vCPUs that sometimes share a physical core); a table of tokens/s means
little without the CPU it came from and the FMA rate it had then.
"""
from __future__ import annotations

import os
import platform

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "asimd", "sve")  # what the kernels use


def cpu() -> dict:
    """The CPU's identity: model name, vendor, family/model (x86), the SIMD flags the kernels care
    about, logical CPUs this process may use.  Fields unknown on this OS are left out."""
    from .kbuild import cpuinfo_lines

    info = {"arch": platform.machine(), "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count()}
    first = {k: line.partition(":")[2].strip() for k, line in cpuinfo_lines().items()}
    if not first:
        return {**info, "model": platform.processor() or "unknown"}
    names = {"model": "model name", "vendor": "vendor_id", "family": "cpu family", "model_number": "model"}
    info.update({k: first[v] for k, v in names.items() if v in first})
    if "model" not in info:  # aarch64 kernels name the implementer and part instead
        info["model"] = " ".join(f"{k} {first[k]}" for k in ("CPU implementer", "CPU part") if k in first) or "unknown"
    have = set((first.get("flags") or first.get("Features") or "").split())
    info["flags"] = [f for f in FLAGS if f in have]
    return info


def fma_rates(threads: int) -> dict | None:
    """The native kernel's FMA probe (native.fma_peak) on ``threads`` threads and on one, in
    GFLOP/s, or None without the kernel.  A rate on N threads far under N times one thread's
    means the CPUs share cores (SMT siblings, or another tenant's load on them): shares_cores."""
    from . import native

    many = native.fma_peak(threads)
    if not many:
        return None
    one = many if threads == 1 else native.fma_peak(1)
    return {"variant": native.variant(), "threads": threads, "gflops": round(many, 1),
            "one_thread_gflops": round(one, 1)}


def shares_cores(rates: dict) -> bool:
    return rates["threads"] > 1 and rates["gflops"] < 0.75 * rates["threads"] * rates["one_thread_gflops"]


def describe(info: dict) -> str:
    """One line: 'Intel(R) Xeon(R) Processor (x86_64, family 6 model 207; avx2 fma avx512f), 2 CPUs'."""
    x86 = f", family {info['family']} model {info['model_number']}" if "family" in info else ""
    flags = f"; {' '.join(info['flags'])}" if info.get("flags") else ""
    return f"{info.get('model', 'unknown')} ({info.get('arch', '?')}{x86}{flags}), {info.get('cpus', '?')} CPUs"


def describe_rates(rates: dict) -> str:
    one = f" ({rates['gflops'] / rates['one_thread_gflops']:.2f}x one thread's {rates['one_thread_gflops']:.1f})" \
        if rates["threads"] > 1 else ""
    return f"{rates['gflops']:.1f} GFLOP/s on {rates['threads']} thread{'s' * (rates['threads'] > 1)}{one}"


def busy_cpus(seconds: float = 0.05) -> float | None:
    """CPUs' worth of time the machine spent busy over ``seconds`` while this process slept: what
    other processes use (from /proc/stat; None where there is none).  Why: a forward on N threads
    waits at every step for a thread another process displaced -- with both of 2 cores busy
    elsewhere a 2-thread `generate` ran up to ~300x slower in a user's trial, one thread not at all."""
    import time

    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(v), v[3] + v[4]

    try:
        total0, idle0 = ticks()
        time.sleep(seconds)
        total1, idle1 = ticks()
    except (OSError, ValueError):
        return None
    total = total1 - total0
    return (1 - (idle1 - idle0) / total) * (os.cpu_count() or 1) if total > 0 else None
