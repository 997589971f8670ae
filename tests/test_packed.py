"""packed.py: Llama-family models decode many sequences per forward -- and each sequence gets
what transformers' own forward gives it alone (float64)."""
import warnings

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from dynatree import PairError, decode, make_config, native, pair_from_models
from dynatree.engine import decode_batch
from dynatree.models import HFRunner
from dynatree.packed import PackedRunner, supports

from conftest import alone_and_packed, assert_same_runs, hf_cache, random_prompts

FAMILIES = {  # GQA in all; Qwen2 with biases on q/k/v; Qwen3 with per-head q/k norms and head_dim != d / heads
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny(family: str, seed: int, vocab: int = 64):
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    extra = {"head_dim": 16} if family == "qwen3" else {}
    cfg = config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, **extra)
    model = model_cls(cfg).double().eval()
    with torch.no_grad():  # norms start at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_sequences_get_transformers_logits(family):
    """A tree, a chain, one token and a prompt joining with an empty cache, packed in one forward:
    each sequence's logits and cache are what transformers' forward gives it alone."""
    model = tiny(family, 3)
    assert supports(model)
    assert_same_runs(*alone_and_packed(model, PackedRunner(model), ref=HFRunner(model)), atol=1e-10)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_llama_pair_decodes_batched_and_equals_ar(family):
    """The engine takes the packed runner for a Llama (or Qwen3) pair, and batched greedy rows of
    every kind equal batch-1 ar (float64)."""
    target = tiny(family, 5)
    draft = tiny(family, 6)
    with torch.no_grad():  # a related draft, so trees get accepted nodes
        for pt, pd in zip(target.parameters(), draft.parameters()):
            pd.copy_(pt + 0.3 * (pd - pt))
    pair = pair_from_models(target, draft, None, eos_token_id=None)
    assert isinstance(pair.runner("target"), PackedRunner)
    prompts = random_prompts(5, seed=7, lo=2, hi=20, vocab=64)
    refs = [decode(pair, p, make_config("ar"), max_new_tokens=12, ignore_eos=True)[0] for p in prompts]
    for method in ("ar", "linear", "dynatree"):
        got = decode_batch(pair, prompts, make_config(method), max_new_tokens=12, ignore_eos=True)
        assert [toks for toks, _, _ in got] == refs, method
    window = {"kv_window": 24, "kv_sinks": 2, "kv_evict": 6}  # StreamingLLM: evicting, keys turned back
    refs = [decode(pair, p, make_config("ar", window), max_new_tokens=20, ignore_eos=True)[0] for p in prompts]
    got = decode_batch(pair, prompts, make_config("dynatree", window), max_new_tokens=20, ignore_eos=True)
    assert [toks for toks, _, _ in got] == refs


def test_other_architectures_keep_transformers_forward():
    model = tiny("llama", 1)
    model.config.model_type = "phi3"  # not in the family: transformers' forward, one sequence at a time
    assert not supports(model)
    pair = pair_from_models(model, None, None, eos_token_id=None)
    assert isinstance(pair.runner("target"), HFRunner)
    sliding = tiny("qwen3", 1)  # a layer of sliding-window attention: not reproduced here
    sliding.config.layer_types = ["full_attention", "sliding_attention"]
    assert supports(tiny("qwen3", 1)) and not supports(sliding)


