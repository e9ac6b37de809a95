"""Screenshot TensorBoard's time series of the main job: loss scale, loss and precision telemetry.

Starts a real TensorBoard server on a logdir, waits until it serves the job's scalars, opens its Time
Series dashboard in headless Chromium (driven by Playwright), waits until every chart has drawn its
line, writes a PNG and stops the server. With ``--train`` it first runs the main job
(``examples/train_gpt.py``) into ``LOGDIR/RUN`` in a small float16 configuration whose dynamic loss
scale overflows, backs off and grows again::

    python3 tools/tensorboard_screenshot.py --train               # runs/gpt-shot -> docs/tensorboard.png
    python3 tools/tensorboard_screenshot.py --logdir runs/gpt --out /tmp/gpt.png   # an existing run

The dashboard is chosen with TensorBoard's own URL parameters: ``tagFilter`` (a regular expression over
tags), ``smoothing=0`` (raw values: a smoothed loss scale would draw values the scale never had) and
``forceSVG=true`` (SVG charts: Chromium without a GPU draws no WebGL lines). Plain
``chromium --headless --screenshot --virtual-time-budget=N`` left the cards empty in about half of the
tries on this project's machine, whatever N, hence Playwright and its wait for the drawn lines.

Needs ``tensorboard`` and ``playwright`` (Python) and a Chromium binary (Debian: ``apt-get install
chromium``; Playwright's own download works too, with ``--chromium`` pointing at it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The main job at a size that trains in one to three minutes on a 2-core CPU: float16 compute with a
# loss scale of 2**20 growing every 13 finite steps, so that it overflows, backs off and grows again
# several times in 200 steps. Compiled with aot_eager: inductor's compile alone would take longer than
# the training here.
TRAIN_ARGS = [
    "--model", "tiny", "--steps", "200", "--batch-size", "32",
    "--policy", "params=float32,compute=float16,output=float32",
    "--init-scale", str(2**20), "--scale-period", "13",
    "--telemetry-every", "10", "--log-every", "10", "--eval-every", "50",
    "--backend", "aot_eager", "--sample-bytes", "0", "--seed", "0", "--quiet",
]  # fmt: skip

# Loss scale, training loss and the whole model's float16 telemetry (funcamp.numerics): the gradient's
# amax, the loss scale's headroom (log2 of max-finite over scale x amax) and the fraction of gradient
# elements that would flush to zero in float16 without and with the loss scale.
TAG_FILTER = (
    r"^(amp/loss_scale|train/loss|numerics/all/(grad_amax|float16/(headroom_log2|underflow|underflow_scaled)))$"
)

# Launch flags for a machine without a GPU, a sandbox or outside network (Playwright adds --headless).
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]  # fmt: skip

# In the page: per scalar card (by its tag), "drawn" once a series line is a valid SVG path, "broken"
# when its series paths hold Infinity or NaN coordinates (the browser then draws axes and no line).
CARD_STATES_JS = """() => {
  const out = {};
  for (const card of document.querySelectorAll("scalar-card-component")) {
    const t = card.querySelector("[title]");
    if (!t) continue;
    const ds = [...card.querySelectorAll("path")].map(p => p.getAttribute("d") || "")
      .filter(d => /^M-?[0-9.]/.test(d) && d.includes("L"));
    out[t.getAttribute("title")] = ds.length === 0 ? "none"
      : ds.some(d => /^[ML0-9.,e+-]+$/.test(d)) ? "drawn" : "broken";
  }
  return out;
}"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--logdir", default="runs/gpt-shot", help="TensorBoard directory (default: runs/gpt-shot)")
    p.add_argument(
        "--train",
        action="store_true",
        help="first run examples/train_gpt.py into LOGDIR/RUN with TRAIN_ARGS (refuses a RUN that has events)",
    )
    p.add_argument("--run", default="gpt-tiny-float16", help="run name for --train (default: gpt-tiny-float16)")
    p.add_argument(
        "--train-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for train_gpt.py, repeatable; later ones win (e.g. --train-arg=--steps --train-arg=400)",
    )
    p.add_argument("--out", default="docs/tensorboard.png", help="PNG to write (default: docs/tensorboard.png)")
    p.add_argument("--tag-filter", default=TAG_FILTER, help="TensorBoard tag regular expression (default: TAG_FILTER)")
    p.add_argument(
        "--size",
        default="1900,1080",
        help="viewport WIDTH,HEIGHT in CSS pixels; all cards must fit (default: 1900,1080)",
    )
    p.add_argument(
        "--card-width", type=int, default=420, help="TensorBoard's minimum card width in pixels (default: 420)"
    )
    p.add_argument("--keep-settings", action="store_true", help="leave TensorBoard's settings pane open")
    p.add_argument("--chromium", default=None, help="browser binary (default: chromium, then google-chrome on PATH)")
    p.add_argument("--port", type=int, default=0, help="TensorBoard port (default: a free one)")
    p.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for TensorBoard, then for the charts (default: 60)"
    )
    args = p.parse_args(argv)
    try:
        args.width, args.height = (int(v) for v in args.size.split(","))
    except ValueError:
        p.error(f"--size must be WIDTH,HEIGHT in pixels, e.g. 1900,1080; got {args.size!r}")
    if args.width < 400 or args.height < 300:
        p.error(f"--size must be at least 400,300; got {args.size!r}")
    try:
        re.compile(args.tag_filter)
    except re.error as e:
        p.error(f"--tag-filter is not a regular expression: {e}")
    if args.timeout <= 0:
        p.error(f"--timeout must be positive; got {args.timeout}")
    return args


