"""The QLoRA job's model as each plan loads it: an nf4 Linear4bit base with LoRA on all seven
projections, checkpointing really on or off; and its FLOPs (executed vs FlopCounterMode)."""

from __future__ import annotations

import dataclasses
import math

import pytest

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
import torch

from diag.config import QLoraConfig
from diag.decision import MFU_DISAGREEMENT
from diag.qlora.plans import Plan

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _load(checkpointing: bool):
    from diag.embedded import ensure_assets
    from diag.qlora.base import load_model

    plan = dataclasses.replace(Plan.naive(), gradient_checkpointing=checkpointing)
    model = load_model(QLoraConfig.quick(), plan, ensure_assets().model_dir, torch.device("cpu"))
    model.train()
    return model


# its module fixture is made once: the file's tests share one xdist worker (make test)
pytestmark = pytest.mark.xdist_group("test_qlora_model")


@pytest.fixture(scope="module")
def models():
    return {on: _load(on) for on in (True, False)}


def test_the_base_is_nf4_linear4bit_with_lora_on_all_seven_projections(models):
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    model = models[False]
    layers = model.base_model.model.model.layers
    assert len(layers) >= 1
    for layer in layers:
        for name in SEVEN:
            parent = layer.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else layer.mlp
            module = getattr(parent, name)
            assert isinstance(module, LoraLayer), name
            base = module.base_layer
            assert isinstance(base, bnb.nn.Linear4bit), name
            assert base.weight.quant_type == "nf4" and base.weight.quant_state is not None
            assert not base.weight.requires_grad
            assert module.lora_A["default"].weight.requires_grad
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # with a cache transformers builds no packed-sequence mask: packed records would mix (the
    # Trainer switches it off too; the sweeps' QLoraStep has no Trainer)
    assert model.config.use_cache is False


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_records_train_as_each_would_alone(attention, tmp_path):
    """The job's packed rows, through its Trainer's own data loader and collator: each record's
    logits in a window equal its logits run alone (fp32), and the loss is the records' own."""
    import transformers

    from diag.embedded import ensure_assets, synthetic_dataset
    from diag.qlora.data import build_dataset, job_records
    from diag.qlora.trainer import training_args

    model_dir = ensure_assets().model_dir
    data = synthetic_dataset(tmp_path / "d.jsonl", records=12)
    cfg = QLoraConfig.quick(seq_len=256, steps=1, warmup_steps=0)
    plan = dataclasses.replace(Plan.naive(), pipeline="packed", micro_batch=4)
    job = build_dataset(cfg, plan, job_records(cfg, data, model_dir), model_dir, data, attention)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attention)
    args = training_args(cfg, plan, job, tmp_path / "out", torch.device("cpu"))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=job.dataset)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch
    worst, weighted, counted, most = 0.0, 0.0, 0, 0
    with torch.no_grad():
        packed = model(**batch)
        for r, (positions, labels) in enumerate(zip(batch["position_ids"], batch["labels"])):
            starts = (positions == 0).nonzero().flatten().tolist() + [cfg.seq_len]
            records = [(a, b) for a, b in zip(starts, starts[1:]) if (labels[a:b] != -100).any()]
            most = max(most, len(records))
            for a, b in records:
                alone = model(input_ids=batch["input_ids"][r:r + 1, a:b], labels=labels[None, a:b])
                worst = max(worst, float((alone.logits[0] - packed.logits[r, a:b]).abs().max()))
                n = int((labels[a + 1:b] != -100).sum())
                weighted, counted = weighted + float(alone.loss) * n, counted + n
    assert most >= 3 and worst <= 1e-4
    assert float(packed.loss) == pytest.approx(weighted / counted, rel=1e-5)


