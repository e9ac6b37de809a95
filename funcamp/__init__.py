"""funcamp: functional (JAX-style) automatic mixed precision for PyTorch.

Precision policies cast the floating leaves of pytrees; immutable loss scales scale the loss and
unscale the gradients; ``grad_and_value`` checks them for overflow without a host sync; a pure train
step composes these with optax-style optimizers and compiles whole with ``torch.compile``.
"""

from funcamp import (
    capture,
    checkpoint,
    compile_cache,
    debug,
    formats,
    fp8,
    hardware,
    memory,
    nn,
    numerics,
    ops,
    optim,
    parallel,
    quant,
    sharding,
    tune,
)
from funcamp._tree import all_finite, global_norm, select_tree, tree_bytes
from funcamp._version import __version__
from funcamp.grad import GradAndValue, grad_and_value
from funcamp.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    loss_scale_from_state_dict,
)
from funcamp.memory import MemoryReport, memory_footprint, memory_report
from funcamp.numerics import Telemetry
from funcamp.ops import OpPolicies, with_op_policies
from funcamp.policy import Policy, cast_to_full, cast_to_half, get_policy, half_dtype
from funcamp.tensorboard import TensorBoardLogger
from funcamp.train import LossSum, SkippedStepsError, TrainState, check_skips, make_train_step, nonfinite_leaf_name
from funcamp.tune import TuneResult, tune_policy

__all__ = [
    "DynamicLossScale",
    "GradAndValue",
    "LossScale",
    "LossSum",
    "MemoryReport",
    "NoOpLossScale",
    "OpPolicies",
    "Policy",
    "SkippedStepsError",
    "StaticLossScale",
    "TensorBoardLogger",
    "Telemetry",
    "TrainState",
    "TuneResult",
    "__version__",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "capture",
    "check_skips",
    "checkpoint",
    "compile_cache",
    "debug",
    "formats",
    "fp8",
    "get_policy",
    "global_norm",
    "grad_and_value",
    "half_dtype",
    "hardware",
    "loss_scale_from_state_dict",
    "make_train_step",
    "memory",
    "memory_footprint",
    "memory_report",
    "nn",
    "nonfinite_leaf_name",
    "numerics",
    "ops",
    "optim",
    "parallel",
    "sharding",
    "quant",
    "select_tree",
    "tree_bytes",
    "tune",
    "tune_policy",
    "with_op_policies",
]
