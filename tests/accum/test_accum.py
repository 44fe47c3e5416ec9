"""diag.accum: its token file (the token cache's train.bin), the batch loader, FLOPs/MFU/floor,
and one quick sweep on CPU."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from diag.accum import advice as accum_advice
from diag.accum import run_accum
from diag.accum.sweep import COLUMNS, pairs
from diag.config import AccumConfig
from diag.data import BatchLoader, ensure_tokens
from diag.mfu import ModelShape, count_flops, judge_mfu, mfu_from_figures
from diag.mfu.formula import NANOGPT_PEAK


# its module fixture is made once: the file's tests share one xdist worker (make test)
pytestmark = pytest.mark.xdist_group("test_accum")


@pytest.fixture(scope="module")
def result():
    return run_accum(AccumConfig.quick(device="cpu"))


@pytest.fixture(scope="module")
def tiny():
    import torch
    from transformers import LlamaForCausalLM

    from diag.embedded import ensure_assets

    return LlamaForCausalLM.from_pretrained(ensure_assets().model_dir, dtype=torch.float32)


def test_formula_agrees_with_flop_counter_within_5_percent(tiny):
    import torch

    seq = 128
    x = torch.randint(0, tiny.config.vocab_size, (3, seq))
    y = torch.randint(0, tiny.config.vocab_size, (3, seq))
    shape = ModelShape.from_model(tiny, seq)
    counted = count_flops(tiny, x, y) / x.numel()
    assert counted == pytest.approx(shape.flops_per_token, rel=0.05)
    # the attention term is really in what was counted (math SDPA forced): without it the
    # formula would undershoot by 12·L·d·T
    attention = 12 * shape.layers * shape.d_model * seq
    assert counted - 6 * shape.params == pytest.approx(attention, rel=0.1)
    assert all(p.grad is None for p in tiny.parameters())  # the count leaves no gradients


def test_model_shape_counts_tied_head_once_and_skips_lookups():
    gpt2 = ModelShape.named("gpt2-small", seq_len=1024)
    # nanoGPT's "123.65M": every weight but the position embedding; wte is the LM head too
    assert gpt2.params == 123_653_376
    assert (gpt2.layers, gpt2.d_model) == (12, 768)
    assert gpt2.flops_per_token == 6 * 123_653_376 + 12 * 12 * 768 * 1024


def test_seed_h200_figures_give_the_real_mfu_and_flag_nanogpts_peak():
    gpt2 = ModelShape.named("gpt2-small", seq_len=1024)
    table = mfu_from_figures(391_368, gpt2, "NVIDIA H200", tokens_per_step=131_072)
    ours, assumed = table.iloc[0], table.iloc[1]
    assert ours["peak_tflops"] == pytest.approx(989.4)
    assert ours["mfu"] == pytest.approx(0.338, abs=0.002)  # the compiled 64 x 2 row
    assert math.isnan(assumed["mfu"])  # 107% is never printed as an MFU
    assert assumed["ratio_to_peak"] == pytest.approx(1.073, abs=0.002)
    assert assumed["peak_tflops"] == NANOGPT_PEAK / 1e12
    assert "impossible" in assumed["verdict"] and "33.8%" in assumed["verdict"]
    # the floor: a step's FLOPs at 100% of the dense peak
    assert ours["floor_s"] == pytest.approx(gpt2.flops_per_token * 131_072 / 989.4e12)
    assert ours["floor_s"] < ours["seconds_per_step"]


def test_unknown_device_gets_no_mfu_and_a_reason():
    gpt2 = ModelShape(params=1000, layers=1, d_model=8, seq_len=8)
    row = mfu_from_figures(1e6, gpt2, "Acme Tensor 9000", assumed_peak=None).iloc[0]
    assert math.isnan(row["mfu"]) and math.isnan(row["peak_tflops"])
    assert "unknown device 'Acme Tensor 9000'" in row["verdict"]
    mfu, ratio, note = judge_mfu(1e6, 1e6, None, "unknown GPU 'X': no dense bf16 peak")
    assert math.isnan(mfu) and math.isnan(ratio)
    assert note == "no MFU: unknown GPU 'X': no dense bf16 peak"


def test_token_file_is_made_once_keyed_and_decodes_to_the_dataset(tmp_path):
    import json

    from transformers import PreTrainedTokenizerFast

    from diag.data import format_prompt
    from diag.embedded import ensure_assets, synthetic_dataset

    first = ensure_tokens()
    stamp = first.path.stat().st_mtime_ns
    again = ensure_tokens()
    assert again == first and first.path.stat().st_mtime_ns == stamp  # reused, not rewritten
    assert first.dtype == "uint16" and first.vocab_size == 2048
    assert first.path.stat().st_size == 2 * first.tokens
    assets = ensure_assets()
    tok = PreTrainedTokenizerFast.from_pretrained(assets.model_dir)
    ids = np.memmap(first.path, dtype=first.dtype, mode="r")
    end = int(np.argmax(ids == tok.eos_token_id))
    rec = json.loads(assets.dataset.read_text().splitlines()[0])
    prompt, response = format_prompt(rec)  # the token cache's encoding: BOS, prompt, response
    assert tok.decode(ids[:end].tolist(), skip_special_tokens=True) == prompt + response
    other = ensure_tokens(assets.model_dir, synthetic_dataset(tmp_path / "d.jsonl", records=50))
    assert other.path.parent != first.path.parent  # other data: another key, another file


def test_batch_loader_gathers_shifted_windows_prefetched_or_not():
    tokens = ensure_tokens()
    data = tokens.open()
    with BatchLoader(tokens, 4, 32, "cpu", seed=3) as pre, \
            BatchLoader(tokens, 4, 32, "cpu", seed=3, prefetch=False) as plain:
        for _ in range(3):
            (x1, y1), (x2, y2) = pre.next(), plain.next()
            assert x1.shape == (4, 32) and str(x1.dtype) == "torch.int64"
            assert (x1 == x2).all() and (y1 == y2).all()  # prefetch changes timing, not data
            assert (x1[:, 1:] == y1[:, :-1]).all()
    rng = np.random.default_rng(3)  # the same draws, in order: the third batch's windows
    for _ in range(3):
        starts = rng.integers(0, data.size - 33, size=4)
    assert (x2.numpy() == np.stack([data[s:s + 32] for s in starts])).all()


def test_pairs_keep_tokens_per_step():
    cfg = AccumConfig(tokens_per_step=4096, seq_len=256)
    assert pairs(cfg) == [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]
    assert pairs(cfg.replace(micro_batches=[8, 2])) == [(8, 2), (2, 8)]


def test_quick_sweep_rows_add_up(result):
    frame, cfg = result.frame, AccumConfig.quick(device="cpu")
    # one process: rank 0 of 1, nobody to wait for (the columns a DDP run fills)
    assert list(frame.columns[:2]) == ["rank", "node"]
    assert (frame[["rank", "node", "comm_wait_s"]] == 0).all().all()
    assert [c for c in frame.columns if c not in ("rank", "node", "comm_wait_s")] == COLUMNS
    assert (frame["status"] == "ok").all()
    assert set(zip(frame["micro_batch"], frame["grad_accum"])) == set(pairs(cfg))
    assert (frame["micro_batch"] * frame["grad_accum"] * cfg.seq_len == cfg.tokens_per_step).all()
    # cfg.steps screened per point, then rounds for points within noise of the fastest
    for repeats in frame.groupby("micro_batch")["repeat"].apply(sorted):
        assert repeats == list(range(len(repeats))) and len(repeats) >= cfg.steps
    assert np.allclose(frame["tokens_per_s"] * frame["seconds_per_step"], cfg.tokens_per_step)
    assert np.allclose(frame["data_s"] + frame["comm_wait_s"] + frame["compute_s"],
                       frame["seconds_per_step"])
    assert (frame["warmup_s"] > 0).all() and (frame["peak_mem_gb"] > 0).all()
    assert (frame["floor_s"] < frame["seconds_per_step"]).all()
    assert frame["mfu"].between(0, 1, inclusive="right").all()
    assert np.allclose(frame["mfu"], frame["floor_s"] / frame["seconds_per_step"])


def test_summary_mfu_check_and_advice(result):
    summary, check = result.summary, result.mfu
    # the recommended point is the decision's (resolved faster, or the most accumulation kept)
    assert summary["recommended"].sum() == 1
    (decided,) = result.decisions
    assert summary.loc[summary["recommended"], "micro_batch"].iloc[0] == decided.value
    assert decided.samples[0] >= 5 and "samples" in decided.why
    kept = summary.assign(recommended=summary["grad_accum"] == summary["grad_accum"].max())
    assert accum_advice(kept, 10).empty  # nothing resolved faster: no finding to price
    # a point marked faster is priced against the most-accumulating one (marked here: which
    # point the timings favour on a busy box is the decision's business, tested above)
    summary = summary.assign(recommended=summary["grad_accum"] == summary["grad_accum"].min())
    advice = accum_advice(summary, AccumConfig().steps_per_run)
    best = summary[summary["recommended"]].iloc[0]
    worst = summary.loc[summary["grad_accum"].idxmax()]
    assert check.set_index("method")["vs_formula"].between(0.95, 1.05).all()
    assert "measured: CPU fp32 matmul probe" in check["peak"].iloc[0]
    (row,) = advice.itertuples()
    assert row.stage == "compute"
    saved = (worst["seconds_per_step"] - best["seconds_per_step"]) * AccumConfig().steps_per_run
    assert row.seconds_saved == pytest.approx(max(0.0, saved))
    assert f"{int(best['micro_batch'])} x {int(best['grad_accum'])}" in row.evidence
    # priced on another run's compute (what `diag run` ranks): the same fraction of it
    (scaled,) = accum_advice(summary, 10, compute_s=2.0).itertuples()
    fraction = 1 - best["seconds_per_step"] / worst["seconds_per_step"]
    assert scaled.seconds_saved == pytest.approx(max(0.0, 2.0 * fraction))
    assert "shorter steps applied to the run's compute (2 s)" in scaled.evidence


def test_plot_accum_draws_every_point_and_the_floor(result):
    from diag.plots import plot_accum

    oom = pd.DataFrame([{**result.frame.iloc[0].to_dict(), "micro_batch": 999, "grad_accum": 0,
                         "status": "oom", "tokens_per_s": math.nan}])
    fig = plot_accum(pd.concat([result.frame, oom], ignore_index=True))
    rate, step = fig.axes
    assert [t.get_text() for t in rate.get_yticklabels()] == ["2 x 8", "16 x 1", "999 x 0"]
    assert len(rate.patches) == 2 and any("oom" in t.get_text() for t in rate.texts)
    floors = [line for line in step.lines if line.get_label().startswith("floor")]
    assert floors and floors[0].get_xdata()[0] == pytest.approx(result.frame["floor_s"].iloc[0])
    with pytest.raises(ValueError, match="accum sweep"):
        plot_accum(pd.DataFrame())


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_gpt2_small_on_cuda_uses_bf16_the_table_peak_and_counts_flash_attention():
    cfg = AccumConfig(model="gpt2-small", device="cuda", tokens_per_step=8192, seq_len=1024,
                      micro_batches=[2, 8], steps=2, warmup_steps=1)
    result = run_accum(cfg)
    assert (result.frame["status"] == "ok").all()
    check = result.mfu.set_index("method")
    assert (check["amp"] == "bf16").all() and check["peak"].iloc[0].startswith("table:")
    # FlopCounterMode counts the fused CUDA attention kernels itself (no math path forced)
    assert check["vs_formula"].between(0.95, 1.05).all()
    assert result.frame["mfu"].between(0, 1, inclusive="right").all()
    assert (result.frame["peak_mem_gb"] > 0.5).all()  # CUDA allocator high-water mark
