"""CUDA-graph capture of a donating train step, and a check on the CPU of what capture forbids.

A CUDA graph records the kernels of one call and replays them with one launch: no Python, no Dynamo guards,
no per-kernel launch cost. It replays exactly what it recorded, at the addresses it recorded, so the step it
records must keep its state at fixed addresses, read nothing on the host, keep its shapes, and draw random
numbers only from a generator that replay advances. funcamp's step meets this by construction: it is pure,
compiled whole (``fullgraph=True``), reads nothing on the host, and with ``make_train_step(..., donate=True)``
writes the next state into the tensors of the state it is given, so the state never moves.

:func:`cuda_graph` wraps such a step: ``step = funcamp.capture.cuda_graph(funcamp.make_train_step(loss_fn,
opt, donate=True))``. It is an explicit ``torch.cuda.CUDAGraph`` around the compiled callable rather than
``torch.compile(mode="reduce-overhead")`` (inductor's CUDA-graph trees), because:

* the trees skip any graph that mutates an input they do not know to be static ("skipping cudagraphs due to
  mutated inputs"), and the donated state is exactly that: every state leaf would have to be marked with
  ``torch._dynamo.mark_static_address`` (and guarded on its identity) for the trees to capture it;
* the trees say why they skipped only in a log that is off by default; the wrapper says it once, as a warning,
  and runs the step uncaptured (:attr:`CapturedStep.reason`);
* the wrapper records the whole call (the fused optimizer kernels' writes into the state included) and
  replays it with one ``graph.replay()``; the compiled step itself is unchanged, so the step built without the
  wrapper is the one the rest of the suite tests.

:func:`check` traces a step on the CPU (``make_fx`` over fake tensors standing in for device tensors), built
with the compiled choice (the body of a :class:`funcamp.train.Step` within its plan made compiled), and lists
what capture forbids: host syncs (``.item()``, ``bool(tensor)``), CPU tensors in a device step,
data-dependent shapes (``nonzero``, ``masked_select``), RNG state calls and explicit generators, and
``torch.cond`` (inductor evaluates its predicate on the host). The property therefore holds without a GPU.

Two rooms: :mod:`funcamp.capture._graphs` (the wrapper) and :mod:`funcamp.capture._check` (the check, with
what it reports in :mod:`funcamp.capture._report`).
"""

from __future__ import annotations

from funcamp.capture._check import check
from funcamp.capture._graphs import CapturedStep, CaptureWarning, cuda_graph
from funcamp.capture._report import CaptureReport, Violation

__all__ = ["CaptureReport", "CaptureWarning", "CapturedStep", "Violation", "check", "cuda_graph"]
