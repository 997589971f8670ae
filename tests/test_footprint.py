"""jobs/footprint.py: an actor's memory estimated from checkpoint headers, and what the driver
starts with it (how many actors, auto's batch cap)."""
import math

import pytest
from safetensors.torch import load_file

from dynatree.jobs import footprint
from dynatree.jobs.driver import _footprint
from dynatree.jobs.spec import build_spec

GIB = 2**30


def job(pair_dirs, **kw):
    base = dict(input="x.parquet", output="out", target=str(pair_dirs / "target"), draft=str(pair_dirs / "draft"),
                max_new_tokens=20, max_prompt_tokens=30, dtype="float32", prefix_cache_gb=0.0)
    return build_spec(None, **{**base, **kw})


def _counts(model_dir):
    tensors = load_file(model_dir / "model.safetensors")
    return (sum(t.numel() for t in tensors.values()), sum(t.numel() for t in tensors.values() if t.dim() == 2))


def test_the_estimate_counts_weights_packed_copies_and_caches(pair_dirs):
    (pt, mt), (pd, md) = _counts(pair_dirs / "target"), _counts(pair_dirs / "draft")
    fp = _footprint(job(pair_dirs))
    assert fp.weights == 4 * (pt + pd) and fp.packed == 4 * (mt + md)  # float32 checkpoints: float32 copies
    assert fp.fixed == footprint.RUNTIME_BYTES and fp.row_tokens == 50 + 64
    per_token = sum(2 * layers * 32 * 4 for layers in (2, 1))  # tiny_neox: hidden 32; target 2 layers, draft 1
    assert fp.per_row == per_token * fp.row_tokens and fp.total(3) == fp.base + 3 * fp.per_row
    assert _footprint(job(pair_dirs, kernel="lean-mkl")).packed == 0  # torch's kernels keep no packed copy
    assert _footprint(job(pair_dirs, dtype="float64")).weights == 2 * fp.weights
    assert _footprint(job(pair_dirs, options={"kv_dtype": "bfloat16"})).per_row == fp.per_row // 2
    windowed = _footprint(job(pair_dirs, max_prompt_tokens=None, options={"kv_window": 40, "kv_evict": 8}))
    assert windowed.row_tokens == 40 + 64  # a windowed cache holds the window, whatever the prompt
    assert _footprint(job(pair_dirs, prefix_cache_gb=1.0)).fixed == GIB + footprint.RUNTIME_BYTES
    assert _footprint(job(pair_dirs, target="EleutherAI/pythia-70m", draft=None, method="ar")) is None  # a hub name


def nodes(*gib, cpus=2):
    # free memory split as Ray reports it: memory for tasks + the object store
    return [{"Alive": True, "Resources": {"CPU": cpus, "memory": 0.7 * g * GIB, "object_store_memory": 0.3 * g * GIB}}
            for g in gib]


def big(base_gib: float, row_mib: float) -> footprint.Footprint:
    return footprint.Footprint(int(base_gib * GIB), 0, 0, int(row_mib * 2**20), 704)


def test_fit_starts_what_memory_holds_and_caps_auto(pair_dirs):
    spec = job(pair_dirs, cpus_per_actor=1)
    assert footprint.fit(big(1, 10), nodes(24), 2, 1, spec) == (2, None, [])  # room to spare: nothing changes
    n, cap, notes = footprint.fit(big(8, 100), nodes(24), 2, 1, spec)
    rows = math.floor((0.9 * 24 * GIB / 2 - 8 * GIB) / (100 * 2**20))  # both actors, each half the node
    assert (n, cap) == (2, rows) and rows == 28
    assert f"auto capped at {rows} row(s)" in notes[0] and "~8.0 GiB for its models" in notes[0]
    n, cap, notes = footprint.fit(big(15, 400), nodes(24), 2, 1, spec)
    assert (n, cap) == (1, math.floor((0.9 * 24 - 15) * GIB / (400 * 2**20)))
    assert "starting 1 actor(s), not the 2 the CPUs hold" in notes[0]
    n, cap, notes = footprint.fit(big(30, 400), nodes(24), 2, 1, spec)  # not even one: one is tried, with a warning
    assert (n, cap) == (1, 1) and "even one row may not fit" in notes[0]
    asked = job(pair_dirs, cpus_per_actor=1, num_actors=2)  # asked for: kept, with a warning
    n, _, notes = footprint.fit(big(15, 400), nodes(24), 2, 1, asked)
    assert n == 2 and "the 2 actor(s) asked for may not fit (room for 1)" in notes[0]
    fixed = job(pair_dirs, cpus_per_actor=1, batch_size=32)  # a fixed batch counts whole: one actor holds it
    assert footprint.fit(big(8, 100), nodes(24), 2, 1, fixed)[:2] == (1, None)
    fixed = job(pair_dirs, cpus_per_actor=1, batch_size=200)  # and is not changed, only warned about
    n, cap, notes = footprint.fit(big(8, 100), nodes(24), 2, 1, fixed)
    rows = math.floor((0.9 * 24 - 8) * GIB / (100 * 2**20))
    assert (n, cap) == (1, None) and f"--batch-size 200 may not fit (room for {rows} row(s)" in notes[0]


def test_fit_fills_nodes_in_order_and_prices_the_tightest():
    spec = build_spec(None, input="x", output="y", cpus_per_actor=1)
    n, cap, _ = footprint.fit(big(4, 100), nodes(24, 12), 4, 1, spec)  # 2 actors on each node
    assert (n, cap) == (4, math.floor((0.9 * 12 * GIB / 2 - 4 * GIB) / (100 * 2**20)))
    n, cap, notes = footprint.fit(big(8, 100), nodes(24, 12), 4, 1, spec)  # the small node holds one
    assert n == 3 and "not the 4" in notes[0]
    dead = nodes(24, 24)
    dead[1]["Alive"] = False
    assert footprint.fit(big(8, 10), dead, 4, 1, spec)[0] == 2


@pytest.mark.parametrize("stored", ["BF16", "F32"])
def test_headers_are_read_without_the_weights(tmp_path, stored):
    import json
    head = {"a": {"dtype": stored, "shape": [4, 6], "data_offsets": [0, 0]},
            "b": {"dtype": stored, "shape": [6], "data_offsets": [0, 0]}, "__metadata__": {"format": "pt"}}
    blob = json.dumps(head).encode()
    (tmp_path / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8,
                                                      "num_attention_heads": 2, "num_key_value_heads": 1}))
    weights, packed, per_row = footprint._model(tmp_path, "float32", True, 4, 10)
    assert weights == 30 * 4 and packed == 24 * (2 if stored == "BF16" else 4) and per_row == 2 * 2 * 1 * 4 * 4 * 10
    assert footprint._model(tmp_path, "float32", False, 4, 10)[1] == 0
