"""Equivalence with greedy AR: where two token streams part, and whether that is a near-tie.

In float32 two exact implementations may still pick different tokens where the target's top-2
logits are within rounding of each other.  ``divergence`` reports the first differing index and
the target's top-1 minus top-2 logit gap there (from a plain, cache-free forward), so a tiny
margin (a numerical near-tie) can be told apart from a bug (a large one).
"""
from __future__ import annotations

import torch

from .models import ModelPair


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def divergence(pair: ModelPair, prompt_ids: list[int], reference: list[int],
               candidate: list[int], window: int = 0) -> tuple[int | None, float | None]:
    """(first differing index, target top-2 logit margin there) or (None, None) if identical.

    With a cache window (``window`` = kv_window) the margin is known only while nothing was
    evicted (a plain forward is then what the windowed decode computed); past that it is None."""
    i = first_difference(reference, candidate)
    if i is None:
        return None, None
    if window and len(prompt_ids) + i > window:
        return i, None
    ids = torch.tensor([prompt_ids + reference[:i]], device=pair.device)
    logits = pair.target(input_ids=ids).logits[0, -1].float()
    top2 = logits.topk(2).values
    return i, float(top2[0] - top2[1])


def truncate_prompt(ids: list[int], max_prompt_tokens: int | None) -> list[int]:
    """Keep the last ``max_prompt_tokens`` tokens: generation continues from the end of the text."""
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        return ids[-max_prompt_tokens:]
    return ids


def check_methods(pair: ModelPair, prompts: list[list[int]], methods: dict, *, max_new_tokens: int,
                  ignore_eos: bool = True, progress=None) -> list[dict]:
    """Decode every prompt with ``ar`` and each method; one row per (prompt, method).

    methods: {label: config}.  Rows carry tokens/s, tokens/iteration and the AR comparison.
    """
    from .config import ARConfig, ar_reference, reference_label
    from .engine import decode

    rows = []
    for pi, prompt in enumerate(prompts):
        refs = {}  # greedy ar per cache window (plain ar first)

        def ar(cfg: ARConfig) -> list[int]:
            if cfg not in refs:
                ref, _, mref = decode(pair, prompt, cfg, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
                refs[cfg] = ref
                rows.append({"prompt": pi, "method": reference_label(cfg),
                             "matches_ar": True, "first_divergence": None, "divergence_margin": None,
                             **mref.as_dict()})
            return refs[cfg]

        ar(ARConfig())
        for label, cfg in methods.items():
            ref = ar(ar_reference(cfg))
            toks, _, m = decode(pair, prompt, cfg, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
            idx, margin = divergence(pair, prompt, ref, toks, cfg.kv_window)
            rows.append({"prompt": pi, "method": label, "matches_ar": idx is None,
                         "first_divergence": idx, "divergence_margin": margin, **m.as_dict()})
        if progress:
            progress(pi + 1, len(prompts))
    return rows
