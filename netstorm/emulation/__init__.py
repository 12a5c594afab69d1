"""WAN emulation on one Linux host: namespaces per DC, shaped veth links, routing, dynamics, runner.

Needs root (CAP_NET_ADMIN). Pure planning (``topology``, ``dynamics``) imports nothing privileged, so it
is testable anywhere; the modules that touch the kernel are ``netns``, ``shaping``, ``lossfilter``,
``network`` and ``teardown``.
"""
