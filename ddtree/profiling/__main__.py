"""`python -m ddtree.profiling`: the list of tools (each runs as `python -m ddtree.profiling.<tool>`)."""

import ddtree.profiling

print(ddtree.profiling.__doc__)
