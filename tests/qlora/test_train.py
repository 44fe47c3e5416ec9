"""`diag train` end to end on the embedded data (tiny nf4 Llama, embedded S3 and hub): a few steps
with eval, the adapter reloaded with the same eval loss, a Ctrl-C then --resume that trains the
same losses, and a resume whose source changed, refused."""

from __future__ import annotations

import json
import os
import signal

import pytest

from diag.config import TrainConfig

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

# its module fixture is made once: the file's tests share one xdist worker (make test)
pytestmark = [pytest.mark.xdist_group("test_train"), pytest.mark.slow]  # trains: ~15 s
STEPS = 6


def _cfg(out, **more):
    # the plan's settings given (defaults, no sweep): this file tests the run, not the measuring
    return TrainConfig.quick(out_dir=str(out), max_steps=STEPS, checkpoint_every=1,
                             eval_every=3, device="cpu", **more)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    from diag.qlora import run_train

    out = tmp_path_factory.mktemp("train") / "out"
    return out, run_train(_cfg(out, merge=True), decisions=())


def test_a_short_run_trains_evaluates_and_leaves_the_adapter(fresh):
    out, result = fresh
    row = result.frame.iloc[0]
    assert (row["steps"], row["eval_records"], row["batch_size"]) == (STEPS, 5, 8)
    assert row["records"] == row["steps_per_epoch"] * 8  # whole steps of batch_size records
    losses = result.losses
    assert list(losses.loc[losses["split"] == "train", "step"]) == list(range(1, STEPS + 1))
    evals = losses[losses["split"] == "eval"]
    assert list(evals["step"]) == [0, 3, 6]  # before the first step, every 3, at the end
    assert evals["trained_tokens"].iloc[-1] == row["trained_tokens"] > 0
    assert row["final_eval_loss"] == evals["loss"].iloc[-1] < row["first_eval_loss"]
    stages = set(result.stages.loc[result.stages["step"].isna(), "stage"])
    assert stages == {"fetch_data", "load_model", "preprocess", "setup", "warmup", "train",
                      "checkpoint", "eval"}
    eta = result.eta.set_index("stage")
    assert set(eta.index) == stages | {"total"}
    assert eta.at["total", "measured_s"] == pytest.approx(row["seconds"])
    # the whole command's ETA, said once the steps had a pace (after step 2 of 6), and its clock
    assert row["eta_s"] > 0 and row["command_s"] >= row["seconds"]
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-5", "checkpoint-6"]
    assert json.loads((out / "diag-run.json").read_text())["max_steps"] == STEPS
    # --merge: the base in 16-bit with the adapter in its weights, a model of its own
    config = json.loads((out / "merged" / "config.json").read_text())
    assert "quantization_config" not in config and row["merged"] == str(out / "merged")
    assert (out / "merged" / "model.safetensors").is_file()


def test_the_adapter_reloads_onto_a_fresh_base_with_the_same_eval_loss(fresh, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import Trainer, TrainingArguments

    from diag.data import PackedDataset
    from diag.embedded import ensure_assets
    from diag.qlora.checkpoints import merge_into
    from diag.qlora.data import train_records
    from diag.qlora.base import load_base
    from diag.qlora.plans import Plan

    out, result = fresh
    cfg, assets = _cfg(out), ensure_assets()
    base = load_base(Plan.optimized(), assets.model_dir, torch.device("cpu"))
    model = PeftModel.from_pretrained(base, out)
    held = train_records(cfg, assets.dataset, assets.model_dir).eval  # the same seeded draw
    evals = PackedDataset(held.cache.folder, cfg.seq_len, records=held.indices, pack=False)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=cfg.eval_batch,
                             prediction_loss_only=True, report_to=[], use_cpu=True,
                             remove_unused_columns=False)
    loss = Trainer(model=model, args=args, eval_dataset=evals).evaluate()["eval_loss"]
    assert loss == pytest.approx(result.frame.iloc[0]["final_eval_loss"], abs=1e-4)
    with pytest.raises(ValueError, match="loaded in 4-bit"):
        merge_into(model)


def test_ctrl_c_saves_a_checkpoint_and_resume_trains_the_same_losses(fresh, tmp_path,
                                                                     monkeypatch):
    import diag.qlora.trainer
    from diag.qlora import run_train
    from diag.qlora.checkpoints import Interrupted, last_checkpoint

    out = tmp_path / "out"
    late = []
    previous = signal.signal(signal.SIGINT, lambda *a: late.append(1))  # past training: noted
    save = diag.qlora.trainer.save_whole

    def ctrl_c(*args: object) -> None:  # as a person would, once a checkpoint is on disk: at
        save(*args)  # the same point whatever the load (a thread's signal lands anywhere)
        if last_checkpoint(out).name == "checkpoint-1":
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(diag.qlora.trainer, "save_whole", ctrl_c)
    try:
        with pytest.raises(Interrupted) as stop:
            run_train(_cfg(out), decisions=())
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    assert not late and stop.value.signum == signal.SIGINT
    assert last_checkpoint(out).name == "checkpoint-2"  # the step the signal came in saved
    assert f"--resume --out-dir {out}" in str(stop.value)
    # the resumed process runs no eval before its first step, the fresh one did: on a CPU with
    # AVX512-BF16 an eval repacked bitsandbytes' 4-bit base in place, off by 1e-4 (load_base)
    resumed = run_train(_cfg(out, resume=True), decisions=())
    assert resumed.frame.iloc[0]["resumed_from_step"] == 2
    both = [r.losses.set_index(["split", "step"])["loss"] for r in (fresh[1], resumed)]
    assert list(both[1].index) == list(both[0].index)  # every step's and every eval's loss
    assert (both[1] - both[0]).abs().max() <= 1e-5, (both[0], both[1])


