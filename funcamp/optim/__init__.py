"""optax-style optimizers for funcamp: pure ``init``/``update`` pairs over pytrees of tensors.

An optimizer is a ``GradientTransformation``; ``chain`` composes them; ``masked`` and
``multi_transform`` give parameter groups their own transformations (``set_to_zero`` freezes one);
``kahan_summation`` and ``stochastic_rounding`` let bfloat16 master weights keep small updates;
``moment_dtype="int8"`` / ``"int4"`` / ``torch.float8_e4m3fn`` keep the Adam family's moments
block-quantized (:class:`MomentFormat`, :class:`QuantizedMoment`); ``apply_updates`` adds the result
to the parameters, keeping each parameter's dtype. Every state is
a NamedTuple of tensors (step counts are 0-d int32 tensors), so a whole train step compiles with
``fullgraph=True`` and does not recompile as the step count or the learning rate changes.
"""

from funcamp.optim._flat import elementwise
from funcamp.optim._moments import MomentFormat, QuantizedMoment, moment_format
from funcamp.optim.aliases import adam, adamw, lion, sgd
from funcamp.optim.base import EmptyState, GradientTransformation, apply_updates, chain, identity
from funcamp.optim.groups import MaskedState, MultiTransformState, masked, multi_transform, set_to_zero
from funcamp.optim.low_precision import (
    KahanSummationState,
    StochasticRoundingState,
    kahan_summation,
    stochastic_rounding,
)
from funcamp.optim.schedules import (
    Schedule,
    constant,
    cosine_decay,
    linear_schedule,
    linear_warmup,
    warmup_cosine_decay,
)
from funcamp.optim.transforms import (
    ScaleByAdamState,
    ScaleByLearningRateState,
    ScaleByLionState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    learning_rate,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    trace,
)

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "KahanSummationState",
    "MaskedState",
    "MomentFormat",
    "MultiTransformState",
    "QuantizedMoment",
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "ScaleByLionState",
    "Schedule",
    "StochasticRoundingState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine_decay",
    "elementwise",
    "identity",
    "kahan_summation",
    "learning_rate",
    "linear_schedule",
    "linear_warmup",
    "lion",
    "masked",
    "moment_format",
    "multi_transform",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "set_to_zero",
    "sgd",
    "stochastic_rounding",
    "trace",
    "warmup_cosine_decay",
]
