"""jobs/footprint.py: an actor's memory estimated from checkpoint headers, and what the driver
starts with it (how many actors, what each reserves, auto's batch cap)."""
import dataclasses
import json
import math

import pytest
from safetensors.torch import load_file

from dynatree.config import cache_rows
from dynatree.jobs import footprint
from dynatree.jobs.driver import _footprint
from dynatree.jobs.spec import build_spec
from dynatree.scheduler import BatchTuner

GIB = 2**30


def job(pair_dirs, **kw):
    base = dict(input="x.parquet", output="out", target=str(pair_dirs / "target"), draft=str(pair_dirs / "draft"),
                max_new_tokens=20, max_prompt_tokens=30, dtype="float32", prefix_cache_gb=0.0)
    return build_spec(None, **{**base, **kw})


def _counts(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    return (sum(t.numel() for t in tensors.values()), sum(t.numel() for t in tensors.values() if t.dim() == 2),
            sum(t.numel() for k, t in tensors.items() if t.dim() == 2 and "embed_in" not in k))


def test_the_estimate_counts_weights_packed_copies_and_caches(pair_dirs):
    (pt, mt, lt), (pd, md, ld) = _counts(pair_dirs / "target"), _counts(pair_dirs / "draft")
    spec = job(pair_dirs)
    fp = _footprint(spec)
    assert fp.weights == 4 * (pt + pd) and fp.packed == 4 * (mt + md)  # float32 checkpoints: float32 copies
    assert fp.released == 4 * (lt + ld)  # freed once packed: every matrix but the input embeddings
    slots = cache_rows(spec.method_config, 50, 128)  # the engine's allocation: text and a tree's room
    assert fp.fixed == footprint.RUNTIME_BYTES and fp.row_tokens == slots
    vocab = json.loads((pair_dirs / "target" / "config.json").read_text())["vocab_size"]
    logits = (spec.method_config.node_budget + 1) * vocab * 4  # a full tree's logits, per model (wider than deep)
    assert fp.per_row == sum(2 * layers * 32 * 4 * slots + logits for layers in (2, 1))  # hidden 32; 2 + 1 layers
    assert fp.total(3) == fp.loaded + 3 * fp.per_row and fp.total(0) == fp.base  # the load, then rows
    # each matrix freed as it is packed: the load peaks at the weights, not the weights plus their copies
    assert fp.base == fp.weights + fp.fixed + fp.packed - fp.released < fp.weights + fp.fixed + fp.packed
    assert _footprint(job(pair_dirs, kernel="hf")).packed == 0 == _footprint(job(pair_dirs, kernel="hf")).released
    assert _footprint(job(pair_dirs, kernel="lean-bf16")).packed == 2 * (mt + md)  # bfloat16 compute: 16-bit copies
    assert _footprint(job(pair_dirs, dtype="float64")).weights == 2 * fp.weights
    assert _footprint(job(pair_dirs, dtype="float64")).packed == 0
    bf = _footprint(job(pair_dirs, options={"kv_dtype": "bfloat16"}))
    assert fp.per_row - bf.per_row == sum(layers * 32 * 4 * slots for layers in (2, 1))  # caches halve
    huge = job(pair_dirs, options={"max_nodes": 4096})  # (the caches grow for a tree wider than the context)
    assert cache_rows(huge.method_config, 50, 128) == 50 + 128 + 8
    assert _footprint(huge).per_row - fp.per_row == 2 * (4096 - 256) * vocab * 4  # its logits counted whole
    windowed = job(pair_dirs, options={"kv_window": 40, "kv_evict": 8})
    assert _footprint(windowed).row_tokens == cache_rows(windowed.method_config, 50, 128) < slots
    whole = dataclasses.replace(spec, max_prompt_tokens=None)  # whole prompts: up to the context
    assert _footprint(whole).row_tokens == cache_rows(spec.method_config, 128 + 20, 128)
    assert _footprint(job(pair_dirs, prefix_cache_gb=1.0)).fixed == 2 * GIB + footprint.RUNTIME_BYTES  # one store a model
    off = job(pair_dirs, prefix_cache_gb=1.0, options={"prefix_cache": False})  # (counted anyway: trial AM)
    assert _footprint(off).fixed == footprint.RUNTIME_BYTES and _footprint(off).prefix == 0
    assert _footprint(job(pair_dirs, target="EleutherAI/pythia-70m", draft=None, method="ar")) is None  # a hub name


def write_model(path, tensors: dict, config: dict, name="model.safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    head = {k: {"dtype": d, "shape": s, "data_offsets": [0, 0]} for k, (d, s) in tensors.items()}
    blob = json.dumps({**head, "__metadata__": {"format": "pt"}}).encode()
    (path / name).write_bytes(len(blob).to_bytes(8, "little") + blob)
    (path / "config.json").write_text(json.dumps(config))


LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 10}


def test_headers_are_read_without_the_weights(tmp_path, pair_dirs):
    spec = job(pair_dirs)
    write_model(tmp_path / "m", {"a": ("BF16", [4, 6]), "b": ("BF16", [6]), "x.attention.bias": ("BOOL", [1, 64]),
                                 "y.inv_freq": ("F32", [4])}, LLAMA)
    weights, packed, released, per_row = footprint._model(tmp_path / "m", spec, 4, 10)  # buffers, non-floats left out
    tree = spec.method_config.node_budget + 1  # (a full tree's logits, however few the slots)
    assert (weights, packed, released, per_row) == (30 * 4, 24 * 2, 24 * 4, 2 * 2 * 1 * 4 * 4 * 10 + tree * 10 * 4)
    write_model(tmp_path / "m", {"a": ("BF16", [4, 6]), "c": ("F16", [6, 6])}, LLAMA)  # no one 16-bit format
    assert footprint._model(tmp_path / "m", spec, 4, 10)[1] == 60 * 4
    write_model(tmp_path / "m", {"a": ("BF16", [4, 6])}, LLAMA, name="consolidated.safetensors")  # not what loads
    assert footprint._model(tmp_path / "m", spec, 4, 10)[1] == 60 * 4
    gpt2 = {"model_type": "gpt2", "n_layer": 3, "n_embd": 8, "n_head": 2, "vocab_size": 10}
    write_model(tmp_path / "g", {"a": ("F32", [8, 8])}, gpt2)
    weights, packed, released, per_row = footprint._model(tmp_path / "g", spec, 4, 10)  # GPT-2: transformers' forward
    assert (weights, packed, released, per_row) == (64 * 4, 0, 0, 3 * 2 * 2 * 4 * 4 * 10 + tree * 10 * 4)
    write_model(tmp_path / "u", {"a": ("F32", [8, 8])}, {"model_type": "odd", "layers": 3})
    assert footprint._model(tmp_path / "u", spec, 4, 10) is None  # sizes it cannot read: no estimate


def nodes(*gib, cpus=2):
    # free memory split as Ray reports it: memory for tasks + the object store
    return [{"Alive": True, "Resources": {"CPU": cpus, "memory": 0.7 * g * GIB, "object_store_memory": 0.3 * g * GIB}}
            for g in gib]


def big(base_gib: float, row_mib: float) -> footprint.Footprint:
    return footprint.Footprint(int(base_gib * GIB), 0, 0, int(row_mib * 2**20), 704)


def test_fit_starts_what_memory_holds_and_caps_auto(pair_dirs):
    spec = job(pair_dirs, cpus_per_actor=1)
    assert footprint.fit(big(1, 10), nodes(24), 2, 1, spec)[:3] == (2, None, None)  # room to spare: nothing changes
    assert footprint.fit(big(1, 10), nodes(24), 2, 1, spec).notes == []
    n, reserve, cap, _, notes = footprint.fit(big(8, 100), nodes(24), 2, 1, spec)
    rows = math.floor((0.9 * 24 * GIB / 2 - 8 * GIB) / (100 * 2**20))  # both actors, each half the node
    assert (n, reserve, cap) == (2, None, rows) and rows == 28
    assert f"auto capped near {rows} row(s)" in notes[0] and "~8.0 GiB before its rows" in notes[0]
    n, reserve, cap, _, notes = footprint.fit(big(11, 400), nodes(24), 2, 1, spec)  # memory binds: reserved
    assert (n, reserve) == (1, big(11, 400).total(1)) and "starting 1 actor(s), not the 2 the CPUs hold" in notes[0]
    assert cap == math.floor((0.9 * 24 - 11) * GIB / (400 * 2**20))
    n, reserve, cap, _, notes = footprint.fit(big(20, 400), nodes(24), 2, 1, spec)  # above Ray's memory: nothing reserved
    assert (n, reserve) == (1, None) and "starting 1 actor, not 2: no node's Ray memory resource holds one" in notes[0]
    n, reserve, cap, _, notes = footprint.fit(big(30, 400), nodes(24), 2, 1, spec)  # not even one: tried, with a warning
    assert (n, reserve, cap) == (1, None, 1) and "even one row may not fit" in notes[0]
    assert "--prefix-cache-gb" not in notes[0] and "a smaller batch or --max-prompt-tokens needs less" in notes[0]
    held = footprint.Footprint(int(0.1 * GIB), 0, int(2.6 * GIB), 36 * 2**20, 704, prefix=2 * GIB)  # (trial AE)
    notes = footprint.fit(held, nodes(2), 1, 1, job(pair_dirs, prefix_cache_gb=1.0)).notes
    assert "--prefix-cache-gb 1 counts 2.0 GiB for stores that fill only with prompt beginnings" in notes[0], notes
    # weights freed as packed: the load's peak (the weights) decides the actors, what is left the rows
    fp = footprint.Footprint(10 * GIB, 5 * GIB, 2 * GIB, 500 * 2**20, 904, released=9 * GIB)
    assert (fp.base, fp.loaded) == (12 * GIB, 8 * GIB)
    n, reserve, cap, _, notes = footprint.fit(fp, nodes(24), 2, 1, spec)
    assert (n, cap) == (1, math.floor((0.9 * 24 - 17 + 9) * GIB / (500 * 2**20))) and "9.0 GiB freed as they are packed" in notes[0]
    asked = job(pair_dirs, cpus_per_actor=1, num_actors=2)  # asked for: kept, with a warning
    n, reserve, _, _, notes = footprint.fit(big(15, 400), nodes(24), 2, 1, asked)
    assert (n, reserve) == (2, None) and "the 2 actor(s) asked for may not fit (room for 1)" in notes[0]
    fixed = job(pair_dirs, cpus_per_actor=1, batch_size=32)  # a fixed batch counts whole: one actor holds it
    assert footprint.fit(big(8, 100), nodes(24), 2, 1, fixed)[:3] == (1, big(8, 100).total(32), None)
    fixed = job(pair_dirs, cpus_per_actor=1, batch_size=200)  # and is not changed, only warned about
    n, _, cap, _, notes = footprint.fit(big(8, 100), nodes(24), 2, 1, fixed)
    rows = math.floor((0.9 * 24 - 8) * GIB / (100 * 2**20))
    assert (n, cap) == (1, None) and f"--batch-size 200 may not fit (room for {rows} row(s)" in notes[0]


def test_fit_prices_the_tightest_node_whatever_their_order():
    spec = build_spec(None, input="x", output="y", cpus_per_actor=1)
    for order in ((24, 12), (12, 24)):
        n, reserve, cap, _, _ = footprint.fit(big(4, 100), nodes(*order), 4, 1, spec)  # Ray may put 2 on the small one
        assert (n, reserve, cap) == (4, None, math.floor((0.9 * 12 * GIB / 2 - 4 * GIB) / (100 * 2**20)))
        n, reserve, cap, _, notes = footprint.fit(big(7, 100), nodes(*order), 4, 1, spec)  # the small node holds one
        assert (n, reserve) == (3, big(7, 100).total(1)) and "not the 4" in notes[0]
        assert cap == math.floor((0.9 * 12 * GIB - 7 * GIB) / (100 * 2**20))
    dead = nodes(24, 24)
    dead[1]["Alive"] = False
    assert footprint.fit(big(11, 10), dead, 2, 1, spec)[0] == 1  # the dead node's memory is not counted
    thin = [{"Alive": True, "Resources": {"CPU": 3.0, "memory": 70 * GIB, "object_store_memory": 30 * GIB}}]
    assert footprint.fit(big(1, 10), thin, 30, 0.1, spec)[:2] == (30, None)  # fractional CPUs: 30 fit, as Ray counts


def test_the_tuner_can_pick_a_memory_cap_off_its_ladder():
    assert BatchTuner(max_size=7, start=16).sizes == [1, 2, 4, 7] and BatchTuner(max_size=7).size == 7
    assert BatchTuner(max_size=64).sizes == [1, 2, 4, 8, 16, 32, 64]
