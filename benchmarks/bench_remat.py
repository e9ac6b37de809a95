"""Benchmark: activation checkpointing (remat) of every transformer block, eager, float32: memory and time.

    python benchmarks/bench_remat.py                                  # both models, defaults below
    python benchmarks/bench_remat.py --model gpt --rounds 5
    python benchmarks/bench_remat.py --model gpt2 --batch-size 2 --seq-len 256 --json out.json

Models: the main job's GPT (``examples/gpt.py``, size ``small``, batch 32 x 128 bytes of Python's bundled
``pydoc_data.topics`` text) and GPT-2 124M (``transformers.GPT2Config()``, random weights, SDPA attention,
dropout 0.1 as configured, batch 2 x 256 random token ids). Four variants train each from the same
initial weights with AdamW (lr 1e-3), float32 throughout (this benchmark is about activations):

1. ``torch``: plain eager PyTorch, ``loss.backward()`` and ``torch.optim.AdamW(foreach=True)``.
2. ``torch_ckpt``: variant 1 with every block wrapped by FSDP's
   ``apply_activation_checkpointing(check_fn=...)`` (``torch.utils.checkpoint``, non-reentrant): torch's
   own recipe, the reference for the cost of recomputation.
3. ``funcamp``: ``functionalize`` + ``make_train_step(compile=False)`` (plain autograd: where torch can
   checkpoint; under ``torch.func`` and in the compiled step it cannot, see ``funcamp.nn``).
4. ``funcamp_remat``: variant 3 with ``functionalize(..., remat=<block type>)``.
5. ``funcamp_compiled`` / ``funcamp_compiled_remat`` (``--variants``): the inductor-compiled step without / with
   ``remat=`` (``funcamp.passes.RematPass`` recomputes the regions); no separate forward+backward peak.
   ``--remat-budgets 0,0.5,1`` runs each ``funcamp*_remat`` variant once per activation memory budget
   (``remat=funcamp.nn.Remat(block, budget=b)``), named ``<variant>@<b>``, all interleaved in the rounds;
   ``--compute bfloat16`` and ``--donate`` set the funcamp variants' compute dtype and ``make_train_step(donate=)``
   (torch's variants stay float32).

Time: each variant is warmed up (one step), then ``--rounds`` rounds run ``--steps`` steps of every variant
in turn, the order rotated each round; the median of the rounds' ms/step is reported, with ratios to
variant 1 and (remat) to the same stack without it, and the best (lowest) round with its ratio, less
sensitive to other processes on a shared machine. Memory, after the timing: ``step peak MB`` is the
highest number of bytes PyTorch's CPU allocator held during one step above what was live when the step
began (the profiler's running total, ``bench_train_step.profiled_step``; activations, gradients and
temporaries; the parameters and optimizer state held between steps are not in it), the max over
``--probe-steps`` steps; on CUDA, ``torch.cuda.max_memory_allocated`` over the step minus the bytes allocated
before it. ``fwd+bwd peak MB`` is the same measure of the forward and backward alone (``loss.backward()``;
eager ``funcamp.grad_and_value``), without the optimizer update: the part checkpointing changes. funcamp's
functional update allocates new parameters and moments (3 x 4 bytes per parameter) while the old ones are
live, so for a large model with a small batch its whole-step peak is the update's, not the activations'.
The first step of every variant, from the same RNG seed, must give the same loss (variants 1-4
compute the same function): it is printed and checked.

Measured on an AMD EPYC (AVX2 only, ``torch.backends.cpu.get_cpu_capability()`` = ``AVX2``), 2 cores shared
with other work (timings noisy; memory exact), torch 2.13.0+cpu, float32, first-step losses equal in every run:

- ``python benchmarks/bench_remat.py --model gpt --rounds 7 --steps 2``: GPT small, batch 32 x 128. Step peak
  144.5 MB -> 48.5 MB (0.34x) for torch and funcamp alike; time 1.26x (torch) and 1.21x median / 1.29x best
  (funcamp) the same stack without checkpointing.
- ``python benchmarks/bench_remat.py --model gpt2 --rounds 3 --steps 1``: GPT-2 124M, batch 2 x 256.
  Forward+backward peak 1055.1 -> 769.2 MB (0.73x) for both; whole step: torch 0.90x, funcamp 1.00x (its
  peak, 3944.8 MB, is the functional AdamW update's); time 1.30x (torch), 1.04x median / 1.33x best (funcamp).
- ``python benchmarks/bench_remat.py --model gpt2 --batch-size 8 --rounds 3 --steps 1``: batch 8 x 256.
  Forward+backward peak 4220.3 -> 1268.0 MB (0.30x) for both; whole step: torch 0.30x, funcamp 0.93x
  (4220.3 -> 3944.8 MB, the update's); time 1.06x median / 1.18x best (torch), 1.16x / 1.13x (funcamp).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train_step import (  # noqa: E402  (also puts examples/ on the path)
    ChunkedHeadLoss,
    checkpoint_blocks,
    load_corpus,
    machine,
    profiled_step,
)
from gpt import GPT, Block, config_for  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import optim  # noqa: E402
from funcamp.nn import functionalize  # noqa: E402

VARIANTS = ("torch", "torch_ckpt", "funcamp", "funcamp_remat")
#: The inductor-compiled step (funcamp.passes.RematPass recomputes the regions): ``--variants`` adds them;
#: ``_lce``: with the chunked LM head and loss (``bench_train_step.ChunkedHeadLoss``, ``--model gpt`` only).
COMPILED = ("funcamp_compiled", "funcamp_compiled_remat", "funcamp_compiled_remat_lce")
LR = 1e-3
POLICY = "params=float32,compute=float32,output=float32"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=("gpt", "gpt2", "both"), default="both")
    p.add_argument("--gpt-size", default="small", help="examples/gpt.py size (default small)")
    p.add_argument("--gpt-batch", type=int, default=32)
    p.add_argument("--gpt-block", type=int, default=None, help="tokens per sequence (default: the size's block_size)")
    p.add_argument("--chunk-size", type=int, default=256, help="rows per chunk of the _lce variants' loss")
    p.add_argument("--batch-size", type=int, default=2, help="GPT-2 124M sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="GPT-2 124M tokens per sequence")
    p.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--probe-steps", type=int, default=1, help="profiled steps per variant for memory")
    p.add_argument("--variants", nargs="+", choices=VARIANTS + COMPILED, default=list(VARIANTS))
    p.add_argument("--remat-budgets", default=None, help="comma-separated budgets: each _remat variant once per budget")
    p.add_argument("--compute", default="float32", help="the funcamp variants' compute dtype (default float32)")
    p.add_argument("--donate", action="store_true", help="the funcamp variants' make_train_step(donate=True)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


# --- models and batches ------------------------------------------------------------------------------


def gpt_job(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, type, Any, Callable]:
    cfg = config_for(args.gpt_size, block_size=args.gpt_block)
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    data = load_corpus()
    g = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(len(data) - cfg.block_size - 1, (args.gpt_batch,), generator=g)
    windows = data[starts[:, None] + torch.arange(cfg.block_size + 1)].long().to(device)

    def logits(forward: Callable, inputs: torch.Tensor) -> torch.Tensor:
        return forward(inputs)

    label = f"GPT {args.gpt_size} ({model.num_params():,} params), batch {args.gpt_batch} x {cfg.block_size}"
    return model, Block, (label, windows), logits


def gpt2_job(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, type, Any, Callable]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(args.seed)
    config = GPT2Config()
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config).to(device).train()
    g = torch.Generator().manual_seed(args.seed)
    windows = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=g).to(device)

    def logits(forward: Callable, inputs: torch.Tensor) -> torch.Tensor:
        return forward(input_ids=inputs, use_cache=False).logits

    label = f"GPT-2 124M ({model.num_parameters():,} params), batch {args.batch_size} x {args.seq_len}"
    return model, GPT2Block, (label, windows), logits


# --- the variants ------------------------------------------------------------------------------------


def loss_of(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


class TorchStep:
    """Variants 1-2: eager PyTorch; ``ckpt``: FSDP's apply_activation_checkpointing on every block."""

    def __init__(self, model: torch.nn.Module, block: type, logits: Callable, ckpt: bool) -> None:
        if ckpt:
            checkpoint_blocks(model, block)
        self.model, self.logits = model, logits
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)

    def __call__(self, windows: torch.Tensor) -> torch.Tensor:
        loss = loss_of(self.logits(self.model, windows[:, :-1]), windows)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)  # at the end: the same peak, no gradients held between steps
        return loss.detach()

    def grads(self, windows: torch.Tensor) -> None:
        """Forward and backward only (the part checkpointing changes); the gradients are dropped."""
        loss_of(self.logits(self.model, windows[:, :-1]), windows).backward()
        self.opt.zero_grad(set_to_none=True)


