"""Fine-tune a few tensors of a GPT-2 whose frozen matrices are stored in int8, and log it to TensorBoard.

    python examples/finetune_int8.py                    # 300 steps, a 2-layer GPT-2: minutes on 2 CPU cores
    python examples/finetune_int8.py --baseline         # the same fine-tune on the float matrices, to compare
    python examples/finetune_int8.py --torch-amp        # and timed against plain PyTorch (torch.amp, eager)
    python3 -m tensorboard.main --logdir runs           # loss, validation loss, footprint

The model is Hugging Face's ``GPT2LMHeadModel`` built from ``GPT2Config`` (random weights, nothing is
downloaded; byte-level vocabulary 256, ``--n-layer 2 --n-embd 128`` by default). ``funcamp.nn.functionalize``
with ``quantize=funcamp.quant.Int8WeightOnlyConfig()`` stores every ``Conv1D`` matrix (``c_attn``,
``c_proj``, ``c_fc``) in int8 with one float32 absmax scale per output channel, frozen, as
``load_in_8bit=True`` does; the trainable tensors (``--trainable``, default: biases, LayerNorms and the
token and position embeddings, the token embedding being the tied LM head) are float32 masters trained
with AdamW in funcamp's compiled train step, the int8 matrices dequantized into the compute dtype inside
it. The data is the main job's (``examples/train_gpt.py``: Python's bundled help text, or ``--data``).

Before training it prints the footprint table of GPT-2 124M (``GPT2Config()``) in float32, float16, the
note's int8 layout, and mixed precision: funcamp's count next to transformers' ``get_memory_footprint``
(the int8 row from transformers + bitsandbytes when both are installed); ``--no-footprint-124m`` skips it.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `python examples/finetune_int8.py` from anywhere

from train_gpt import default_policy, evaluate, get_batch, load_corpus, split  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import optim  # noqa: E402
from funcamp.memory import memory_footprint, memory_report  # noqa: E402
from funcamp.nn import functionalize  # noqa: E402
from funcamp.quant import Int8WeightOnlyConfig  # noqa: E402

MIB = 2**20
TRAINABLE = ["*.bias", "*.ln_*", "transformer.ln_f", "transformer.wte", "transformer.wpe"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=None, help="UTF-8 text file (default: Python's bundled pydoc_data.topics)")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64, help="context length in bytes (default: 64)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: 1e-2)")
    p.add_argument("--policy", default="auto", help="policy string, or auto: float32 params, compute fast on device")
    p.add_argument("--trainable", nargs="+", default=TRAINABLE, help=f"name patterns (default: {TRAINABLE})")
    p.add_argument("--baseline", action="store_true", help="also fine-tune with float (not int8) frozen matrices")
    p.add_argument(
        "--torch-amp", action="store_true", help="also time the same fine-tune in plain PyTorch (torch.amp, eager)"
    )
    p.add_argument("--timing-rounds", type=int, default=5, help="interleaved timing rounds after training")
    p.add_argument("--timing-steps", type=int, default=20, help="steps per timing round")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the step")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    p.add_argument("--logdir", default="runs/finetune_int8")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--footprint-124m", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def gpt2(**config: Any) -> torch.nn.Module:
    """``GPT2LMHeadModel`` from ``GPT2Config(**config)``, random weights (needs transformers)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise SystemExit(f"this example needs transformers: pip install -e '.[hf]' ({e})") from e
    return GPT2LMHeadModel(GPT2Config(**config))


def machine() -> str:
    """The CPU's model name (Linux) and torch's CPU capability, e.g. ``AMD EPYC (AVX2)``."""
    name = "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


# --- the footprint table of GPT-2 124M -----------------------------------------------------------------


def _bnb_int8_footprint(model: torch.nn.Module) -> int | None:
    """transformers + bitsandbytes' ``get_memory_footprint`` of ``model`` loaded with ``load_in_8bit``, or None."""
    try:
        import accelerate  # noqa: F401
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig, GPT2LMHeadModel
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        q = GPT2LMHeadModel.from_pretrained(
            d, quantization_config=BitsAndBytesConfig(load_in_8bit=True), dtype=torch.float16
        )
        return q.get_memory_footprint()


