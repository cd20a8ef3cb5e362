"""The sweep's runtime: load generator, metrics, result files, the sweep report, plots, the pace probe.

The load generator emits typed per-request records; metrics turn them into vLLM-style numbers;
result files hold one JSON per cell; the report and the plots read those files only. The engine-profiling
tools (python -m ddtree.profiling.<tool>) live in ddtree.profiling, which nothing here imports.
`ddtree.bench.plots` is not imported here (matplotlib is slow to import); import it directly.
"""

from ddtree.bench.loadgen import RequestRecord, run_load, run_requests
from ddtree.bench.metrics import summarize_cell, summarize_repeat
from ddtree.bench.prompts import code_prompts
from ddtree.bench.report import write_sweep_summary
from ddtree.bench.results import (
    CellResult,
    cell_exists,
    read_cells,
    write_cell,
    write_summary_csv,
)

__all__ = [
    "CellResult",
    "RequestRecord",
    "cell_exists",
    "code_prompts",
    "read_cells",
    "run_load",
    "run_requests",
    "summarize_cell",
    "summarize_repeat",
    "write_cell",
    "write_summary_csv",
    "write_sweep_summary",
]
