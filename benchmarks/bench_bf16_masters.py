"""bfloat16 master weights against float32 ones on the main job's GPT: validation loss and bytes per parameter.

    python benchmarks/bench_bf16_masters.py                    # small GPT, 200 steps, 6 runs
    python benchmarks/bench_bf16_masters.py --steps 400 --runs f32 kahan

Each run trains the main job's model (``examples/gpt.py``, size ``--model``) on the main job's text and
batches (``examples/train_gpt.py``: same data, same seed, same schedule, clipping and AdamW with no
decay of norms and biases) for ``--steps`` steps, computing in float32 (bfloat16 matmuls are 20-40x
slower than float32 on AVX2-only CPUs; the master weights are the only thing that changes), and reports
the validation loss at the end (the main job's ``evaluate``), the bytes per parameter of the
weights plus the optimizer state, and the time per step after the first (which compiles; measured on
a shared machine, so only a rough guide):

* ``f32``: float32 master weights (``params=float32``), float32 moments: the reference;
* ``bf16``: bfloat16 weights (``params=bfloat16``; LayerNorms stay float32), plain round-to-nearest;
* ``kahan`` / ``sr``: bfloat16 weights with ``optim.kahan_summation`` / ``optim.stochastic_rounding``;
* ``kahan-m16`` / ``sr-m16``: the same with bfloat16 Adam moments (``moment_dtype=torch.bfloat16``).

Prints one line per run and a table (Markdown) with the loss relative to ``f32``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import train_gpt  # noqa: E402
from gpt import GPT, config_for  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import _tree, optim  # noqa: E402

RUNS = {  # name -> (params dtype, wrapper, moment dtype)
    "f32": ("float32", None, None),
    "bf16": ("bfloat16", None, None),
    "kahan": ("bfloat16", "kahan", None),
    "sr": ("bfloat16", "sr", None),
    "kahan-m16": ("bfloat16", "kahan", torch.bfloat16),
    "sr-m16": ("bfloat16", "sr", torch.bfloat16),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", help="examples/gpt.py size (default: small)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default: 200)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (the main job's default)")
    p.add_argument("--eval-batches", type=int, default=16, help="validation batches (default: 16)")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


def build_optimizer(args: argparse.Namespace, params: dict, wrapper: str | None, moment_dtype: torch.dtype | None):
    """The main job's optimizer (examples/train_gpt.py), optionally wrapped for bfloat16 master weights."""
    decay_mask = {name: p.ndim >= 2 for name, p in params.items()}
    warmup = min(50, args.steps // 10)
    schedule = optim.warmup_cosine_decay(args.lr, warmup=warmup, total=args.steps, end_value=args.lr / 10)
    inner = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask, moment_dtype=moment_dtype),
    )
    if wrapper == "kahan":
        return optim.kahan_summation(inner)
    if wrapper == "sr":
        return optim.stochastic_rounding(inner, seed=args.seed)
    return inner


def run(args: argparse.Namespace, name: str, train: torch.Tensor, val: torch.Tensor) -> dict:
    dtype, wrapper, moment_dtype = RUNS[name]
    cfg = config_for(args.model, vocab_size=256)
    policy = fa.get_policy(f"params={dtype},compute=float32,output=float32")
    torch.manual_seed(args.seed)
    apply_fn, params = fa.nn.functionalize(GPT(cfg), policy)
    loss_fn = train_gpt.make_loss_fn(apply_fn)
    optimizer = build_optimizer(args, params, wrapper, moment_dtype)
    state = fa.TrainState.create(params, optimizer)
    step = fa.make_train_step(loss_fn, optimizer, backend=args.backend)
    n_params = sum(p.numel() for p in params.values())
    bytes_per_param = (_tree.tree_bytes(state.params) + _tree.tree_bytes(state.opt_state)) / n_params
    ev = argparse.Namespace(
        eval_batches=args.eval_batches, batch_size=args.batch_size, block_size=cfg.block_size, seed=args.seed
    )
    t1 = time.perf_counter()
    for i in range(args.steps):
        batch = train_gpt.get_batch(train, i, batch_size=args.batch_size, block_size=cfg.block_size, seed=args.seed)
        state, metrics = step(state, batch)
        if i == 0:  # the first step compiles
            float(metrics["loss"])
            t1 = time.perf_counter()
    train_loss = float(metrics["loss"])
    seconds = (time.perf_counter() - t1) / max(args.steps - 1, 1)
    val_loss = train_gpt.evaluate(loss_fn, state.params, val, ev, torch.device("cpu"))
    skipped = int(state.skipped_steps)
    return dict(
        name=name, val=val_loss, train=train_loss, bytes=bytes_per_param, seconds=seconds, n=n_params, skipped=skipped
    )


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data, _ = train_gpt.load_corpus(None)
    cfg = config_for(args.model, vocab_size=256)
    train, val = train_gpt.split(data, cfg.block_size)
    cap = torch.backends.cpu.get_cpu_capability()
    print(
        f"torch {torch.__version__}, CPU capability {cap}, {torch.get_num_threads()} threads, model {args.model}, "
        f"{args.steps} steps, batch {args.batch_size}, compute float32, backend {args.backend}",
        flush=True,
    )
    results = []
    for name in args.runs:
        r = run(args, name, train, val)
        results.append(r)
        print(
            f"{name:10s} val {r['val']:.4f}  train {r['train']:.4f}  {r['bytes']:.2f} B/param  skipped {r['skipped']}  "
            f"{1e3 * r['seconds']:.0f} ms/step after the first ({r['n'] / 1e6:.2f}M params)",
            flush=True,
        )
    ref = next((r["val"] for r in results if r["name"] == "f32"), None)
    print("\n| master weights | val loss | vs f32 | bytes/param (weights + AdamW state) |")
    print("|---|---|---|---|")
    for r in results:
        rel = f"{100 * (r['val'] / ref - 1):+.2f}%" if ref else "n/a"
        print(f"| {r['name']} | {r['val']:.4f} | {rel} | {r['bytes']:.2f} |")


if __name__ == "__main__":
    main()
