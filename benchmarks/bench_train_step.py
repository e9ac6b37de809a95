"""Benchmark: funcamp's compiled train step against the torch.amp recipe, on the same GPT, in one run.

    python benchmarks/bench_train_step.py                        # CPU default (GPT "small", bf16)
    python benchmarks/bench_train_step.py --device cuda --config gpt2-124m --dtype bfloat16
    python benchmarks/bench_train_step.py --device cuda --config gpt2-124m --dtype float16
    python benchmarks/bench_train_step.py --dtype float32 --variants amp_compile,funcamp_compile --no-probe
        # the main job's step where its auto policy chose float32 (no autocast, no loss scale on either side)

Six variants train the GPT of ``examples/gpt.py`` from the same initial weights (one model, deep-copied)
on the same byte-level batches of Python's bundled ``pydoc_data.topics`` text, with the same AdamW
hyperparameters and, for the mixed-precision variants, the same dynamic loss scale (``2**16``, period 2000):

1. ``fp32_eager``: float32, eager, ``torch.optim.AdamW(foreach=True)``.
2. ``amp_eager``: ``torch.autocast`` + ``torch.amp.GradScaler`` + ``torch.optim.AdamW`` (fused where the
   device has the fused kernel, else foreach).
3. ``amp_compile``: variant 2 with ``torch.compile(model)``; optimizer and scaler outside, as users do.
4. ``funcamp_eager``: ``funcamp.nn.functionalize`` + ``funcamp.make_train_step(compile=False)``.
5. ``funcamp_compile``: the same step compiled whole (``fullgraph=True``).

Variants 4-6 run funcamp's step as the main job (``examples/train_gpt.py``) runs it: donating
(``make_train_step(donate=True)``: each step writes the next state into the tensors of the one it is given; the
benchmark never reuses a state), the loss on the whole logits; ``--no-donate`` runs them as pure steps
(``make_train_step``'s default). Each one's plan (compiled or eager, donation, storage) is printed and recorded.
6. ``funcamp_tuned``: variant 5 with the ``module_policies`` map of :func:`funcamp.tune.tune_policy`, measured on
   this device for this model and batch shape (base policy float32; each attention, MLP, embedding and the LM
   head in the dtype that was fastest among those accurate enough). The tuning table is printed.

Two more, on request (``--variants``; not in the default six):

7. ``funcamp_donate``: variant 5 with ``donate=True`` (the next state written into the given one's tensors),
   whatever ``--donate`` says.
8. ``funcamp_graph``: variant 7 replayed as one CUDA graph (:func:`funcamp.capture.cuda_graph`; on a machine
   without CUDA it warns once and runs variant 7: the harness is tested on the CPU, the speed only on a GPU).
9. ``funcamp_donate_off``: variant 7 compiled with the graph passes ``--passes-off`` names switched off
   (``FUNCAMP_PASSES_OFF``; default ``scalars_once``): a pass's effect on speed, in the same rounds as the rest.

Timing: one process; each variant is warmed up (its first call, compile included, is timed on its own),
then ``--rounds`` rounds run ``--steps`` steps of every variant in turn, the order rotated each round; a
round's time over its steps is one sample (device synchronised at both ends). Reported: the median and
the min-max spread of the samples, tokens/s, and ratios of medians to variants 2 and 3.

Time to first step (``first step s``): wall seconds from building a variant's step (its ``tune_policy`` included)
to the end of its first step, compile included, each variant in a fresh process, one at a time, with a
fresh (cold) inductor cache by default (``--first-step warm``: the second of two runs on one cache).

Memory, host syncs and the recompile check run afterwards, in fresh subprocesses (one per variant), so
that no variant sees another's allocations or compiled code; see docs/benchmark.md for the method.
The losses of all variants after the timed steps must agree to mixed-precision tolerance (``--loss-rtol``
relative to float32), or the run is marked void and exits with status 2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import ctypes
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT, SIZES, config_for  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import optim  # noqa: E402
from funcamp.nn import functionalize  # noqa: E402
from funcamp.tune import tune_policy  # noqa: E402

DEFAULT_VARIANTS = ("fp32_eager", "amp_eager", "amp_compile", "funcamp_eager", "funcamp_compile", "funcamp_tuned")
VARIANTS = (*DEFAULT_VARIANTS, "funcamp_donate", "funcamp_graph", "funcamp_donate_off")
#: Variants whose step is compiled (graphs and recompiles are counted for these).
COMPILED = ("amp_compile", "funcamp_compile", "funcamp_tuned", "funcamp_donate", "funcamp_graph", "funcamp_donate_off")
#: Dense bf16 peak of an H100/H200 SXM (TFLOP/s), the default denominator of MFU (``--peak-tflops``).
H100_BF16_DENSE_TFLOPS = 989.0
#: Per-config defaults: (batch size, device) -> sequences per step.
DEFAULT_BATCH = {"tiny": 8, "small": 32, "medium": 16, "gpt2-124m": 16}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1
INIT_SCALE, SCALE_PERIOD = 2.0**16, 2000  # torch.amp.GradScaler's defaults, used by funcamp too
#: The fields of every row of the JSON (None where not measured, e.g. with --no-probe), and of the table.
COLUMNS = (
    "variant",
    "ms_per_step",
    "spread_ms",
    "cpu_ms_per_step",
    "tokens_per_s",
    "ratio_vs_2",
    "ratio_vs_3",
    "peak_mb",
    "peak_vs_2",
    "rss_delta_mb",
    "first_call_s",
    "first_step_s",
    "graphs",
    "recompiles",
    "host_syncs_per_step",
    "final_loss",
)
HEADERS = (
    "variant",
    "ms/step",
    "spread",
    "CPU ms/step",
    "tokens/s",
    "vs 2",
    "vs 3",
    "peak MB",
    "peak vs 2",
    "RSS Δ MB",
    "first call s",
    "first step s",
    "graphs",
    "recompiles",
    "host syncs/step",
    "final loss",
)


def checkpoint_blocks(model: torch.nn.Module, block: type) -> None:
    """Wrap every ``block`` of ``model`` with torch's non-reentrant activation checkpointing (in place), as FSDP's
    ``apply_activation_checkpointing`` does: the torch side of the remat benchmarks."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, block))


