"""Benchmark: fp8 training (funcamp.fp8) against bf16, on the GPT of examples/gpt.py, in one run, on a GPU.

    python benchmarks/bench_fp8_cuda.py                                  # gpt2-124m, batch 16 x 1024 tokens
    python benchmarks/bench_fp8_cuda.py --config gpt2-1.3b --batch-size 8  # a size where matmuls dominate
    python benchmarks/bench_fp8_cuda.py --config gpt2-1.3b --n-layer 6    # its matmul shapes, a quarter of it
    python benchmarks/bench_fp8_cuda.py --device cpu --config tiny --steps 3 --rounds 1 --backend aot_eager
                                                                         # smoke test of the script itself

Variants, each from the same initial weights, on the same batches (random tokens), with the same AdamW:

1. ``amp_bf16``: ``torch.autocast(bfloat16)`` with ``torch.compile(model)`` and ``torch.optim.AdamW(fused)``,
   the torch.amp recipe users run; every speed is also given as a ratio to it.
2. ``funcamp_bf16``: ``funcamp.nn.functionalize(model, "p=f32,c=bf16,o=f32")`` and the whole step compiled
   (``make_train_step``, ``fullgraph=True``).
3. ``fp8_tensorwise``, ``fp8_rowwise``, ``fp8_delayed``: variant 2 after ``funcamp.fp8.convert(model,
   recipe)`` (every Linear but the first and the last; the LM head is tied to the embedding and stays
   bf16), with ``module_policies=funcamp.fp8.MODULE_POLICIES``.

Timing: each variant is built and warmed up (``--warmup`` steps, compilation included), then ``--rounds``
rounds of ``--steps`` steps, synchronised at both ends; reported: the median round's tokens/s, the spread,
the ratio to ``amp_bf16`` and to ``funcamp_bf16``, MFU (model FLOPs: 6 x parameters x tokens plus the
attention's 12 x layers x context x width per token, PaLM's formula, over ``--peak-tflops``: 989 for
H100/H200 SXM dense bf16 by default; fp8's own peak is twice that, MFU here is against bf16's as torchao
reports it), the peak memory, and the last loss (fp8 must stay within a few percent of bf16).
The field's anchors: torchao reports +25% tokens/s (tensorwise) on Llama3-8B and about +5-7% at GPT-2
small scale, where the matmuls are too small to gain much.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT, SIZES, GPTConfig  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import fp8, optim  # noqa: E402

CONFIGS = {
    **SIZES,
    # GPT-2 XL-like width at 24 layers: 1.3B parameters, matmuls dominate the step.
    "gpt2-1.3b": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=2048, bias=True),
}
VARIANTS = ["amp_bf16", "funcamp_bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_delayed"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="gpt2-124m", choices=sorted(CONFIGS))
    p.add_argument(
        "--n-layer",
        type=int,
        default=None,
        help="blocks (default: the config's); fewer blocks of the same width keep every matmul's shape and cut the\n"
        "compile time (the embedding and LM head weigh more, so fp8's gain reads lower than at full depth)",
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: from the GPU name)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    for key, value in {"H100": 989.4, "H200": 989.4, "H20": 148.0, "A100": 312.0, "L40": 181.0}.items():
        if key in name:
            return value
    return None


def batches(cfg: GPTConfig, batch_size: int, n: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=g)
        out.append({"inputs": tokens[:, :-1].to(device), "targets": tokens[:, 1:].to(device)})
    return out


def build(variant: str, model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> Any:
    """A ``step(batch) -> loss`` closure holding its own state."""
    if variant == "amp_bf16":
        m = copy.deepcopy(model)
        compiled = torch.compile(m, backend=args.backend)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")

        def amp_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = compiled(batch["inputs"])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return amp_step
    m = model if variant == "funcamp_bf16" else fp8.convert(model, variant.removeprefix("fp8_"))
    stateful = variant == "fp8_delayed"  # a bool: loss_fn must not hold the initial buffers (dynamo guards on them)
    out = fa.nn.functionalize(m, "p=f32,c=bf16,o=f32", module_policies=fp8.MODULE_POLICIES, with_buffers=stateful)
    apply_fn, params = out.apply_fn, out.params
    buffers = out.buffers if stateful else None  # the delayed recipe's state; none for the others

    def loss_fn(params: Any, *rest: Any) -> Any:
        if not stateful:
            logits, new = apply_fn(params, rest[0]["inputs"]), None
        else:
            logits, new = apply_fn(params, rest[0], rest[1]["inputs"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rest[-1]["targets"].flatten())
        return (loss, new) if stateful else loss

    opt = optim.adamw(3e-4, weight_decay=0.1)
    holder = {"state": fa.TrainState.create(params, opt, loss_scale=fa.NoOpLossScale(), buffers=buffers)}
    train_step = fa.make_train_step(loss_fn, opt, backend=args.backend)

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        holder["state"], metrics = train_step(holder["state"], batch)
        return metrics["loss"]

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variant: str, model: torch.nn.Module, data: list, args: argparse.Namespace, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    step = build(variant, model, args, device)
    for i in range(args.warmup):
        loss = step(data[i % len(data)])
    sync(device)
    warm_s = time.perf_counter() - t0
    rounds = []
    for _ in range(args.rounds):
        sync(device)
        t = time.perf_counter()
        for i in range(args.steps):
            loss = step(data[i % len(data)])
        sync(device)
        rounds.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"variant": variant, "round_s": rounds, "warmup_s": warm_s, "loss": float(loss), "peak_gib": peak}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    cfg = CONFIGS[args.config]
    if args.n_layer is not None:
        cfg = dataclasses.replace(cfg, n_layer=args.n_layer)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    n_params = model.num_params()
    tokens = args.batch_size * cfg.block_size
    flops_per_token = 6 * n_params + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd
    peak = peak_tflops(device, args.peak_tflops)
    data = batches(cfg, args.batch_size, 4, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else torch.backends.cpu.get_cpu_capability()
    print(
        f"{name} | torch {torch.__version__} | {args.config} ({n_params / 1e6:.1f}M params) | "
        f"{args.batch_size} x {cfg.block_size} tokens | {args.rounds} rounds x {args.steps} steps | {args.backend}"
    )
    results = []
    for variant in args.variants.split(","):
        r = measure(variant, model, data, args, device)
        median = statistics.median(r["round_s"])
        r["tokens_s"] = tokens * args.steps / median
        r["spread"] = [tokens * args.steps / t for t in (max(r["round_s"]), min(r["round_s"]))]
        r["mfu"] = r["tokens_s"] * flops_per_token / (peak * 1e12) if peak else None
        results.append(r)
        if args.json:  # after each variant: a run cut short by a time limit keeps what it measured
            write_json(args.json, name, cfg, args, results)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = {r["variant"]: r["tokens_s"] for r in results}
    print(
        f"{'variant':16} {'tokens/s':>12} {'spread':>21} {'x amp_bf16':>10} {'x funcamp_bf16':>14} "
        f"{'MFU':>6} {'peak GiB':>8} {'loss':>8} {'warmup s':>8}"
    )
    for r in results:
        ratio_amp = r["tokens_s"] / base["amp_bf16"] if "amp_bf16" in base else float("nan")
        ratio_fa = r["tokens_s"] / base["funcamp_bf16"] if "funcamp_bf16" in base else float("nan")
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        lo, hi = r["spread"]
        print(
            f"{r['variant']:16} {r['tokens_s']:12,.0f} {lo:10,.0f}-{hi:<10,.0f} {ratio_amp:10.3f} {ratio_fa:14.3f} "
            f"{mfu:>6} {r['peak_gib']:8.1f} {r['loss']:8.4f} {r['warmup_s']:8.1f}"
        )
    return results


def write_json(path: str, device: str, cfg: GPTConfig, args: argparse.Namespace, results: list[dict]) -> None:
    meta = {"device": device, "torch": torch.__version__, "config": dataclasses.asdict(cfg), "args": vars(args)}
    Path(path).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
