"""Does torch.compiler.nested_compile_region compose with a gradient inside one compiled graph? (torch 2.13: no)

    python benchmarks/nested_region_repro.py

Three marked blocks, differentiated inside ``torch.compile(fullgraph=True)`` as funcamp's step does
(``torch.func.grad_and_value``), and two alternatives (``torch.autograd.grad`` traced by Dynamo, Dynamo's
automatic region deduplication); each line says ok or the first line of the error. The output and the reasons:
``benchmarks/results/nested_compile_region_torch_2_13.md``.
"""

import torch


def block(w, x):
    return torch.tanh(x @ w) * 2 + x


def run(name, step, marked):
    torch._dynamo.reset()
    f = torch.compiler.nested_compile_region(block) if marked else block

    def loss(params, x):
        for w in params:
            x = f(w, x)
        return x.sum()

    params, x = [torch.randn(8, 8) for _ in range(3)], torch.randn(4, 8)
    try:
        torch.compile(lambda p, x: step(loss, p, x), fullgraph=True, backend="aot_eager")(params, x)
        print(f"{name}, marked={marked}: ok")
    except Exception as e:
        first = str(e).splitlines()[0]
        print(f"{name}, marked={marked}: {type(e).__name__}: {first}")


def func_grad(loss, params, x):  # what funcamp's step does (funcamp.grad: torch.func.grad_and_value)
    return torch.func.grad_and_value(loss)(params, x)


def autograd_grad(loss, params, x):  # the alternative: torch.autograd.grad traced by Dynamo
    ps = [p.detach().requires_grad_(True) for p in params]
    with torch.enable_grad():
        v = loss(ps, x)
    return torch.autograd.grad(v, ps), v.detach()


for marked in (False, True):
    run("torch.func.grad_and_value", func_grad, marked)
torch._dynamo.config.trace_autograd_ops = True
for marked in (False, True):
    run("torch.autograd.grad (trace_autograd_ops=True)", autograd_grad, marked)
torch._dynamo.config.trace_autograd_ops = False
torch._dynamo.config.use_graph_deduplication = True  # Dynamo's automatic region deduplication
run("torch.func.grad_and_value, use_graph_deduplication=True", func_grad, False)