def find_chromium(explicit: str | None) -> str:
    """The browser binary: ``explicit`` or the first of chromium, chromium-browser, google-chrome on PATH."""
    names = [explicit] if explicit else ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit(
        f"no browser found (tried {', '.join(names)}): install Chromium (Debian: apt-get install chromium) "
        "or pass --chromium PATH"
    )


def event_files(logdir: str) -> list[str]:
    return glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)


def train(logdir: str, run: str, extra: list[str]) -> None:
    run_dir = os.path.join(logdir, run)
    if event_files(run_dir):
        raise SystemExit(
            f"{run_dir} already holds TensorBoard events: remove it or choose another --logdir/--run, "
            "so that two runs are not drawn as one"
        )
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), *TRAIN_ARGS, "--logdir", run_dir, *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_scalars(base: str, server: subprocess.Popen, tag_filter: str, timeout: float) -> list[str]:
    """Poll the scalars plugin until it lists a tag matching ``tag_filter``; return the matching tags."""
    pattern = re.compile(tag_filter, re.IGNORECASE)  # TensorBoard's filter is case-insensitive
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"TensorBoard exited with code {server.returncode} before answering")
        try:
            with urllib.request.urlopen(f"{base}/data/plugin/scalars/tags", timeout=5) as r:
                runs = json.load(r)
            tags = sorted({tag for tags in runs.values() for tag in tags if pattern.search(tag)})
            if tags:
                return tags
            last = f"runs {sorted(runs)} have no tag matching {tag_filter!r}"
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as e:
            last = str(e)
        time.sleep(0.5)
    raise SystemExit(f"TensorBoard at {base} served no matching scalars within {timeout:.0f} s: {last}")


def dashboard_url(base: str, tag_filter: str) -> str:
    query = urllib.parse.urlencode({"forceSVG": "true", "smoothing": "0", "tagFilter": tag_filter})
    return f"{base}/?{query}#timeseries"


def screenshot(
    url: str,
    out: str,
    tags: list[str],
    browser: str,
    width: int,
    height: int,
    timeout: float,
    card_width: int,
    keep_settings: bool,
) -> None:
    """Load ``url`` in headless Chromium, wait until every tag's card drew its line, write the PNG ``out``.

    Raises SystemExit when a card has not drawn its line after ``timeout`` seconds: the page did not load,
    the card lies outside the window (TensorBoard lays out only visible cards), or a logged value is +-inf
    (TensorBoard writes it into the SVG path, which the browser then rejects).
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chrome = pw.chromium.launch(executable_path=browser, args=CHROMIUM_FLAGS)
        try:
            page = chrome.new_page(viewport={"width": width, "height": height})
            page.goto(url, timeout=timeout * 1000)
            # TensorBoard keeps its settings in localStorage (key "_tb_global_settings"): close the settings
            # pane that a fresh profile opens (the URL already set smoothing=0), choose the cards' width, and
            # reload, so that the charts are laid out once at their final width.
            settings = {"timeSeriesCardMinWidth": card_width}
            if not keep_settings:
                settings["timeSeriesSettingsPaneOpened"] = False
            page.evaluate(
                """s => localStorage.setItem("_tb_global_settings",
                    JSON.stringify({...JSON.parse(localStorage.getItem("_tb_global_settings") || "{}"), ...s}))""",
                settings,
            )
            page.reload(timeout=timeout * 1000)
            all_drawn = f"{json.dumps(tags)}.every(t => s[t] === 'drawn')"
            ready = f"(() => {{ const s = ({CARD_STATES_JS})(); return {all_drawn}; }})()"
            try:
                page.wait_for_function(ready, timeout=timeout * 1000)
            except PlaywrightTimeout:
                states = page.evaluate(CARD_STATES_JS)
                broken = [t for t in tags if states.get(t) == "broken"]
                blank = [t for t in tags if states.get(t) != "drawn"]
                message = f"after {timeout:.0f} s TensorBoard draws no line for {blank}"
                if broken:
                    message += (
                        f"; the lines of {broken} have non-finite coordinates: a logged value is +-inf (a NaN shows"
                        " as a gap; choose a run or a --tag-filter without them), or the card lies below the window"
                        " (a larger --size)"
                    )
                raise SystemExit(message) from None
            page.wait_for_timeout(500)  # let the last layout settle
            page.screenshot(path=out)
        finally:
            chrome.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    browser = find_chromium(args.chromium)
    if args.train:
        train(args.logdir, args.run, args.train_arg)
    if not event_files(args.logdir):
        raise SystemExit(f"no TensorBoard event files under {args.logdir}: pass --train to run the main job first")
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", args.logdir, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        tags = wait_for_scalars(base, server, args.tag_filter, args.timeout)
        print(f"TensorBoard {base}: {len(tags)} tags match: {', '.join(tags)}", flush=True)
        url = dashboard_url(base, args.tag_filter)
        out = os.path.abspath(args.out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        screenshot(url, out, tags, browser, args.width, args.height, args.timeout, args.card_width, args.keep_settings)
        print(f"wrote {args.out} ({os.path.getsize(out):,} bytes) from {url}", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
