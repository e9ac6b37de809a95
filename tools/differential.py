"""The differential tester's long run: draw N train-step configurations, check each against the eager reference.

Prints every configuration tried (one line: its fields that differ from the defaults, the time, ok or FAIL) and,
for each failure, what differed; ends with a count. The configurations and the comparison are those of
``tests/_differential.py`` (see its docstring for the equalities checked). Examples::

    PYTHONPATH=. python tools/differential.py --n 200 --seed 0
    PYTHONPATH=. python tools/differential.py --n 1000 --minutes 20 --backends eager,aot_eager
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import _differential as diff  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="configurations to draw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=None, help="stop drawing after this long")
    parser.add_argument("--backends", default="eager,aot_eager,inductor", help="comma-separated")
    args = parser.parse_args(argv)
    backends = tuple(args.backends.split(","))
    start, tried, failed = time.monotonic(), [], []

    @seed(args.seed)
    @settings(max_examples=args.n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(diff.configs(backends=backends))
    def run(cfg: diff.Config) -> None:
        if args.minutes is not None and time.monotonic() - start > 60 * args.minutes:
            return
        t = time.monotonic()
        try:
            summary = diff.check(cfg)
        except diff.Mismatch as e:
            failed.append(cfg)
            print(f"[{len(tried) + 1}] FAIL {time.monotonic() - t:.1f}s {e}", flush=True)
        except Exception:  # an error raised by the step (or the tester): a failure too
            failed.append(cfg)
            print(f"[{len(tried) + 1}] ERROR {time.monotonic() - t:.1f}s {cfg.short()}", flush=True)
            print("    " + "    ".join(traceback.format_exc().splitlines(keepends=True)[-8:]), end="", flush=True)
        else:
            finite = "".join("." if f else "x" for f in summary["finite"])
            print(f"[{len(tried) + 1}] ok {time.monotonic() - t:.1f}s {finite} {cfg.short()}", flush=True)
        tried.append(cfg)

    run()
    minutes = (time.monotonic() - start) / 60
    print(f"tried {len(tried)} configurations in {minutes:.1f} min, {len(failed)} failed")
    for cfg in failed:
        print(f"  failed: {cfg.short()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