def llama32(family: str, seed: int, vocab: int = 100):
    """float32 with head_dim 16 (Qwen3: 32, its own head_dim != d / heads): shapes the C forward
    takes; vocab 100 exercises the LM head's padding; Qwen2 brings q/k/v biases and, as the small
    Qwen2.5 models do, an LM head tied to the embedding."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    extra = {"head_dim": 32} if family == "qwen3" else {}
    cfg = config_cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     tie_word_embeddings=family == "qwen2", eos_token_id=0, bos_token_id=0, **extra)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.skipif(native.library("generic") is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("isa", native.variants_here())
@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_family_runs_the_batch_invariant_c_forward(family, isa, monkeypatch):
    """float32 Llama-family models take csrc/neox.c's forward (GQA, RMS norms, SwiGLU, Qwen2's
    biases, Qwen3's q/k norms): transformers' logits within float32 rounding, and -- what the
    torch path cannot promise -- a sequence's logits bitwise the same packed beside others, and a
    tree's bitwise the AR steps' for the same path."""
    from dynatree.kvcache import new_cache
    from dynatree.runtime import KeyMask
    from dynatree.tree import Tree, ancestor_matrix, flatten_bfs, position_ids

    monkeypatch.setenv("DYNATREE_ISA", isa)
    model = llama32(family, 3)
    run = PackedRunner(model)
    assert run.native and run.lib is native.library(isa)
    assert_same_runs(*alone_and_packed(model, run, ref=HFRunner(model)), atol=1e-5)
    alone, alone_caches, packed, packed_caches = alone_and_packed(model, run)
    for a, b in zip(alone, packed):
        assert torch.equal(a.logits, b.logits) and a.top == b.top
    for ca, cb in zip(alone_caches, packed_caches):
        assert all(torch.equal(la.keys[:, :, :ca.length], lb.keys[:, :, :cb.length])
                   for la, lb in zip(ca.layers, cb.layers))
    prompt, path = [5, 9, 11, 40, 2, 7], [17, 23, 4]
    with torch.inference_mode():
        cache = new_cache(model, 32)
        run(input_ids=torch.tensor([prompt]), past_key_values=cache)
        ar = [run(input_ids=torch.tensor([[t]]), past_key_values=cache).logits[0, 0] for t in path]
        cache.truncate(len(prompt))
        tree, _ = flatten_bfs(Tree([17, 23, 50, 4, 60], [-1, 0, 0, 1, 1], [0, 1, 1, 2, 2], [0.0] * 5))
        got = run(input_ids=torch.tensor([tree.tokens]), attention_mask=KeyMask(len(prompt), ancestor_matrix(tree.parents)),
                  position_ids=position_ids(tree.depths, len(prompt)), past_key_values=cache).logits[0]
    assert [tree.tokens[u] for u in (0, 1, 3)] == path
    assert all(torch.equal(got[u], a) for u, a in zip((0, 1, 3), ar))


@pytest.mark.skipif(native.library("generic") is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_every_variant_computes_the_same_llama_bits(family):
    """As for GPT-NeoX: a corpus decoded on an AVX2 node and an AVX-512 node is the same corpus
    (the mixed batch: a tree, a chain, a decode step -- grouped-query heads sharing one task --
    and a joining prompt)."""
    seen = []
    for v in native.variants_here():
        model = llama32(family, 4)
        run = PackedRunner(model, isa=v)
        assert run.native and run.lib is native.library(v)
        seen.append([o.logits for o in alone_and_packed(model, run)[2]])
    assert all(torch.equal(a, b) for other in seen[1:] for a, b in zip(seen[0], other))


@pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")
def test_c_forward_with_every_bias_one_kv_head_and_llama3_rotary_scaling():
    """Llama's optional attention and MLP biases, multi-query attention (one kv head for four q
    heads) and Llama 3's rotary scaling: transformers' logits within float32 rounding."""
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, max_position_embeddings=128, attention_bias=True, mlp_bias=True,
                      rope_parameters=rope)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.uniform_(-0.5, 0.5)
    run = PackedRunner(model)
    assert run.native
    assert_same_runs(*alone_and_packed(model, run, ref=HFRunner(model)), atol=1e-5)


@pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")
def test_a_float32_llama_pair_equals_ar_without_a_tolerance():
    """On the batch-invariant kernel every method's greedy tokens are ar's in float32, alone and
    batched (the torch path needs float64 for that promise)."""
    target, draft = llama32("qwen3", 5), llama32("qwen3", 6)
    with torch.no_grad():
        for pt, pd in zip(target.parameters(), draft.parameters()):
            pd.copy_(pt + 0.3 * (pd - pt))
    pair = pair_from_models(target, draft, None, eos_token_id=None)
    assert pair.runner("target").native and pair.runner("draft").native
    prompts = random_prompts(5, seed=7, lo=2, hi=30, vocab=100)
    refs = [decode(pair, p, make_config("ar"), max_new_tokens=24, ignore_eos=True)[0] for p in prompts]
    for method in ("linear", "fixed_tree", "dynatree", "dyspec"):
        assert [decode(pair, p, make_config(method), max_new_tokens=24, ignore_eos=True)[0] for p in prompts] == refs
        got = decode_batch(pair, prompts, make_config(method), max_new_tokens=24, ignore_eos=True)
        assert [toks for toks, _, _ in got] == refs, method
    # a bfloat16 cache, a StreamingLLM window (keys turned back on eviction) and seeded sampling:
    # each against ar with the same options, batched
    for opts in ({"kv_dtype": "bfloat16"}, {"kv_window": 24, "kv_sinks": 2, "kv_evict": 6},
                 {"temperature": 0.8, "seed": 3}):
        refs = [decode(pair, p, make_config("ar", opts), max_new_tokens=30, ignore_eos=True)[0] for p in prompts]
        got = decode_batch(pair, prompts, make_config("dynatree", opts), max_new_tokens=30, ignore_eos=True)
        assert [toks for toks, _, _ in got] == refs, opts


def test_what_the_c_forward_does_not_take_stays_on_torch():
    """Head sizes the attention kernel lacks, other activations, length-dependent rotary
    scaling, float64, and --kernel lean-mkl keep the torch path, each with its reason."""
    def why(run):
        assert not run.native
        return run.refusal

    assert "head size 8" in why(PackedRunner(tiny("llama", 1).float()))
    assert "float64 model on cpu" in why(PackedRunner(llama32("llama", 1).double()))
    assert "lean-mkl" in why(PackedRunner(llama32("llama", 1), gemm=False))
    gelu = llama32("llama", 1)
    gelu.config.hidden_act = "gelu"
    assert "activation 'gelu (gated)'" in why(PackedRunner(gelu))
    dynamic = llama32("llama", 1)
    dynamic.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "rotary type 'dynamic'" in why(PackedRunner(dynamic))
    assert PackedRunner(llama32("llama", 1)).refusal == ""
    pair = pair_from_models(llama32("llama", 1), None, None, eos_token_id=None, kernel="lean-mkl")
    assert not pair.runner("target").native


@pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")
def test_profile_runs_a_llama_pair_against_its_torch_path(tmp_path):
    """`dynatree profile` on a Llama-family pair: the native forward timed against the same
    architecture's torch path, and its FLOPs counted from every Linear (the LM head included)."""
    from click.testing import CliRunner

    from dynatree.cli import main
    from dynatree.profiling import matmul_params

    from dynatree.tokenizer import train_bpe_tokenizer

    from conftest import TEXT

    tok = train_bpe_tokenizer(TEXT, 100)
    for name, seed in (("target", 12), ("draft", 13)):
        llama32("llama", seed, vocab=len(tok)).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    res = CliRunner().invoke(main, ["profile", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                                    "--device", "cpu", "--prefix", "16", "--prefill", "20", "--repeats", "1"])
    assert res.exit_code == 0, res.output
    assert "native kernel: " in res.output and "target, native ÷ lean-mkl time (median of" in res.output
    assert "not on dynatree's kernel" not in res.output
    res = CliRunner().invoke(main, ["profile", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                                    "--device", "cpu", "--dtype", "float64", "--prefix", "16", "--prefill", "0",
                                    "--repeats", "1"])
    assert res.exit_code == 0, res.output
    assert "target: not on dynatree's kernel: a float64 model on cpu" in res.output
    d, ff, layers, heads, kv, hd = 64, 128, 2, 4, 2, 16
    for family in ("llama", "qwen2"):  # qwen2: the LM head tied to the embedding is still multiplied
        assert matmul_params(llama32(family, 12)) == layers * (d * (heads + 2 * kv) * hd + heads * hd * d
                                                               + 3 * d * ff) + 100 * d