def test_a_resume_whose_source_changed_is_refused(fresh, tmp_path):
    import shutil

    from diag.qlora import run_train

    out = tmp_path / "out"
    shutil.copytree(fresh[0], out)
    run = json.loads((out / "diag-run.json").read_text())
    run = {k: v for k, v in run.items() if k != "finished"}  # stopped at its last checkpoint
    (out / "diag-run.json").write_text(json.dumps(run | {"cache": "0" * 64}))
    with pytest.raises(ValueError, match=r"the source changed since the run .* started "
                                         r"\(token cache 000000000000 then"):
        run_train(_cfg(out, resume=True), decisions=())


def test_a_resume_of_a_finished_run_trains_nothing(fresh, tmp_path, capsys):
    import shutil

    from diag.cli import main
    from diag.qlora import run_train

    out = tmp_path / "out"
    shutil.copytree(fresh[0], out, ignore=shutil.ignore_patterns("merged"))
    adapter = (out / "adapter_model.safetensors").read_bytes()
    argv = ["train", "--quick", "--device", "cpu", "--max-steps", str(STEPS),
            "--checkpoint-every", "1", "--eval-every", "3", "--out-dir", str(out), "--resume"]
    assert main(argv) == 0  # said, and its summary shown: no source read, no model loaded
    assert f"finished at step {STEPS}: nothing to train" in capsys.readouterr().err
    # stopped after its last checkpoint, before its output was recorded: the Trainer resumed
    # there would train a step past max_steps; diag publishes that checkpoint's adapter instead
    run = json.loads((out / "diag-run.json").read_text())
    (out / "diag-run.json").write_text(json.dumps({k: v for k, v in run.items()
                                                   if k != "finished"}))
    again = run_train(_cfg(out, resume=True), decisions=()).frame.iloc[0]
    assert again["steps"] == again["resumed_from_step"] == STEPS
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-5", "checkpoint-6"]
    assert (out / "adapter_model.safetensors").read_bytes() == adapter
    assert again["final_eval_loss"] == fresh[1].frame.iloc[0]["final_eval_loss"]


def test_the_adapter_names_its_base_as_given_and_loads_on_another_machine(fresh, tmp_path):
    import subprocess
    import sys

    from diag.embedded import HubServer, ensure_assets

    out, assets = fresh[0], ensure_assets()
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == (assets.repo_id, "main")
    card = (out / "README.md").read_text()
    assert f"base_model: {assets.repo_id}" in card and "## Packed rows" in card
    assert str(tmp_path.anchor + "tmp") not in card and "snapshots" not in card
    # a fresh HF cache and the hub's address: PEFT finds the base from the adapter alone
    script = ("from peft import AutoPeftModelForCausalLM\n"
              f"m = AutoPeftModelForCausalLM.from_pretrained({str(out)!r})\n"
              "print(type(m).__name__, m.peft_config['default'].base_model_name_or_path)")
    with HubServer(assets.hub_root) as hub:
        got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env={**os.environ, **hub.env(), "HF_HOME": str(tmp_path)},
                             timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split() == ["PeftModelForCausalLM", assets.repo_id]


def test_the_merged_model_keeps_packed_records_apart(fresh):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fresh[0] / "merged", dtype=torch.float32)
    assert model.config.use_cache is False and model.generation_config.use_cache is not False
    first, second = torch.arange(5, 17), torch.arange(40, 49)
    row = torch.cat([first, second])[None]
    positions = torch.cat([torch.arange(12), torch.arange(9)])[None]
    with torch.no_grad():
        alone = model(second[None]).logits[0]
        packed = model(row, position_ids=positions).logits[0, 12:]
        cached = model(row, position_ids=positions, use_cache=True).logits[0, 12:]
    apart, across = (alone - packed).abs().max(), (alone - cached).abs().max()
    assert apart < 1e-4 < across / 100, (apart, across)  # the cache's path: records attend across


def test_under_a_launcher_a_signal_stops_the_rank_at_once(monkeypatch):
    # a checkpoint at the end of the step a signal came in: ranks that got it in different steps
    # would each wait for the other in the next one's all-reduce, until the launcher's SIGKILL
    import signal

    from diag.qlora.trainer import signals_callback

    mine = signal.getsignal(signal.SIGTERM)
    monkeypatch.setenv("WORLD_SIZE", "2")
    signals_callback()().on_train_begin(None, None, None)
    assert signal.getsignal(signal.SIGTERM) is mine
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: a checkpoint at the step's end
    callback = signals_callback()()
    callback.on_train_begin(None, None, None)
    try:
        assert signal.getsignal(signal.SIGTERM) == callback._caught
    finally:
        callback.on_train_end(None, None, None)
    assert signal.getsignal(signal.SIGTERM) is mine
