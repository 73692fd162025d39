"""The embedded default inputs: stdlib corpus, tokenizer, ``python_stdlib`` dataset, launcher.

All CPU. Corpora here come from a tiny fake source tree or from one small stdlib package (``json``),
except one subprocess test that builds the real default corpus offline.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from titan_megamoe.data import (
    DEFAULT_DATA_DIR,
    DEFAULT_TOKENIZER_DIR,
    register_datasets,
)
from titan_megamoe.data.corpus import (
    COMPLETE_MARKER,
    build_stdlib_corpus,
    corpus_files,
    iter_corpus_texts,
    read_manifest,
)
from titan_megamoe.data.tokenizer import BOS_TOKEN, EOS_TOKEN, train_stdlib_tokenizer
from titan_megamoe import launch

REPO_ROOT = Path(__file__).resolve().parents[1]
JSON_PKG = Path(json.__file__).parent  # a small real stdlib package (~5 files, ~60 KB)

# Fake stdlib tree: name -> bytes. Sorted relative-path order of the kept files is a, pkg/b, z.
FAKE_FILES = {
    "a.py": b"def a():\n    return 1\n",
    "pkg/b.py": b"class B:\n    x = 'b'\n",
    "z_unicode.py": "s = 'caf\u00e9 \u2028 \u03c0'\n".encode("utf-8"),  # U+2028 must survive JSONL
    "latin1.py": b"# coding: latin-1\ns = '\xe9'\n",  # not UTF-8: skipped
    "pkg/__pycache__/c.py": b"excluded = True\n",
    "site-packages/d.py": b"excluded = True\n",
    "lib/dist-packages/e.py": b"excluded = True\n",
    "notes.txt": b"not python\n",
}
KEPT = ["a.py", "pkg/b.py", "z_unicode.py"]

SNIPPET = textwrap.dedent(
    """\
    def f(xs: list[int]) -> dict[str, int]:
    \t# tab, unicode not in the corpus: \u00e9 \u03c0 \u2603 \U0001f600
        return {"n": len(xs), "s": sum(x * 2 for x in xs)}  \n
    """
)


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    root = tmp_path / "fake_stdlib"
    for rel, data in FAKE_FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    return build_stdlib_corpus(tmp_path_factory.mktemp("corpus") / "json_pkg", src_root=JSON_PKG)


@pytest.fixture(scope="module")
def small_tokenizer(small_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tok300"
    return train_stdlib_tokenizer(small_corpus, out, vocab_size=300)


# ---------------------------------------------------------------- corpus


def test_corpus_keeps_utf8_py_files_in_sorted_order(fake_root, tmp_path):
    out = build_stdlib_corpus(tmp_path / "c", src_root=fake_root)
    expected = [FAKE_FILES[rel].decode("utf-8") for rel in KEPT]
    assert list(iter_corpus_texts(out)) == expected
    manifest = read_manifest(out)
    assert manifest["num_docs"] == 3
    assert manifest["num_bytes"] == sum(len(FAKE_FILES[rel]) for rel in KEPT)
    assert manifest["num_skipped_non_utf8"] == 1
    assert manifest["src_root"] == str(fake_root)
    assert [p.name for p in corpus_files(out)] == manifest["files"] == ["python_stdlib-00000.jsonl"]
    # No temp directory left next to the output.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "fake_stdlib"]


def test_corpus_is_deterministic(fake_root, tmp_path):
    one = build_stdlib_corpus(tmp_path / "one", src_root=fake_root)
    two = build_stdlib_corpus(tmp_path / "two", src_root=fake_root)
    for name in ["python_stdlib-00000.jsonl", COMPLETE_MARKER]:
        assert (one / name).read_bytes() == (two / name).read_bytes()


def test_corpus_cache_is_returned_without_rebuilding(fake_root, tmp_path):
    out = build_stdlib_corpus(tmp_path / "c", src_root=fake_root)
    shard = corpus_files(out)[0]
    before = (shard.stat().st_mtime_ns, shard.read_bytes())
    (fake_root / "new.py").write_text("added_later = 1\n")
    assert build_stdlib_corpus(out, src_root=fake_root) == out
    assert (shard.stat().st_mtime_ns, shard.read_bytes()) == before
    assert read_manifest(out)["num_docs"] == 3


def test_corpus_refuses_incomplete_existing_dir(fake_root, tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "mine.jsonl").write_text('{"text": "user data"}\n')
    with pytest.raises(FileExistsError, match="_COMPLETE"):
        build_stdlib_corpus(tmp_path / "c", src_root=fake_root)
    assert (tmp_path / "c" / "mine.jsonl").read_text() == '{"text": "user data"}\n'


def test_corpus_shards_and_byte_cap(fake_root, tmp_path):
    sharded = build_stdlib_corpus(tmp_path / "s", src_root=fake_root, shard_bytes=1)  # 1 doc / shard
    assert len(corpus_files(sharded)) == 3
    assert list(iter_corpus_texts(sharded)) == [FAKE_FILES[rel].decode() for rel in KEPT]
    cap = len(FAKE_FILES["a.py"]) + len(FAKE_FILES["pkg/b.py"])  # exactly the first two docs
    capped = build_stdlib_corpus(tmp_path / "m", src_root=fake_root, max_bytes=cap)
    assert read_manifest(capped)["num_docs"] == 2
    assert read_manifest(capped)["num_bytes"] == cap
    with pytest.raises(ValueError, match="max_bytes"):
        build_stdlib_corpus(tmp_path / "tiny", src_root=fake_root, max_bytes=3)


def test_corpus_errors_on_root_without_py_files(tmp_path):
    empty = tmp_path / "empty"
    (empty / "__pycache__").mkdir(parents=True)
    (empty / "__pycache__" / "only_cached.py").write_text("x = 1\n")  # pruned, so still "no .py"
    with pytest.raises(FileNotFoundError, match=r"no \*\.py file"):
        build_stdlib_corpus(tmp_path / "c", src_root=empty)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        build_stdlib_corpus(tmp_path / "c", src_root=tmp_path / "missing")
    assert not (tmp_path / "c").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # temp dir cleaned up


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_loads_in_torchtitan_and_round_trips(small_tokenizer):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(str(small_tokenizer))
    assert (tok.bos_token, tok.bos_id) == (BOS_TOKEN, 0)
    assert (tok.eos_token, tok.eos_id) == (EOS_TOKEN, 1)
    assert tok.get_vocab_size() == 300  # specials included, nothing appended at load
    ids = tok.encode(SNIPPET, add_bos=True, add_eos=True)
    assert ids[0] == 0 and ids[-1] == 1
    assert 0 not in ids[1:-1] and 1 not in ids[1:-1]
    assert max(ids) < 300
    assert len(ids) < len(SNIPPET.encode("utf-8"))  # the merges actually compress
    assert tok.decode(ids) == SNIPPET
    assert tok.encode(SNIPPET) == ids[1:-1]  # no implicit BOS/EOS


def test_tokenizer_is_deterministic_and_cached(small_corpus, small_tokenizer, tmp_path):
    again = train_stdlib_tokenizer(small_corpus, tmp_path / "again", vocab_size=300)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        assert (again / name).read_bytes() == (small_tokenizer / name).read_bytes()
    before = (again / "tokenizer.json").stat().st_mtime_ns
    assert train_stdlib_tokenizer(small_corpus, again, vocab_size=999) == again
    assert (again / "tokenizer.json").stat().st_mtime_ns == before
    provenance = json.loads((again / "provenance.json").read_text())
    assert provenance["vocab_size"] == 300
    assert provenance["num_train_docs"] == read_manifest(small_corpus)["num_docs"]


def test_tokenizer_rejects_vocab_without_room_for_bytes(small_corpus, tmp_path):
    with pytest.raises(ValueError, match=">= 258"):
        train_stdlib_tokenizer(small_corpus, tmp_path / "t", vocab_size=257)
    assert not (tmp_path / "t").exists()


# ---------------------------------------------------------------- dataset


def test_python_stdlib_dataset_feeds_torchtitan_dataloader(
    small_corpus, small_tokenizer, tmp_path, monkeypatch
):
    import datasets.config
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.config import JobConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS, build_text_dataloader

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    register_datasets()
    register_datasets()  # idempotent
    entry = DATASETS["python_stdlib"]
    assert entry.path == DEFAULT_DATA_DIR == "data/python_stdlib"
    assert len(entry.loader(str(small_corpus))) == read_manifest(small_corpus)["num_docs"]

    job = JobConfig()
    job.training.dataset = "python_stdlib"
    job.training.dataset_path = str(small_corpus)
    job.training.local_batch_size = 2
    job.training.seq_len = 64
    tok = HuggingFaceTokenizer(str(small_tokenizer))
    loader = build_text_dataloader(dp_world_size=1, dp_rank=0, tokenizer=tok, job_config=job)
    inputs, labels = next(iter(loader))
    x = inputs["input"]
    assert x.shape == labels.shape == (2, 64)
    assert x.dtype == labels.dtype == __import__("torch").int64
    assert int(x.min()) >= 0 and int(max(x.max(), labels.max())) < tok.get_vocab_size()
    assert int(x[0, 0]) == tok.bos_id  # the first document starts the stream
    assert bool((labels[:, :-1] == x[:, 1:]).all())  # labels are inputs shifted by one
    first_doc = next(iter_corpus_texts(small_corpus))
    assert tok.decode(x[0].tolist()) == first_doc[: len(tok.decode(x[0].tolist()))]


def test_loader_builds_default_corpus_offline(tmp_path):
    """Fresh process, HF offline, empty working dir: the loader builds data/python_stdlib itself."""
    script = textwrap.dedent(
        """
        from titan_megamoe.data import register_datasets
        from titan_megamoe.data.corpus import iter_corpus_texts, read_manifest
        from torchtitan.hf_datasets.text_datasets import DATASETS
        register_datasets()
        entry = DATASETS["python_stdlib"]
        ds = entry.loader(entry.path)
        same_text = entry.sample_processor(ds[0]) == next(iter_corpus_texts(entry.path))
        print(len(ds), read_manifest(entry.path)["num_docs"], same_text)
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = str(tmp_path / "hf")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    n_rows, n_docs, text_ok = proc.stdout.split()[-3:]
    assert n_rows == n_docs and int(n_docs) > 500  # CPython's stdlib has ~1,800 .py files
    assert text_ok == "True"
    assert (tmp_path / DEFAULT_DATA_DIR / COMPLETE_MARKER).is_file()


