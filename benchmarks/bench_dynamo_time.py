"""Benchmark: Dynamo's seconds tracing the main job's step, this checkout against another, interleaved processes.

    python benchmarks/bench_dynamo_time.py --baseline /path/to/other/checkout --rounds 3

Each run is a fresh process that builds the main job's step for ``--model`` (``bench_graph_size.py``'s models:
``gpt2-body``, the unrolled GPT-2 124M body, or ``small``) with ``--backend eager`` (Dynamo only: nothing is
lowered or compiled after the trace), calls it once and prints ``torch._dynamo.utils.compile_times()``'s
``bytecode_tracing`` (Dynamo's symbolic run of the step), ``_compile.compile_inner`` (all of Dynamo's compile,
guards and bytecode included), ``get_fake_value`` and ``build_guards``, in seconds. With ``--baseline``, the
other checkout's funcamp (its ``funcamp/`` and ``examples/``) runs in turn, round by round, the order alternating;
the last lines give each round's ratio. Bytecode counts, which do not move with the machine, are
``bench_graph_size.py``'s. Run it through ``../shared/tools/quiet``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEYS = ("bytecode_tracing", "_compile.compile_inner", "get_fake_value", "build_guards")

_CHILD = """
import json, sys
root, model, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path[:0] = [root, root + "/examples", {here!r}]
import torch
torch.set_num_threads(threads)
import funcamp as fa
assert fa.__file__.startswith(root), (fa.__file__, root)
import bench_graph_size as bgs
import torch._dynamo.utils as du
train_gpt, jargs = bgs._job_args(model, ["--scan", "off", "--backend", "eager"])
net = bgs._model(train_gpt, jargs, None)
batch = bgs._batch(train_gpt, jargs)
policy = train_gpt.make_policy(fa.get_policy(bgs.POLICY), jargs.master_weights)
run = train_gpt.build_run(jargs, policy, net, torch.device("cpu"), distributed=False)
run.train_step(run.state, batch)
times = du.compilation_time_metrics
print("RESULT " + json.dumps({{k: round(sum(times.get(k, [0.0])), 3) for k in {keys!r}}}))
"""


def _one(root: Path, model: str, threads: int) -> dict[str, float]:
    code = _CHILD.format(here=str(HERE), keys=KEYS)
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), model, str(threads)], capture_output=True, text=True, env=env
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
    args = p.parse_args()
    roots = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    got: dict[str, list[dict[str, float]]] = {name: [] for name in roots}
    for r in range(args.rounds):
        order = list(roots.items()) if r % 2 == 0 else list(roots.items())[::-1]
        for name, root in order:
            got[name].append(_one(root, args.model, args.threads))
            print(f"round {r + 1}: {name} ({root}): {got[name][-1]}", flush=True)
    for name, runs in got.items():
        med = {k: round(statistics.median(run[k] for run in runs), 2) for k in KEYS}
        print(f"{name}: medians {med}")
    if args.baseline:
        ratios = [a["bytecode_tracing"] / b["bytecode_tracing"] for a, b in zip(got["this"], got["baseline"])]
        print("bytecode_tracing this / baseline, by round: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
