"""The asyncio trainer API: ``await netstorm.aconnect()`` with the same verbs as ``netstorm.connect``.

Requests on one connection are serialized (the node answers them in order); every await has the
client's timeout, and its error names the node's address and the iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Collection, Mapping

import numpy as np

from netstorm import auth, authconn
from netstorm import trainer_wire as tw
from netstorm.client import (
    DEFAULT_TIMEOUT,
    Registry,
    RegistryView,
    raise_for,
    release_init,
    resolve_address,
    tcp_credentials,
)
from netstorm.errors import AuthError, NodeGone, TrainerAuthError, TrainerError, TrainerTimeout


class AsyncClient(RegistryView):
    """An asyncio connection to this DC's general node; create with ``aconnect``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, inline: bool,
                 address: object, timeout: float) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()
        self.address = address
        self.timeout = timeout
        self.registry = Registry(inline=inline)
        self._broken: str | None = None

    async def _call(self, request: tw.Message, payload: bytes, expected: type[tw.Message],
                    context: str) -> tuple[tw.Message, bytes]:
        async with self._lock:
            if self._broken is not None:
                raise NodeGone(f"{context}: this connection to the node at {self.address} is unusable after: "
                               f"{self._broken}")
            try:
                async with asyncio.timeout(self.timeout):
                    self._writer.write(tw.encode(request, len(payload)))
                    if payload:
                        self._writer.write(payload)
                    await self._writer.drain()
                    while True:
                        header_len, payload_len = tw.decode_prefix(
                            await self._reader.readexactly(tw.PREFIX.size), max_payload=1 << 40)
                        reply = tw.decode(await self._reader.readexactly(header_len))
                        data = await self._reader.readexactly(payload_len) if payload_len else b""
                        if not isinstance(reply, tw.ModelWanted):
                            break
                        offer, model = self.registry.model_payload(reply)  # the live model for a joiner
                        self._writer.write(tw.encode(offer, len(model)))
                        self._writer.write(model)
                        await self._writer.drain()
            except TimeoutError:
                self._broken = f"{context}: no answer within {self.timeout:g} s"
                self._writer.close()
                raise TrainerTimeout(f"{context}: no answer from the node at {self.address} within "
                                     f"{self.timeout:g} s") from None
            except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
                self._broken = f"{context}: {exc or 'connection closed'}"
                self._writer.close()
                raise NodeGone(f"{context}: the node at {self.address} is gone: {exc}") from None
            except TrainerError as exc:
                self._broken = str(exc)
                self._writer.close()
                raise
            except BaseException:  # cancelled mid-request: its reply would be read as the next request's
                self._broken = f"{context}: cancelled before the node answered"
                self._writer.close()
                raise
        raise_for(reply, expected, context)
        return reply, data

    async def init(self, tensors: Mapping[str, np.ndarray], *, compression: str = "none",
                   votes: int = 0, bits: int = 0, gia_reuse: int = 1) -> dict[str, np.ndarray]:
        request, payload, path = self.registry.prepare_init(tensors, compression, votes, bits, gia_reuse)
        try:
            reply, data = await self._call(request, payload, tw.InitReply, "init")
        finally:
            release_init(path)
            self.registry.handed_over()
        return self.registry.accept_init(reply, list(tensors), data)

    async def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = False, *,
                        keep: Collection[str] | None = None) -> dict[str, np.ndarray]:
        names, payload = self.registry.prepare_push(tensors)
        context = f"push_pull of iteration {self.iteration + 1}"
        reply, data = await self._call(tw.PullRequest(names, average, push=True), payload, tw.PullReply, context)
        return self.registry.accept_result(reply, names, data, keep)

    async def push(self, name: str, value: np.ndarray) -> None:
        names, payload = self.registry.prepare_push({name: value})
        await self._call(tw.PushRequest(names), payload, tw.PushReply, f"push of {name!r}")

    async def pull(self, name: str, average: bool = False) -> np.ndarray:
        self.registry.key(name)
        reply, data = await self._call(tw.PullRequest((name,), average), b"", tw.PullReply, f"pull of {name!r}")
        return self.registry.accept_result(reply, (name,), data)[name]

    async def close(self) -> None:
        """Say Bye unless a request is in flight (the node then knows this trainer left on purpose) and close."""
        if self._broken is None and not self._lock.locked():
            with contextlib.suppress(ConnectionError, OSError):
                self._writer.write(tw.encode(tw.Bye()))
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()
        self.registry.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def aconnect(address: str | os.PathLike[str] | None = None, *,
                   timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 (the contract)
                   secret_file: str | os.PathLike[str] | None = None) -> AsyncClient:
    """An asyncio client of this DC's general node (same addresses and secret as ``netstorm.connect``)."""
    kind, where = resolve_address(address)
    credentials = tcp_credentials(secret_file) if kind == "tcp" else None
    try:
        async with asyncio.timeout(timeout):
            if kind == "tcp":
                assert isinstance(where, tuple)
                reader, writer = await authconn.open_stream(*where, credentials, plane=auth.Plane.TRAINER,
                                                            me=auth.TRAINER, timeout=timeout, tls=False)
            else:
                reader, writer = await asyncio.open_unix_connection(str(where))
    except AuthError as exc:
        raise TrainerAuthError(f"the node at {where}: {exc}") from None
    except (OSError, TimeoutError) as exc:
        raise NodeGone(f"cannot reach the node at {where}: {exc or 'timed out'}") from None
    return AsyncClient(reader, writer, inline=(kind == "tcp"), address=where, timeout=timeout)
