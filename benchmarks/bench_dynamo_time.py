"""Benchmark: Dynamo's seconds tracing the main job's step, this checkout against another, interleaved processes.

    python benchmarks/bench_dynamo_time.py --baseline /path/to/other/checkout --rounds 3

Each run is a fresh process that builds the main job's step for ``--model`` (``bench_graph_size.py``'s models:
``gpt2-body``, GPT-2 124M's body, unrolled or with ``--scan auto`` its 12 blocks stacked and one traced, or
``small``) with ``--backend eager`` (Dynamo only: nothing is lowered or compiled after the trace), calls it once
and prints ``torch._dynamo.utils.compile_times()``'s
``bytecode_tracing`` (Dynamo's symbolic run of the step), ``_compile.compile_inner`` (all of Dynamo's compile,
guards and bytecode included), ``get_fake_value`` and ``build_guards``, in seconds. With ``--baseline``, the
other checkout's funcamp (its ``funcamp/`` and ``examples/``) runs in turn, round by round, the order alternating;
the last lines give each round's ratio. Bytecode counts, which do not move with the machine, are
``bench_graph_size.py``'s. Run it through ``../shared/tools/quiet``.

    python benchmarks/bench_dynamo_time.py --rounds 1 --by-function 40   # where Dynamo's time goes

``--by-function N`` also prints, per round, the N functions of the step (funcamp's, the model's, torch's) in which
Dynamo spent the most time, inclusive of what each called, with the number of times Dynamo inlined each: a timer
around Dynamo's ``InliningInstructionTranslator.inline_call_`` (the seconds are Dynamo's symbolic run of that
function, not the function's own run, and include the timer's own cost). docs/benchmarks.md reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEYS = ("bytecode_tracing", "_compile.compile_inner", "get_fake_value", "build_guards")

_CHILD = """
import collections, json, sys, time
root, model, threads, top, scan = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
sys.path[:0] = [root, root + "/examples", {here!r}]
import torch
torch.set_num_threads(threads)
import funcamp as fa
assert fa.__file__.startswith(root), (fa.__file__, root)
import bench_graph_size as bgs
import torch._dynamo.utils as du
train_gpt, jargs = bgs._job_args(model, ["--scan", scan, "--backend", "eager"])
net = bgs._model(train_gpt, jargs, None)
batch = bgs._batch(train_gpt, jargs)
policy = train_gpt.make_policy(fa.get_policy(bgs.POLICY), jargs.master_weights)
run = train_gpt.build_run(jargs, policy, net, torch.device("cpu"), distributed=False)
spent, calls, active = collections.Counter(), collections.Counter(), collections.Counter()
if top:
    from torch._dynamo import symbolic_convert as sc
    inline = sc.InliningInstructionTranslator.inline_call_

    def timed(tracer, inline=inline):
        code = tracer.f_code
        name = code.co_filename.split("site-packages/")[-1].replace(root + "/", "") + ":" + code.co_name
        active[name] += 1
        t0 = time.perf_counter()
        try:
            return inline(tracer)
        finally:
            active[name] -= 1
            calls[name] += 1
            if not active[name]:  # a recursive call's time counted once, at its outermost call
                spent[name] += time.perf_counter() - t0

    sc.InliningInstructionTranslator.inline_call_ = timed
run.train_step(run.state, batch)
times = du.compilation_time_metrics
result = {{k: round(sum(times.get(k, [0.0])), 3) for k in {keys!r}}}
result["by_function"] = [[n, round(s, 3), calls[n]] for n, s in spent.most_common(top)]
print("RESULT " + json.dumps(result))
"""


def _one(root: Path, model: str, threads: int, top: int = 0, scan: str = "off") -> dict[str, Any]:
    code = _CHILD.format(here=str(HERE), keys=KEYS)
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), model, str(threads), str(top), scan],
        capture_output=True,
        text=True,
        env=env,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"bench_dynamo_time: the run of {root} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-body", choices=("gpt2-body", "small"))
    p.add_argument("--baseline", type=Path, default=None, help="another checkout of funcamp to run in turn")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--scan",
        default="off",
        choices=("off", "auto"),
        help="the job's --scan: off (default), every block traced; auto, GPT-2's 12 blocks stacked and one traced",
    )
    p.add_argument("--by-function", type=int, default=0, metavar="N", help="print the N functions Dynamo spent most in")
    args = p.parse_args()
    roots = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    got: dict[str, list[dict[str, float]]] = {name: [] for name in roots}
    for r in range(args.rounds):
        order = list(roots.items()) if r % 2 == 0 else list(roots.items())[::-1]
        for name, root in order:
            got[name].append(_one(root, args.model, args.threads, args.by_function, args.scan))
            by_function = got[name][-1].pop("by_function")
            print(f"round {r + 1}: {name} ({root}): {got[name][-1]}", flush=True)
            if by_function:
                print("  Dynamo's seconds inside each function (inclusive), and the times it was inlined:")
                for fn, seconds, n in by_function:
                    print(f"  {seconds:8.2f} s {n:6d}  {fn}")
    for name, runs in got.items():
        med = {k: round(statistics.median(run[k] for run in runs), 2) for k in KEYS}
        print(f"{name}: medians {med}")
    if args.baseline:
        ratios = [a["bytecode_tracing"] / b["bytecode_tracing"] for a, b in zip(got["this"], got["baseline"])]
        print("bytecode_tracing this / baseline, by round: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
