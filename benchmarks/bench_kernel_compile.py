"""Benchmark: the C++ compiler's seconds for each kernel of an inductor output code, compiled alone, one after another.

    python benchmarks/bench_graph_size.py --models gpt2-body --variants torch,funcamp --dump /tmp/dump
    python benchmarks/bench_kernel_compile.py /tmp/dump/gpt2-body_funcamp/03_step_output_code_inference.py

Reads every ``async_compile.cpp_pybinding(...)`` kernel of the given output code (``bench_graph_size.py --dump``
writes them) and compiles each in this process with inductor's own code cache (``CppPythonBindingsCodeCache``,
its compiler flags and precompiled header), serially, into a fresh, empty ``TORCHINDUCTOR_CACHE_DIR``: the
seconds are the compiler's for that kernel, with no pool of workers sharing the cores. The first kernel of a
process also pays inductor's probe of the CPU's vector instructions (test programs compiled once per cache
directory: 6.3 s on the EPYC); the precompiled header lives in the default cache directory, shared by all.
Prints the kernels by seconds, with their lines of C++, and the total. Run it through ``../shared/tools/quiet``;
seconds move with the machine, the order of the kernels less.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

_KERNEL = re.compile(r"(\w+) = async_compile\.cpp_pybinding\((\[.*?\]), r'''(.*?)'''\)", re.S)


def kernels(output_code: str) -> list[tuple[str, list[str], str]]:
    """``(name, argument types, C++ source)`` of every C++ kernel of an inductor output code, in its order."""
    return [
        (name, [t.strip().strip("'") for t in types.strip("[]").split(",")], code)
        for name, types, code in _KERNEL.findall(output_code)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output_code", help="an inductor output code file (bench_graph_size.py --dump writes them)")
    p.add_argument("--top", type=int, default=40, help="kernels to list (default: 40)")
    args = p.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_kernel_compile_")
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    with open(args.output_code) as f:
        found = kernels(f.read())
    if not found:
        sys.exit(f"bench_kernel_compile: no C++ kernel in {args.output_code}")
    rows = []
    for name, types, code in found:
        start = time.perf_counter()
        CppPythonBindingsCodeCache.load_pybinding(types, code)
        rows.append((time.perf_counter() - start, code.count("\n"), name))
    print(f"{len(rows)} kernels, {sum(r[1] for r in rows):,} lines of C++, {sum(r[0] for r in rows):.1f} s in all")
    print(f"first compiled (with the precompiled header): {rows[0][2][:80]} {rows[0][0]:.2f} s")
    for seconds, lines, name in sorted(rows, reverse=True)[: args.top]:
        print(f"{seconds:7.2f} s {lines:6d}  {name[:100]}")


if __name__ == "__main__":
    main()
