"""The copy of your module's structure that ``apply_fn`` runs, with the callables its forward reaches.

``copy.deepcopy`` copies a module's submodules, containers, ``functools.partial`` objects and bound
methods, but shares functions: a closure built in ``__init__`` (minGPT's ``self.mlpf = lambda x:
m.dropout(m.c_proj(m.act(m.c_fc(x))))``) would call *your* submodules from the copy, with your stored
weights, so the parameters ``apply_fn`` is given would get no gradient (and in a half compute dtype the
float32 weights meet half inputs). :func:`copy_structure` copies such a function too: a new function
with the same code whose closure cells and defaults are deep-copied along with the module, so that
they hold the copy's submodules. A function is copied only where its closure or defaults reach your
module, its submodules or their parameters; every other function is shared, as deepcopy shares it.

What cannot be made to run on the copy is refused by name (:func:`_check`): a reference that still
reaches your module (a ``weakref`` to it, a builtin method of one of its tensors), a parameter or
persistent buffer held outside its module's own slots (a plain list of weights: it would keep the
stored tensor while the module's slot gets the one given), and a module with parameters that is not
registered as a submodule (held in a plain list or dict: ``named_parameters()`` does not list it, so its
weights would be neither trained nor cast).
"""

from __future__ import annotations

import copy
import functools
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

#: A module's own slots, walked through ``named_modules`` / ``named_parameters`` / ``named_buffers``.
_SLOTS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
#: Attributes torch keeps in step with the parameter slots itself (``RNNBase`` refreshes them each call).
_SYNCED = {nn.RNNBase: frozenset({"_flat_weights", "_flat_weight_refs"})}
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType, torch.dtype, torch.device)
_DEPTH = 8


