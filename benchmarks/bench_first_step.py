"""Benchmark: time to the first train step (compilation included), funcamp against torch.compile(model).

    python benchmarks/bench_first_step.py --config tiny --threads 1 --repeats 3
    python benchmarks/bench_first_step.py --config tiny --threads 1 --repeats 3 --main-job-steps 400

What a user waits for before training starts. Two variants of ``benchmarks/bench_train_step.py`` on the same
GPT, batch and dtype (bfloat16 compute by default):

* ``amp_compile``: ``torch.autocast`` + ``torch.amp.GradScaler`` + ``torch.optim.AdamW`` (fused) with
  ``torch.compile(model)``; the first step compiles the forward graph, then the backward one.
* ``funcamp_compile``: ``funcamp.make_train_step`` compiled whole (``fullgraph=True``): forward, backward,
  unscale, finite check, AdamW and the skip logic in one graph.

Each run is a fresh process that builds the variant (deep copy of the model, ``functionalize``,
``torch.compile``'s wrapper) and times, on the wall clock, building it plus its first step (``first step s``),
then ``--steps`` more steps one by one after ``--warmup`` (``ms/step``: their median). ``cold``: a fresh, empty
inductor cache (``TORCHINDUCTOR_CACHE_DIR``); ``warm``: a second process on the cache the cold one filled (FX
graph and kernel caches hit). ``--repeats`` rounds, the variants' order rotated each round; reported: the
median and the min-max spread of each figure, and the ratio of medians funcamp / torch.compile(model). The
machine may be shared: only ratios of runs made in the same rounds are compared.

``--main-job-steps N`` also times, cold, the main job ``examples/train_gpt.py`` (its defaults on this device,
``--steps N``) from process start to exit, against a plain loop of N steps of ``torch.compile(model)`` and
``torch.optim.AdamW`` on the same GPT, batch and compute dtype (the main job's policy on this device), which
has no validation, checkpoints or logging: a lower bound for a torch.amp main job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train_step as bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("amp_compile", "funcamp_compile")
#: The variant funcamp_compile run with the funcamp of ``--baseline`` (on PYTHONPATH).
BASELINE = "funcamp_compile@base"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(bench.SIZES), help="GPT size of examples/gpt.py")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="compute dtype")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads in each run")
    p.add_argument("--repeats", type=int, default=3, help="rounds of (cold, warm) runs per variant")
    p.add_argument("--steps", type=int, default=10, help="timed steps after the first (steady ms/step)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps between the first and the timed ones")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--main-job-steps", type=int, default=0, help="also time the main job for N steps (0: skip)")
    p.add_argument(
        "--baseline",
        default=None,
        metavar="PATH",
        help="also run funcamp_compile with the funcamp package of another checkout at PATH\n"
        "(e.g. `git worktree add /tmp/base <commit>`), as the variant funcamp_compile@base",
    )
    p.add_argument("--json", default="benchmarks/results/bench_first_step.json")
    p.add_argument("--markdown", default="benchmarks/results/bench_first_step.md")
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one variant in this process
    p.add_argument("--torch-loop", type=int, default=0, help=argparse.SUPPRESS)  # internal: the main job's baseline
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    for name in ("repeats", "steps", "warmup", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.baseline:
        if not (Path(args.baseline) / "funcamp" / "__init__.py").exists():
            p.error(f"--baseline: {args.baseline} holds no funcamp/__init__.py")
        args.variants.append(BASELINE)
    return args


def _bench_args(args: argparse.Namespace) -> argparse.Namespace:
    return bench.parse_args(["--config", args.config, "--dtype", args.dtype, "--threads", str(args.threads)])


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """In this fresh process: build ``args.run``, time it to the end of its first step, then steady steps."""
    torch.set_num_threads(args.threads)
    bargs = _bench_args(args)
    args.run = args.run.removesuffix("@base")  # the same variant; which funcamp is PYTHONPATH's business
    device = torch.device("cpu")
    n = 1 + args.warmup + args.steps
    batches = bench.make_batches(
        n, batch_size=bargs.batch_size, block_size=bench.block_size(bargs), seed=0, device=device
    )
    model = bench.make_model(bargs, device)
    t0 = time.perf_counter()
    step = bench.build_variant(args.run, model, bargs)
    loss = step(batches[0])
    first = time.perf_counter() - t0
    graphs = bench.compiled_graphs()
    for b in batches[1 : 1 + args.warmup]:
        loss = step(b)
    samples = []
    for b in batches[1 + args.warmup :]:
        s = time.perf_counter()
        loss = step(b)
        float(loss)  # the step's end (a host read after it, outside any compiled region)
        samples.append((time.perf_counter() - s) * 1e3)
    return {
        "first_step_s": first,
        "ms_per_step": statistics.median(samples),
        "ms_samples": samples,
        "graphs_first_step": graphs,
        "recompiles": bench.compiled_graphs() - graphs,
        "final_loss": float(loss),
        "funcamp": str(Path(bench.fa.__file__).parent),
        "compile_phases_s": bench.compile_phases(),
    }


def torch_loop(args: argparse.Namespace) -> dict[str, Any]:
    """The main job's baseline: N steps of torch.compile(model) + torch.optim.AdamW, in the main job's dtype."""
    import train_gpt  # examples/ is on sys.path (bench_train_step puts it there)

    import funcamp as fa

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    jargs = train_gpt.parse_args([])  # the main job's defaults: model, batch size, learning rate
    config = bench.config_for(jargs.model, vocab_size=256)
    torch.manual_seed(0)
    model = bench.GPT(config)
    compute = fa.get_policy(train_gpt.default_policy(torch.device("cpu"))).compute_dtype
    half = compute in (torch.bfloat16, torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=jargs.lr, weight_decay=jargs.weight_decay, foreach=True)
    forward = torch.compile(model)
    batches = bench.make_batches(
        8, batch_size=jargs.batch_size, block_size=config.block_size, seed=0, device=torch.device("cpu")
    )
    for i in range(args.torch_loop):
        batch = batches[i % len(batches)]
        with torch.autocast("cpu", dtype=compute, enabled=half):
            logits = forward(batch["inputs"])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), jargs.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"seconds_in_process": time.perf_counter() - t0, "compute_dtype": str(compute), "final_loss": float(loss)}


def _subprocess(
    extra: list[str], args: argparse.Namespace, cache: str, pythonpath: str | None = None
) -> tuple[dict[str, Any], float]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    common = ["--config", args.config, "--dtype", args.dtype, "--threads", str(args.threads)]
    common += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd = [sys.executable, str(Path(__file__).resolve()), *common, *extra, "--out", out]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(extra)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(Path(out).read_text()), wall
    finally:
        Path(out).unlink(missing_ok=True)


def main_job(args: argparse.Namespace) -> dict[str, Any]:
    """Wall seconds of the main job (cold cache, whole process) and of the torch.compile loop, same steps."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="funcamp-first-main-") as tmp:
        cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", str(args.main_job_steps)]
        cmd += ["--threads", str(args.threads), "--logdir", str(Path(tmp) / "runs"), "--quiet"]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "cache-funcamp")}
        print(f"main job: {' '.join(cmd[1:])} ...", end=" ", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        out["funcamp_main_job_s"] = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"the main job failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        out["funcamp_main_job_tail"] = proc.stdout.strip().splitlines()[-3:]
        print(f"{out['funcamp_main_job_s']:.1f} s", flush=True)
        print(f"torch.compile(model) loop, {args.main_job_steps} steps ...", end=" ", flush=True)
        loop, wall = _subprocess(["--torch-loop", str(args.main_job_steps)], args, str(Path(tmp) / "cache-torch"))
        out["torch_loop_s"], out["torch_loop"] = wall, loop
        print(f"{wall:.1f} s", flush=True)
    out["ratio"] = out["funcamp_main_job_s"] / out["torch_loop_s"]
    return out


def _spread(values: list[float], spec: str) -> str:
    return f"{format(min(values), spec)}-{format(max(values), spec)}"


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    rows = {}
    for variant, by_cache in runs.items():
        row: dict[str, Any] = {}
        for cache, results in by_cache.items():
            first = [r["first_step_s"] for r in results]
            row[f"{cache}_first_step_s"] = statistics.median(first)
            row[f"{cache}_first_step_spread"] = _spread(first, ".1f")
            phases = {}
            for key in results[0]["compile_phases_s"]:
                phases[key] = statistics.median(r["compile_phases_s"].get(key, 0.0) for r in results)
            row[f"{cache}_phases_s"] = phases
        steady = [r["ms_per_step"] for rs in by_cache.values() for r in rs]
        row["ms_per_step"] = statistics.median(steady)
        row["ms_per_step_spread"] = _spread(steady, ".1f")
        row["recompiles"] = max(r["recompiles"] for rs in by_cache.values() for r in rs)
        row["graphs_first_step"] = max(r["graphs_first_step"] for rs in by_cache.values() for r in rs)
        row["final_loss"] = [r["final_loss"] for rs in by_cache.values() for r in rs][0]
        row["funcamp"] = by_cache["cold"][0].get("funcamp")
        rows[variant] = row
    return rows


def paired_ratios(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, list[float]]]:
    """Per round, each variant's first step over torch.compile(model)'s in the same round (a shared machine's
    load changes between rounds more than within one)."""
    if "amp_compile" not in runs:
        return {}
    base = runs["amp_compile"]
    return {
        name: {
            cache: [r["first_step_s"] / b["first_step_s"] for r, b in zip(by_cache[cache], base[cache])]
            for cache in ("cold", "warm")
        }
        for name, by_cache in runs.items()
        if name != "amp_compile"
    }


