"""The MFU formula and its judge (diag.mfu.formula; the QLoRA step's is test_qlora_step's): 6N /
8N per token plus the attention term, N counted from a model, the counter's check flagged past
10%, MFU above 100% and a floor above the step refused (hand-built tiny models; no download, no
training run)."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from diag.mfu.formula import (NANOGPT_PEAK, ModelShape, count_flops, disagreement,
                              floor_impossible, floor_seconds, judge_mfu, loss_of,
                              mfu_from_figures)

D, HEADS, T, VOCAB = 8, 2, 4, 16


class TinyLM(nn.Module):
    """Embedding, one projection, one causal SDPA, an LM head (tied to the embedding or not)."""

    def __init__(self, tied: bool = True, head: bool = True, **config) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self._head = head
        self.config = SimpleNamespace(**({"num_hidden_layers": 1, "num_attention_heads": HEADS,
                                          "hidden_size": D, "vocab_size": VOCAB} | config))

    def get_output_embeddings(self):
        return self.head if self._head else None

    def forward(self, input_ids):
        b, t = input_ids.shape
        h = self.proj(self.emb(input_ids))
        q = h.view(b, t, HEADS, D // HEADS).transpose(1, 2)
        h = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(b, t, D)
        return SimpleNamespace(logits=self.head(h))


def _batch(b: int = 3):
    ids = torch.randint(0, VOCAB, (b, T + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# -- the formula -------------------------------------------------------------------------------

def test_flops_per_token_is_6n_plus_12_ldt_and_8n_16_ldt_recomputing():
    s = ModelShape(params=1000, layers=3, d_model=8, seq_len=16, name="m")
    assert s.flops_per_token == 6 * 1000 + 12 * 3 * 8 * 16 == 10608
    assert s.training_flops() == s.flops_per_token
    assert s.training_flops(recompute=True) == 8 * 1000 + 16 * 3 * 8 * 16 == 14144
    assert ModelShape(7, 0, 8, 16).flops_per_token == 42  # no attention term without layers


def test_n_counts_matmul_weights_a_tied_embedding_once_as_the_head():
    # proj 8x8 + bias 8, head 16x8 (the tied embedding); the position lookup is not a matmul
    tied = ModelShape.from_model(TinyLM(), seq_len=T)
    assert (tied.params, tied.layers, tied.d_model, tied.seq_len) == (200, 1, D, T)
    assert tied.name == "TinyLM"
    assert ModelShape.from_model(TinyLM(tied=False), T, "x").params == 200  # emb is a lookup
    assert ModelShape.from_model(TinyLM(tied=False), T, "x").name == "x"
    # no output embeddings: every embedding is a lookup, the Linear head still counts
    assert ModelShape.from_model(TinyLM(tied=False, head=False), T).params == 200
    assert ModelShape.from_model(TinyLM(tied=True, head=False), T).params == 72


def test_the_shape_reads_gpt2_and_llama_config_names():
    gpt2 = TinyLM()
    gpt2.config = SimpleNamespace(n_layer=5, n_head=4, n_embd=32)  # GPT-2's names only
    s = ModelShape.from_model(gpt2, T)
    assert (s.layers, s.d_model) == (5, 32) and isinstance(s.d_model, int)  # 32 // 4 heads
    llama = ModelShape.from_model(TinyLM(num_hidden_layers=3, num_attention_heads=4,
                                         hidden_size=64, head_dim=32), T)
    assert (llama.layers, llama.d_model) == (3, 128)  # heads x head_dim, not hidden_size


def test_a_named_shape_is_gpt2_small_at_124m_less_its_position_table():
    s = ModelShape.named("gpt2-small", seq_len=256)
    assert (s.params, s.layers, s.d_model, s.seq_len, s.name) == (124_439_808 - 1024 * 768, 12,
                                                                   768, 256, "gpt2-small")
    medium = ModelShape.named("gpt2-medium")  # 354.8M less its 1024 x 1024 position table
    assert (medium.params, medium.layers, medium.d_model, medium.seq_len) == (
        354_823_168 - 1024 * 1024, 24, 1024, 1024)
    with pytest.raises(ValueError, match=r"name='gpt2-xl': allowed values are 'gpt2-small', "
                                         r"'gpt2-medium'"):
        ModelShape.named("gpt2-xl")


# -- the counter's check -----------------------------------------------------------------------

def test_the_counter_sees_6n_plus_attention_on_cpu_and_clears_the_gradients():
    model, (x, y) = TinyLM(), _batch()
    entered = []

    @contextlib.contextmanager
    def autocast():
        entered.append(True)
        yield

    counted = count_flops(model, x, y, autocast=autocast())
    # matmul weights (not the bias): proj 64 + head 128; attention 12·d·T per token, fwd + bwd
    assert counted == (6 * (64 + 128) + 12 * D * T) * x.numel()
    assert entered == [True]
    assert all(p.grad is None for p in model.parameters())
    assert count_flops(model, x, y) == counted
    loss = loss_of(model, x, y)
    logits = model(input_ids=x).logits
    assert loss.item() == pytest.approx(F.cross_entropy(logits.reshape(-1, VOCAB),
                                                        y.reshape(-1)).item())


def test_disagreement_is_flagged_past_ten_percent_either_way():
    assert disagreement(100.0, 105.0) == (False, "counter 1.05x the formula (within 10%)")
    assert disagreement(100.0, 109.0, "why") == (False, "counter 1.09x the formula (within 10%)")
    assert disagreement(100.0, 120.0, "bnb kernels", against="executed") == (
        True, "counter 1.2x executed (over 10%): bnb kernels")
    assert disagreement(100.0, 85.0) == (True, "counter 0.85x the formula (over 10%)")
    assert disagreement(100.0, 91.0)[0] is False and disagreement(100.0, 111.0)[0] is True
    assert disagreement(0.0, 5.0) == (True, "no comparison: formula 0, counter 5 FLOPs")
    assert disagreement(0.5, 0.5) == (False, "counter 1x the formula (within 10%)")
    assert disagreement(-1.0, 5.0)[0] is True
    assert disagreement(10.0, math.nan) == (True, "no comparison: formula 10, counter nan FLOPs")
    assert disagreement(10.0, math.inf)[0] is True


def test_a_floor_above_the_step_is_impossible_and_an_equal_one_is_not():
    assert floor_impossible(2.0, 1.0) is True
    assert floor_impossible(1.0, 1.0) is False and floor_impossible(0.5, 1.0) is False
    assert floor_impossible(math.nan, 1.0) is False and floor_impossible(2.0, math.nan) is False
    assert floor_impossible(math.inf, 1.0) is False and floor_impossible(2.0, -math.inf) is False


def test_the_floor_is_the_step_at_the_peak():
    assert floor_seconds(6.0, 100.0, 200.0) == 3.0
    for peak in (None, 0.0, math.inf, math.nan):
        assert math.isnan(floor_seconds(6.0, 100.0, peak))


def test_mfu_is_the_ratio_to_the_peak_never_above_one():
    assert judge_mfu(10.0, 4.0, 80.0, "label") == (0.5, 0.5, "against label")
    assert judge_mfu(10.0, 4.0, 40.0, "exact") == (1.0, 1.0, "against exact")  # 100% can be
    mfu, ratio, note = judge_mfu(10.0, 4.0, 20e12 / 1e12, "p")
    assert math.isnan(mfu) and ratio == 2.0
    mfu, ratio, note = judge_mfu(1e12, 3.0, 1e12, "the table")
    assert math.isnan(mfu) and ratio == 3.0
    assert note == ("not an MFU: 300% of the peak is impossible; the peak (1 TFLOP/s, the table) "
                    "is wrong for this device, or 3 FLOPs per token is over-counted (achieved 3 "
                    "TFLOP/s)")
    assert judge_mfu(0.5, 1.0, 0.5, "a small peak") == (1.0, 1.0, "against a small peak")
    for peak in (None, 0.0, -1.0):
        mfu, ratio, note = judge_mfu(10.0, 4.0, peak, "unknown device")
        assert math.isnan(mfu) and math.isnan(ratio) and note == "no MFU: unknown device"


def test_mfu_from_your_figures_against_the_table_and_the_assumed_peak():
    shape = ModelShape(params=1_000_000_000, layers=0, d_model=1, seq_len=1)  # 6e9 per token
    f = mfu_from_figures(10_000.0, shape, "NVIDIA H100 80GB HBM3", tokens_per_step=20_000)
    assert list(f["peak"]) == ["diag table", "assumed"]
    table, assumed = f.to_dict("records")
    assert table["peak_tflops"] == pytest.approx(989.4)
    assert table["achieved_tflops"] == pytest.approx(60.0)
    assert table["mfu"] == pytest.approx(60 / 989.4) == table["ratio_to_peak"]
    assert table["verdict"].startswith("against diag table: H100 SXM dense bf16 (")
    assert table["flops_per_token"] == 6e9
    assert table["seconds_per_step"] == 2.0
    assert table["floor_s"] == pytest.approx(6e9 * 20_000 / 989.4e12)
    assert assumed["peak_tflops"] == 312.0 and assumed["mfu"] == pytest.approx(60 / 312)
    assert assumed["verdict"] == (
        "against assumed 312 TFLOP/s (nanoGPT's hard-coded A100 bf16); and not this device's "
        "peak: H100 SXM does 989.4 dense bf16 TFLOP/s (3.17x the assumed one), so the real MFU "
        "is 6.1%")
    assert assumed["floor_s"] == pytest.approx(6e9 * 20_000 / 312e12)


def test_mfu_from_figures_on_a_device_the_table_lacks_or_lacks_the_dtype_of():
    shape = ModelShape(params=1_000_000, layers=0, d_model=1, seq_len=1)
    f = mfu_from_figures(1000.0, shape, "Acme X1", assumed_peak=None)
    (row,) = f.to_dict("records")
    assert math.isnan(row["mfu"]) and math.isnan(row["peak_tflops"])
    assert row["verdict"] == ("no MFU: unknown device 'Acme X1': diag has no dense bf16 peak for "
                              "it; give the datasheet's dense (not 2:4-sparse) figure as "
                              "assumed_peak")
    assert "seconds_per_step" not in f.columns
    t4 = mfu_from_figures(1000.0, shape, "Tesla T4", assumed_peak=1e12).to_dict("records")
    assert t4[0]["verdict"] == "no MFU: T4 has no bf16 tensor-core figure in diag's table"
    assert t4[1]["verdict"] == "against assumed 1 TFLOP/s" and t4[1]["mfu"] == pytest.approx(6e-3)
    a100 = mfu_from_figures(1000.0, shape, "NVIDIA A100-SXM4-80GB")
    assert a100["verdict"].iloc[1] == ("against assumed 312 TFLOP/s (nanoGPT's hard-coded A100 "
                                       "bf16)")  # the same peak: no correction
    fp32 = mfu_from_figures(1000.0, shape, "NVIDIA A100-SXM4-80GB", dtype="fp32",
                            assumed_peak=NANOGPT_PEAK)
    assert fp32["peak_tflops"].iloc[0] == pytest.approx(19.5)
    assert mfu_from_figures(0.5, shape, "cpu")["achieved_tflops"].iloc[0] == 3e-6  # any rate > 0
    near = mfu_from_figures(1000.0, shape, "NVIDIA H100 80GB HBM3", assumed_peak=989e12)
    assert near["verdict"].iloc[1] == "against assumed 989 TFLOP/s"  # within 0.1%: the same peak
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="tokens_per_s=.*: must be > 0"):
            mfu_from_figures(bad, shape, "cpu")
