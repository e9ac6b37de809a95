"""Benchmark: a scanned run's flat layout, name-major (``TrainState.create(scan=apply_fn.scan)``) against per layer.

    python benchmarks/bench_scan_layout.py first --layout name-major     # the first step, one process
    python benchmarks/bench_scan_layout.py first --layout per-layer      # (alternate the two, fresh processes)
    python benchmarks/bench_scan_layout.py steady                        # both layouts in one process, interleaved
    python benchmarks/bench_scan_layout.py steady --no-donate --policy params=float32,compute=float32,output=float32

The model is GPT-2 124M's body (``bench_graph_size.py``'s ``gpt2-body``: 12 layers of width 768, vocabulary 256),
its step the main job's (``examples/train_gpt.py``'s ``build_run``: ``functionalize(scan="auto")``, which scans
the 12 blocks, AdamW with the clip and the schedule, donating unless ``--no-donate``), over a state laid out
``--layout``: ``name-major`` (each parameter name's layers end to end in one buffer: the scan's stack a view of it)
or ``per-layer`` (each layer's parameters in buffers of their own, as without ``scan=``).

``first``: a fresh inductor cache (``--cache-dir``, default a new temporary one), the first step timed, then
``--steps`` more; prints ``compile_times()``'s phases (seconds) and, with ``--code``, the generated C++ kernels'
count, lines and loops. ``steady``: both layouts' steps compiled in one process, then ``--rounds`` rounds of
``--steps`` steps of each in turn, the order reversed each round; prints each layout's median step, the median of
the rounds' ratios (name-major / per-layer), and what one step allocates over the state at rest (the profiler's
CPU-allocator peak, ``bench_train_step.profiled_step``). ``--keep-freed-memory``: the main job's ``mallopt``
(freed memory kept by the C library) first. Run each through ``../shared/tools/quiet``; docs/benchmarks.md has the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]

LAYOUTS = ("name-major", "per-layer")


def _build(args: argparse.Namespace):
    import bench_graph_size as bgs
    import torch

    import funcamp as fa

    extra = ["--scan", "auto", "--batch-size", str(args.batch_size), "--block-size", str(args.block_size)]
    train_gpt, jargs = bgs._job_args("gpt2-body", [*extra, *([] if args.donate else ["--no-donate"])])
    net = bgs._model(train_gpt, jargs, None)
    batch = bgs._batch(train_gpt, jargs)
    policy = train_gpt.make_policy(fa.get_policy(args.policy), jargs.master_weights)
    run = train_gpt.build_run(jargs, policy, net, torch.device("cpu"), distributed=False)
    if run.apply_fn.scan != ("blocks",):
        raise SystemExit(f"expected the blocks scanned, got {run.apply_fn.scan}")

    def state(layout: str):
        scan = run.apply_fn.scan if layout == "name-major" else ()
        return fa.TrainState.create(run.params, run.optimizer, loss_scale=run.loss_scale, policy=policy, scan=scan)

    return train_gpt, run, batch, state


def first(args: argparse.Namespace) -> dict:
    import torch._dynamo.utils as dynamo_utils

    _, run, batch, make_state = _build(args)
    state = make_state(args.layout)
    print(state.storage.describe(), flush=True)
    t0 = time.perf_counter()
    counts = {}
    if args.code:
        import re

        from torch._inductor.utils import run_and_get_code

        (state, metrics), codes = run_and_get_code(run.train_step, state, batch)
        kernels = re.findall(r"async_compile.cpp_pybinding\(\[[^\]]*\], r'''(.*?)'''", "\n".join(codes), re.S)
        loops = sorted((k.count("for(int64_t") for k in kernels), reverse=True)
        counts = {"kernels": len(kernels), "lines": sum(len(k.splitlines()) for k in kernels), "loops": sum(loops)}
        counts["largest_loops"] = loops[:3]
    else:
        state, metrics = run.train_step(state, batch)
    loss = float(metrics["loss"])
    elapsed = time.perf_counter() - t0
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = run.train_step(state, batch)
        float(metrics["loss"])
        steps.append(round((time.perf_counter() - t0) * 1000))
    phases = dynamo_utils.compilation_time_metrics
    keys = ("_compile.compile_inner", "bytecode_tracing", "compile_fx.<locals>.fw_compiler_base", "async_compile.wait")
    return {
        "layout": args.layout,
        "first_s": round(elapsed, 1),
        "loss": loss,
        "steps_ms": steps,
        **{k: round(sum(phases.get(k, [0])), 1) for k in keys},
        **counts,
    }


def steady(args: argparse.Namespace) -> dict:
    import train_gpt
    from bench_train_step import profiled_step

    import funcamp as fa

    allocator = train_gpt.keep_freed_memory() if args.keep_freed_memory else "as it comes"
    _, run, batch, make_state = _build(args)

    states = {layout: make_state(layout) for layout in LAYOUTS}
    steps = {layout: fa.make_train_step(run.loss_fn, run.optimizer, donate=args.donate) for layout in LAYOUTS}
    for layout in LAYOUTS:  # compiled, then one more step
        for _ in range(2):
            states[layout], metrics = steps[layout](states[layout], batch)
            float(metrics["loss"])
    adds = {}
    for layout in LAYOUTS:

        def one(layout: str = layout) -> None:
            states[layout], metrics = steps[layout](states[layout], batch)
            float(metrics["loss"])

        adds[layout] = round(profiled_step(one)[0] / 1e6, 1)
    samples = {layout: [] for layout in LAYOUTS}
    order = list(LAYOUTS)
    for _ in range(args.rounds):
        for layout in order:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                states[layout], metrics = steps[layout](states[layout], batch)
            float(metrics["loss"])
            samples[layout].append((time.perf_counter() - t0) / args.steps)
        order.reverse()
    ratios = [a / b for a, b in zip(samples["name-major"], samples["per-layer"], strict=True)]
    return {
        "donate": args.donate,
        "allocator": allocator,
        "median_ms": {k: round(statistics.median(v) * 1000, 1) for k, v in samples.items()},
        "ratio_median": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        "adds_MB": adds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("first", "steady"))
    p.add_argument("--layout", choices=LAYOUTS, default="name-major", help="first: the state's layout")
    p.add_argument("--donate", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--policy", default="params=float32,compute=bfloat16,output=float32")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6, help="steady: interleaved rounds")
    p.add_argument("--code", action="store_true", help="first: count the generated kernels")
    p.add_argument("--keep-freed-memory", action="store_true", help="steady: the main job's mallopt first")
    p.add_argument("--cache-dir", default=None, help="inductor cache (default: a fresh temporary one)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="bench_scan_layout_")
    import torch

    torch.set_num_threads(args.threads)
    result = first(args) if args.mode == "first" else steady(args)
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
