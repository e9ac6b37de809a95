"""Train a small GPT in mixed precision with funcamp, on real text, and log it to TensorBoard.

    python examples/train_gpt.py                      # defaults: no download, a few minutes on 2 CPU cores
    python3 -m tensorboard.main --logdir runs         # then open http://localhost:6006

Byte-level language modelling (vocabulary 256): the default corpus is the English text of the Python
help topics that every CPython ships (``pydoc_data.topics``, about 460 KB); ``--data PATH`` takes any
UTF-8 text file. The first 90% of the bytes train, the last 10% validate.

The model is a plain ``nn.Module`` (``examples/gpt.py``); ``funcamp.nn.functionalize`` makes it a pure
function of float32 master parameters that computes in the policy's half dtype; the whole train step
(loss scaling, gradients, finite check, clipping, AdamW, skip on overflow, loss-scale update) is one
``torch.compile`` graph, which writes each new state into the tensors of the one it is given (donation: the job
never reads a state after its step; ``--no-donate`` runs the pure step, the same numbers). The header's second
line is the configuration as the step decided it (compiled or eager, donation, the flat storage), the loss and
whether the layers are scanned. Default (``--policy auto``): float32 params and outputs, computing in the dtype
``funcamp.tune.choose_compute_dtype`` finds faster for this model: torch's report decides where it can
(bfloat16 on Ampere+ GPUs, float16 with a dynamic loss scale on older ones, float32 on CPUs without oneDNN
half kernels, such as AVX2-only ones); elsewhere (AVX-512 and AMX CPUs) one decoder block's forward+backward
kernels (``funcamp.tune.block_probe``: no compile) are timed in each candidate dtype in interleaved rounds,
float32 unless a half dtype is faster by more than the rounds' spread, the winner's step alone is built and
compiled, and the decision is cached (``$FUNCAMP_CACHE_DIR/tune`` or ``~/.cache/funcamp/tune``) so
that every later run on the machine makes the same choice; ``--retune`` times again. Before that, for each half
candidate, the same block's kernels are timed with attention in float32 (``funcamp.tune.choose_op_dtypes``; on a CPU
without AMX bfloat16 attention can take twice float32's at the main job's shapes); the rule is kept where it is
faster by more than the rounds' spread, cached alike, and the half dtype is then timed against float32 with the
rules it keeps, as its step will run. The header says which, why, and where the decisions came from.

``--telemetry-every N`` adds ``funcamp.numerics``' precision telemetry every N steps (per block: gradient
and weight amax, the share of gradient elements that would underflow or overflow in float16 and
bfloat16 before and after loss scaling, the loss scale's headroom, log2|g| histograms), computed inside
the same compiled graph and shown in TensorBoard under ``numerics/``.

``--fp8 tensorwise|rowwise|delayed|mxfp8|nvfp4`` runs every Linear but the first and the last in fp8
(``funcamp.fp8.convert``; the delayed recipe's amax histories are buffers that the train state carries
and checkpoints; ``mxfp8`` and ``nvfp4`` are the block-scaled recipes, run as their exact float32
emulation, said once, on every device but one whose ``torch._scaled_mm`` takes their block scales).
``--master-weights bfloat16|bfloat16-kahan|bfloat16-sr`` stores the parameters in
bfloat16 (LayerNorms stay float32) and wraps the optimizer in ``optim.kahan_summation`` or
``optim.stochastic_rounding``; ``--moment-dtype bfloat16`` halves AdamW's state, ``--moment-dtype int8|int4``
keeps it block-quantized (torchao's AdamW8bit / AdamW4bit: about 0.25x / 0.13x of float32 moments).
``--lint`` prints ``funcamp.debug.lint``'s report of the policy on the first batch before training. When
``--max-consecutive-skips`` steps in a row are skipped, the error ends with ``funcamp.debug``'s replay
of the last one: the first op whose output was not finite.

The compiled step is saved after the first step to ``~/.cache/funcamp/compile`` (``--cache-dir DIR``:
``DIR/compile``; ``funcamp.compile_cache``: torch's compile artifacts and, on the CPU, the C++ kernels, in one
checked file per step and settings) and loaded by the next run with the same settings, whose first step then
skips AOTAutograd, inductor and the C++ compiler; one line says which (``--no-compile-cache``: off).

Every step's batch is a function of ``(seed, step)``, so ``--resume`` continues bit-for-bit from the
last checkpoint (saved every ``--save-every`` steps, atomically, with ``funcamp.checkpoint``).
Logging and checkpoint writes happen only where ``is_main`` (rank 0 under data parallelism).

More than one device: the same script under ``torchrun`` trains data-parallel, one process per device
(NCCL on GPUs, gloo on CPUs); each rank reads its own ``--batch-size`` rows of every global batch:

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --policy p=f32,c=bf16,o=f32,r=bf16

``--shard`` splits the float32 master parameters and AdamW's state over the ranks (``funcamp.sharding``,
ZeRO-3 / FSDP2 style: each rank stores about 1/N; the step all-gathers the parameters and
reduce-scatters the gradients) and prints each rank's state bytes; the state carries the layout, so the
step and its ``optim.clip_by_global_norm`` (then the norm over all shards) need nothing more; checkpoints are
sharded directories written with ``torch.distributed.checkpoint`` (``funcamp.checkpoint.save_sharded``, default
``LOGDIR/checkpoint``), and ``--resume`` reads one saved on any number of ranks:

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --shard --policy p=f32,c=bf16,o=f32,r=bf16
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `python examples/train_gpt.py` from anywhere

from gpt import GPT, SIZES, config_for  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import fp8, optim, parallel, sharding  # noqa: E402
from funcamp.debug import lint, locate_from_state  # noqa: E402

SAMPLE_PROMPT = "The "


# Settings whose change between a run and its --resume breaks bit-for-bit continuation.
def _resume_mismatch(path: str, single_file: bool, config: dict, error: Exception) -> str:
    """The message for a checkpoint that does not fit this run: the flags that differ, where they can be read."""
    hint = ""
    if single_file:
        try:
            saved = fa.checkpoint.load(path)["config"]
            diff = {k: (saved.get(k), v) for k, v in config.items() if k != "world_size" and saved.get(k) != v}
            if diff:
                hint = f"; settings that differ from the saved run's (saved, now): {diff}"
        except Exception:  # the hint is optional: the mismatch itself is reported either way
            pass
    first = str(error).splitlines()[0]
    return (
        f"--resume: the checkpoint at {path} does not fit this run ({first}){hint}. Resume with the saved run's "
        "settings, or start a new --logdir"
    )


_RESUME_KEYS = (
    "model",
    "block_size",
    "batch_size",
    "steps",
    "lr",
    "warmup",
    "weight_decay",
    "clip",
    "seed",
    "data",
    "fp8",
    "master_weights",
    "moment_dtype",
)
MASTER_WEIGHTS = ("float32", "bfloat16", "bfloat16-kahan", "bfloat16-sr")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=None, help="UTF-8 text file (default: Python's bundled pydoc_data.topics)")
    p.add_argument("--model", default="small", choices=sorted(SIZES), help="model size (default: small)")
    p.add_argument("--block-size", type=int, default=None, help="context length in bytes (default: the model's)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default: 32)")
    p.add_argument("--steps", type=int, default=450, help="optimizer steps; the schedule's length (default: 450)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--warmup", type=int, default=None, help="linear warmup steps (default: min(50, steps // 10))")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of matrices (default: 0.1)")
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (default: 1.0)")
    p.add_argument(
        "--policy",
        default="auto",
        help="precision policy string, or auto: the compute dtype in which one decoder block's matmuls and\n"
        "attention run faster here, timed once per model, batch shape, settings and machine and cached\n"
        "(default: auto)",
    )
    p.add_argument(
        "--retune",
        action="store_true",
        help="--policy auto: time the candidate dtypes again instead of reading the cached decision",
    )
    p.add_argument(
        "--master-weights",
        default="float32",
        choices=MASTER_WEIGHTS,
        help="dtype the parameters are stored and updated in; bfloat16*: the policy's params=bfloat16 and\n"
        "bfloat16: plain rounding (loses small updates), bfloat16-kahan: optim.kahan_summation (a bfloat16\n"
        "compensation buffer), bfloat16-sr: optim.stochastic_rounding(seed=--seed) (default: float32)",
    )
    p.add_argument(
        "--moment-dtype",
        default="float32",
        choices=["float32", "bfloat16", "int8", "int4", "float8_e4m3fn"],
        help="format of AdamW's two moments (optim.adamw(moment_dtype=...)): a dtype, or block-quantized\n"
        "int8 / int4 / float8_e4m3fn as torchao's AdamW8bit / AdamW4bit / AdamWFp8 (tensors of 4096\n"
        "elements and more; smaller ones keep float32 moments) (default: float32)",
    )
    p.add_argument(
        "--fp8",
        default=None,
        choices=["tensorwise", "rowwise", "delayed", "mxfp8", "nvfp4"],
        help="run every Linear but the first and the last in fp8 with this scaling recipe (funcamp.fp8; mxfp8 "
        "and nvfp4 are block-scaled, emulated in float32 where the device has no kernel for them)",
    )
    p.add_argument(
        "--loss-scale",
        default="auto",
        choices=["auto", "none", "static", "dynamic"],
        help="auto: dynamic for float16 compute, none otherwise",
    )
    p.add_argument("--init-scale", type=float, default=2.0**15, help="initial loss scale (default: 2**15)")
    p.add_argument("--scale-period", type=int, default=2000, help="finite steps before the dynamic scale grows")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the step")
    p.add_argument(
        "--donate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write each step's new state into the old state's tensors (make_train_step(donate=True)): this job\n"
        "never reuses an old state, so it holds one state, not two; the numbers are the same bit for bit\n"
        "(--no-donate: a pure step that returns a new state) (default: on)",
    )
    p.add_argument(
        "--scan",
        default="auto",
        choices=["auto", "off"],
        help="auto: functionalize(scan='auto') stacks the decoder blocks and compiles one where its measured rule\n"
        "says so (8 layers or more on a CPU; not under --shard); off: every block traced and compiled\n"
        "(default: auto)",
    )
    p.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a CPU under Linux's C library: serve large blocks from the heap and keep what is freed\n"
        "(mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB, the MALLOC_MMAP_MAX_/MALLOC_TRIM_THRESHOLD_ of\n"
        "docs/memory.md): each step's temporaries reuse pages instead of faulting fresh ones in; this\n"
        "process's resident size then does not shrink after its peak (default: on)",
    )
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    p.add_argument("--logdir", default="runs/gpt", help="TensorBoard directory (default: runs/gpt)")
    p.add_argument("--log-every", type=int, default=10, help="steps per logging interval (default: 10)")
    p.add_argument("--eval-every", type=int, default=100, help="steps between validations (default: 100)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (default: 8)")
    p.add_argument("--checkpoint", default=None, help="checkpoint file (default: LOGDIR/checkpoint.pt)")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (default: 100)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step, as if interrupted")
    p.add_argument("--max-consecutive-skips", type=int, default=100, help="fail after this many skipped steps")
    p.add_argument(
        "--telemetry-every",
        type=int,
        default=0,
        help="precision telemetry (funcamp.numerics: per-block amax, float16/bfloat16 underflow and overflow,\n"
        "loss-scale headroom, log2|g| histograms) every N steps, in TensorBoard under numerics/ (default: 0, off)",
    )
    p.add_argument(
        "--lint",
        action="store_true",
        help="before training, print funcamp.debug.lint's report of the policy on the first batch",
    )
    p.add_argument(
        "--shard",
        action="store_true",
        help="shard parameters and optimizer state over the torchrun ranks (funcamp.sharding, ZeRO-3 / FSDP2\n"
        "style); checkpoints become torch.distributed.checkpoint directories (default LOGDIR/checkpoint)",
    )
    p.add_argument("--sample-bytes", type=int, default=200, help="bytes of text to generate at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="root of funcamp's caches; the compiled step's in DIR/compile (default: $FUNCAMP_CACHE_DIR or\n"
        "~/.cache/funcamp)",
    )
    p.add_argument(
        "--compile-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="load the compiled step from the cache before the first step and save it after (funcamp.compile_cache;\n"
        "default: on)",
    )
    args = p.parse_args(argv)
    for name in ("batch_size", "steps", "log_every", "eval_every", "eval_batches", "save_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.stop_after is not None and args.stop_after < 1:
        p.error(f"--stop-after must be >= 1 (the step to stop after), got {args.stop_after}")
    if args.shard and args.telemetry_every:
        p.error("--shard with --telemetry-every: the telemetry reads whole gradients; use one or the other")
    if args.telemetry_every < 0:
        p.error(f"--telemetry-every must be >= 0 (0: off), got {args.telemetry_every}")
    if args.fp8 and args.master_weights != "float32":
        p.error(
            f"--fp8 with --master-weights {args.master_weights}: the fp8 layers keep float32 master weights "
            "(funcamp.fp8.MODULE_POLICIES), so bfloat16 ones would apply to the other layers only; use one of the two"
        )
    if args.retune and args.policy != "auto":
        p.error(f"--retune measures --policy auto's choice again; it does nothing with --policy {args.policy}")
    if args.warmup is None:
        args.warmup = min(50, args.steps // 10)
    if args.warmup < 0 or args.warmup >= args.steps:
        p.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    return args


# --- data -------------------------------------------------------------------------------------------


def load_corpus(path: str | None) -> tuple[torch.Tensor, str]:
    """The corpus as a 1-d uint8 tensor of UTF-8 bytes, and its name."""
    if path is None:
        from pydoc_data.topics import topics

        text, name = "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics"
    else:
        try:
            text, name = Path(path).read_text(encoding="utf-8"), os.path.abspath(path)
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"--data {path}: cannot read it as UTF-8 text ({e})") from None
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
    return data, name


def split(data: torch.Tensor, block_size: int, train_fraction: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """First ``train_fraction`` of the bytes for training, the rest for validation."""
    n = int(len(data) * train_fraction)
    train, val = data[:n], data[n:]
    if len(val) <= block_size + 1:
        raise SystemExit(f"the corpus ({len(data)} bytes) is too small for --block-size {block_size}")
    return train, val


def get_batch(
    data: torch.Tensor,
    index: int,
    *,
    batch_size: int,
    block_size: int,
    seed: int,
    stream: int = 0,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Batch ``index`` of a stream: random windows, a pure function of ``(seed, stream, index)``.

    The global batch is ``batch_size * world_size`` windows; rank ``r`` takes rows ``r*B:(r+1)*B``,
    so data parallelism shards it without changing what the model sees. Returns ``inputs`` and
    ``targets`` (targets shifted by one), ``(batch_size, block_size)`` int64 on ``device``.
    """
    g = torch.Generator().manual_seed((seed * 1_000_003 + stream) * 1_000_000_007 + index)
    starts = torch.randint(len(data) - block_size - 1, (batch_size * world_size,), generator=g)
    starts = starts[rank * batch_size : (rank + 1) * batch_size]
    windows = data[starts[:, None] + torch.arange(block_size + 1)].long()
    return {
        "inputs": windows[:, :-1].to(device, non_blocking=True),
        "targets": windows[:, 1:].to(device, non_blocking=True),
    }