def copy_structure(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(module, memo)``, with the functions that reach ``module`` copied as well, then checked.

    Raises:
      TypeError: if deepcopy fails, or the copy still reaches ``module`` or holds a parameter, a persistent
        buffer or a module with parameters where ``apply_fn`` cannot give it the tensors of the call (the
        message names the attribute).
    """
    state = [*module.named_parameters(remove_duplicate=False), *_persistent_buffers(module)]
    placeholders = {id(memo[id(t)]): name for name, t in state if id(t) in memo}
    originals = _originals(module)
    cells = _rebuild_functions(module, originals, memo)
    try:
        copied = copy.deepcopy(module, memo)
        for old, new in cells:
            new.cell_contents = copy.deepcopy(old.cell_contents, memo)
    except Exception as e:
        raise TypeError(
            f"functionalize: could not copy the structure of {type(module).__name__} (copy.deepcopy failed: "
            f"{e}); functionalize needs a deep-copyable module so that it never changes yours"
        ) from e
    _check(copied, type(module).__name__, originals, placeholders)
    return copied


def _originals(module: nn.Module) -> dict[int, str]:
    """Your submodules, parameters and persistent buffers, by id: what the copy must not reach."""
    found = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    found.update({id(p): name for name, p in module.named_parameters(remove_duplicate=False)})
    found.update({id(b): name for name, b in _persistent_buffers(module)})
    return found


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, m in module.named_modules(remove_duplicate=False):
        for local, b in m._buffers.items():
            if b is not None and local not in m._non_persistent_buffers_set:
                yield f"{prefix}.{local}" if prefix else local, b


def _attributes(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """A module's attributes other than its own slots (hooks included): what its forward may reach."""
    synced = next((names for cls, names in _SYNCED.items() if isinstance(module, cls)), frozenset())
    for key, value in vars(module).items():
        if key not in _SLOTS and key not in synced:
            yield key, value


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """``(path suffix, object)`` of what ``obj`` holds that a call may use (not the modules' slots)."""
    if isinstance(obj, dict):
        yield from ((f"[{k!r}]", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from ((f"[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, functools.partial):
        yield ".func", obj.func
        yield from ((f" (argument {i})", v) for i, v in enumerate(obj.args))
        yield from ((f" (argument {k})", v) for k, v in obj.keywords.items())
    elif isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
        yield ".__func__", obj.__func__
    elif isinstance(obj, types.FunctionType):
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True):
            if _filled(cell):
                yield f" (closure variable {name})", cell.cell_contents
        yield from ((f" (default {i})", v) for i, v in enumerate(obj.__defaults__ or ()))
        yield from ((f" (default {k})", v) for k, v in (obj.__kwdefaults__ or {}).items())
    elif isinstance(obj, weakref.ref):
        yield " (weakref)", obj()
    elif isinstance(obj, types.BuiltinMethodType) and not isinstance(obj.__self__, types.ModuleType):
        yield ".__self__", obj.__self__
    elif isinstance(obj, nn.Module):
        yield from ((f".{k}", v) for k, v in _attributes(obj))
        yield from ((f".{k}", v) for k, v in obj._modules.items())
    elif not isinstance(obj, (torch.Tensor, *_LEAVES)) and hasattr(obj, "__dict__"):
        yield from ((f".{k}", v) for k, v in vars(obj).items())


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell (a variable assigned after the function was made)
        return False
    return True


def _walk(obj: Any, path: str, seen: set[int], depth: int = 0) -> Iterator[tuple[str, Any]]:
    """Every object reachable from ``obj`` through :func:`_children`, once, with its path; ``obj`` first."""
    if id(obj) in seen or depth > _DEPTH:
        return
    seen.add(id(obj))
    yield path, obj
    for suffix, child in _children(obj):
        yield from _walk(child, path + suffix, seen, depth + 1)


def _module_roots(module: nn.Module, root: str) -> Iterator[tuple[str, Any]]:
    """``(path, attribute value)`` of every registered module's attributes."""
    for name, m in module.named_modules():
        for key, value in _attributes(m):
            yield f"{root}.{name}.{key}" if name else f"{root}.{key}", value


def _rebuild_functions(
    module: nn.Module, originals: dict[int, str], memo: dict[int, Any]
) -> list[tuple[types.CellType, types.CellType]]:
    """Enter in ``memo`` a new function for each one whose closure or defaults reach ``originals``.

    The new function has the same code and globals and new closure cells (shared where the old ones
    were), filled by the caller once the module is copied; its defaults, keyword defaults and
    ``__dict__`` are deep-copied now, with ``memo``. Returns ``(old cell, new cell)`` pairs.
    """
    seen: set[int] = set()
    functions = [
        obj
        for path, value in _module_roots(module, "")
        for _, obj in _walk(value, path, seen)
        if isinstance(obj, types.FunctionType) and _reaches(obj, originals)
    ]
    cells: dict[int, tuple[types.CellType, types.CellType]] = {}
    for f in functions:
        closure = []
        for cell in f.__closure__ or ():
            if id(cell) not in cells:
                cells[id(cell)] = (cell, types.CellType())
            closure.append(cells[id(cell)][1])
        new = types.FunctionType(f.__code__, f.__globals__, f.__name__, None, tuple(closure) or None)
        new.__qualname__, new.__module__, new.__doc__ = f.__qualname__, f.__module__, f.__doc__
        memo[id(f)] = new
    for f in functions:
        new = memo[id(f)]
        new.__defaults__ = copy.deepcopy(f.__defaults__, memo)
        new.__kwdefaults__ = copy.deepcopy(f.__kwdefaults__, memo)
        new.__dict__.update(copy.deepcopy(f.__dict__, memo))
    return [(old, new) for old, new in cells.values() if _filled(old)]


def _reaches(f: types.FunctionType, originals: dict[int, str]) -> bool:
    seen: set[int] = set()
    return any(id(obj) in originals for _, obj in _walk(f, "", seen) if obj is not f)


def _check(copied: nn.Module, root: str, originals: dict[int, str], placeholders: dict[int, str]) -> None:
    """Refuse, naming the attribute, what the copy reaches but ``apply_fn`` cannot give this call's tensors.

    Raises:
      TypeError: see :func:`copy_structure`.
    """
    registered = {id(m) for m in copied.modules()}
    seen: set[int] = set()
    for start, value in _module_roots(copied, root):
        for path, obj in _walk(value, start, seen):
            if id(obj) in originals:
                raise TypeError(
                    f"functionalize: {path} reaches your module's {_what(obj)} {root}.{originals[id(obj)]} itself, "
                    "not through the module structure: apply_fn runs a copy of the module with the tensors it is "
                    "given, and this reference would run yours, with your stored weights (their gradients "
                    "lost). Reach it through an attribute or a closure over the module instead"
                )
            if id(obj) in placeholders:
                raise TypeError(
                    f"functionalize: {path} holds the {_what(obj)} {root}.{placeholders[id(obj)]} itself, outside "
                    "its module: apply_fn gives each module the tensors of the call in its own slots, and this "
                    "reference would keep the stored tensor (its gradient lost). Read it from its module at "
                    "call time (self.fc.weight), or register it (nn.Parameter attribute, nn.ParameterList)"
                )
            if isinstance(obj, nn.Module) and id(obj) not in registered and _holds_state(obj):
                raise TypeError(
                    f"functionalize: {path} is a {type(obj).__name__} with parameters or buffers that is not "
                    f"registered as a submodule of {root} (held in a plain list, dict or other object): "
                    "named_parameters() does not list its parameters, so they would be neither trained nor cast "
                    "(torch.func.functional_call would run them unchanged too). Hold it in nn.ModuleList or "
                    "nn.ModuleDict, or assign it as a module attribute"
                )


def _what(obj: Any) -> str:
    return "submodule" if isinstance(obj, nn.Module) else "tensor"


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in _persistent_buffers(module))
