"""The pytest suite machinery: options, cells, ordering, the service fixture, floors (see plugin.py)."""