def tied_model(family: str, vocab: int, tie: bool = True):
    """A float32 model whose LM head is its embedding matrix, as Qwen2.5-0.5B and many small ones
    (``tie`` False: the same shape with a head of its own)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    if family == "neox":
        return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=128,
                                                max_position_embeddings=128, tie_word_embeddings=tie)).eval()
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=tie)).eval()


def saved(model, pair_dirs, path):
    from transformers import AutoTokenizer

    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(pair_dirs / "target").save_pretrained(path)
    return path


PROMPT, STEPS = [5, 9, 11, 40, 2, 7], [17, 23, 4]


@pytest.mark.skipif(native.library("generic") is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("family", ["neox", "llama"])
def test_a_tied_embedding_loaded_from_disk_reaches_the_c_forward_dense(family, pair_dirs, tmp_path):
    """An LM head that is the embedding matrix, loaded as a user loads it: models.cpu_layout
    stored Linear weights transposed for MKL, which made the shared embedding a strided view that
    the C forward read as row-major -- wrong logits, and `ar` wrong with every method, so no check
    against `ar` could see it.  (Now a tied weight keeps its rows, and cmodel._rows copies any
    strided table the C code would read.)"""
    from dynatree import load_pair
    from dynatree.check import reference_logits

    model = tied_model(family, 300)
    pair = load_pair(saved(model, pair_dirs, tmp_path), None, device="cpu", dtype="float32")
    assert pair.runner("target").native
    with torch.no_grad():
        want = model(torch.tensor([PROMPT + STEPS])).logits[0, -1]
    assert torch.allclose(reference_logits(pair, PROMPT, STEPS), want, atol=1e-4)


@pytest.mark.skipif(native.library("generic") is None, reason="no C compiler on this machine")
def test_a_native_forward_that_disagrees_with_torch_on_the_load_probe_is_not_used(pair_dirs, tmp_path, monkeypatch):
    """The load-time probe (models._probed), on the bug above put back: the runner falls back to
    the same forward on torch's ops, says why, and the logits are transformers' again."""
    from dynatree import cmodel, load_pair
    from dynatree.check import reference_logits

    # the old bug, put back: the C forward handed its 2-D tables (embedding, rotary) as strided views
    monkeypatch.setattr(cmodel, "_rows", lambda t: t if t is None or t.dim() < 2 else t.t().contiguous().t())
    model = tied_model("llama", 300)
    pair = load_pair(saved(model, pair_dirs, tmp_path), None, device="cpu", dtype="float32")
    with pytest.warns(UserWarning, match="the target model runs on torch's ops, not the native kernel: its logits "
                                         "differed from torch's"):
        run = pair.runner("target")
    assert not run.native and "on a probe prompt" in pair.not_native("target")
    with torch.no_grad():
        want = model(torch.tensor([PROMPT + STEPS])).logits[0, -1]
    assert torch.allclose(reference_logits(pair, PROMPT, STEPS), want, atol=1e-4)
    # a job's actor frees the float32 weights as it packs them: no torch forward left to fall back on
    pair = load_pair(saved(model, pair_dirs, tmp_path / "again"), None, device="cpu", dtype="float32")
    pair.release_packed = True
    with pytest.raises(PairError, match="the target model cannot run on the native kernel: its logits differed "
                                        "from torch's .*run it with --kernel lean-mkl"):
        pair.runner("target")


@pytest.mark.skipif(native.library("generic") is None, reason="no C compiler on this machine")
def test_freeing_as_packed_keeps_memory_near_the_float32_model(monkeypatch):
    """Each matrix goes once packed -- a fused q/k/v too, whose row-block views would otherwise
    hold it to the end: with float32 packing (copies as large as the matrices) the live tensors
    never grow by a layer's q/k/v (they grew by all of them, 3x this model's, before)."""
    import gc

    from dynatree import cmodel
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=128, rotary_pct=0.5, tie_word_embeddings=False)
    pair = pair_from_models(GPTNeoXForCausalLM(cfg).float().eval(), None, None)
    pair.release_packed = True

    def live() -> int:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on every live object touches torch's deprecated aliases
            warnings.simplefilter("ignore", FutureWarning)
            return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gc.get_objects()
                        if isinstance(t, torch.Tensor) and t.device.type == "cpu"}.values())

    real, seen = cmodel.Runner.packed_callback, []

    def counted(self, release):
        free = real(self, release)
        return lambda w: (free(w), seen.append(live()))

    monkeypatch.setattr(cmodel.Runner, "packed_callback", counted)
    start = live()
    run = pair.runner("target")
    assert run.native and run.fwd.weight_format == 0 and len(seen) == 1 + 4 * 4
    assert max(seen) - start < 3 * 256 * 256 * 4  # less than one layer's q/k/v matrix


@pytest.mark.skipif(native.library("generic") is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("family,tied", [("neox", False), ("neox", True), ("llama", False), ("llama", True)])
@pytest.mark.parametrize("when", ["warmed up", "as packed"])
def test_released_matrices_leave_the_native_outputs_and_refuse_torch(family, tied, when, pair_dirs, tmp_path):
    """A job's actors free the float32 Linear weights as the native kernel packs them
    (ModelPair.release_packed; or all at once after, cmodel.Runner.release_matrices): the
    engine's outputs stay the same bits, an embedding (a tied LM head's too) stays, and a forward
    that needs torch's path says why instead of running on empty weights."""
    from dynatree import load_pair
    from dynatree.kvcache import new_cache
    from dynatree.runtime import Seq

    path = saved(tied_model(family, 300, tie=tied), pair_dirs, tmp_path / "m")
    ref = load_pair(str(path), str(path), device="cpu", dtype="float32")
    assert ref.runner("target").native
    cfg = make_config("dynatree")
    before = decode_batch(ref, [PROMPT, PROMPT[:3]], cfg, max_new_tokens=12, ignore_eos=True)
    embed = next(m.weight for m in ref.target.modules() if isinstance(m, torch.nn.Embedding))
    linears = [m.weight for m in ref.target.modules() if isinstance(m, torch.nn.Linear)]
    size = sum(w.numel() * 4 for w in linears if w.data_ptr() != embed.data_ptr())
    pair = ref if when == "warmed up" else load_pair(str(path), str(path), device="cpu", dtype="float32")
    pair.release_packed = when == "as packed"
    assert pair.runner("target").released == (size if when == "as packed" else 0)
    embed = next(m.weight for m in pair.target.modules() if isinstance(m, torch.nn.Embedding))
    assert pair.release_matrices() == 2 * size > 0  # target and draft (the same files, two copies)
    assert embed.numel() > 0 and (pair.target.lm_head.weight.numel() > 0) == tied
    after = decode_batch(pair, [PROMPT, PROMPT[:3]], cfg, max_new_tokens=12, ignore_eos=True)
    assert [t for t, _, _ in after] == [t for t, _, _ in before]
    assert [t for t, _, _ in decode_batch(pair, [PROMPT], make_config("ar"), max_new_tokens=12, ignore_eos=True)] == \
        [before[0][0]]
    runner = pair.runner("target")
    with pytest.raises(RuntimeError, match="float32 weights were released"):
        runner.forward([Seq(torch.tensor(PROMPT * 100), new_cache(runner, 700))])  # 600 rows' logits: torch's path
    assert pair.release_matrices() == 2 * size  # nothing more to free