def footprint_table(bnb: bool = True) -> list[tuple[str, int, int, int | None]]:
    """``(layout, funcamp stored bytes, funcamp compute-copy bytes, transformers' bytes or None)`` for 124M."""
    torch.manual_seed(0)
    model = gpt2().requires_grad_(False)
    rows: list[tuple[str, int, int, int | None]] = []

    def ours(policy: str, **kw: Any) -> tuple[int, int]:
        apply_fn, params = functionalize(model, policy, **kw)
        report = memory_report(params, apply_fn=apply_fn)
        return report.stored_bytes, report.compute_bytes

    half = copy.deepcopy(model).to(torch.float16)
    half_bytes = half.get_memory_footprint()
    del half
    rows.append(("float32", *ours("float32"), model.get_memory_footprint()))
    rows.append(("float16 (LayerNorms float32)", *ours("float16"), None))
    rows.append(("float16", *ours("float16", module_policies={torch.nn.LayerNorm: None}), half_bytes))
    int8 = Int8WeightOnlyConfig()
    rows.append(("int8 + float16, LayerNorms float32 (the note)", *ours("p=f16,c=f16,o=f32", quantize=int8), None))
    rows.append(
        (
            "int8 + float16 (transformers' load_in_8bit)",
            *ours("p=f16,c=f16,o=f32", module_policies={torch.nn.LayerNorm: None}, quantize=int8),
            _bnb_int8_footprint(model) if bnb else None,
        )
    )
    rows.append(("int8 + bfloat16 compute, LayerNorms float32", *ours("p=f32,c=bf16,o=f32", quantize=int8), None))
    rows.append(
        (
            "int8, float32 trainable biases/LayerNorms/embeddings (this example's split)",
            *ours("p=f32,c=bf16,o=f32", trainable=TRAINABLE, quantize=int8),
            None,
        )
    )
    model.requires_grad_(True)
    rows.append(("mixed: float32 masters, bfloat16 compute", *ours("p=f32,c=bf16,o=f32"), None))
    return rows


def format_table(rows: list[tuple[str, int, int, int | None]]) -> str:
    lines = [
        "| GPT-2 124M layout | funcamp stored | + compute copies in a call | transformers `get_memory_footprint` |",
        "|---|---:|---:|---:|",
    ]
    for name, stored, compute, theirs in rows:
        theirs_text = f"{theirs / MIB:.1f} MiB ({theirs:,} B)" if theirs is not None else "-"
        lines.append(f"| {name} | {stored / MIB:.1f} MiB ({stored:,} B) | {compute / MIB:.1f} MiB | {theirs_text} |")
    return "\n".join(lines)


# --- the fine-tune -------------------------------------------------------------------------------------------