def markdown(result: dict[str, Any]) -> str:
    m, rows = result["machine"], result["rows"]
    lines = [
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({result['args']['threads']} torch threads, "
        f"`torch.backends.cpu.get_cpu_capability()` = {m['cpu_capability']}); Python {m['python']}, "
        f"torch {m['torch']}, funcamp {m['funcamp']}. Shared machine (load average at the start: {result['load']}).",
        "",
        f"GPT `{result['args']['config']}`, {result['args']['dtype']} compute, {result['args']['repeats']} rounds; "
        "each figure the median over the rounds, with the min-max spread.",
        "",
        "| variant | first step s, cold | spread | first step s, warm | spread | ms/step | spread | graphs | "
        "recompiles | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['cold_first_step_s']:.1f} | {r['cold_first_step_spread']} | {r['warm_first_step_s']:.1f} | "
            f"{r['warm_first_step_spread']} | {r['ms_per_step']:.1f} | {r['ms_per_step_spread']} | "
            f"{r['graphs_first_step']} | {r['recompiles']} | {r['final_loss']:.4f} |"
        )
    ratios = result.get("paired_ratios", {})
    for name in rows:
        if name == "amp_compile" or "amp_compile" not in rows:
            continue
        a, f = rows["amp_compile"], rows[name]
        paired = "; ".join(
            f"{cache} {statistics.median(ratios[name][cache]):.2f}x ({_spread(ratios[name][cache], '.2f')})"
            for cache in ("cold", "warm")
        )
        lines += [
            "",
            f"{name} / torch.compile(model), ratio of medians: first step cold "
            f"{f['cold_first_step_s'] / a['cold_first_step_s']:.2f}x (target <= 1.5x), warm "
            f"{f['warm_first_step_s'] / a['warm_first_step_s']:.2f}x; steady step "
            f"{f['ms_per_step'] / a['ms_per_step']:.2f}x. "
            f"Median (spread) of the rounds' own ratios: {paired}.",
        ]
    if BASELINE in rows and "funcamp_compile" in rows:
        b, f = rows[BASELINE], rows["funcamp_compile"]
        lines += [
            "",
            f"{BASELINE}: the same step with the funcamp of `{result['args']['baseline']}` "
            f"({result.get('baseline_rev')}); funcamp now / then: first step cold "
            f"{f['cold_first_step_s'] / b['cold_first_step_s']:.2f}x, warm "
            f"{f['warm_first_step_s'] / b['warm_first_step_s']:.2f}x; final losses equal: "
            f"{f['final_loss'] == b['final_loss']}.",
        ]
    lines += [
        "",
        "Compile phases of the first step (s, medians; `torch._dynamo.utils.compile_times()`, nested, "
        "summed over compile threads):",
    ]
    for name, r in rows.items():
        for cache in ("cold", "warm"):
            phases = ", ".join(f"{bench.COMPILE_PHASES[k]} {v:.1f}" for k, v in r[f"{cache}_phases_s"].items())
            lines.append(f"- {name}, {cache}: {phases}")
    if result.get("main_job"):
        j = result["main_job"]
        lines += [
            "",
            f"Main job, cold cache, {result['args']['main_job_steps']} steps (`examples/train_gpt.py` defaults, whole "
            f"process): {j['funcamp_main_job_s']:.1f} s; a torch.compile(model) + torch.optim.AdamW loop of the same "
            f"steps on the same GPT and batch in {j['torch_loop']['compute_dtype']} (no validation, checkpoints or "
            f"logging), whole process: {j['torch_loop_s']:.1f} s; ratio {j['ratio']:.2f}x.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run or args.torch_loop:
        result = run_one(args) if args.run else torch_loop(args)
        Path(args.out).write_text(json.dumps(result))
        return 0
    load = os.getloadavg()[0]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {v: {"cold": [], "warm": []} for v in args.variants}
    for r in range(args.repeats):
        order = args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
        for v in order:
            with tempfile.TemporaryDirectory(prefix=f"funcamp-first-{v}-") as cache:
                for kind in ("cold", "warm"):
                    result, _ = _subprocess(["--run", v], args, cache, args.baseline if v == BASELINE else None)
                    runs[v][kind].append(result)
                    print(
                        f"round {r + 1}: {v} {kind}: first step {result['first_step_s']:.1f} s, "
                        f"{result['ms_per_step']:.1f} ms/step",
                        flush=True,
                    )
    result = {
        "command": "python " + " ".join([str(Path(sys.argv[0]).as_posix()), *sys.argv[1:]]),
        "machine": bench.machine(),
        "load": f"{load:.1f}",
        "args": {k: v for k, v in vars(args).items() if k not in ("run", "out", "torch_loop")},
        "runs": runs,
        "rows": summarize(runs),
        "paired_ratios": paired_ratios(runs),
    }
    if args.baseline:
        rev = subprocess.run(["git", "-C", args.baseline, "log", "-1", "--format=%h"], capture_output=True, text=True)
        result["baseline_rev"] = rev.stdout.strip() or "not a git checkout"
    if args.main_job_steps:
        result["main_job"] = main_job(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.markdown).write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
