"""What to do about a compile failure whose cause funcamp recognises: a note added to dynamo's error.

Only failures that a new user meets with a common model and that dynamo's own message does not explain
are recognised, each matched on the graph-break type dynamo records (``Unsupported.gb_type``) and on the
logger it names; anything else is left as dynamo raised it.
"""

from __future__ import annotations

import re

from funcamp import _dynamo_autograd

__all__ = ["add_known_fix"]

_LOGGING = "logging.Logger method not supported"
_CONTEXT_MANAGER = "Unsupported context manager"
# transformers' lazy install of its output-capturing hooks (utils/output_capturing.py), in dynamo's user stack
_HF_HOOKS = "maybe_install_capturing_hooks"
# Dynamo's context for a logging call: "method: <Logger transformers.modeling_utils (WARNING)>.warning_once, args: ..."
_LOGGER_CALL = re.compile(r"method: <Logger (?P<logger>\S+) \(\w+\)>\.(?P<method>\w+)")


def add_known_fix(error: BaseException) -> None:
    """Add a note (``add_note``) saying what to do, if ``error`` is a compile failure funcamp knows."""
    note = known_fix(error)
    if note is not None:
        error.add_note(note)


def known_fix(error: BaseException) -> str | None:
    """The note for ``error``, or None.

    A custom ``torch.autograd.Function`` that Dynamo cannot trace: the note names it
    (:func:`funcamp._dynamo_autograd.function_note`).

    A ``threading.Lock`` entered inside the step (dynamo's "Unsupported context manager" on a ``lock``): transformers
    5.x takes one at a model's first forward that records hidden states, attentions or router logits, to install
    its hooks (:mod:`funcamp.nn._deferred`); the note says to install them first; another lock gets the general fix.

    A logging call inside the step (dynamo's "logging.Logger method not supported"): Hugging Face
    transformers' ``loss_function`` logs ``loss_type=None ... Using the default loss: ForCausalLMLoss`` at
    every call with ``labels=`` of a model whose class name maps to no loss type (``GPT2LMHeadModel``), so
    the note says how to avoid it; another logger gets the general fix.
    """
    function = _dynamo_autograd.function_note(error)
    if function is not None:
        return function
    gb_type = getattr(error, "gb_type", None) or ""
    if gb_type.startswith(_CONTEXT_MANAGER) and "`lock` context manager" in str(error):
        return _lock_note(str(error))
    if not gb_type.startswith(_LOGGING):
        return None
    message = str(error)
    call = _LOGGER_CALL.search(message)
    logger, method = (call["logger"], call["method"]) if call else ("a logger", "<method>")
    ignore = f"torch._dynamo.config.ignore_logging_functions.add(logging.Logger.{method})"
    if logger.startswith("transformers") and "loss_type" in message:
        return (
            "funcamp: the model was called with labels= and transformers' loss_function logs a warning at every "
            "such call (loss_type=None: the model's class name maps to no loss type, so it falls back to "
            "ForCausalLMLoss), which torch.compile(fullgraph=True) cannot trace. Either compute the loss outside "
            "the model from the logits, as examples/hf_gpt2.py does: logits = apply_fn(params, input_ids=ids)"
            ".logits; loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()); or name the "
            "loss it falls back to on the model before functionalize: model.loss_type = 'ForCausalLM' (the same "
            f"loss, one graph); or make the log call a no-op while compiling: {ignore}"
        )
    return (
        f"funcamp: the step calls {logger}'s {method}(), which torch.compile(fullgraph=True) cannot trace. Make it "
        f"a no-op while compiling ({ignore}: nothing is logged from inside the step), move it out of the loss, or "
        "run make_train_step(..., compile=False)"
    )


def _lock_note(message: str) -> str:
    """The note for a lock entered inside the step: transformers' hook installation, or any other."""
    if _HF_HOOKS in message:
        return (
            "funcamp: transformers installs the hooks that record hidden states, attentions or router logits at the "
            "model's first forward that asks for one (output_router_logits=True in an MoE config, "
            "output_hidden_states=...), under a threading.Lock, which torch.compile(fullgraph=True) cannot enter. "
            "funcamp.nn.functionalize installs them on its copy of the model (except with scan=); elsewhere (your own "
            "torch.func.functional_call, a scanned model) run one eager forward of the model before the first "
            "compiled step, or install them yourself: "
            "transformers.utils.output_capturing.maybe_install_capturing_hooks(model)"
        )
    return (
        "funcamp: the step enters a threading.Lock (`with lock:`), which torch.compile(fullgraph=True) cannot trace. "
        "Take the lock outside the train step (do the locked work once, before the first step), or run "
        "make_train_step(..., compile=False)"
    )