# ---------------------------------------------------------------- launcher


def _write_toml(path: Path, dataset: str, assets: str) -> Path:
    path.write_text(
        f'[model]\nhf_assets_path = "{assets}"\n\n[training]\ndataset = "{dataset}"\nsteps = 10\n'
    )
    return path


def _dry_run(capsys, argv) -> dict[str, str]:
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    lines = {}
    for line in out.splitlines():
        key, _, value = line.partition(": ") if not line.startswith("env ") else ("env", "", line[4:])
        lines.setdefault(key, "")
        lines[key] += value + ("\n" if key == "env" else "")
    return lines


def test_launch_dry_run_prints_command_and_env(tmp_path, capsys):
    cfg = _write_toml(tmp_path / "job.toml", "python_stdlib", "./assets/python_stdlib_tokenizer")
    argv = ["--config", str(cfg), "--ngpu", "2", "--steps", "5", "--dry-run", "--", "--x.y", "1"]
    got = _dry_run(capsys, argv)
    assert shlex.split(got["command"]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "-m", "torchtitan.train", "--job.config_file", str(cfg), "--training.steps", "5", "--x.y", "1",
    ]  # fmt: skip
    assert got["env"].split() == [
        "HF_HUB_OFFLINE=1", "HF_DATASETS_OFFLINE=1", "NCCL_NVLS_ENABLE=0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1",
    ]  # fmt: skip
    assert got["prepare corpus"] == DEFAULT_DATA_DIR
    assert got["prepare tokenizer"] == DEFAULT_TOKENIZER_DIR
    assert not (tmp_path / "data").exists()  # dry run prepares nothing


