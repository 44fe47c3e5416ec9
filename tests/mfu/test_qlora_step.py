"""The QLoRA step's FLOPs (diag.mfu.qlora) on hand-built tiny models: executed counts what runs
(no input gradient where none is needed, no frozen weight gradient, a recomputed forward twice),
FlopCounterMode agrees with it, the model-FLOPs convention is shown beside it, and MFU divides by
the peak of the precisions the step ran in (no download, no training run)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from diag.machine import device as dev
from diag.mfu import qlora as qmfu
from diag.mfu.formula import ModelShape

D, R, HEADS, T, VOCAB = 8, 2, 2, 4, 16


class Lora(nn.Module):
    """peft's shape: a frozen base layer and trainable adapters, the sum of both paths."""

    def __init__(self) -> None:
        super().__init__()
        self.base_layer = nn.Linear(D, D, bias=False).requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(D, R, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(R, D, bias=False)})

    def forward(self, h):
        return self.base_layer(h) + self.lora_B["default"](self.lora_A["default"](h))


class TinyQLoraLM(nn.Module):
    """A frozen embedding and head around one block (a LoRA projection, causal attention, a
    LoRA output projection, as a Llama layer's attention), recomputed in backward when
    checkpointing."""

    def __init__(self, checkpointing: bool = False, embeddings_need_grad: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D).requires_grad_(False)
        self.proj, self.out = Lora(), Lora()
        self.head = nn.Linear(D, VOCAB, bias=False).requires_grad_(False)
        self.is_gradient_checkpointing = checkpointing
        self._grad_in = embeddings_need_grad  # as peft's enable_input_require_grads does
        self.config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=HEADS,
                                      hidden_size=D, vocab_size=VOCAB)

    def get_input_embeddings(self):
        return self.emb

    def _block(self, h):
        b, t, _ = h.shape
        q = self.proj(h).view(b, t, HEADS, D // HEADS).transpose(1, 2)
        h = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2)
        return self.out(h.reshape(b, t, D))

    def forward(self, input_ids):
        h = self.emb(input_ids)
        if self._grad_in:
            h.requires_grad_(True)
        h = checkpoint(self._block, h, use_reentrant=False) if self.is_gradient_checkpointing \
            else self._block(h)
        return SimpleNamespace(logits=self.head(h))


BASE, A, B, HEAD = 2 * D * D, 2 * D * R, 2 * R * D, 2 * D * VOCAB  # forward FLOPs per token


def test_a_qlora_shape_counts_the_frozen_base_and_the_adapters_apart():
    model = TinyQLoraLM()
    q = qmfu.qlora_shape(model, seq_len=T)
    assert (q.frozen, q.adapters) == (2 * D * D + D * VOCAB, 2 * (D * R + R * D))
    assert q.shape.params == q.frozen + q.adapters and q.shape.layers == 1
    assert (q.shape.d_model, q.shape.seq_len) == (D, T) and not q.checkpointing
    assert q.shape.name == "TinyQLoraLM (nf4 + LoRA)" and q.formula == "6N + 12·L·d·T"
    assert qmfu.qlora_shape(model, T, checkpointing=True).checkpointing
    model.config.head_dim = 8  # heads x head_dim, where the config gives one
    assert qmfu.qlora_shape(model, T).shape.d_model == 16


@pytest.mark.parametrize("embeddings_need_grad", [False, True])
def test_executed_counts_what_backward_computes_and_the_counter_agrees(embeddings_need_grad):
    model = TinyQLoraLM(embeddings_need_grad=embeddings_need_grad)
    counter, run = qmfu.count_step(model, batch_size=3, seq_len=T)
    assert run.forward == 2 * (BASE + A + B) + HEAD
    # the head, the output projection and proj's lora_B always pass a gradient back; proj's
    # base and lora_A only when their input (the embeddings) needs one: the first layer's does
    # not unless checkpointing asks for it
    assert run.input_grads == HEAD + (BASE + A + B) + B + (BASE + A if embeddings_need_grad
                                                           else 0)
    assert run.weight_grads == 2 * (A + B)  # the adapters train; the base and head are frozen
    assert run.attention == 12 * D * T and run.forward_4bit == 0  # no bitsandbytes layer here
    assert counter == run.total  # FlopCounterMode sees every one of those matmuls
    assert dict(run.by_dtype) == {"fp32": run.total}
    assert all(p.grad is None for p in model.parameters())  # the counted step leaves none