def hf_greedy(model, prompt: list[int], n: int, cached: bool = False) -> list[int]:
    """Greedy decoding by transformers' forward: over the whole text at every step, no cache (the
    model's definition), or (``cached``) the prompt in one forward and then a token at a time with
    transformers' own cache, as AR decodes -- where the cut into forwards changes the result
    (LongRoPE).  (Not generate(): after a prompt longer than the window or the LongRoPE switch it
    parts from both, on the first token.)"""
    ids = list(prompt)
    with torch.no_grad():
        past = None
        for _ in range(n):
            x = torch.tensor([ids[-1:] if past is not None else ids])
            out = model(x, **hf_cache(model, past), use_cache=cached)
            past = out.past_key_values if cached else None
            ids.append(int(out.logits[0, -1].argmax()))
    return ids[len(prompt):]


def related_pair(target, draft):
    with torch.no_grad():  # a related draft, so trees get accepted nodes
        for pt, pd in zip(target.parameters(), draft.parameters()):
            pd.copy_(pt + 0.3 * (pd - pt))
    return pair_from_models(target, draft, None, eos_token_id=None)


@pytest.mark.parametrize("family,extra", [("mistral", {"sliding_window": 5}),
                                          ("qwen2", {"use_sliding_window": True, "sliding_window": 5,
                                                     "max_window_layers": 1})])
