"""Run ``torchtitan.train`` on one host with the embedded default inputs prepared first.

    python -m titan_megamoe.launch --config train_configs/X.toml [--ngpu N] [--steps S]
        [--dry-run] [-- extra torchtitan args]

Steps: check the TOML exists; prepare the stdlib corpus if the job uses ``[training] dataset =
"python_stdlib"`` and the stdlib tokenizer if ``[model] hf_assets_path`` is
``assets/python_stdlib_tokenizer`` (both cached, paths relative to the working directory); then run

    <python> -m torch.distributed.run --standalone --nproc_per_node N -m torchtitan.train
        --job.config_file X.toml [--training.steps S] <extra>

with :data:`LAUNCH_ENV` added to the environment, and return its exit code. ``--dry-run`` prints
the preparation plan, the environment additions and the command, and runs nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from titan_megamoe.data import DATASET_NAME, DEFAULT_DATA_DIR, DEFAULT_TOKENIZER_DIR

__all__ = ["LAUNCH_ENV", "build_command", "check_megamoe_table", "check_megamoe_job", "main", "plan_prepare"]

# Set for every launch, overriding the caller's values.
LAUNCH_ENV = {
    # Inputs are local files; never wait on (or silently use) the Hub.
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    # NVLink multicast (NVLS) is off on the lent machines and unreliable on shared hosts: never use it.
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# TorchTitan 0.2.2 defaults for the keys the plan reads (torchtitan/config/job_config.py).
_TT_DEFAULT_DATASET = "c4_test"
_TT_DEFAULT_HF_ASSETS_PATH = "./tests/assets/tokenizer"


def _read_toml(path: Path) -> dict:
    """Parse ``path`` with tomllib (3.11+) or tomli."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def _cli_override(extra: list[str], flag: str) -> str | None:
    """Value of the last ``--flag V`` / ``--flag=V`` in ``extra`` (TorchTitan CLI overrides TOML)."""
    value = None
    for i, arg in enumerate(extra):
        if arg == flag and i + 1 < len(extra):
            value = extra[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b)


def plan_prepare(toml: dict, extra: list[str]) -> tuple[str | None, bool]:
    """Decide what to prepare for a job: ``(corpus dir to build or None, train default tokenizer?)``.

    The corpus is ``[training] dataset_path`` (default :data:`DEFAULT_DATA_DIR`) when the dataset is
    ``python_stdlib``. The tokenizer is prepared when ``[model] hf_assets_path`` is
    :data:`DEFAULT_TOKENIZER_DIR`; it is always trained from the corpus at :data:`DEFAULT_DATA_DIR`
    so the cached tokenizer does not depend on which job ran first. CLI overrides in ``extra``
    (``--training.dataset``, ``--training.dataset_path``, ``--model.hf_assets_path``) win over the TOML.
    """
    training, model = toml.get("training", {}), toml.get("model", {})
    dataset = _cli_override(extra, "--training.dataset") or training.get("dataset", _TT_DEFAULT_DATASET)
    dataset_path = _cli_override(extra, "--training.dataset_path") or training.get("dataset_path")
    assets = _cli_override(extra, "--model.hf_assets_path") or model.get(
        "hf_assets_path", _TT_DEFAULT_HF_ASSETS_PATH
    )
    corpus = (dataset_path or DEFAULT_DATA_DIR) if dataset.lower() == DATASET_NAME else None
    return corpus, _same_path(assets, DEFAULT_TOKENIZER_DIR)


