"""Benchmark: the cost of funcamp's precision telemetry (``make_train_step(telemetry=N)``) on the GPT.

    python benchmarks/bench_telemetry.py                          # CPU: GPT "small", the device's fast dtype
    python benchmarks/bench_telemetry.py --device cuda --config gpt2-124m --dtype bfloat16

Four variants train the GPT of ``examples/gpt.py`` from the same initial weights on the same byte-level
batches, each compiled (``--backend``, default inductor) and warmed up first:

1. ``amp_compile``: ``torch.compile(model)`` + ``torch.autocast`` (off for float32) + ``torch.optim.AdamW``
   (foreach) + ``torch.amp.GradScaler`` (on for float16 only): the torch.amp baseline.
2. ``funcamp``: ``functionalize`` + ``make_train_step`` compiled whole, no telemetry.
3. ``funcamp_t10``: the same with ``telemetry=10`` (metrics every 10th step, ``torch.cond`` in the graph).
4. ``funcamp_t1``: ``telemetry=1`` (every step: the cost of one active step).
5. ``funcamp_t1_nometer``: ``Telemetry(every=1, lost_updates=False)``: the same without the lost-update meter
   (its cost is ``funcamp_t1`` against this one).

Timing: ``--rounds`` rounds; each runs ``--steps`` (a multiple of 10, so each round of ``funcamp_t10``
has the same share of active steps) steps of every variant in turn, the order rotated each round, every
step timed on its own (device synchronised). Reported per variant: the median over rounds of the
mean step time, its min-max spread, and ratios to ``funcamp`` and ``amp_compile`` measured in the same
run; for ``funcamp_t10`` also the median time of its inactive steps (those that skip the telemetry)
and of its active ones. The machine (CPU capability, threads, torch version) and the command are
written with the results (``--json``, ``--markdown``).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from bench_train_step import TorchStep, make_batches  # noqa: E402  (the same batches and torch.amp step)
from gpt import GPT, SIZES, config_for  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import optim  # noqa: E402
from funcamp.numerics import Telemetry  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1
VARIANTS = ("amp_compile", "funcamp", "funcamp_t10", "funcamp_t1", "funcamp_t1_nometer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small", choices=sorted(SIZES), help="GPT size of examples/gpt.py")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default: 32, as train_gpt.py)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: half_dtype")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (default: all)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps per variant, the first call included")
    p.add_argument("--steps", type=int, default=10, help="steps per variant per round (a multiple of 10)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--isolated",
        type=int,
        default=0,
        metavar="N",
        help="instead: time funcamp.numerics.telemetry_metrics alone, compiled, N calls on the GPT's parameter shapes",
    )
    p.add_argument("--json", default="benchmarks/results/bench_telemetry.json", help="output JSON file")
    p.add_argument("--markdown", default="benchmarks/results/bench_telemetry.md", help="output markdown file")
    args = p.parse_args(argv)
    if args.steps < 10 or args.steps % 10:
        p.error(f"--steps must be a multiple of 10, got {args.steps}")
    if args.warmup % 10:
        p.error(f"--warmup must be a multiple of 10 (so rounds start at the same phase), got {args.warmup}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
    return args


class AmpStep(TorchStep):
    """torch.amp recipe: compiled model, autocast, GradScaler, torch.optim.AdamW (foreach, this benchmark's
    learning rate, the scaler for float16 only); the step itself is bench_train_step.TorchStep's."""

    def __init__(self, model: GPT, dtype: torch.dtype, backend: str) -> None:
        device = next(model.parameters()).device
        self.device_type, self.dtype, self.amp = device.type, dtype, dtype != torch.float32
        self.forward = torch.compile(model, backend=backend)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True
        )
        self.scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16, enabled=dtype == torch.float16)


class FuncampStep:
    """``functionalize`` + ``TrainState`` + ``make_train_step`` compiled whole, with ``telemetry``."""

    def __init__(self, model: GPT, dtype: torch.dtype, backend: str, telemetry: int | Telemetry | None) -> None:
        policy = fa.get_policy(f"params=float32,compute={str(dtype).removeprefix('torch.')},output=float32")
        apply_fn, params = fa.nn.functionalize(model, policy)

        def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
            logits = apply_fn(params, batch["inputs"])
            return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

        opt = optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
        scale = fa.DynamicLossScale(2.0**16, backoff_factor=0.5) if dtype == torch.float16 else None
        self.state = fa.TrainState.create(params, opt, loss_scale=scale)
        self.step = fa.make_train_step(loss_fn, opt, backend=backend, telemetry=telemetry)
        self.every = getattr(telemetry, "every", telemetry)

    def active_next(self) -> bool:
        """Whether the next call computes the telemetry (a host read of the step count, outside the timing)."""
        return self.every is not None and (int(self.state.step) + 1) % self.every == 0

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.state, metrics = self.step(self.state, batch)
        return metrics["loss"]


