"""The bundled demo pair ships inside the package: an installed wheel finds it and every decoder runs on it."""
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "dynatree" / "assets" / "demo-pair"


def test_demo_pair_is_small_and_documented():
    files = [p for p in ASSETS.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 12 * 2**20
    card = json.loads((ASSETS / "card.json").read_text())
    for key in ("corpus", "target", "draft", "measured"):
        assert key in card


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Build a wheel of this checkout and install it (no deps) into an isolated directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp / "dist"), str(ROOT)], check=True, capture_output=True, text=True)
    # setuptools warns that a data directory (assets, csrc, examples) missing from `packages` would be
    # left out of wheels by its later versions
    assert "would be ignored" not in built.stderr, built.stderr[-2000:]
    wheel = next((tmp / "dist").glob("dynatree-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "dynatree/assets/demo-pair/target/model.safetensors" in names
    assert "dynatree/actors/worker.py" in names and "dynatree/jobs/driver.py" in names
    assert "dynatree/csrc/gemm.c" in names and "dynatree/jobs/examples/demo.yaml" in names
    assert not any(n.startswith(("actors/", "jobs/")) for n in names)  # no generic top-level modules
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(tmp / "site"), str(wheel)], check=True)
    return tmp / "site"


def test_installed_package_generates_with_every_decoder(installed, tmp_path):
    code = (
        "import dynatree, sys\n"
        "from dynatree import load_pair, generate\n"
        f"assert dynatree.__file__.startswith({str(installed)!r}), dynatree.__file__\n"
        "pair = load_pair(device='cpu')\n"
        "ref = generate(pair, 'It was a dark and stormy night', 'ar', max_new_tokens=24, ignore_eos=True)\n"
        "for m in ('linear', 'fixed_tree', 'dynatree', 'dyspec'):\n"
        "    g = generate(pair, 'It was a dark and stormy night', m, max_new_tokens=24, ignore_eos=True)\n"
        "    assert g.token_ids == ref.token_ids, m\n"
        "print(ref.text)\n")
    env = {**os.environ, "PYTHONPATH": str(installed)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    words = res.stdout.split()
    assert len(words) >= 8


def test_cli_generate_without_model_flags():
    from click.testing import CliRunner

    from dynatree.cli import main
    res = CliRunner().invoke(main, ["generate", "--prompt", "The old man", "--max-new-tokens", "12",
                                    "--device", "cpu", "--check-ar", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["matches_ar"] is True and len(out["token_ids"]) <= 12
    from dynatree import native
    if native.library() is not None:  # what ran, not only what was asked for (the demo pair: the native kernel)
        assert out["forward"].startswith("native kernel (")


def test_cli_generate_reads_stdin_without_its_last_line_end():
    """`echo text | dynatree generate` decodes "text" (the newline echo adds is no part of the prompt),
    as --prompt text does; only that one line end goes."""
    from click.testing import CliRunner

    from dynatree.cli import main
    args = ["generate", "--max-new-tokens", "4", "--device", "cpu", "--method", "ar", "--json"]
    got = [json.loads(CliRunner().invoke(main, args + extra, input=stdin).stdout.strip().splitlines()[-1])
           for extra, stdin in (([], "The old man\n"), ([], "The old man\r\n"), (["--prompt", "The old man"], ""),
                                ([], "The old man\n\n"))]
    assert got[0]["token_ids"] == got[1]["token_ids"] == got[2]["token_ids"]
    n = [g["metrics"]["prompt_tokens"] for g in got]
    assert n[0] == n[1] == n[2] < n[3]


def test_the_package_lists_its_lazy_names_without_importing_torch():
    """dir(dynatree) shows generate, load_pair, ... (tab completion) though they load on first use,
    and listing them imports neither torch nor transformers (the job driver never needs them)."""
    code = ("import dynatree, sys; names = dir(dynatree); "
            "assert {'generate', 'generate_batch', 'load_pair', 'make_config', '__version__'} <= set(names), names; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_native_kernel_actor_starts_without_transformers_modeling_code():
    """An actor on the native kernel loads its pair and decodes without transformers' modeling
    stack (modeling_utils and what it imports: ~1.3 s of every actor's start, and of
    `dynatree generate`'s); only `--kernel hf` and other architectures need it."""
    from dynatree import native

    if native.library() is None:
        pytest.skip(f"the native kernel is not built here ({native.status()})")
    code = ("import sys, dynatree.actors.worker; from dynatree import generate, load_pair; "
            "p = load_pair(device='cpu'); g = generate(p, 'The quick brown fox', max_new_tokens=4); "
            "assert not p.not_native('target') and not p.not_native('draft'), p.forward_in_use(); "
            "bad = [m for m in sys.modules if m.startswith('transformers.modeling_utils')]; assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_busy_cpus_sees_other_processes_not_its_own_and_the_note_follows_it():
    """A process spinning beside us is seen in /proc/stat, this process's own CPU time (models
    loading meanwhile) is not; the note names the --threads that fit in the CPUs left free.
    (conftest turns the commands' measurement off; its parts are called here.)"""
    from dynatree import cli, machine

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat on this system")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        before = machine.cpu_snapshot()
        time.sleep(0.3)
        assert machine.busy_between(before, machine.cpu_snapshot()) >= 0.6
    finally:
        spin.kill()
        spin.wait()
    before = machine.cpu_snapshot()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # this process busy: not another's load
        pass
    own = machine.cpu_snapshot()
    assert own[2] - before[2] >= 0.25
    # one second in which the machine was busy 2.5 CPU-seconds, 2.0 of them this process's
    assert machine.busy_between((0.0, 10.0, 3.0), (1.0, 12.5, 5.0)) == pytest.approx(0.5)
    assert machine.busy_between((1.0, 10.0, 3.0), (1.0, 10.0, 3.0)) is None
    note = cli.cores_note(1.5, 2, 2)
    assert "other processes are using ~1.5 of this machine's 2 CPUs" in note and "give --threads 1" in note
    assert cli.cores_note(0.2, 2, 2) is None and cli.cores_note(None, 2, 2) is None
    assert cli.cores_note(1.5, 1, 2) is None  # (one thread: nothing to wait for)
    assert "give --threads 3" in cli.cores_note(5.0, 4, 8)  # (3 CPUs free)
    for busy in (0.0, None):  # more threads than CPUs (taskset, --threads 64): said as that, not as others' load
        note = cli.cores_note(busy, 3, 2)
        assert note.startswith("note: a forward on 3 threads waits at every step for any thread that has no CPU of "
                               "its own") and "give --threads 2" in note and "other processes" not in note, note
