"""The LAN worker's side of the edge tier: trainer API over UDP to the DC gateway.

A LAN worker behind a DC gateway sends its gradients as fixed-point UDP datagrams; the gateway (``bpf/``,
the XDP aggregator and its agent) sums them in the kernel and returns the WAN result the same way. The
datagram layout, the chunk-to-slot layout and the datagram builders live here, in the library, because
both sides speak them: ``client`` (``connect_edge``), ``sender`` (one worker's datagrams, NACKs and
PULLs), ``header`` (the fixed binary header the XDP program parses in C), ``fixedpoint`` (quantisation),
``layout`` (tensors cut into slot-sized chunks), ``packets`` (whole tensors' datagrams in numpy), ``tokens``
(the keyed tokens that authenticate datagrams when the job has a secret), ``udp`` (awaitable UDP on any
event loop).
"""
