"""Does the streamed token cache hold memory flat, keep up with the tokenizer, pack well and safely?

Side by side in one run, on real-word records (paragraphs of Python's own documentation,
pydoc_data, shuffled into instruction records) and the embedded tokenizer, every process
single-threaded (TOKENIZERS_PARALLELISM=false) and `--procs` processes throughout:
(a) peak memory (PSS of the building process and its workers, sampled) of a cache built from a
~300 MB JSONL over one built from ~30 MB; (b) tokens/s of the whole build (reading, parsing,
templating, writing) over tokenizers' own batch call (`encode_batch_fast`, the call diag makes)
on the same records already in memory, split over the same processes, at 10 MB and at 300 MB:
rounds alternate, median of the per-round ratios; (c) the share of token slots holding a token
at seq_len 512; (d) each record's logits inside packed windows against the record alone (fp32,
sdpa); (e) builds killed at random points: none taken, the next build identical (sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # both sides: one thread per process
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diag.data import ARRAYS, PackedDataset, build_token_cache, format_prompt  # noqa: E402
from diag.data import read_meta, read_source  # noqa: E402
from diag.data.stream import ENCODE_BATCH  # noqa: E402
from diag.embedded import ensure_assets, synthetic_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUILD = ("import sys; from diag.data import build_token_cache; "
         "build_token_cache(sys.argv[1], sys.argv[2], cache_dir=sys.argv[3], "
         "num_proc=int(sys.argv[4]))")


def peak_pss_mb(source: Path, tok: str, procs: int, cache_dir: Path) -> tuple[float, float]:
    """(peak MB of the build's process tree, seconds): a fresh interpreter builds the cache
    while this one sums its tree's proportional set size every 0.1 s."""
    import psutil

    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", BUILD, str(source), tok, str(cache_dir),
                              str(procs)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    top, proc = 0.0, psutil.Process(child.pid)
    while child.poll() is None:
        total = 0
        for p in [proc, *proc.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
            except psutil.Error:
                continue  # a worker that finished between listing and reading
        top = max(top, total / 1e6)
        time.sleep(0.1)
    if child.returncode:
        raise RuntimeError(f"the build of {source} failed ({child.returncode})")
    return top, time.perf_counter() - start


_SHARES: list[list[tuple[str, str]]] = []  # set before the pool forks: inherited, not pickled


def _encode(share: int) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(_encode.path)  # type: ignore[attr-defined]
    tokens, share_of = 0, _SHARES[share]
    for lo in range(0, len(share_of), ENCODE_BATCH):  # diag's batch size: only its overhead differs
        part = share_of[lo:lo + ENCODE_BATCH]
        prompts = tok.encode_batch_fast([p for p, _ in part], add_special_tokens=True)
        responses = tok.encode_batch_fast([r for _, r in part], add_special_tokens=False)
        tokens += sum(len(e.ids) for e in prompts) + sum(len(e.ids) + 1 for e in responses)
    return tokens  # + 1: the EOS diag closes each record with


def tokenizers_tokens_per_s(pairs: list[tuple[str, str]], tok: str, procs: int) -> float:
    """tokenizers alone: the records' prompt and response texts (made beforehand, untimed,
    inherited by the forked processes), one share per process, in diag's batches."""
    _encode.path = str(Path(tok, "tokenizer.json"))  # type: ignore[attr-defined]
    _SHARES[:] = [pairs[i::procs] for i in range(procs)]
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        tokens = sum(pool.map(_encode, range(procs)))
    return tokens / (time.perf_counter() - start)


def real_words(path: Path, target_mb: float, seed: int) -> Path:
    """Instruction records of real English: each topic's paragraphs of the Python reference
    (pydoc_data, shipped with Python), shuffled per pass until target_mb is written."""
    import json

    from pydoc_data.topics import topics

    paras = [(name, p.strip()) for name, text in sorted(topics.items())
             for p in text.split("\n\n") if len(p.strip()) > 40]
    rng, written = random.Random(seed), 0
    with path.open("w") as f:
        while written < target_mb * 1e6:
            rng.shuffle(paras)
            for (name, a), (_, b) in zip(paras[::2], paras[1::2]):
                line = json.dumps({"instruction": f"Explain this part of Python's {name}.",
                                   "input": a, "output": b}) + "\n"
                written += f.write(line)
                if written >= target_mb * 1e6:
                    break
    return path


def rate_ratio(source: Path, tok: str, procs: int, rounds: int, work: Path) -> float:
    """Median of the per-round ratios of the build's tokens/s over tokenizers' alone."""
    pairs = [format_prompt(r) for r in read_source(source)[0]]
    ratios, built, alone = [], [], []
    for r in range(rounds):
        for side in (("build", "tokenizers") if r % 2 == 0 else ("tokenizers", "build")):
            if side == "build":
                cache = build_token_cache(source, tok, cache_dir=work / "rate", num_proc=procs,
                                          rebuild=True)
                built.append(cache.tokens / cache.seconds)
            else:
                alone.append(tokenizers_tokens_per_s(pairs, tok, procs))
        ratios.append(built[-1] / alone[-1])
    mb = source.stat().st_size / 1e6
    b, t = statistics.median(built), statistics.median(alone)
    print(f"{mb:.0f} MB: cache build {b:,.0f} tokens/s ({mb * b / cache.tokens:.2f} MB/s), "
          f"tokenizers alone {t:,.0f} tokens/s ({mb * t / cache.tokens:.2f} MB/s); medians of "
          f"{rounds} alternating rounds, ratios " + ", ".join(f"{x:.3f}" for x in ratios)
          + f"; load {os.getloadavg()[0]:.1f}")
    shutil.rmtree(work / "rate", ignore_errors=True)
    return statistics.median(ratios)


def sha(folder: Path) -> str:
    return hashlib.sha256(b"".join((folder / n).read_bytes() for n in ARRAYS)).hexdigest()


def kills(source: Path, tok: str, procs: int, n: int, work: Path) -> int:
    """n builds killed (their process group: the workers too) at a random point once they have
    started writing, each followed by a build: how many left no cache and were rebuilt
    identical. A kill that lands after the build swapped its cache in (it finished) is no
    mid-build kill: that cache must be whole and identical, and the kill is drawn again."""
    whole = build_token_cache(source, tok, cache_dir=work / "whole", num_proc=procs)
    want, length, good, killed = sha(whole.folder), whole.seconds, 0, 0
    rng = random.Random(0)
    while killed < n:
        root = work / f"kill-{killed}"
        shutil.rmtree(root, ignore_errors=True)
        child = subprocess.Popen([sys.executable, "-c", BUILD, str(source), tok, str(root),
                                  str(procs)], cwd=ROOT, start_new_session=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        while child.poll() is None and not [p for p in root.glob(".*.tmp-*") if p.is_dir()]:
            time.sleep(0.02)  # until its temporary folder exists: the build has begun
        time.sleep(rng.uniform(0.0, 0.9) * length)
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        taken = [f for f in root.iterdir() if read_meta(f) is not None]
        if taken:  # finished before the kill landed: whole, or a half cache was taken
            if sha(taken[0]) != want:
                print(f"kill {killed}: a cache that differs from the whole build was taken")
                killed += 1
            continue
        killed += 1
        again = build_token_cache(source, tok, cache_dir=root, num_proc=procs)
        good += again.status == "built" and sha(again.folder) == want
    return good


def isolation(folder: Path, tok: str, seq_len: int, windows: int = 8) -> float:
    """Max |logit difference| of every record in the first packed windows against it alone."""
    import torch
    from transformers import AutoModelForCausalLM, default_data_collator

    model = AutoModelForCausalLM.from_pretrained(tok, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    packed = PackedDataset(folder, seq_len)
    batch = default_data_collator([packed[w] for w in range(windows)])
    worst = 0.0
    with torch.no_grad():
        logits = model(**batch).logits
        for r, (positions, labels) in enumerate(zip(batch["position_ids"], batch["labels"])):
            starts = (positions == 0).nonzero().flatten().tolist() + [seq_len]
            for a, b in zip(starts, starts[1:]):
                if (labels[a:b] != -100).any():  # a record, not the padding after the last
                    alone = model(input_ids=batch["input_ids"][r:r + 1, a:b]).logits[0]
                    worst = max(worst, float((alone - logits[r, a:b]).abs().max()))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small-mb", type=float, default=30)
    ap.add_argument("--large-mb", type=float, default=300)
    ap.add_argument("--rate-mb", type=float, default=10)
    ap.add_argument("--only-rate", action="store_true", help="(b) alone: the build's rate")
    ap.add_argument("--procs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    assets = ensure_assets()
    tok = str(assets.model_dir)
    print(f"cores: {len(os.sched_getaffinity(0))}, load average: {os.getloadavg()[0]:.1f}, "
          f"processes: {args.procs}, TOKENIZERS_PARALLELISM=false")
    with tempfile.TemporaryDirectory(prefix="diag-bench-data-") as tmp:
        work = Path(tmp)
        small = real_words(work / "small.jsonl", args.small_mb, seed=1)
        large = real_words(work / "large.jsonl", args.large_mb, seed=2)
        rate = real_words(work / "rate.jsonl", args.rate_mb, seed=3)
        ratios = {mb: rate_ratio(src, tok, args.procs, rounds, work) for mb, src, rounds in (
            (args.rate_mb, rate, args.rounds), (args.large_mb, large, 1))}
        for mb, ratio in ratios.items():
            print(f"data_vs_tokenizers_{mb:g}mb: {ratio:.3f} (goal >= 0.9)")
        if args.only_rate:
            return 0 if min(ratios.values()) >= 0.9 else 1
        peaks = {}
        for name, source in (("small", small), ("large", large)):
            peaks[name], seconds = peak_pss_mb(source, tok, args.procs, work / f"rss-{name}")
            print(f"{source.stat().st_size / 1e6:.0f} MB source: peak {peaks[name]:.0f} MB "
                  f"(build and workers, PSS), {seconds:.0f} s")
        print(f"data_peak_rss_ratio: {peaks['large'] / peaks['small']:.3f} (goal <= 1.25)")


        held = build_token_cache(assets.dataset, tok, cache_dir=work / "embedded",
                                 num_proc=args.procs)
        packed = PackedDataset(held.folder, args.seq_len)
        use = packed.tokens / (len(packed) * args.seq_len)
        print(f"{held.records} embedded records in {len(packed)} windows of {args.seq_len}")
        print(f"packing_slot_use: {use:.4f} (goal >= 0.97)")
        worst = isolation(held.folder, tok, args.seq_len)
        print(f"packing_isolation_max_diff: {worst:.3g} (goal <= 1e-4)")

        kept = kills(synthetic_dataset(work / "kill.jsonl", target_mb=8, seed=3), tok,
                     args.procs, args.kills, work)
        print(f"data_kills_never_taken: {kept}/{args.kills} rebuilt identical, none taken "
              f"(goal == {args.kills}/{args.kills})")
    ok = peaks["large"] / peaks["small"] <= 1.25 and min(ratios.values()) >= 0.9 \
        and use >= 0.97 and worst <= 1e-4 and kept == args.kills
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
