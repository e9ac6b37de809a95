"""A griffe extension for the API pages (mkdocs.yml): read funcamp's docstrings as they are written.

funcamp's docstrings follow the Google style of shared/STYLE.md: ``Args:``, ``Returns:``, ``Raises:`` and
``References:`` stacked without blank lines between them, and ``Example:`` for doctests. griffe's Google
parser starts a section only after a blank line and knows ``Examples:`` only, so without this the
``Returns:`` and ``Raises:`` of most functions would render as plain text and the doctests as markdown.
This extension changes nothing in the source: before griffe parses a docstring, it puts a blank line
above each section title and reads ``Example:`` as ``Examples:``.

It also gives the classes made with ``funcamp._tree.dataclass`` (frozen dataclasses registered as pytrees,
such as the loss scales) the ``__init__`` that ``dataclasses`` makes at run time, as griffe does for
``@dataclasses.dataclass``, so that their ``Args:`` match a signature.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SECTION = re.compile(
    r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Warns|Example|Examples|References|Note|Notes|Warning):\s*$"
)


def normalize(text: str) -> str:
    """``text`` with a blank line above every section title and ``Example:`` read as ``Examples:``."""
    out: list[str] = []
    fence = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
        match = None if fence else _SECTION.match(line)
        if match:
            if out and out[-1].strip():
                out.append("")
            if match.group(1) == "Example":
                line = "Examples:"
        out.append(line)
    return "\n".join(out)


_DATACLASS = "funcamp._tree.dataclass"


def _default(value: Any) -> Any:
    """The default of a field: ``_tree.field(default=x, ...)`` gives ``x``; a plain value is itself."""
    if isinstance(value, griffe.ExprCall) and str(value.function).endswith("field"):
        for argument in value.arguments:
            if isinstance(argument, griffe.ExprKeyword) and argument.name == "default":
                return argument.value
        return None
    return value


def _add_dataclass_init(cls: griffe.Class) -> None:
    """Give ``cls``, made by ``funcamp._tree.dataclass`` and without an ``__init__``, its fields' ``__init__``."""
    if "__init__" in cls.members or not any(
        isinstance(d.value, griffe.Expr) and d.value.canonical_path == _DATACLASS for d in cls.decorators
    ):
        return
    parameters = [griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)]
    for member in cls.members.values():
        if member.is_attribute and member.annotation is not None and "property" not in member.labels:
            parameters.append(
                griffe.Parameter(
                    member.name,
                    annotation=member.annotation,
                    kind=griffe.ParameterKind.positional_or_keyword,
                    default=_default(member.value),
                )
            )
    init = griffe.Function("__init__", lineno=0, endlineno=0, parent=cls, returns="None")
    init.parameters = griffe.Parameters(*parameters)
    cls.set_member("__init__", init)


class FuncampDocstrings(griffe.Extension):
    """Normalize every docstring of the loaded objects; give ``_tree.dataclass`` classes their ``__init__``."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = normalize(obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        modules = [pkg]
        while modules:
            module = modules.pop()
            modules.extend(module.modules.values())
            for member in module.members.values():
                if not member.is_alias and member.is_class:
                    _add_dataclass_init(member)
