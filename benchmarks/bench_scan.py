"""Benchmark: does a scan over stacked layers compile a repeated GPT block once? Cold compile, unrolled vs scan.

    python benchmarks/bench_scan.py --layers 2,4,8,12 --backends aot_eager,inductor --rounds 1
    python benchmarks/bench_scan.py --layers 2,12 --backends inductor --rounds 2 --out benchmarks/results/x.json

The question behind funcamp's stacking of a run of identical blocks. A step as funcamp's compiled step is:
``torch.autograd.grad`` traced by Dynamo (``torch._dynamo.config.trace_autograd_ops = True``; torch.func's grad
cannot differentiate a higher-order op inside ``torch.compile`` on torch 2.13) over ``L`` blocks of the main job's
GPT (``examples/gpt.py``'s ``Block``: pre-norm LayerNorm, attention through ``scaled_dot_product_attention``,
GELU MLP; width 128, 4 heads, context 128, batch 8), computing in bfloat16 with float32 master parameters and the
LayerNorms in float32 (the casts of funcamp's default policy ``params=float32,compute=bfloat16,output=float32``),
then an SGD update of every parameter, all in one ``fullgraph=True`` graph. Two routes:

* ``unrolled``: the blocks called one after the other (what ``torch.compile`` of funcamp's step traces today);
* ``scan``: the per-layer parameter leaves ``torch.stack``-ed inside the step on a leading layer axis and
  ``torch._higher_order_ops.scan`` running one block (``torch.func.functional_call`` on one module) over them,
  as flax's ``nn.scan`` and Haiku's ``layer_stack`` do. The state keeps its per-layer leaves.

Each configuration runs in a fresh process with a fresh, empty ``TORCHINDUCTOR_CACHE_DIR``, and reports the first
call (``compile s``: Dynamo, AOTAutograd, inductor and the C++ compiler), the median of 5 later calls
(``step ms``) and the largest difference of its gradients from the eager unrolled step's (``max |dg|``, computed
in the same process). Configurations run interleaved (each round: every layer count, backend and route in turn,
the routes' order alternating), so that a shared machine's load falls on both routes alike: read the per-round
ratios scan / unrolled, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from gpt import Block, GPTConfig  # noqa: E402

ROUTES = ("unrolled", "scan")
BF16 = torch.bfloat16


def _policy_block(cfg: GPTConfig) -> torch.nn.Module:
    """One Block with the default policy's casts: LayerNorms on float32 inputs, output in bfloat16."""
    block = Block(cfg)
    for ln in (block.ln1, block.ln2):
        forward = ln.forward
        ln.forward = lambda x, forward=forward: forward(x.float()).to(BF16)
    return block


def _forward_dtype(name: str, p: torch.Tensor) -> torch.Tensor:
    return p if name.startswith("ln") else p.to(BF16)


def build(layers: int, seed: int = 0) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor, list[str]]:
    """``(template, params, x, names)``: per-layer float32 parameters ``"{i}.{name}"``, an input ``(8, 128, 128)``."""
    cfg = GPTConfig(block_size=128, n_layer=layers, n_head=4, n_embd=128)
    torch.manual_seed(seed)
    template = _policy_block(cfg)
    names = [n for n, _ in template.named_parameters()]
    params = {}
    for i in range(layers):
        for n, p in Block(cfg).named_parameters():
            params[f"{i}.{n}"] = p.detach().clone()
    x = torch.randn(8, 128, 128)
    return template, params, x, names


