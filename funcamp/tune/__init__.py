"""A measured precision policy for one model, batch and device: :func:`tune_policy`.

Whether a half dtype pays depends on the op, its shapes and the hardware: a bfloat16 matmul is 20-40x
slower than float32 on an AVX2-only CPU and several times faster on an AMX CPU or a GPU, and CPU
attention can be slower in bfloat16 even where matmuls are faster. :func:`tune_policy` measures instead
of guessing. For each unit of the model (a submodule; identical ones, same type, parameter shapes and
input shapes, form one group, such as the blocks of a transformer) it

1. captures the unit's real inputs during one forward of the whole model as it is (float32 for a float32
   model), no grad, on the example batch (forward pre-hooks, removed afterwards);
2. runs the unit alone, as :func:`funcamp.nn.functionalize` would run it under each candidate compute
   dtype (norm layers inside it in float32, the float32-accumulation op rules), forward and backward
   (gradients of the parameters and the floating inputs, with a fixed random output cotangent);
3. checks numerics against float32 on the same inputs: the normwise relative error of the output and of
   every gradient (parameters and floating inputs), ``||x - x_32|| / ||x_32||``, must be finite and at
   most the candidate's bound (default :data:`DEFAULT_RTOL`); a candidate above it on any one of them,
   non-finite, or raising is refused;
4. times forward+backward (median of ``torch.utils.benchmark.Timer.blocked_autorange``);
5. chooses the fastest candidate that is not refused, float32 when it is within ``margin`` (5%) of it.

The result is a ``module_policies`` map for :func:`funcamp.nn.functionalize` and a table. Timings are
cached as JSON per (model structure and shapes, input shapes and dtypes, device, torch version, CPU
capability or GPU name, thread count, options), so a second call times nothing; numerics (step 3)
depend on the values, not only the shapes, and are checked again on the batch at hand on every call,
a cache hit included (one forward+backward per unit and candidate, no timing).

No library in the field measures this per module; torch.amp's op lists and jmp's policies are fixed by
hand, and torchtitan filters small matmuls out of fp8 by shape only.

:func:`choose_compute_dtype` answers the coarser question a program asks first (the main job's
``--policy auto``): which one compute dtype for the whole step. It times what ``make_step`` gives it in each
candidate dtype: the compiled step (a compile per candidate) or, at a fraction of one compile,
:func:`block_probe`'s replay of one repeated block's library kernels (matmuls, attention, forward and
backward); interleaved, medians over rounds, it refuses a half dtype whose gain is inside the spread of the
rounds, and caches the decision per model structure, shapes and settings, device and torch version in the
same directory, so every fresh process on a machine makes the same choice whatever the load.

The package, one room a story: ``_keys`` (what a measurement is keyed on; the cache files), ``_checks`` (the
arguments every entry point checks), ``_timing`` (median seconds; a step's candidates in interleaved rounds),
``_units`` (a model's units, their inputs, one run alone), ``_candidates`` (:func:`tune_policy`), ``_decision``
(:func:`choose_compute_dtype`), ``_probe`` (:func:`block_probe`) and ``_ops`` (:func:`choose_op_dtypes`: which ops of a
half step run faster in float32, such as attention on a CPU without AMX).
"""

from funcamp.tune._candidates import DEFAULT_RTOL, TuneCandidate, TuneResult, TuneRow, tune_policy
from funcamp.tune._decision import ComputeDtypeChoice, choose_compute_dtype
from funcamp.tune._keys import default_cache_dir
from funcamp.tune._ops import ATTENTION, OpDtypeChoice, OpTiming, choose_op_dtypes
from funcamp.tune._probe import BlockProbe, block_probe
from funcamp.tune._timing import StepTiming, median_seconds

__all__ = [
    "ATTENTION",
    "DEFAULT_RTOL",
    "ComputeDtypeChoice",
    "BlockProbe",
    "OpDtypeChoice",
    "OpTiming",
    "StepTiming",
    "TuneCandidate",
    "TuneResult",
    "TuneRow",
    "block_probe",
    "choose_compute_dtype",
    "choose_op_dtypes",
    "default_cache_dir",
    "median_seconds",
    "tune_policy",
]

# The classes keep the module they had when this package was one file: their reprs, pickles and the type names a
# checkpoint records (``funcamp.tune.TuneResult``) do not change with the rooms.
for _cls in (BlockProbe, ComputeDtypeChoice, OpDtypeChoice, OpTiming, StepTiming, TuneCandidate, TuneResult, TuneRow):
    _cls.__module__ = __name__
del _cls
