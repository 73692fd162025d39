"""The embedded default corpus: the Python standard library's own ``*.py`` sources as JSONL.

Every Python install carries a few tens of MB of real, varied, permissively licensed text (about
1,800 files / 31 MB for CPython 3.11), so a training run can start with no download at all. This
module turns those files into an ordinary on-disk dataset that TorchTitan's ``datasets``-based
loader reads like any user corpus.

Layout of a corpus directory (all written by :func:`build_stdlib_corpus`):

    <out_dir>/
      python_stdlib-00000.jsonl   one document per line: {"text": <whole file content>}
      python_stdlib-00001.jsonl   ... (a new shard every ``shard_bytes`` of text)
      _COMPLETE                   JSON manifest; written last, so its presence means "complete"

Any directory of ``*.jsonl`` files whose lines have a ``"text"`` field is a valid corpus for the
``python_stdlib`` dataset entry (see ``titan_megamoe.data``), so users can point
``[training] dataset_path`` at their own data.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

__all__ = [
    "COMPLETE_MARKER",
    "build_stdlib_corpus",
    "corpus_files",
    "iter_corpus_texts",
    "read_manifest",
]

COMPLETE_MARKER = "_COMPLETE"
_SHARD_PREFIX = "python_stdlib"
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_FORMAT_VERSION = 1


def _source_files(src_root: Path) -> list[tuple[str, Path]]:
    """All ``*.py`` files under ``src_root`` as ``(relative posix path, absolute path)``.

    Sorted by the relative posix path (not by walk order, which depends on the file system) so the
    corpus is byte-identical across machines with the same sources. Directories named in
    ``_EXCLUDED_DIRS`` are pruned at any depth: third-party packages are not the stdlib, and
    ``__pycache__`` holds bytecode only.
    """
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(src_root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(src_root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def read_manifest(corpus_dir: str | os.PathLike) -> dict | None:
    """The ``_COMPLETE`` manifest of a corpus directory, or None if the directory is not complete.

    Manifest keys: ``num_docs`` (int), ``num_bytes`` (int, UTF-8 bytes of document text, not of the
    JSONL encoding), ``num_skipped_non_utf8`` (int), ``src_root`` (str), ``max_bytes`` (int | None),
    ``files`` (shard file names, in order), ``format_version`` (int).
    """
    marker = Path(corpus_dir) / COMPLETE_MARKER
    if not marker.is_file():
        return None
    return json.loads(marker.read_text(encoding="utf-8"))


def corpus_files(corpus_dir: str | os.PathLike) -> list[Path]:
    """Sorted ``*.jsonl`` files directly inside ``corpus_dir``.

    Works for any corpus directory, ours or a user's (no manifest needed).

    Raises:
        FileNotFoundError: ``corpus_dir`` is not a directory or holds no ``*.jsonl`` file.
    """
    corpus_dir = Path(corpus_dir)
    if not corpus_dir.is_dir():
        raise FileNotFoundError(f"corpus directory {str(corpus_dir)!r} does not exist")
    files = sorted(corpus_dir.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"corpus directory {str(corpus_dir)!r} holds no *.jsonl file; expected JSON lines "
            'with a "text" field (build one with titan_megamoe.data.prepare)'
        )
    return files


def iter_corpus_texts(corpus_dir: str | os.PathLike):
    """Yield the ``"text"`` field of every line of every shard, in sorted-file then line order.

    Raises:
        FileNotFoundError: as :func:`corpus_files`.
        KeyError: a line has no ``"text"`` field.
    """
    for path in corpus_files(corpus_dir):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)["text"]


def build_stdlib_corpus(
    out_dir: str | os.PathLike,
    src_root: str | os.PathLike | None = None,
    max_bytes: int | None = None,
    *,
    shard_bytes: int = 16 * 2**20,
) -> Path:
    """Write the ``*.py`` files under ``src_root`` to JSONL shards in ``out_dir``; cached.

    Documents are whole files, in sorted relative-path order; files that are not valid UTF-8 are
    skipped (and counted in the manifest). With ``max_bytes``, files are taken in that order while
    the running total of text bytes stays <= ``max_bytes`` (the first file that would exceed it ends
    the corpus), so a capped corpus is a prefix of the full one.

    Atomicity: everything is written into a fresh temporary directory next to ``out_dir`` and
    renamed onto it, so ``out_dir`` either does not exist or is complete, also when several ranks
    build it at once (the losers of the rename discard their copy).

    Caching: if ``out_dir`` already holds a ``_COMPLETE`` marker it is returned as is, whatever
    ``src_root`` / ``max_bytes`` are now (delete the directory to rebuild).

    Args:
        out_dir: corpus directory to create (its parent is created if needed).
        src_root: directory to scan; default ``sysconfig.get_paths()["stdlib"]`` of this interpreter.
        max_bytes: optional cap on the total UTF-8 bytes of document text.
        shard_bytes: start a new ``.jsonl`` shard once the current one holds this many text bytes.

    Returns:
        ``Path(out_dir)``.

    Raises:
        FileNotFoundError: ``src_root`` is not a directory, or it holds no UTF-8 ``*.py`` file.
        ValueError: ``max_bytes`` is smaller than the first file, or ``shard_bytes`` < 1.
        FileExistsError: ``out_dir`` exists but has no ``_COMPLETE`` marker (never overwritten).
    """
    out_dir = Path(out_dir)
    if read_manifest(out_dir) is not None:
        return out_dir
    if out_dir.exists():
        raise FileExistsError(
            f"{str(out_dir)!r} exists but is not a complete corpus (no {COMPLETE_MARKER} marker); "
            "delete it or choose another directory"
        )
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
    src_root = Path(src_root if src_root is not None else sysconfig.get_paths()["stdlib"])
    if not src_root.is_dir():
        raise FileNotFoundError(f"source root {str(src_root)!r} is not a directory")
    sources = _source_files(src_root)
    if not sources:
        raise FileNotFoundError(f"no *.py file found under {str(src_root)!r}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp_dir, 0o755)  # mkdtemp makes it 0700; the result is shared like any dataset
    try:
        manifest = _write_shards(tmp_dir, sources, max_bytes, shard_bytes)
        manifest.update(src_root=str(src_root), max_bytes=max_bytes)
        if manifest["num_docs"] == 0:
            if manifest["num_skipped_non_utf8"] == len(sources):
                raise FileNotFoundError(f"no UTF-8 *.py file found under {str(src_root)!r}")
            raise ValueError(f"max_bytes={max_bytes} is smaller than the first source file")
        # The marker goes last: a reader that sees it sees every shard.
        (tmp_dir / COMPLETE_MARKER).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            # Another process renamed its copy first; theirs is as good as ours.
            if read_manifest(out_dir) is None:
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _write_shards(
    tmp_dir: Path, sources: list[tuple[str, Path]], max_bytes: int | None, shard_bytes: int
) -> dict:
    """Write the documents of ``sources`` into shards in ``tmp_dir``; return the manifest counts."""
    files: list[str] = []
    num_docs = num_bytes = num_skipped = 0
    shard = None
    shard_fill = 0
    try:
        for _, path in sources:
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                num_skipped += 1  # e.g. Latin-1 test fixtures in Lib/test
                continue
            if max_bytes is not None and num_bytes + len(raw) > max_bytes:
                break
            if shard is None or shard_fill >= shard_bytes:
                if shard is not None:
                    shard.close()
                files.append(f"{_SHARD_PREFIX}-{len(files):05d}.jsonl")
                shard = open(tmp_dir / files[-1], "w", encoding="utf-8")
                shard_fill = 0
            # ensure_ascii keeps U+2028 etc. escaped, so every reader splits lines the same way.
            shard.write(json.dumps({"text": text}) + "\n")
            shard_fill += len(raw)
            num_docs += 1
            num_bytes += len(raw)
    finally:
        if shard is not None:
            shard.close()
    return {
        "format_version": _FORMAT_VERSION,
        "num_docs": num_docs,
        "num_bytes": num_bytes,
        "num_skipped_non_utf8": num_skipped,
        "files": files,
    }
