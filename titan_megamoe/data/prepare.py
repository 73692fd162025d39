"""Build the embedded default corpus and tokenizer (both cached).

    python -m titan_megamoe.data.prepare [--data-dir data/python_stdlib]
        [--tokenizer-dir assets/python_stdlib_tokenizer] [--vocab-size 2000]

Paths are relative to the working directory, like TorchTitan's ``dataset_path`` and
``hf_assets_path``, so run it from the directory you launch training from.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from titan_megamoe.data import DEFAULT_DATA_DIR, DEFAULT_TOKENIZER_DIR, DEFAULT_VOCAB_SIZE
from titan_megamoe.data.corpus import build_stdlib_corpus, iter_corpus_texts, read_manifest
from titan_megamoe.data.tokenizer import train_stdlib_tokenizer

__all__ = ["PreparedAssets", "prepare", "main"]


@dataclass(frozen=True)
class PreparedAssets:
    """What :func:`prepare` produced (or found cached).

    ``num_bytes`` is UTF-8 bytes of document text; ``seconds`` is wall time of this call.
    """

    data_dir: Path
    tokenizer_dir: Path
    num_docs: int
    num_bytes: int
    vocab_size: int
    seconds: float


def prepare(
    data_dir: str = DEFAULT_DATA_DIR,
    tokenizer_dir: str = DEFAULT_TOKENIZER_DIR,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> PreparedAssets:
    """Build the stdlib corpus in ``data_dir`` (if missing), then its tokenizer in ``tokenizer_dir``.

    ``data_dir`` may be a user corpus (any directory of ``*.jsonl`` with a ``"text"`` field): it is
    only built when it does not exist. ``vocab_size`` only matters when the tokenizer is trained.

    Raises:
        as :func:`build_stdlib_corpus` and :func:`train_stdlib_tokenizer`.
    """
    from tokenizers import Tokenizer

    start = time.perf_counter()
    if not Path(data_dir).exists():
        build_stdlib_corpus(data_dir)
    train_stdlib_tokenizer(data_dir, tokenizer_dir, vocab_size=vocab_size)
    manifest = read_manifest(data_dir)
    if manifest is not None:
        num_docs, num_bytes = manifest["num_docs"], manifest["num_bytes"]
    else:  # a user corpus without our manifest: count it
        texts = list(iter_corpus_texts(data_dir))
        num_docs, num_bytes = len(texts), sum(len(t.encode("utf-8")) for t in texts)
    vocab = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).get_vocab_size()
    return PreparedAssets(
        data_dir=Path(data_dir),
        tokenizer_dir=Path(tokenizer_dir),
        num_docs=num_docs,
        num_bytes=num_bytes,
        vocab_size=vocab,
        seconds=time.perf_counter() - start,
    )


def main(argv: list[str] | None = None) -> int:
    """CLI entry: parse ``argv``, run :func:`prepare`, print what it produced; returns 0."""
    parser = argparse.ArgumentParser(
        prog="python -m titan_megamoe.data.prepare", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="corpus dir (default %(default)s)")
    parser.add_argument(
        "--tokenizer-dir", default=DEFAULT_TOKENIZER_DIR, help="tokenizer dir (default %(default)s)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="total vocab incl. special tokens (default %(default)s)",
    )
    args = parser.parse_args(argv)
    assets = prepare(args.data_dir, args.tokenizer_dir, args.vocab_size)
    print(f"corpus:     {assets.data_dir.resolve()}  ({assets.num_docs} docs, {assets.num_bytes} bytes)")
    print(f"tokenizer:  {assets.tokenizer_dir.resolve()}  (vocab size {assets.vocab_size})")
    print(f"time:       {assets.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
