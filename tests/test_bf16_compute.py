"""--kernel lean-bf16: the native kernel's matrix products in bfloat16 (csrc/gemm.c, format 3).

Its own numbers, not float32's: every GEMM input rounded to bfloat16 as VCVTNEPS2BF16 rounds,
products summed in float32 in VDPBF16PS's order with denormals flushed.  What must hold is what
holds for the float32 kernel: batch invariance (trees and batches give bitwise ``ar``'s tokens
on this kernel) and the same bits on every variant -- the AVX512_BF16 instruction where the CPU
has it, two FMAs per pair elsewhere."""
import re
import shutil

import pytest
import torch

from dynatree import native, pair_from_models
from dynatree.config import make_config
from dynatree.engine import decode, decode_batch
from dynatree.models import PairError

from conftest import alone_and_packed
from test_native import neox32
from test_packed import llama32

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True, params=native.variants_here())
def isa(request, monkeypatch):
    """Each test on each kernel variant this CPU runs (native may be the VDPBF16PS one)."""
    monkeypatch.setenv("DYNATREE_ISA", request.param)
    return request.param


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """VCVTNEPS2BF16 on float32 bits, written independently of the kernel: zero and denormals to
    signed zero, NaN quieted, else round to nearest even.  Returns float32 values."""
    u = x.view(torch.int32).long() & 0xFFFFFFFF  # (as unsigned)
    e, m = u & 0x7F800000, u & 0x7FFFFF
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    r = torch.where((e == 0x7F800000) & (m != 0), (u | 0x400000) & 0xFFFF0000, r)
    r = torch.where(e == 0, u & 0x80000000, r)
    return (r - ((r >> 31) << 32)).int().view(torch.float32)