def build(name: str, model: GPT, dtype: torch.dtype, backend: str) -> Any:
    if name == "amp_compile":
        return AmpStep(copy.deepcopy(model), dtype, backend)
    telemetry = {
        "funcamp": None,
        "funcamp_t10": 10,
        "funcamp_t1": 1,
        "funcamp_t1_nometer": Telemetry(every=1, lost_updates=False),
    }[name]
    return FuncampStep(copy.deepcopy(model), dtype, backend, telemetry)


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_isolated(model: GPT, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Median time of the telemetry alone (active), compiled, on gradients shaped like the GPT's parameters."""
    from funcamp.numerics import Telemetry, telemetry_metrics

    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(p) * 1e-3 for n, p in params.items()}
    scale, config = torch.tensor(1.0, device=device), Telemetry(every=1)
    fn = torch.compile(lambda g, p, s: telemetry_metrics(g, p, s, config), fullgraph=True, backend=args.backend)
    for _ in range(3):
        fn(grads, params, scale)
    times = []
    for _ in range(args.isolated):
        sync(device)
        t0 = time.perf_counter()
        fn(grads, params, scale)
        sync(device)
        times.append(time.perf_counter() - t0)
    out = {"telemetry_alone_median_ms": statistics.median(times) * 1e3, "calls": args.isolated}
    print(f"telemetry alone ({sum(p.numel() for p in params.values())} gradient elements): {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else fa.half_dtype(device)
    torch.manual_seed(args.seed)
    cfg = config_for(args.config, vocab_size=256)
    model = GPT(cfg).to(device)
    if args.isolated:
        return time_isolated(model, args, device)
    n_batches = args.warmup + args.steps
    batches = make_batches(n_batches, batch_size=args.batch_size, block_size=cfg.block_size, seed=1, device=device)
    machine = {
        "platform": platform.platform(),
        "processor": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
    }
    print(f"machine: {machine}\ndtype {dtype}, config {args.config}, batch {args.batch_size}x{cfg.block_size}")

    steps: dict[str, Any] = {}
    first_call: dict[str, float] = {}
    for name in args.variants:
        t0 = time.perf_counter()
        steps[name] = build(name, model, dtype, args.backend)
        for i in range(args.warmup):
            steps[name](batches[i])
            if i == 0:
                sync(device)
                first_call[name] = time.perf_counter() - t0
        sync(device)
        print(f"{name}: first call (compile) {first_call[name]:.1f} s, warmed up", flush=True)

    times: dict[str, list[list[float]]] = {n: [] for n in args.variants}  # per round, per step
    active: dict[str, list[bool]] = {n: [] for n in args.variants}
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
        for name in order:
            step, round_times = steps[name], []
            for i in range(args.steps):
                is_active = step.active_next() if isinstance(step, FuncampStep) else False
                sync(device)
                t0 = time.perf_counter()
                step(batches[args.warmup + i])
                sync(device)
                round_times.append(time.perf_counter() - t0)
                if r == 0:
                    active[name].append(is_active)
            times[name].append(round_times)
        means = {n: f"{statistics.fmean(times[n][-1]) * 1e3:.1f}" for n in args.variants}
        print(f"round {r + 1}/{args.rounds}: mean step ms {means}", flush=True)

    def round_means(name: str) -> list[float]:
        return [statistics.fmean(ts) for ts in times[name]]

    results: dict[str, Any] = {"machine": machine, "command": " ".join(["python3", *sys.argv]), "variants": {}}
    results["settings"] = {k: v for k, v in vars(args).items() if k not in ("json", "markdown")}
    results["settings"]["dtype"] = str(dtype)
    medians = {n: statistics.median(round_means(n)) for n in args.variants}
    for name in args.variants:
        means = round_means(name)
        entry = {
            "median_step_ms": medians[name] * 1e3,
            "min_ms": min(means) * 1e3,
            "max_ms": max(means) * 1e3,
            "first_call_s": first_call[name],
        }
        for base in ("funcamp", "amp_compile"):
            if base in medians:
                entry[f"ratio_to_{base}"] = medians[name] / medians[base]
        if name == "funcamp_t10":
            flags = active[name]
            on = [ts[i] for ts in times[name] for i in range(args.steps) if flags[i]]
            off = [ts[i] for ts in times[name] for i in range(args.steps) if not flags[i]]
            entry["inactive_step_median_ms"] = statistics.median(off) * 1e3
            entry["active_step_median_ms"] = statistics.median(on) * 1e3
            if "funcamp" in times:
                plain = statistics.median([t for ts in times["funcamp"] for t in ts])
                entry["inactive_ratio_to_funcamp_step_median"] = statistics.median(off) / plain
        results["variants"][name] = entry

    lines = [
        f"Telemetry cost, `{results['command']}`",
        "",
        f"Machine: {machine['processor']}, `torch.backends.cpu.get_cpu_capability()` = {machine['cpu_capability']}, "
        f"torch {machine['torch']}, {machine['threads']} threads, device {machine['device']}; compute {dtype}, "
        f"GPT {args.config}, batch {args.batch_size}x{cfg.block_size}, {args.rounds} rounds of {args.steps} steps.",
        "",
        "| variant | median step (ms) | spread of round means (ms) | vs funcamp | vs amp_compile |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, e in results["variants"].items():
        lines.append(
            f"| {name} | {e['median_step_ms']:.2f} | {e['min_ms']:.2f}-{e['max_ms']:.2f} | "
            f"{e.get('ratio_to_funcamp', float('nan')):.3f} | {e.get('ratio_to_amp_compile', float('nan')):.3f} |"
        )
    t10 = results["variants"].get("funcamp_t10")
    if t10:
        lines += [
            "",
            f"funcamp_t10 per step: inactive median {t10['inactive_step_median_ms']:.2f} ms"
            + (
                f" ({t10['inactive_ratio_to_funcamp_step_median']:.3f} x funcamp's median step)"
                if "inactive_ratio_to_funcamp_step_median" in t10
                else ""
            )
            + f", active median {t10['active_step_median_ms']:.2f} ms.",
        ]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    for path, content in ((args.json, json.dumps(results, indent=2) + "\n"), (args.markdown, text)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
    return results


if __name__ == "__main__":
    main()
