"""report.html: the conclusion first, then the figure, then the tables folded away.

`page(summary, frames, images)` lays out what a run folder holds and decides nothing: the headline
and the ranked fixes, then one section per experiment: its conclusion (its decisions' evidence()),
its figure, its CSVs folded and linked; numbers carry their units (`units.cell`).
"""

from __future__ import annotations

import functools
import html
from typing import Any

import pandas as pd

from diag.decision import decided
from diag.forecast.story import TOLERANCE
from diag.machine.contention import busy
from diag.report.units import cell, seconds, share, sig
from diag.timing import STAGE_FRAME

_esc = functools.partial(html.escape, quote=False)  # text between tags: an apostrophe stays one

# Section key -> title, in page order; a frame belongs to the longest key its name starts with
SECTIONS = {
    STAGE_FRAME: "Where the run's time goes",
    "qlora": "The QLoRA job: naive vs optimized plan",
    "train": "The fine-tune: the whole dataset under one plan, its adapter the output",
    "storage": "Storage: object store vs local disk",
    "model_load": "Model load: fresh vs cached",
    "accum": "Micro-batch x gradient accumulation",
    "checkpointing": "Activation checkpointing",
    "loader": "Data loader: pipeline and num_workers",
    "loader_projected": "Data loader against the target GPU's step (projected)",
    "attach": "Attached to a running job: where its wall clock went, sampled",
    "trace": "A torch.profiler trace: where each rank's time went",
}
FIGURES = {STAGE_FRAME: ("stage_shares", "timeline", "amdahl", "waterfall"),
           "qlora": ("qlora_losses",), "train": ("train_losses",)}  # others: the section's key
_OWN = ("decisions", "advice", "info")  # frames the page reads for its own parts
MAX_ROWS = 40
# the words a report uses, said once (docs/glossary.md holds the same entries)
GLOSSARY = {
    "the clock": "diag compares on one clock per run: wall seconds on an accelerator; on a CPU "
                 "the CPU seconds of diag's process, because a shared box's wall seconds move "
                 "with its neighbours. Where the time goes (the shares, the verdict) is always "
                 "wall: a wait has no CPU seconds. Every figure names its clock.",
    "within noise": "two sides are timed in interleaved rounds; a gap is resolved when an "
                    "exact rank test (Mann-Whitney) puts it past chance at 1%, with at least 5 "
                    "samples a side. Until then it is within noise and the simpler default is "
                    "kept.",
    "verdict": "the group of stages with the largest share of the run: input-bound (data_wait, "
               "h2d), start-up-bound (fetch, model load, preprocess, set-up, warm-up), "
               "communication-bound (comm_wait), compute-bound (compute), or memory-bound "
               "(compute-bound at a micro-batch memory capped).",
    "data_wait": "the training loop blocked on its next batch: the GPU idles while the loader "
                 "prepares data.",
    "h2d": "the copy of a batch from host to device memory.",
    "comm_wait": "under DDP, the time a rank waits on the others in a collective (the gradient "
                 "all-reduce that backward does not hide).",
    "MFU": "model FLOPs utilisation: the FLOPs a step ran per second over the device's dense "
           "peak. Executed FLOPs count what a QLoRA step runs (no gradients for the frozen "
           "4-bit base); model FLOPs (6N + 12·L·d·T) are the convention, shown beside. Over "
           "100% is never an MFU: the peak or the count is wrong, and both numbers are shown.",
    "predicted vs measured": "what each stage would save, priced before the runs from what was "
                             "timed then, set beside what the runs measured.",
    "the waterfall": "the naive total, each stage a fix changed (its measured change), the "
                     "stages no fix changed as one residual, and the optimized total.",
    "a token slot": "one position of a training row: a real token or padding; packing fills "
                    "the slots a naive plan pads.",
}
STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
    "line-height:1.4}h1{font-size:1.7em;margin:0 0 .2em}p,li{overflow-wrap:anywhere}"
    ".head{margin:.2em 0}.device{color:#555;font-size:.9em;margin:.2em 0 1em}"
    ".top{font-size:1.1em;background:#fff3cd;padding:.6em}.busy{background:#fde2e1;padding:.5em}"
    "section{border-top:1px solid #ccc;margin-top:1.8em}.conclusion{font-size:1.05em}"
    ".ev,.defaults{color:#555;font-size:.85em}ol li{margin:.45em 0}"
    "details{margin:.3em 0}summary{cursor:pointer}.scroll{overflow-x:auto;max-width:100%}"
    "table{border-collapse:collapse;font-size:12px;margin:.4em 0}"
    "td,th{padding:2px 8px;border-bottom:1px solid #e4e4e4;text-align:left;vertical-align:top;"
    "max-width:32em;overflow-wrap:break-word}.flag{color:#b00}"
    "img{max-width:100%;height:auto;display:block;margin:1em 0}.more{color:#777;font-size:12px}")