def test_a_recomputed_block_runs_its_forward_again_and_its_backward_once():
    model = TinyQLoraLM(checkpointing=True, embeddings_need_grad=True)
    counter, run = qmfu.count_step(model, batch_size=2, seq_len=T)
    # the block's forward twice, less the last adapter matmul: torch stops recomputing once
    # every tensor backward needs is back (the output projection's lora_B input)
    assert run.forward == 4 * (BASE + A + B) - B + HEAD
    assert run.input_grads == HEAD + 2 * (BASE + A + B) and run.weight_grads == 2 * (A + B)
    assert run.attention == 16 * D * T and counter == run.total
    q = qmfu.qlora_shape(model, T)
    assert q.checkpointing and q.formula == "8N + 16·L·d·T"
    # the convention also counts the frozen base's and head's weight gradients: more than ran
    assert q.flops_per_token == 8 * (2 * (D * D + D * R + R * D) + D * VOCAB) + 16 * D * T
    assert q.flops_per_token > run.total


def _executed(**by_dtype: float) -> qmfu.Executed:
    total = sum(by_dtype.values())
    return qmfu.Executed(total * 0.3, total * 0.4, total * 0.1, total * 0.2, total * 0.1,
                         tuple(by_dtype.items()))


def test_the_check_sets_the_counter_with_the_4bit_forward_beside_executed():
    shape = ModelShape(params=100, layers=0, d_model=1, seq_len=1)
    q = qmfu.QLoraShape(shape, frozen=90, adapters=10, checkpointing=False)
    run = qmfu.Executed(200.0, 150.0, 20.0, 0.0, 120.0, (("bf16", 370.0),))
    f = qmfu.qlora_check(q, run, 250.0)
    assert list(f["method"]) == ["model FLOPs 6N + 12·L·d·T", qmfu.EXECUTED,
                                 "FlopCounterMode, one step",
                                 "FlopCounterMode + the 4-bit forward from the Linear4bit shapes"]
    assert list(f["flops_per_token"]) == [600.0, 370.0, 250.0, 370.0]
    assert list(f["flagged"]) == [False, False, False, False]
    assert f["note"].iloc[0] == ("counts the frozen base's weight gradients (180 FLOPs per "
                                 "token), which a QLoRA step never computes")
    assert f["note"].iloc[3] == "counter 1x executed (within 10%)"
    low = qmfu.qlora_check(q, run, 200.0).iloc[3]  # 320 seen of 370
    assert low["flagged"] and "a matmul kernel it has no formula for" in low["note"]
    high = qmfu.qlora_check(q, run, 300.0).iloc[3]
    assert high["flagged"] and "a layer that is not an nn.Linear" in high["note"]


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: name)


def test_the_peak_on_cuda_weighs_the_tables_precisions_by_the_steps_flops(monkeypatch):
    _fake_cuda(monkeypatch, "NVIDIA H100 PCIe")
    bf16, fp32 = dev.dense_peak_flops("H100 PCIe", "bf16"), dev.dense_peak_flops("H100 PCIe",
                                                                                 "fp32")
    run = _executed(bf16=30.0, fp32=70.0)
    peak = qmfu.step_peak(run, "cuda")
    assert peak.flops == pytest.approx(100 / (30 / bf16 + 70 / fp32))  # the step at 100% of each
    assert not peak.measured and peak.spread == 0.0 and peak.dtype == "bf16+fp32"
    assert peak.label.startswith("the step's precisions weighted by their FLOPs: bf16 30% of "
                                 "the FLOPs at 756.5 TFLOP/s (table: H100 PCIe dense bf16); "
                                 "fp32 70%")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    tf32 = qmfu.step_peak(run, "cuda")  # fp32 matmuls allowed the tf32 rate: that peak
    assert tf32.flops == pytest.approx(
        100 / (30 / bf16 + 70 / dev.dense_peak_flops("H100 PCIe", "tf32")))
    _fake_cuda(monkeypatch, "Tesla T4")  # no bf16 tensor cores: no peak, and why
    none = qmfu.step_peak(run, "cuda")
    assert none.flops is None and none.label.startswith("no bf16 peak (T4 has no bf16")
    assert none.label.endswith("which 30% of the step's FLOPs ran in")


def test_the_peak_on_cpu_probes_each_precision_once_and_keeps_the_widest_spread():
    known: dict = {}
    run = _executed(bf16=40.0, fp32=60.0)
    peak = qmfu.step_peak(run, "cpu", probe_size=64, known=known)
    assert set(known) == {"bf16", "fp32"} and all(p.measured for p in known.values())
    assert peak.flops == pytest.approx(100 / (40 / known["bf16"].flops + 60 / known["fp32"].flops))
    assert peak.measured and peak.spread == max(p.spread for p in known.values())
    assert "measured: CPU bf16 matmul probe (64x64" in peak.label
    again = qmfu.step_peak(run, "cpu", probe_size=64, known=known)
    assert again.flops == peak.flops  # the same probes, not new ones