def chain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The defined sum: per output, for each pair (2j, 2j+1) of k, acc += x[2j+1] w[2j+1] then
    acc += x[2j] w[2j], each exact product rounded once into float32 (float64 holds the exact sum
    of these moderate values).  x: (M, K), w: (N, K) -> (M, N)."""
    xb, wb = bf16_bits(x).double(), w.bfloat16().double()
    if x.shape[1] % 2:
        xb, wb = torch.nn.functional.pad(xb, (0, 1)), torch.nn.functional.pad(wb, (0, 1))
    acc = torch.zeros(x.shape[0], w.shape[0])
    for j in range(0, xb.shape[1], 2):
        for k in (j + 1, j):
            acc = (acc.double() + xb[:, k:k + 1] * wb[:, k][None]).float()
    return acc if b is None else acc + b


@pytest.mark.parametrize("m, k, n", [(1, 64, 32), (5, 63, 48), (13, 130, 96), (30, 257, 64)])
def test_gemm_sums_the_rounded_products_in_vdpbf16ps_order(m, k, n):
    torch.manual_seed(m * k)
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    lin = native.PackedLinear(w, b, native.BF16_COMPUTE)
    y = lin(x)
    assert torch.equal(y, chain(x, w, b))
    assert torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(m)]), y)  # each row alone: the same bits


def test_x_is_rounded_as_vcvtneps2bf16_rounds():
    """With K = 1 (padded by a zero pair) each output is its row's rounded input: ties to even both
    ways, denormals to zero, the largest values to infinity, NaN quieted."""
    x = torch.randn(192, 1)
    bits = x.view(torch.int32)
    bits[:64] = (bits[:64] & ~0xFFFF) | 0x8000  # exact ties
    bits[64:128] = (bits[64:128] & ~0xFFFF) | 0x18000  # ties, odd-above
    x[128:144] = torch.randn(16, 1) * 1e-39  # float32 denormals
    x[144:152] = 3.4e38 * torch.sign(torch.randn(8, 1))
    x[152] = float("nan")
    bits[153] = 0x007FFFFF  # the largest denormal: to zero, not rounded up to the smallest normal
    y = native.PackedLinear(torch.ones(1, 1), None, native.BF16_COMPUTE)(x)
    want = bf16_bits(x)
    plain = ~torch.isnan(want) & (want != 0)  # (a zero's sign is lost in +0 + -0)
    assert torch.equal(y[plain].view(torch.int32), want[plain].view(torch.int32))
    assert torch.isnan(y[152]) and torch.isinf(y[144:152]).all() and (y[128:144] == 0).all() and y[153] == 0
    assert plain.sum() == 192 - 18


def test_every_variant_computes_the_same_bf16_bits():
    """Edge values included: sums near and below the smallest normal (flushed), denormal weights
    (read as zero), overflow, NaN."""
    torch.manual_seed(1)
    x, w, b = torch.randn(7, 200), torch.randn(64, 200), torch.randn(64) * 1e-38
    x[1, 20:40] = 3.39e38
    x[2, 5] = float("nan")
    x[4] = 1e-19 * torch.randn(200)
    w[:32] *= 1e-19  # row 4's first 32 outputs sum products of ~1e-38
    w[32:, :50] = 1e-39 * torch.randn(32, 50)
    ys = {v: native.PackedLinear(w, b, native.BF16_COMPUTE, native.library(v))(x) for v in native.variants_here()}
    first = next(iter(ys.values()))
    assert len(ys) >= 2 and all(torch.equal(y.view(torch.int32), first.view(torch.int32)) for y in ys.values())
    assert (first[4, :32] == 0).any() and (first[4, :32] != 0).any()  # some flushed, some not


def test_results_flush_after_rounding_as_vdpbf16ps_does():
    """At the smallest normal 2^-126: a sum tiny before rounding but 2^-126 after is kept, one that
    rounds below it becomes zero; a denormal weight or bias reads as zero (tests/kernel_bits.c
    holds the first case for the aarch64 build)."""
    p = lambda e, m=1.0: m * 2.0 ** e  # noqa: E731
    x = torch.tensor([[p(-75), p(-63), 0.0, p(-75, -1.125)], [p(60), p(-63), 0.0, 0.0]])
    w = torch.tensor([[p(-74), p(-63), 0.0, p(-74)], [p(-74), p(-63), 0.0, p(-73)], [p(-130), p(-63), 0.0, 0.0]])
    y = native.PackedLinear(w, torch.tensor([0.0, 0.0, p(-127)]), native.BF16_COMPUTE)(x)
    assert y[0, 0] == p(-126) and y[0, 1] == 0  # (torch keeps denormals: the kernel flushed)
    # row 1, output 2: 2^-63 * 2^-63, then 2^60 times a denormal weight (else 2^-70), plus a
    # denormal bias (else 1.5 * 2^-126)
    assert y[1, 2] == p(-126)


@pytest.mark.parametrize("arch", ["neox", "llama"])
def test_packed_sequences_get_bitwise_their_own_bf16_logits(arch):
    model = neox32(3) if arch == "neox" else llama32("llama", 3)
    run = pair_from_models(model, None, None, eos_token_id=None, kernel="lean-bf16").runner("target")
    assert run.native and run.fwd.weight_format == native.BF16_COMPUTE
    alone, _, packed, _ = alone_and_packed(model, run)
    assert all(torch.equal(a.logits, p.logits) for a, p in zip(alone, packed))
    # its own numbers: near float32's, not equal to them
    ref = pair_from_models(model, None, None, eos_token_id=None).runner("target")
    f32, _, _, _ = alone_and_packed(model, ref)
    gaps = [float((a.logits - f.logits).abs().max()) for a, f in zip(alone, f32)]
    assert 0 < max(gaps) < 0.05 * max(float(f.logits.abs().max()) for f in f32)


def test_trees_and_batches_equal_ar_on_the_bf16_kernel():
    pair = pair_from_models(neox32(5, layers=3), neox32(6, layers=1), None, eos_token_id=3, kernel="lean-bf16")
    prompts = [[5, 9, 11], [40, 2, 7, 7, 1, 8], [3 + i for i in range(20)]]
    ar = [decode(pair, p, make_config("ar"), max_new_tokens=40, ignore_eos=True)[0] for p in prompts]
    for method, opts in [("dynatree", {}), ("linear", {}), ("dynatree", {"hw_budget": "off"})]:
        assert [decode(pair, p, make_config(method, opts), max_new_tokens=40, ignore_eos=True)[0]
                for p in prompts] == ar, (method, opts)
        got = decode_batch(pair, prompts, make_config(method, opts), max_new_tokens=40, ignore_eos=True)
        assert [out for out, _, _ in got] == ar, ("batched", method, opts)
    # sampled: the seeded draws of ar, batched trees included
    hot = {"temperature": 0.9, "seed": 3}
    drawn = [decode(pair, p, make_config("ar", hot), max_new_tokens=40, ignore_eos=True)[0] for p in prompts]
    got = decode_batch(pair, prompts, make_config("dynatree", hot), max_new_tokens=40, ignore_eos=True)
    assert [out for out, _, _ in got] == drawn and drawn != ar


def test_lean_bf16_says_what_it_cannot_run():
    """No silent float32 stand-in: a model the native kernel does not take is an error."""
    with pytest.raises(PairError, match="lean-bf16.*float64"):
        pair_from_models(neox32(1).double(), None, None, eos_token_id=3, kernel="lean-bf16").runner("target")


def test_profile_and_summaries_say_bf16_compute_and_its_peak(tmp_path):
    from click.testing import CliRunner

    from dynatree.cli import main

    neox32(12).save_pretrained(tmp_path / "target")
    res = CliRunner().invoke(main, ["profile", "--target", str(tmp_path / "target"), "--device", "cpu",
                                    "--kernel", "lean-bf16", "--prefix", "16", "--prefill", "0", "--repeats", "1",
                                    "--rounds", "1"])
    assert res.exit_code == 0, res.output
    lib = native.library()
    how = "VDPBF16PS" if lib.dt_bf16_dot() else "two FMAs a pair"
    assert f"bfloat16 compute on {how}" in res.output and "(bfloat16 compute)" in res.output
    assert re.search(r"^target: .*(% of the bfloat16 dot peak|not measurable)", res.output, re.M), res.output
    pair = pair_from_models(neox32(12), None, None, eos_token_id=None, kernel="lean-bf16")
    assert f"bfloat16 compute on {how}" in pair.forward_in_use("target")


def test_check_ar_says_it_compared_with_the_bf16_kernels_ar(pair_dirs, tmp_path):
    from click.testing import CliRunner
    from transformers import AutoTokenizer

    from dynatree.cli import main

    tok = AutoTokenizer.from_pretrained(pair_dirs / "target")
    neox32(12, vocab=len(tok)).save_pretrained(tmp_path / "m")  # (a head size the native kernel takes)
    tok.save_pretrained(tmp_path / "m")
    args = ["generate", "--target", str(tmp_path / "m"), "--draft", str(tmp_path / "m"), "--device", "cpu",
            "--method", "dynatree", "--max-new-tokens", "12", "--prompt", "It was the best", "--check-ar"]
    res = CliRunner().invoke(main, args + ["--kernel", "lean-bf16"])
    assert res.exit_code == 0 and "matches_ar=True (against ar on this bfloat16-compute kernel" in res.output, res.output
    res = CliRunner().invoke(main, args)  # (float32's ar: plain)
    assert res.exit_code == 0 and "matches_ar=True\n" in res.output, res.output


def test_no_silent_float32_stand_in_for_what_the_kernel_does_not_take(monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=64, n_layer=1, n_head=4, n_positions=64)).eval()
    with pytest.raises(PairError, match="lean-bf16.*gpt2"):
        pair_from_models(gpt2, None, None, eos_token_id=None, kernel="lean-bf16").runner("target")
    # a chain longer than the kernel's rows would need torch's path: refused before decoding
    pair = pair_from_models(neox32(5), neox32(6, layers=1), None, eos_token_id=3, kernel="lean-bf16")
    long = make_config("linear", {"k": 600})
    assert "lean-bf16" in pair.method_problem(long) and not pair.method_problem(make_config("dynatree"))
    with pytest.raises(ValueError, match="lean-bf16"):
        decode(pair, [5, 9, 11], long, max_new_tokens=4)
    # its packed copy is 16-bit whatever the checkpoint: sized as such
    model = neox32(7)
    mats = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    monkeypatch.setattr(native, "MAX_PACKED_BYTES", 3 * mats)
    assert pair_from_models(model, None, None, eos_token_id=None, kernel="lean-bf16").runner("target").native
    assert not pair_from_models(model, None, None, eos_token_id=None).runner("target").native  # float32: 4 bytes


def test_what_config_json_rules_out_is_refused_by_the_driver_and_named(tmp_path):
    """A Mistral with a binding window (and gpt2, a dynamic rotary, ...) under --kernel lean-bf16
    passed a dry run and failed in every actor, saying "neither GPT-NeoX nor a Llama-family layout"
    of the Mistral (the Llama-family trial)."""
    import json

    from transformers import MistralConfig, MistralForCausalLM

    from dynatree.jobs.driver import JobError, _check_native_only
    from dynatree.jobs.spec import build_spec
    from dynatree.names import native_refusal

    ctx = {"max_position_embeddings": 128}
    assert native_refusal({"model_type": "gpt2"}) == "gpt2: neither GPT-NeoX nor a Llama-family model"
    assert native_refusal({"model_type": "mistral", "sliding_window": 24, **ctx}) == "its 24-token sliding attention window"
    assert native_refusal({"model_type": "llama", "sliding_window": 24, **ctx}) == ""  # (Llama's code reads none)
    assert native_refusal({"model_type": "mistral", "sliding_window": 4096, **ctx}) == ""  # (covers the context)
    from transformers import Qwen2Config, Qwen2ForCausalLM  # (a Qwen2 whose window starts past its layers runs)
    from dynatree import packed
    for full_layers, refused in ((2, ""), (1, "its 32-token sliding attention window")):
        qwen = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32, "max_window_layers": full_layers,
                "num_hidden_layers": 2, **ctx}
        assert native_refusal(qwen) == refused
        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in qwen.items() if k != "model_type"}, vocab_size=64,
                                             hidden_size=32, intermediate_size=64, num_attention_heads=4))
        assert packed.supports(model) == (not refused)
    assert native_refusal({"model_type": "qwen2", "sliding_window": 32, "num_hidden_layers": 40, **ctx}) == ""
    assert "'dynamic' rescales with the length" in native_refusal(
        {"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}, **ctx})
    assert native_refusal({"model_type": "llama", "rope_scaling": {"type": "llama3"}, **ctx}) == ""
    assert native_refusal({"model_type": "gpt_neox", "hidden_act": "gelu", **ctx}) == ""
    assert native_refusal({"model_type": "gpt_neox", "rope_parameters": {"rope_type": "linear"}, **ctx}) == \
        "its rotary type 'linear'"
    mistral = MistralForCausalLM(MistralConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                               sliding_window=16)).eval()
    with pytest.raises(PairError, match=r"does not take the target model \(its 16-token sliding attention window\)"):
        pair_from_models(mistral, None, None, eos_token_id=None, kernel="lean-bf16").runner("target")
    for name, config in (("t", {"model_type": "llama", **ctx}), ("d", {"model_type": "gpt2"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    spec = build_spec(None, input="x", output="y", target=str(tmp_path / "t"), draft=str(tmp_path / "d"), kernel="lean-bf16")
    with pytest.raises(JobError, match=r"does not take the draft model \(gpt2: neither .*use --kernel lean"):
        _check_native_only(spec, tmp_path / "t", tmp_path / "d")
    _check_native_only(build_spec(None, input="x", output="y", kernel="lean"), tmp_path / "t", tmp_path / "d")


def test_a_long_prefill_runs_in_chunks_and_the_fpu_modes_are_restored():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from dynatree.budget import time_prefill

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=700, rotary_pct=0.5)
    run = pair_from_models(GPTNeoXForCausalLM(cfg).eval(), None, None, eos_token_id=None,
                           kernel="lean-bf16").runner("target")
    assert time_prefill(run, 600, 1) > 0  # (600 rows: past the kernel's 512, as the engine prefills)
    # the kernel's threads set flush-to-zero for its GEMMs and put it back: torch keeps denormals
    tiny = torch.full((1 << 20,), 1e-39) * 1.0  # (parallel over torch's threads)
    assert (tiny != 0).all() and (torch.tensor([1e-39]) * 1.0 != 0).all()


def test_a_job_spec_says_what_lean_bf16_runs_on():
    from dynatree.jobs.spec import JobSpec, SpecError

    with pytest.raises(SpecError, match="lean-bf16"):
        JobSpec(input="x.parquet", output="out", kernel="lean-bf16", dtype="bfloat16")
    JobSpec(input="x.parquet", output="out", kernel="lean-bf16")


def test_profile_says_whether_bf16_compute_pays_from_the_peaks_it_measured(capsys):
    """The note read "this CPU multiplies bfloat16 at twice the float32 FMA's rate" from the CPU's
    flag alone: on Intel Emerald Rapids the dot products measured half the FMA's rate, and
    lean-bf16 ran slower than float32 (the precision trial)."""
    from dynatree.profiling import _bf16_note

    said = []
    for fma, dot, chosen in ((100.0, 200.0, False), (170.0, 85.0, False), (170.0, 85.0, True), (100.0, 200.0, True)):
        _bf16_note(fma, dot, chosen)
        out = capsys.readouterr()
        said.append(out.out + out.err)
    assert "(2.00x): --kernel lean-bf16 computes in bfloat16 on it" in said[0]
    assert "85 GFLOP/s against the float32 FMA's 170 (0.50x): --kernel lean-bf16 would not be faster here" in said[1]
    assert "(0.50x): --kernel lean-bf16 is slower than --kernel lean here" in said[2]
    assert said[3] == ""  # (chosen where it pays: the peak line after it says enough)