def finetune(
    args: argparse.Namespace, policy: fa.Policy, train: torch.Tensor, val: torch.Tensor, int8: bool, logdir: str
) -> dict[str, Any]:
    """Fine-tune ``--trainable`` of a fresh seeded GPT-2 with its other tensors frozen (matrices in int8 or not)."""
    torch.manual_seed(args.seed)
    model = gpt2(**_small_config(args))
    apply_fn, params = functionalize(
        model, policy, trainable=args.trainable, quantize=Int8WeightOnlyConfig() if int8 else None
    )
    del model
    report = memory_report(params, apply_fn=apply_fn)
    n_int8 = sum(isinstance(t, fa.quant.Int8Weight) for t in apply_fn.frozen.values())

    def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = apply_fn(params, input_ids=batch["inputs"], use_cache=False).logits  # the output dtype
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    optimizer = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(args.lr, weight_decay=0.0))
    loss_scale = fa.DynamicLossScale(2.0**15) if policy.compute_dtype == torch.float16 else fa.NoOpLossScale()
    state = fa.TrainState.create(params, optimizer, loss_scale=loss_scale)
    step_fn = fa.make_train_step(loss_fn, optimizer, compile=args.compile, backend=args.backend)
    tokens_per_step = args.batch_size * args.block_size
    logger = fa.TensorBoardLogger(logdir, log_every=args.log_every, tokens_per_step=tokens_per_step)
    logger.log_scalars(
        {
            "memory/stored_bytes": report.stored_bytes,
            "memory/compute_copy_bytes": report.compute_bytes,
            "memory/trainable_bytes": memory_footprint(params),
            "memory/optimizer_state_bytes": memory_footprint(state.opt_state),
        },
        0,
    )
    logger.log_text("memory", f"```\n{report}\n```", 0)
    if not args.quiet:
        kind = "int8" if int8 else "float"
        print(
            f"[{kind} frozen matrices] trainable {sum(p.numel() for p in params.values()):,} values in "
            f"{len(params)} tensors; frozen {len(apply_fn.frozen)} tensors ({n_int8} in int8)\n{report}",
            flush=True,
        )
    history: dict[str, list[tuple[int, float]]] = {"train_loss": [], "tokens_s": []}
    t0 = time.perf_counter()
    first_step_s = None
    for step in range(1, args.steps + 1):
        state, metrics = step_fn(state, _batch(args, train, step))
        if first_step_s is None:
            first_step_s = time.perf_counter() - t0  # compiles
        written = logger.log(metrics, step=step)
        if written is not None:
            history["train_loss"].append((step, written["train/loss"]))
            if "perf/tokens_per_second" in written:
                history["tokens_s"].append((step, written["perf/tokens_per_second"]))
            if not args.quiet:
                print(f"step {step}: loss {written['train/loss']:.4f}", flush=True)
    train_s = time.perf_counter() - t0
    val_loss = evaluate(loss_fn, state.params, val, args, torch.device("cpu"))
    logger.log_scalars({"val/loss": val_loss}, args.steps)
    logger.close()
    timing = {"state": state}
    extra = [_batch(args, train, args.steps + 1 + i) for i in range(4)]

    def time_steps(k: int) -> float:
        """Seconds for ``k`` more steps, for timing only (the results keep the state of ``--steps``)."""
        s, t = timing["state"], time.perf_counter()
        for i in range(k):
            s, m = step_fn(s, extra[i % len(extra)])
        float(m["loss"])  # the last step has finished
        timing["state"] = s
        return time.perf_counter() - t

    return {
        "state": state,
        "history": history,
        "val_loss": val_loss,
        "seconds": train_s,
        "first_step_seconds": first_step_s,
        "steps_per_second": _steps_per_second(args.steps, train_s, first_step_s),
        "final_loss": float(metrics["loss"]),
        "int8_tensors": n_int8,
        "report": report,
        "time_steps": time_steps,
    }


