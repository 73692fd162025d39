"""The embedded default training input: the ``python_stdlib`` dataset and its tokenizer.

Both are ordinary TorchTitan inputs that users replace with their own:

* dataset: ``[training] dataset = "python_stdlib"`` reads every ``*.jsonl`` file (``{"text": ...}``
  per line) in ``[training] dataset_path`` (default :data:`DEFAULT_DATA_DIR`, relative to the
  working directory). If that directory does not exist, the loader builds the stdlib corpus there
  first, so a run works without the prepare step.
* tokenizer: ``[model] hf_assets_path = "assets/python_stdlib_tokenizer"``
  (:data:`DEFAULT_TOKENIZER_DIR`), created by ``python -m titan_megamoe.data.prepare`` (or by
  ``python -m titan_megamoe.launch``). The dataset loader cannot create it: TorchTitan builds the
  tokenizer before the dataloader, and a missing path that contains ``assets/tokenizer`` gets
  TorchTitan's (misleading) "deprecated path" error.

Importing this package does no work; :func:`register_datasets` adds the dataset entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from titan_megamoe.data.corpus import build_stdlib_corpus, corpus_files
from titan_megamoe.data.tokenizer import train_stdlib_tokenizer

__all__ = [
    "DATASET_NAME",
    "DEFAULT_DATA_DIR",
    "DEFAULT_TOKENIZER_DIR",
    "DEFAULT_VOCAB_SIZE",
    "build_stdlib_corpus",
    "load_python_stdlib",
    "register_datasets",
    "train_stdlib_tokenizer",
]

DATASET_NAME = "python_stdlib"
DEFAULT_DATA_DIR = "data/python_stdlib"
DEFAULT_TOKENIZER_DIR = "assets/python_stdlib_tokenizer"
DEFAULT_VOCAB_SIZE = 2000  # <= 2048, the Qwen3 debugmodel_moe embedding rows


def load_python_stdlib(path: str):
    """TorchTitan ``DatasetConfig.loader``: the JSONL corpus at ``path`` as a map-style ``Dataset``.

    Builds the stdlib corpus at ``path`` first if ``path`` does not exist (safe when all ranks do
    it at once: see :func:`build_stdlib_corpus`). An existing directory is read as is, so a user
    directory of ``*.jsonl`` files works too. Reads only local files, so it works with
    ``HF_DATASETS_OFFLINE=1``.

    Returns:
        ``datasets.Dataset`` with one row per document and a ``"text"`` column.

    Raises:
        FileNotFoundError: ``path`` exists but holds no ``*.jsonl`` file.
    """
    from datasets import load_dataset

    if not Path(path).exists():
        build_stdlib_corpus(path)
    files = [str(f) for f in corpus_files(path)]
    return load_dataset("json", data_files=files, split="train")


def _sample_text(sample: dict[str, Any]) -> str:
    """TorchTitan ``DatasetConfig.sample_processor``: the document text of one JSONL row."""
    return sample["text"]


def register_datasets() -> None:
    """Add the ``python_stdlib`` entry to TorchTitan 0.2.2's dataset registry; idempotent.

    Writes ``torchtitan.hf_datasets.text_datasets.DATASETS["python_stdlib"]``; calling it again
    replaces the entry with an identical one.
    """
    # Imported here: text_datasets pulls in `datasets`, which this package's import must not do.
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[DATASET_NAME] = DatasetConfig(
        path=DEFAULT_DATA_DIR, loader=load_python_stdlib, sample_processor=_sample_text
    )
