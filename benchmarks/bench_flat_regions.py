"""Benchmark: the flat update compiled once per kind of buffer against over all buffers at once, steady step.

    python benchmarks/bench_flat_regions.py --rounds 6 --steps 4
    python benchmarks/bench_flat_regions.py --rounds 6 --steps 4 --variants regions,regions_casts_off
    python benchmarks/bench_flat_regions.py --rounds 6 --steps 4 --no-donate

One process builds the main job's unrolled GPT-2 124M body (``bench_graph_size.py``'s ``gpt2-body``: 12 layers, width
768, vocabulary 256, context 128, batch 4, bf16 compute, clip + AdamW, donating; ``--no-donate``: the pure step,
whose regions return new buffers) twice: once with its flat update
in regions (``funcamp.train._flat_regions``, 62 buffers of 6 kinds), once with the regions off
(``MIN_REUSED`` out of reach); or, ``regions_casts_off``, with the regions but the ``region_casts`` graph pass
off (``FUNCAMP_PASSES_OFF``: each weight's bfloat16 gradient widened into a float32 copy before its region);
compiles both (the second compile reuses kernels the first cached: the first-step figures printed are not a
comparison, ``bench_first_step.py --baseline`` is), then times ``--steps`` steps of each
in turn for ``--rounds`` rounds (the order alternating) and prints each round's ms per step and their ratio.
Run it through ``../shared/tools/quiet``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import bench_graph_size as bgs  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp.train import _flat_regions  # noqa: E402

#: name -> (``MIN_REUSED``, None for the default; ``FUNCAMP_PASSES_OFF`` while it compiles)
VARIANTS = {"regions": (None, ""), "whole": (10**9, ""), "regions_casts_off": (None, "region_casts")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--donate", action=argparse.BooleanOptionalAction, default=True, help="donating steps (default: on)")
    p.add_argument("--variants", default="regions,whole", help=f"two of {', '.join(VARIANTS)} (default: regions,whole)")
    args = p.parse_args()
    names = args.variants.split(",")
    if len(names) != 2 or not set(names) <= set(VARIANTS):
        p.error(f"--variants: two of {', '.join(VARIANTS)}; got {args.variants!r}")
    torch.set_num_threads(args.threads)
    train_gpt, jargs = bgs._job_args("gpt2-body", ["--scan", "off", "--donate" if args.donate else "--no-donate"])
    batch = bgs._batch(train_gpt, jargs)
    policy = train_gpt.make_policy(fa.get_policy(bgs.POLICY), jargs.master_weights)
    runs = {}
    for name in names:
        reuse, off = VARIANTS[name]
        kept = _flat_regions.MIN_REUSED
        _flat_regions.MIN_REUSED = kept if reuse is None else reuse
        run = train_gpt.build_run(
            jargs, policy, bgs._model(train_gpt, jargs, None), torch.device("cpu"), distributed=False
        )
        _flat_regions.MIN_REUSED = kept
        print(name, run.state.storage.describe(), flush=True)
        t0 = time.time()
        os.environ["FUNCAMP_PASSES_OFF"] = off  # read when the step compiles, at its first call
        state, metrics = run.train_step(run.state, batch)
        float(metrics["loss"])
        os.environ.pop("FUNCAMP_PASSES_OFF")
        print(f"{name}: first step {time.time() - t0:.1f} s", flush=True)
        for _ in range(2):
            state, metrics = run.train_step(state, batch)
        runs[name] = [run, state]
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            run, state = runs[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = run.train_step(state, batch)
            float(metrics["loss"])
            times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
            runs[name][1] = state
    for name, ts in times.items():
        print(f"{name}: ms/step per round {[round(t) for t in ts]}, median {sorted(ts)[len(ts) // 2]:.0f}")
    a, b = names
    print(f"{a} / {b} per round:", [round(x / y, 3) for x, y in zip(times[a], times[b], strict=True)])


if __name__ == "__main__":
    main()
