"""python -m compare.capture_routing: top-k expert ids of a real model's MoE layers, for replay.

    python -m compare.capture_routing --out FILE.pt [--layer N] [--checkpoint DCP_DIR]
        [--flavor debugmodel_moe] [--batches 4] [--batch-size 2] [--seq-len 2048] [--device auto]

Builds TorchTitan 0.2.2's Qwen3 ``debugmodel_moe`` (random init, or the model weights of a DCP
checkpoint folder written by TorchTitan, e.g. ``outputs/checkpoint/step-1000``), runs it without
gradients on batches of the embedded ``python_stdlib`` corpus (tokenizer
``titan_megamoe.data.DEFAULT_TOKENIZER_DIR``; both built by ``titan_megamoe.data.prepare.prepare``
when missing) and saves what the routers chose. Replay the file with
``python -m compare.layer --routings replay:FILE.pt [--replay-layer layers.N.moe]``.

File format (``torch.save``; loadable with ``weights_only=True``)::

    {"layers.0.moe": ids (T, K) int16 (int32 if E > 32767),   # one entry per captured MoE layer
     ...,                                                     # tensors are layers, in model order
     "num_experts": E, "top_k": K, "tokens": T, "source": "how it was captured"}
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Iterable

import torch
from torch import Tensor, nn

__all__ = ["capture_topk", "moe_layers", "main"]


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of every TorchTitan ``MoE`` (MegaMoE included: it subclasses MoE)."""
    from torchtitan.models.moe.moe import MoE

    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def capture_topk(model: nn.Module, batches: Iterable, *, layers: list[str] | None = None,
                 source: str = "") -> dict:
    """Run ``model(batch)`` for each batch (no grad) and record every MoE router's selected ids.

    Registers a forward hook on each ``<moe>.router`` (output index 1 is the (T, K) selected
    expert ids, T = batch * seq) and removes it on return.

    Args:
        model: any module containing TorchTitan ``MoE`` / ``MegaMoE`` layers.
        batches: iterable of inputs, each passed as ``model(batch)``.
        layers: FQNs of the MoE modules to capture (default: all).
        source: description stored under "source".

    Returns:
        {fqn: ids (T_total, K) int16 / int32 on CPU, ..., "num_experts": E, "top_k": K,
         "tokens": T_total, "source": source}

    Raises:
        ValueError: no MoE layer in ``model`` (or none matching ``layers``), or no batch.
    """
    found = moe_layers(model)
    if layers is not None:
        unknown = sorted(set(layers) - {n for n, _ in found})
        if unknown:
            raise ValueError(f"unknown MoE layers {unknown}; model has {[n for n, _ in found]}")
        found = [(n, m) for n, m in found if n in layers]
    if not found:
        raise ValueError("capture_topk: the model has no TorchTitan MoE layer")
    num_experts = found[0][1].router.num_experts
    top_k = found[0][1].router.top_k
    store: dict[str, list[Tensor]] = {n: [] for n, _ in found}
    handles = []

    def make_hook(name: str):
        def hook(_mod, _inp, out):
            store[name].append(out[1].detach().to("cpu", torch.int32))

        return hook

    try:
        for name, moe in found:
            handles.append(moe.router.register_forward_hook(make_hook(name)))
        n_batches = 0
        with torch.no_grad():
            for batch in batches:
                model(batch)
                n_batches += 1
    finally:
        for h in handles:
            h.remove()
    if n_batches == 0:
        raise ValueError("capture_topk: no batch given")
    dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
    out: dict = {name: torch.cat(chunks, 0).to(dtype) for name, chunks in store.items()}
    first = next(iter(out.values()))
    out.update(num_experts=int(num_experts), top_k=int(top_k), tokens=int(first.shape[0]),
               source=source)
    return out