def make_loss(template: Any, names: list[str], layers: int, route: str) -> Any:
    def block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(template, {n: _forward_dtype(n, v) for n, v in p.items()}, (h,))

    def unrolled(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = x.to(BF16)
        for i in range(layers):
            h = block({n: params[f"{i}.{n}"] for n in names}, h)
        return h.float().square().mean()

    def scan(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops import scan

        stacked = {n: torch.stack([params[f"{i}.{n}"] for i in range(layers)]) for n in names}

        def body(h: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            return block(p, h).clone(), h.new_zeros(())

        h, _ = scan(body, x.to(BF16), stacked)
        return h.float().square().mean()

    return unrolled if route == "unrolled" else scan


def make_step(loss: Any, lr: float = 0.1) -> Any:
    def step(params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[dict, dict, torch.Tensor]:
        ps = {k: v.detach().requires_grad_() for k, v in params.items()}
        with torch.enable_grad():
            value = loss(ps, x)
        grads = dict(zip(ps, torch.autograd.grad(value, list(ps.values()))))
        return {k: params[k] - lr * g for k, g in grads.items()}, grads, value.detach()

    return step


def worker(layers: int, route: str, backend: str) -> dict[str, Any]:
    torch._dynamo.config.trace_autograd_ops = True
    template, params, x, names = build(layers)
    _, ref, ref_loss = make_step(make_loss(template, names, layers, "unrolled"))(params, x)
    step = torch.compile(make_step(make_loss(template, names, layers, route)), fullgraph=True, backend=backend)
    t0, c0 = time.perf_counter(), _cpu_s()
    new, grads, value = step(params, x)
    compile_s, cpu_s = time.perf_counter() - t0, _cpu_s() - c0
    times = []
    for _ in range(5):
        t = time.perf_counter()
        step(params, x)
        times.append(time.perf_counter() - t)
    return {
        "layers": layers,
        "route": route,
        "backend": backend,
        "compile_s": compile_s,
        "compile_cpu_s": cpu_s,
        "step_ms": 1e3 * statistics.median(times),
        "max_abs_grad_diff": max((grads[k] - ref[k]).abs().max().item() for k in ref),
        "max_abs_grad": max(g.abs().max().item() for g in ref.values()),
        "loss_diff": (value - ref_loss).abs().item(),
        "torch": torch.__version__,
    }


def _cpu_s() -> float:
    """CPU seconds of this process and of its children reaped so far (the C++ compiler, with one compile thread)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_one(layers: int, route: str, backend: str, threads: int, compile_threads: int = 0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench_scan_") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
        if compile_threads:
            env["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, __file__, "--worker", f"{layers},{route},{backend}"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        return {"layers": layers, "route": route, "backend": backend, "error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="2,4,8,12")
    p.add_argument("--backends", default="aot_eager,inductor")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--compile-threads",
        type=int,
        default=0,
        help="TORCHINDUCTOR_COMPILE_THREADS for the workers (1: the C++ compiler runs as a child of the worker, so "
        "that compile cpu s counts it; default: inductor's own choice)",
    )
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        layers, route, backend = args.worker.split(",")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        print(json.dumps(worker(int(layers), route, backend)))
        return
    rows = []
    for r in range(args.rounds):
        for backend in args.backends.split(","):
            for layers in map(int, args.layers.split(",")):
                routes = ROUTES if (r + layers) % 2 == 0 else ROUTES[::-1]
                for route in routes:
                    row = {**run_one(layers, route, backend, args.threads, args.compile_threads), "round": r}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:
                        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    report(rows)


def report(rows: list[dict[str, Any]]) -> None:
    """Per backend and layer count: medians per route, and the per-round ratios scan / unrolled (wall, cpu)."""
    print("\nbackend    layers  route    compile s  cpu s   step ms  max |dg|  scan/unrolled per round: wall; cpu")
    for backend in dict.fromkeys(r["backend"] for r in rows):
        for layers in dict.fromkeys(r["layers"] for r in rows):
            by = [r for r in rows if r["backend"] == backend and r["layers"] == layers and "error" not in r]
            wall, cpu = [], []
            for rnd in dict.fromkeys(r["round"] for r in by):
                pair = {r["route"]: r for r in by if r["round"] == rnd}
                if len(pair) == 2:
                    wall.append(pair["scan"]["compile_s"] / pair["unrolled"]["compile_s"])
                    if "compile_cpu_s" in pair["scan"] and "compile_cpu_s" in pair["unrolled"]:
                        cpu.append(pair["scan"]["compile_cpu_s"] / pair["unrolled"]["compile_cpu_s"])
            for route in ROUTES:
                rs = [r for r in by if r["route"] == route]
                if not rs:
                    continue
                c = statistics.median(r["compile_s"] for r in rs)
                u = statistics.median(r.get("compile_cpu_s", float("nan")) for r in rs)
                s = statistics.median(r["step_ms"] for r in rs)
                d = max(r["max_abs_grad_diff"] for r in rs)
                ratio = " ".join(f"{q:.2f}" for q in wall) + "; " + " ".join(f"{q:.2f}" for q in cpu)
                ratio = ratio if route == "scan" else ""
                print(f"{backend:10} {layers:6}  {route:8} {c:9.1f} {u:6.1f} {s:8.1f}  {d:.1e}  {ratio}")
    for r in rows:
        if "error" in r:
            print("error:", r)


if __name__ == "__main__":
    main()
