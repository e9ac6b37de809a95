"""Cost of funcamp.debug's lint and locator on the main job's GPT, as ratios to a torch.amp eager step.

python benchmarks/bench_debug.py [--model small] [--batch-size 32] [--policy bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT, config_for  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp.debug import find_first_nonfinite, lint  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="small")
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--policy", default="bfloat16", choices=["float32", "bfloat16", "float16"])
p.add_argument("--rounds", type=int, default=3, help="timed rounds, the minimum of each is reported")
args = p.parse_args()
torch.manual_seed(0)
model = GPT(config_for(args.model))
batch = torch.randint(0, 256, (args.batch_size, model.config.block_size + 1))
x, y = batch[:, :-1], batch[:, 1:]
half = getattr(torch, args.policy)
policy = "float32" if half == torch.float32 else f"params=float32,compute={args.policy},output=float32"


def amp_step():  # torch.amp eager: autocast forward, backward into .grad
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=half, enabled=half != torch.float32):
        logits = model(x)
    F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()


apply_fn, params = fa.nn.functionalize(model, policy)
loss_fn = lambda p, b: F.cross_entropy(apply_fn(p, b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())  # noqa: E731


def plain():  # the same loss_fn, eager forward and backward with no dispatch mode
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    torch.autograd.grad(loss_fn(leaves, batch), list(leaves.values()))


runs = {
    "amp": amp_step,
    "plain": plain,
    "lint": lambda: lint(loss_fn, params, batch, policy),
    "locate": lambda: find_first_nonfinite(loss_fn, params, batch),
}
times = {name: [] for name in runs}
for round in range(args.rounds + 1):  # interleaved, so that load from other processes hits all alike
    for name, fn in runs.items():
        t = time.perf_counter()
        fn()
        if round:  # round 0 warms up
            times[name].append(time.perf_counter() - t)
t_amp, t_plain, t_lint, t_loc = (min(times[name]) for name in runs)
print(f"{torch.backends.cpu.get_cpu_capability()} | GPT {args.model}, batch {args.batch_size}, {args.policy}")
print(f"torch.amp eager step {t_amp * 1e3:.0f} ms = 1 | funcamp eager forward+backward {t_plain / t_amp:.2f}")
print(f"lint {t_lint / t_amp:.2f} | find_first_nonfinite {t_loc / t_amp:.2f} (min of {args.rounds} rounds)")
