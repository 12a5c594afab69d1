"""The general node: one per DC, aggregating gradients over the WAN along the scheduler's trees.

- ``core``: ``NodeCore``, the sans-I/O protocol: per-tensor iterations, policy binding, failures with
  a cause, path choice and chunk moves from link snapshots, probes, one timer; ``actions`` holds what
  it asks its shell to do.
- ``chunks``: the sans-I/O aggregation core (per iteration and chunk: children, sums, forwarding).
- ``sendqueue``: the order frames leave a link in.
- ``peers``: TCP between nodes (BufferedProtocol receive into numpy, per-peer sender with back-pressure).
- ``forwarding``: the path each tree-edge chunk takes (primary or auxiliary, paper Fig. 7).
- ``service``: ``GeneralNode``, the asyncio shell around ``NodeCore``: it moves bytes, runs the core's
  timer and carries out its actions. A DC's contribution enters through
  ``GeneralNode.contribute(key, values, iteration=)`` and leaves through ``GeneralNode.collect(keys,
  sink)``, whatever its source (the trainer endpoint, a LAN aggregator).
- ``ranks``: the DC's trainers (``trainers`` of them): each push counts, their sum is the DC's
  contribution, a result is released once all have read it, and ``max_ahead`` bounds how far any runs.
- ``trainer_endpoint``: trainers over a Unix socket with shared memory, or TCP.
- ``control_client``: the scheduler's client (registration, policies, link reports, heartbeats).
"""
