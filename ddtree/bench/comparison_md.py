"""A comparison with a baseline as markdown: the header and "what moved" list of the sweep summary's
"vs baseline" part, and vs_baseline.md (`ddtree sweep-report --compare OLD NEW`)."""

from __future__ import annotations

from typing import Any

from ddtree.bench.baseline import NOISE_SIGMAS, CellDelta, Comparison
from ddtree.bench.cell_keys import key_order


def render_header(comparison: Comparison, record: dict[str, Any] | None = None) -> list[str]:
    """The baseline's identity, the differences, and the "what moved" list (markdown lines)."""
    c = comparison
    b = c.baseline
    lines = [f"Baseline `{c.baseline_path}`: commit {b['commit']}, GPU {b['gpu']}, backend {b['backend']}"
             + (f", started {record['started_at']}" if record and record.get("started_at") else "")
             + f"; tolerance {c.tolerance:.0%}; tok/s spreads at least ±{NOISE_SIGMAS:g} sigma of the pair's "
             f"noise (sigma {c.noise:.1%}).", ""]
    lines += [f"- Note: {note}" for note in c.differences()]
    verdict = "no regression" if c.ok else (f"regressed: {len(c.shift_regressions)} shifts, {len(c.regressed)} cells, "
                                            f"{len(c.gate_regressions)} gates")
    lines += [f"- Verdict: **{verdict}** ({len(c.cells)} cells compared, {len(c.improved)} improved, "
              f"{len(c.only_baseline)} missing now, {len(c.only_current)} new)", "", "### What moved", ""]
    moved = c.moved()
    lines += [f"- {line}" for line in moved] if moved else ["- nothing beyond tolerance and noise"]
    return lines + [""]


def render_comparison(comparison: Comparison, current_dir: str) -> str:
    """vs_baseline.md: the header, then a table per (context, concurrency) of both sides."""
    lines = [f"# {current_dir} vs baseline", "", *render_header(comparison)]
    groups: dict[tuple[int, float, int], list[CellDelta]] = {}
    for delta in comparison.cells.values():
        groups.setdefault(key_order(delta.key)[:3], []).append(delta)
    for (context, rate, concurrency), deltas in sorted(groups.items()):
        load = f"{rate:g} requests/s" if rate else f"concurrency {concurrency}"
        lines += [f"## context {context}, {load}", "",
                  "| config | tok/s now [spread] | tok/s baseline [spread] | ratio | accept now | accept baseline "
                  "| verdict |", "|---|---|---|---|---|---|---|"]
        for d in sorted(deltas, key=lambda d: d.key[0]):
            tps, acc = d.of("output_throughput"), d.of("accept_length")
            lines.append(
                f"| {d.key[0]} | {tps.current.text(1) if tps else '-'} | {tps.baseline.text(1) if tps else '-'} | "
                f"{f'{tps.ratio:.2f}' if tps else '-'} | {f'{acc.current.median:.2f}' if acc else '-'} | "
                f"{f'{acc.baseline.median:.2f}' if acc else '-'} | {d.verdict} |")
        lines.append("")
    return "\n".join(lines)
