"""Step time of a small MLP: torch.amp (autocast + GradScaler + AdamW) against funcamp, in one run.

    python benchmarks/bench_mlp.py [--steps 200] [--dtype bfloat16|float16] [--threads N]

Three variants train the same MLP from the same weights on the same batches, timed interleaved in
rounds after warm-up: torch.amp eager (``torch.autocast`` + ``torch.amp.GradScaler`` +
``torch.optim.AdamW``, foreach), funcamp eager (``make_train_step(..., compile=False)``) and funcamp
compiled (the whole step, inductor). Prints median ms/step, the spread (min-max of the rounds'
medians) and the ratio to torch.amp eager. The GPT benchmark, with memory, graphs and host syncs, is
``benchmarks/bench_train_step.py``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import funcamp as fa
from funcamp import optim


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))


def batches(n: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def torch_amp_variant(model: nn.Module, dtype: torch.dtype, lr: float):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=True)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)

    def step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step


def funcamp_variant(model: nn.Module, dtype: torch.dtype, lr: float, compile: bool):
    policy = fa.Policy(torch.float32, dtype, torch.float32)
    apply_fn, params = fa.nn.functionalize(copy.deepcopy(model), policy)
    optimizer = optim.adamw(lr, weight_decay=0.01)
    loss_scale = fa.DynamicLossScale(2.0**15) if dtype == torch.float16 else fa.NoOpLossScale()
    holder = {"state": fa.TrainState.create(params, optimizer, loss_scale=loss_scale)}

    def loss_fn(params, batch):
        x, y = batch
        return nn.functional.cross_entropy(apply_fn(params, x), y)

    train_step = fa.make_train_step(loss_fn, optimizer, compile=compile)

    def step(batch):
        holder["state"], metrics = train_step(holder["state"], batch)
        return metrics["loss"]

    return step


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="timed steps per variant")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = make_model(args.width)
    data = batches(16, args.batch)
    variants = {
        "torch.amp eager": torch_amp_variant(model, dtype, 1e-3),
        "funcamp eager": funcamp_variant(model, dtype, 1e-3, compile=False),
        "funcamp compiled": funcamp_variant(model, dtype, 1e-3, compile=True),
    }
    for step in variants.values():  # warm-up (and compile)
        for i in range(5):
            step(data[i])
    per_round = max(1, args.steps // args.rounds)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, step in variants.items():
            start = time.perf_counter()
            for i in range(per_round):
                loss = step(data[(r * per_round + i) % len(data)])
            float(loss)  # wait for the work (a host read, outside the timed steps' loop body)
            times[name].append((time.perf_counter() - start) / per_round * 1e3)
    base = statistics.median(times["torch.amp eager"])
    print(
        f"MLP 256-{args.width}-{args.width}-10, batch {args.batch}, {args.dtype} compute, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print("| variant | ms/step (median) | spread | vs torch.amp eager |")
    print("|---|---:|---:|---:|")
    result = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        result[name] = med
        print(f"| {name} | {med:.2f} | {min(ts):.2f}-{max(ts):.2f} | {med / base:.2f} |")
    return result


if __name__ == "__main__":
    main()
