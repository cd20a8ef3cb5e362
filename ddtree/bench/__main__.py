"""`python -m ddtree.bench`: the engine-level benchmark (ddtree.bench.engine_bench)."""

from ddtree.bench.engine_bench import main

raise SystemExit(main())
