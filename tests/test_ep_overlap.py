"""compare.ep_overlap --tiny on CPU: 2 emulated ranks (interpreter), every measurement of the record
present and consistent; the overlap formula and the NVLink byte model on a worked example."""

from __future__ import annotations

import json
import math

import pytest
import torch

from compare.ep_overlap import SCHEMA, main, nvlink_bytes, overlap_fraction


def test_tiny_emulated_run(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CPU smoke run (emulated ranks, interpreter); on GPUs see scripts/gpu_ep_overlap.sh")
    out = tmp_path / "ovl.json"
    assert main(["--tiny", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| overlap fwd |" in text and "| full fwd ms |" in text and "phases (ms" in text and "profile rank 0" in text
    data = json.loads(out.read_text())
    assert data["schema"] == SCHEMA
    run = data["run"]
    for k in ("gpu", "torch", "triton", "git_rev", "git_dirty", "date_utc", "command", "hostnames"):
        assert k in run, k
    assert run["command"].startswith("python -m compare.ep_overlap --tiny") and run["emulated_ranks"] == 2
    (rec,) = data["records"]
    assert rec["status"] == "ok", rec["reason"]
    assert rec["ep"] == 2 and rec["emulated"] and rec["mode"] == "v1" and rec["precision"] == "bf16"
    for k in ("full_fwd", "full_fwdbwd", "comm_fwd", "comm_fwdbwd", "compute_fwd", "compute_fwdbwd"):
        assert rec[k]["ms"] > 0, k
    assert rec["overlap_fwd"] == pytest.approx(overlap_fraction(
        rec["full_fwd"]["ms"], rec["comm_fwd"]["ms"], rec["compute_fwd"]["ms"]))
    fwd = [k for k in rec["phases"] if k.startswith("fwd.")]
    bwd = [k for k in rec["phases"] if k.startswith("bwd.")]
    assert fwd[0] == "fwd.barrier0" and fwd[-1] == "fwd.combine_sum" and len(fwd) == 9
    assert "bwd.gemm1_dgrad" in bwd and bwd[-1] == "bwd.combine_sum"
    assert rec["profile_rank0"]["top"] and rec["profile_rank0"]["kernel_ms"] > 0


def test_overlap_formula_and_byte_model():
    assert overlap_fraction(10.0, 4.0, 6.0) == 0.0  # back to back
    assert overlap_fraction(6.0, 4.0, 6.0) == 1.0  # comm fully hidden
    assert overlap_fraction(12.0, 4.0, 6.0) == -0.5  # slower than the parts (waits, gaps)
    # R=2, T=2, E_l=2, K=2: rank 0's tokens -> experts {0,1} (local), {1,2} (one row to rank 1);
    # rank 1's tokens -> {0,3} (one row to rank 0), {2,3} (local)
    ids = torch.tensor([[0, 1], [1, 2], [0, 3], [2, 3]])
    nb = nvlink_bytes(ids, R=2, T=2, D=8, e_l=2)
    # each rank sends 1 x row (bf16) and 1 combine row back (bf16, comm/workspace.py COMBINE_DTYPE);
    # bwd: x + dy, dx back
    assert nb == {"fwd": 8 * 2 + 8 * 2, "bwd": 8 * 4 + 8 * 2, "fwdbwd": 8 * 4 + 8 * 6}
    # the FP8 x payload of "fp8": D e4m3 bytes + D / 128 fp32 scales per row, the rest unchanged
    nb8 = nvlink_bytes(ids, R=2, T=2, D=256, e_l=2, x_payload="fp8")
    assert nb8["fwd"] == (256 + 8) + 256 * 2 and nb8["bwd"] == 256 * 4 + 256 * 2


def test_tiny_emulated_run_fp8(tmp_path, capsys):
    """--precisions fp8 end to end (ops/ep_fp8_backend's steps, FP8 weights quantized once), modes v1
    (FP8 x payload) and v1b (bf16 x payload): the records say fp8 and their payload, every time is finite
    and positive, the phases carry the FP8 passes' labels in order (quant_x only with the bf16 payload:
    with the FP8 one it is part of the dispatch)."""
    if torch.cuda.is_available():
        pytest.skip("CPU smoke run (emulated ranks, interpreter); on GPUs see scripts/gpu_ep_overlap.sh")
    out = tmp_path / "ovl_fp8.json"
    # D, F multiples of 128 (FP8 scale blocks); 1 expert per rank, top-1, 4 tokens per rank: the least
    # interpreter work that still crosses ranks. Mode v2 rides along to show the skipped record.
    argv = ["--tiny", "--shapes", "custom:128,128,2,1", "--tokens", "4", "--precisions", "fp8", "--modes", "v1,v1b,v2",
            "--profile-iters", "0", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| precision |" in text and "| fp8 | v1 |" in text and "phases (ms" in text
    data = json.loads(out.read_text())
    rec, rec_b, skipped = data["records"]
    assert skipped["precision"] == "fp8" and skipped["mode"] == "v2" and skipped["status"] == "skipped"
    bwd = ["bwd.barrier0", "bwd.dispatch", "bwd.barrier1", "bwd.placed_rows", "bwd.quant_dout", "bwd.gemm2_dgrad",
           "bwd.quant_dgate_up", "bwd.quant_dout_T", "bwd.wgrad_w2", "bwd.quant_x_T", "bwd.wgrad_w13",
           "bwd.gemm1_dgrad", "bwd.dscore_push", "bwd.combine_push", "bwd.barrier2", "bwd.combine_sum"]
    from titan_megamoe.ops import fp8_backend

    if fp8_backend._WGRAD == "bf16":  # TITAN_MEGAMOE_FP8_WGRAD=bf16: no transposed quantization passes
        bwd = [p for p in bwd if p not in ("bwd.quant_dout_T", "bwd.quant_x_T")]
    for r, mode, payload in ((rec, "v1", "fp8"), (rec_b, "v1b", "bf16")):
        assert r["status"] == "ok", r["reason"]
        assert r["precision"] == "fp8" and r["mode"] == mode and r["x_payload"] == payload
        assert "quantized once" in r["weights"]
        for k in ("full_fwd", "full_fwdbwd", "comm_fwd", "comm_fwdbwd", "compute_fwd", "compute_fwdbwd"):
            assert math.isfinite(r[k]["ms"]) and r[k]["ms"] > 0, k
        assert all(math.isfinite(v) and v >= 0 for v in r["phases"].values()), r["phases"]
        quant_x = ["fwd.quant_x"] if payload == "bf16" else []
        assert list(r["phases"]) == [
            "fwd.barrier0", "fwd.dispatch", "fwd.barrier1", "fwd.layout", *quant_x, "fwd.gemm1", "fwd.gemm2",
            "fwd.combine_push", "fwd.barrier2", "fwd.combine_sum", *bwd]
        assert r["profile_rank0"] is None
    assert rec["nvlink_bytes_per_rank"]["fwd"] < rec_b["nvlink_bytes_per_rank"]["fwd"]


def test_precision_errors(capsys):
    with pytest.raises(SystemExit):
        main(["--tiny", "--precisions", "fp16"])
    assert "allowed: bf16, fp8, fp8_bwd" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the tiny default shape has D = 16: no 128-wide scale block
        main(["--tiny", "--precisions", "fp8"])
    assert "multiples of 128" in capsys.readouterr().err


def test_tiny_run_as_a_user_types_it(tmp_path):
    """``python -m compare.ep_overlap --tiny`` in a fresh process without TRITON_INTERPRET (README's CPU command;
    the test session's conftest sets the flag, which hid that the harness set it after triton was imported)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "tiny.json"
    run = subprocess.run([sys.executable, "-m", "compare.ep_overlap", "--tiny", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    assert records and all(r.get("status") != "error" for r in records), [r.get("reason") for r in records]
