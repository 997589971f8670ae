"""checkpoint.py: GPT-NeoX checkpoints read without transformers' model classes hold the same
weights and give the same logits as transformers' loading, and everything else still loads
through transformers."""
import json

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from dynatree import checkpoint, load_pair, make_config, decode
from dynatree.kvcache import make_window, new_cache
from dynatree.lean import LeanNeoX
from dynatree.models import load_model

from conftest import tiny_neox


def _save(tmp_path, name, dtype=torch.bfloat16, **cfg):
    base = dict(vocab_size=80, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=64, rotary_pct=0.25, use_parallel_residual=True,
                tie_word_embeddings=False, initializer_range=0.3)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(**{**base, **cfg})).to(dtype)
    model.save_pretrained(tmp_path / name)
    return str(tmp_path / name)


@pytest.mark.parametrize("cfg", [{}, {"use_parallel_residual": False}, {"tie_word_embeddings": True},
                                 {"hidden_act": "relu", "attention_bias": False}])
def test_same_weights_and_logits_as_transformers(tmp_path, cfg):
    path = _save(tmp_path, "m", **cfg)
    assert checkpoint.readable(path)
    for dtype in (torch.float64, torch.float32):
        lite = load_model(path, torch.device("cpu"), dtype, lean=True)
        hf = load_model(path, torch.device("cpu"), dtype)
        assert isinstance(lite, checkpoint.NeoXWeights) and isinstance(hf, GPTNeoXForCausalLM)
        a, b = dict(lite.named_parameters()), dict(hf.named_parameters())
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == dtype for k in a)
        ids = torch.randint(0, 80, (1, 20), generator=torch.Generator().manual_seed(1))
        la = LeanNeoX(lite, gemm=False)(input_ids=ids).logits
        assert torch.equal(la, LeanNeoX(hf, gemm=False)(input_ids=ids).logits)
        wa, wb = make_window(lite, 16, 2, 4), make_window(hf, 16, 2, 4)  # StreamingLLM's re-rotation
        assert torch.equal(wa.cos, wb.cos) and torch.equal(wa.sin, wb.sin)
        if dtype == torch.float64:  # and transformers' own forward agrees
            torch.testing.assert_close(la, hf(input_ids=ids).logits, rtol=1e-9, atol=1e-9)
        else:  # the native kernel (when it builds) over either copy: bitwise the same
            ra, rb = LeanNeoX(lite), LeanNeoX(hf)
            oa = ra(input_ids=ids, past_key_values=new_cache(ra, 32)).logits
            assert torch.equal(oa, rb(input_ids=ids, past_key_values=new_cache(rb, 32)).logits)


def test_loading_skips_random_init(tmp_path, monkeypatch):
    """Random initialisation of parameters about to be replaced costs seconds per billion."""
    path, calls = _save(tmp_path, "m"), []
    real = torch.nn.init.kaiming_uniform_
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", lambda t, *a, **k: calls.append(t.shape) or real(t, *a, **k))
    load_model(path, torch.device("cpu"), torch.float32, lean=True)
    assert calls == []
    torch.nn.Linear(4, 4)
    assert calls == [(4, 4)]  # other modules are untouched


def test_sharded_checkpoints_read_the_index_and_nothing_else(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=80, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=128, max_position_embeddings=64, rotary_pct=0.25))
    model.save_pretrained(tmp_path / "s", max_shard_size="100KB")
    assert (tmp_path / "s" / "model.safetensors.index.json").is_file() and len(checkpoint.files(str(tmp_path / "s"))) > 2
    # a stray file beside the shards (an old export) is not part of the checkpoint
    save_file({"gpt_neox.embed_in.weight": torch.zeros(80, 64)}, str(tmp_path / "s" / "zz-old.safetensors"))
    lite = load_model(str(tmp_path / "s"), torch.device("cpu"), torch.float32, lean=True)
    hf = load_model(str(tmp_path / "s"), torch.device("cpu"), torch.float32)
    a, b = dict(lite.named_parameters()), dict(hf.named_parameters())
    assert isinstance(lite, checkpoint.NeoXWeights) and all(torch.equal(a[k], b[k]) for k in b)


