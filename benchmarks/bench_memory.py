"""What one train step adds to memory over the state at rest: torch.amp against funcamp, with and without donation.

    python benchmarks/bench_memory.py                         # the state-dominated MLP and the GPT small
    python benchmarks/bench_memory.py --models mlp,gpt,gpt2   # and GPT-2 124M (slow to compile on a CPU)

Each (model, variant) runs in a fresh process: two warm-up steps (the first compiles), then ``--steps`` measured
steps. At rest (between steps) the process holds the parameters and the optimizer state (torch: ``.grad`` set
to None at the end of each step; funcamp: the state it was handed back). A step's peak is the live tensor bytes
before it plus the profiler's peak of CPU-allocator bytes during it (CUDA: ``max_memory_allocated``); the table
gives ``peak - rest`` ("adds"), the rest, and ratios against the compiled in-place torch step and eager torch.

Variants (bfloat16 compute by default, ``--dtype``):

- ``torch_eager``: ``torch.autocast`` + ``torch.optim.AdamW(foreach=True)``, ``zero_grad(set_to_none=True)``;
- ``torch_compiled_opt``: the same with ``torch.compile(optimizer.step)`` (an in-place compiled update);
- ``funcamp_eager`` / ``funcamp_eager_donate``: ``make_train_step(compile=False)``, without / with ``donate=True``;
- ``funcamp_compiled`` / ``funcamp_compiled_donate``: ``make_train_step`` (inductor), without / with ``donate``.
- with activation checkpointing of every block (GPT models; ``--variants``): ``torch_eager_ckpt``, ``torch_compiled``
  / ``torch_compiled_ckpt`` (``torch.compile(model)``), ``funcamp_eager_remat``, ``funcamp_compiled_remat``,
  ``funcamp_compiled_donate_remat`` (``functionalize(remat=Block)``); the table compares each with its base.
  ``--time-steps N`` times N steps after the memory (best kept; separate processes, so noisy on a shared machine).
  ``--remat-budgets 0,0.25,0.5,0.75,1`` runs each ``funcamp_*_remat`` variant once per activation memory budget
  (``remat=funcamp.nn.Remat(Block, budget=b)``; 0 is ``remat=Block``), named ``<variant>@<b>``.
- with the chunked LM head and loss (GPT models; ``--variants``): ``torch_eager_lce``, ``torch_eager_ckpt_lce``,
  ``funcamp_compiled_donate_lce``, ``funcamp_compiled_donate_remat_lce``: the model's forward returns
  ``funcamp.nn.linear_cross_entropy`` of the hidden states and the tied head's weight (``--chunk-size`` rows at a
  time), so the 2048 x 50304 logits of GPT-2 are never made whole; compared with the same step without ``_lce``.

Models: ``mlp`` (8 x ``Linear(2048, 2048)``, 33.6M parameters, batch 8: the state dominates), ``gpt``
(``examples/gpt.py`` ``small``, batch 32 x 128: activations matter), ``gpt2`` (GPT-2 124M shape, batch 8 x 256).
Results: ``--out FILE.json`` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from bench_train_step import (  # noqa: E402
    MLP,
    ChunkedHeadLoss,
    _trim,
    checkpoint_blocks,
    live_tensor_bytes,
    machine,
    profiled_step,
)
from gpt import GPT, SIZES, Block, GPTConfig  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import optim  # noqa: E402

VARIANTS = (
    "torch_eager",
    "torch_compiled_opt",
    "funcamp_eager",
    "funcamp_eager_donate",
    "funcamp_compiled",
    "funcamp_compiled_donate",
)
#: Activation checkpointing of every transformer block (GPT models only): ``torch_eager_ckpt`` wraps each block with
#: ``torch.utils.checkpoint`` (non-reentrant, FSDP's ``checkpoint_wrapper``); ``torch_compiled_ckpt`` is the same
#: under ``torch.compile(model)`` (torch's compiled activation checkpointing, AOTAutograd's partitioner), beside
#: ``torch_compiled`` without it (both with the compiled optimizer); funcamp's use ``functionalize(remat=Block)``.
REMAT_VARIANTS = (
    "torch_eager_ckpt",
    "torch_compiled",
    "torch_compiled_ckpt",
    "funcamp_eager_remat",
    "funcamp_compiled_remat",
    "funcamp_compiled_donate_remat",
)
#: The chunked LM head and loss (GPT models only): the model's forward is ``funcamp.nn.linear_cross_entropy`` of its
#: hidden states and the tied head's weight (:class:`ChunkedHeadLoss`), never the whole logits; the same plain-torch
#: function in torch's variants.
LCE_VARIANTS = (
    "torch_eager_lce",
    "torch_eager_ckpt_lce",
    "funcamp_compiled_donate_lce",
    "funcamp_compiled_donate_remat_lce",
)
#: What a checkpointed (or chunked-loss) variant is compared with: the same step without either.
BASE = {v: v.replace("_remat", "").replace("_ckpt", "").replace("_lce", "") for v in REMAT_VARIANTS + LCE_VARIANTS}
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def make(model_name: str, device: torch.device, seed: int = 0, layers: int = 12) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, batches(n), loss(output, batch))``; ``layers``: GPT-2's blocks (12 for GPT-2 124M)."""
    torch.manual_seed(seed)
    if model_name == "mlp":
        model = MLP().to(device)

        def batches(n: int) -> list[dict[str, torch.Tensor]]:
            g = torch.Generator(device="cpu").manual_seed(seed + 1)
            return [{"x": torch.randn(8, 2048, generator=g).to(device)} for _ in range(n)]

        return model, batches, lambda out, b: out.float().square().mean()
    config = (
        SIZES["small"]
        if model_name == "gpt"
        else GPTConfig(vocab_size=50304, block_size=256, n_layer=layers, n_head=12, n_embd=768, bias=True)
    )
    batch, block = (32, 128) if model_name == "gpt" else (8, 256)
    model = GPT(config).to(device)

    def batches(n: int) -> list[dict[str, torch.Tensor]]:
        g = torch.Generator(device="cpu").manual_seed(seed + 1)
        out = []
        for _ in range(n):
            tokens = torch.randint(0, config.vocab_size, (batch, block + 1), generator=g).to(device)
            out.append({"x": tokens[:, :-1], "y": tokens[:, 1:]})
        return out

    return model, batches, lambda out, b: F.cross_entropy(out.flatten(0, 1).float(), b["y"].flatten())