def torch_amp_finetune(args: argparse.Namespace, policy: fa.Policy, train: torch.Tensor) -> dict[str, Any]:
    """The reference: the same fine-tune as torch.amp users write it, frozen float matrices, eager.

    ``requires_grad_(False)`` outside ``--trainable`` (fnmatch on parameter and module names, as
    funcamp's ``trainable=``), ``torch.autocast`` in the policy's compute dtype where it is a half one,
    ``GradScaler`` for float16, ``clip_grad_norm_`` and ``torch.optim.AdamW`` on the trainable tensors.
    """
    import fnmatch

    torch.manual_seed(args.seed)
    model = gpt2(**_small_config(args))
    for name, p in model.named_parameters():
        prefixes = [name.rsplit(".", i)[0] for i in range(name.count(".") + 1)]
        p.requires_grad_(any(fnmatch.fnmatchcase(x, pat) for x in prefixes for pat in args.trainable))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    half = policy.compute_dtype in (torch.float16, torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu", enabled=policy.compute_dtype == torch.float16)

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=policy.compute_dtype if half else None, enabled=half):
            logits = model(input_ids=batch["inputs"], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    t0, first_step_s = time.perf_counter(), None
    for i in range(1, args.steps + 1):
        loss = step(_batch(args, train, i))
        if first_step_s is None:
            first_step_s = time.perf_counter() - t0
    train_s = time.perf_counter() - t0
    extra = [_batch(args, train, args.steps + 1 + i) for i in range(4)]

    def time_steps(k: int) -> float:
        t = time.perf_counter()
        for i in range(k):
            step(extra[i % len(extra)])
        return time.perf_counter() - t

    return {
        "seconds": train_s,
        "first_step_seconds": first_step_s,
        "steps_per_second": _steps_per_second(args.steps, train_s, first_step_s),
        "final_loss": float(loss),
        "time_steps": time_steps,
    }


def _batch(args: argparse.Namespace, train: torch.Tensor, index: int) -> dict[str, torch.Tensor]:
    return get_batch(train, index, batch_size=args.batch_size, block_size=args.block_size, seed=args.seed)


def interleaved_steps_per_second(timers: dict[str, Any], rounds: int, steps: int) -> dict[str, float]:
    """Median steps/s of each runner over ``rounds`` rounds of ``steps`` steps, the runners taking turns.

    Taking turns spreads the load of other processes over all runners alike; the median drops outliers.
    """
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, run in timers.items():
            times[name].append(run(steps))
    return {name: steps / statistics.median(ts) for name, ts in times.items()}


def _small_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "vocab_size": 256,
        "n_positions": args.block_size,
        "n_embd": args.n_embd,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def _steps_per_second(steps: int, train_s: float, first_step_s: float) -> float | None:
    """Steps after the first (which compiles) per second of wall time; None when only the first step ran."""
    return (steps - 1) / (train_s - first_step_s) if steps > 1 else None


def _speed(run: dict[str, Any]) -> str:
    rate = run["steps_per_second"]
    then = "no step after it: steps/s not measured" if rate is None else f"then {rate:.1f} steps/s"
    return f"{run['seconds']:.1f} s ({run['first_step_seconds']:.1f} s to the first step, {then})"


def _ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as the summary lines print it, or why there is none."""
    return "not measured (run 2 steps or more)" if a is None or b is None else f"{a / b:.2f}x"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Print the 124M footprint table, fine-tune; returns the int8 run's results (and the baseline's)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    if args.footprint_124m:
        table = format_table(footprint_table())
        results["footprint_table"] = table
        print(f"machine: {machine()}, torch {torch.__version__}\n{table}\n")
    data, _ = load_corpus(args.data)
    train, val = split(data, args.block_size)
    policy = fa.get_policy(default_policy(torch.device("cpu")) if args.policy == "auto" else args.policy)
    mode = f"compiled ({args.backend})" if args.compile else "eager"
    print(f"{machine()} | torch {torch.__version__} | policy {policy} | {args.steps} steps | {mode}")
    run = finetune(args, policy, train, val, int8=True, logdir=args.logdir)
    results.update(run)
    print(f"int8 frozen matrices: val loss {run['val_loss']:.6f} after {args.steps} steps; {_speed(run)}")
    if args.baseline:
        base = finetune(args, policy, train, val, int8=False, logdir=f"{args.logdir}/baseline")
        results["baseline"] = base
        last = f"last loss {base['final_loss']:.4f}"
        print(f"float frozen matrices: val loss {base['val_loss']:.6f}, {last}; {_speed(base)}")
        print(
            f"int8 / float: val loss {run['val_loss'] / base['val_loss']:.4f}x, "
            f"step time {_ratio(base['steps_per_second'], run['steps_per_second'])} (same run, same machine)"
        )
    if args.torch_amp:
        amp = torch_amp_finetune(args, policy, train)
        results["torch_amp"] = amp
        print(
            f"torch.amp (eager, float frozen matrices): last loss {amp['final_loss']:.4f}; {_speed(amp)}; "
            f"funcamp int8 steps/s over torch.amp's: {_ratio(run['steps_per_second'], amp['steps_per_second'])}"
        )
    timers = {"funcamp, int8 frozen matrices": run["time_steps"]}
    if args.baseline:
        timers["funcamp, float frozen matrices"] = results["baseline"]["time_steps"]
    if args.torch_amp:
        timers["torch.amp (eager), float frozen matrices"] = results["torch_amp"]["time_steps"]
    if len(timers) > 1 and args.timing_rounds > 0:
        speed = interleaved_steps_per_second(timers, args.timing_rounds, args.timing_steps)
        results["steps_per_second"] = speed
        ref = next(reversed(speed))
        rounds = f"median of {args.timing_rounds} interleaved rounds of {args.timing_steps} steps"
        print(f"speed ({rounds}, {machine()}); ratio to {ref}:")
        for name, value in speed.items():
            print(f"  {name:<42} {value:6.2f} steps/s  {value / speed[ref]:.2f}x")
    print(f"TensorBoard: python3 -m tensorboard.main --logdir {args.logdir}")
    return results


if __name__ == "__main__":
    main()