def page(summary: dict[str, Any], frames: dict[str, pd.DataFrame], images: dict[str, str]) -> str:
    """The whole self-contained page (figures inlined as base64 PNG)."""
    head = summary.get("headline")  # its lines, else what the folder measured
    if head:
        lines = head["text"].split("\n")
        top = f"<h1>{_esc(lines[0][0].upper() + lines[0][1:])}</h1>"
        for line in lines[1:]:  # "top fix: ..." stands out
            kind = "top" if line.startswith("top fix: ") else "head"
            top += f"<p class={kind}>{_esc(line[0].upper() + line[1:])}</p>"
    else:
        top = f"<h1>diag report: {_esc(', '.join(sections(frames)) or 'the machine')}</h1>"
        if summary.get("top_finding"):
            top += f"<p class=top>Top finding: {_esc(summary['top_finding'])}</p>"
    said = busy(summary.get("machine") or {})
    if said:
        top += f"<p class=busy>{_esc(said[0].upper() + said[1:])}.</p>"
    when = summary["created_utc"].replace("T", " ")[:16] + " UTC"
    machine = device_line(summary)
    parts = [f"<header>{top}<p class=device>Run of {when}{f' on {machine}' if machine else ''}."
             "</p></header>", _fixes(summary, frames)]
    for key, names in sections(frames).items():
        figures = [_img(f, images[f]) for f in FIGURES.get(key, (key,)) if f in images]
        parts.append(_section(SECTIONS.get(key, key.replace("_", " ")), key,
                              _conclusion(key, names, summary, frames), figures,
                              [_table(n, frames[n]) for n in names]))
    if summary.get("ranks"):  # several ranks: each one's step, and the one the others waited for
        found = summary.get("stragglers") or []
        said = found[0]["finding"] if found else "no rank held the others back"
        tables = [_table("per rank", pd.DataFrame(summary["ranks"]), csv=False)]
        tables += [_table("stragglers", pd.DataFrame(found), csv=False)] if found else []
        parts.append(_section("Per rank", "ranks", _esc(said), [
            _img("ranks", images["ranks"])] if "ranks" in images else [], tables))
    parts.append("<details><summary>Glossary</summary><dl>" + "".join(
        f"<dt><b>{_esc(k)}</b></dt><dd>{_esc(v)}</dd>" for k, v in GLOSSARY.items())
        + "</dl></details>")
    versions = ", ".join(f"{k} {v}" for k, v in summary.get("versions", {}).items())
    parts.append(_section("The machine and the software", "machine",
                          f"Measured on {machine}." if machine else
                          "The command recorded no device facts; the software it ran:", [],
                          [f"<p class=ev>{_esc(versions)}</p>",
                           *([_table("info", frames["info"])] if "info" in frames else [])]))
    return (f"<!doctype html><html><head><meta charset=utf-8><title>diag report</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>")


def sections(frames: dict[str, pd.DataFrame]) -> dict[str, list[str]]:
    """Section key -> its frames' names in page order (the longest known key a name extends)."""
    known = sorted(SECTIONS, key=len, reverse=True)
    mine = [n for n in frames if n not in _OWN]
    names = sorted(mine, key=len)
    out: dict[str, list[str]] = {}
    for name in mine:
        key = next((k for k in [*known, *names] if name == k or name.startswith(f"{k}_")))
        out.setdefault(key, []).append(name)
    decisions = frames.get("decisions")
    for key in (() if decisions is None else decisions["source"].dropna()):
        out.setdefault(key, [])  # a decision whose experiment left no table still gets its say
    order = list(SECTIONS)
    return dict(sorted(out.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order
                                                   else len(order), kv[0])))


def _value(value: Any) -> str:
    return "none" if value is None else str(value)


