"""The pytest suite machinery: the plugin and its session, options, cells, the service fixtures, the cell runner, floors (see plugin.py)."""