def test_sliding_window_models_stay_exact_with_trees(family, extra):
    """A sliding window shorter than the text (Mistral: every layer; Qwen2: the layers from
    max_window_layers on, the others full) runs on transformers' forward: a tree's nodes must see
    the keys an AR step at their position sees, window included, so every method equals
    transformers' greedy decoding (float64), alone and batched."""
    def model(seed):
        config_cls, model_cls = FAMILIES[family]
        torch.manual_seed(seed)
        cfg = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, **extra)
        return model_cls(cfg).double().eval()

    target = model(5)
    pair = related_pair(target, model(6))
    assert isinstance(pair.runner("target"), HFRunner)
    assert "sliding attention window" in pair.not_native("target")
    prompts = random_prompts(4, seed=3, lo=3, hi=14, vocab=64)
    refs = [hf_greedy(target, p, 16) for p in prompts]
    for method in ("ar", "linear", "fixed_tree", "dynatree"):
        assert [decode(pair, p, make_config(method), max_new_tokens=16, ignore_eos=True)[0] for p in prompts] == refs
        got = decode_batch(pair, prompts, make_config(method), max_new_tokens=16, ignore_eos=True)
        assert [toks for toks, _, _ in got] == refs, method
    with pytest.raises(ValueError, match="sliding attention window"):  # StreamingLLM's eviction beside it: refused
        decode(pair, prompts[0], make_config("ar", {"kv_window": 24, "kv_sinks": 2, "kv_evict": 6}), max_new_tokens=4)


