"""Fine-tune a Hugging Face causal LM with LoRA adapters (peft) in funcamp's train step, and save it merged.

    pip install -e ".[hf]"                              # transformers and peft
    python examples/finetune_lora.py                    # a tiny Llama built in code (random weights): seconds
    python examples/finetune_lora.py --model HuggingFaceTB/SmolLM2-135M --steps 200 --lr 2e-4
                                                        # a real checkpoint (a Hub name or a local folder)
    python3 -m tensorboard.main --logdir runs           # loss, validation loss, tokens/s

The base model is ``--model tiny`` (default: a 2-layer ``LlamaForCausalLM`` from a ``LlamaConfig`` built here,
byte-level vocabulary 256, nothing downloaded) or any causal LM ``AutoModelForCausalLM.from_pretrained``
loads (in float32), with its tokenizer. ``peft.get_peft_model`` adds LoRA adapters (``--rank``, ``--alpha``,
``--dropout``; ``--target-modules``, default peft's choice for the architecture: ``q_proj`` and ``v_proj`` for
Llama) and marks every base weight ``requires_grad=False``; ``funcamp.nn.functionalize`` follows that marking
(its ``trainable=None``), so the train state holds the adapters alone, as float32 masters, and AdamW's state
is twice their size. The base weights are constants of ``apply_fn``, held in the compute dtype (bfloat16 by
default: ``--policy params=float32,compute=bfloat16,output=float32``), never differentiated nor updated.

The data is the main job's (``examples/train_gpt.py``: Python's bundled help text, or ``--data PATH``): bytes
as token ids for ``tiny``, the model's tokenizer otherwise; the first 90% trains, the rest validates, and a
step's batch is a function of ``(seed, step)``. TensorBoard as in the main job (``funcamp.TensorBoardLogger``):
``train/loss``, ``train/grad_norm``, ``train/learning_rate``, ``amp/...`` and ``perf/tokens_per_second``
every ``--log-every`` steps, ``val/loss`` before and after training, under ``--output``. The validation runs
the training ``apply_fn`` under ``torch.no_grad()``: with the training flag, so dropout where the model has
some (``--dropout``, GPT-2's 0.1; Llama's attention dropout is 0).

At the end the trained adapters go back into the peft model (``funcamp.nn.load_into``, with the module's own
float32 base tensors as the frozen ones: the base stays bit for bit what was loaded), which writes
``OUTPUT/adapter`` (peft's adapter files: ``PeftModel.from_pretrained(base, OUTPUT/adapter)``), then
``merge_and_unload`` folds ``scale * B @ A`` into each adapted weight and ``save_pretrained`` writes
``OUTPUT/merged``, a plain model (``AutoModelForCausalLM.from_pretrained(OUTPUT/merged)``, no peft needed),
in float32, with the tokenizer when there is one.

``--compile`` compiles the whole step (``torch.compile(fullgraph=True)``, ``--backend``); the default is eager.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `python examples/finetune_lora.py` from anywhere

from train_gpt import evaluate, get_batch, load_corpus, split  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import optim  # noqa: E402
from funcamp.nn import functionalize  # noqa: E402

POLICY = "params=float32,compute=bfloat16,output=float32"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (built here), or a Hub name or folder (default: tiny)")
    p.add_argument("--data", default=None, help="UTF-8 text file (default: Python's bundled pydoc_data.topics)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r (default: 8)")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha; the scale is alpha / r (default: 16)")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (default: 0, peft's)")
    p.add_argument("--target-modules", nargs="+", default=None, help="module names (default: peft's choice)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per sequence (default: 64)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default: 100)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    p.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (default: 1.0)")
    p.add_argument("--policy", default=POLICY, help=f"precision policy (default: {POLICY})")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile the step")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    p.add_argument("--output", default="runs/finetune_lora", help="TensorBoard events, adapter/ and merged/")
    p.add_argument("--log-every", type=int, default=10, help="steps per logging interval (default: 10)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches (default: 4)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="print only the summary lines")
    args = p.parse_args(argv)
    for name in ("rank", "block_size", "batch_size", "steps", "log_every", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


def tiny_config() -> Any:
    """The ``LlamaConfig`` of ``--model tiny``: 2 layers, width 64, grouped-query attention, 256 byte tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def build_base(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """The base causal LM (random for ``tiny``, seeded by ``--seed``; else loaded in float32) and its tokenizer
    (None for ``tiny``, whose tokens are bytes)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit(f"this example needs transformers and peft: pip install -e '.[hf]' ({e})") from e
    torch.manual_seed(args.seed)
    if args.model == "tiny":
        return LlamaForCausalLM(tiny_config()), None
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except OSError as e:  # not on the Hub, no such folder, or a folder without a model or a tokenizer
        raise SystemExit(f"--model {args.model}: cannot load a causal LM and its tokenizer from it ({e})") from None
    return model, tokenizer


def add_lora(base: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """``peft.get_peft_model`` with LoRA adapters; every base weight is then ``requires_grad=False``."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise SystemExit(f"this example needs peft: pip install -e '.[hf]' ({e})") from e
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=args.dropout,
        target_modules=args.target_modules,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing` property (transformers 5.x warns)
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(base, config)


def load_tokens(args: argparse.Namespace, tokenizer: Any) -> tuple[torch.Tensor, str]:
    """The corpus as a 1-d tensor of token ids (bytes for ``tiny``, the tokenizer's ids otherwise), its name."""
    data, name = load_corpus(args.data)
    if tokenizer is not None:
        text = bytes(data.tolist()).decode("utf-8")
        data = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return data, name


def make_loss_fn(apply_fn: Any) -> Any:
    """``loss_fn(params, batch) -> loss``: next-token cross entropy on the logits (the policy's output dtype)."""

    def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = apply_fn(params, input_ids=batch["inputs"], use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    return loss_fn


def train(args: argparse.Namespace, model: torch.nn.Module, data: torch.Tensor, device: torch.device) -> dict:
    """Functionalize the peft model, train its adapters for ``--steps``, log to TensorBoard; the results."""
    policy = fa.get_policy(args.policy)
    apply_fn, params = functionalize(model, policy, training=True)  # trainable: requires_grad, the adapters
    loss_fn = make_loss_fn(apply_fn)
    optimizer = optim.chain(optim.clip_by_global_norm(args.clip), optim.adamw(args.lr, weight_decay=0.0))
    loss_scale = fa.DynamicLossScale(2.0**15) if policy.compute_dtype == torch.float16 else fa.NoOpLossScale()
    state = fa.TrainState.create(params, optimizer, loss_scale=loss_scale)
    train_step = fa.make_train_step(loss_fn, optimizer, compile=args.compile, backend=args.backend)
    train_data, val = split(data, args.block_size)
    n_train = sum(p.numel() for p in params.values())
    n_frozen = sum(t.numel() for t in apply_fn.frozen.values())
    summary = (
        f"trainable: {len(params)} adapter tensors, {n_train:,} values ({fa.tree_bytes(params):,} bytes); "
        f"optimizer state {fa.tree_bytes(state.opt_state):,} bytes; frozen: {len(apply_fn.frozen)} tensors, "
        f"{n_frozen:,} values, {fa.tree_bytes(dict(apply_fn.frozen)):,} bytes as apply_fn holds them (the compute "
        "dtype; norms in float32)"
    )
    print(f"funcamp {fa.__version__} | {device} | policy {policy} | {summary}", flush=True)
    history: dict[str, list[tuple[int, float]]] = {"train_loss": [], "val_loss": []}
    tokens_per_step = args.batch_size * args.block_size
    with fa.TensorBoardLogger(args.output, log_every=args.log_every, tokens_per_step=tokens_per_step) as logger:
        logger.log_text("lora", summary, 0)

        def validate(step: int) -> None:  # outside the train step: no time counted in tokens/s
            val_loss = evaluate(loss_fn, state.params, val, args, device)
            history["val_loss"].append((step, val_loss))
            logger.log_scalars({"val/loss": val_loss}, step)
            if not args.quiet:
                print(f"step {step}: val loss {val_loss:.4f}", flush=True)
            logger.restart_clock()

        validate(0)
        for step in range(1, args.steps + 1):
            batch = get_batch(
                train_data, step, batch_size=args.batch_size, block_size=args.block_size, seed=args.seed, device=device
            )
            state, metrics = train_step(state, batch)
            written = logger.log(metrics, step=step)
            if written is not None:
                history["train_loss"].append((step, written["train/loss"]))
                if not args.quiet:
                    print(f"step {step}: loss {written['train/loss']:.4f}", flush=True)
        validate(args.steps)
    return {"state": state, "apply_fn": apply_fn, "history": history, "summary": summary}


def save(model: torch.nn.Module, state: fa.TrainState, apply_fn: Any, tokenizer: Any, output: Path) -> Any:
    """The trained adapters into ``model`` (its own base tensors kept), ``output/adapter``, then the merged
    model into ``output/merged``; returns the merged model (``merge_and_unload`` changes ``model`` in place)."""
    own = {k: v for k, v in model.state_dict().items() if k in apply_fn.frozen}  # the float32 base, as loaded
    fa.nn.load_into(model, state.params, frozen=own)
    model.save_pretrained(output / "adapter")
    merged = model.merge_and_unload()
    merged.save_pretrained(output / "merged")
    if tokenizer is not None:
        tokenizer.save_pretrained(output / "merged")
    return merged


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the fine-tune (see the module docstring); returns the train state, the merged model, the histories
    (``train_loss``, ``val_loss``: ``[(step, value), ...]``) and the output paths."""
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    t0 = time.perf_counter()
    base, tokenizer = build_base(args)
    n_base = base.num_parameters()  # before peft adds its adapters to it, in place
    model = add_lora(base.to(device), args)
    data, name = load_tokens(args, tokenizer)
    print(f"model {args.model}: {n_base:,} parameters | data {name}: {len(data):,} tokens", flush=True)
    results = train(args, model, data, device)
    output = Path(args.output)
    merged = save(model, results["state"], results["apply_fn"], tokenizer, output)
    val = results["history"]["val_loss"]
    print(
        f"done: {args.steps} steps, val loss {val[0][1]:.4f} -> {val[-1][1]:.4f}, "
        f"{int(results['state'].skipped_steps)} skipped, {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    print(f"adapter: {output / 'adapter'} | merged: {output / 'merged'} (AutoModelForCausalLM.from_pretrained)")
    print(f"TensorBoard: python3 -m tensorboard.main --logdir {args.output}")
    return {**results, "merged": merged, "adapter_dir": output / "adapter", "merged_dir": output / "merged"}


if __name__ == "__main__":
    main()
