"""`diag train`'s rules on constructed inputs, in milliseconds: bad input refused in one line
before any work, the out-dir claim, a checkpoint save that runs out of room, the ETA's sums."""

from __future__ import annotations

import errno
import json

import pytest

from diag.config import QLoraConfig, TrainConfig
from diag.qlora import checkpoints


@pytest.mark.parametrize("given, said", [
    ({"epochs": 0}, "TrainConfig.epochs=0: must be a whole number >= 1 (or unset)"),
    ({"max_steps": -5}, "TrainConfig.max_steps=-5: must be a whole number >= 1 (or unset)"),
    ({"epochs": 2, "max_steps": 10}, "TrainConfig: give epochs or max_steps, not both (got "
                                     "epochs=2, max_steps=10)"),
    ({"eval_share": 0.0}, "TrainConfig.eval_share=0.0: must be in (0, 1)"),
    ({"eval_share": 1}, "TrainConfig.eval_share=1: must be in (0, 1)"),
    ({"records": 20, "eval_share": 0.5}, "TrainConfig.eval_share=0.5: holds out 10 of 20 records "
     "(at least eval_batch=8), leaving 10 to train on, less than one optimizer step of "
     "batch_size=16; lower eval_share or eval_batch, or train on more records"),
    ({"resume": True}, "TrainConfig.resume: name the out_dir (--out-dir) of the run to continue"),
    ({"plan": "both"}, "TrainConfig.plan='both': allowed values are 'optimized', 'naive'"),
    ({"lr_warmup": 1.0}, "TrainConfig.lr_warmup=1.0: must be in [0, 1)"),
])
def test_bad_input_is_one_line_naming_the_field(given, said):
    with pytest.raises(ValueError) as err:
        TrainConfig(**given)
    assert str(err.value) == said


def test_the_eval_share_is_at_least_one_batch_and_the_steps_follow_epochs_or_max_steps():
    cfg = TrainConfig(eval_batch=8, batch_size=16)
    assert cfg.held_out(100) == 8 and cfg.held_out(10_000) == 100  # 1%, at least one batch
    assert cfg.total_steps(50) == 50 and cfg.replace(epochs=3).total_steps(50) == 150
    assert cfg.replace(max_steps=7).total_steps(50) == 7
    job = cfg.job()  # the job the plan is decided on: the same rows per optimizer step
    assert job.records == 4 * 16 and job.steps == 4 and job.lr == cfg.lr


@pytest.mark.parametrize("batch, held, share", [(16, 8, 0.01), (8, 4, 0.5), (1, 1, 0.9)])
def test_a_source_counted_to_enough_records_never_fails_the_split(tmp_path, batch, held, share):
    from diag.data import count_records

    cfg = TrainConfig(batch_size=batch, eval_batch=held, eval_share=share)
    cfg.held_out(cfg.enough())  # the count a check stops at always leaves a step and a batch
    with pytest.raises(ValueError, match="less than one optimizer step"):
        cfg.held_out(cfg.enough() - (cfg.enough() - batch - held) - 1)
    (tmp_path / "d.jsonl").write_text("{}\n" * 5000 + "{}")  # the last line has no newline
    assert count_records(tmp_path / "d.jsonl") == 5001
    assert count_records(tmp_path / "d.jsonl", at_most=cfg.enough()) == cfg.enough()


def test_the_panels_last_step_is_the_fine_tune():
    from diag import widgets
    from diag.diagnose import TRAIN, steps

    p = widgets.panel(quick=True, train=True)
    cfg = widgets.config_from(p)
    assert cfg.train and steps(cfg)[-1] == TRAIN and p.progress.max == len(steps(cfg))
    assert list(p.outputs)[-1] == TRAIN.name  # its section comes last
    assert TRAIN not in steps(cfg.replace(train=False))


