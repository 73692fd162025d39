"""The user-facing docs cite files that exist.

Every number in README.md and docs/ traces to a committed result file; a renamed or missing file breaks that
trace silently, so these tests read each backquoted path or result-file name and look for it.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ["README.md", "docs/RESULTS.md", "docs/SWITCHES.md", "docs/CI.md", "docs/ARCHITECTURE.md",
        "benchmarks/results/README.md", "docs/HISTORY.md"]
_RESULT_SUFFIX = re.compile(r"\.(json|png|log|txt|pt)$")
_REPO_DIRS = ("scripts/", "train_configs/", "tests/", "docs/", "compare/", "titan_megamoe/", "benchmarks/", "logs/",
              "ops/", "kernels/", "comm/")


def expand_braces(name: str) -> list[str]:
    """``a{x,y}b`` -> ``[axb, ayb]``, nested groups as a product (the docs' shorthand for sibling files)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if m is None:
        return [name]
    return [n for alt in m.group(1).split(",") for n in expand_braces(name[:m.start()] + alt + name[m.end():])]


def cited_paths(text: str) -> list[str]:
    """Backquoted tokens that name a repository path or a result file, braces expanded.

    Placeholders (``<gpu>``, ``$OUT``, ``*``) and abbreviations (``..._s18e_...``) are not names and are skipped.
    """
    out = []
    for tok in re.findall(r"`([^`\s]+)`", text):
        if any(c in tok for c in ("...", "<", "*", "$")):
            continue
        tok = tok.replace(".json/.png", ".json").replace(".{json,png}", ".json")
        if _RESULT_SUFFIX.search(tok) or tok.startswith(_REPO_DIRS):
            out.extend(expand_braces(tok))
    return out


def _exists(name: str) -> bool:
    if "/" in name and not name.startswith(("benchmarks/", "logs/")):
        return (ROOT / name).exists() or (ROOT / "titan_megamoe" / name).exists()
    return any(p.exists() for p in (ROOT / name, RESULTS / name, RESULTS / Path(name).name,
                                    RESULTS / "logs" / Path(name).name))


def test_expand_braces():
    assert expand_braces("a_{x,y}_b{1,2}.json") == ["a_x_b1.json", "a_x_b2.json", "a_y_b1.json", "a_y_b2.json"]
    assert expand_braces("plain.json") == ["plain.json"]


def test_cited_paths_reads_names_and_skips_placeholders():
    text = ("see `layer_{a,b}_1.json`, `scripts/gpu_ci.sh`, `benchmarks/results/layer_<gpu>_<date>.json`, "
            "`..._s18e_...`, `$OUT/x.json`, `--iters` and `kernels/ws_gemm.py`")
    assert cited_paths(text) == ["layer_a_1.json", "layer_b_1.json", "scripts/gpu_ci.sh", "kernels/ws_gemm.py"]
    assert _exists("kernels/ws_gemm.py") and _exists("scripts/gpu_ci.sh")
    assert not _exists("layer_a_1.json")


@pytest.mark.parametrize("doc", DOCS)
def test_doc_cites_existing_files(doc):
    names = cited_paths((ROOT / doc).read_text())
    assert names, f"{doc} cites no files: the reader broke, not the doc"
    missing = sorted({n for n in names if not _exists(n)})
    assert not missing, f"{doc} cites files that do not exist: {missing}"


def test_readme_modules_exist():
    """Each ``python -m X`` in README names a module of this repository or of its dependencies."""
    import importlib.util

    mods = set(re.findall(r"python3? -m ([A-Za-z_][\w.]*)", (ROOT / "README.md").read_text()))
    assert {"compare.layer", "compare.train", "titan_megamoe.launch"} <= mods
    missing = sorted(m for m in mods if importlib.util.find_spec(m) is None)
    assert not missing, f"README runs modules that do not exist: {missing}"