def build_command(
    config: str | os.PathLike, ngpu: int, steps: int | None, extra: list[str]
) -> list[str]:
    """The torchrun argv for one host: ``ngpu`` ranks of ``torchtitan.train`` on ``config``."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc_per_node", str(ngpu),
        # rank 0's log only: every rank prints the metrics line, and parsers want one per step
        "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
        "-m", "torchtitan.train",
        "--job.config_file", str(config),
    ]  # fmt: skip
    if steps is not None:
        cmd += ["--training.steps", str(steps)]
    return cmd + list(extra)


def _megamoe_settings(toml: dict, extra: list[str]) -> dict | None:
    """The ``[megamoe]`` table with the CLI's ``--megamoe.backend`` / ``--megamoe.precision`` applied (TorchTitan's
    CLI overrides the TOML), or None when there is neither; a non-table ``[megamoe]`` value is returned as is."""
    table = toml.get("megamoe")
    cli = {k: v for k in ("backend", "precision") if (v := _cli_override(extra, f"--megamoe.{k}")) is not None}
    if not cli or (table is not None and not isinstance(table, dict)):
        return table
    return {**(table if isinstance(table, dict) else {}), **cli}


def check_megamoe_table(toml: dict, extra: list[str] = ()) -> str | None:
    """The error in the config's ``[megamoe]`` table (unknown key, bad value, a backend / precision pair not
    built; the CLI's ``--megamoe.backend`` / ``--megamoe.precision`` in ``extra`` applied), or in how the config
    reaches it (``[job] custom_config_module``), or None when it is valid or absent; checked before anything runs
    (a dry run included), so a typo does not wait for a GPU machine.

    Same checks as the trainer's (``titan_megamoe.config.MegaMoEConfig`` and its ``check_available``); model
    converters and parallelism are checked by TorchTitan and the converter at start-up.
    """
    import dataclasses

    from titan_megamoe.config import MegaMoEConfig, MegaMoEConfigError

    table = _megamoe_settings(toml, list(extra))
    if table is None:
        return None
    if not isinstance(table, dict):
        return f"[megamoe] must be a table, got {table!r}"
    if toml.get("megamoe") is not None:  # CLI values alone: TorchTitan checks how they reach its config
        job = toml.get("job") if isinstance(toml.get("job"), dict) else {}
        if job.get("custom_config_module") != "titan_megamoe.config":
            return ("a [megamoe] table needs [job] custom_config_module = \"titan_megamoe.config\" (TorchTitan "
                    f"refuses tables it does not know; got custom_config_module = {job.get('custom_config_module')!r})")
        known = {f.name for f in dataclasses.fields(MegaMoEConfig)}
        unknown = sorted(set(table) - known)
        if unknown:
            return f"unknown [megamoe] key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
    try:
        MegaMoEConfig(**table).check_available()
    except (MegaMoEConfigError, NotImplementedError) as e:
        return str(e)
    return None


def _converters(toml: dict, extra: list[str]) -> list[str]:
    """``[model] converters``, the CLI's ``--model.converters`` winning."""
    model = toml.get("model") if isinstance(toml.get("model"), dict) else {}
    converters = _cli_override(extra, "--model.converters") or model.get("converters", [])
    if isinstance(converters, str):
        converters = [c.strip() for c in converters.split(",") if c.strip()]
    return list(converters)


def _degree(toml: dict, extra: list[str], key: str) -> int:
    """``[parallelism] key`` (default 1), the CLI's ``--parallelism.key`` winning.

    Raises:
        ValueError: the value is not an integer.
    """
    par = toml.get("parallelism") if isinstance(toml.get("parallelism"), dict) else {}
    value = _cli_override(extra, f"--parallelism.{key}")
    value = par.get(key, 1) if value is None else value
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"parallelism.{key} must be an integer, got {value!r}") from None