def test_cli_refuses_bad_input_in_one_line(capsys):
    from diag.cli import main

    assert main(["train", "--epochs", "2", "--max-steps", "9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give epochs or max_steps, not both" in err


def test_ctrl_c_exits_130_with_the_line_on_how_to_resume(monkeypatch, capsys):
    import signal

    from diag import cli

    def stopped(name, cfg):
        raise checkpoints.Interrupted(signal.SIGTERM, 7, cfg_dir)

    cfg_dir = "out/run"
    monkeypatch.setattr(cli, "run", stopped)
    assert cli.main(["train", "--out-dir", "elsewhere"]) == 143
    err = capsys.readouterr().err
    assert err == ("diag: stopped by SIGTERM after step 7; a checkpoint of step 7 is saved: run "
                   "the same command with --resume --out-dir out/run to continue\n")
    assert "name --out-dir to keep one" in str(checkpoints.Interrupted(signal.SIGINT, 3, None))


def _checkpoint(folder, step, complete=True):
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(b"w")
    if complete:  # the Trainer writes trainer_state.json last
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def test_an_out_dir_of_another_run_is_refused_unless_resuming(tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path))
    assert checkpoints.claim(tmp_path, cfg.identity(), resume=False) is None  # a new run
    _checkpoint(tmp_path, 3)
    _checkpoint(tmp_path, 4, complete=False)  # killed mid-save: not a checkpoint
    with pytest.raises(ValueError, match=r"holds the checkpoints of another run \(up to step "
                                         r"3\): pass --resume to continue it"):
        checkpoints.claim(tmp_path, cfg.identity(), resume=False)
    assert checkpoints.claim(tmp_path, cfg.identity(), resume=True)["lr"] == cfg.lr
    other = cfg.replace(lr=1e-3, resume=True)
    with pytest.raises(ValueError, match=r"started with lr=0.0002, this one asks lr=0.001"):
        checkpoints.claim(tmp_path, other.identity(), resume=True)
    # how it runs is not what it trains: another device, cadence or plan source resumes
    same = cfg.replace(device="cpu", checkpoint_every=5, results="runs/x", resume=True)
    assert checkpoints.claim(tmp_path, same.identity(), resume=True) is not None
    assert checkpoints.last_checkpoint(tmp_path).name == "checkpoint-3"


def test_a_resume_with_nothing_to_resume_is_refused_naming_the_folder(tmp_path, capsys):
    from diag.cli import main

    (tmp_path / "diag-run.json").write_text("{}")  # a run stopped before its first checkpoint
    with pytest.raises(ValueError) as err:
        checkpoints.check(tmp_path, {}, resume=True)
    assert str(err.value) == (f"--resume: {str(tmp_path)!r} holds no complete checkpoint to "
                              "continue from; run without --resume to start afresh there")
    assert checkpoints.check(tmp_path, {}, resume=False) is None  # and nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diag-run.json"]
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--resume, --no-resume continue from the last checkpoint in out_dir (none there: " \
           "refused)" in " ".join(capsys.readouterr().out.split())


def test_a_resume_from_another_source_is_refused_before_the_source_is_read(tmp_path, capsys,
                                                                          monkeypatch):
    from diag.cli import main

    monkeypatch.delenv("DIAG_QUICK", raising=False)
    _checkpoint(tmp_path, 2)  # the other bucket is never listed: no credentials asked for
    checkpoints.record(tmp_path, TrainConfig(out_dir=str(tmp_path)).identity())
    assert main(["train", "--resume", "--out-dir", str(tmp_path), "--source",
                 "s3://another-bucket/data.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was started with source='', this one asks " \
        "source='s3://another-bucket/data.jsonl'" in err


def test_diag_qlora_claims_its_plan_folders_too(tmp_path):
    cfg = QLoraConfig(out_dir=str(tmp_path))
    _checkpoint(tmp_path / "naive", 2)
    with pytest.raises(ValueError, match="another run"):
        checkpoints.claim(tmp_path, cfg.identity(), False, folders=("naive", "optimized"))
    with pytest.raises(ValueError, match="is a file"):
        checkpoints.claim(tmp_path / "naive" / "checkpoint-2" / "trainer_state.json", {}, False)


@pytest.mark.parametrize("fault", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:664] . "
                                                "unexpected pos 64 vs 0: file write failed")])
def test_a_save_that_runs_out_of_room_keeps_the_checkpoint_before_it(tmp_path, fault):
    before = _checkpoint(tmp_path, 2)

    def write(tmp):
        (tmp / "adapter_model.safetensors").write_bytes(b"half")
        raise fault

    with pytest.raises(RuntimeError) as err:
        checkpoints.save_whole(tmp_path / "checkpoint-4", write, keep=2)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("checkpoint checkpoint-4: writing under ")
    assert "nothing of it was kept, checkpoint-2 is intact" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]  # no part, no temp
    assert (before / "trainer_state.json").is_file()
    with pytest.raises(ValueError, match="not this"):  # any other fault is raised as it is
        checkpoints.save_whole(tmp_path / "checkpoint-6", lambda tmp: (_ for _ in ()).throw(
            ValueError("not this")), keep=2)


def test_saves_keep_the_newest_k(tmp_path):
    for step in (1, 2, 3):
        checkpoints.save_whole(tmp_path / f"checkpoint-{step}", lambda tmp, s=step: (
            tmp / "trainer_state.json").write_text(json.dumps({"global_step": s})), keep=2)
    assert [s for s, _ in checkpoints.checkpoints(tmp_path)] == [2, 3]


def test_publish_renames_the_loadable_file_last(tmp_path):
    (tmp_path / "adapter_config.json").write_text("old")
    names = checkpoints.publish(tmp_path, lambda tmp: [(tmp / n).write_text("new") for n in (
        "adapter_config.json", "adapter_model.safetensors", "tokenizer.json")])
    assert names[-1] == "adapter_config.json" and len(names) == 3
    assert (tmp_path / "adapter_config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


# -- the ETA, on a constructed comparison: what each unit costs, and the sums -----------------

def test_the_naive_plan_reads_a_whole_dataset_from_disk_item_by_item(tmp_path):
    """ArrowRecords serves the source's good records as read_source reads them (chunks of
    several sizes, a bad line skipped alike), from a file, not from memory."""
    from diag.data import read_source
    from diag.embedded import synthetic_dataset
    from diag.qlora.data import ArrowRecords

    data = synthetic_dataset(tmp_path / "d.jsonl", records=3000)
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines[:1500] + ["{not json"] + lines[1500:]) + "\n")
    records, problems = read_source(data, on_error="skip")
    assert len(problems) == 1 and len(records) == 3000
    picked = [0, 1499, 1500, 2999, 7]
    got = ArrowRecords(data, {}, tmp_path, picked)
    assert len(got) == 5 and [got[i] for i in range(5)] == [records[i] for i in picked]
    assert got[1:3] == [records[1499], records[1500]]
    assert (tmp_path / "records.arrow").stat().st_size > 0 and got.__getstate__()["_table"] is None