class ChunkedHeadLoss(torch.nn.Module):
    """``forward(x, y)``: the mean cross-entropy of ``gpt``'s logits for targets ``y``, by
    ``funcamp.nn.linear_cross_entropy(gpt.hidden_states(x), gpt.lm_head.weight, y)`` (the whole logits never made)."""

    def __init__(self, gpt: torch.nn.Module, chunk_size: int) -> None:
        super().__init__()
        self.gpt, self.chunk_size = gpt, chunk_size

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = self.gpt.hidden_states(x)
        return fa.nn.linear_cross_entropy(hidden, self.gpt.lm_head.weight, y, chunk_size=self.chunk_size)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="small", choices=sorted(SIZES), help="GPT size of examples/gpt.py")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: per config)")
    p.add_argument("--block-size", type=int, default=None, help="context length (default: the config's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float16", "float32"],
        help="compute dtype (default bf16); float32: the recipe without autocast and GradScaler (the fused AdamW and\n"
        "the compiled model kept) against funcamp's float32 policy without a loss scale, the main job's\n"
        "--policy auto where no half dtype is faster",
    )
    p.add_argument(
        "--loss-scale",
        default=None,
        choices=["dynamic", "none"],
        help="GradScaler / funcamp scale (default: dynamic; float32: none, the only choice)",
    )
    p.add_argument(
        "--op-policies",
        default="none",
        help="per-op dtypes of the funcamp variants (not the tuned one): none; auto, the main job's --policy auto\n"
        "rule (funcamp.tune.choose_op_dtypes on one block: attention in float32 where it measures faster); or\n"
        "op=dtype[,op=dtype], e.g. scaled_dot_product_attention=float32 (default: none)",
    )
    p.add_argument("--backend", default="inductor", help="torch.compile backend of variants 3 and 5")
    p.add_argument(
        "--donate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="variants 4-6 donate each state to the next step (make_train_step(donate=True)), as the main job\n"
        "does; --no-donate: pure steps, make_train_step's default (default: on)",
    )
    p.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated, of variants 1-9 (default: 1-6)"
    )
    p.add_argument(
        "--passes-off", default="scalars_once", help="graph passes variant 9 compiles without (FUNCAMP_PASSES_OFF)"
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant, the first call included")
    p.add_argument("--steps", type=int, default=None, help="steps per variant per timed round (CPU 2, CUDA 10)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds, samples per variant (CPU 30, CUDA 10)")
    p.add_argument("--probe-steps", type=int, default=3, help="measured steps in each memory/sync subprocess")
    p.add_argument("--no-probe", action="store_true", help="skip the memory and host-sync subprocesses")
    p.add_argument("--probe-variants", default=None, help="variants to probe (default: all that run)")
    p.add_argument("--probe-workers", type=int, default=None, help="subprocesses at a time (default: CPU 2-4, CUDA 1)")
    p.add_argument("--check-recompiles", type=int, default=200, metavar="N", help="steps of the check (0: skip)")
    p.add_argument("--check-config", default="tiny", choices=sorted(SIZES), help="GPT size of the recompile check")
    p.add_argument("--check-backend", default=None, help="compile backend of the check (default: --backend)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--loss-rtol", type=float, default=None, help="agreement tolerance (default: 0.02 bf16, 0.01 f16)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="MFU denominator, TFLOP/s (CUDA default: 989; CPU default: measured, see --peak-size)",
    )
    p.add_argument(
        "--peak-size",
        type=int,
        default=2048,
        help="CPU: the MFU denominator is the best rate of an N x N x N matmul in the compute dtype, timed\n"
        "before and after the steps with the bench's threads, the better taken (default: 2048; 0: no MFU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="benchmarks/results/bench_train_step.json", help="output JSON file")
    p.add_argument("--markdown", default="benchmarks/results/bench_train_step.md", help="output markdown file")
    p.add_argument("--cache-dir", default=None, help="inductor cache (default: a fresh temporary one: cold compile)")
    p.add_argument(
        "--first-step",
        default="cold",
        choices=["cold", "warm", "none"],
        help="time to first step, in a fresh process per variant: cold (a fresh inductor cache), warm (the\n"
        "second of two runs on one cache) or none (skip)",
    )
    p.add_argument("--first-step-variants", default=None, help="variants to time to first step (default: all)")
    p.add_argument("--tune-cache", default=None, help="tune_policy cache dir of variant 6 (default: none, measure)")
    p.add_argument("--tune-depth", type=int, default=2, help="tune_policy depth of variant 6 (2: attention, MLP)")
    p.add_argument("--tune-rounds", type=int, default=3, help="tune_policy timing rounds of variant 6")
    p.add_argument("--first-step-run", default=None, help=argparse.SUPPRESS)  # internal: one variant's first step
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # internal: run one variant's probe
    p.add_argument("--recompile-check", action="store_true", help=argparse.SUPPRESS)  # internal
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)  # internal: the subprocess's JSON
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    probed = args.variants if args.probe_variants is None else args.probe_variants.split(",")
    args.probe_variants = [v.strip() for v in probed if v.strip()]
    timed = args.variants if args.first_step_variants is None else args.first_step_variants.split(",")
    args.first_step_variants = [v.strip() for v in timed if v.strip()] if args.first_step != "none" else []
    for v in args.variants + args.probe_variants + args.first_step_variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    cuda = args.device == "cuda"
    args.steps = args.steps or (10 if cuda else 2)  # short rounds on a shared CPU: neighbours hit all alike
    args.rounds = args.rounds or (10 if cuda else 30)
    for name in ("warmup", "steps", "rounds", "probe_steps", "tune_rounds", "tune_depth"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.op_policies not in ("none", "auto"):
        try:
            explicit_rules(args.op_policies)
        except ValueError as e:
            p.error(str(e))
    args.dtype = args.dtype or "bfloat16"
    if args.dtype == "float32":  # nothing to scale: no GradScaler, no funcamp loss scale (the table says so)
        if args.loss_scale == "dynamic":
            p.error("--loss-scale dynamic with --dtype float32: float32 has nothing to scale; pass none or omit it")
        args.loss_scale = "none"
    args.loss_scale = args.loss_scale or "dynamic"
    args.check_backend = args.check_backend or args.backend
    args.batch_size = args.batch_size or DEFAULT_BATCH.get(args.config, 16)
    if args.loss_rtol is None:
        args.loss_rtol = {"bfloat16": 0.02, "float16": 0.01}.get(args.dtype, 1e-3)
    args.peak_source = "given (--peak-tflops)" if args.peak_tflops is not None else None
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = H100_BF16_DENSE_TFLOPS
        args.peak_source = "H100/H200 SXM dense bf16, datasheet"
    return args


# --- data and model ----------------------------------------------------------------------------------


def load_corpus() -> torch.Tensor:
    """The English text of Python's help topics (bundled with CPython) as a 1-d uint8 tensor of bytes."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def make_batches(n: int, *, batch_size: int, block_size: int, seed: int, device: torch.device) -> list[dict]:
    """``n`` batches of random windows (inputs, targets shifted by one), fixed by ``seed``, on ``device``."""
    data = load_corpus()
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=g)
        windows = data[starts[:, None] + torch.arange(block_size + 1)].long()
        batches.append({"inputs": windows[:, :-1].to(device), "targets": windows[:, 1:].to(device)})
    return batches


def make_model(args: argparse.Namespace, device: torch.device) -> GPT:
    vocab = 256 if args.config != "gpt2-124m" else None  # bytes; GPT-2's own vocabulary for gpt2-124m
    cfg = config_for(args.config, vocab_size=vocab, block_size=args.block_size)
    torch.manual_seed(args.seed)
    return GPT(cfg).to(device)


def better_peak(before: float, after: float, dtype: str, size: int) -> tuple[float, str]:
    """``(peak, source)``: the better of the matmul rates (TFLOP/s) measured before and after the steps, and the
    sentence the results print for it (``config.peak_source``)."""
    source = (
        f"measured: {dtype} {size}^3 matmul, {torch.get_num_threads()} threads, the better of {before:.2f} before "
        f"the steps and {after:.2f} after"
    )
    return max(before, after), source


def matmul_peak_tflops(dtype: torch.dtype, size: int, *, repeats: int = 10) -> float:
    """This CPU's measured matmul rate in ``dtype``, TFLOP/s: the fastest of ``repeats`` products of two
    ``size x size`` matrices (``2 * size**3`` FLOPs each, after two untimed ones), with torch's threads as set.
    The denominator of MFU on a CPU, where no datasheet peak applies (AMX, AVX-512 with bf16 and AVX2 differ by
    an order of magnitude). :func:`timing_run` measures it before and after the steps and takes the better: on a
    shared 2-core Xeon one run measured 2.21 TFLOP/s and the next 0.77."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def flops_per_token(model: GPT) -> float:
    """Training FLOPs per token of ``model``: ``6 N`` for the parameters' matmuls (forward 2, backward 4) plus
    ``12 L T d`` for attention's scores and weighted sums (``L`` layers, context ``T``, width ``d``; the causal
    mask's skipped half counted, as PaLM's and nanoGPT's MFU count it)."""
    c = model.config
    return 6 * model.num_params() + 12 * c.n_layer * c.block_size * c.n_embd


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fused_supported(device: torch.device) -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices()


# --- the variants -------------------------------------------------------------------------------------


class TorchStep:
    """Variants 1-3: the imperative recipe (autocast, GradScaler, torch.optim.AdamW, zero_grad)."""

    def __init__(self, model: GPT, args: argparse.Namespace, *, amp: bool, compile_model: bool) -> None:
        device = next(model.parameters()).device
        self.device_type = device.type
        self.dtype = getattr(torch, args.dtype)
        # float32 compute: the recipe without autocast and GradScaler (torch.autocast takes no float32 on a CPU)
        self.autocast = amp and self.dtype != torch.float32
        self.model = model
        self.forward = torch.compile(model, backend=args.backend) if compile_model else model
        self.fused = amp and fused_supported(device)
        kind = {"fused": True} if self.fused else {"foreach": True}
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **kind
        )
        self.scaler = torch.amp.GradScaler(
            device.type,
            init_scale=INIT_SCALE,
            growth_interval=SCALE_PERIOD,
            enabled=self.autocast and args.loss_scale == "dynamic",
        )
        self.optimizer_kind = "fused" if self.fused else "foreach"

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.autocast):
            logits = self.forward(batch["inputs"])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # At the end rather than the start: the same peak, and no gradients held between steps.
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


