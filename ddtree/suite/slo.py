"""`--slo KEY=VALUE,...`: the SLOs of the sweep's answer, over the grid's `slo:` block.

    pytest -m perf --config-grid smoke --slo ttft_p99_ms=2000,tpot_p90_ms=50,attainment_target=0.95

Its option joins the "ddtree" group. A key given here replaces the grid's, the grid's other keys
stay. The value is checked at configure (ddtree.suite.plugin), before anything is collected or
started: an unknown key or a bad value is a usage error naming the key and what is allowed
(ddtree.bench.slo). SLOs never fail a cell; they choose the answer. The report header shows them.
"""

from __future__ import annotations

import dataclasses

import pytest

from ddtree.bench.slo import SLO_KEYS, parse_slo_flag
from ddtree.errors import ConfigError
from ddtree.suite.options import SuiteOptions, raw_option

HELP = ("SLOs for the sweep's answer, KEY=VALUE,... over the grid's slo block; keys: "
        f"{', '.join(SLO_KEYS)} (thresholds in ms > 0; attainment_target in (0, 1], default 0.99)")


def add_options(parser: pytest.Parser) -> None:
    parser.getgroup("ddtree").addoption("--slo", dest="ddtree_slo", metavar="KEY=VALUE,...", help=HELP)
    parser.addini("ddtree_slo", HELP, default=None)


def apply_slo(config: pytest.Config, options: SuiteOptions) -> None:
    """Lay --slo (or the ini key ddtree_slo) over the grid's slo block, in options.grid."""
    value, where = raw_option(config, "slo")
    if value is None:
        return
    try:
        slo = parse_slo_flag(str(value), options.grid.slo, where)
    except ConfigError as err:
        raise pytest.UsageError(str(err)) from err
    options.grid = dataclasses.replace(options.grid, slo=slo)
