"""Equivalence with AR: where two token streams part, and whether that is a near-tie.

In float32 two exact implementations may still pick different tokens where the target's top-2
logits are within rounding of each other.  ``divergence`` reports the first differing index and
the target's top-1 minus top-2 logit gap there (as the reference ``ar`` computed it; when
sampling, the gap of the perturbed scores the draw took, sampling.py), so a tiny margin (a
numerical near-tie) can be told apart from a bug (a large one).
"""
from __future__ import annotations

import torch

from .models import ModelPair
from .sampling import Sampler


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def reference_logits(pair: ModelPair, prompt_ids: list[int], tokens: list[int], cfg=None) -> torch.Tensor:
    """(V,) the target's logits after ``prompt_ids + tokens`` as greedy ``ar`` computed them: the
    prompt's prefill, then one cached step per token, into a cache of the method's ``kv_dtype``
    (so a bfloat16-cache divergence is judged by the numbers its reference ran on)."""
    from .kvcache import new_cache
    from .runtime import Seq

    runner, dev = pair.runner("target"), pair.device
    cache = new_cache(runner, len(prompt_ids) + len(tokens) + 1, getattr(cfg, "kv_dtype", "model"))
    with pair.lock:  # (the runner's buffers are the pair's: ModelPair.lock)
        out = runner.forward([Seq(torch.tensor(prompt_ids, device=dev), cache, keep=1)])[0]
        for tok in tokens:  # one step each, as ar ran them (a single forward may round differently off the native kernel)
            out = runner.forward([Seq(torch.tensor([tok], device=dev), cache, keep=1)])[0]
    return out.logits[0, -1].float()


def divergence(pair: ModelPair, prompt_ids: list[int], reference: list[int],
               candidate: list[int], cfg=None) -> tuple[int | None, float | None]:
    """(first differing index, target top-2 logit margin there) or (None, None) if identical.

    ``cfg``: the method's config; the margin is read from :func:`reference_logits` with its cache
    dtype.  With a cache window (``kv_window``) the margin is known only while nothing was evicted;
    past that it is None."""
    i = first_difference(reference, candidate)
    if i is None:
        return None, None
    window = getattr(cfg, "kv_window", 0)
    if window and len(prompt_ids) + i > window:
        return i, None
    logits = reference_logits(pair, prompt_ids, reference[:i], cfg)
    sampler = Sampler.from_config(cfg, prompt_ids) if cfg is not None else None
    if sampler is not None:  # the draw at index i is the argmax of the perturbed scores
        sampler.at(i)
        logits = sampler.scores(logits[None], [0])[0]
    top2 = logits.topk(2).values
    return i, float(top2[0] - top2[1])


def truncate_prompt(ids: list[int], max_prompt_tokens: int | None, chat: bool = False, lead: int = 0) -> list[int]:
    """Keep the last ``max_prompt_tokens`` tokens: generation continues from the end of the text
    (``lead``: the first ``lead`` ids, the tokenizer's BOS, kept before them, as ModelPair.encode
    keeps them).  A ``chat`` prompt (rendered by a chat template) is never cut -- its last tokens
    would lose the template's header -- so a longer one is a ValueError."""
    if chat and max_prompt_tokens and len(ids) > max_prompt_tokens:
        raise ValueError(f"chat prompt of {len(ids)} tokens is longer than the {max_prompt_tokens} a prompt may keep "
                         "(max_prompt_tokens, or the context less max_new_tokens); shorten the conversation")
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        lead = lead if lead < max_prompt_tokens else 0
        return ids[:lead] + ids[len(ids) - max_prompt_tokens + lead:]
    return ids


def all_windowed(cfgs) -> bool:
    """Whether every method config in ``cfgs`` (None: one without options, a transformers peer)
    has a cache window (kv_window), and so decodes past the context."""
    cfgs = list(cfgs)
    return bool(cfgs) and all(getattr(c, "kv_window", 0) for c in cfgs)


def prompt_budget(context: int, windowed: bool, max_prompt_tokens: int | None, max_new_tokens: int) -> int | None:
    """The prompt tokens kept (None: all) -- by a job's rows (actors/worker.prompt_ids), a check and
    a bench: ``max_prompt_tokens`` for ``windowed`` methods (all_windowed: they decode past the
    context), else fewer where the ``context``-token window must hold the new tokens too (a
    ValueError when they alone fill it)."""
    if windowed:
        return max_prompt_tokens
    room = context - max_new_tokens
    if room < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the {context}-token "
                         "context (the generation does not fit beside one; methods with a cache window, option "
                         "kv_window, can generate past it; give every one)")
    return min(room, max_prompt_tokens or room)


