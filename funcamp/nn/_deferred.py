"""Hooks a library installs at a model's first forward, installed on the copy when ``functionalize`` builds it.

transformers 5.x records hidden states, attentions and an MoE's router logits (``output_hidden_states``,
``output_attentions``, ``output_router_logits``, the config's or the call's) with forward hooks that it installs
at the first forward asking for one of them, under a ``threading.Lock``. Dynamo cannot enter a lock ("Unsupported
context manager ... lock"), so a fresh model whose config asks for router logits (Mixtral, Qwen2-MoE, OLMoE) did
not compile in the train step, where ``apply_fn`` runs the copy's first forward; one eager forward first was the
workaround. Here the copy gets those hooks up front, the ones that first forward would install (each submodel's
own), whether or not a call asks: a hook does nothing in a forward that records nothing. Nothing is imported: only
a transformers already imported is asked, and a model of another library is left as it is.
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["install"]

_CAPTURING = "transformers.utils.output_capturing"


def install(copied: nn.Module) -> None:
    """Install transformers' output-capturing hooks on every submodel of ``copied`` that records outputs."""
    capturing = sys.modules.get(_CAPTURING)
    registry = getattr(capturing, "_CAN_RECORD_REGISTRY", None)
    install_hooks = getattr(capturing, "maybe_install_capturing_hooks", None)
    if registry is None or install_hooks is None:
        return
    for module in copied.modules():  # outer models first: each installs its submodels' hooks with their own flags
        if registry.get(module) and not getattr(module, "_output_capturing_hooks_installed", False):
            install_hooks(module)