def _conclusion(key: str, names: list[str], summary: dict[str, Any],
                frames: dict[str, pd.DataFrame]) -> str:
    """The section's first line: its decisions, else where the time went, else the comparison."""
    # the decisions it speaks for: by source (a projected one: its projected section)
    mine = [d for d in decided(frames) if (f"{d.source}_projected" if d.basis == "projected"
                                   and f"{d.source}_projected" in frames else d.source) == key]
    if mine:
        chosen = [d for d in mine if d.basis != "default"]
        # the same default may come from two sweeps (the job's loader and the projected one)
        kept = list({(d.setting, _value(d.value)): d for d in mine
                     if d.basis == "default"}.values())
        out = "; ".join(f"<b>{_esc(d.setting)} = {_esc(_value(d.value))}</b>, "
                        f"{_esc(d.evidence())}" for d in chosen or kept) + "."
        if chosen and kept:
            plans = frames.get("qlora_plans")  # the optimized plan's settings as they ran
            plans = plans[plans["run"] == "optimized"] if plans is not None else None
            ran = {} if plans is None else {s: str(v) if v == v else "none"
                                            for s, v in zip(plans["setting"], plans["value"])}
            out += ("<br><span class=defaults>Defaults kept: " + ", ".join(
                f"{_esc(d.setting)} {_esc(_value(d.value))}" + (
                    f" (ran {_esc(ran[d.setting])} on this device)" if ran.get(
                        d.setting, _value(d.value)) != _value(d.value) else "") for d in kept)
                + " (their reasons in decisions.csv).</span>")
        return out
    if f"{key}_verdict" in frames:  # attach, trace: the verdict on a job diag did not start
        said = frames[f"{key}_verdict"].iloc[0]
        return _esc("; ".join(str(said[c]) for c in ("text", "top_fix", "upgrade", "note")
                              if c in said and pd.notna(said[c]) and str(said[c]))) + "."
    if key == STAGE_FRAME and summary.get("stages"):  # each run's length and largest stage
        said = []
        for run, part in pd.DataFrame(summary["stages"]).groupby("run", sort=False):
            big = part.loc[part["seconds"].idxmax()]
            said.append(f"the {_esc(str(run))} run took {seconds(part['seconds'].sum())}, "
                        f"{_esc(big['stage'])} its largest stage ({share(big['share'])})")
        text = "; ".join(said)
        return text[0].upper() + text[1:] + "."
    if key == "qlora" and "qlora_comparison" in frames:
        said, table = str(frames["qlora_comparison"].iloc[0]["text"]), frames.get("qlora_mfu")
        said = _esc(said[0].upper() + said[1:]) + "."
        if table is not None and not table.empty:  # each plan's MFU, the convention beside it
            executed = table.groupby("plan", sort=False).nth(0)  # executed, then model FLOPs
            model = table.groupby("plan", sort=False).nth(1)
            each = ", ".join(f"{_esc(str(p))} <b>{cell('mfu', m) or 'none'}</b>"
                             for p, m in zip(executed["plan"], executed["mfu"]))
            convention = " and ".join(cell("mfu", m) or "none" for m in model["mfu"])
            why = "" if executed["mfu"].notna().all() else (
                " (none: " + _esc(str(executed["peak"][executed["mfu"].isna()].iloc[0])) + ")")
            said += (f" MFU of the steady steps, by the FLOPs they ran: {each}{why}; by the "
                     f"model-FLOPs convention {convention} (the glossary says how the two differ).")
        return said
    if key == "train" and "train" in frames:  # per plan: its run against its ETA, its loss
        said = []
        for r in frames["train"].itertuples():
            err = (f" ({(r.seconds - r.predicted_s) / r.predicted_s:+.0%})"
                   if r.predicted_s == r.predicted_s and r.predicted_s else "")
            eta = getattr(r, "eta_s", None)  # None: too few steps to pace, or an older folder
            kept = (f"; the whole command {seconds(r.command_s)} against its ETA of "
                    f"{seconds(eta)}, said once its first steps had a pace "
                    f"({r.command_s / eta - 1:+.0%})" if eta == eta and eta else "")
            said.append(f"The {_esc(str(r.plan))} plan trained {cell('records', r.records)} "
                        f"records ({cell('records', r.eval_records)} held out) for "
                        f"{sig(r.epochs)} epoch{'s' * (round(r.epochs, 3) != 1)}, "
                        f"{cell('steps', r.steps)} steps, {cell('tokens', r.trained_tokens)} "
                        f"tokens, in <b>{seconds(r.seconds)}</b>; {seconds(r.predicted_s)} "
                        f"projected before the run{err}{kept}; held-out "
                        f"loss {sig(r.first_eval_loss)} &rarr; <b>{sig(r.final_eval_loss)}</b>; "
                        f"the adapter is in {_esc(str(r.out_dir))}.")
        return " ".join(said)
    rows = sum(len(frames[n]) for n in names)
    return f"Measured {rows:,} rows; no setting was decided from them."