def _token_batches(tokenizer_dir: str, data_dir: str, n: int, bsz: int, seq: int, device):
    """``n`` (bsz, seq) int64 batches of the corpus, documents joined in corpus order."""
    from tokenizers import Tokenizer

    from titan_megamoe.data.corpus import iter_corpus_texts

    tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    need = n * bsz * seq
    ids: list[int] = []
    for text in iter_corpus_texts(data_dir):
        ids.extend(tok.encode(text).ids)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(f"corpus {data_dir} has {len(ids)} tokens, {need} needed")
    flat = torch.tensor(ids[:need], dtype=torch.int64).view(n, bsz, seq)
    return [b.to(device) for b in flat], tok.get_vocab_size()


def main(argv: list[str] | None = None) -> int:
    from titan_megamoe.data import DEFAULT_DATA_DIR, DEFAULT_TOKENIZER_DIR

    p = argparse.ArgumentParser(prog="python -m compare.capture_routing",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output .pt file")
    p.add_argument("--layer", type=int, default=None, help="capture only transformer block N")
    p.add_argument("--checkpoint", default=None, help="TorchTitan DCP checkpoint folder (model weights)")
    p.add_argument("--flavor", default="debugmodel_moe", help="Qwen3 flavor (default %(default)s)")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--tokenizer-dir", default=DEFAULT_TOKENIZER_DIR)
    args = p.parse_args(argv)

    import dataclasses

    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    import titan_megamoe  # noqa: F401 - registers the reduced flavors
    from titan_megamoe.data.prepare import prepare
    from titan_megamoe.testing import stock_histc_on_cpu

    if args.flavor not in qwen3_args:
        p.error(f"argument --flavor: unknown flavor {args.flavor!r}; allowed: {', '.join(qwen3_args)}")
    margs = dataclasses.replace(qwen3_args[args.flavor])
    if not margs.moe_enabled:
        p.error(f"argument --flavor: {args.flavor} has no MoE layers")
    if min(args.batches, args.batch_size, args.seq_len) <= 0:
        p.error("arguments --batches / --batch-size / --seq-len must be > 0")
    if args.seq_len > margs.max_seq_len:
        p.error(f"argument --seq-len: {args.seq_len} > the flavor's max_seq_len {margs.max_seq_len}")
    if args.layer is not None and not 0 <= args.layer < margs.n_layers:
        p.error(f"argument --layer: must be in [0, {margs.n_layers}), got {args.layer}")
    if args.checkpoint is not None:
        from pathlib import Path

        if not Path(args.checkpoint).is_dir():
            p.error(f"argument --checkpoint: {args.checkpoint!r} is not a directory")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")

    prepare(args.data_dir, args.tokenizer_dir)
    batches, vocab = _token_batches(args.tokenizer_dir, args.data_dir, args.batches, args.batch_size,
                                    args.seq_len, device)
    if vocab > margs.vocab_size:
        p.error(f"tokenizer vocab {vocab} > the flavor's vocab_size {margs.vocab_size}")
    if not use_cuda:  # stock grouped-mm padding is a Triton GPU kernel
        margs.moe_args = dataclasses.replace(margs.moe_args, use_grouped_mm=False)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Qwen3Model(margs)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    what = f"Qwen3 {args.flavor}, random init (seed {args.seed})"
    if args.checkpoint is not None:
        import torch.distributed.checkpoint as dcp

        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=args.checkpoint)
        model.load_state_dict(sd)
        what = f"Qwen3 {args.flavor}, weights from {args.checkpoint}"
    model.eval()
    names = [n for n, _ in moe_layers(model)]
    layers = None if args.layer is None else [n for n in names if n.startswith(f"layers.{args.layer}.")]
    source = (f"{what}; {args.batches} x {args.batch_size} x {args.seq_len} tokens of "
              f"{args.data_dir}; device {device.type}")
    ctx = stock_histc_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
    with ctx:
        result = capture_topk(model, batches, layers=layers, source=source)
    torch.save(result, args.out)
    n_layers = sum(isinstance(v, Tensor) for v in result.values())
    print(f"wrote {args.out}: {n_layers} layer(s) x {result['tokens']} tokens, top_k {result['top_k']} "
          f"of {result['num_experts']} experts ({source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
