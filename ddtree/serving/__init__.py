"""The pieces of `python -m ddtree.server`: arguments, request validation, the batching thread, metrics, routes."""
