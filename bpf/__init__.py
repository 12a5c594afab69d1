"""LAN edge aggregation: XDP programs with bpf_timer, their loader, the edge agent and LAN sender."""
