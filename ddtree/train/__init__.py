"""Training the fixture model pair from local files: corpus, byte-level BPE, target, DFlash drafter.

Pipeline (see ddtree.train.cli): the corpus and token arrays are built on the CPU host, the
models are trained from those arrays alone (on a GPU host for the real fixtures).
Submodules are imported on use so that `import ddtree.train` stays light.
"""
