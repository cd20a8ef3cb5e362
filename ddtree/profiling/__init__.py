"""Engine-profiling tools: each is `python -m ddtree.profiling.<tool>`, one question about the engine or the server.

Tools:
    engine_bench     AR, DFLASH and DDTREE side by side in one process per (context, concurrency) cell
    paired           a few configs timed round by round, ratios taken within each round
    real_width       the engine at real model width on random weights: GEMMs, kernel profiles, rounds, the peer
    acceptance       acceptance and speed of every algorithm on held-out code prompts
    http_vs_engine   the HTTP server against the engine in process on the same prompts
    timeline         one request's stages through the client, the HTTP process and the engine process
    round_overhead   what the server's round loop adds to a decode round
    burst            how the scheduler admits a burst of arrivals, and what a prefill of k prompts costs
    tree_cpu         the tree steps on the CPU: the heap reference against the batched code

Their parts: flags (the shared command-line flags), emulated (an engine of fixed costs, no model),
in_process and fresh_runs (http_vs_engine's in-process side and its fresh-process runs), kernel_profile
(graph replays, kernel tables), peer (transformers' Qwen3 at real width), random_models and hbm (random-weight
pairs, HBM floors), syncs (host syncs per round).

The sweep (ddtree.suite, ddtree.bench) never imports this package; nothing under ddtree/ outside it does.
"""
