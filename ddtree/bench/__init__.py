"""The benchmark side of the suite: load generator, metrics, result files, sweep report, plots.

The load generator emits typed per-request records; metrics turn them into vLLM-style numbers;
result files hold one JSON per cell; the report and the plots read those files only.
`ddtree.bench.plots` is not imported here (matplotlib is slow to import); import it directly.
"""

from ddtree.bench.loadgen import RequestRecord, run_load, run_requests
from ddtree.bench.metrics import summarize_cell, summarize_repeat
from ddtree.bench.progress import Progress
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
    "Progress",
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
