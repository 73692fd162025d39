"""A small byte-level BPE tokenizer trained on a JSONL corpus, in the files TorchTitan 0.2.2 loads.

The output directory is an ordinary ``--model.hf_assets_path`` for
``torchtitan.components.tokenizer.HuggingFaceTokenizer``:

    <out_dir>/
      tokenizer.json          the ``tokenizers`` model: BPE + ByteLevel pre-tokenizer / decoder
      tokenizer_config.json   bos_token / eos_token and their ids (``added_tokens_decoder``)
      provenance.json         vocab size, corpus manifest, ``tokenizers`` version (informational)

Special tokens come first in the vocabulary (``<|begin_of_text|>`` = 0, ``<|end_of_text|>`` = 1),
then the 256 byte symbols, then merges, so every id is < ``vocab_size``. The default 2000 fits the
Qwen3 ``debugmodel_moe`` embedding (2048 rows; TorchTitan does not resize embeddings to the
tokenizer). Training on the full CPython 3.11 stdlib corpus (31 MB) takes about 7 s on 2 cores,
so no training-byte cap is applied.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from titan_megamoe.data.corpus import iter_corpus_texts, read_manifest

__all__ = ["BOS_TOKEN", "EOS_TOKEN", "SPECIAL_TOKENS", "tokenizer_is_complete", "train_stdlib_tokenizer"]

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)  # ids 0, 1 in this order
_NUM_BYTE_SYMBOLS = 256
_REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_is_complete(tokenizer_dir: str | os.PathLike) -> bool:
    """True if ``tokenizer_dir`` holds both files TorchTitan needs (ours or a user's)."""
    return all((Path(tokenizer_dir) / name).is_file() for name in _REQUIRED_FILES)


def train_stdlib_tokenizer(
    corpus_dir: str | os.PathLike, out_dir: str | os.PathLike, vocab_size: int = 2000
) -> Path:
    """Train a byte-level BPE on every document of ``corpus_dir`` and write it to ``out_dir``; cached.

    The vocabulary holds exactly ``vocab_size`` entries including the two special tokens (fewer
    only if the corpus runs out of pairs to merge). Byte-level: all 256 byte symbols are in the
    alphabet whether or not the corpus uses them, so any text encodes without an unknown token and
    ``decode(encode(text)) == text``. The result is deterministic for a given corpus (documents are
    read in sorted-shard, line order; ``tokenizers`` breaks merge ties by pair, not by hash order).

    Written atomically (temp directory next to ``out_dir``, then rename). If ``out_dir`` already
    holds ``tokenizer.json`` and ``tokenizer_config.json`` it is returned untouched.

    Args:
        corpus_dir: a directory of ``*.jsonl`` files with a ``"text"`` field (see ``corpus.py``).
        out_dir: tokenizer directory to create (its parent is created if needed).
        vocab_size: total vocabulary size, special tokens included; >= 258.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: ``vocab_size`` cannot hold the 256 byte symbols plus the special tokens.
        FileNotFoundError: ``corpus_dir`` holds no ``*.jsonl`` file.
        FileExistsError: ``out_dir`` exists but lacks one of the two tokenizer files.
    """
    from tokenizers import Tokenizer, __version__ as tokenizers_version
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    out_dir = Path(out_dir)
    if tokenizer_is_complete(out_dir):
        return out_dir
    if out_dir.exists():
        raise FileExistsError(
            f"{str(out_dir)!r} exists but lacks {' or '.join(_REQUIRED_FILES)}; "
            "delete it or choose another directory"
        )
    min_vocab = _NUM_BYTE_SYMBOLS + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs >= {min_vocab} "
            f"(256 byte symbols + {len(SPECIAL_TOKENS)} special tokens)"
        )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    num_docs = 0

    def texts():
        nonlocal num_docs
        for text in iter_corpus_texts(corpus_dir):
            num_docs += 1
            yield text

    tokenizer.train_from_iterator(texts(), trainer)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        # TorchTitan's dataset passes add_bos/add_eos explicitly; HF users get plain encodes.
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(tok)): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for tok in SPECIAL_TOKENS
        },
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }
    provenance = {
        "vocab_size": tokenizer.get_vocab_size(),
        "requested_vocab_size": vocab_size,
        "num_train_docs": num_docs,
        "corpus_dir": str(corpus_dir),
        "corpus_manifest": _manifest_summary(corpus_dir),
        "tokenizers_version": tokenizers_version,
    }

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp_dir, 0o755)  # mkdtemp makes it 0700; the result is shared like any dataset
    try:
        tokenizer.save(str(tmp_dir / "tokenizer.json"))
        (tmp_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        (tmp_dir / "provenance.json").write_text(json.dumps(provenance, indent=2), encoding="utf-8")
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            # Another process renamed its copy first; same corpus, so the same tokenizer.
            if not tokenizer_is_complete(out_dir):
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _manifest_summary(corpus_dir: str | os.PathLike) -> dict | None:
    """The corpus manifest minus its shard list (kept short), or None for a user corpus."""
    manifest = read_manifest(corpus_dir)
    if manifest is None:
        return None
    return {k: v for k, v in manifest.items() if k != "files"}