def test_a_window_the_architecture_does_not_apply_is_ignored():
    """A Llama config carrying sliding_window and layer_types (keys transformers' Llama never
    reads): no window in the tree masks, no dict of masks it cannot take -- the packed forward,
    every method equal to transformers' greedy decoding (float64)."""
    def model(seed):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          initializer_range=0.25, sliding_window=5, layer_types=["full_attention", "sliding_attention"])
        return LlamaForCausalLM(cfg).double().eval()

    target = model(5)
    pair = related_pair(target, model(6))
    assert isinstance(pair.runner("target"), PackedRunner) and HFRunner(target).window is None
    prompts = random_prompts(3, seed=3, lo=3, hi=14, vocab=64)
    refs = [hf_greedy(target, p, 12) for p in prompts]
    for method in ("ar", "dynatree"):
        got = decode_batch(pair, prompts, make_config(method), max_new_tokens=12, ignore_eos=True)
        assert [toks for toks, _, _ in got] == refs, method
    window = {"kv_window": 24, "kv_sinks": 2, "kv_evict": 6}  # nor is a cache window refused for it
    assert decode(pair, prompts[0], make_config("ar", window), max_new_tokens=4, ignore_eos=True)[1] == "length"


def longrope_llama(seed: int):
    torch.manual_seed(seed)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
            "short_factor": [1.0] * 4, "long_factor": [1.0, 5.0, 25.0, 125.0]}
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rope_parameters=rope, eos_token_id=0, bos_token_id=0)
    return LlamaForCausalLM(cfg).double().eval()


