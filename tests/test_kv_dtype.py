"""kv_dtype=bfloat16: keys and values stored rounded to bfloat16 (half the bytes a forward streams
from the caches), read back widened.  Rounding happens once, as a token is cached, the same for
every method, so every greedy method equals `ar` with the same kv_dtype."""
import json
import shutil

import pytest
import torch

from dynatree import decode, make_config, native
from dynatree.config import ARConfig, ar_reference, reference_label
from dynatree.engine import decode_batch
from dynatree.kvcache import BufferCache, new_cache

from conftest import random_prompts
from test_batched import METHODS, f32_pair

BF16 = {"kv_dtype": "bfloat16"}
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


def test_reference_is_ar_with_the_same_cache_dtype():
    ref = ar_reference(make_config("dynatree", BF16))
    assert ref == ARConfig(kv_dtype="bfloat16") and reference_label(ref) == "ar_kvbfloat16"
    windowed = ar_reference(make_config("linear", {**BF16, "kv_window": 100}))
    assert reference_label(windowed) == "ar_window100_kvbfloat16"
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        make_config("ar", {"kv_dtype": "int8"})


def test_cache_stores_bfloat16_and_reads_back_widened():
    layer = BufferCache(1, 8, torch.bfloat16).layers[0]
    k = torch.randn(1, 2, 3, 4)
    got_k, got_v = layer.update(k, -k)
    assert layer.keys.dtype == torch.bfloat16 and got_k.dtype == torch.float32
    assert torch.equal(got_k, k.to(torch.bfloat16).float()) and torch.equal(got_v, (-k).to(torch.bfloat16).float())


@needs_cc
@pytest.mark.parametrize("isa", native.variants_here())
def test_native_kernel_rounds_like_torch(isa, monkeypatch):
    """The kernel writes bfloat16 keys/values rounded to nearest even, as torch converts: layer 0's
    cached keys of a bf16 cache equal the float32 cache's, converted by torch."""
    monkeypatch.setenv("DYNATREE_ISA", isa)
    pair = f32_pair()
    target = pair.runner("target")
    assert target.native
    ids = torch.tensor([random_prompts(1, seed=60, lo=40, hi=40)[0]])
    caches = {}
    with torch.inference_mode():
        for kv in ("model", "bfloat16"):
            caches[kv] = new_cache(target, 64, kv)
            target(input_ids=ids, past_key_values=caches[kv])
    full, half = caches["model"].layers[0], caches["bfloat16"].layers[0]
    assert half.keys.dtype == torch.bfloat16 and half.length == 40
    assert torch.equal(full.keys[:, :, :40].to(torch.bfloat16), half.keys[:, :, :40])
    assert torch.equal(full.values[:, :, :40].to(torch.bfloat16), half.values[:, :, :40])


@needs_cc
@pytest.mark.parametrize("isa,batch", [(v, 1) for v in native.variants_here()] + [("native", 3)])
def test_native_greedy_with_bf16_cache_is_bf16_ar(isa, batch, monkeypatch):
    """Native kernel, no tolerance: with a bfloat16 cache every method equals ar with a bfloat16
    cache on every variant this CPU runs and at any batch size (the tokens differ from float32 ar's
    only where the rounding flips a choice; the comparison is like with like)."""
    monkeypatch.setenv("DYNATREE_ISA", isa)
    pair = f32_pair()
    prompts = random_prompts(3, seed=61, lo=5, hi=50)
    refs = [decode(pair, p, make_config("ar", BF16), max_new_tokens=60, ignore_eos=True)[0] for p in prompts]
    for method, opts in METHODS[1:5]:
        for at in range(0, len(prompts), batch):
            got = decode_batch(pair, prompts[at:at + batch], make_config(method, {**opts, **BF16}),
                               max_new_tokens=60, ignore_eos=True)
            assert [t for t, _, _ in got] == refs[at:at + batch], (method, opts, batch)


