"""ddtree: DDTree tree speculative decoding and the suite that measures it."""

__version__ = "0.1.0"