def test_each_plans_mfu_of_its_steady_steps_by_both_counts():
    shape = ModelShape(params=100, layers=0, d_model=1, seq_len=1)
    q = qmfu.QLoraShape(shape, frozen=90, adapters=10, checkpointing=False)  # 600 per token
    run = qmfu.Executed(200.0, 150.0, 20.0, 30.0, 100.0, (("fp32", 400.0),))
    peak = dev.Peak(1e6, "a peak", "test", True, "fp32", spread=0.25)
    counted = {"optimized": qmfu.Counted(q, run, 300.0, peak)}
    frame = pd.DataFrame([{"plan": "optimized", "token_slots": 1200, "steps": 3, "ranks": 1}])
    stages = pd.DataFrame({"stage": ["warmup", "data_wait", "compute", "compute", "train"],
                           "seconds": [9.0, 0.5, 1.5, 2.0, 4.0], "step": [None, 1, 1, 2, None],
                           "rank": 0, "run": "optimized"}).astype({"step": "Int64"})
    got = qmfu.run_mfu(frame, stages, counted)
    assert list(got["flops"]) == [qmfu.EXECUTED, "model FLOPs 6N + 12·L·d·T"]
    rate = 400 * 2 / 4.0  # 400 token slots per step, 2 steady steps in 4 s
    assert list(got["token_slots_per_s"]) == [rate, rate]
    assert list(got["mfu"]) == [rate * 400 / 1e6, rate * 600 / 1e6]
    assert list(got["counter_vs_flops"]) == [1.0, 400 / 600]  # 300 counted + 100 4-bit forward
    assert list(got["peak_spread"]) == [0.25, 0.25] and got["peak"].iloc[0] == "against a peak"
    two = qmfu.run_mfu(frame.assign(ranks=2), stages.assign(rank=1), counted)
    assert two["peak_tflops"].iloc[0] == 2e-6 and two["mfu"].iloc[0] == rate * 400 / 2e6
    slow = dev.Peak(1.0, "a slow peak", "test", True, "fp32")  # 100% exceeded: no MFU, said
    over = qmfu.run_mfu(frame, stages, {"optimized": qmfu.Counted(q, run, 300.0, slow)})
    assert over["mfu"].isna().all() and over["peak"].iloc[0].startswith("not an MFU")
    assert qmfu.run_mfu(frame.assign(plan="naive"), stages, counted).empty
    assert math.isnan(qmfu.plan_mfu("x", 0.0, 10, q, run, 300.0, peak)[0]["token_slots_per_s"])


def test_the_report_says_each_plans_mfu_by_both_counts_and_a_missing_peak_as_none(tmp_path):
    from diag import report

    shape = ModelShape(params=100, layers=0, d_model=1, seq_len=1)
    q = qmfu.QLoraShape(shape, frozen=90, adapters=10, checkpointing=False)
    run = qmfu.Executed(200.0, 150.0, 20.0, 30.0, 100.0, (("bf16", 400.0),))
    table = dev.Peak(1e6, "table: H100 SXM dense bf16", "datasheet", False, "bf16")
    unknown = dev.Peak(None, "unknown GPU 'X1'", "", False, "bf16")
    frame = pd.DataFrame([{"plan": p, "token_slots": 1200, "steps": 3, "ranks": 1}
                          for p in ("naive", "optimized")])
    stages = pd.DataFrame({"stage": "compute", "seconds": [2.0, 2.0, 1.0, 1.0],
                           "step": [1, 2, 1, 2], "rank": 0,
                           "run": ["naive", "naive", "optimized", "optimized"]})
    mfu = qmfu.run_mfu(frame, stages, {"naive": qmfu.Counted(q, run, 300.0, unknown),
                                        "optimized": qmfu.Counted(q, run, 300.0, table)})
    comparison = pd.DataFrame([{"speedup": 2.0, "low": 1.9, "high": 2.1, "resolved": True,
                                "rounds": 5, "text": "naive 2 s -> optimized 1 s per start"}])
    folder = report.write({"qlora_comparison": comparison, "qlora_mfu": mfu}, tmp_path / "r")
    page = (folder / "report.html").read_text()
    assert ("MFU of the steady steps, by the FLOPs they ran: naive <b>none</b>, optimized "
            "<b>16.0%</b> (none: ") in page  # 400 slots/s x 400 / 1e6
    assert "by the model-FLOPs convention none and 24.0% (the glossary" in page
    assert "qlora_mfu.csv" in page and (folder / "qlora_mfu.csv").is_file()