def test_configs_the_lean_forward_does_not_run_go_through_transformers(tmp_path):
    path = _save(tmp_path, "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    for change in ({"head_dim": 8}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}):
        (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, **change}))
        assert not checkpoint.readable(path), change
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "head_dim": 16}))  # = 64 / 4
    assert checkpoint.readable(path)


def test_lean_pairs_skip_transformers_models_and_hf_pairs_keep_them(pair_dirs):
    t, d = pair_dirs / "target", pair_dirs / "draft"
    lean = load_pair(t, d, device="cpu", dtype="float32")
    assert isinstance(lean.target, checkpoint.NeoXWeights) and isinstance(lean.draft, checkpoint.NeoXWeights)
    for kw in ({"kernel": "hf"}, {"transformers_models": True}):
        pair = load_pair(t, d, device="cpu", dtype="float32", **kw)
        assert isinstance(pair.target, GPTNeoXForCausalLM) and isinstance(pair.draft, GPTNeoXForCausalLM)
    ids = lean.encode("The quick brown")
    assert (decode(lean, ids, make_config("dynatree"), max_new_tokens=12)[0]
            == decode(pair, ids, make_config("ar"), max_new_tokens=12)[0])
    with pytest.raises(TypeError, match="kernel='hf'"):
        lean.target(input_ids=torch.tensor([ids]))


def test_what_it_cannot_read_goes_through_transformers(tmp_path):
    path = _save(tmp_path, "gelu_new", hidden_act="gelu_new")
    assert not checkpoint.readable(path)
    assert isinstance(load_model(path, torch.device("cpu"), torch.float32, lean=True), GPTNeoXForCausalLM)
    bin_only = tmp_path / "bin"
    tiny_neox(0, dtype=torch.float32).save_pretrained(bin_only, safe_serialization=False)
    if not any(bin_only.glob("*.safetensors")):  # transformers 5 may always write safetensors
        assert not checkpoint.readable(str(bin_only))
    cfg = json.loads((tmp_path / "gelu_new" / "config.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    assert not checkpoint.readable(str(tmp_path / "other")) and not checkpoint.readable(str(tmp_path / "nope"))


def test_a_checkpoint_missing_a_tensor_or_of_the_wrong_shape_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from dynatree import PairError

    path = _save(tmp_path, "m")
    f = tmp_path / "m" / "model.safetensors"
    state = load_file(str(f))
    del state["gpt_neox.layers.1.mlp.dense_4h_to_h.weight"]
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(PairError, match="dense_4h_to_h"):
        load_model(path, torch.device("cpu"), torch.float32, lean=True)
    state["gpt_neox.layers.1.mlp.dense_4h_to_h.weight"] = torch.zeros(64, 100, dtype=torch.bfloat16)
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(PairError, match="size mismatch"):
        load_model(path, torch.device("cpu"), torch.float32, lean=True)
    state["gpt_neox.layers.1.mlp.dense_4h_to_h.weight"] = torch.zeros(64, 128, dtype=torch.bfloat16)
    state["lm_head.weight"] = state["embed_out.weight"].clone()  # the head under both of its names
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(PairError, match="stored twice"):
        load_model(path, torch.device("cpu"), torch.float32, lean=True)


def test_a_pythia_style_checkpoint_reads_the_same(tmp_path):
    """Pythia's hub files: an fp16 checkpoint, a config with rotary_pct/rotary_emb_base, and the
    attention buffers older transformers saved (bias, masked_bias, rotary inv_freq)."""
    from safetensors.torch import load_file, save_file

    path = _save(tmp_path, "pythia", dtype=torch.float16)
    cfg = json.loads((tmp_path / "pythia" / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rotary_pct=0.25, rotary_emb_base=10000, torch_dtype="float16")
    (tmp_path / "pythia" / "config.json").write_text(json.dumps(cfg))
    f = tmp_path / "pythia" / "model.safetensors"
    state = load_file(str(f))
    for i in range(2):
        state[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
        state[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        state[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(2)
    save_file(state, str(f), metadata={"format": "pt"})
    assert checkpoint.readable(path)
    lite = load_model(path, torch.device("cpu"), torch.float32, lean=True)
    hf = load_model(path, torch.device("cpu"), torch.float32)
    a, b = dict(lite.named_parameters()), dict(hf.named_parameters())
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(lite.gpt_neox.rotary_emb.inv_freq, hf.gpt_neox.rotary_emb.inv_freq)
