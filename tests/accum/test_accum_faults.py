"""diag.accum under bad input and faults: named ValueErrors, a real OOM point, a token file
from another tokenizer, a peak that makes MFU impossible."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from diag.accum import sweep
from diag.accum.experiment import measure
from diag.config import AccumConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides, field", [
    ({"tokens_per_step": 1000, "seq_len": 64}, "tokens_per_step=1000: not divisible by seq_len=64"),
    ({"tokens_per_step": 1024, "seq_len": 64, "micro_batches": [3]}, "micro_batches: 3 x seq_len"),
    ({"tokens_per_step": 1024, "seq_len": 64, "micro_batches": [32]}, "micro_batches: 32"),
    ({"tokens_per_step": 0}, "tokens_per_step=0"),
    ({"seq_len": -8}, "seq_len=-8"),
    ({"steps": 0}, "steps=0"),
    ({"warmup_steps": -1}, "warmup_steps=-1"),
    ({"micro_batches": [0]}, "micro_batches: 0"),
    ({"model": "gpt2-small", "seq_len": 2048, "tokens_per_step": 2048},
     "seq_len=2048: above the context"),
    ({"seq_len": 4096, "tokens_per_step": 4096}, "seq_len=4096: above the context of model 'tiny'"),
    ({"model": "llama-70b"}, "model='llama-70b': allowed values"),
    ({"dtype": "fp8"}, "dtype='fp8'"),
    ({"compile": True, "warmup_steps": 0}, "warmup_steps=0: compile=True needs"),
])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match="AccumConfig." + field.replace("(", r"\(")):
        AccumConfig(**overrides)


def test_cli_reports_a_bad_size_in_one_line():
    done = subprocess.run([sys.executable, "-m", "diag", "accum", "--quick", "--tokens-per-step",
                           "1000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "AccumConfig.tokens_per_step=1000: not divisible by seq_len=64" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_token_file_from_another_tokenizer_fails_before_training(tmp_path, monkeypatch):
    path = tmp_path / "train.bin"
    np.array([1, 2, 5000, 3] * 64, dtype=np.uint16).tofile(path)  # 5000: past the tiny vocab
    trained = []
    monkeypatch.setattr(sweep, "_train_point", lambda *a, **k: trained.append(a))
    cfg = AccumConfig.quick(device="cpu", token_file=str(path))
    with pytest.raises(ValueError, match=r"holds token id 5000, but the model has 2048 ids"):
        measure(cfg)
    assert not trained
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")  # 3 bytes: not whole uint16 ids
    with pytest.raises(ValueError, match="token_file=.*not a whole number of uint16 ids"):
        measure(cfg.replace(token_file=str(odd)))


def test_mfu_above_100_percent_is_flagged_not_printed():
    # a peak far below what the CPU does: every step computes > 100%, which is never a result
    cfg = AccumConfig.quick(device="cpu", micro_batches=[16], steps=1, warmup_steps=0,
                            peak_tflops=1e-6)
    frame = measure(cfg)[0]
    assert (frame["status"] == "ok").all() and frame["mfu"].isna().all()
    for detail in frame["detail"]:
        assert "not an MFU" in detail and "impossible" in detail
        assert "1e-06 TFLOP/s" in detail and "AccumConfig.peak_tflops" in detail
        assert "FLOPs per token is over-counted" in detail


OOM_SCRIPT = textwrap.dedent("""
    import resource, sys
    from diag.accum import sweep
    from diag.accum.experiment import measure
    from diag.config import AccumConfig
    from diag.data import ensure_tokens

    ensure_tokens()
    headroom = int(float(sys.argv[1]) * 1e9)
    train_point = sweep._train_point

    def capped(*args, **kwargs):
        # the address space capped 0.15 GB above what is mapped as this point starts (model,
        # token map, threads and allocator arenas already counted, whatever they were in this
        # process): like a GPU at its memory edge, a micro-batch whose activations need more
        # than the headroom fails in the allocator, and one that needs less runs. Measured here:
        # micro-batch 8 runs with 0.03 GB, 128 needs 0.3-0.4 GB, so 0.15 leaves margin both ways
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, hard))
        try:
            return train_point(*args, **kwargs)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))

    sweep._train_point = capped
    cfg = AccumConfig(tokens_per_step=8192, seq_len=64, micro_batches=[128, 8], steps=1,
                      warmup_steps=0, device="cpu")
    measure(cfg)[0].to_json(sys.argv[2], orient="records")
""")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_out_of_memory_point_is_a_row_and_the_sweep_goes_on(tmp_path):
    import pandas as pd

    out = tmp_path / "frame.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", OOM_SCRIPT, "0.15", str(out)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    frame = pd.read_json(out, orient="records")
    oom, ok = frame.iloc[0], frame.iloc[1]
    assert (oom["micro_batch"], oom["status"]) == (128, "oom")
    assert "can't allocate memory" in oom["detail"] and math.isnan(oom["seconds_per_step"])
    assert (ok["micro_batch"], ok["grad_accum"], ok["status"]) == (8, 16, "ok")
    assert ok["tokens_per_s"] > 0 and ok["seconds_per_step"] > 0


def test_unknown_gpu_in_the_sweep_leaves_mfu_and_floor_empty_with_the_reason(monkeypatch):
    from diag.machine import device
    from diag.accum.experiment import measure

    # what peak_flops answers on a GPU diag's table does not know (see test_device)
    unknown = device.Peak(None, "unknown GPU 'Acme Tensor 9000': diag has no dense bf16 peak "
                          "for it; pass the peak FLOP/s explicitly", "", False)
    monkeypatch.setattr(device, "peak_flops", lambda *a, **k: unknown)
    cfg = AccumConfig.quick(device="cpu", micro_batches=[16], steps=1, warmup_steps=0)
    frame, mfu, _ = measure(cfg)
    assert (frame["status"] == "ok").all() and (frame["tokens_per_s"] > 0).all()
    assert frame["mfu"].isna().all() and frame["floor_s"].isna().all()
    assert (frame["detail"] == "no MFU: " + unknown.label).all()
    assert mfu["peak_tflops"].isna().all()