# --- model, loss, sampling ----------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available (use --device cpu or auto)")
    return torch.device(name)


def auto_policy_for(dtype: torch.dtype, master_weights: str) -> fa.Policy:
    """``--policy auto``'s policy computing in ``dtype``: float32 params (or ``--master-weights``) and outputs."""
    half = str(dtype).removeprefix("torch.")
    return make_policy(fa.get_policy(f"params=float32,compute={half},output=float32"), master_weights)


def build_run(
    args: argparse.Namespace,
    policy: fa.Policy,
    model: torch.nn.Module,
    device: torch.device,
    *,
    distributed: bool,
    op_policies: dict[str, torch.dtype] | None = None,
) -> SimpleNamespace:
    """The functional model, loss, optimizer, first state and train step of ``model`` under ``policy``.

    ``distributed``: parameters broadcast from rank 0 and gradients averaged over the ranks (sharded under
    ``--shard``); False builds this process's step alone (no collective), as ``--policy auto`` times it.
    ``op_policies``: per-op dtypes inside the forward (``--policy auto``'s measured rules:
    ``fa.tune.choose_op_dtypes``)."""
    stateful = args.fp8 == "delayed"  # its amax histories and scales are buffers, carried by the state
    functional = fa.nn.functionalize(
        model,
        policy,
        op_policies=op_policies or None,
        module_policies=fp8.MODULE_POLICIES if args.fp8 else None,
        with_buffers=stateful,
        scan="auto" if args.scan == "auto" and not args.shard else None,  # a scan holds every layer gathered at once
    )
    apply_fn, params = functional.apply_fn, functional.params  # float32 masters (or --master-weights)
    buffers = functional.buffers if stateful else None
    if distributed:
        params = parallel.broadcast_params(params)  # every rank starts from rank 0's parameters
    loss_fn = make_loss_fn(apply_fn, stateful=buffers is not None)
    decay_mask = {name: p.ndim >= 2 for name, p in params.items()}  # no decay of norms and biases
    group = parallel.resolve_group(distributed)  # None in one process
    layout = sharding.shard_layout(params, group) if args.shard else None  # --shard: rows of dim 0 per rank
    optimizer = make_optimizer(args, decay_mask)
    loss_scale = make_loss_scale(args.loss_scale, policy, args.init_scale, args.scale_period)
    reductions = getattr(apply_fn, "buffer_reductions", None)  # --fp8 delayed: amaxes max-, scales min-reduced
    state = fa.TrainState.create(
        params,
        optimizer,
        loss_scale=loss_scale,
        buffers=buffers,
        shard=layout,
        buffer_reductions=reductions,
        data_parallel=distributed,  # gradients averaged over the ranks in policy.reduce_dtype
        policy=policy,
        # the scanned blocks laid out name-major (the scan reads each name's layers as one view), for a donating step
        scan=apply_fn.scan if args.donate else (),
    )  # the state carries the layout: the step, the clip and stochastic rounding take it from there
    train_step = fa.make_train_step(
        loss_fn,
        optimizer,
        max_consecutive_skips=args.max_consecutive_skips,
        compile=args.compile,
        backend=args.backend,
        telemetry=args.telemetry_every or None,  # numerics/... metrics every N steps, in the same graph
        donate=args.donate,  # the loop below never reads a state after passing it to the step
    )
    return SimpleNamespace(
        policy=policy,
        op_choice=None,  # --policy auto's fa.tune.OpDtypeChoice, set by auto_policy
        apply_fn=apply_fn,
        params=params,
        buffers=buffers,
        loss_fn=loss_fn,
        group=group,
        layout=layout,
        optimizer=optimizer,
        loss_scale=loss_scale,
        state=state,
        train_step=train_step,
    )


