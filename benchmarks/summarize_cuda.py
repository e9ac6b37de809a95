"""Summarize a ``benchmarks/run_cuda.sh`` run: ``summary.json`` and ``summary.md`` (the docs/benchmarks.md section).

    python benchmarks/summarize_cuda.py OUT_DIR

Reads what the run's parts wrote to ``OUT_DIR`` (``machine.txt``, ``status.txt``, ``bench_train_step_bf16.json``,
``bench_train_step_fp16.json``, ``bench_fp8.json``); a part that is missing (skipped, cut by its time limit) is
reported as missing, never filled in. Each figure is checked against its target: funcamp + CUDA graph at least
1.1x the tokens/s of torch.amp + ``torch.compile(model)`` and at least 45% MFU (GPT-2 124M bf16), peak memory with
``donate=True`` at most torch.amp's (fused AdamW), fp8 at least +20% tokens/s over bf16.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TRAIN_VARIANTS = {
    "amp_eager": "torch.amp eager",
    "amp_compile": "torch.amp + torch.compile(model)",
    "funcamp_compile": "funcamp compiled",
    "funcamp_donate": "funcamp compiled, donate=True",
    "funcamp_graph": "funcamp compiled, donate=True, CUDA graph",
}


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def train_section(data: dict[str, Any] | None, dtype: str) -> tuple[list[str], dict[str, Any]]:
    """The markdown lines and the JSON summary of one bench_train_step run (None: missing)."""
    if data is None:
        return [f"{dtype}: no results (the part was skipped, failed or cut by its time limit).", ""], {}
    cfg, rows = data["config"], data["rows"]
    lines = [
        f"GPT {cfg['config']} ({data['n_params'] / 1e6:.1f}M parameters), {dtype}, loss scale {cfg['loss_scale']}, "
        f"batch {cfg['batch_size']} x {cfg['block_size']} tokens, "
        f"{data['timed_steps']} timed steps per variant (interleaved rounds); backend {cfg['backend']}.",
        "",
        "| variant | tokens/s | vs torch.amp + compile | MFU | peak MB | first step s | host syncs/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    out: dict[str, Any] = {"valid": data.get("valid"), "rows": {}}
    for name, row in rows.items():
        vs3 = 1 / row["ratio_vs_3"] if row.get("ratio_vs_3") else None
        lines.append(
            f"| {TRAIN_VARIANTS.get(name, name)} | {_fmt(row['tokens_per_s'], ',.0f')} | {_fmt(vs3, '.2f')} | "
            f"{_fmt(row.get('mfu'), '.1%')} | "
            f"{_fmt(row.get('peak_mb'), ',.0f')} | {_fmt(row.get('first_call_s'), '.1f')} | "
            f"{_fmt(row.get('host_syncs_per_step'), '.1f')} |"
        )
        out["rows"][name] = {
            "tokens_per_s": row["tokens_per_s"],
            "vs_amp_compile": vs3,
            "mfu": row.get("mfu"),
            "peak_mb": row.get("peak_mb"),
            "first_call_s": row.get("first_call_s"),
            "capture": row.get("capture"),
        }
    graph = rows.get("funcamp_graph")
    if graph is not None:
        why = (graph.get("capture") or {}).get("uncaptured_because")
        lines += ["", "CUDA graph: " + ("captured." if why is None else f"NOT captured: {why}")]
    lines += ["", f"Losses agree across variants: {data.get('valid')}.", ""]
    return lines, out


def fp8_section(data: dict[str, Any] | None) -> tuple[list[str], dict[str, Any]]:
    if data is None:
        return ["fp8: no results (the part was skipped, failed or cut by its time limit).", ""], {}
    meta, results = data["meta"], data["results"]
    cfg = meta["config"]
    base = {r["variant"]: r["tokens_s"] for r in results}.get("funcamp_bf16")
    lines = [
        f"fp8 against bf16 (funcamp's compiled step), {meta['args']['config']} at {cfg['n_layer']} blocks of width "
        f"{cfg['n_embd']}, batch {meta['args']['batch_size']} x {cfg['block_size']} tokens.",
        "",
        "| variant | tokens/s | vs funcamp bf16 | MFU | peak GiB | loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    out = {}
    for r in results:
        ratio = r["tokens_s"] / base if base else None
        lines.append(
            f"| {r['variant']} | {r['tokens_s']:,.0f} | {_fmt(ratio, '.2f')} | {_fmt(r.get('mfu'), '.1%')} | "
            f"{r['peak_gib']:.1f} | {r['loss']:.4f} |"
        )
        out[r["variant"]] = {"tokens_s": r["tokens_s"], "vs_bf16": ratio, "mfu": r.get("mfu"), "loss": r["loss"]}
    return [*lines, ""], out


def targets(bf16: dict[str, Any], fp8: dict[str, Any]) -> list[str]:
    """Each target with its figure, or 'not measured'."""
    rows = bf16.get("rows", {})
    graph, donate, amp = rows.get("funcamp_graph", {}), rows.get("funcamp_donate", {}), rows.get("amp_eager", {})
    speed, mfu = graph.get("vs_amp_compile"), graph.get("mfu")
    peak, ref = donate.get("peak_mb"), amp.get("peak_mb")
    best = max((v["vs_bf16"] for k, v in fp8.items() if k.startswith("fp8_") and v["vs_bf16"]), default=None)

    def verdict(value: Any, ok: bool, text: str) -> str:
        return f"- {text}: " + ("not measured" if value is None else f"{value} ({'met' if ok else 'missed'})")

    return [
        verdict(_fmt(speed, ".2f") + "x" if speed else None, bool(speed and speed >= 1.1), "capture >= 1.1x tokens/s"),
        verdict(_fmt(100 * mfu, ".1f") + "%" if mfu else None, bool(mfu and mfu >= 0.45), "capture MFU >= 45%"),
        verdict(
            f"{peak:,.0f} MB vs {ref:,.0f} MB" if peak and ref else None,
            bool(peak and ref and peak <= ref),
            "donate=True peak <= torch.amp's (fused AdamW)",
        ),
        verdict(_fmt(best, ".2f") + "x" if best else None, bool(best and best >= 1.2), "fp8 >= 1.2x bf16 tokens/s"),
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: summarize_cuda.py OUT_DIR")
    out = Path(argv[0])
    machine = (out / "machine.txt").read_text() if (out / "machine.txt").exists() else ""
    status = (out / "status.txt").read_text() if (out / "status.txt").exists() else ""
    lines = ["```", machine.strip(), "```", "", "Parts: " + "; ".join(status.strip().splitlines()), ""]
    summary: dict[str, Any] = {"machine": machine, "status": status.strip().splitlines()}
    for dtype, name in (("bf16", "bench_train_step_bf16.json"), ("fp16", "bench_train_step_fp16.json")):
        section, summary[dtype] = train_section(_load(out / name), dtype)
        lines += section
    section, summary["fp8"] = fp8_section(_load(out / "bench_fp8.json"))
    lines += section
    summary["targets"] = targets(summary["bf16"], summary["fp8"])
    lines += ["Targets:", *summary["targets"], ""]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return summary


if __name__ == "__main__":
    main()