def test_bf16_cache_on_the_torch_path_float64(close_pair):
    """Torch path in float64: keys/values rounded to bfloat16 and widened back; every method equals
    ar with the same cache dtype, windowed too; the cache buffers take a quarter of float64's bytes."""
    prompts = random_prompts(2, seed=62, lo=5, hi=30)
    for extra in ({}, {"kv_window": 40, "kv_evict": 8}):
        refs = [decode(close_pair, p, make_config("ar", {**BF16, **extra}), max_new_tokens=80, ignore_eos=True)[0]
                for p in prompts]
        for method, opts in METHODS[1:]:
            got = [decode(close_pair, p, make_config(method, {**opts, **BF16, **extra}), max_new_tokens=80,
                          ignore_eos=True)[0] for p in prompts]
            assert got == refs, (method, opts, extra)
    m16 = decode(close_pair, prompts[0], make_config("ar", BF16), max_new_tokens=20)[2]
    m64 = decode(close_pair, prompts[0], make_config("ar"), max_new_tokens=20)[2]
    assert m16.kv_cache_mb == pytest.approx(m64.kv_cache_mb / 4)


def test_bf16_cache_on_the_transformers_kernel(target):
    """transformers' own forward (`--kernel hf`) reads the widened cache through the same
    BufferLayer.update, so it takes the option too."""
    from conftest import EOS, noisy_copy
    from dynatree.models import pair_from_models

    pair = pair_from_models(target, noisy_copy(target, 7, 0.04), None, eos_token_id=EOS, kernel="hf")
    p = random_prompts(1, seed=63, lo=10, hi=10)[0]
    ref, _, m_ref = decode(pair, p, make_config("ar", BF16), max_new_tokens=60, ignore_eos=True)
    got = decode(pair, p, make_config("dynatree", {**BF16, "hw_budget": "off"}), max_new_tokens=60, ignore_eos=True)
    assert got[0] == ref
    assert m_ref.kv_cache_mb == pytest.approx(decode(pair, p, make_config("ar"), max_new_tokens=60)[2].kv_cache_mb / 4)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_no_cache_slot_is_read_before_it_is_written(kernel, close_pair, monkeypatch):
    """Cache buffers are allocated uninitialised; poisoning every fresh buffer with NaN changes no
    token of any method (a read of an unwritten slot would reach the logits)."""
    from dynatree.kvcache import BufferLayer

    pair = f32_pair() if kernel == "native" else close_pair
    prompts = random_prompts(2, seed=64, lo=5, hi=40)
    cfgs = [make_config(m, o) for m, o in METHODS] + [make_config("dynatree", {**BF16, "kv_window": 40, "kv_evict": 8})]
    clean = [[t for t, _, _ in decode_batch(pair, prompts, c, max_new_tokens=50, ignore_eos=True)] for c in cfgs]
    init, grow = BufferLayer.lazy_initialization, BufferLayer._grow

    poisoned_layers = []

    def poisoned_init(self, k, v):
        init(self, k, v)
        poisoned_layers.append(self)
        self.keys.fill_(float("nan"))
        self.values.fill_(float("nan"))

    def poisoned_grow(self, needed):
        grow(self, needed)
        self.keys[:, :, self.length:] = float("nan")
        self.values[:, :, self.length:] = float("nan")

    monkeypatch.setattr(BufferLayer, "lazy_initialization", poisoned_init)
    monkeypatch.setattr(BufferLayer, "_grow", poisoned_grow)
    poisoned = [[t for t, _, _ in decode_batch(pair, prompts, c, max_new_tokens=50, ignore_eos=True)] for c in cfgs]
    assert poisoned_layers and any(l.keys.float().isnan().any() for l in poisoned_layers)  # unused slots stay poisoned
    assert poisoned == clean


@needs_cc
def test_a_divergence_is_judged_by_its_references_numbers():
    """Where float32-cache ar and bfloat16-cache ar part, the logits check.divergence reads are the
    bf16 reference's own (its argmax is the bf16 token there; a float32 forward's would not be),
    and replaying a reference reproduces every one of its tokens."""
    from dynatree.check import divergence, first_difference, reference_logits

    pair, cfg = f32_pair(), make_config("linear", BF16)
    parted = 0
    for p in random_prompts(6, seed=63, lo=5, hi=40):
        f32 = decode(pair, p, make_config("ar"), max_new_tokens=48, ignore_eos=True)[0]
        b16 = decode(pair, p, make_config("ar", BF16), max_new_tokens=48, ignore_eos=True)[0]
        i = first_difference(b16, f32)
        if i is None:
            continue
        parted += 1
        assert int(reference_logits(pair, p, b16[:i], cfg).argmax()) == b16[i]
        assert int(reference_logits(pair, p, f32[:i]).argmax()) == f32[i]
        at, margin = divergence(pair, p, b16, f32, cfg)
        assert at == i and margin >= 0
    assert parted >= 1  # the rounding flips some choice on these prompts, or this test shows nothing
    logits = [int(reference_logits(pair, p, b16[:j], cfg).argmax()) for j in range(len(b16))]
    assert logits == b16


