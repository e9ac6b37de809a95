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

    A logging call inside the step (dynamo's "logging.Logger method not supported"): Hugging Face
    transformers' ``loss_function`` logs ``loss_type=None ... Using the default loss: ForCausalLMLoss`` at
    every call with ``labels=`` of a model whose class name maps to no loss type (``GPT2LMHeadModel``), so
    the note says how to avoid it; another logger gets the general fix.
    """
    function = _dynamo_autograd.function_note(error)
    if function is not None:
        return function
    if not (getattr(error, "gb_type", None) or "").startswith(_LOGGING):
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