def _layer_forwards(model) -> int:
    """Calls of the first decoder layer's MLP forward over one forward + backward (inside the
    checkpointed layer: the recomputation calls it again; module hooks are not re-fired by
    torch's non-reentrant checkpoint, so the forward itself is wrapped)."""
    mlp = model.base_model.model.model.layers[0].mlp
    calls, forward = [], mlp.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    mlp.forward = counted
    try:
        ids = torch.randint(4, model.config.vocab_size, (2, 32),
                            generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        del mlp.forward  # back to the class's method
        model.zero_grad(set_to_none=True)
    return len(calls)


def test_checkpointing_is_really_on_or_off(models):
    # recomputation runs the layer's forward again in the backward pass: twice vs once
    assert _layer_forwards(models[True]) == 2
    assert _layer_forwards(models[False]) == 1


def test_mfu_formula_has_the_attention_term_and_8n_with_checkpointing(models):
    from diag.mfu import qlora_shape

    on, off = qlora_shape(models[True], 96), qlora_shape(models[False], 96)
    assert on.checkpointing and not off.checkpointing
    s = off.shape
    attention = s.layers * s.d_model * s.seq_len
    assert off.flops_per_token == pytest.approx(6 * s.params + 12 * attention)
    assert on.flops_per_token == pytest.approx(8 * s.params + 16 * attention)
    # the 4-bit base counted at in x out, not at its packed storage (two weights per byte)
    config = models[False].config
    q = config.hidden_size * config.num_attention_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    assert off.frozen >= config.num_hidden_layers * q
    assert off.adapters > 0 and s.params == off.frozen + off.adapters


@pytest.mark.parametrize("checkpointing", [False, True])
def test_executed_flops_match_the_counter_with_the_4bit_forward_added_back(models, checkpointing):
    from diag.mfu import count_step, qlora_check, qlora_shape

    lm = models[checkpointing]
    counted, run = count_step(lm, 2, 96)
    table = qlora_check(qlora_shape(lm, 96), run, counted).set_index("method")
    model, executed, counter, seen = (table.iloc[i] for i in range(4))
    assert counter["flops_per_token"] > 0  # the math SDPA backend forced: attention counted
    # bitsandbytes' 4-bit forward is a custom op the counter cannot see; added back from the
    # Linear4bit shapes, the counter sees what diag says the step executed
    assert counter["flops_per_token"] < executed["flops_per_token"]
    assert seen["vs_executed"] == pytest.approx(1.0, abs=0.05) and not table["flagged"].any()
    # the convention counts the frozen base's weight gradients: well over what runs
    assert model["vs_executed"] > 1.3
    _, run = count_step(models[checkpointing], 1, 96)
    shares = dict(run.by_dtype)  # the 4-bit base in bf16 (its compute dtype), the rest fp32
    assert set(shares) == {"bf16", "fp32"} and sum(shares.values()) == pytest.approx(run.total)
    assert shares["bf16"] >= run.forward_4bit > 0


@pytest.mark.parametrize("ratio, flagged", [(1.0, False), (1 + MFU_DISAGREEMENT - 0.01, False),
                                            (1 + MFU_DISAGREEMENT + 0.01, True),
                                            (1 - MFU_DISAGREEMENT + 0.01, False),
                                            (1 - MFU_DISAGREEMENT - 0.01, True)])
def test_disagreement_flagged_iff_over_the_threshold(ratio, flagged):
    from diag.mfu import ModelShape, qlora_check
    from diag.mfu.qlora import Executed, QLoraShape

    q = QLoraShape(ModelShape(1000, 2, 64, 32), frozen=900, adapters=100, checkpointing=False)
    run = Executed(2000.0, 1500.0, 200.0, 300.0, 1000.0, (("bf16", 4000.0),))
    table = qlora_check(q, run, 4000.0 * ratio - 1000.0)
    assert list(table["flagged"]) == [False, False, False, flagged]


def test_accum_flags_the_counter_gap_and_an_impossible_floor():
    from diag.mfu import disagreement, floor_impossible

    assert disagreement(100.0, 85.0)[0] and not disagreement(100.0, 95.0)[0]
    assert "over 10%" in disagreement(100.0, 120.0, "cause")[1]
    assert disagreement(100.0, math.nan)[0]
    assert floor_impossible(2.0, 1.0) and not floor_impossible(0.5, 1.0)
    assert not floor_impossible(math.nan, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_executed_matches_the_counter_and_the_peak_is_the_tables():
    from diag.embedded import ensure_assets
    from diag.qlora.base import load_model
    from diag.mfu import count_step, step_peak

    model = load_model(QLoraConfig.quick(), Plan.naive(), ensure_assets().model_dir,
                       torch.device("cuda"))
    model.train()
    # on CUDA the fused SDPA kernels have FLOP formulas of their own; the 4-bit forward is
    # bitsandbytes' custom op there too
    counter, run = count_step(model, 2, 96)
    assert (counter + run.forward_4bit) / run.total == pytest.approx(1.0, abs=0.05)
    peak = step_peak(run, "cuda")
    assert not peak.measured and peak.spread == 0.0
    assert peak.flops is None or peak.label.count("table: ") == len(run.by_dtype)