def test_a_shorter_stream_is_a_difference_at_its_end():
    """first_difference: a candidate that stops early (or runs long) is not 'identical to ar' --
    bench's matches_ar and check's rows read None as equal."""
    from dynatree.check import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 2]) == 2 and first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1 and first_difference([], [4]) == 0


def test_a_sampled_divergence_margin_is_the_perturbed_scores_gap():
    """When sampling, the draw at the first difference is the argmax of the perturbed scores, so
    the margin reported is their top-2 gap, not the plain logits' (check.divergence)."""
    from dynatree import make_config
    from dynatree.check import divergence, reference_logits
    from dynatree.sampling import Sampler
    from test_batched import f32_pair

    pair, prompt = f32_pair(), [5, 9, 11, 40]
    cfg = make_config("linear", {"temperature": 0.8, "seed": 7})
    ref = [17, 23, 4, 8]
    cand = ref[:2] + [(ref[2] + 1) % 50, 9]
    at, margin = divergence(pair, prompt, ref, cand, cfg)
    logits = reference_logits(pair, prompt, ref[:2], cfg)
    s = Sampler.from_config(cfg, prompt)
    s.at(2)
    top = s.scores(logits[None], [0])[0].topk(2).values
    plain = logits.topk(2).values
    assert at == 2 and margin == float(top[0] - top[1]) != float(plain[0] - plain[1])


def test_check_measures_a_low_precision_run_against_a_float32_reference(pair_dirs, tmp_path):
    """check --reference-dtype: every row, the run's own ar too, is compared with ar on the target in
    another precision, with that reference's top-2 margin where they part (no command said how far a
    bfloat16 run's text is from float32's: the precision trial)."""
    import warnings

    from click.testing import CliRunner

    from dynatree import cli, pair_from_models
    from dynatree.check import check_methods, first_difference, reference_logits
    from test_batched import EOS, tiny_neox

    ref = f32_pair()  # (its models, rounded to bfloat16 below: the same weights in another precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (bfloat16 on a CPU: slow, and said so)
        low = pair_from_models(tiny_neox(31, hidden=64, dtype=torch.float32).to(torch.bfloat16),
                               tiny_neox(32, hidden=64, layers=1, dtype=torch.float32).to(torch.bfloat16), None,
                               eos_token_id=EOS)
    prompts = random_prompts(3, seed=63, lo=5, hi=40)  # (the first and third part within 20 tokens)
    rows = check_methods(low, prompts, {"dynatree": make_config("dynatree")}, max_new_tokens=20, reference=ref)
    parted = 0
    for r in rows:  # (each row's tokens decoded again: a row's decoding is deterministic)
        p = prompts[r["prompt"]]
        mine = decode(low, p, make_config(r["method"]), max_new_tokens=20, ignore_eos=True)[0]
        theirs = decode(ref, p, make_config("ar"), max_new_tokens=20, ignore_eos=True)[0]
        i = first_difference(theirs, mine)
        assert (r["reference_matches"], r["reference_divergence"]) == (i is None, i)
        if i is not None:
            parted += 1
            top = reference_logits(ref, p, theirs[:i]).topk(2).values
            assert r["reference_margin"] == float(top[0] - top[1])
    assert parted >= 1  # bfloat16 moves some choice on these prompts, or this test shows nothing
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("The quick brown fox", "Call me Ishmael")))
    args = ["check", "--target", str(pair_dirs / "target"), "--draft", str(pair_dirs / "draft"), "--device", "cpu",
            "--dtype", "float64", "--methods", "dynatree", "--max-new-tokens", "4", "--prompts", str(prompts_file)]
    same = CliRunner().invoke(cli.main, args + ["--reference-dtype", "fp64"])
    assert same.exit_code == 1 and "computes as the run does" in same.output, same.output
    res = CliRunner().invoke(cli.main, args + ["--reference-dtype", "float32"])  # the second table
    assert res.exit_code == 0, res.output
    table = res.output[res.output.index("against ar on the target in float32"):].splitlines()
    assert "native kernel" in table[0] and [ln.split()[1:4] for ln in table[2:]] == [["ar", "2", "2"],
                                                                                   ["dynatree", "2", "2"]], res.output