def build(
    variant: str,
    model: torch.nn.Module,
    loss: Any,
    dtype: torch.dtype,
    backend: str,
    chunk_size: int = 256,
    remat_budget: float = 0.0,
):
    device = next(model.parameters()).device
    remat = "_remat" in variant or "_ckpt" in variant
    if (remat or variant.endswith("_lce")) and not isinstance(model, GPT):
        raise ValueError(f"bench_memory: {variant} needs transformer blocks and a head: use it with --models gpt,gpt2")
    inputs = lambda b: (b["x"],)  # noqa: E731
    if variant.endswith("_lce"):
        model, loss = ChunkedHeadLoss(model, chunk_size), lambda out, b: out
        inputs = lambda b: (b["x"], b["y"])  # noqa: E731
    if variant.startswith("torch"):
        if remat:
            checkpoint_blocks(model, Block)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)
        compiled = variant.startswith("torch_compiled")
        update = torch.compile(opt.step, backend=backend) if compiled else opt.step
        if variant in ("torch_compiled", "torch_compiled_ckpt"):
            model = torch.compile(model, backend=backend)

        def torch_step(batch: dict[str, torch.Tensor]) -> None:
            with torch.autocast(device.type, dtype=dtype):
                value = loss(model(*inputs(batch)), batch)
            value.backward()
            update()
            opt.zero_grad(set_to_none=True)

        return torch_step
    policy = fa.get_policy(f"params=float32,compute={str(dtype).split('.')[1]},output=float32")
    blocks = fa.nn.Remat(Block, budget=remat_budget) if remat_budget else Block
    apply_fn, params = fa.nn.functionalize(model, policy, remat=blocks if remat else None)
    params = {k: v.detach().clone() for k, v in params.items()}  # the state owns its tensors
    opt = optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD)
    box = [fa.TrainState.create(params, opt)]
    step = fa.make_train_step(
        lambda p, b: loss(apply_fn(p, *inputs(b)), b),
        opt,
        compile="compiled" in variant,
        backend=backend,
        donate="donate" in variant,
    )

    def funcamp_step(batch: dict[str, torch.Tensor]) -> None:
        box[0], _ = step(box[0], batch)

    return funcamp_step


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this fresh process."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    _trim()
    before = live_tensor_bytes(device)
    model, batches, loss = make(args.model, device, layers=args.gpt2_layers)
    data = iter(batches(2 + 2 * args.steps + args.time_steps))
    step = build(args.variant, model, loss, dtype, args.backend, args.chunk_size, args.remat_budget)
    del model
    for _ in range(2):
        step(next(data))
    _trim()
    peaks, rests = [], []
    for _ in range(args.steps):
        rest = live_tensor_bytes(device) - before
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            step(next(data))
            torch.cuda.synchronize()
            peak = rest + torch.cuda.max_memory_allocated(device) - base
        else:
            peak = rest + profiled_step(lambda: step(next(data)))[0]
        peaks.append(peak)
        rests.append(rest)
    times = []
    for _ in range(args.time_steps):  # after the memory steps, without the profiler
        batch = next(data)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    remat = "_remat" in args.variant and args.remat_budgets is not None
    return {
        "model": args.model,
        "variant": f"{args.variant}@{args.remat_budget:g}" if remat else args.variant,
        "remat_budget": args.remat_budget if "_remat" in args.variant else None,
        "rest_mb": max(rests) / 2**20,
        "peak_mb": max(peaks) / 2**20,
        "adds_mb": max(p - r for p, r in zip(peaks, rests)) / 2**20,
        "ms_per_step": min(times) if times else None,
    }