def device_line(summary: dict[str, Any]) -> str:
    """The machine in words, HTML-escaped; "" without device facts."""
    device = summary.get("device")
    if not device:
        return ""
    accelerator = str(device.get("accelerator") or "none")
    if accelerator in ("none", "nan"):
        where = "CPU only (no accelerator)"
    else:
        count = int(float(device.get("accelerator_count") or 1))
        where = accelerator + (f" x {count}" if count > 1 else "")
    facts = [str(device.get("cpu_model") or ""),
             device.get("cpu_cores_logical") and f"{device['cpu_cores_logical']} cores",
             device.get("ram_gb") and f"{cell('ram_gb', float(device['ram_gb']))} RAM"]
    return _esc(", ".join([where, *(f for f in facts if f)]))


def _fixes(summary: dict[str, Any], frames: dict[str, pd.DataFrame]) -> str:
    """The comparison's savings predicted vs measured, then the fixes left on the last run."""
    out = []
    savings = frames.get("qlora_savings")
    if savings is not None and not savings.empty:
        unit = " CPU" if (savings["clock"] == "CPU").any() else ""
        items = "".join(
            f"<li><b>{_esc(r.stage)}</b>: {_esc(r.finding)}: "
            + (f"predicted {seconds(r.predicted_s)}{unit}, " if r.predicted_s == r.predicted_s
               else "not predicted, ") + f"measured {seconds(r.measured_s)}{unit}"
            + (f" <span class=flag>(off by {share(r.error_share)})</span>"
               if str(r.flagged) == "True" else "")
            + f"<div class=ev>{_esc(r.evidence)}</div></li>" for r in savings.itertuples())
        out.append(f"<h2>What each stage saved: predicted before the runs, measured in them"
                   f"</h2><p class=ev>{_esc(TOLERANCE[0].upper() + TOLERANCE[1:])}.</p>"
                   f"<ol>{items}</ol>")
    found, per = summary.get("findings") or [], "per run"
    if not found and "advice" in frames:  # a single experiment: its advice is its fixes
        found, per = frames["advice"].to_dict("records"), "per start"
    runs = list(dict.fromkeys(f.get("run", "") for f in found))
    last = "optimized" if "optimized" in runs else runs[-1] if runs else ""
    changed = (summary.get("headline") or {}).get("changed") or ()  # fixed in the optimized run
    items = "".join(
        f"<li><b>{_esc(f['finding'])}</b>: saves {seconds(f['seconds_saved'])} {per}"
        + (f" ({share(f['share_of_run'])} of the run)"
           if f.get("share_of_run") is not None and f["share_of_run"] == f["share_of_run"]
           else "") + f"<div class=ev>{_esc(str(f['evidence']))}</div></li>"
        for f in found if f.get("run", "") == last and (last != "optimized"
                                                        or f["stage"] not in changed))
    if items:
        title = ("What is left: fixes the optimized plan did not apply, largest first"
                 if last == "optimized" else "Fixes, largest saving first")
        out.append(f"<h2>{title}</h2><ol>{items}</ol>")
    out += [_table(n, frames[n]) for n in ("advice", "decisions") if n in frames]
    return f"<section class=fixes>{''.join(out)}</section>" if out else ""


def _section(title: str, key: str, conclusion: str, figures: list[str],
             tables: list[str]) -> str:
    return (f"<section class=experiment id={key}><h2>{_esc(title)}</h2>"
            f"<p class=conclusion>{conclusion}</p>{''.join(figures)}{''.join(tables)}</section>")


def _img(name: str, data: str) -> str:
    return f'<img alt="{name}" src="data:image/png;base64,{data}">'


def _table(name: str, frame: pd.DataFrame, csv: bool = True) -> str:
    """The first MAX_ROWS rows folded under the name, linked to its CSV (csv), with units."""
    frame = frame.drop(columns="json", errors="ignore")  # each decision whole: for the CSV only
    shown = frame.head(MAX_ROWS)
    more = (f"<p class=more>{len(frame) - MAX_ROWS} more rows in the CSV</p>"
            if len(frame) > MAX_ROWS else "")
    body = shown.to_html(index=False, border=0, na_rep="", formatters={
        c: (lambda v, c=c: cell(str(c), v)) for c in shown.columns})
    label = f'<a href="{_esc(name)}.csv">{_esc(name)}.csv</a>' if csv else _esc(name)
    return (f"<details><summary>{label}: {len(frame):,} rows, {len(frame.columns)} columns"
            f"</summary><div class=scroll>{body}</div>{more}</details>")