# What the step's speed depends on beyond the model, the batch's shapes and the machine (the cache key).
_STEP_KEYS = (
    "compile",
    "backend",
    "fp8",
    "master_weights",
    "moment_dtype",
    "loss_scale",
    "telemetry_every",
    "shard",
    "clip",
    "weight_decay",
)


def auto_policy(
    args: argparse.Namespace,
    model: torch.nn.Module,
    device: torch.device,
    rank: int,
    world_size: int,
    train: torch.Tensor,
) -> tuple[SimpleNamespace, fa.tune.ComputeDtypeChoice]:
    """``--policy auto``: the compute dtype whose train step runs faster here, and that step.

    ``fa.tune.choose_compute_dtype``: torch's report where it decides (CUDA compute capability; float32 on
    a CPU without oneDNN half kernels); else the decision cached for this model, batch shape, settings and
    machine; else one decoder block's forward+backward kernels (``fa.tune.block_probe``: matmuls and attention,
    recorded eagerly in each candidate dtype and replayed, no compile) timed in interleaved rounds, float32
    unless a half dtype is faster by more than the rounds' spread; each half dtype is timed with the per-op rules
    ``fa.tune.choose_op_dtypes`` keeps for it first (attention in float32 where the block measures it faster: the
    step's ``op_policies``; ``run.op_choice`` says why). Then the winner's step alone is built (and compiled once,
    by its first call). Under torchrun rank 0 decides alone (no collectives while timing) and every rank takes its
    decisions."""
    batch = get_batch(train, 0, batch_size=args.batch_size, block_size=args.block_size, seed=args.seed, device=device)
    distributed = world_size > 1
    choice = op_choice = None
    if rank == 0:
        key = {name: getattr(args, name) for name in _STEP_KEYS}
        key["world_size"] = world_size
        base = auto_policy_for(torch.float32, args.master_weights)

        op_choices: dict[torch.dtype, Any] = {}  # each half candidate's per-op rules (fa.tune.OpDtypeChoice)

        def make_step(dtype: torch.dtype) -> Any:
            if dtype == torch.float32:
                print(f"policy auto: timing {probe.what} in each candidate dtype (no compile)", flush=True)
            rules = op_choices[dtype].op_policies if dtype in op_choices else {}
            return probe.run_with(dtype, rules)  # a half dtype with the ops it runs faster in float32

        # Capturing the block's input runs the model; the global RNG is left as it was, so that a run that
        # measures trains exactly like one that reads the cache.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            cap = fa.hardware.capability(device)
            probe = None
            if cap.decided is None:
                fp8_policies = fp8.MODULE_POLICIES if args.fp8 else None  # as build_run's functionalize
                probe = fa.tune.block_probe(model, (batch["inputs"],), policy=base, module_policies=fp8_policies)
            what = "the step"
            if probe is not None:
                key["measure"] = probe.key
                # First the ops each half dtype runs faster in float32 (attention, on a CPU without AMX), then each
                # half dtype is timed with its rules against float32: a half dtype whose attention alone is slow
                # is judged as the step will run it.
                for half in cap.candidates:
                    op_choices[half] = fa.tune.choose_op_dtypes(probe, half, key=key, retune=args.retune)
                ruled = [
                    f"{str(t).removeprefix('torch.')} with {', '.join(c.op_policies)} in float32"
                    for t, c in op_choices.items()
                    if c.op_policies
                ]
                key["op_policies"] = {
                    str(t).removeprefix("torch."): sorted(c.op_policies) for t, c in op_choices.items()
                }
                what = probe.what + (f" ({'; '.join(ruled)})" if ruled else "")
            choice = fa.tune.choose_compute_dtype(
                make_step, model, batch, device=device, key=key, retune=args.retune, what=what
            )
            if probe is not None:  # the chosen dtype's rules (float32: none, nothing measured)
                op_choice = op_choices.get(choice.dtype) or fa.tune.choose_op_dtypes(probe, choice.dtype, cache=False)
    if distributed:  # one decision for all ranks: rank 0's
        shared = [choice, op_choice]
        torch.distributed.broadcast_object_list(shared, src=0)
        choice, op_choice = shared
    rules = dict(op_choice.op_policies) if op_choice is not None else None
    policy = auto_policy_for(choice.dtype, args.master_weights)
    run = build_run(args, policy, model, device, distributed=distributed, op_policies=rules)
    run.op_choice = op_choice
    return run, choice