class FuncampStep:
    """Variants 3-4: functionalize + make_train_step(compile=False); ``remat``: the block type."""

    def __init__(
        self,
        model: torch.nn.Module,
        block: type,
        logits: Callable,
        remat: bool,
        compiled: bool = False,
        budget: float = 0.0,
        policy: str = POLICY,
        donate: bool = False,
    ) -> None:
        blocks = fa.nn.Remat(block, budget=budget) if budget else block
        apply_fn, params = functionalize(model, policy, remat=blocks if remat else None)
        self.compiled = compiled
        self.remat = apply_fn.remat
        chunked = isinstance(model, ChunkedHeadLoss)

        def loss_fn(params: dict[str, torch.Tensor], windows: torch.Tensor) -> torch.Tensor:
            if chunked:  # the model's forward is the loss
                return apply_fn(params, windows[:, :-1], windows[:, 1:])
            return loss_of(logits(functools.partial(apply_fn, params), windows[:, :-1]), windows)

        self.grad_fn = fa.grad_and_value(loss_fn, fa.NoOpLossScale())  # what the eager step differentiates with
        opt = optim.adamw(LR)
        self.state = fa.TrainState.create(params, opt)
        self.step = fa.make_train_step(loss_fn, opt, compile=compiled, donate=donate)

    def __call__(self, windows: torch.Tensor) -> torch.Tensor:
        self.state, metrics = self.step(self.state, windows)
        return metrics["loss"]

    def grads(self, windows: torch.Tensor) -> None:
        """Forward and backward only (eager ``funcamp.grad_and_value``); the gradients are dropped."""
        self.grad_fn(self.state.params, windows)