def check_megamoe_job(toml: dict, ngpu: int, extra: list[str]) -> str | None:
    """The error in a config's converters or ``[parallelism]`` for ``ngpu`` ranks, or None; checked before anything
    runs, a dry run included. CLI overrides in ``extra`` (``--model.converters``, ``--parallelism.<key> N``) win over
    the TOML.

    Refused for every config: an ``expert_parallel_degree`` that does not divide the ranks (TorchTitan's mesh needs
    it too). Refused for a megamoe config (``[model] converters`` with "megamoe"), with the converter's own messages
    where it has them (``converter.check_converters``, ``check_parallelism``): a converter of the MoE grouped GEMMs
    beside megamoe; tensor, expert tensor and pipeline parallelism; an EP degree that does not divide the model
    flavor's expert count (each rank holds whole experts). TorchTitan checks the rest of the mesh at start-up.
    """
    import types

    model = toml.get("model") if isinstance(toml.get("model"), dict) else {}
    converters = _converters(toml, extra)
    try:
        ep = _degree(toml, extra, "expert_parallel_degree")
    except ValueError as e:
        return str(e)
    if ep < 1 or ngpu % ep:  # TorchTitan's mesh needs it too, so stock configs are checked as well
        return (f"parallelism.expert_parallel_degree = {ep} does not divide the {ngpu} rank(s) of this launch "
                f"(--ngpu {ngpu}): launch with --ngpu a multiple of {ep} on a machine with that many GPUs, or "
                f"set an expert_parallel_degree dividing {ngpu}")
    if "megamoe" not in converters:
        return None
    try:
        dims = types.SimpleNamespace(**{k: _degree(toml, extra, f"{name}_parallel_degree") for k, name in
                                        (("tp", "tensor"), ("etp", "expert_tensor"), ("pp", "pipeline"))})
    except ValueError as e:
        return str(e)
    from titan_megamoe.converter import check_converters, check_parallelism
    from titan_megamoe.errors import UnsupportedModelError

    try:
        check_converters(converters)
        check_parallelism(dims)
    except UnsupportedModelError as e:
        return str(e)
    if ep > 1:
        experts = _flavor_experts(_cli_override(extra, "--model.name") or model.get("name"),
                                  _cli_override(extra, "--model.flavor") or model.get("flavor"))
        if experts is not None and experts % ep:
            return (f"parallelism.expert_parallel_degree = {ep} does not divide the {experts} routed experts of "
                    f"{model.get('name')} {model.get('flavor')} (megamoe keeps whole experts per rank): use a "
                    f"divisor of {experts}")
    return None


def describe_job(toml: dict, ngpu: int, extra: list[str]) -> list[str]:
    """What the launch will run, as lines for the user: the MoE implementation (megamoe's backend, precision and EP
    degree, or stock TorchTitan), then warnings for a valid config that is likely not what was meant: megamoe's
    slow ``reference`` backend, a ``[megamoe]`` table without the "megamoe" converter, more ranks than one host
    has. Call after ``check_megamoe_table`` / ``check_megamoe_job`` passed."""
    from titan_megamoe.config import MegaMoEConfig

    converters, ep = _converters(toml, extra), _degree(toml, extra, "expert_parallel_degree")
    table = _megamoe_settings(toml, extra)
    lines = []
    if "megamoe" in converters:
        cfg = MegaMoEConfig(**(table or {}))
        lines.append(f"moe: megamoe, backend {cfg.backend}, precision {cfg.precision}, EP {ep} of {ngpu} rank(s)"
                     + ("" if table is not None else " (no [megamoe] table: its defaults)"))
        if cfg.backend == "reference":
            lines.append('warning: [megamoe] backend "reference" is the pure-PyTorch oracle (correct, but 0.2-0.4x '
                         'stock TorchTitan): set backend = "triton" for the fused kernels')
    else:
        lines.append(f"moe: stock TorchTitan (no \"megamoe\" in [model] converters), EP {ep} of {ngpu} rank(s)")
        if table is not None:
            lines.append(f"warning: the [megamoe] table has no effect: [model] converters = {converters} has no "
                         '"megamoe" (add it to run the fused operator)')
    if ngpu > 8:
        lines.append(f"note: --ngpu {ngpu} starts {ngpu} ranks on this host (torchrun --standalone); for several "
                     "nodes run torchrun yourself, with the env lines this launcher sets")
    return lines