def default_policy(device: torch.device) -> str:
    """float32 params and outputs, compute in the dtype ``fa.half_dtype`` names for the device (the other examples'
    ``auto``; this job's ``--policy auto`` times the step instead: :func:`auto_policy`)."""
    half = str(fa.half_dtype(device)).removeprefix("torch.")
    return f"params=float32,compute={half},output=float32"


def make_loss_scale(kind: str, policy: fa.Policy, init_scale: float, period: int) -> fa.LossScale:
    if kind == "auto":
        kind = "dynamic" if policy.compute_dtype == torch.float16 else "none"
    if kind == "none":
        return fa.NoOpLossScale()
    if kind == "static":
        return fa.StaticLossScale(init_scale)
    return fa.DynamicLossScale(init_scale, period=period)


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _fmt(loss: float | None) -> str:
    """A validation loss as the progress lines print it (4 decimals), or "none" if none was measured."""
    return "none" if loss is None else f"{loss:.4f}"


def _rate(value: float | None, unit: str) -> str:
    """A throughput as the end-of-run line prints it, or why there is none (only the first step ran, untimed)."""
    if value is None:
        return f"{unit} not measured (the first step compiles and is not timed: run 2 steps or more)"
    return f"{value:,.0f} {unit}"


def make_policy(policy: fa.Policy, master_weights: str) -> fa.Policy:
    """``policy`` with the parameter dtype of ``--master-weights`` (compute, output, reduce dtypes kept).

    Raises SystemExit if ``--policy`` names a parameter dtype other than float32 (a policy string's
    default) or the one ``--master-weights`` gives: the two flags would disagree.
    """
    dtype = torch.float32 if master_weights == "float32" else torch.bfloat16
    if policy.param_dtype not in (torch.float32, dtype):
        raise SystemExit(
            f"--policy stores parameters in {str(policy.param_dtype).removeprefix('torch.')} but --master-weights "
            f"is {master_weights}: leave params=float32 in --policy and choose the master weights with "
            f"--master-weights ({', '.join(MASTER_WEIGHTS)})"
        )
    return fa.Policy(dtype, policy.compute_dtype, policy.output_dtype, policy.reduce_dtype)