def markdown(rows: list[dict[str, Any]], info: dict[str, Any], argv: list[str]) -> str:
    lines = [
        f"`python benchmarks/bench_memory.py {' '.join(argv)}`; {info['cpu']} "
        f"({info['cpu_capability']}), torch {info['torch']}{(', ' + info['gpu']) if info.get('gpu') else ''}.",
        "",
        "| model | variant | state at rest MB | step adds MB | vs compiled torch.optim | vs eager torch "
        "| vs no remat | ms/step | time vs no remat |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "-"

    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["variant"]: r for r in rows if r["model"] == model}
        ref_c, ref_e = by.get("torch_compiled_opt"), by.get("torch_eager")
        for name, r in by.items():
            base = by.get(BASE.get(name.split("@")[0], ""))
            ms = r.get("ms_per_step")
            lines.append(
                f"| {model} | {name} | {r['rest_mb']:.1f} | {r['adds_mb']:.1f} "
                f"| {ratio(r['adds_mb'], ref_c and ref_c['adds_mb'])} "
                f"| {ratio(r['adds_mb'], ref_e and ref_e['adds_mb'])} "
                f"| {ratio(r['adds_mb'], base and base['adds_mb'])} | {'-' if ms is None else f'{ms:.0f}'} "
                f"| {ratio(ms, base and base.get('ms_per_step'))} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,gpt", help="comma-separated: mlp, gpt, gpt2 (default mlp,gpt)")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS + REMAT_VARIANTS + LCE_VARIANTS)}",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=2, help="measured steps per variant (default 2)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--time-steps", type=int, default=0, help="timed steps per variant after the memory (best kept)")
    p.add_argument("--gpt2-layers", type=int, default=12, help="blocks of the gpt2 model (12: GPT-2 124M)")
    p.add_argument("--chunk-size", type=int, default=256, help="rows per chunk of the _lce variants' loss")
    p.add_argument(
        "--remat-budgets",
        default=None,
        help="comma-separated activation memory budgets in [0, 1]: each _remat variant once per budget",
    )
    p.add_argument("--remat-budget", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="write the rows and the machine as JSON here")
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--probe-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:  # a child process
        result = probe(args)
        Path(args.probe_out).write_text(json.dumps(result))
        return [result]
    rows = []
    argv_used = argv if argv is not None else sys.argv[1:]
    budgets = [float(b) for b in args.remat_budgets.split(",")] if args.remat_budgets else [0.0]
    runs = [
        (variant, budget)
        for variant in args.variants.split(",")
        for budget in (budgets if "_remat" in variant else [0.0])
    ]
    for model in args.models.split(","):
        for variant, budget in runs:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            cmd = [
                sys.executable,
                __file__,
                "--model",
                model,
                "--variant",
                variant,
                "--probe-out",
                out,
                "--dtype",
                args.dtype,
                "--device",
                args.device,
                "--backend",
                args.backend,
                "--steps",
                str(args.steps),
                "--threads",
                str(args.threads),
                "--time-steps",
                str(args.time_steps),
                "--gpt2-layers",
                str(args.gpt2_layers),
                "--chunk-size",
                str(args.chunk_size),
                "--remat-budget",
                str(budget),
            ]
            if args.remat_budgets:
                cmd += ["--remat-budgets", args.remat_budgets]
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            subprocess.run(cmd, check=True, env=env)
            rows.append(json.loads(Path(out).read_text()))
            os.unlink(out)
            row = rows[-1]
            print(f"{model} {row['variant']}: adds {row['adds_mb']:.1f} MB over {row['rest_mb']:.1f} MB", flush=True)
            if args.out:  # after each variant: a long run stopped early keeps what it measured
                Path(args.out).write_text(json.dumps({"machine": machine(), "argv": argv_used, "rows": rows}, indent=1))
    info = machine()
    print(markdown(rows, info, argv if argv is not None else sys.argv[1:]))
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": info, "argv": argv_used, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
