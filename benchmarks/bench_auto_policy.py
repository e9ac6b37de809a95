"""Benchmark: is ``--policy auto``'s choice the faster compiled train step on this machine?

    python benchmarks/bench_auto_policy.py                      # the main job's defaults (GPT small, 32 x 128)
    python benchmarks/bench_auto_policy.py --rounds 30 --steps 3 -- --model tiny --backend aot_eager

Arguments after ``--`` are the main job's (``examples/train_gpt.py``), so the decision read here is the one
that command makes: the same key, the same cache (``$FUNCAMP_CACHE_DIR/tune``). The script

1. takes ``--policy auto``'s decision as the main job does (``train_gpt.auto_policy``: torch's report, the
   cached decision, or a measurement now) and prints it with its source;
2. builds the main job's compiled step in every candidate dtype (``train_gpt.build_run``), calls each twice
   (the first compiles), then times ``--rounds`` rounds of ``--steps`` steps of every candidate, the order
   rotated each round; per round, each half dtype's time over float32's in that round;
3. reports the median seconds per step, the median per-round ratio and its quartiles, and whether the
   chosen dtype is the faster one, or within the spread of it (a tie the decision may resolve either way).

One process: the candidates share the machine's load round by round, as in ``choose_compute_dtype``, but
with more rounds and steps; the verdict is independent of the decision's own timings.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_gpt  # noqa: E402
from gpt import GPT, config_for  # noqa: E402

import funcamp as fa  # noqa: E402


def _next_state(run: Any, box: list, batch: dict) -> None:
    """One step of ``run``'s train step on the state in ``box``, which then holds the next one (the main job's step
    donates the state it is given: a state is never passed twice)."""
    box[0], _ = run.train_step(box[0], batch)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    own, job = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds (default: 20)")
    p.add_argument("--steps", type=int, default=3, help="steps of each candidate per round (default: 3)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    bench = p.parse_args(own)
    args = train_gpt.parse_args(job)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = train_gpt.resolve_device(args.device)
    data, _ = train_gpt.load_corpus(args.data)
    cfg = config_for(args.model, vocab_size=256, block_size=args.block_size)
    args.block_size = cfg.block_size
    train, _ = train_gpt.split(data, cfg.block_size)
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)

    t0 = time.perf_counter()
    chosen_run, choice = train_gpt.auto_policy(args, model, device, 0, 1, train)
    print(f"decision ({time.perf_counter() - t0:.1f} s): {choice.explain()}", flush=True)
    cap = fa.hardware.capability(device)
    dtypes = tuple(dict.fromkeys((torch.float32, *cap.candidates, choice.dtype)))
    batch = train_gpt.get_batch(train, 1, batch_size=args.batch_size, block_size=cfg.block_size, seed=args.seed)
    batch = {k: v.to(device) for k, v in batch.items()}
    sync = getattr(getattr(torch, device.type, None), "synchronize", None) or (lambda: None)
    steps, first = {}, {}
    for dtype in dtypes:
        run = chosen_run if dtype == choice.dtype else None
        if run is None:
            run = train_gpt.build_run(
                args, train_gpt.auto_policy_for(dtype, args.master_weights), model, device, distributed=False
            )
        fn = functools.partial(_next_state, run, [run.state], batch)  # the job's step: it donates each state
        start = time.perf_counter()
        fn()
        sync()
        first[dtype] = time.perf_counter() - start
        fn()
        steps[dtype] = fn
        print(f"built {str(dtype).removeprefix('torch.')}: first call {first[dtype]:.1f} s", flush=True)
    samples: dict[torch.dtype, list[float]] = {d: [] for d in dtypes}
    for r in range(bench.rounds):
        k = r % len(dtypes)
        for dtype in dtypes[k:] + dtypes[:k]:
            sync()
            start = time.perf_counter()
            for _ in range(bench.steps):
                steps[dtype]()
            sync()
            samples[dtype].append((time.perf_counter() - start) / bench.steps)
    rows = []
    for dtype in dtypes:
        ratios = [a / b for a, b in zip(samples[dtype], samples[torch.float32])]
        low, mid, high = statistics.quantiles(ratios, n=4, method="inclusive")
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "ms_per_step": 1e3 * statistics.median(samples[dtype]),
                "ratio": statistics.median(ratios),
                "q1": low,
                "q3": high,
                "first_call_s": first[dtype],
            }
        )
    fastest = min(rows, key=lambda row: row["ratio"])
    mine = next(row for row in rows if row["dtype"] == str(choice.dtype).removeprefix("torch."))
    spread = max(row["q3"] - row["q1"] for row in rows)
    behind = mine["ratio"] - fastest["ratio"]
    if mine is fastest:
        verdict = "the chosen dtype's step is the faster one"
    elif behind <= spread:
        verdict = f"the chosen dtype is within the spread of the fastest ({behind:.3f} <= {spread:.3f})"
    else:
        verdict = f"the chosen dtype's step is SLOWER than {fastest['dtype']}'s, beyond the spread ({behind:.3f})"
    print(f"{bench.rounds} interleaved rounds x {bench.steps} steps, {device}, {torch.get_num_threads()} threads:")
    for row in rows:
        print(
            f"  {row['dtype']:9s} {row['ms_per_step']:8.1f} ms/step  ratio to float32 {row['ratio']:.3f} "
            f"(quartiles {row['q1']:.3f}-{row['q3']:.3f})  first call {row['first_call_s']:.1f} s"
        )
    print(f"chosen {mine['dtype']} ({choice.source}); {verdict}")
    result = {
        "choice": mine["dtype"],
        "source": choice.source,
        "explain": choice.explain(),
        "rows": rows,
        "verdict": verdict,
        "rounds": bench.rounds,
        "steps": bench.steps,
        "machine": choice.machine,
        "torch": torch.__version__,
    }
    if bench.json:
        Path(bench.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
