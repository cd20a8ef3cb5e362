"""`python -m ddtree.bench` ran the engine bench before the profiling tools had a package of their own: say where
it went instead of failing with "No module named ddtree.bench.__main__"."""

import sys

sys.exit("ddtree.bench is the sweep's runtime and has no command of its own. The engine bench is "
         "`python -m ddtree.profiling.engine_bench`; `python -m ddtree.profiling` lists every profiling tool.")