class FuncampStep:
    """Variants 4-6: ``functionalize`` + ``TrainState`` + ``make_train_step`` (6: with a tuned map).

    ``scan``: ``functionalize``'s ``scan=`` (e.g. ``"blocks"``: the GPT's layers compiled once; not with ``tuned``).
    """

    def __init__(
        self,
        model: GPT,
        args: argparse.Namespace,
        *,
        compile: bool,
        tuned: bool = False,
        donate: bool | None = None,
        graph: bool = False,
        scan: str | None = None,
        passes_off: str | None = None,
    ) -> None:
        self.tune, self.passes_off, self.op_policies = None, passes_off, None
        donate = args.donate if donate is None else donate  # the main job's default, unless the variant says
        if tuned:
            policy = fa.get_policy("params=float32,compute=float32,output=float32")
            example = example_batch(args, model)
            t0 = time.perf_counter()
            result = tune_policy(
                model,
                (example["inputs"],),
                policy=policy,
                depth=args.tune_depth,
                rounds=args.tune_rounds,
                cache=args.tune_cache or False,
            )
            self.tune = {
                "seconds": time.perf_counter() - t0,
                "from_cache": result.from_cache,
                "table": str(result),
                "map": {name: str(p) for name, p in result.module_policies.items()},
                "depth": args.tune_depth,
            }
            print(f"\nfuncamp_tuned: tune_policy took {self.tune['seconds']:.1f} s\n{result}\n", flush=True)
            apply_fn, params = functionalize(model, policy, module_policies=result.module_policies)
        else:
            policy = fa.get_policy(f"params=float32,compute={args.dtype},output=float32")
            self.op_policies = op_policies(args, model)
            apply_fn, params = functionalize(model, policy, scan=scan, op_policies=self.op_policies)

        def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
            logits = apply_fn(params, batch["inputs"])  # float32 out
            return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

        opt = optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
        if args.loss_scale == "dynamic":
            scale = fa.DynamicLossScale(INIT_SCALE, period=SCALE_PERIOD, backoff_factor=0.5)
        else:
            scale = fa.NoOpLossScale()
        # a scanned run laid out name-major for a donating step (its stacks views of the buffers), as the main job
        stacked = apply_fn.scan if donate or graph else ()
        self.state = fa.TrainState.create(params, opt, loss_scale=scale, scan=stacked)
        self.step = fa.make_train_step(loss_fn, opt, compile=compile, backend=args.backend, donate=donate or graph)
        self.plan = self.step.plan_for(self.state)  # compiled or eager, donation, storage: the table's note
        if graph:  # variant 8: the donating step replayed as one CUDA graph (uncaptured, with a warning, on a CPU)
            self.step = fa.capture.cuda_graph(self.step)
        self.optimizer_kind = "funcamp.optim.adamw"

    @property
    def capture(self) -> dict[str, Any] | None:
        """Variant 8: graph replays so far and why the step ran uncaptured (None when it was captured)."""
        if not isinstance(self.step, fa.capture.CapturedStep):
            return None
        return {"replays": self.step.replays, "uncaptured_because": self.step.reason}

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # FUNCAMP_PASSES_OFF is read at each compile, so it is set around every call of variant 9
        off = self.passes_off
        with contextlib.nullcontext() if off is None else mock.patch.dict(os.environ, {"FUNCAMP_PASSES_OFF": off}):
            self.state, metrics = self.step(self.state, batch)
        return metrics["loss"]


