"""Trainers that drive a NetStorm node: the synthetic one the emulator and benchmarks run per DC.

A trainer is an ordinary client of the trainer API (``netstorm.connect``); nothing here is known to
the node. ``netstorm.trainers.synthetic`` pushes model-shaped, integer-valued gradients whose sum every
DC can check exactly; ``netstorm.trainers.launch`` starts a ``netstorm local`` cluster with one
trainer process per DC for benchmarks, examples and tests.
"""