def build(
    name: str,
    base: torch.nn.Module,
    block: type,
    logits: Callable,
    chunk_size: int = 256,
    policy: str = POLICY,
    donate: bool = False,
) -> TorchStep | FuncampStep:
    """A variant by name; ``<variant>@<b>``: the same with the activation memory budget ``b``."""
    name, _, budget = name.partition("@")
    model = copy.deepcopy(base)
    if name.endswith("_lce"):
        if not isinstance(model, GPT):
            raise ValueError(f"bench_remat: {name} needs examples/gpt.py's GPT: use it with --model gpt")
        model = ChunkedHeadLoss(model, chunk_size)
    if name.startswith("torch"):
        return TorchStep(model, block, logits, ckpt=name == "torch_ckpt")
    return FuncampStep(
        model,
        block,
        logits,
        remat="_remat" in name,
        compiled="compiled" in name,
        budget=float(budget or 0.0),
        policy=policy,
        donate=donate,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_peak(step: Callable[[], Any], device: torch.device) -> int:
    """Bytes allocated during one step above those live when it began (see the module docstring)."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    return profiled_step(step)[0]


def run_job(job: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    base, block, (label, windows), logits = (gpt_job if job == "gpt" else gpt2_job)(args, device)
    print(f"\n{label}: every {block.__name__} checkpointed in torch_ckpt and funcamp_remat", flush=True)
    steps, first_loss = {}, {}
    budgets = args.remat_budgets.split(",") if args.remat_budgets else None
    expand = lambda v: [f"{v}@{float(b):g}" for b in budgets] if budgets and "_remat" in v and "@" not in v else [v]  # noqa: E731
    args.variants = [name for v in args.variants for name in expand(v)]
    policy = f"params=float32,compute={args.compute},output=float32"
    for name in args.variants:
        steps[name] = build(name, base, block, logits, args.chunk_size, policy, args.donate)
        torch.manual_seed(args.seed + 1)  # the same dropout masks in every variant's first step
        first_loss[name] = steps[name](windows).item()
        print(f"  {name}: first step loss {first_loss[name]:.6f}", flush=True)
    del base
    samples: dict[str, list[float]] = {name: [] for name in args.variants}
    order = list(args.variants)
    for r in range(args.rounds):
        for name in order:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                steps[name](windows)
            sync(device)
            samples[name].append((time.perf_counter() - t0) / args.steps * 1e3)
        print(f"  round {r}: " + ", ".join(f"{n} {samples[n][-1]:.0f} ms" for n in args.variants), flush=True)
        order = order[1:] + order[:1]
    peaks, grad_peaks = {}, {}
    for name in args.variants:
        step = steps[name]
        peaks[name] = max(step_peak(lambda s=step: s(windows), device) for _ in range(args.probe_steps))
        if getattr(step, "compiled", False):  # the compiled step has no separate forward+backward
            continue
        grad_peaks[name] = max(step_peak(lambda s=step: s.grads(windows), device) for _ in range(args.probe_steps))
    rows = {}
    for name in args.variants:
        ms = statistics.median(samples[name])
        plain = "torch" if name.startswith("torch") else name.split("@")[0].replace("_remat", "").replace("_lce", "")
        rows[name] = {
            "ms_per_step": ms,
            "spread_ms": [min(samples[name]), max(samples[name])],
            "vs_torch": ms / statistics.median(samples["torch"]) if "torch" in samples else None,
            "vs_no_ckpt": ms / statistics.median(samples[plain]) if plain in samples else None,
            "best_ms": min(samples[name]),
            "best_vs_no_ckpt": min(samples[name]) / min(samples[plain]) if plain in samples else None,
            "step_peak_mb": peaks[name] / 2**20,
            "peak_vs_no_ckpt": peaks[name] / peaks[plain] if plain in peaks else None,
            "grad_peak_mb": grad_peaks[name] / 2**20 if name in grad_peaks else None,
            "grad_peak_vs_no_ckpt": grad_peaks[name] / grad_peaks[plain]
            if plain in grad_peaks and name in grad_peaks
            else None,
            "first_loss": first_loss[name],
        }
    same = len({v for n, v in first_loss.items() if not n.endswith("_lce")}) == 1  # _lce: its own sum order
    return {"model": label, "block": block.__name__, "rows": rows, "first_losses_equal": same}


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for job in result["jobs"]:
        lines += [
            f"\n{job['model']}, every {job['block']} checkpointed "
            f"(first-step losses equal: {job['first_losses_equal']})\n",
            "| variant | ms/step | spread | vs torch | vs no ckpt | best ms | best vs no ckpt | step peak MB "
            "| peak vs no ckpt | fwd+bwd peak MB | fwd+bwd vs no ckpt |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in job["rows"].items():
            lo, hi = r["spread_ms"]
            lines.append(
                f"| {name} | {r['ms_per_step']:.0f} | {lo:.0f}-{hi:.0f} | {_fmt(r['vs_torch'], '.2f')} | "
                f"{_fmt(r['vs_no_ckpt'], '.2f')} | {r['best_ms']:.0f} | {_fmt(r['best_vs_no_ckpt'], '.2f')} | "
                f"{r['step_peak_mb']:.1f} | {_fmt(r['peak_vs_no_ckpt'], '.2f')} | "
                f"{_fmt(r['grad_peak_mb'], '.1f')} | {_fmt(r['grad_peak_vs_no_ckpt'], '.2f')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    info = machine()
    print(f"machine: {info}", flush=True)
    jobs = ["gpt", "gpt2"] if args.model == "both" else [args.model]
    result = {"command": " ".join(["python", *sys.argv]), "machine": info, "jobs": []}
    for job in jobs:
        result["jobs"].append(run_job(job, args, device))
        gc.collect()
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if all(j["first_losses_equal"] for j in result["jobs"]) else 2


if __name__ == "__main__":
    sys.exit(main())