def test_launch_plan_follows_toml_and_cli_overrides(tmp_path, capsys):
    import torch

    other = _write_toml(tmp_path / "c4.toml", "c4_test", "./tests/assets/tokenizer")
    got = _dry_run(capsys, ["--config", str(other), "--dry-run"])
    assert (got["prepare corpus"], got["prepare tokenizer"]) == ("-", "-")
    assert shlex.split(got["command"])[5] == str(torch.cuda.device_count() or 1)  # --ngpu default
    assert "--training.steps" not in got["command"]
    got = _dry_run(
        capsys,
        ["--config", str(other), "--ngpu", "1", "--dry-run", "--",
         "--training.dataset", "python_stdlib", "--training.dataset_path=/my/corpus"],
    )  # fmt: skip
    assert got["prepare corpus"] == "/my/corpus"


def test_launch_missing_config_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        launch.main(["--config", str(tmp_path / "nope.toml"), "--dry-run"])
    assert exc.value.code == 2
    assert f"config file not found: {tmp_path / 'nope.toml'}" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\n")
    with pytest.raises(SystemExit) as exc:
        launch.main(["--config", str(bad), "--ngpu", "1", "--dry-run"])
    assert exc.value.code == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_launch_module_entry_point_exits_nonzero_on_missing_config(tmp_path):
    """The real `python -m titan_megamoe.launch` CLI (one process: importing the package costs ~10 s)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "titan_megamoe.launch", "--ngpu", "1", "--dry-run"]
    cmd += ["--config", "missing.toml"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "config file not found: missing.toml" in proc.stderr
    assert "command:" not in proc.stdout


def test_launch_refuses_more_ranks_than_gpus_before_any_work(tmp_path, capsys, monkeypatch):
    from titan_megamoe.launch import main

    monkeypatch.chdir(tmp_path)
    cfg = _write_toml(tmp_path / "job.toml", "python_stdlib", "./assets/python_stdlib_tokenizer")
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(cfg), "--ngpu", "99"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--ngpu 99" in err and "CUDA GPU" in err
    assert not (tmp_path / "data").exists()  # refused before building the corpus


@pytest.mark.parametrize("table, message", [
    ('backend = "tritn"', "megamoe.backend = 'tritn' is not valid; allowed values: 'reference', 'triton'"),
    ("capacity_factor = 0.5", "megamoe.capacity_factor must be a finite number >= 1.0"),
    ("capacity_fator = 2.0", "unknown [megamoe] key(s) capacity_fator"),
    ('backend = "reference"\nprecision = "fp8"', "backend='reference' with precision='fp8' is not available"),
])
def test_launch_rejects_a_bad_megamoe_table_before_anything_runs(tmp_path, capsys, table, message):
    """A typo in [megamoe] stops the launcher, a dry run too, naming the key and the allowed values."""
    cfg = _write_toml(tmp_path / "job.toml", "c4_test", "./tests/assets/tokenizer")
    cfg.write_text(cfg.read_text() + f'\n[job]\ncustom_config_module = "titan_megamoe.config"\n\n[megamoe]\n{table}\n')
    with pytest.raises(SystemExit) as e:
        launch.main(["--config", str(cfg), "--ngpu", "1", "--dry-run"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    cfg.write_text(cfg.read_text().replace(table, 'backend = "triton"'))
    assert launch.main(["--config", str(cfg), "--ngpu", "1", "--dry-run"]) == 0


def test_launch_rejects_a_megamoe_table_without_its_config_module(tmp_path, capsys):
    """[megamoe] without [job] custom_config_module = "titan_megamoe.config": TorchTitan would refuse the table at
    start-up; the launcher says so first, naming the setting to add."""
    cfg = _write_toml(tmp_path / "job.toml", "c4_test", "./tests/assets/tokenizer")
    cfg.write_text(cfg.read_text() + '\n[megamoe]\nbackend = "triton"\n')
    with pytest.raises(SystemExit) as e:
        launch.main(["--config", str(cfg), "--ngpu", "1", "--dry-run"])
    assert e.value.code == 2
    assert 'custom_config_module = "titan_megamoe.config"' in capsys.readouterr().err


@pytest.mark.parametrize("edit, ngpu, extra, message", [
    ("expert_parallel_degree = 3", 2, [], "expert_parallel_degree = 3 does not divide the 2 rank(s)"),
    ("expert_parallel_degree = 3", 3, [], "expert_parallel_degree = 3 does not divide the 64 routed experts of qwen3 "
                                          "debugmodel_moe"),
    ("tensor_parallel_degree = 2", 2, [], "megamoe cannot run with tensor_parallel_degree=2"),
    ("expert_tensor_parallel_degree = 2", 2, [], "expert_tensor_parallel_degree=2 (set it to 1"),
    ("expert_parallel_degree = 2", 2, ["--parallelism.expert_parallel_degree", "3"], "= 3 does not divide the 2"),
    ('expert_parallel_degree = "two"', 2, [], "parallelism.expert_parallel_degree must be an integer, got 'two'"),
    ('converters = ["megamoe", "quantize.grouped_mm.float8"]', 2, [],
     "converters ['quantize.grouped_mm.float8'] quantize the MoE grouped GEMMs, which megamoe replaces"),
])
def test_launch_rejects_parallelism_megamoe_cannot_run(capsys, tmp_path, edit, ngpu, extra, message):
    """A megamoe config whose [parallelism] the fused operator cannot run (tensor / expert tensor parallelism, an EP
    degree that divides neither the ranks nor the experts; CLI overrides count), or with a converter of the expert
    GEMMs beside it, stops the launcher, a dry run too, with what to change; the unedited config and a stock one with
    the same edit pass."""
    src = REPO_ROOT / "train_configs" / "qwen3_debugmoe_megamoe_bf16.toml"
    key = edit.split(" = ")[0]
    text = src.read_text()
    assert f"\n{key} = " in text
    bad = tmp_path / "bad.toml"
    bad.write_text("\n".join(edit if line.startswith(f"{key} = ") else line for line in text.splitlines()))
    argv = ["--config", str(bad), "--ngpu", str(ngpu), "--dry-run", "--", *extra]
    with pytest.raises(SystemExit) as e:
        launch.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert launch.main(["--config", str(src), "--ngpu", "2", "--dry-run"]) == 0
    stock = tmp_path / "stock.toml"
    stock.write_text(bad.read_text().replace('converters = ["megamoe"]', "converters = []").replace(
        '"megamoe", ', ""))
    stock_argv = ["--config", str(stock), "--ngpu", str(ngpu), "--dry-run", "--", *extra]
    if "does not divide the 2" in message or "must be an integer" in message:  # TorchTitan's mesh needs these too
        with pytest.raises(SystemExit):
            launch.main(stock_argv)
        assert message in capsys.readouterr().err
    else:
        assert launch.main(stock_argv) == 0


def test_launch_says_what_it_will_run_and_warns_of_likely_mistakes(tmp_path, capsys):
    """The dry run's "moe:" line names the implementation (megamoe's backend / precision / EP, or stock), and valid
    configs that are likely not what was meant get a warning: the slow reference backend, a [megamoe] table without
    the converter, its defaults without a table, more ranks than one host has."""
    def run(text: str, *argv: str) -> list[str]:
        cfg = tmp_path / "job.toml"
        cfg.write_text(text)
        assert launch.main(["--config", str(cfg), "--dry-run", *argv]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.split(":")[0] in ("moe", "warning",
                                                                                                 "note")]

    src = (REPO_ROOT / "train_configs" / "qwen3_debugmoe_megamoe_bf16.toml").read_text()
    lines = run(src, "--ngpu", "2")
    assert "moe: megamoe, backend triton, precision bf16, EP 2 of 2 rank(s)" in lines
    assert not any(line.startswith(("warning: [megamoe]", "warning: the [megamoe]", "note")) for line in lines), lines
    lines = run(src.replace('backend = "triton"', 'backend = "reference"'), "--ngpu", "2")
    assert 'warning: [megamoe] backend "reference" is the pure-PyTorch oracle' in "\n".join(lines)
    no_table = re.sub(r"\[megamoe\]\n(?:[^\[\n].*\n|\n)*", "", src)  # the table, up to the next one
    assert "[megamoe]" not in no_table and "[optimizer]" in no_table
    lines = run(no_table.replace('custom_config_module = "titan_megamoe.config"', ""), "--ngpu", "2")
    assert any(line.endswith("(no [megamoe] table: its defaults)") and "backend triton" in line for line in lines)
    lines = run(src.replace('converters = ["megamoe"]', "converters = []"), "--ngpu", "2")
    assert 'moe: stock TorchTitan (no "megamoe" in [model] converters), EP 2 of 2 rank(s)' in lines
    assert any(line.startswith("warning: the [megamoe] table has no effect") for line in lines), lines
    lines = run(src, "--ngpu", "16")
    assert any(line.startswith("note: --ngpu 16 starts 16 ranks on this host") for line in lines), lines
    # TorchTitan's CLI overrides the TOML, here too; an empty table is a table
    lines = run(src, "--ngpu", "2", "--", "--megamoe.backend", "reference")
    assert "moe: megamoe, backend reference, precision bf16, EP 2 of 2 rank(s)" in lines
    assert any(line.startswith('warning: [megamoe] backend "reference"') for line in lines), lines
    lines = run(re.sub(r"(\[megamoe\]\n)(?:[^\[\n].*\n|\n)*", r"\1\n", src), "--ngpu", "2")
    assert "moe: megamoe, backend triton, precision bf16, EP 2 of 2 rank(s)" in lines
    bad = tmp_path / "job.toml"
    with pytest.raises(SystemExit):
        launch.main(["--config", str(bad), "--ngpu", "2", "--dry-run", "--", "--megamoe.precision", "fp8",
                     "--megamoe.backend=reference"])
    assert "backend='reference' with precision='fp8' is not available" in capsys.readouterr().err
