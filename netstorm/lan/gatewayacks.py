"""The LAN gateway's ACKs: the chunks each batch of datagrams completed, told the workers in one datagram per
256 chunks, once to the multicast group (or a copy per worker), so their pool windows move; and the ACKs a
worker's QUERY asks for, to that worker alone (sans-I/O: chunk numbers in, datagrams into the outbox)."""

from __future__ import annotations

import numpy as np

from netstorm.lan.gatewayroster import Address, GatewayRoster
from netstorm.lan.header import TOKEN_AT
from netstorm.lan.packets import ack_packets


class AckBook:
    """ACKs gathered over one wake-up, per iteration."""

    def __init__(self, roster: GatewayRoster) -> None:
        self.roster = roster
        self.pending: dict[int, list[int]] = {}
        """iteration -> chunk sequence numbers to ACK after this batch of datagrams."""
        self.sent = 0

    def add(self, iteration: int, seqs: list[int]) -> None:
        if seqs:
            self.pending.setdefault(iteration, []).extend(seqs)

    def flush(self) -> None:
        """Send the ACKs gathered while handling a batch: one multicast datagram per 256 chunks (or a unicast
        copy per worker without a group)."""
        acks, self.pending = self.pending, {}
        roster = self.roster
        tokens = roster.tokens
        for iteration, seqs in acks.items():
            if roster.group is not None:
                targets = [(roster.group, tokens.group(iteration))]
            else:
                targets = [(address, tokens.gateway(w, iteration)) for w, address in roster.addresses.items()]
            for datagram in ack_packets(np.asarray(seqs), job=roster.job, iteration=iteration):
                for address, token in targets:
                    self.sent += 1
                    roster.control(_stamped(datagram, token), address)

    def answer(self, iteration: int, seqs: np.ndarray, worker: int, address: Address) -> None:
        """ACK ``seqs`` of ``iteration`` to ``worker`` alone (its QUERY asked about them)."""
        token = self.roster.tokens.gateway(worker, iteration)
        for datagram in ack_packets(seqs, job=self.roster.job, iteration=iteration):
            self.roster.control(_stamped(datagram, token), address)


def _stamped(datagram: bytes, token: int) -> bytes:
    return datagram[:TOKEN_AT] + token.to_bytes(8, "little") + datagram[TOKEN_AT + 8:]