def make_optimizer(args: argparse.Namespace, decay_mask: dict[str, bool]) -> optim.GradientTransformation:
    """Clipping and AdamW on a warmup-cosine schedule, wrapped for ``--master-weights bfloat16-kahan|-sr``.

    The same optimizer with and without ``--shard``: in the step, the clip takes the norm from the state's
    layout (over the shards of all ranks when sharded) and stochastic rounding its element offsets (its noise
    hashes each element's index in the whole tensor)."""
    schedule = optim.warmup_cosine_decay(args.lr, warmup=args.warmup, total=args.steps, end_value=args.lr / 10)
    quantized = args.moment_dtype in ("int8", "int4")  # optim.adamw takes these by name; the others are dtypes
    moment_dtype = args.moment_dtype if quantized else getattr(torch, args.moment_dtype)
    optimizer = optim.chain(
        optim.clip_by_global_norm(args.clip),
        optim.adamw(
            schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=decay_mask, moment_dtype=moment_dtype
        ),
    )
    if args.master_weights == "bfloat16-kahan":  # the wrappers must be outermost
        return optim.kahan_summation(optimizer)
    if args.master_weights == "bfloat16-sr":
        return optim.stochastic_rounding(optimizer, seed=args.seed)
    return optimizer


#: The loss, as the header names it. funcamp.nn.linear_cross_entropy (the head's logits a chunk at a time) is not
#: used: with this job's byte vocabulary the logits are small, and in its compiled step it was not leaner
#: (docs/main-job.md).
LOSS = "loss: cross-entropy of the whole logits (float32)"


def keep_freed_memory() -> str:
    """Tell the C library to serve large blocks from its heap and keep what is freed, for this process.

    glibc maps every block above its mmap threshold afresh and unmaps it when freed, so each step's large
    temporaries fault their pages in again (docs/memory.md, "The undonated step and the allocator"). The same
    settings as ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`` before Python starts, made with ``mallopt`` (the
    trim threshold a C int: 2 GiB). Returns what the header prints: what was set, or why nothing was.
    """
    if not sys.platform.startswith("linux"):
        return "as it comes (not Linux)"
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "as it comes (no glibc mallopt)"
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    if mallopt(m_mmap_max, 0) != 1 or mallopt(m_trim_threshold, (1 << 31) - 1) != 1:
        return "as it comes (mallopt refused)"
    return "freed memory kept (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB; --no-keep-freed-memory)"


def layers_line(apply_fn: Any) -> str:
    """How the decoder blocks are compiled: scanned (one compiled for all) or unrolled (each traced and compiled),
    as ``functionalize(scan="auto")`` decided, with its reason in short."""
    report = dict(getattr(apply_fn, "scan_report", {}))
    if not report:
        return "layers: unrolled (no scan)"
    return "layers: " + "; ".join(f"{name} {decided.split(' (')[0]}" for name, decided in report.items())


def make_loss_fn(apply_fn: Any, stateful: bool = False) -> Any:
    """``loss_fn(params, batch) -> loss``; ``stateful`` (``--fp8 delayed``, whose amax histories are
    buffers): ``loss_fn(params, buffers, batch) -> (loss, new_buffers)``. A bool, not the buffers: a
    loss_fn that held the initial buffers would make torch.compile guard on them and recompile every step."""

    def loss_fn(params: dict[str, torch.Tensor], *rest: Any) -> Any:
        batch = rest[-1]
        out = apply_fn(params, *rest[:-1], batch["inputs"])  # output dtype of the policy (float32)
        logits, new_buffers = out if stateful else (out, None)
        loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        return (loss, new_buffers) if stateful else loss

    return loss_fn


@torch.no_grad()
def evaluate(
    loss_fn: Any,
    params: Any,
    val: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
    buffers: Any = None,
) -> float:
    """Mean loss over ``--eval-batches`` fixed validation batches (one host read).

    With ``buffers`` (``--fp8 delayed``: a stateful ``loss_fn``) the state is read, not advanced: the
    updated buffers are dropped, so evaluating does not change training."""
    total = torch.zeros((), device=device)
    for i in range(args.eval_batches):
        batch = get_batch(
            val, i, batch_size=args.batch_size, block_size=args.block_size, seed=args.seed, stream=1, device=device
        )
        total += loss_fn(params, batch) if buffers is None else loss_fn(params, buffers, batch)[0]
    return total.item() / args.eval_batches