def test_longrope_rows_get_the_rotary_their_own_ar_steps_get():
    """LongRoPE switches to its long factors once a forward's largest position reaches the
    original context (24 here) -- for every row of that forward, so its outputs depend on how the
    text was cut into forwards; the reference is AR's cut: the prompt in one forward, then a token
    at a time.  A sequence's rotary must not depend on the sequences packed beside it (a longer
    prompt), and no tree may span the switch (its shallow nodes would read the long table that
    their AR steps do not): every method, batched, equals that reference (float64)."""
    from dynatree.kvcache import new_cache
    from dynatree.runtime import Seq

    target = longrope_llama(5)
    pair = related_pair(target, longrope_llama(6))
    run = pair.runner("target")
    short, long_ = random_prompts(1, seed=1, lo=6, hi=7, vocab=64)[0], random_prompts(1, seed=2, lo=30, hi=31, vocab=64)[0]
    with torch.inference_mode():
        alone = run.forward([Seq(torch.tensor(short), new_cache(run, 40))])[0].logits
        packed = run.forward([Seq(torch.tensor(short), new_cache(run, 40)), Seq(torch.tensor(long_), new_cache(run, 40))])
    assert torch.allclose(alone, packed[0].logits, rtol=0, atol=1e-10)

    spans, forward = [], run.forward

    def watch(seqs, **kw):  # each masked (tree) sequence's first and last position
        spans.extend((int(s.positions.min()), int(s.positions.max())) for s in seqs if s.mask is not None)
        return forward(seqs, **kw)

    run.forward = watch
    prompts = [random_prompts(1, seed=s, lo=n, hi=n + 1, vocab=64)[0] for s, n in ((1, 6), (2, 20), (3, 30), (4, 22))]
    refs = [hf_greedy(target, p, 14, cached=True) for p in prompts]
    for method in ("ar", "linear", "dynatree"):
        got = decode_batch(pair, prompts, make_config(method), max_new_tokens=14, ignore_eos=True)
        assert [toks for toks, _, _ in got] == refs, method
        assert [decode(pair, p, make_config(method), max_new_tokens=14, ignore_eos=True)[0] for p in prompts] == refs
    assert spans and not [(a, b) for a, b in spans if a < 24 <= b]  # trees grew, none across the switch
    from dynatree.config import check_windows  # a cache window: refused before decoding (check, bench)
    with pytest.raises(ValueError, match="^dynatree: kv_window does not support scaled rotary embeddings"):
        check_windows({"dynatree": make_config("dynatree", {"kv_window": 40, "kv_evict": 4})}, 128, pair.windows)


