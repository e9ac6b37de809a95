"""Benchmark: time to the first train step (compilation included), funcamp against torch.compile(model).

    python benchmarks/bench_first_step.py --models tiny,main-small --threads 1 --repeats 3
    python benchmarks/bench_first_step.py --models main-small,nanogpt-6l,gpt2-124m --repeats 3 --steps 2 --warmup 1
    python benchmarks/bench_first_step.py --models tiny --threads 1 --repeats 3 --main-job-steps 400

The cheapest informative set (cold only; ``--steps 2 --warmup 1``; each line a separate run, fastest first;
all three variants: ``V=amp_compile,funcamp_compile,funcamp_scan``; ``S="--kinds cold --steps 2 --warmup 1"``):

    # 1. the main job's GPT small, fixed bf16 policy, unrolled and scanned against torch.compile(model): ~6 runs
    python benchmarks/bench_first_step.py --models main-small --variants $V $S --repeats 2
    # 2. compile time by depth at width 128 (2 and 8 layers first; 4 and 12 when the machine is quiet)
    python benchmarks/bench_first_step.py --models main-small --layers 2,8 --variants $V $S --repeats 1
    python benchmarks/bench_first_step.py --models main-small --layers 2,4,8,12 --variants $V $S --repeats 2
    # 3. GPT-2 124M's body (vocabulary 256, context 128, batch 4, bf16 fixed): torch compiles 12 layers, scan one
    python benchmarks/bench_first_step.py --models gpt2-body --variants $V $S --repeats 2
    # 4. the main job end to end to its first step against a torch.compile(model) process: defaults (auto
    #    policy), then the GPT-2 body with bf16 fixed (the rounds on tiny are only there to run the harness)
    python benchmarks/bench_first_step.py --models tiny --variants amp_compile $S --repeats 1 --main-job-steps 1
    python benchmarks/bench_first_step.py --models tiny --variants amp_compile $S --repeats 1 --main-job-steps 1 \
        --main-job-args="--model gpt2-124m --block-size 128 --batch-size 4 \
        --policy params=float32,compute=bfloat16,output=float32"

What a user waits for before training starts. Two variants of ``benchmarks/bench_train_step.py`` on the same
GPT, batch and dtype (bfloat16 compute by default):

* ``amp_compile``: ``torch.autocast`` + ``torch.amp.GradScaler`` + ``torch.optim.AdamW`` (fused) with
  ``torch.compile(model)``; the first step compiles the forward graph, then the backward one.
* ``funcamp_compile``: ``funcamp.make_train_step`` compiled whole (``fullgraph=True``): forward, backward,
  unscale, finite check, AdamW and the skip logic in one graph.
* ``funcamp_scan`` (on request, ``--variants``): ``funcamp_compile`` with ``functionalize(..., scan="blocks")``:
  the GPT's layers stacked and compiled once as one ``torch._higher_order_ops.scan`` (``examples/gpt.py``'s
  forward applies each block once, in order, to the previous one's output: the contract of ``scan=``; needs two
  or more layers).

Models (``--models``, :data:`MODELS`): ``tiny`` (the tests' GPT), ``main-small`` (the main job's default GPT and
batch), ``nanogpt-6l`` (the shape of nanoGPT's 6-layer shakespeare-char model: 6 layers, 6 heads, width 384,
context 256, no biases; byte vocabulary) and ``gpt2-124m`` (OpenAI's GPT-2 small, 124M parameters, context
1024, GPT-2's vocabulary; batch 1 on the CPU) and ``gpt2-body`` (GPT-2 small's 12 layers, width 768 and heads
with a byte vocabulary and context 128, batch 4). ``--layers 2,4,8,12``: each model at each of these depths (its
width unchanged; named ``main-small@8L``), and a table of the cold first step by depth with each round's own
growth from the shallowest to the deepest. ``--backend``: the compile backend of every variant (inductor).
The JSON records the machine (lscpu's model name, ``torch.backends.cpu.get_cpu_capability()``, torch), the load
average at the start and end and after each run (``load_end``); after each model of each round the runs so far
are written to ``<json>.partial.json``.

Each run is a fresh process that builds the variant (deep copy of the model, ``functionalize``,
``torch.compile``'s wrapper) and times, on the wall clock, building it plus its first step (``first step s``),
then ``--steps`` more steps one by one after ``--warmup`` (``ms/step``: their median). Kinds (``--kinds``):
``cold``, a fresh, empty inductor cache (``TORCHINDUCTOR_CACHE_DIR``), after which the run saves a
``funcamp.compile_cache`` file; ``warm``, a second process on the cache the cold one filled (FX graph,
AOTAutograd and kernel caches hit: the same machine); ``file``, a process on another fresh, empty inductor cache
that first loads the cold run's ``funcamp.compile_cache`` file (load time included: a new machine or container
with the file). ``--repeats`` rounds; in each round, each model and each variant in turn (the variants' order
rotated each round), all kinds of one variant back to back. Reported per model: the median and the min-max
spread of each figure, and per kind the median (spread) of the rounds' own ratios funcamp / torch.compile(model):
the machine may be shared, and only runs made in the same round are compared.

``--main-job-steps N`` also times, cold, the main job ``examples/train_gpt.py`` (its defaults on this device,
``--steps N``) from process start to exit, against a plain loop of N steps of ``torch.compile(model)`` and
``torch.optim.AdamW`` on the same GPT, batch and compute dtype (the main job's policy on this device), which
has no validation, checkpoints or logging: a lower bound for a torch.amp main job. Both also to their first step:
the process's start-up and exit with each one's own seconds to the end of its first step (the job's "s to the first
step" leaves out its step-0 validation; what runs after the step, the last validation, the checkpoint and the
sample, is left out). ``--main-job-args`` passes further ``train_gpt.py`` arguments (model, context, batch, policy)
to both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
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
VARIANTS = ("amp_compile", "funcamp_compile", "funcamp_scan")
#: ``--variants``' default (``funcamp_scan`` on request).
DEFAULT_VARIANTS = ("amp_compile", "funcamp_compile")
KINDS = ("cold", "warm", "file")
#: The ``examples/gpt.py`` size names accepted for the models they are.
ALIASES = {"small": "main-small", "medium": "nanogpt-6l"}
#: ``--models``: name -> (``examples/gpt.py`` size, batch size on the CPU, what it stands for).
MODELS: dict[str, tuple[str, int, str]] = {
    "tiny": ("tiny", 8, "the tests' GPT: 2 layers, width 32, context 32"),
    "main-small": ("small", 32, "the main job's default GPT and batch: 4 layers, width 128, context 128, batch 32"),
    "nanogpt-6l": ("medium", 8, "nanoGPT's shakespeare-char shape: 6 layers, 6 heads, width 384, context 256"),
    "gpt2-124m": ("gpt2-124m", 1, "GPT-2 small: 12 layers, width 768, context 1024, vocabulary 50257"),
    "gpt2-body": ("gpt2-124m", 4, "GPT-2 124M's body: 12 layers, width 768, 12 heads; vocabulary 256, context 128"),
}
#: ``examples/gpt.py`` config fields a model replaces (the rest: its size's; vocabulary 256 but for ``gpt2-124m``).
OVERRIDES: dict[str, dict[str, int]] = {"gpt2-body": {"block_size": 128}}
#: The variant funcamp_compile run with the funcamp of ``--baseline`` (on PYTHONPATH).
BASELINE = "funcamp_compile@base"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="tiny", help=f"comma-separated, of {', '.join(MODELS)} (default: tiny)")
    p.add_argument("--config", default=None, choices=sorted([*MODELS, *ALIASES]), help="one model (as --models)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of cold,warm,file")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: per model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="compute dtype")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads in each run")
    p.add_argument("--repeats", type=int, default=3, help="rounds of (cold, warm) runs per variant")
    p.add_argument("--steps", type=int, default=10, help="timed steps after the first (steady ms/step)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps between the first and the timed ones")
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)})",
    )
    p.add_argument(
        "--layers",
        default=None,
        help="comma-separated layer counts (e.g. 2,4,8,12): each model at each depth, its width unchanged",
    )
    p.add_argument("--backend", default="inductor", help="torch.compile backend of every variant (tests: aot_eager)")
    p.add_argument("--main-job-steps", type=int, default=0, help="also time the main job for N steps (0: skip)")
    p.add_argument(
        "--main-job-args",
        default="",
        help="further examples/train_gpt.py arguments for the main job and its torch loop (model, batch, policy),\n"
        "e.g. '--model gpt2-124m --block-size 128 --batch-size 4\n"
        "--policy params=float32,compute=bfloat16,output=float32' (default: none, the main job's defaults)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="PATH",
        help="also run funcamp_compile with the funcamp package of another checkout at PATH\n"
        "(e.g. `git worktree add /tmp/base <commit>`), as the variant funcamp_compile@base",
    )
    p.add_argument("--json", default="benchmarks/results/bench_first_step.json")
    p.add_argument("--markdown", default="benchmarks/results/bench_first_step.md")
    p.add_argument(
        "--summarize",
        default=None,
        metavar="PARTIAL",
        help="measure nothing: report the runs of a run cut short (its <json>.partial.json)",
    )
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one variant in this process
    p.add_argument("--save-cache", default=None, help=argparse.SUPPRESS)  # internal: compile_cache file to write
    p.add_argument("--load-cache", default=None, help=argparse.SUPPRESS)  # internal: compile_cache file to read
    p.add_argument("--torch-loop", type=int, default=0, help=argparse.SUPPRESS)  # internal: the main job's baseline
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    args.models = [args.config] if args.config else [m.strip() for m in args.models.split(",") if m.strip()]
    args.models = [ALIASES.get(m, m) for m in args.models]
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for m in args.models:
        if _split(m)[0] not in MODELS:
            p.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    if args.layers:
        try:
            layers = [int(x) for x in args.layers.split(",") if x.strip()]
        except ValueError:
            layers = []
        if not layers or min(layers) < 1:
            p.error(f"--layers: comma-separated layer counts >= 1, got {args.layers!r}")
        args.models = [f"{m}@{n}L" for m in args.models for n in layers]
    if not args.kinds or "cold" not in args.kinds or any(k not in KINDS for k in args.kinds):
        p.error(f"--kinds: a comma-separated subset of {', '.join(KINDS)} with cold in it, got {args.kinds}")
    for name in ("repeats", "steps", "warmup", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.baseline:
        if not (Path(args.baseline) / "funcamp" / "__init__.py").exists():
            p.error(f"--baseline: {args.baseline} holds no funcamp/__init__.py")
        args.variants.append(BASELINE)
    return args


def _split(key: str) -> tuple[str, int | None]:
    """``"main-small@8L"`` -> ``("main-small", 8)`` (a ``--layers`` depth); ``"main-small"`` -> (it, None)."""
    name, _, depth = key.partition("@")
    return name, int(depth.removesuffix("L")) if depth else None


def _describe(key: str) -> str:
    name, layers = _split(key)
    return MODELS[name][2] + (f"; at {layers} layers" if layers else "")


def _bench_args(args: argparse.Namespace, model: str) -> argparse.Namespace:
    name, _ = _split(model)
    config, batch, _ = MODELS[name]
    batch = args.batch_size or batch
    argv = ["--config", config, "--dtype", args.dtype, "--threads", str(args.threads), "--batch-size", str(batch)]
    argv += ["--backend", args.backend]
    if "block_size" in OVERRIDES.get(name, {}):
        argv += ["--block-size", str(OVERRIDES[name]["block_size"])]
    return bench.parse_args(argv)


def make_model(key: str, bargs: argparse.Namespace) -> torch.nn.Module:
    """The GPT of ``key`` (a model of :data:`MODELS`, at its ``--layers`` depth if any), seeded."""
    name, layers = _split(key)
    vocab = None if name == "gpt2-124m" else 256
    fields = {"vocab_size": vocab, "block_size": bargs.block_size, "n_layer": layers, **OVERRIDES.get(name, {})}
    torch.manual_seed(bargs.seed)
    return bench.GPT(bench.config_for(bargs.config, **fields))


def build(variant: str, model: torch.nn.Module, bargs: argparse.Namespace) -> Any:
    """``funcamp_scan``: funcamp_compile with ``functionalize(..., scan="blocks")`` (the GPT's layers, whose
    forward applies each once, in order, to the previous one's output: ``scan=``'s contract); others as
    ``bench_train_step.build_variant``."""
    if variant == "funcamp_scan":
        return bench.FuncampStep(model, bargs, compile=True, scan="blocks")
    return bench.build_variant(variant, model, bargs)


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """In this fresh process: build ``args.run``, time it to the end of its first step, then steady steps."""
    torch.set_num_threads(args.threads)
    (model_name,) = args.models
    bargs = _bench_args(args, model_name)
    args.run = args.run.removesuffix("@base")  # the same variant; which funcamp is PYTHONPATH's business
    device = torch.device("cpu")
    n = 1 + args.warmup + args.steps
    batches = bench.make_batches(
        n, batch_size=bargs.batch_size, block_size=bench.block_size(bargs), seed=0, device=device
    )
    model = make_model(model_name, bargs)
    cache = None
    if args.save_cache or args.load_cache:
        from funcamp import compile_cache

        key = compile_cache.step_key(batches[0], extra={"bench": "first_step", "model": model_name, "run": args.run})
        cache = compile_cache, key
    t0 = time.perf_counter()
    loaded = cache[0].load(args.load_cache, cache[1]) if args.load_cache else None  # timed: part of the start
    step = build(args.run, model, bargs)
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
    saved = cache[0].save(args.save_cache, cache[1]) if args.save_cache else None
    return {
        "first_step_s": first,
        "compile_cache": str(loaded or saved or ""),
        "ms_per_step": statistics.median(samples),
        "ms_samples": samples,
        "graphs_first_step": graphs,
        "recompiles": bench.compiled_graphs() - graphs,
        "final_loss": float(loss),
        "funcamp": str(Path(bench.fa.__file__).parent),
        "compile_phases_s": bench.compile_phases(),
        "load_end": os.getloadavg()[0],
        "layers": model.config.n_layer,
    }


def torch_loop(args: argparse.Namespace) -> dict[str, Any]:
    """The main job's baseline: N steps of torch.compile(model) + torch.optim.AdamW, in the main job's dtype."""
    import train_gpt  # examples/ is on sys.path (bench_train_step puts it there)

    import funcamp as fa

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    jargs = train_gpt.parse_args(shlex.split(args.main_job_args))  # the main job's: model, batch, learning rate
    config = bench.config_for(jargs.model, vocab_size=256, block_size=jargs.block_size)
    torch.manual_seed(0)
    model = bench.GPT(config)
    policy = jargs.policy if jargs.policy != "auto" else train_gpt.default_policy(torch.device("cpu"))
    compute = fa.get_policy(policy).compute_dtype
    half = compute in (torch.bfloat16, torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=jargs.lr, weight_decay=jargs.weight_decay, foreach=True)
    forward = torch.compile(model)
    batches = bench.make_batches(
        8, batch_size=jargs.batch_size, block_size=config.block_size, seed=0, device=torch.device("cpu")
    )
    first = None
    for i in range(args.torch_loop):
        batch = batches[i % len(batches)]
        with torch.autocast("cpu", dtype=compute, enabled=half):
            logits = forward(batch["inputs"])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), jargs.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if first is None:
            first = time.perf_counter() - t0
    return {
        "seconds_in_process": time.perf_counter() - t0,
        "first_step_in_process": first,
        "compute_dtype": str(compute),
        "final_loss": float(loss),
    }


def _subprocess(
    extra: list[str], args: argparse.Namespace, cache: str, pythonpath: str | None = None, model: str = "tiny"
) -> tuple[dict[str, Any], float]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    common = ["--models", model, "--dtype", args.dtype, "--threads", str(args.threads)]
    common += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--backend", args.backend]
    common += ["--batch-size", str(args.batch_size)] if args.batch_size else []
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
        cmd += shlex.split(args.main_job_args)
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "cache-funcamp"),
            "FUNCAMP_CACHE_DIR": str(Path(tmp) / "funcamp"),  # cold: no compile-cache file, no tuned policy
        }
        print(f"main job: {' '.join(cmd[1:])} ...", end=" ", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        out["funcamp_main_job_s"] = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"the main job failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        out["funcamp_main_job_tail"] = proc.stdout.strip().splitlines()[-3:]
        # To its first step: the process's start-up and exit (its wall less the job's own clock) and the job's "s to
        # the first step" (setup, the auto policy, compile and the step; not the step-0 validation). Not what runs
        # after it: the final validation, the checkpoint, the sample.
        done = re.search(r"(?:after compile|eager): ([0-9.]+) s to the first step\), wall ([0-9.]+) s", proc.stdout)
        if done is None:
            raise RuntimeError(f"the main job's done line is missing:\n{proc.stdout[-2000:]}")
        to_first, job_wall = float(done.group(1)), float(done.group(2))
        out["funcamp_to_first_step_s"] = out["funcamp_main_job_s"] - job_wall + to_first
        step0 = re.search(r"step 0: val loss [0-9.]+ \(([0-9.]+) s\)", proc.stdout)
        out["funcamp_step0_validation_s"] = float(step0.group(1)) if step0 else None
        print(
            f"{out['funcamp_main_job_s']:.1f} s ({out['funcamp_to_first_step_s']:.1f} s to the first step)", flush=True
        )
        print(f"torch.compile(model) loop, {args.main_job_steps} steps ...", end=" ", flush=True)
        extra = ["--torch-loop", str(args.main_job_steps), f"--main-job-args={args.main_job_args}"]
        loop, wall = _subprocess(extra, args, str(Path(tmp) / "cache-torch"))
        out["torch_loop_s"], out["torch_loop"] = wall, loop
        out["torch_to_first_step_s"] = wall - loop["seconds_in_process"] + loop["first_step_in_process"]
        print(f"{wall:.1f} s ({out['torch_to_first_step_s']:.1f} s to the first step)", flush=True)
    out["ratio"] = out["funcamp_main_job_s"] / out["torch_loop_s"]
    out["ratio_to_first_step"] = out["funcamp_to_first_step_s"] / out["torch_to_first_step_s"]
    return out


def _spread(values: list[float], spec: str) -> str:
    return f"{format(min(values), spec)}-{format(max(values), spec)}"


Runs = dict[str, dict[str, list[dict[str, Any]]]]  # variant -> kind -> one result per round


def summarize(runs: Runs) -> dict[str, dict[str, Any]]:
    rows = {}
    for variant, by_kind in runs.items():
        row: dict[str, Any] = {}
        by_kind = {kind: results for kind, results in by_kind.items() if results}
        for kind, results in by_kind.items():
            first = [r["first_step_s"] for r in results]
            row[f"{kind}_first_step_s"] = statistics.median(first)
            row[f"{kind}_first_step_spread"] = _spread(first, ".1f")
            phases = {}
            for key in results[0]["compile_phases_s"]:
                phases[key] = statistics.median(r["compile_phases_s"].get(key, 0.0) for r in results)
            row[f"{kind}_phases_s"] = phases
        steady = [r["ms_per_step"] for rs in by_kind.values() for r in rs]
        row["ms_per_step"] = statistics.median(steady)
        row["ms_per_step_spread"] = _spread(steady, ".1f")
        row["recompiles"] = max(r["recompiles"] for rs in by_kind.values() for r in rs)
        row["graphs_first_step"] = max(r["graphs_first_step"] for rs in by_kind.values() for r in rs)
        row["final_loss"] = [r["final_loss"] for rs in by_kind.values() for r in rs][0]
        row["funcamp"] = by_kind["cold"][0].get("funcamp")
        row["compile_cache"] = [r.get("compile_cache", "") for r in by_kind.get("file", [])[:1]]
        rows[variant] = row
    return rows


def paired_ratios(runs: Runs) -> dict[str, dict[str, list[float]]]:
    """Per round, each variant's first step over torch.compile(model)'s in the same round and kind (a shared
    machine's load changes between rounds more than within one); ``steady``: the ms/step of the cold runs."""
    if "amp_compile" not in runs:
        return {}
    base = runs["amp_compile"]
    out = {}
    for name, by_kind in runs.items():
        if name == "amp_compile":
            continue
        ratios = {
            kind: [r["first_step_s"] / b["first_step_s"] for r, b in zip(results, base[kind])]
            for kind, results in by_kind.items()
            if results and base.get(kind)
        }
        ratios["steady"] = [r["ms_per_step"] / b["ms_per_step"] for r, b in zip(by_kind["cold"], base["cold"])]
        out[name] = ratios
    return out


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x ({_spread(values, '.2f')})" if values else "-"


def markdown(result: dict[str, Any]) -> str:
    m, args = result["machine"], result["args"]
    lines = [
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({args['threads']} torch threads, "
        f"`torch.backends.cpu.get_cpu_capability()` = {m['cpu_capability']}); Python {m['python']}, "
        f"torch {m['torch']}, funcamp {m['funcamp']}. Shared machine (load average at the start: {result['load']}, "
        f"at the end: {result.get('load_end', '?')})."
        + (f" Cut short: the runs of `{result['summarized_from']}`." if result.get("summarized_from") else ""),
        "",
        f"{args['dtype']} compute, {args['repeats']} rounds; each figure the median over the rounds, with the "
        "min-max spread. Ratios: the median (min-max) of the rounds' own ratios funcamp / torch.compile(model) "
        "+ torch.amp + fused AdamW. cold: an empty inductor cache; warm: a second process on the cold one's "
        "cache; file: an empty inductor cache and the cold run's `funcamp.compile_cache` file.",
    ]
    summary = ["", "| model | what | cold | warm | file | steady step |", "|---|---|---:|---:|---:|---:|"]
    for model, block in result["models"].items():
        for name, ratios in block["paired_ratios"].items():
            summary.append(
                f"| {model} ({name}) | {_describe(model)} | {_ratio(ratios.get('cold', []))} | "
                f"{_ratio(ratios.get('warm', []))} | {_ratio(ratios.get('file', []))} | "
                f"{_ratio(ratios.get('steady', []))} |"
            )
    lines += summary
    for model, block in result["models"].items():
        rows = block["rows"]
        config, batch, _ = MODELS[_split(model)[0]]
        lines += [
            "",
            f"### {model}: GPT `{config}` ({_describe(model)}), batch {args['batch_size'] or batch}",
            "",
            "| variant | first step s, cold | spread | warm | spread | file | spread | ms/step | spread | graphs | "
            "recompiles | final loss |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in rows.items():
            cells = []
            for kind in KINDS:
                if f"{kind}_first_step_s" in r:
                    cells += [f"{r[f'{kind}_first_step_s']:.1f}", r[f"{kind}_first_step_spread"]]
                else:
                    cells += ["-", "-"]
            lines.append(
                f"| {name} | {' | '.join(cells)} | {r['ms_per_step']:.1f} | {r['ms_per_step_spread']} | "
                f"{r['graphs_first_step']} | {r['recompiles']} | {r['final_loss']:.4f} |"
            )
        if BASELINE in rows and "funcamp_compile" in rows:
            b, f = rows[BASELINE], rows["funcamp_compile"]
            lines += [
                "",
                f"{BASELINE}: the same step with the funcamp of `{args['baseline']}` ({result.get('baseline_rev')}); "
                f"funcamp now / then: first step cold {f['cold_first_step_s'] / b['cold_first_step_s']:.2f}x"
                + (
                    f", warm {f['warm_first_step_s'] / b['warm_first_step_s']:.2f}x"
                    if "warm_first_step_s" in f and "warm_first_step_s" in b
                    else ""
                )
                + f"; final losses equal: {f['final_loss'] == b['final_loss']}.",
            ]
        lines += [
            "",
            "Compile phases of the first step (s, medians; `torch._dynamo.utils.compile_times()`, nested, "
            "summed over compile threads):",
        ]
        for name, r in rows.items():
            for kind in KINDS:
                if f"{kind}_phases_s" in r:
                    phases = ", ".join(f"{bench.COMPILE_PHASES[k]} {v:.1f}" for k, v in r[f"{kind}_phases_s"].items())
                    lines.append(f"- {name}, {kind}: {phases}")
        messages = [(name, m) for name, r in rows.items() for m in r["compile_cache"]]
        if messages:
            lines += ["", "The file runs of round 1:"]
            lines += [f"- {name}: {message}" for name, message in messages]
    sweep = result.get("layer_sweep")
    if sweep:
        variants = list(next(iter(sweep["cold_first_step_s"].values())))
        lines += [
            "",
            "### Cold first step by depth (s, median over rounds)",
            "",
            "| layers | " + " | ".join(variants) + " |",
            "|---:|" + "---:|" * len(variants),
        ]
        for layers, by_variant in sweep["cold_first_step_s"].items():
            lines.append(f"| {layers} | " + " | ".join(f"{by_variant[v]:.1f}" for v in variants) + " |")
        lines += [
            "",
            f"Growth from {sweep['from']} to {sweep['to']} layers (each round's own deepest / shallowest cold first "
            "step; median, min-max): "
            + "; ".join(f"{v} {_ratio(g)}" for v, g in sweep["growth"].items())
            + ". Each variant over torch.compile(model) in the same round, cold, by depth: "
            + "; ".join(
                f"{layers} layers: " + ", ".join(f"{v} {_ratio(r)}" for v, r in by_variant.items())
                for layers, by_variant in sweep["ratios"].items()
            )
            + ".",
        ]
    if result.get("main_job"):
        j = result["main_job"]
        lines += [
            "",
            f"Main job, cold cache, {args['main_job_steps']} steps (`examples/train_gpt.py` "
            f"{args.get('main_job_args') or 'defaults'}, whole process): {j['funcamp_main_job_s']:.1f} s; "
            "a torch.compile(model) + torch.optim.AdamW loop of the same "
            f"steps on the same GPT and batch in {j['torch_loop']['compute_dtype']} (no validation, checkpoints or "
            f"logging), whole process: {j['torch_loop_s']:.1f} s; ratio {j['ratio']:.2f}x. To the first step (the "
            "process's start-up and exit with the job's own seconds to its first step, which leave out its step-0 "
            "validation and what runs after the step: the last validation, the checkpoint, the sample): "
            f"{j['funcamp_to_first_step_s']:.1f} s against {j['torch_to_first_step_s']:.1f} s, "
            f"**{j['ratio_to_first_step']:.2f}x**"
            + (
                f" (its step-0 validation took {j['funcamp_step0_validation_s']:.1f} s more)."
                if j.get("funcamp_step0_validation_s") is not None
                else "."
            ),
        ]
    return "\n".join(lines) + "\n"


def layer_sweep(models: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """``--layers``: per depth each variant's median cold first step, and per variant each round's growth from the
    shallowest to the deepest (runs of one round only); None without ``--layers`` (or with one depth)."""
    depths = sorted({_split(k)[1] for k in models} - {None})
    if len(depths) < 2:
        return None
    runs = {_split(k)[1]: block["runs"] for k, block in models.items()}
    variants = [v for v in runs[depths[0]] if all(v in runs[d] for d in depths)]  # a run cut short may lack some
    cold = {d: {v: statistics.median(r["first_step_s"] for r in runs[d][v]["cold"]) for v in variants} for d in depths}
    low, high = runs[depths[0]], runs[depths[-1]]
    growth = {
        v: [b["first_step_s"] / a["first_step_s"] for a, b in zip(low[v]["cold"], high[v]["cold"])] for v in variants
    }
    ratios = {}
    for key, block in models.items():
        ratios[_split(key)[1]] = {v: r.get("cold", []) for v, r in block["paired_ratios"].items()}
    return {"from": depths[0], "to": depths[-1], "cold_first_step_s": cold, "growth": growth, "ratios": ratios}


def _round(args: argparse.Namespace, r: int, model: str, runs: Runs, tmp: str) -> None:
    """One round of one model: each variant in turn (rotated by the round), its kinds back to back."""
    order = args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
    for v in order:
        base = args.baseline if v == BASELINE else None
        with tempfile.TemporaryDirectory(prefix=f"funcamp-first-{v}-", dir=tmp) as cache:
            file = str(Path(cache) / "compile-cache.bin")
            with_file = "file" in args.kinds and v != BASELINE  # the baseline's funcamp may lack compile_cache
            for kind in args.kinds:
                if kind == "file" and not with_file:
                    continue
                extra = ["--run", v]
                extra += ["--save-cache", file] if kind == "cold" and with_file else []
                extra += ["--load-cache", file] if kind == "file" else []
                inductor = cache if kind != "file" else str(Path(cache) / "fresh")
                result, _ = _subprocess(extra, args, inductor, base, model)
                runs[v][kind].append(result)
                print(
                    f"round {r + 1}: {model}: {v} {kind}: first step {result['first_step_s']:.1f} s, "
                    f"{result['ms_per_step']:.1f} ms/step",
                    flush=True,
                )


def measure(args: argparse.Namespace, load: float) -> dict[str, Runs]:
    """The rounds: every model, every variant, every kind; after each model of each round, the runs so far in
    ``<json>.partial.json`` (``--summarize`` reports them if the run is cut short)."""
    runs: dict[str, Runs] = {m: {v: {k: [] for k in KINDS} for v in args.variants} for m in args.models}
    partial = Path(args.json).with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="funcamp-first-") as tmp:
        for r in range(args.repeats):
            for model in args.models:
                _round(args, r, model, runs[model], tmp)
                state = {"round": r + 1, "load_start": load, "load_now": os.getloadavg()[0], "runs": runs}
                partial.write_text(json.dumps(state))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run or args.torch_loop:
        result = run_one(args) if args.run else torch_loop(args)
        Path(args.out).write_text(json.dumps(result))
        return 0
    load = os.getloadavg()[0]
    if args.summarize:  # a run cut short: what its partial file holds (the variants with cold runs)
        data = json.loads(Path(args.summarize).read_text())
        runs = {m: {v: k for v, k in by_v.items() if k.get("cold")} for m, by_v in data["runs"].items()}
        runs = {m: by_v for m, by_v in runs.items() if by_v}
        args.models = list(runs)
        load = data.get("load_start", load)
    else:
        runs = measure(args, load)
    internal = ("run", "out", "torch_loop", "save_cache", "load_cache")
    result = {
        "command": "python " + " ".join([str(Path(sys.argv[0]).as_posix()), *sys.argv[1:]]),
        "machine": bench.machine(),
        "load": f"{load:.1f}",
        "load_end": f"{os.getloadavg()[0]:.1f}",
        "summarized_from": args.summarize,
        "args": {k: v for k, v in vars(args).items() if k not in internal},
        "models": {
            m: {"runs": runs[m], "rows": summarize(runs[m]), "paired_ratios": paired_ratios(runs[m])}
            for m in args.models
        },
    }
    result["layer_sweep"] = layer_sweep(result["models"])
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
