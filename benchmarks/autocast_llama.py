"""``functionalize(..., autocast=True)`` against ``torch.autocast`` on a tiny Hugging Face LlamaForCausalLM.

Trains the same model from the same weights on the same batch, with the same optimizer (funcamp's AdamW),
four ways, and prints the loss of each after every ``--every`` steps and the largest difference from the
reference (``torch.autocast`` on the module, differentiated with autograd: ``loss.backward()``):

- ``funcamp autograd``: ``apply_fn`` under ``autocast=True``, differentiated with autograd;
- ``funcamp grad_and_value``: the same through ``funcamp.grad_and_value`` (eager: plain autograd), as the
  eager ``make_train_step`` differentiates;
- ``funcamp torch.func``: the same differentiated with ``torch.func.grad``;
- ``torch.func``: ``torch.autocast`` on the module through ``torch.func.functional_call``, ``torch.func.grad``.

    python benchmarks/autocast_llama.py --steps 50 --lr 3e-3 --dtype bfloat16

CPU, one process; no timing.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import funcamp as fa


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    half = dtype != torch.float32
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    model = llama()
    apply_fn, params0 = fa.nn.functionalize(model, f"params=float32,compute={args.dtype},output=float32", autocast=True)

    def lm_loss(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    def reference(p: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype, enabled=half):
            return lm_loss(torch.func.functional_call(model, p, (), {"input_ids": ids}).logits)

    def funcamp(p: dict) -> torch.Tensor:
        return lm_loss(apply_fn(p, input_ids=ids).logits)

    def autograd(loss_fn):  # noqa: ANN001, ANN202
        def grad(p: dict) -> tuple[dict, torch.Tensor]:
            leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
            loss = loss_fn(leaves)
            loss.backward()
            return {k: v.grad for k, v in leaves.items()}, loss.detach()

        return grad

    def func(loss_fn):  # noqa: ANN001, ANN202
        return lambda p: torch.func.grad_and_value(loss_fn)(p)

    def funcamp_grad(p: dict) -> tuple[dict, torch.Tensor]:
        grads, loss, _ = fa.grad_and_value(funcamp, fa.NoOpLossScale())(p)
        return grads, loss

    routes = {
        "torch.autocast autograd (reference)": autograd(reference),
        "funcamp autograd": autograd(funcamp),
        "funcamp grad_and_value": funcamp_grad,
        "funcamp torch.func": func(funcamp),
        "torch.autocast torch.func": func(reference),
    }
    optimizer = fa.optim.adamw(args.lr, weight_decay=0.0)
    states = {name: (dict(params0), optimizer.init(params0)) for name in routes}
    for step in range(1, args.steps + 1):
        losses = {}
        for name, grad in routes.items():
            params, opt = states[name]
            grads, losses[name] = grad(params)
            updates, opt = optimizer.update(grads, opt, params)
            states[name] = (fa.optim.apply_updates(params, updates), opt)
        if step % args.every == 0 or step == args.steps:
            ref = losses["torch.autocast autograd (reference)"]
            parts = [f"{n} {v.item():.6f} ({(v - ref).abs().item():.1e})" for n, v in losses.items()]
            print(f"step {step}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
