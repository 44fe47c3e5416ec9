"""diag's optimized QLoRA job against TRL's SFTTrainer(packing=True), on the train loop only.

Both sides get the same nf4 base (diag's load_model), records, LoRA config, seq_len, steps,
micro-batch and checkpointing; each Trainer carries diag's TimingCallback, and a side's figure is
its trained tokens over its train loop: the `warmup` and `train` stages, from the Trainer's
on_train_begin to its last step's end. So neither side's model load, tokenizing or packing
(TRL's happens in SFTTrainer's constructor, diag's in `preprocess`), Trainer set-up or
checkpoint saving (diag saves one at the end, TRL none: save_strategy="no") is in it.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from diag.config import QLoraConfig
from diag.qlora import Plan
from diag import noise

LOOP = ("warmup", "train")  # the run-level stages of the train loop (steady steps inside train)


def loop_seconds(stages: Any) -> float:
    """The train loop's seconds in a StageTimer frame: its run-level warmup and train rows."""
    run = stages[stages["step"].isna()]
    return float(run.loc[run["stage"].isin(LOOP), "seconds"].sum())


def trl_loop(cfg: QLoraConfig, optimized: Plan, model_dir: Path, dataset: Path
             ) -> tuple[float, int]:
    """TRL's SFTTrainer(packing=True) over the job's records: (train loop seconds, trained
    tokens). Its batches per step are sized so cfg.steps steps cover every packed row once, as
    diag trains each record once over cfg.steps steps."""
    from datasets import Dataset, disable_progress_bars
    from transformers import AutoTokenizer, PrinterCallback
    from trl import SFTConfig, SFTTrainer

    from diag.data import format_prompt, read_source
    from diag.machine.device import resolve
    from diag.qlora.data import job_records
    from diag.qlora.base import load_model
    from diag.timing import StageTimer
    from diag.timing.callback import TimingCallback

    disable_progress_bars()  # SFTTrainer's tokenizing and packing maps
    device = resolve(cfg.device)
    records, _ = read_source(dataset, cfg.fields(), on_error="skip", limit=cfg.records)
    recs = job_records(cfg.replace(on_error="skip"), dataset, model_dir)
    pairs = [format_prompt(records[i]) for i in recs.indices]
    model = load_model(cfg, optimized, model_dir, device)
    data = Dataset.from_list([{"prompt": p, "completion": c} for p, c in pairs])
    timer = StageTimer(device=device)
    with tempfile.TemporaryDirectory(prefix="diag-trl-") as out:
        args = SFTConfig(output_dir=out, max_steps=cfg.steps, packing=True,
                         max_length=cfg.seq_len, per_device_train_batch_size=optimized.micro_batch,
                         gradient_accumulation_steps=1, learning_rate=cfg.lr, report_to=[],
                         logging_steps=1, save_strategy="no", disable_tqdm=True,
                         use_cpu=device.type == "cpu", seed=cfg.seed,
                         gradient_checkpointing=optimized.gradient_checkpointing)
        tok = AutoTokenizer.from_pretrained(model_dir)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                             callbacks=[TimingCallback(timer, warmup_steps=cfg.warmup_steps,
                                                       device=device)])
        trainer.remove_callback(PrinterCallback)  # as diag's: no log line per step
        rows = len(trainer.train_dataset)
        trainer.args.gradient_accumulation_steps = max(1, -(-rows // (cfg.steps *
                                                                       optimized.micro_batch)))
        tokens = int(sum(len(ids) for ids in trainer.train_dataset["input_ids"]))
        trainer.train()
    return loop_seconds(timer.to_frame()), tokens


def vs_trl(cfg: QLoraConfig, optimized: Plan, budget_s: float = 120.0) -> dict[str, Any]:
    """Seconds per trained token of each side's train loop, interleaved rounds (order
    alternating) until their difference resolves (diag.noise) or budget_s is spent."""
    from diag.embedded import ensure_assets
    from diag.qlora.job import open_sources, prepare, run_plan

    assets, tokens, order = ensure_assets(), {}, [("diag", "trl"), ("trl", "diag")]
    with open_sources(cfg) as src:
        prepare(cfg, optimized, src)

        def side(who: str) -> float:
            if who == "diag":
                got = run_plan(cfg, optimized, src)
                tokens[who] = got["summary"]["real_tokens"]
                return loop_seconds(got["stages"]) / tokens[who]
            seconds, tokens[who] = trl_loop(cfg, optimized, assets.model_dir, assets.dataset)
            return seconds / tokens[who]

        def round_() -> list[float]:
            order.reverse()
            at = {who: side(who) for who in order[0]}
            return [at["diag"], at["trl"]]

        rounds = noise.Rounds(round_, lambda s: not noise.compare(*s).resolved,
                              budget_s=budget_s)
        mine, theirs = rounds.run()
    return {"diag": mine, "trl": theirs, "tokens": tokens, "spent_s": rounds.spent_s}


def print_vs_trl(cfg: QLoraConfig, optimized: Plan, budget_s: float = 120.0) -> None:
    got = vs_trl(cfg, optimized, budget_s)
    mine, theirs = statistics.median(got["diag"]), statistics.median(got["trl"])
    print(f"qlora_vs_trl: {theirs / mine:.3g} (trained tokens/s of the train loop, diag's "
          f"optimized plan {1 / mine:,.0f} ({got['tokens']['diag']} tokens) over TRL "
          f"SFTTrainer packing=True {1 / theirs:,.0f} ({got['tokens']['trl']} tokens), both at "
          f"micro-batch {optimized.micro_batch}, checkpointing "
          f"{'on' if optimized.gradient_checkpointing else 'off'}; "
          f"{noise.compare(got['diag'], got['trl']).describe()}, {got['spent_s']:.3g} s) "
          "(goal >= 1.0)")
