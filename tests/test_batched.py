"""Batched AR equals unbatched AR token for token (float64), with per-row stopping."""
from dynatree import decode, make_config
from dynatree.batched import decode_ar_batch
from dynatree.models import pair_from_models

from conftest import random_prompts


def test_batched_ar_matches_unbatched(close_pair):
    prompts = random_prompts(9, seed=11, lo=1, hi=30)
    for ignore_eos in (True, False):
        got = decode_ar_batch(close_pair, prompts, max_new_tokens=25, ignore_eos=ignore_eos)
        for p, (toks, reason, m) in zip(prompts, got):
            ref, ref_reason, _ = decode(close_pair, p, make_config("ar"), max_new_tokens=25, ignore_eos=ignore_eos)
            assert toks == ref and reason == ref_reason
            assert m.new_tokens == len(ref)


def test_batched_ar_rows_stop_independently(close_pair):
    prompts = random_prompts(6, seed=12, lo=2, hi=20)
    free = [decode(close_pair, p, make_config("ar"), max_new_tokens=20, ignore_eos=True)[0] for p in prompts]
    eos = free[0][4]  # an EOS that some rows hit early and others later or never
    pair = pair_from_models(close_pair.target, None, None, eos_token_id=eos)
    got = decode_ar_batch(pair, prompts, max_new_tokens=20)
    reasons = set()
    for p, (toks, reason, _) in zip(prompts, got):
        ref, ref_reason, _ = decode(pair, p, make_config("ar"), max_new_tokens=20)
        assert toks == ref and reason == ref_reason
        reasons.add(reason)
    assert reasons == {"eos", "length"} or "eos" in reasons
    # a row near the context limit stops with "context" while the others go on
    ctx = pair.max_context
    long = random_prompts(1, seed=13, lo=ctx - 5, hi=ctx - 5)[0]
    got = decode_ar_batch(close_pair, [long, prompts[1]], max_new_tokens=20, ignore_eos=True)
    assert got[0][1] == "context" and len(got[0][0]) == 5
    assert got[1][0] == decode(close_pair, prompts[1], make_config("ar"), max_new_tokens=20, ignore_eos=True)[0]