def check_methods(pair: ModelPair, prompts: list[list[int]], methods: dict, *, max_new_tokens: int,
                  ignore_eos: bool = True, progress=None, reference: ModelPair | None = None) -> list[dict]:
    """Decode every prompt with ``ar`` and each method; one row per (prompt, method).

    methods: {label: config}.  Rows carry tokens/s, tokens/iteration and the AR comparison.  An
    ``ar`` method is a reference: decoded once, under its reference label (``ar_t0.5``, ...).
    Plain greedy ``ar`` runs too on every prompt whose generation fits the context (methods with a
    cache window decode past it; it cannot).  ``reference``: the same target in another precision
    (float32 beside a bfloat16 run): every row, the references too, is also compared with that
    pair's ``ar`` (:func:`against_reference`'s fields).
    """
    rows, pi = [], 0
    try:
        for pi, prompt in enumerate(prompts):
            _check_prompt(pair, pi, prompt, methods, rows, max_new_tokens, ignore_eos, reference)
            if progress:
                progress(pi + 1, len(prompts))
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: the prompts checked whole stay reportable
        e.partial_rows = [r for r in rows if r["prompt"] < pi]
        raise
    return rows


def _check_prompt(pair: ModelPair, pi: int, prompt: list[int], methods: dict, rows: list[dict], max_new_tokens: int,
                  ignore_eos: bool, reference: ModelPair | None = None) -> None:
    """check_methods' rows for prompt number ``pi``, appended to ``rows``."""
    from .config import ARConfig, ar_reference, reference_label
    from .engine import decode

    refs = {}  # ar per reference config (plain greedy ar first)
    elsewhere = {}  # (the reference pair's ar per reference config)
    against = (lambda cfg, toks: {}) if reference is None else (lambda cfg, toks: against_reference(
        reference, prompt, cfg, toks, elsewhere, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos))

    def ar(cfg: ARConfig, label: str | None = None) -> list[int]:
        """The reference's tokens, its row decoded once (under the user's label when it is a
        method given with one; again under another label given to the same config).  A bare
        ``ar`` is labelled by its config (``ar_t0.5``): plain greedy ``ar`` is ``ar``."""
        if label == "ar" or label in {row["method"] for c, (_, row) in refs.items() if c != cfg}:
            label = None
        if cfg not in refs:
            pair.forget_prefixes()  # each decode prefills its prompt itself, as the methods' do
            ref, _, mref = decode(pair, prompt, cfg, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
            rows.append({"prompt": pi, "method": label or reference_label(cfg),
                         "matches_ar": None, "first_divergence": None, "divergence_margin": None,  # (the reference)
                         **mref.as_dict(), **against(cfg, ref)})
            refs[cfg] = (ref, rows[-1])
        elif label and label != refs[cfg][1]["method"]:
            rows.append({**refs[cfg][1], "method": label})
        return refs[cfg][0]

    if len(prompt) + max_new_tokens <= pair.max_context:
        ar(ARConfig())
    for label, cfg in methods.items():
        ref = ar(ar_reference(cfg), label if isinstance(cfg, ARConfig) else None)
        if isinstance(cfg, ARConfig):
            continue
        pair.forget_prefixes()
        toks, _, m = decode(pair, prompt, cfg, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        idx, margin = divergence(pair, prompt, ref, toks, cfg)
        rows.append({"prompt": pi, "method": label, "matches_ar": idx is None,
                     "first_divergence": idx, "divergence_margin": margin, **m.as_dict(), **against(cfg, toks)})


def against_reference(reference: ModelPair, prompt: list[int], cfg, tokens: list[int], refs: dict, *,
                      max_new_tokens: int, ignore_eos: bool) -> dict:
    """How far ``tokens`` (decoded with ``cfg``) are from ``ar`` on ``reference`` -- the same target
    in another precision: ``reference_matches`` (bool), ``reference_divergence`` (the first differing
    index, or None) and ``reference_margin`` (the reference's top-2 logit gap there: how near a tie
    the precision flipped).  The reference ``ar`` has the method's sampling and window, and the
    reference pair's own cache dtype (kv_dtype model); it is decoded once per config into ``refs``."""
    from dataclasses import replace

    from .config import ar_reference
    from .engine import decode

    rcfg = replace(ar_reference(cfg), kv_dtype="model")
    if rcfg not in refs:
        reference.forget_prefixes()
        refs[rcfg] = decode(reference, prompt, rcfg, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)[0]
    idx, margin = divergence(reference, prompt, refs[rcfg], tokens, rcfg)
    return {"reference_matches": idx is None, "reference_divergence": idx, "reference_margin": margin}