def example_batch(args: argparse.Namespace, model: GPT) -> dict[str, torch.Tensor]:
    """One batch of the timed shape, not one the steps train on (seed + 1), on the model's device: what the funcamp
    variants measure before they are built (``tune_policy``, ``--op-policies auto``)."""
    device, size = next(model.parameters()).device, block_size(args)
    (batch,) = make_batches(1, batch_size=args.batch_size, block_size=size, seed=args.seed + 1, device=device)
    return batch


def explicit_rules(spec: str) -> dict[str, torch.dtype]:
    """``op=dtype[,op=dtype]`` as ``{op: torch dtype}``; ValueError naming the item that is not (a floating dtype)."""
    rules = {}
    for item in spec.split(","):
        op, _, name = item.partition("=")
        dtype = getattr(torch, name, None) if name else None
        if not op or not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"--op-policies: {item!r} is not op=dtype with a floating dtype (e.g. scaled_dot_product_attention="
                "float32); or pass none or auto"
            )
        rules[op] = dtype
    return rules


def op_policies(args: argparse.Namespace, model: GPT) -> dict[str, torch.dtype] | None:
    """``--op-policies``' rules for ``model`` (auto: measured on one block, as the main job's ``--policy auto``)."""
    spec = args.op_policies
    if spec == "none":
        return None
    if spec != "auto":
        return explicit_rules(spec)
    example = example_batch(args, model)
    probe = fa.tune.block_probe(model, (example["inputs"],))
    choice = fa.tune.choose_op_dtypes(probe, getattr(torch, args.dtype), cache=False)
    print(f"--op-policies auto: {choice.explain()}", flush=True)
    return dict(choice.op_policies) or None