def test_phi3_recomputes_its_cache_at_the_longrope_switch_as_its_generate_does():
    """Phi-3's generate() (transformers' Phi3ForCausalLM.prepare_inputs_for_generation) drops its
    cache when a text first passes the switch and runs the whole text again, so every earlier key
    takes the long factors too -- its greedy text is then the uncached forward's.  Every method
    does the same here (a battery found them parting from generate() at the token after the
    switch, margins 0.07-0.71); a prompt past the switch needs no reset (float64)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    def model(seed):
        torch.manual_seed(seed)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                "long_factor": [1.0, 5.0, 25.0, 125.0], "original_max_position_embeddings": 24}
        cfg = Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         original_max_position_embeddings=24, rope_parameters=rope, initializer_range=0.25,
                         eos_token_id=None, bos_token_id=0, pad_token_id=0)
        return Phi3ForCausalLM(cfg).double().eval()

    target = model(5)
    pair = related_pair(target, model(6))
    prompts = [random_prompts(1, seed=s, lo=n, hi=n + 1, vocab=64)[0] for s, n in ((1, 6), (2, 20), (3, 24), (4, 30))]
    refs = [hf_greedy(target, p, 14) for p in prompts]  # uncached: the whole text every step
    with torch.no_grad():
        gen = target.generate(torch.tensor([prompts[1]]), max_new_tokens=14, do_sample=False, eos_token_id=None)
    assert gen[0, len(prompts[1]):].tolist() == refs[1]  # generate() resets: the uncached text
    assert refs[1] != hf_greedy(target, prompts[1], 14, cached=True)  # (which a cache kept across differs from)
    for method in ("ar", "linear", "dynatree"):
        got = decode_batch(pair, prompts, make_config(method), max_new_tokens=14, ignore_eos=True)
        assert [toks for toks, _, _ in got] == refs, method
        assert [decode(pair, p, make_config(method), max_new_tokens=14, ignore_eos=True)[0] for p in prompts] == refs
    sampled = [[toks for toks, _, _ in decode_batch(pair, prompts, make_config(m, {"temperature": 0.8, "seed": 3}),
                                                    max_new_tokens=14, ignore_eos=True)] for m in ("ar", "dynatree")]
    assert sampled[0] == sampled[1]  # a draw at the reset is the same draw too


def test_prefix_caching_never_cuts_a_prompt_past_the_longrope_switch():
    """Prefix caching (on by default) shares 32-token blocks computed in forwards of their own: a
    block below the switch holds short-factor keys, while a prompt past the switch, prefilled in
    one forward, has long-factor keys throughout.  Such prompts take no part: after a shorter
    prompt with the same first block was decoded twice (its block stored), and beside it in a
    batch, a prompt past the switch decodes as alone (a battery's case: Llama, switch at 48)."""
    def model(seed):
        torch.manual_seed(seed)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.5],
                "long_factor": [1.0, 2.0, 4.0, 8.0], "original_max_position_embeddings": 48, "factor": 128 / 48}
        cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          rope_parameters=rope, initializer_range=0.25)
        return LlamaForCausalLM(cfg).double().eval()

    target = model(0)
    pair = related_pair(target, model(1))
    g = torch.Generator().manual_seed(11)
    base = torch.randint(0, 96, (32,), generator=g).tolist()
    short = base + torch.randint(0, 96, (8,), generator=g).tolist()  # 40 tokens: below the switch
    long_ = base + torch.randint(0, 96, (28,), generator=g).tolist()  # 60: past it
    ref = hf_greedy(target, long_, 12, cached=True)
    for method in ("ar", "dynatree"):
        pair.forget_prefixes()
        for _ in range(2):
            decode(pair, short, make_config(method), max_new_tokens=4, ignore_eos=True)
        toks, _, m = decode(pair, long_, make_config(method), max_new_tokens=12, ignore_eos=True)
        assert toks == ref and m.cached_prompt_tokens == 0, method
        pair.forget_prefixes()
        got = decode_batch(pair, [short, long_], make_config(method), max_new_tokens=12, ignore_eos=True)
        assert got[1][0] == ref, method


def test_grouped_heads_repeated_for_cuda_attend_alike():
    """On CUDA a masked SDPA call repeats grouped key/value heads (the fused kernels take grouped
    heads only without a mask): the same attention as grouped heads, float64."""
    from dynatree.runtime import sdpa

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 5, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(1, 2, 12, 16, dtype=torch.float64, generator=g) for _ in range(2))
    mask = torch.ones(5, 12, dtype=torch.bool).tril(7)[None, None]
    grouped, repeated = sdpa(q, k, v, mask, 0.25, True), sdpa(q, k, v, mask, 0.25, True, expand=True)
    assert grouped.shape == (1, 8, 5, 16) and torch.allclose(grouped, repeated, rtol=0, atol=1e-12)
