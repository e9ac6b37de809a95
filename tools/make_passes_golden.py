"""Write the graph passes' golden text: what :class:`funcamp.passes.RematPass` does to a traced step.

How to run (from the repository root, a minute on CPU)::

    PYTHONPATH=$PWD python3 tools/make_passes_golden.py

It traces the case of ``tests/_passes_case.py`` (a bfloat16 step with checkpointed blocks, dropout, a gathered
weight, a bias added to an activation, an embedding; inductor stopped at its post-grad pass) and writes, under
``tests/golden/passes/``:

* ``traced.txt``: the graph as traced, one node a line (``format_node()`` and its tags), after a header naming
  torch's version;
* ``<variant>.diff``, one per variant (``remat``: the regions as traced; ``budget``: the same with a memory budget
  of 0.5; ``no_regions``: no region at all): the unified diff, without context, from that variant's graph to the
  graph the passes leave.

``tests/test_passes.py`` compares the live passes with these files byte for byte. A change to a pass on purpose
regenerates them in the same commit; review the diff of the ``.diff`` files: it is the change's effect on the graph.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import _passes_case as case  # noqa: E402


def main() -> None:
    graph = case.trace()
    case.GOLDEN.mkdir(parents=True, exist_ok=True)
    (case.GOLDEN / "traced.txt").write_text(case.header() + case.text(graph))
    for variant in case.VARIANTS:
        before, after = case.passed(graph, variant)
        if before == after:
            raise AssertionError(f"{variant}: the passes left the graph as traced")
        (case.GOLDEN / f"{variant}.diff").write_text(case.diff(before, after))
        print(f"{variant}: {len(after.splitlines())} nodes, {len(case.diff(before, after).splitlines())} diff lines")


if __name__ == "__main__":
    main()