def build_variant(name: str, base: GPT, args: argparse.Namespace) -> TorchStep | FuncampStep:
    model = copy.deepcopy(base)
    if name == "fp32_eager":
        return TorchStep(model, args, amp=False, compile_model=False)
    if name == "amp_eager":
        return TorchStep(model, args, amp=True, compile_model=False)
    if name == "amp_compile":
        return TorchStep(model, args, amp=True, compile_model=True)
    return FuncampStep(
        model,
        args,
        compile=name in COMPILED,
        tuned=name == "funcamp_tuned",
        donate=True if name in ("funcamp_donate", "funcamp_donate_off") else None,  # None: --donate's
        graph=name == "funcamp_graph",
        passes_off=args.passes_off if name == "funcamp_donate_off" else None,
    )


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclasses.dataclass
class Runner:
    """One variant in the timing process: its step, its batch cursor, and what it measured."""

    name: str
    step: Any
    batches: list[dict]
    device: torch.device
    cursor: int = 0
    first_call_s: float = math.nan
    graphs: int = 0
    recompiles: int = 0
    samples_ms: list[float] = dataclasses.field(default_factory=list)
    cpu_samples_ms: list[float] = dataclasses.field(default_factory=list)
    loss: torch.Tensor | None = None

    def run(self, n: int, *, first: bool = False) -> tuple[float, float]:
        """Run ``n`` steps on the next batches: (wall seconds, process CPU seconds); counts new graphs."""
        before = compiled_graphs()
        sync(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            self.loss = self.step(self.batches[self.cursor])
            self.cursor += 1
        sync(self.device)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        new = compiled_graphs() - before
        if first:
            self.graphs += new
        else:
            self.recompiles += new
        return seconds, cpu


# --- subprocess probes: memory and host syncs ----------------------------------------------------------


class MLP(torch.nn.Module):
    """``depth`` x ``Linear(width, width)`` with ReLU: the state-dominated model of bench_memory and bench_sharding."""

    def __init__(self, width: int = 2048, depth: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def live_tensor_bytes(device: torch.device) -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can see on ``device``."""
    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.device.type != device.type or obj.is_meta:
                    continue
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except Exception:  # noqa: BLE001 (functorch wrappers, sparse tensors: no plain storage)
                continue
    return sum(seen.values())


def _walk(nodes: list[Any]) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def profiled_step(step: Callable[[], Any]) -> tuple[int, int]:
    """Run ``step`` under the profiler: (peak bytes allocated during it, device-to-host scalar reads).

    The peak counts tensors allocated by PyTorch's CPU allocator after the step starts (the profiler's
    running total): add the bytes live before the step for the step's peak. Host reads are calls of
    ``aten::_local_scalar_dense`` (every ``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor) and
    ``aten::nonzero`` (data-dependent shapes), which are the ops that synchronise with an accelerator.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    allocs = sorted((n for n in nodes if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    reads = sum(1 for n in nodes if n.name in ("aten::_local_scalar_dense", "aten::nonzero"))
    if not allocs:
        return 0, reads
    # The running total is process-wide and carries over from earlier profiled steps: start from its value
    # before this step's first allocation.
    start = allocs[0].extra_fields.total_allocated - allocs[0].extra_fields.alloc_size
    return max(0, max(n.extra_fields.total_allocated for n in allocs) - start), reads


def cuda_syncs(step: Callable[[], Any]) -> int:
    """Run ``step`` with ``torch.cuda.set_sync_debug_mode("warn")``: the synchronising calls it made."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """Memory and host syncs of one variant, in this (fresh) process."""
    device = torch.device(args.device)
    warmup = min(args.warmup, 2)  # the first call (compile) and one more: the state is the steady one
    n = warmup + 2 * args.probe_steps
    batches = make_batches(n, batch_size=args.batch_size, block_size=block_size(args), seed=args.seed, device=device)
    _trim()
    rss_before_kb = _rss_kb("VmRSS")
    live_before = live_tensor_bytes(device)
    if device.type == "cuda":
        alloc_before = torch.cuda.memory_allocated(device)
    step = build_variant(args.probe, make_model(args, device), args)  # the base model is dropped
    it = iter(batches)
    for _ in range(warmup):
        step(next(it))
    sync(device)
    out: dict[str, Any] = {"variant": args.probe}
    # Peak RSS over the measured steps (the high-water mark reset after warm-up), against the RSS before
    # the model existed: compiled code and the compiler's leftovers are part of it.
    _trim()
    can_reset = True
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        can_reset = False
    for _ in range(args.probe_steps):
        step(next(it))
    sync(device)
    out["rss_delta_mb"] = (_rss_kb("VmHWM") - rss_before_kb) / 1024 if can_reset else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        syncs = sum(cuda_syncs(lambda: step(next(it))) for _ in range(args.probe_steps))
        sync(device)
        out["peak_mb"] = (torch.cuda.max_memory_allocated(device) - alloc_before) / 2**20
        out["rest_mb"] = (torch.cuda.memory_allocated(device) - alloc_before) / 2**20
        out["host_syncs_per_step"] = syncs / args.probe_steps
        out["memory_method"] = "torch.cuda.max_memory_allocated over the measured steps, minus the bytes before"
        out["sync_method"] = "torch.cuda.set_sync_debug_mode('warn') warnings per step"
    else:
        peaks, reads = [], 0
        for _ in range(args.probe_steps):
            live0 = live_tensor_bytes(device)
            peak, r = profiled_step(lambda: step(next(it)))
            peaks.append(live0 + peak)
            reads += r
        out["peak_mb"] = (max(peaks) - live_before) / 2**20
        out["rest_mb"] = (live0 - live_before) / 2**20  # held between steps: parameters, optimizer state
        out["host_syncs_per_step"] = reads / args.probe_steps
        out["memory_method"] = "live tensor bytes before the step + profiler peak of CPU-allocator bytes during it"
        out["sync_method"] = "aten::_local_scalar_dense + aten::nonzero calls per step (torch.profiler)"
    return out


def run_subprocess(extra: list[str], args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), *forwarded(args), *extra, "--out", out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    try:
        if proc.returncode != 0:
            raise RuntimeError(f"subprocess {' '.join(extra)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(Path(out).read_text())
    finally:
        Path(out).unlink(missing_ok=True)


def forwarded(args: argparse.Namespace) -> list[str]:
    """The options a subprocess needs to rebuild the same model, data and variants."""
    out = ["--config", args.config, "--batch-size", str(args.batch_size), "--device", args.device]
    out += ["--dtype", args.dtype, "--loss-scale", args.loss_scale, "--backend", args.backend]
    out += ["--warmup", str(args.warmup), "--probe-steps", str(args.probe_steps), "--seed", str(args.seed)]
    out += ["--check-recompiles", str(args.check_recompiles), "--check-config", args.check_config]
    out += ["--check-backend", args.check_backend]
    out += [] if args.donate else ["--no-donate"]
    out += ["--op-policies", args.op_policies]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.block_size:
        out += ["--block-size", str(args.block_size)]
    out += ["--tune-depth", str(args.tune_depth), "--tune-rounds", str(args.tune_rounds)]
    if args.tune_cache:
        out += ["--tune-cache", args.tune_cache]
    return out


# --- time to first step --------------------------------------------------------------------------------------


def first_step_run(args: argparse.Namespace) -> dict[str, Any]:
    """In this fresh process: seconds from building ``args.first_step_run``'s step to the end of its first step.

    The model and the batch exist before the clock starts (as in ``timing_run``); building includes the
    deep copy of the model, ``functionalize``, ``tune_policy`` (variant 6), ``torch.compile``'s wrapper; the
    first step includes importing and initialising the compiler and compiling.
    """
    device = torch.device(args.device)
    batch = make_batches(1, batch_size=args.batch_size, block_size=block_size(args), seed=args.seed, device=device)[0]
    model = make_model(args, device)
    sync(device)
    t0 = time.perf_counter()
    step = build_variant(args.first_step_run, model, args)
    built = time.perf_counter()
    loss = step(batch)
    sync(device)
    end = time.perf_counter()
    tune = getattr(step, "tune", None)
    return {
        "first_step_s": end - t0,
        "build_s": built - t0,
        "tune_s": tune["seconds"] if tune else None,
        "loss": float(loss),
        "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "compile_phases_s": compile_phases(),
    }


#: Phases of ``torch._dynamo.utils.compile_times()`` reported for the first step (seconds, summed over calls).
COMPILE_PHASES = {
    "_compile.compile_inner": "all of torch.compile",
    "bytecode_tracing": "Dynamo tracing",
    "create_aot_dispatcher_function": "AOTAutograd (incl. inductor)",
    "compile_fx_inner": "inductor",
    "compile_file": "C++ compiler",
    "async_compile.wait": "waiting for compile workers",
}


def compile_phases() -> dict[str, float]:
    """Seconds per compile phase in this process (those of :data:`COMPILE_PHASES` that ran)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    found = dict(zip(names, values))
    return {key: float(found[key]) for key in COMPILE_PHASES if key in found}


def first_steps(args: argparse.Namespace, env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Time to first step of each variant, one fresh subprocess at a time (timings, so never side by side).

    ``cold``: a fresh, empty inductor cache per variant. ``warm``: two runs on one fresh cache; the second
    is reported (the first fills the cache).
    """
    out = {}
    for name in args.first_step_variants:
        print(f"time to first step: {name} ({args.first_step} inductor cache) ...", end=" ", flush=True)
        cache = tempfile.mkdtemp(prefix=f"funcamp-bench-first-{name}-")
        sub_env = {**env, "TORCHINDUCTOR_CACHE_DIR": cache}
        runs = 2 if args.first_step == "warm" else 1
        for _ in range(runs):
            result = run_subprocess(["--first-step-run", name], args, sub_env)
        result["cache"] = args.first_step
        out[name] = result
        print(f"{result['first_step_s']:.1f} s", flush=True)
    return out


# --- the recompile check -----------------------------------------------------------------------------------


def recompile_check(args: argparse.Namespace) -> dict[str, Any]:
    """funcamp compiled, ``--check-recompiles`` steps in float16 with a scale that overflows and grows.

    A ``DynamicLossScale`` starting at ``2**24`` (float16 gradients overflow: skipped steps, backoffs),
    period 10 (growth every 10 finite steps, so it overflows again), and a warmup-cosine learning rate: the
    scale, the skip flag and the learning rate all change, under ``error_on_recompile=True``. Metrics are
    read once, after the last step.
    """
    import torch._dynamo

    device = torch.device(args.device)
    n = args.check_recompiles
    cfg_args = argparse.Namespace(**{**vars(args), "config": args.check_config, "block_size": None})
    model = make_model(cfg_args, device)
    bsz = DEFAULT_BATCH.get(args.check_config, 8)
    batches = make_batches(n, batch_size=bsz, block_size=model.config.block_size, seed=args.seed, device=device)
    apply_fn, params = functionalize(model, "params=float32,compute=float16,output=float32")

    def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(apply_fn(params, batch["inputs"]).flatten(0, 1), batch["targets"].flatten())

    opt = optim.adamw(optim.warmup_cosine_decay(LR, warmup=max(1, n // 10), total=n), weight_decay=WEIGHT_DECAY)
    state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**24, period=10))
    step = fa.make_train_step(loss_fn, opt, backend=args.check_backend)
    before = compiled_graphs()
    metrics = []
    reads = 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        state, m = step(state, batches[0])
        graphs = compiled_graphs() - before
        metrics.append(m)
        for i in range(1, n):
            if i == n - 1:  # the last step, watched for host syncs

                def one(i: int = i) -> None:
                    nonlocal state
                    state, m = step(state, batches[i])
                    metrics.append(m)

                reads = cuda_syncs(one) if device.type == "cuda" else profiled_step(one)[1]
                continue
            state, m = step(state, batches[i])
            metrics.append(m)
    recompiles = compiled_graphs() - before - graphs
    scales = [float(m["loss_scale"]) for m in metrics]
    lrs = [float(m["learning_rate"]) for m in metrics]
    finite = [bool(m["grads_finite"]) for m in metrics]
    return {
        "steps": n,
        "config": args.check_config,
        "backend": args.check_backend,
        "compute": "float16",
        "graphs": graphs,
        "recompiles": recompiles,
        "skipped_steps": finite.count(False),
        "scale_changes": sum(a != b for a, b in zip(scales, scales[1:])),
        "distinct_scales": len(set(scales)),
        "lr_changes": sum(a != b for a, b in zip(lrs, lrs[1:])),
        "host_reads_last_step": reads,
        "final_loss": float(metrics[-1]["loss"]),
        "skipped_steps_in_state": int(state.skipped_steps),
    }


# --- the timing run ------------------------------------------------------------------------------------------


def block_size(args: argparse.Namespace) -> int:
    return args.block_size or SIZES[args.config].block_size


#: The C library's allocator settings a CPU step's time depends on (docs/memory.md, "The undonated step and the
#: allocator"): torch.amp's GPT-2 124M step took 2199-2683 ms with them unset and 1464 ms with freed memory kept, in
#: runs beside a donated funcamp step (docs/benchmarks.md), so every figure says which it ran under.
ALLOCATOR_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def allocator_settings() -> str:
    """The :data:`ALLOCATOR_ENV` variables set in this process's environment, ``NAME=value`` joined by spaces, or
    ``"as it comes"`` when none is."""
    set_ = [f"{name}={os.environ[name]}" for name in ALLOCATOR_ENV if name in os.environ]
    return " ".join(set_) if set_ else "as it comes"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "funcamp": fa.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "allocator": allocator_settings(),
    }
    with contextlib.suppress(OSError, FileNotFoundError, subprocess.SubprocessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                info["cpu"] = line.split(":", 1)[1].strip()
        flags = next((line for line in lscpu.splitlines() if line.startswith("Flags:")), "")
        info["cpu_bf16"] = [f for f in ("avx512_bf16", "amx_bf16", "amx_fp16") if f" {f}" in flags]
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def timing_run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    total = args.warmup + args.rounds * args.steps
    bs = block_size(args)
    batches = make_batches(total, batch_size=args.batch_size, block_size=bs, seed=args.seed, device=device)
    base = make_model(args, device)
    n_params = base.num_params()
    per_token = flops_per_token(base)
    measure_peak = args.peak_tflops is None and device.type == "cpu" and args.peak_size
    peaks = [matmul_peak_tflops(getattr(torch, args.dtype), args.peak_size)] if measure_peak else []
    runners = [Runner(name, build_variant(name, base, args), batches, device) for name in args.variants]
    del base
    # Inductor's first compile in a process also pays for importing and initialising the compiler; pay it
    # here, so that the first compiled variant is not charged for it.
    if any(name in COMPILED for name in args.variants):
        torch.compile(lambda x: x * 2, backend=args.backend)(torch.ones(2, device=device))
    for r in runners:
        if getattr(r.step, "plan", None):
            print(f"{r.name}: {r.step.plan}", flush=True)
    for r in runners:
        print(f"warm-up {r.name} ...", end=" ", flush=True)
        r.first_call_s = r.run(1, first=True)[0]
        if args.warmup > 1:
            r.run(args.warmup - 1)
        print(f"first call {r.first_call_s:.2f} s", flush=True)
    for i in range(args.rounds):
        gc.collect()
        for r in runners[i % len(runners) :] + runners[: i % len(runners)]:
            wall, cpu = r.run(args.steps)
            r.samples_ms.append(1e3 * wall / args.steps)
            r.cpu_samples_ms.append(1e3 * cpu / args.steps)
    if measure_peak:  # again after the rounds: a shared host's rate moves; the better of the two is the peak
        peaks.append(matmul_peak_tflops(getattr(torch, args.dtype), args.peak_size))
        args.peak_tflops, args.peak_source = better_peak(peaks[0], peaks[1], args.dtype, args.peak_size)
    tokens = args.batch_size * block_size(args)
    rows = {}
    for r in runners:
        ms = statistics.median(r.samples_ms)
        row = dict.fromkeys(COLUMNS) | {
            "variant": r.name,
            "ms_per_step": ms,
            "spread_ms": [min(r.samples_ms), max(r.samples_ms)],
            "samples_ms": r.samples_ms,
            "cpu_ms_per_step": statistics.median(r.cpu_samples_ms),
            "cpu_samples_ms": r.cpu_samples_ms,
            "tokens_per_s": tokens / ms * 1e3,
            "first_call_s": r.first_call_s,
            "graphs": r.graphs if r.name in COMPILED else None,
            "recompiles": r.recompiles if r.name in COMPILED else None,
            "final_loss": float(r.loss),
            "optimizer": r.step.optimizer_kind,
            "tune": getattr(r.step, "tune", None),
            "capture": getattr(r.step, "capture", None),
            "plan": getattr(r.step, "plan", None),
            "op_policies": {
                k: str(v).removeprefix("torch.") for k, v in (getattr(r.step, "op_policies", None) or {}).items()
            }
            or None,
        }
        if args.peak_tflops:
            row["mfu"] = per_token * row["tokens_per_s"] / (args.peak_tflops * 1e12)
        rows[r.name] = row
    for row in rows.values():
        for ref, key in (("amp_eager", "ratio_vs_2"), ("amp_compile", "ratio_vs_3")):
            row[key] = row["ms_per_step"] / rows[ref]["ms_per_step"] if ref in rows else None
            # Cross-check: the median over rounds of the ratio within each round (neighbours' load cancels).
            paired = [a / b for a, b in zip(row["samples_ms"], rows[ref]["samples_ms"])] if ref in rows else []
            row["paired_" + key] = statistics.median(paired) if paired else None
    return {
        "rows": rows,
        "n_params": n_params,
        "flops_per_token": per_token,
        "tokens_per_step": tokens,
        "timed_steps": args.rounds * args.steps,
    }


def check_losses(rows: dict[str, dict], rtol: float) -> tuple[bool, str]:
    losses = {k: r["final_loss"] for k, r in rows.items()}
    ref_name = "fp32_eager" if "fp32_eager" in losses else next(iter(losses))
    ref = losses[ref_name]
    bad = {k: v for k, v in losses.items() if not (math.isfinite(v) and abs(v - ref) <= rtol * abs(ref))}
    if bad:
        return False, f"VOID: final losses disagree with {ref_name} ({ref:.4f}) beyond rtol {rtol}: {bad}"
    spread = max(losses.values()) - min(losses.values())
    return True, f"final losses agree: max |difference| {spread:.4f} (rtol {rtol} of {ref_name}'s {ref:.4f})"


# --- output ---------------------------------------------------------------------------------------------------

LABELS = {
    "fp32_eager": "1 float32 eager, AdamW foreach",
    "amp_eager": "2 torch.amp eager, AdamW {opt}",
    "amp_compile": "3 torch.amp + compile(model), AdamW {opt}",
    "funcamp_eager": "4 funcamp eager",
    "funcamp_compile": "5 funcamp compiled step",
    "funcamp_tuned": "6 funcamp tuned policy, compiled step",
    "funcamp_donate": "7 funcamp compiled step, donate=True",
    "funcamp_graph": "8 funcamp compiled step, donate=True, CUDA graph",
    "funcamp_donate_off": "9 funcamp compiled step, donate=True, passes off: {passes_off}",
}


def _fmt(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, spec)


def _first_step_note(cfg: dict[str, Any], rows: dict[str, dict]) -> list[str]:
    timed = [r for r in rows.values() if r.get("first_step")]
    if not timed:
        return []
    cache = timed[0]["first_step"]["cache"]
    how = (
        "a fresh, empty inductor cache per variant (cold)"
        if cache == "cold"
        else "the second of two runs on one inductor cache (warm: FX graph and kernel caches hit)"
    )
    tune = [r for r in timed if r["first_step"].get("tune_s") is not None]
    extra = "".join(
        f"; {LABELS[r['variant']][0]}'s includes {r['first_step']['tune_s']:.1f} s of tune_policy" for r in tune
    )
    phases = [
        f"{LABELS[r['variant']][0]}: "
        + ", ".join(f"{COMPILE_PHASES[k]} {v:.1f}" for k, v in r["first_step"].get("compile_phases_s", {}).items())
        for r in timed
        if r["first_step"].get("compile_phases_s")
    ]
    profile = (
        [
            "",
            "Compile phases of the first step (s, `torch._dynamo.utils.compile_times()`; nested, and summed over "
            "compile threads, so they do not add up): " + "; ".join(phases) + ".",
        ]
        if phases
        else []
    )
    return [
        "",
        "first call s: the variant's first step in the timing process (compiler already imported and initialised "
        "by a trivial compile; kernels another variant compiled before it may come from the shared cache). "
        "first step s: wall seconds from building the step (deep copy of the model, functionalize, tune_policy, "
        "torch.compile's wrapper) to the end of its first step, compile included, each variant in a fresh "
        f"process run alone, with {how}{extra}.",
        *profile,
    ]


def _targets(rows: dict[str, dict]) -> list[str]:
    if "funcamp_tuned" not in rows:
        return []
    tuned = rows["funcamp_tuned"]
    parts = []
    if tuned.get("ratio_vs_2") is not None:
        parts.append(f"step time {tuned['ratio_vs_2']:.2f}x torch.amp eager (target <= 0.6x)")
    if tuned.get("ratio_vs_3") is not None:
        parts.append(f"{tuned['ratio_vs_3']:.2f}x torch.amp + compile(model) (target <= 0.8x)")
    ref = rows.get("amp_compile", {}).get("first_step_s")
    for name in ("funcamp_compile", "funcamp_tuned"):
        mine = rows.get(name, {}).get("first_step_s")
        if ref and mine:
            parts.append(f"{LABELS[name][0]}'s first step {mine / ref:.2f}x torch.compile(model)'s (target <= 1.5x)")
    return ["", "Targets (issue 12), variant 6: " + "; ".join(parts) + "."] if parts else []


def _capture_targets(rows: dict[str, dict]) -> list[str]:
    """Variant 8 against its targets: >= 1.1x the tokens/s of variant 3, >= 45% MFU; variant 7's or 8's peak at
    most variant 2's (torch.amp with a fused AdamW where the device has it); and whether it was captured."""
    graph = rows.get("funcamp_graph")
    if not graph:
        return []
    capture = graph.get("capture") or {}
    why = capture.get("uncaptured_because")
    parts = [f"captured ({capture.get('replays')} replays)" if why is None else f"NOT captured: {why}"]
    if graph.get("ratio_vs_3") is not None:
        parts.append(f"tokens/s {1 / graph['ratio_vs_3']:.2f}x torch.amp + compile(model)'s (target >= 1.1x)")
    if graph.get("mfu") is not None:
        parts.append(f"MFU {100 * graph['mfu']:.1f}% (target >= 45%)")
    for name in ("funcamp_donate", "funcamp_graph"):
        ratio = rows.get(name, {}).get("peak_vs_2")
        if ratio is not None:
            parts.append(f"{LABELS[name][0]}'s peak {ratio:.2f}x torch.amp eager's (target <= 1.0x)")
    return ["", "Targets (issue 34), variant 8: " + "; ".join(parts) + "."]


def _tuned_note(rows: dict[str, dict]) -> list[str]:
    tune = rows.get("funcamp_tuned", {}).get("tune")
    if not tune:
        return []
    chosen: dict[str, list[str]] = {}
    for name, policy in tune["map"].items():
        chosen.setdefault(policy.split("compute=")[1].split(",")[0], []).append(name)
    summary = "; ".join(f"{dtype}: {', '.join(names)}" for dtype, names in chosen.items())
    return [
        "",
        f"Variant 6's map (tune_policy, depth {tune['depth']}, {tune['seconds']:.1f} s in the timing process"
        f"{', from its cache' if tune['from_cache'] else ''}; base policy float32): {summary}.",
        "",
        "```",
        tune["table"],
        "```",
    ]


def markdown(result: dict[str, Any]) -> str:
    cfg, m, rows = result["config"], result["machine"], result["rows"]
    cuda = cfg["device"] == "cuda"
    head = list(HEADERS)
    if cfg.get("peak_tflops"):
        head.append("MFU")
    lines = [
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['threads']} torch threads, {m['cpu_capability']}"
        + (f", {', '.join(m.get('cpu_bf16', []))}" if m.get("cpu_bf16") else "")
        + ")"
        + (f", GPU {m['gpu']}" if cuda and m.get("gpu") else "")
        + f"; Python {m['python']}, torch {m['torch']}, funcamp {m['funcamp']}"
        + (f"; C allocator: {m['allocator']}" if not cuda and m.get("allocator") else ""),
        "",
        f"Model: GPT `{cfg['config']}` ({result['n_params'] / 1e6:.2f}M parameters), batch {cfg['batch_size']} x "
        f"{cfg['block_size']} tokens, {cfg['dtype']} compute, loss scale: {cfg['loss_scale']}; "
        f"{result['timed_steps']} timed steps per variant ({cfg['rounds']} interleaved rounds of {cfg['steps']}) "
        f"after {cfg['warmup']} warm-up steps; compile backend `{cfg['backend']}`; funcamp's per-op rules "
        f"(`--op-policies {cfg.get('op_policies', 'none')}`): "
        + (", ".join(sorted({str(r.get("op_policies")) for n, r in rows.items() if n.startswith("funcamp")})) or "n/a")
        + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|",
    ]
    for name, r in rows.items():
        lo, hi = r["spread_ms"]
        cells = [
            LABELS[name].format(opt=r["optimizer"], passes_off=cfg.get("passes_off")),
            _fmt(r["ms_per_step"], ".1f"),
            f"{lo:.1f}-{hi:.1f}",
            _fmt(r["cpu_ms_per_step"], ".1f"),
            _fmt(r["tokens_per_s"], ",.0f"),
            _fmt(r["ratio_vs_2"]),
            _fmt(r["ratio_vs_3"]),
            _fmt(r.get("peak_mb"), ".1f"),
            _fmt(r.get("peak_vs_2")),
            _fmt(r.get("rss_delta_mb"), ".0f"),
            _fmt(r["first_call_s"], ".1f"),
            _fmt(r.get("first_step_s"), ".1f"),
            "-" if r["graphs"] is None else str(r["graphs"]),
            "-" if r["recompiles"] is None else str(r["recompiles"]),
            _fmt(r.get("host_syncs_per_step"), ".1f"),
            _fmt(r["final_loss"], ".4f"),
        ]
        if cfg.get("peak_tflops"):
            cells.append(_fmt(100 * r["mfu"], ".1f") + "%")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", result["loss_check"]]
    if cfg.get("peak_tflops") and result.get("flops_per_token"):
        lines += [
            "",
            f"MFU: {result['flops_per_token'] / 1e6:.1f} MFLOP per token (6 N + 12 L T d) x tokens/s over "
            f"{cfg['peak_tflops']:.2f} TFLOP/s ({cfg.get('peak_source') or 'given'}).",
        ]
    plans = [f"{name}: {r['plan']}" for name, r in rows.items() if r.get("plan")]
    if plans:
        lines += ["", "funcamp's plans (`step.plan_for(state)`): " + "; ".join(f"`{p}`" for p in plans) + "."]
    lines += _first_step_note(cfg, rows) + _targets(rows) + _capture_targets(rows) + _tuned_note(rows)
    probed = next((r for r in rows.values() if r.get("memory_method")), None)
    if probed:
        lines += [
            "",
            f"peak MB: {probed['memory_method']}, minus the bytes live before the model was built; RSS Δ MB: the "
            "process's peak resident memory over the measured steps (high-water mark reset after warm-up) minus its "
            "resident memory before the model was built, compiled code included; host syncs/step: "
            f"{probed['sync_method']}. Each variant measured in a fresh subprocess.",
        ]
    chk = result.get("recompile_check")
    if chk:
        lines += [
            "",
            f"Recompile check (funcamp compiled with `{chk['backend']}`, GPT `{chk['config']}`, {chk['compute']} "
            f"compute, {chk['steps']} steps, `error_on_recompile=True`): {chk['graphs']} graph, {chk['recompiles']} "
            f"recompiles, {chk['skipped_steps']} skipped steps, {chk['scale_changes']} loss-scale changes "
            f"({chk['distinct_scales']} distinct scales), {chk['lr_changes']} learning-rate changes, "
            f"host reads in a profiled step: {_fmt(chk['host_reads_last_step'], 'd')}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe or args.recompile_check or args.first_step_run:
        if args.first_step_run:
            result = first_step_run(args)
        else:
            result = probe(args) if args.probe else recompile_check(args)
        Path(args.out).write_text(json.dumps(result))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    cache = args.cache_dir or tempfile.mkdtemp(prefix="funcamp-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold by default: first-call seconds include compiling
    t0 = time.perf_counter()
    timing = timing_run(args)
    rows = timing["rows"]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}  # subprocesses reuse the now warm cache
    for name, first in first_steps(args, dict(os.environ)).items():
        rows[name]["first_step_s"] = first["first_step_s"]
        rows[name]["first_step"] = first
    # Counts and bytes, not times: the subprocesses may run side by side once the timing is done.
    probed = [] if args.no_probe else [name for name in args.variants if name in args.probe_variants]
    jobs = {name: ["--probe", name] for name in probed}
    if args.check_recompiles:
        jobs["check"] = ["--recompile-check"]
    workers = args.probe_workers or (1 if args.device == "cuda" else min(4, os.cpu_count() or 1))
    print(f"subprocesses: {', '.join(jobs)} ({workers} at a time) ...", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(run_subprocess, extra, args, env) for key, extra in jobs.items()}
        done = {key: f.result() for key, f in futures.items()}
    check = done.pop("check", None)
    for name, probed in done.items():
        rows[name].update(probed)
    ref = rows.get("amp_eager", {}).get("peak_mb")
    for row in rows.values():
        row["peak_vs_2"] = row["peak_mb"] / ref if ref and row.get("peak_mb") else None
    ok, loss_check = check_losses(rows, args.loss_rtol)
    cfg = {k: v for k, v in vars(args).items() if k not in ("probe", "recompile_check", "out", "first_step_run")}
    cfg["block_size"] = block_size(args)
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__), *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "config": cfg,
        **timing,
        "loss_check": loss_check,
        "valid": ok,
        "recompile_check": check,
        "wall_s": time.perf_counter() - t0,
    }
    text = markdown(result)
    print("\n" + text)
    for path, content in ((args.json, json.dumps(result, indent=2)), (args.markdown, text)):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
    print(f"wrote {args.json} and {args.markdown} ({result['wall_s']:.0f} s)")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
