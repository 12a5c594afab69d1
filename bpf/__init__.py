"""The gateway side of the LAN edge tier: XDP programs with bpf_timer, their loader, the agent that drives
the XDP or userspace aggregator, and the node's gateway role. The worker side and the datagram layout
both sides share are trainer API, in the library (``netstorm.lan``)."""
