"""WAN emulation on one Linux host: namespaces per DC, shaped veth links, routing, dynamics, runner.

Needs root (CAP_NET_ADMIN). Pure planning (``topology``, ``dynamics``) imports nothing privileged, so it
is testable anywhere; the modules that touch the kernel are ``netns``, ``shaping``, ``lossfilter``,
``network`` and ``teardown``, and the two small testbeds built from the same pieces: ``bridge_lan`` (a
gateway and LAN workers, for the edge benchmark and tests) and ``shaped_links`` (shaped point-to-point
links, for the probe-accuracy tests).
"""
