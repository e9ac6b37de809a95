"""Inductor's ``reorder_for_locality`` on and off for funcamp's compiled step: step time, interleaved.

    python benchmarks/bench_locality.py --model gpt --rounds 8

The compiled step turns the pass off (``funcamp.train._assemble.inductor_options``: inductor takes the one
forward-and-backward graph for an inference graph and moved every weight gradient's matmul to the end of the
backward, which costs memory; see docs/memory.md). This checks that turning it off costs no time: the same
model (``bench_memory.make``), ``make_train_step(donate=True)`` with bfloat16 compute, built twice with the
option off and on, the first steps timed once each (they compile), then ``--rounds`` rounds of 3 steps of each,
the order alternating between rounds; prints the median and best ms/step and their ratio (off / on).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import bench_memory  # noqa: E402

import funcamp.train._assemble as step_module  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=("mlp", "gpt", "gpt2"))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    options = step_module.inductor_options
    steps = {}
    try:
        for name, on in (("off", False), ("on", True)):
            step_module.inductor_options = lambda on=on: {**(options() or {}), "reorder_for_locality": on}
            model, batches, loss = bench_memory.make(args.model, torch.device("cpu"))
            step = bench_memory.build("funcamp_compiled_donate", model, loss, torch.bfloat16, "inductor")
            steps[name] = (step, batches(1 + 3 * args.rounds))
    finally:
        step_module.inductor_options = options
    for name, (step, data) in steps.items():
        t0 = time.perf_counter()
        step(data[0])
        print(f"{name}: first step {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            step, data = steps[name]
            t0 = time.perf_counter()
            for i in range(3):
                step(data[1 + 3 * r + i])
            times[name].append((time.perf_counter() - t0) / 3 * 1e3)
    for name, t in times.items():
        print(f"{name}: median {statistics.median(t):.1f} ms, best {min(t):.1f} ms, rounds {[round(x) for x in t]}")
    med = statistics.median(times["off"]) / statistics.median(times["on"])
    print(f"off / on: median {med:.3f}, best {min(times['off']) / min(times['on']):.3f}")
    return times


if __name__ == "__main__":
    main()
