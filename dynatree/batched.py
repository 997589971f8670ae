"""Batched greedy AR: the throughput baseline for offline corpus generation.

B prompts are left-padded to a common length and decoded together, one target forward per
step for the whole batch; each row stops on its own (EOS, ``max_new_tokens`` or the context
limit) and finished rows are dropped from the batch and the cache.  Position ids count only a
row's real tokens, and padding is masked out, so every row gets the tokens unbatched ``ar``
gives it (tested in float64; in lower precision, batched matmuls may round differently).
"""
from __future__ import annotations

import time

import torch

from .kvcache import new_cache
from .metrics import Metrics, Tally, finish
from .models import ModelPair


@torch.inference_mode()
def decode_ar_batch(pair: ModelPair, prompts: list[list[int]], *, max_new_tokens: int,
                    ignore_eos: bool = False) -> list[tuple[list[int], str, Metrics]]:
    """Decode ``prompts`` together; returns (tokens, finish reason, metrics) per prompt."""
    if not prompts:
        return []
    for p in prompts:
        if not p or len(p) >= pair.max_context:
            raise ValueError("every prompt needs 1 .. context-1 tokens")
    model, dev = pair.target, pair.device
    eos = None if ignore_eos else pair.eos_token_id
    pad = pair.eos_token_id if pair.eos_token_id is not None else 0
    b, width = len(prompts), max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)  # (B,)
    ids = torch.full((b, width), pad, dtype=torch.long, device=dev)  # (B, W) left-padded
    attn = torch.zeros((b, width), dtype=torch.long, device=dev)  # (B, W) 1 = real token
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=dev)
        attn[i, width - len(p):] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, W) positions of real tokens start at 0

    t_start = time.perf_counter()
    cache = new_cache(model, width + max_new_tokens + 1)
    outs: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * b
    done_at = [0.0] * b
    forwards = 0
    active = list(range(b))  # original row index of each batch row
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                   use_cache=True).logits[:, -1]  # (B, V)
    forwards += 1
    ttft = time.perf_counter() - t_start
    next_pos = lengths.clone()  # (B,) position of the token fed next
    while active:
        nxt = logits.argmax(-1)  # (B_active,)
        toks = nxt.tolist()  # host sync: per-row stop decisions
        keep = []
        now = time.perf_counter() - t_start
        for j, (row, tok) in enumerate(zip(active, toks)):
            outs[row].append(tok)
            n_total = len(prompts[row]) + len(outs[row])
            if eos is not None and tok == eos:
                reasons[row] = "eos"
            elif len(outs[row]) >= max_new_tokens:
                reasons[row] = "length"
            elif n_total >= pair.max_context:
                reasons[row] = "context"
            if reasons[row] is None:
                keep.append(j)
            else:
                done_at[row] = now
        if not keep:
            break
        if len(keep) < len(active):
            sel = torch.tensor(keep, device=dev)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[sel], layer.values[sel]
            attn, nxt, next_pos = attn[sel], nxt[sel], next_pos[sel]
            active = [active[j] for j in keep]
        attn = torch.cat([attn, attn.new_ones((len(active), 1))], dim=1)  # (B, kv_len)
        logits = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                       past_key_values=cache, use_cache=True).logits[:, -1]
        forwards += 1
        next_pos = next_pos + 1
    results = []
    for row in range(b):
        n = len(outs[row])
        tally = Tally()
        for _ in range(max(n - 1, 0)):
            tally.add(1, 0, 0, 0)
        m = finish(tally, prompt_tokens=len(prompts[row]), new_tokens=n, wall=done_at[row], ttft=ttft,
                   prefill=ttft, draft_time=0.0, verify_time=done_at[row] - ttft,
                   target_forwards=n, draft_forwards=0, device=dev)
        results.append((outs[row], reasons[row], m))
    return results
