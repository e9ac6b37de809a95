"""Bring your own ``torch.nn.Module``: a pure function of parameter pytrees, with a policy per module.

:func:`functionalize` turns a module into ``apply_fn(params, *args, **kwargs)`` built on
``torch.func.functional_call``, together with detached master parameters in the policy's param dtype.
Parameters and floating inputs are cast to the compute dtype inside ``apply_fn`` (or, with
``autocast=True``, the forward runs under ``torch.autocast`` exactly as your module would, with no rule of
funcamp's own), and the output is cast to the output dtype. Normalisation layers keep their
parameters and their arithmetic in float32, as torch.amp, Apex (``keep_batchnorm_fp32``) and Hugging
Face (``_keep_in_fp32_modules``) do; embeddings look up in float32 from a table kept in the param
dtype (:func:`float32_lookup`; torch.amp leaves them in float32 too). Buffers that change in training
(BatchNorm running statistics) come in and go out explicitly:
``apply_fn(params, buffers, *args, **kwargs) -> (out, new_buffers)``.
Frozen parameters (``requires_grad=False``, or not selected by ``trainable=``) are held by ``apply_fn``
as constants, apart from the trainable ``params``: never differentiated, never in an optimizer state.
Chosen frozen matrices can be held in int8 (``quantize=funcamp.quant.Int8WeightOnlyConfig()``: per-output-
channel absmax scales, dequantized into the compute dtype at each call; see :mod:`funcamp.quant`).

The module you pass is never changed, nor kept alive: ``functionalize`` works on a structural copy of
it whose parameters are shape-only placeholders, sets the training flag and the per-module wrappers on
that copy, and runs it with the tensors passed to ``apply_fn``; each parameter is cast where its module
uses it.
``torch.utils.checkpoint`` inside the module's forward works (see :mod:`funcamp.nn._remat`), and
``functionalize(..., remat=...)`` checkpoints chosen submodules (by type, name pattern or predicate)
without editing the model; memory is saved eagerly (plain autograd) and in the inductor-compiled step;
``remat=Remat(modules, budget=b)`` keeps the fraction ``b`` of their activation bytes there (:class:`Remat`).

The way back: :func:`load_into` ``(model, state.params, state.buffers, frozen=apply_fn.frozen)`` writes
trained tensors into the module (``load_state_dict(strict=True)``: tied weights under each name, frozen
weights kept bitwise as the module holds them (or refused where the module holds others), fp8 layers
mapped back, each value in the module's dtype); :func:`state_dict` builds
that state dict without loading it (for ``save_pretrained(dir, state_dict=...)`` or ``torch.save``).

:func:`linear_cross_entropy` ``(hidden, weight, targets)`` is a language model's head and loss in chunks of rows,
never the whole logits (plain torch: in a module's forward, eager, under ``torch.func`` and compiled).

Layout: ``_functionalize`` (the assembly, one call of ``apply_fn``, the return convention, ``fp8=``),
``_plan`` (which policy each module and tensor follows), ``_store`` (the trainable/frozen/int8 split and
the dtypes tensors are stored and used in), ``_wrappers`` (the module copy and its per-module wrappers:
casts, and the per-op mode), ``_copy`` (the copy of the structure, with the callables that reach it),
``_use`` (each parameter made into its forward tensor where its module uses it, through the step
layout's ``param_at_use``), ``_remat`` (activation checkpointing inside ``apply_fn``, and ``remat=``),
``_scan`` (``scan=``: a run of identical blocks compiled once), ``_load`` (the way back into the module),
``_loss`` (the chunked head and loss).
"""

from funcamp.nn._functionalize import Functional, FunctionalWithBuffers, functionalize
from funcamp.nn._load import load_into, state_dict
from funcamp.nn._loss import linear_cross_entropy
from funcamp.nn._plan import EMBEDDING_TYPES, NORM_TYPES, float32_lookup, keep_in_float32, param_policies
from funcamp.nn._remat import Remat, RematBudgetWarning, RematInactiveWarning

__all__ = [
    "EMBEDDING_TYPES",
    "NORM_TYPES",
    "Functional",
    "FunctionalWithBuffers",
    "Remat",
    "RematBudgetWarning",
    "RematInactiveWarning",
    "float32_lookup",
    "functionalize",
    "keep_in_float32",
    "linear_cross_entropy",
    "load_into",
    "param_policies",
    "state_dict",
]