def _flavor_experts(name: str | None, flavor: str | None) -> int | None:
    """The routed expert count of TorchTitan model ``name`` / ``flavor`` (our reduced flavors included), None when
    unknown (TorchTitan then names the model or flavor problem itself at start-up)."""
    if not name or not flavor:
        return None
    try:
        from torchtitan.protocols.train_spec import get_train_spec

        import titan_megamoe  # noqa: F401  (registers the reduced flavors)

        args = get_train_spec(name).model_args[flavor]
        return int(args.moe_args.num_experts)
    except Exception:  # noqa: BLE001 - an unknown model / flavor, or a dense model
        return None


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _default_ngpu() -> int:
    import torch  # here, not at import: `--help` and `--dry-run --ngpu N` stay fast

    return torch.cuda.device_count() or 1


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns the training exit code (0 for ``--dry-run``).

    Raises:
        SystemExit(2): the config file is missing or not valid TOML, or bad launcher arguments.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m titan_megamoe.launch",
        usage="%(prog)s --config X.toml [--ngpu N] [--steps N] [--dry-run] [-- TORCHTITAN_ARGS ...]",
        description="Run torchtitan.train with prepared default inputs.",
        epilog="Arguments after a lone '--' go to torchtitan.train unchanged, e.g. "
               "-- --training.local_batch_size 2 --metrics.log_freq 5",
    )
    parser.add_argument("--config", required=True, help="TorchTitan TOML job config")
    parser.add_argument(
        "--ngpu", type=int, default=None, help="ranks on this host (default: CUDA devices, or 1)"
    )
    parser.add_argument("--steps", type=int, default=None, help="passed as --training.steps")
    parser.add_argument(
        "--dry-run", action="store_true", help="print plan, env and command; run nothing"
    )
    args = parser.parse_args(argv)

    config = Path(args.config)
    if not config.is_file():
        parser.error(f"config file not found: {config} (working directory {Path.cwd()})")
    try:
        toml = _read_toml(config)
    except Exception as e:  # tomllib.TOMLDecodeError or tomli's, whichever was imported
        parser.error(f"config file {config} is not valid TOML: {e}")
    bad = check_megamoe_table(toml, extra)
    if bad:
        parser.error(f"config file {config}: {bad}")
    if args.ngpu is not None and args.ngpu < 1:
        parser.error(f"--ngpu must be >= 1, got {args.ngpu}")
    ngpu = args.ngpu if args.ngpu is not None else _default_ngpu()
    bad = check_megamoe_job(toml, ngpu, extra)
    if bad:
        default = "" if args.ngpu is not None else " (--ngpu was not given: it defaults to the visible CUDA GPUs, or 1)"
        parser.error(f"config file {config}: {bad}{default}")
    corpus_dir, want_tokenizer = plan_prepare(toml, extra)
    cmd = build_command(config, ngpu, args.steps, extra)

    visible = _visible_gpus()
    if ngpu > visible:
        msg = (f"--ngpu {ngpu} but this machine has {visible} CUDA GPU(s) visible: TorchTitan's trainer runs "
               "on CUDA GPUs only, one rank per GPU (use --ngpu <= the GPU count and a config whose parallelism "
               "fits it, e.g. the *_1gpu_* configs on one GPU; --dry-run shows the command without running; on a "
               "machine without GPUs, the CPU test suite is the thing to run)")
        if not args.dry_run:
            parser.error(msg)
        print(f"warning: {msg}")
    for line in describe_job(toml, ngpu, extra):
        print(line if args.dry_run else f"[launch] {line}", flush=True)
    if args.dry_run:
        print(f"prepare corpus: {corpus_dir or '-'}")
        print(f"prepare tokenizer: {DEFAULT_TOKENIZER_DIR if want_tokenizer else '-'}")
        for key, value in LAUNCH_ENV.items():
            print(f"env {key}={value}")
        print("command: " + shlex.join(cmd))
        return 0

    os.environ.update(LAUNCH_ENV)  # also for the prepare step in this process
    if corpus_dir is not None and not Path(corpus_dir).exists():
        from titan_megamoe.data.corpus import build_stdlib_corpus

        print(f"[launch] building corpus in {corpus_dir}", flush=True)
        build_stdlib_corpus(corpus_dir)
    if want_tokenizer:
        from titan_megamoe.data.prepare import prepare

        assets = prepare(DEFAULT_DATA_DIR, DEFAULT_TOKENIZER_DIR)
        print(f"[launch] tokenizer {assets.tokenizer_dir} (vocab {assets.vocab_size})", flush=True)
    print("[launch] " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, env=os.environ.copy()).returncode


if __name__ == "__main__":
    raise SystemExit(main())
