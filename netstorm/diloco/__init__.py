"""DiLoCo and Streaming DiLoCo across DCs: H inner steps per DC, then an outer step on the mean
pseudo-gradient, fragment by fragment (arXiv 2311.08105, 2501.18512).

The algorithm is transport-free (``schedule``, ``outer``, ``codec``, ``state``, ``core``); ``sync`` runs
each fragment's outer all-reduce as NetStorm iterations through the trainer API, and ``reference``
simulates every DC in one process, the yardstick of the tests.
"""
