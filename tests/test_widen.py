"""dynatree widen: a GPT-NeoX model grown to a larger model's cost computes the same function."""
import json

import pytest
import torch
from click.testing import CliRunner
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from dynatree import load_pair
from dynatree.cli import main
from dynatree.config import make_config
from dynatree.engine import decode
from dynatree.widen import FLOOR, widened


def neox(dtype=torch.float64, seed=0, parallel=True):
    torch.manual_seed(seed)
    cfg = GPTNeoXConfig(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, rotary_pct=0.5, initializer_range=0.3,
                        use_parallel_residual=parallel, tie_word_embeddings=False, eos_token_id=3, bos_token_id=3)
    model = GPTNeoXForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # non-zero biases and norms, so a misplaced copy shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def build(model, **kw):
    cfg, state = widened(model, **kw)
    wide = GPTNeoXForCausalLM(cfg).to(model.dtype).eval()
    missing, unexpected = wide.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k or "inv_freq" in k for k in missing)
    return wide


@pytest.mark.parametrize("factor,layers,vocab", [(1, 2, 90), (2, 2, 90), (3, 5, 90), (2, 4, 120)])
def test_the_widened_model_computes_the_same_logits(factor, layers, vocab):
    """float64: equal to rounding (norms sum r times as many terms); extra vocabulary at FLOOR."""
    model = neox()
    wide = build(model, factor=factor, layers=layers, vocab=vocab)
    assert (wide.config.hidden_size, wide.config.num_hidden_layers, wide.config.vocab_size) == (32 * factor, layers, vocab)
    ids = torch.tensor([[5, 9, 11, 40, 2, 7, 7, 80, 1, 0, 33]])
    with torch.no_grad():
        small, big = model(ids).logits[0], wide(ids).logits[0]
    torch.testing.assert_close(big[:, :90], small, rtol=1e-10, atol=1e-10)
    if vocab > 90:
        torch.testing.assert_close(big[:, 90:], torch.full_like(big[:, 90:], FLOOR), rtol=0, atol=1e-12)


def test_a_perturbed_copy_is_caught():
    """The comparison above can fail: a copy of the hidden state that a reader does not ignore
    changes the logits."""
    model = neox()
    cfg, state = widened(model, factor=2)
    state["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"][:, 40] += 0.5  # copy 1 read by the MLP
    wide = GPTNeoXForCausalLM(cfg).double().eval()
    wide.load_state_dict(state, strict=False)
    ids = torch.tensor([[5, 9, 11, 40]])
    with torch.no_grad():
        assert not torch.allclose(wide(ids).logits[0], model(ids).logits[0], rtol=1e-6, atol=1e-6)


def test_widen_refuses_what_it_cannot_grow():
    with pytest.raises(ValueError, match="parallel residual"):
        widened(neox(parallel=False), factor=2)
    with pytest.raises(ValueError, match="grows a model, never shrinks it: layers 1 < 2$"):
        widened(neox(), factor=2, layers=1)
    with pytest.raises(ValueError, match="never shrinks it: factor 0 < 1$"):  # (it named no failing size)
        widened(neox(), factor=0)
    with pytest.raises(ValueError, match="factor >= 2"):
        widened(neox(), factor=1, vocab=100)


def test_the_cli_writes_a_pair_the_engine_decodes(tmp_path):
    """bf16 on disk, loaded as float32 on the native kernel: dynatree on the widened pair equals
    its own ar (the exactness the benchmarks check), and the extra vocabulary is never chosen."""
    for name, seed in (("target", 0), ("draft", 1)):
        neox(torch.bfloat16, seed).save_pretrained(tmp_path / name)
    runner = CliRunner()
    for name, args in (("target", ["--factor", "2", "--layers", "3", "--vocab", "128"]),
                       ("draft", ["--factor", "2", "--vocab", "128"])):
        res = runner.invoke(main, ["widen", str(tmp_path / name), str(tmp_path / f"wide-{name}"), *args])
        assert res.exit_code == 0, res.output
        assert "parameters (hidden 64" in res.output
    assert json.loads((tmp_path / "wide-target" / "config.json").read_text())["num_hidden_layers"] == 3
    pair = load_pair(str(tmp_path / "wide-target"), str(tmp_path / "wide-draft"), device="cpu", dtype="float32")
    prompt = [5, 9, 11, 40, 2, 7, 7, 80]
    ref = decode(pair, prompt, make_config("ar"), max_new_tokens=16, ignore_eos=True)[0]
    assert max(ref) < 90
    assert decode(pair, prompt, make_config("dynatree"), max_new_tokens=16, ignore_eos=True)[0] == ref
    res = runner.invoke(main, ["widen", str(tmp_path / "target"), str(tmp_path / "x"), "--factor", "1", "--vocab", "100"])
    assert res.exit_code != 0 and "factor >= 2" in res.output


def test_the_cli_never_writes_over_the_source_or_an_existing_directory(tmp_path):
    """OUT = SRC, OUT inside SRC and a non-empty OUT are refused before anything is written (the
    source's files keep their bytes), as are non-positive sizes; the weights are readable by all
    who can read the config."""
    src = tmp_path / "src"
    neox(torch.float32, 0).save_pretrained(src)
    before = {f.name: f.read_bytes() for f in src.iterdir()}
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "results.parquet").write_text("x")
    runner = CliRunner()
    for out, extra, why in ((src, [], "is SRC or inside it"), (src / "sub", [], "is SRC or inside it"),
                            (tmp_path / "full", [], "not an empty directory"),
                            (tmp_path / "new", ["--layers", "0"], "must be positive")):
        res = runner.invoke(main, ["widen", str(src), str(out), "--factor", "2", *extra])
        assert res.exit_code != 0 and why in res.output, res.output
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_bytes((src / "config.json").read_bytes())
    for bad, why in ((tmp_path / "full", "is not a saved model: no config.json in this directory"),
                     (tmp_path / "none", "does not exist"),  # (it said "Error: Error no file named ...": the trial)
                     (tmp_path / "noweights", "is not a saved model: no weights in this directory")):
        res = runner.invoke(main, ["widen", str(bad), str(tmp_path / "new"), "--factor", "2"])
        assert res.exit_code != 0 and why in res.output, res.output
    assert {f.name: f.read_bytes() for f in src.iterdir()} == before
    assert not (src / "sub").exists() and not (tmp_path / "new").exists()
    res = runner.invoke(main, ["widen", str(src), str(tmp_path / "ok"), "--factor", "2"])
    assert res.exit_code == 0, res.output
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "ok").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"]