@torch.no_grad()
def generate(
    apply_fn: Any,
    params: Any,
    prompt: str,
    n: int,
    block_size: int,
    seed: int,
    device: torch.device,
    buffers: Any = None,
) -> str:
    """Sample ``n`` bytes after ``prompt`` (temperature 0.8), decoded as UTF-8 with replacement.

    With ``buffers`` (``--fp8 delayed``) ``apply_fn`` is stateful; its updated buffers are dropped."""
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([list(prompt.encode("utf-8"))], device=device)
    for _ in range(n):
        context = idx[:, -block_size:]
        logits = apply_fn(params, context) if buffers is None else apply_fn(params, buffers, context)[0]
        logits = logits[:, -1].float()
        probs = torch.softmax(logits / 0.8, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def replay_state(state: Any, donate: bool) -> Any:
    """``replay(new_state)``: the state ``funcamp.debug.locate_from_state`` replays a failed (skipped) step from.

    Undonated, the state before the step itself. Donated, the step writes into the state it is given, so this
    keeps a copy of its loss scale only (0-d tensors) and takes the parameters and buffers from the new state,
    where a skipped step kept them unchanged, bit for bit."""
    if not donate:
        return lambda new_state: state
    loss_scale = copy.deepcopy(state.loss_scale)
    return lambda new_state: SimpleNamespace(params=new_state.params, buffers=new_state.buffers, loss_scale=loss_scale)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def distributed_info(device: torch.device) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``: under ``torchrun``, start the process group (NCCL on CUDA, gloo
    on CPUs) with this rank on GPU ``LOCAL_RANK``; ``(0, 1, device)`` in a single process."""
    rank, world_size, local = parallel.setup_from_env(None if device.type == "cuda" else "gloo")
    return rank, world_size, local if device.type == "cuda" else device


#: The settings the compiled step's graph depends on, beside the state's and the batch's trees.
_COMPILE_CACHE_KEYS = (
    "model",
    "lr",
    "warmup",
    "steps",
    "weight_decay",
    "clip",
    "master_weights",
    "moment_dtype",
    "fp8",
    "backend",
    "max_consecutive_skips",
    "telemetry_every",
    "shard",
    "threads",
    "seed",
    "donate",
)


def compile_cache_for(
    args: argparse.Namespace, state: Any, batch: Any, policy: fa.Policy, rank: int, world_size: int
) -> tuple[Path, fa.compile_cache.CacheKey] | None:
    """``(file, key)`` of the compiled step in ``--cache-dir`` (funcamp.compile_cache), or None when it is off
    (``--no-compile-cache``, ``--no-compile``, or a backend that writes no artifacts)."""
    if not (args.compile and args.compile_cache and args.backend == "inductor"):
        return None
    extra = {k: getattr(args, k) for k in _COMPILE_CACHE_KEYS}
    extra.update(job="examples/train_gpt.py", policy=str(policy), rank=rank, world_size=world_size)
    key = fa.compile_cache.step_key(state, batch, extra=extra)
    root = Path(args.cache_dir) / "compile" if args.cache_dir else fa.compile_cache.default_dir()
    return fa.compile_cache.path(root, key), key


# --- the run --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run training; returns the results (final state, losses, timings) for tests and scripts."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    rank, world_size, device = distributed_info(resolve_device(args.device))
    allocator = keep_freed_memory() if args.keep_freed_memory and device.type == "cpu" else "as it comes"
    is_main = rank == 0
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")

    data, data_name = load_corpus(args.data)
    cfg = config_for(args.model, vocab_size=256, block_size=args.block_size)
    args.block_size = cfg.block_size
    train, val = split(data, cfg.block_size)
    policy = None
    if args.policy != "auto":
        try:
            policy = make_policy(fa.get_policy(args.policy), args.master_weights)  # params=bf16 for bfloat16*
        except ValueError as e:
            raise SystemExit(f"--policy: {e}") from None

    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    if args.fp8:  # every Linear but blocks.0.attn.qkv and the tied lm_head (fp8 layers: float32 weights and
        # inputs, cast to fp8 inside, output in the compute dtype: fp8.MODULE_POLICIES)
        model = fp8.convert(model, args.fp8)
    choice = None
    if policy is None:  # --policy auto: timed on the step itself (or torch's report), the decision cached
        run, choice = auto_policy(args, model, device, rank, world_size, train)
    else:
        run = build_run(args, policy, model, device, distributed=world_size > 1)
    policy, apply_fn, params, loss_fn, train_step = run.policy, run.apply_fn, run.params, run.loss_fn, run.train_step
    op_choice = run.op_choice
    group, layout, optimizer, state = run.group, run.layout, run.optimizer, run.state
    del run

    def whole_params() -> dict[str, torch.Tensor]:  # every rank must call it under --shard (an all-gather)
        return state.params if layout is None else sharding.unshard_params(state.params, layout, group)

    ckpt_path = args.checkpoint or os.path.join(args.logdir, "checkpoint" if args.shard else "checkpoint.pt")
    config = {k: v for k, v in vars(args).items() if k in _RESUME_KEYS}
    config["data"] = data_name
    config["world_size"] = world_size  # not a resume key: a resume on other ranks is told what changes
    start = 0
    if args.resume:
        sharded_dir = ckpt_path if os.path.isdir(ckpt_path) else os.path.join(args.logdir, "checkpoint")
        if layout is None and os.path.isfile(os.path.join(sharded_dir, "LATEST")):
            raise SystemExit(
                f"--resume: {sharded_dir}{os.sep} is a sharded checkpoint (written with --shard); pass --shard to "
                "resume it (on any number of ranks)"
            )
        single_file = os.path.join(args.logdir, "checkpoint.pt")
        if layout is not None and not os.path.exists(ckpt_path) and os.path.isfile(single_file):
            raise SystemExit(
                f"--resume: {single_file} is an unsharded checkpoint (written without --shard); drop --shard to "
                "resume it"
            )
        if not os.path.exists(ckpt_path):
            raise SystemExit(f"--resume: no checkpoint at {ckpt_path}")
        like = {"state": state, "rng": {"torch": torch.get_rng_state()}, "config": config}
        try:
            if layout is None:
                saved = fa.checkpoint.load(ckpt_path, like=like)
            else:  # saved on any number of ranks: each rank reads the rows it holds now
                saved = fa.checkpoint.load_sharded(ckpt_path, like, layout, group=group)
        except fa.checkpoint.CheckpointMismatchError as e:
            raise SystemExit(_resume_mismatch(ckpt_path, layout is None, config, e)) from None
        state, start = saved["state"], int(saved["state"].step)
        torch.set_rng_state(saved["rng"]["torch"])
        changed = {
            k: (saved["config"].get(k), v)
            for k, v in config.items()
            if saved["config"].get(k) != v and k != "world_size"
        }
        if changed and is_main:
            print(f"warning: settings differ from the checkpoint's (saved, now): {changed}", file=sys.stderr)
        saved_world = saved["config"]["world_size"]
        if saved_world != world_size and is_main:
            before, now = saved["config"]["batch_size"] * saved_world, args.batch_size * world_size
            print(
                f"note: the checkpoint was written by {_ranks(saved_world)} of --batch-size "
                f"{saved['config']['batch_size']} ({before} sequences per step); this run has {_ranks(world_size)} "
                f"of --batch-size {args.batch_size} ({now} sequences per step)"
                + (f": pass --batch-size {before // world_size} to keep the global batch" if before != now else ""),
                file=sys.stderr,
                flush=True,
            )

    tokens_per_step = args.batch_size * cfg.block_size * world_size
    logger = fa.TensorBoardLogger(
        args.logdir,
        log_every=args.log_every,
        tokens_per_step=tokens_per_step,
        enabled=is_main,
        purge_step=start + 1 if args.resume else None,
    )
    if layout is not None:  # each rank's state: its parameter shards, optimizer state, gradient shards
        mine = 2 * fa.tree_bytes(state.params) + fa.tree_bytes(state.opt_state)
        per_rank = [mine] * world_size
        if group is not None:
            torch.distributed.all_gather_object(per_rank, mine, group=group)
        if is_main:
            whole = sharding.state_bytes(params, optimizer, 1)["total"]
            print(
                f"shard: state bytes per rank (params + optimizer + gradient shards): "
                f"{', '.join(f'rank {r} {b:,}' for r, b in enumerate(per_rank))}; unsharded {whole:,} "
                f"({max(per_rank) / whole:.3f}x)",
                flush=True,
            )
    if is_main:
        n_params = sum(p.numel() for p in params.values())
        parallelism = (
            f"sharded over {_ranks(world_size)} | "
            if args.shard
            else (f"data parallel over {_ranks(world_size)} | " if world_size > 1 else "")
        )
        print(
            f"funcamp {fa.__version__} | {device} | policy {policy} | master weights {args.master_weights}, "
            f"moments {args.moment_dtype}{' | fp8 ' + args.fp8 if args.fp8 else ''} | "
            f"{type(state.loss_scale).__name__} | {parallelism}"
            f"model {args.model} ({n_params / 1e6:.2f}M params, context {cfg.block_size}) | "
            f"data {os.path.basename(data_name)}: {len(train)} train / {len(val)} val bytes | "
            f"{'compiled (' + args.backend + ')' if args.compile else 'eager'} | steps {start}->{args.steps}",
            flush=True,
        )
        # What runs, as the step decided it: compiled or eager, donation, probes, the process layout and the
        # storage (flat buffers, or leaf by leaf and why); the loss; the layers unrolled or scanned.
        print(f"{train_step.plan_for(state)} | {LOSS} | {layers_line(apply_fn)} | allocator: {allocator}", flush=True)
        if choice is not None:
            again = " (--retune measures again)" if choice.source != "capability" else ""
            print(f"policy auto: {choice.explain()}{again}", flush=True)
        if op_choice is not None:
            print(f"policy auto, per op: {op_choice.explain()}", flush=True)
        if args.telemetry_every:
            print(f"telemetry: numerics/... every {args.telemetry_every} steps (funcamp.numerics)", flush=True)

    def save_checkpoint() -> None:
        if layout is not None:  # every rank writes its shards (torch.distributed.checkpoint)
            rng = {"torch": torch.get_rng_state()}
            fa.checkpoint.save_sharded(ckpt_path, {"state": state, "rng": rng, "config": config}, layout, group=group)
        elif is_main:
            rng = {"torch": torch.get_rng_state()}
            fa.checkpoint.save(ckpt_path, {"state": state, "rng": rng, "config": config})

    history: dict[str, list[tuple[int, float]]] = {"train_loss": [], "loss_scale": [], "val_loss": [], "tokens_s": []}
    bar = tqdm(total=args.steps, initial=start, disable=not is_main or args.quiet, dynamic_ncols=True, unit="step")
    other_s, compile_s, t_first, steps_timed, eval0_s, lint_s = 0.0, None, None, 0, 0.0, 0.0
    end = args.steps if args.stop_after is None else min(args.steps, args.stop_after)

    def train_batch(step: int) -> dict[str, torch.Tensor]:
        return get_batch(
            train,
            step,
            batch_size=args.batch_size,
            block_size=cfg.block_size,
            seed=args.seed,
            rank=rank,
            world_size=world_size,
            device=device,
        )

    lint_params = whole_params() if args.lint and end > start else None
    if args.lint and is_main and end > start:  # one eager forward and backward of the first batch, host side
        t0 = time.perf_counter()
        report = lint(
            loss_fn, lint_params, train_batch(start + 1), policy, loss_scale=state.loss_scale, buffers=state.buffers
        )
        lint_s = time.perf_counter() - t0
        bar.write(f"{report}\n(funcamp.debug.lint of the first batch, eager, {lint_s:.1f} s)")
    if start == 0 and end > 0:  # the untrained model's validation loss (about ln 256 = 5.55), at step 0
        t0 = time.perf_counter()
        val_loss = evaluate(loss_fn, whole_params(), val, args, device, state.buffers)
        history["val_loss"].append((0, val_loss))
        logger.log_scalars({"val/loss": val_loss}, 0)
        eval0_s = time.perf_counter() - t0
        if is_main:  # eager; not in "s to the first step"
            bar.write(f"step 0: val loss {val_loss:.4f} ({eval0_s:.1f} s)")
    cache = compile_cache_for(args, state, train_batch(start + 1), policy, rank, world_size) if end > start else None
    if cache is not None:  # a warm start: the compiled step of an earlier run with the same key
        loaded = fa.compile_cache.load(*cache)
        if is_main:
            bar.write(str(loaded))
    for step in range(start + 1, end + 1):
        batch = train_batch(step)
        # Replayed if the run fails on skips. A pure step never changes its input: the state itself. A donating step
        # consumes it, but a skipped step keeps the parameters and buffers bit for bit, so the replay reads them in
        # the new state, with the loss scale this step used (copied: the step writes the next one into it).
        replay_from = replay_state(state, args.donate)
        state, metrics = train_step(state, batch)
        if t_first is None:
            sync(device)
            t_first = time.perf_counter()
            compile_s = t_first - t_start - eval0_s - lint_s  # setup and the first step (compilation)
            if cache is not None:  # not training: out of tokens/s
                saved = fa.compile_cache.save(*cache)
                if is_main and saved.action != "unchanged":
                    bar.write(str(saved))
                other_s += time.perf_counter() - t_first
                logger.restart_clock()
        else:
            steps_timed += 1
        written = logger.log(metrics, step=step)
        bar.update(1)
        if written is not None:
            if written["amp/consecutive_skips"] >= args.max_consecutive_skips:  # no extra device read otherwise
                # raises SkippedStepsError naming the first bad parameter and, from an eager replay of
                # this step, the first op that made a NaN or inf (funcamp.debug)
                # (--shard: the state holds shards, which the eager replay cannot run the model on)
                replay = None if layout else functools.partial(locate_from_state, loss_fn, replay_from(state), batch)
                fa.check_skips(metrics, state.params, replay=replay)
            history["train_loss"].append((step, written["train/loss"]))
            history["loss_scale"].append((step, written["amp/loss_scale"]))
            tok_s = written.get("perf/tokens_per_second")
            if tok_s is not None:
                history["tokens_s"].append((step, tok_s))
            bar.set_postfix(
                loss=f"{written['train/loss']:.3f}",
                scale=f"{written['amp/loss_scale']:g}",
                tok_s=f"{tok_s:,.0f}" if tok_s else "-",
            )
        evaluate_now = step % args.eval_every == 0 or step == end  # end: --steps, or the --stop-after step
        save_now = step % args.save_every == 0 or step == args.steps
        if evaluate_now or save_now:  # not training: its time counts neither in tokens/s nor in the logger's
            t0 = time.perf_counter()
            if evaluate_now:
                val_loss = evaluate(loss_fn, whole_params(), val, args, device, state.buffers)
                history["val_loss"].append((step, val_loss))
                logger.log_scalars({"val/loss": val_loss}, step)
                if is_main:
                    bar.write(f"step {step}: val loss {val_loss:.4f}")
            if save_now:
                save_checkpoint()
            other_s += time.perf_counter() - t0
            logger.restart_clock()
    sync(device)
    loop_end = time.perf_counter()
    logger.flush()
    bar.close()

    train_s = loop_end - (t_first or loop_end) - other_s
    # None when no step was timed: the first step compiles and is not timed (--steps 1, or one step left)
    tokens_per_second = tokens_per_step * steps_timed / train_s if steps_timed and train_s > 0 else None
    results: dict[str, Any] = {
        "state": state,
        "history": history,
        "val_loss": history["val_loss"][-1][1] if history["val_loss"] else None,
        "tokens_per_second": tokens_per_second,
        "compile_seconds": compile_s,
        "logdir": args.logdir,
        "checkpoint": ckpt_path,
        "policy": str(policy),
        "policy_choice": choice,  # --policy auto: fa.tune.ComputeDtypeChoice (None for an explicit --policy)
        "op_choice": op_choice,  # --policy auto: fa.tune.OpDtypeChoice (None for an explicit --policy, or on CUDA)
        "sample": None,
    }
    final_params = whole_params() if end == args.steps and args.sample_bytes > 0 else None
    if end == args.steps and args.sample_bytes > 0 and is_main:
        results["sample"] = generate(
            apply_fn, final_params, SAMPLE_PROMPT, args.sample_bytes, cfg.block_size, args.seed, device, state.buffers
        )
        logger.log_text("sample", results["sample"], end)
    logger.close()
    results["wall_seconds"] = time.perf_counter() - t_start
    parallel.shutdown()
    if is_main:
        skipped = int(state.skipped_steps)
        val_step = history["val_loss"][-1][0] if history["val_loss"] else None
        print(
            f"done: step {int(state.step)}, val loss {_fmt(results['val_loss'])} (at step {val_step}), "
            f"{skipped} skipped steps, "
            f"final loss scale {float(state.loss_scale.loss_scale):g}, {_rate(tokens_per_second, 'tokens/s')} "
            f"({'after compile: ' if args.compile else 'eager: '}{compile_s:.1f} s to the first step), "
            f"wall {results['wall_seconds']:.1f} s"
            if compile_s is not None
            else f"done: nothing to do (checkpoint at step {start})",
            flush=True,
        )
        if results["sample"] is not None:
            print(f"--- sample ---\n{results['sample']}\n--------------")
        print(f"TensorBoard: python3 -m tensorboard.main --logdir {args.logdir}")
    return results


if __name__ == "__main__":
    try:
        main()
    except SystemExit:  # a refused setting under torchrun: close the process group so that the rank exits cleanly
        parallel.shutdown()
        raise
