"""The functional train step, ``(state, batch) -> (state, metrics)``, and the stages it is assembled from.

One call scales the loss, differentiates (optionally over micro-batches), unscales and checks the
gradients, runs the optimizer, and keeps the old parameters, buffers and optimizer state where the
gradients were not finite, with ``torch.where``: no host sync and no Python branch on tensor values,
so ``torch.compile(fullgraph=True)`` turns the whole step into one graph.

:func:`make_train_step` assembles the stages (:func:`gradients`, :func:`cast_like`, :func:`check`,
:func:`update`, :func:`commit`, :func:`metrics`, or all of them as :func:`run`) over a process layout
(:class:`SingleProcess`, :class:`DataParallel`, :class:`Sharded`) and adds the metrics of its probes
(:func:`skip_limit`, :func:`aux_probe`, :func:`telemetry_probe`). A step of another shape (two models, two
optimizers, a loss scale per loss) is written from the same stages: see ``examples/gan.py``.
"""

from funcamp.train._assemble import Step, StepPlan, assemble, inductor_options
from funcamp.train._donate import DonatedStateError
from funcamp.train._layout import DataParallel, Sharded, SingleProcess, layout_from
from funcamp.train._loss import LossSum, micro_batches
from funcamp.train._probes import (
    SkippedStepsError,
    aux_probe,
    check_skips,
    nonfinite_leaf_name,
    skip_limit,
    telemetry_probe,
)
from funcamp.train._stages import (
    Gradients,
    StepRecord,
    Verdict,
    cast_like,
    check,
    commit,
    gradients,
    metrics,
    run,
    update,
)
from funcamp.train._state import TrainState
from funcamp.train._step import EAGER_RERUN_NOTE, make_train_step
from funcamp.train._storage import ParamStorage, PerLeaf

__all__ = [
    "EAGER_RERUN_NOTE",
    "DataParallel",
    "DonatedStateError",
    "Gradients",
    "LossSum",
    "Sharded",
    "SingleProcess",
    "ParamStorage",
    "PerLeaf",
    "SkippedStepsError",
    "Step",
    "StepPlan",
    "StepRecord",
    "TrainState",
    "Verdict",
    "assemble",
    "aux_probe",
    "cast_like",
    "check",
    "check_skips",
    "commit",
    "gradients",
    "inductor_options",
    "layout_from",
    "make_train_step",
    "metrics",
    "micro_batches",
    "nonfinite_leaf_name",
    "run",
    "skip_limit",
    "telemetry_probe",
    "update",
]
