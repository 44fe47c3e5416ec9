"""A plain training loop in the shape of nanoGPT's train.py (no Trainer, no Lightning): a tiny
GPT on a token memmap, get_batch(), gradient accumulation, a pause in time.sleep outside every
stage (as a logging call would), timed by itself. `python nanogpt_loop.py TRUTH.json SECONDS`
prints "ready" once torch is imported, trains for about SECONDS, then writes its own seconds
of data_wait (get_batch), compute (forward, backward, step, loss.item()) and other, and the share
of its wall its thread waited for a CPU while runnable (waited: /proc/thread-self/schedstat)."""

import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

truth_path, seconds = sys.argv[1], float(sys.argv[2])
block_size, batch_size, vocab, n_embd = 32, 8, 256, 64
gradient_accumulation_steps = 2
pause = 0.02  # seconds asleep per iteration, outside every stage
device = "cpu"
data_path = os.path.join(tempfile.mkdtemp(), "train.bin")
np.random.default_rng(0).integers(0, vocab, 200_000, dtype=np.uint16).tofile(data_path)


def get_batch(split):
    data = np.memmap(data_path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64))
                     for i in ix])
    x, y = x.to(device), y.to(device)
    return x, y


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, n_embd)
        self.wpe = torch.nn.Embedding(block_size, n_embd)
        self.h = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.LayerNorm(n_embd), torch.nn.Linear(n_embd, 4 * n_embd), torch.nn.GELU(),
            torch.nn.Linear(4 * n_embd, n_embd)) for _ in range(2)])
        self.lm_head = torch.nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.h(self.wte(idx) + self.wpe(pos))
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


torch.manual_seed(1337)
model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
spent = {"data_wait": 0.0, "compute": 0.0, "other": 0.0}
X, Y = get_batch("train")
model(X, Y)[1].backward()  # the first step's start-up (lazy imports) before the clock runs
optimizer.step()
optimizer.zero_grad(set_to_none=True)
print("ready", flush=True)


def run_delay_s() -> float:
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


delay0 = run_delay_s()
t_start = t0 = time.perf_counter()
while time.perf_counter() - t_start < seconds:
    for _micro_step in range(gradient_accumulation_steps):
        t1 = time.perf_counter()
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        t2 = time.perf_counter()
        X, Y = get_batch("train")
        t3 = time.perf_counter()
        loss.backward()
        t4 = time.perf_counter()
        spent["compute"] += (t2 - t1) + (t4 - t3)
        spent["data_wait"] += t3 - t2
    t5 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lossf = loss.item() * gradient_accumulation_steps
    t6 = time.perf_counter()
    spent["compute"] += t6 - t5
    time.sleep(pause)  # outside every stage: what a logging call or a throttle costs
t_end = time.perf_counter()
spent["other"] = (t_end - t0) - spent["compute"] - spent["data_wait"]
spent["waited"] = (run_delay_s() - delay0) / (t_end - t0)
with open(truth_path, "w") as f:
    json.dump(spent, f)
sys.stdout.flush()
os._exit(0)
