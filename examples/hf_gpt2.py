"""Train Hugging Face GPT-2 (124M) with funcamp: memory footprints, a per-dtype report, a few steps.

Builds GPT-2 from ``transformers.GPT2Config()`` (random weights, nothing downloaded), prints its memory
footprint in float32, float16 and bfloat16 (funcamp's count next to transformers' own
``get_memory_footprint``), turns it into a pure function with ``funcamp.nn.functionalize`` (float32
master weights, half-precision compute, LayerNorms in float32, the LM head tied to the token
embedding), and trains a few steps on random tokens with funcamp's compiled-or-not train step.

    pip install -e ".[hf]"
    python examples/hf_gpt2.py                     # GPT-2 124M, 3 steps
    python examples/hf_gpt2.py --tiny --steps 2    # a 2-layer GPT-2: seconds on a CPU
    python examples/hf_gpt2.py --compile           # torch.compile(fullgraph=True) of the whole step
    python examples/hf_gpt2.py --tiny --checkpointing --trainable "transformer.h.1.*" "lm_head"
                                                   # activation checkpointing; fine-tune chosen tensors
    python examples/hf_gpt2.py --tiny --save runs/gpt2-tuned   # then GPT2LMHeadModel.from_pretrained(...)

``--checkpointing`` turns on Hugging Face's activation checkpointing (``torch.utils.checkpoint`` per
block): the eager step recomputes each block in the backward; the compiled step runs the blocks as
they are (torch.func cannot checkpoint in torch 2.13). ``--trainable`` keeps only the matching
tensors in the train state; the others are frozen, held by ``apply_fn`` in the compute dtype.
``--save DIR`` puts the trained tensors back into a GPT-2 module (``funcamp.nn.load_into``: the tied LM
head under its own name too, each tensor in the module's dtype) and writes it with ``save_pretrained``.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import funcamp as fa
from funcamp import optim
from funcamp.memory import memory_footprint, memory_report
from funcamp.nn import functionalize, param_policies

MIB = 2**20


def build_gpt2(tiny: bool, attn_implementation: str) -> torch.nn.Module:
    """GPT-2 with random weights: the 124M configuration, or a 2-layer one for quick runs."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise SystemExit(f"this example needs transformers: pip install -e '.[hf]' ({e})") from e

    if tiny:
        config = GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=128, bos_token_id=0, eos_token_id=0
        )
    else:
        config = GPT2Config()
    config._attn_implementation = attn_implementation
    return GPT2LMHeadModel(config)


def print_footprints(model: torch.nn.Module) -> None:
    """The model's footprint in three dtypes: funcamp's count and transformers' (of a cast copy)."""
    print(f"{'dtype':<10} {'funcamp':>12} {'transformers':>14}")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        cast = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
        ours, theirs = memory_footprint(cast), cast.get_memory_footprint()
        print(f"{str(dtype).removeprefix('torch.'):<10} {ours / MIB:>8.1f} MiB {theirs / MIB:>10.1f} MiB")
        del cast


def main(argv: list[str] | None = None) -> dict[str, torch.Tensor]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--policy", default=None, help="default: params=float32,compute=<half dtype>,output=float32")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2 instead of the 124M one")
    parser.add_argument("--autocast", action="store_true", help="torch.autocast instead of casting up front")
    parser.add_argument("--compile", action="store_true", help="compile the train step (inductor)")
    parser.add_argument("--checkpointing", action="store_true", help="Hugging Face activation checkpointing")
    parser.add_argument(
        "--trainable", nargs="+", default=None, help="name patterns of the tensors to train (default: all)"
    )
    parser.add_argument("--save", default=None, help="save_pretrained the trained model into this folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    # torch 2.13 cannot differentiate SDPA with dropout under torch.func.grad and CPU autocast; GPT-2's
    # "eager" attention (matmul, softmax, dropout) has no such problem.
    attn_implementation = "eager" if args.autocast else "sdpa"
    model = build_gpt2(args.tiny, attn_implementation).to(device)
    print(f"GPT-2: {model.num_parameters():,} parameters")
    print_footprints(model)

    policy = fa.get_policy(args.policy or f"params=float32,compute={fa.half_dtype(device)},output=float32")
    print(memory_report(model, param_policies(model, policy)))

    if args.checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    apply_fn, params = functionalize(model, policy, autocast=args.autocast, trainable=args.trainable)
    if apply_fn.frozen:
        frozen_mib = memory_footprint(dict(apply_fn.frozen)) / MIB
        print(f"trainable: {len(params)} tensors; frozen: {len(apply_fn.frozen)} tensors, {frozen_mib:.1f} MiB")
    del model  # funcamp holds its own master copy; the module is only a template now

    def loss_fn(params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        logits = apply_fn(params, input_ids=tokens[:, :-1], use_cache=False).logits  # float32: the output dtype
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    optimizer = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(args.lr, weight_decay=0.1))
    loss_scale = fa.DynamicLossScale(2.0**15) if policy.compute_dtype == torch.float16 else fa.NoOpLossScale()
    state = fa.TrainState.create(params, optimizer, loss_scale=loss_scale)
    train_step = fa.make_train_step(loss_fn, optimizer, compile=args.compile)

    vocab = {**apply_fn.frozen, **params}["transformer.wte.weight"].shape[0]
    tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), device=device)
    metrics: dict[str, torch.Tensor] = {}
    for i in range(args.steps):
        state, metrics = train_step(state, tokens)  # the same batch: the loss must fall
        print(
            f"step {i}: loss {metrics['loss'].item():.4f}  grad_norm {metrics['grad_norm'].item():.3f}  "
            f"loss_scale {metrics['loss_scale'].item():g}  finite {bool(metrics['grads_finite'])}"
        )
    if args.save:
        # The way back: a module with the base weights (from_pretrained of it, in a real fine-tune; here the same
        # seed), the trained tensors loaded into it, its own exact frozen ones kept (apply_fn holds them in the
        # compute dtype; frozen=apply_fn.frozen would keep them too, as they round to those copies).
        torch.manual_seed(args.seed)
        model = build_gpt2(args.tiny, attn_implementation).to(device)
        own = {k: v for k, v in model.state_dict().items() if k in apply_fn.frozen}
        fa.nn.load_into(model, state.params, frozen=own)
        model.save_pretrained(args.save)
        print(f"saved to {args.save}: GPT2LMHeadModel.from_pretrained({args.save!r})")
    return metrics


if __name__ == "__main__":
    main()
