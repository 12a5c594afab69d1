"""The trainer endpoint of a general node: a Unix socket (tensors in shared memory) and optionally TCP.

See docs/ARCHITECTURE.md, *The node: data plane, trainers, back-pressure*."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import math
import mmap
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from netstorm import auth, authconn
from netstorm import trainer_wire as tw
from netstorm.authconn import Credentials
from netstorm.client import MEMFD_NAME, SHM_PREFIX, shm_directory, sweep_shm
from netstorm.errors import (
    AuthError,
    ChunkError,
    ErrorCode,
    LayoutError,
    ModelTooLarge,
    NetStormError,
    TrainerProtocolError,
)
from netstorm.layout import Layout, TensorSpec
from netstorm.schema import MAX_ITEMS
from node.ranks import Ranks
from node.service import GeneralNode

log = logging.getLogger("netstorm.node.trainer")


class _Session:
    """One trainer connection: its transport kind and, for Unix sockets, the shared model vector."""

    def __init__(self, node: GeneralNode, inline: bool, name: str,
                 peer: tuple[int, int] | None = None) -> None:
        self.node = node
        self.inline = inline
        self.name = name
        self.peer_pid: int | None = peer[0] if peer is not None else None
        self.peer_uid: int | None = peer[1] if peer is not None else None
        """The trainer's process and user over a Unix socket (SO_PEERCRED)."""
        self.rank: int | None = None
        """This trainer's rank at the node, from its init on."""
        self.clean = False
        """The trainer said ``Bye``: it closed on purpose."""
        self.shm: np.ndarray | None = None
        self._mmap: mmap.mmap | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        self.shm = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def attach(self, path: str, fd: int, elements: int) -> None:
        """Map the trainer's model memory: its anonymous memfd (descriptor ``fd`` of the process at the other
        end of the socket, opened through /proc), or a netstorm-* file in the shared-memory directory, which
        is unlinked once mapped (both sides hold it: nothing is left if either dies). Either must belong to
        the trainer's user, so a trainer cannot make the node write into memory that is not its own."""
        if fd >= 0:
            if self.peer_pid is None:
                raise TrainerProtocolError("a model memfd needs a Unix socket whose peer's pid is known")
            where = f"/proc/{self.peer_pid}/fd/{fd}"
            try:
                target = os.readlink(where)
            except OSError as exc:
                raise TrainerProtocolError(f"cannot reach the trainer's model memory {where}: {exc.strerror} "
                                           f"(a node running as another user needs NETSTORM_SHM=file)") from None
            if not target.startswith(f"/memfd:{MEMFD_NAME}"):
                raise TrainerProtocolError(f"descriptor {fd} of the trainer is {target}, not its model memory")
            path = where
        else:
            if not path:
                raise TrainerProtocolError("init over a Unix socket needs a shared-memory file or memfd")
            named = Path(path)
            if named.parent != Path(shm_directory()) or not named.name.startswith(SHM_PREFIX):
                raise TrainerProtocolError(f"shared-memory file {path} is not a {SHM_PREFIX}* file in "
                                           f"{shm_directory()}")
        try:
            handle = os.open(path, os.O_RDWR | (os.O_NOFOLLOW if fd < 0 else 0))
        except OSError as exc:
            raise TrainerProtocolError(f"cannot open shared memory {path}: {exc.strerror}") from None
        try:
            info = os.fstat(handle)
            if not stat.S_ISREG(info.st_mode) or (fd >= 0 and info.st_nlink != 0):
                raise TrainerProtocolError(f"shared memory {path} is not an anonymous or regular file")
            if self.peer_uid is not None and info.st_uid != self.peer_uid:
                raise TrainerProtocolError(f"shared memory {path} belongs to uid {info.st_uid}, the trainer "
                                           f"runs as uid {self.peer_uid}")
            size = info.st_size
            if size != elements * 4:
                raise TrainerProtocolError(f"shared memory {path} holds {size} bytes; the model needs "
                                           f"{elements * 4}")
            self.close()
            self._mmap = mmap.mmap(handle, size) if size else None
            if fd < 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # both sides hold it now
        finally:
            os.close(handle)
        self.shm = (np.frombuffer(self._mmap, dtype="<f4") if self._mmap is not None
                    else np.zeros(0, dtype="<f4"))

    def keys(self, layout: Layout, names: tuple[str, ...]) -> list[int]:
        keys = [layout.key(n) for n in names]
        if len(set(keys)) != len(keys):
            raise TrainerProtocolError(f"a tensor is named twice in one request: {list(names)}")
        return keys


class _TrainerGone(Exception):
    """The trainer's connection closed while one of its requests was being served."""


class _WatchedReader(asyncio.StreamReader):
    """A stream reader that says when its connection reached its end (EOF or an error), so a request can
    be abandoned while the trainer is gone even though nothing reads the socket meanwhile."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit=limit)
        self.gone = asyncio.Event()

    def feed_eof(self) -> None:
        super().feed_eof()
        self.gone.set()

    def set_exception(self, exc: Exception) -> None:
        super().set_exception(exc)
        self.gone.set()


def _watched(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
             ) -> Callable[[], asyncio.StreamReaderProtocol]:
    """A protocol factory like ``asyncio.start_server``'s, with a ``_WatchedReader`` per connection."""
    def factory() -> asyncio.StreamReaderProtocol:
        return asyncio.StreamReaderProtocol(_WatchedReader(READ_LIMIT), handler)
    return factory


READ_LIMIT = 2**16
"""asyncio's default stream buffer limit (what start_server uses)."""


def _peer(writer: asyncio.StreamWriter) -> tuple[int, int] | None:
    """The pid and uid of the process at the other end of a Unix socket (Linux SO_PEERCRED)."""
    sock = writer.get_extra_info("socket")
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(pid), int(uid)


class TrainerEndpoint:
    """Serves trainers of one node."""

    def __init__(self, node: GeneralNode, *, credentials: Credentials | None = None) -> None:
        self.node = node
        self.ranks = Ranks(node)
        self._handover_lock = asyncio.Lock()
        self._background: set[asyncio.Future[None]] = set()
        self.credentials = credentials
        """With a job secret, a TCP trainer proves it before its first request (the Unix socket is
        guarded by its file permissions instead)."""
        self._servers: list[asyncio.Server] = []
        self._sessions = 0
        self._by_host: dict[str, int] = {}
        """Open TCP trainer connections per source address (at most ``max_connections_per_source``)."""

    async def serve_unix(self, path: str | Path, *, group: str | int | None = None) -> asyncio.Server:
        """Serve trainers on a Unix socket only its owner may connect to (mode 0600), or with ``group`` its
        owner and that group (0660). The socket is bound under a temporary name and renamed into place
        once its mode is set, so it is never reachable with looser permissions."""
        path = Path(path)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        for stale in sweep_shm():
            log.info("node %d: removed %s, left by a trainer that died", self.node.node_id, stale)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            staging.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(staging))
            if group is not None:
                os.chown(staging, -1, group if isinstance(group, int) else grp.getgrnam(group).gr_gid)
            os.chmod(staging, 0o660 if group is not None else 0o600)
            os.rename(staging, path)
        except BaseException:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                staging.unlink()
            raise
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(_watched(lambda r, w: self._handle(r, w, inline=False)), sock=sock)
        self._servers.append(server)
        return server

    async def serve_tcp(self, host: str, port: int) -> asyncio.Server:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_watched(lambda r, w: self._handle(r, w, inline=True)), host, port)
        self._servers.append(server)
        return server

    def close(self) -> None:
        for server in self._servers:
            server.close()
        for task in self._background:
            task.cancel()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, inline: bool) -> None:
        self._sessions += 1
        session = _Session(self.node, inline, f"trainer {self._sessions} of node {self.node.node_id}",
                           None if inline else _peer(writer))
        session.reader, session.writer = reader, writer
        log.info("node %d: %s connected (%s)", self.node.node_id, session.name, "tcp" if inline else "unix")
        peer = writer.get_extra_info("peername") if inline else None
        host = str(peer[0]) if isinstance(peer, tuple) and peer else None
        if host is not None:
            self._by_host[host] = self._by_host.get(host, 0) + 1
        try:
            cap = self.node.config.max_connections_per_source
            if host is not None and self._by_host[host] > cap:
                log.warning("node %d: closing %s: more than %d trainer connections from %s", self.node.node_id,
                            session.name, cap, host)
                await self._reply(writer, tw.ErrorReply(ErrorCode.PROTOCOL, f"more than {cap} trainer connections "
                                                                           f"from {host}"))
                return
            if inline and self.credentials is not None:
                try:
                    await authconn.server_stream(
                        self.credentials, reader, writer, plane=auth.Plane.TRAINER, me=auth.node(self.node.node_id),
                        timeout=self.node.config.connect_timeout, allowed=(auth.Role.TRAINER,),
                        refuse=lambda why: tw.encode(tw.ErrorReply(ErrorCode.AUTH, why)))
                except AuthError as exc:
                    log.warning("node %d: %s refused: %s", self.node.node_id, session.name, exc)
                    return
            while True:
                idle = self.node.config.trainer_idle_timeout
                try:
                    async with asyncio.timeout(idle):  # a trainer computes between requests, never forever
                        prefix = await reader.readexactly(tw.PREFIX.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except TimeoutError:
                    log.warning("node %d: closing %s: no request for %g s", self.node.node_id, session.name, idle)
                    with contextlib.suppress(ConnectionError, TimeoutError):
                        await self._reply(writer, tw.ErrorReply(ErrorCode.TIMEOUT, f"closing the connection: no "
                                                                f"request for {idle:g} s (trainer_idle_timeout)"))
                    return
                try:
                    header_len, payload_len = tw.decode_prefix(prefix, max_payload=1 << 40)
                    async with asyncio.timeout(self.node.config.iteration_timeout):
                        request = tw.decode(await reader.readexactly(header_len))
                        expected = self._payload_len(session, request)
                        if payload_len != expected:
                            raise TrainerProtocolError(f"{request.TYPE}: payload of {payload_len} bytes, "
                                                       f"expected {expected}")
                        payload = await reader.readexactly(payload_len) if payload_len else b""
                except TimeoutError:
                    log.warning("node %d: closing %s: a request stalled mid-message for %g s", self.node.node_id,
                                session.name, self.node.config.iteration_timeout)
                    return
                except (TrainerProtocolError, LayoutError) as exc:
                    log.warning("node %d: closing %s: %s", self.node.node_id, session.name, exc)
                    code = exc.code if isinstance(exc, ModelTooLarge) else ErrorCode.PROTOCOL
                    await self._reply(writer, tw.ErrorReply(code, str(exc)))
                    return
                if isinstance(request, tw.Bye):
                    session.clean = True
                    return
                try:
                    reply, out = await self._serve_watched(session, request, payload)
                except _TrainerGone:
                    log.warning("node %d: %s went away in the middle of its %s; its place is free", self.node.node_id,
                                session.name, request.TYPE)
                    return
                except NetStormError as exc:
                    log.warning("node %d: %s: %s failed: %s", self.node.node_id, session.name, request.TYPE, exc)
                    reply, out = tw.ErrorReply(exc.code, str(exc)), b""
                except Exception as exc:  # a bug must not cost the trainer its connection without a word
                    log.exception("node %d: %s: %s failed unexpectedly", self.node.node_id, session.name,
                                  request.TYPE)
                    why = f"node {self.node.node_id}: internal error: {exc!r}"
                    reply, out = tw.ErrorReply(ErrorCode.INTERNAL, why), b""
                await self._reply(writer, reply, out)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            log.info("node %d: %s went away: %s", self.node.node_id, session.name, exc)
        finally:
            if host is not None:
                self._by_host[host] -= 1
                if not self._by_host[host]:
                    del self._by_host[host]
            self.ranks.leave(session.rank, clean=session.clean)
            session.close()
            writer.close()

    async def _serve_watched(self, session: _Session, request: tw.Message,
                             payload: bytes) -> tuple[tw.Message, bytes]:
        """Serve one request, unless the trainer goes away first (its socket closed: it closed or died):
        then the request is abandoned at once, so its place at the node is free for a replacement now,
        not when the iteration it waited for ends."""
        reader = session.reader
        if not isinstance(reader, _WatchedReader):
            return await self._serve(session, request, payload)
        serving = asyncio.ensure_future(self._serve(session, request, payload))
        gone = asyncio.ensure_future(reader.gone.wait())
        try:
            await asyncio.wait({serving, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not serving.done() and reader.gone.is_set():
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError, NetStormError, ConnectionError,
                                     asyncio.IncompleteReadError):
                await serving
            raise _TrainerGone
        return await serving

    async def _reply(self, writer: asyncio.StreamWriter, reply: tw.Message, out: bytes | memoryview = b"") -> None:
        writer.write(tw.encode(reply, len(out)))
        if out:
            writer.write(out)
        async with asyncio.timeout(self.node.config.iteration_timeout):
            await writer.drain()

    def _payload_len(self, session: _Session, request: tw.Message) -> int:
        if isinstance(request, tw.InitRequest):
            elements = sum(math.prod(shape) for _, shape, _ in request.tensors)
            most = MAX_ITEMS * self.node.config.chunk_size
            bound = self.node.config.max_model_bytes
            if 4 * elements > bound:  # refused before a layout (or a payload) is built for it
                raise ModelTooLarge(f"node {self.node.node_id}: init of {elements} elements ({4 * elements} bytes "
                                    f"of float32) exceeds its max_model_bytes = {bound}; nothing was allocated")
            if elements > most:
                raise TrainerProtocolError(f"init of {elements} elements: more than the {MAX_ITEMS} chunks of "
                                           f"{self.node.config.chunk_size} elements a layout may hold")
            return 4 * elements if session.inline else 0
        if not session.inline:
            return 0
        if isinstance(request, tw.PushRequest) or (isinstance(request, tw.PullRequest) and request.push):
            layout = self._layout()
            return 4 * sum(layout.tensors[k].size for k in session.keys(layout, request.names))
        return 0

    def _layout(self) -> Layout:
        if self.node.layout is None:
            raise TrainerProtocolError("no tensors registered: call init first")
        return self.node.layout

    async def _serve(self, session: _Session, request: tw.Message, payload: bytes) -> tuple[tw.Message, bytes]:
        node = self.node
        if isinstance(request, tw.InitRequest):
            if session.rank is not None:
                raise TrainerProtocolError("init twice on one connection")
            session.rank = self.ranks.join(session.name)  # refused at once when every slot is taken
            try:
                return await self._init(session, request, payload)
            except BaseException:
                self.ranks.leave(session.rank)  # a failed init leaves no trace: the trainer may init again
                session.rank = None
                raise
        layout = self._layout()
        rank = self.ranks.check_request(session.rank)
        if isinstance(request, tw.PushRequest):
            keys = session.keys(layout, request.names)
            return tw.PushReply(await self._push(session, layout, keys, payload)), b""
        if isinstance(request, tw.PullRequest):
            keys = session.keys(layout, request.names)
            if request.push:
                await self._push(session, layout, keys, payload)
            iteration = self.ranks.pull_iteration(rank, keys[0]) if keys else -1
            out = await self._collect(session, layout, keys, average=request.average, inline_order=True)
            return tw.PullReply(iteration, request.names, node.contributor_count(iteration),
                                tuple(node.contributors(iteration)) if keys else (),
                                node.wan_bytes(iteration) if keys else 0), out
        raise TrainerProtocolError(f"a trainer may not send {request.TYPE!r}")

    async def _init(self, session: _Session, request: tw.InitRequest, payload: bytes) -> tuple[tw.Message, bytes]:
        node = self.node
        assert session.rank is not None
        specs = [TensorSpec(n, s, d) for n, s, d in request.tensors]
        if not session.inline:  # check the file before the tensors become the node's layout
            session.attach(request.shm, request.fd, sum(spec.size for spec in specs))
        layout = await node.register(specs, compression=request.compression, votes=request.votes, bits=request.bits,
                                     gia_reuse=request.gia_reuse)
        if not session.inline:
            values = session.shm
        else:
            # Inline values come in request order; place them in layout order.
            values = np.empty(layout.total, dtype="<f4")
            flat = np.frombuffer(payload, dtype="<f4")
            position = 0
            for name, _, _ in request.tensors:
                key = layout.key(name)
                size = layout.tensors[key].size
                values[layout.key_slice(key)] = flat[position:position + size]
                position += size
        assert values is not None
        keys = list(range(len(layout.tensors)))
        names = tuple(t.name for t in layout.tensors)
        if self.ranks.initialized:
            self.ranks.start(session.rank, layout, replacement=True)
            # what its predecessor left unread is released once complete, in the background: the
            # replacement starts now, not when the iteration its predecessor was in ends
            settling = asyncio.ensure_future(self.ranks.settle(layout))
            self._background.add(settling)
            settling.add_done_callback(self._background.discard)
            iteration = min(self.ranks.push_iteration(session.rank, k) for k in keys) if keys else 0
            log.info("node %d: %s replaces a trainer: %d tensors (layout %s), continues at iteration %d with its "
                     "own values", node.node_id, session.name, len(names), layout.hash, iteration)
            out = payload if session.inline else b""
            return tw.InitReply(node.node_id, iteration, node.contributor_count(iteration), layout.hash,
                                gia_threshold=layout.gia_threshold), out
        self.ranks.start(session.rank, layout, replacement=False)
        iteration = node.next_iteration()
        policy = await node.ensure_policy(iteration)
        # a DC admitted into a running job starts at its boundary iteration, which hands it the live model:
        # the lowest-id DC already in contributes its trainer's model, every other DC (the joiner too) zeros
        joining = node.joining(iteration)
        provider = min(set(policy.nodes) - set(joining))
        contributor = self.ranks.init_values(session.rank, node.node_id == provider)
        try:
            await self.ranks.push(session.rank, layout,
                                  {k: values[layout.key_slice(k)] if contributor else None for k in keys})
            out = await self._collect(session, layout, keys, average=False)
        except NetStormError:
            if node.node_id in joining:
                # Its boundary is gone: the job runs on with this DC in its policies, and no later
                # iteration hands it the model. It leaves; restarted, it is admitted afresh.
                log.error("node %d: the hand-over of the live model (iteration %d) failed: this node leaves "
                          "the job; restart it to rejoin", node.node_id, iteration)
                node.stop(f"the hand-over of the live model (iteration {iteration}) failed")
            raise
        self.ranks.initialized = True
        if session.inline:
            # Reply in request order, like the values came.
            order = [layout.key(n) for n, _, _ in request.tensors]
            ordered = np.concatenate([np.frombuffer(out, dtype="<f4")[layout.key_slice(k)] for k in order]) \
                if order else np.zeros(0, dtype="<f4")
            out = ordered.tobytes()
        log.info("node %d: %s registered %d tensors (layout %s), initial values from node %d",
                 node.node_id, session.name, len(names), layout.hash, provider)
        return tw.InitReply(node.node_id, iteration, node.contributor_count(iteration), layout.hash,
                            (provider,), layout.gia_threshold), out

    async def _handovers(self, session: _Session, layout: Layout) -> None:
        """Run every iteration about to start that admits DCs, as the hand-over of the live model (one
        push at a time: with several ranks, the first to push runs it and the others find it done)."""
        async with self._handover_lock:
            await self._run_handovers(session, layout)

    async def _run_handovers(self, session: _Session, layout: Layout) -> None:
        node = self.node
        keys = list(range(len(layout.tensors)))
        while True:
            try:
                iteration = node.next_iteration()
            except ChunkError:
                return  # this push continues an iteration already started
            if any(node.pull_iteration(k) != iteration for k in keys):
                return  # results not yet pulled: the trainer is mid-pipeline, not at an iteration boundary
            policy = await node.ensure_policy(iteration)
            node.check(iteration)  # its policy may have failed it (a member gone): the push fails, as without us
            joining = node.joining(iteration)
            if not joining:
                return
            provider = min(set(policy.nodes) - set(joining))
            model = await self._ask_model(session, layout, iteration) if provider == node.node_id else None
            for key in keys:
                await node.contribute(key, model[layout.key_slice(key)] if model is not None else None,
                                      iteration=iteration, lan=False)
            await node.collect(keys, lambda key, values: None)
            log.info("node %d: iteration %d handed the model of node %d to node(s) %s", node.node_id, iteration,
                     provider, list(joining))

    async def _ask_model(self, session: _Session, layout: Layout, iteration: int) -> np.ndarray:
        """The trainer's current model, asked for in the middle of its push."""
        assert session.reader is not None and session.writer is not None
        await self._reply(session.writer, tw.ModelWanted(iteration))
        size = layout.total * 4
        async with asyncio.timeout(self.node.config.iteration_timeout):
            header_len, payload_len = tw.decode_prefix(await session.reader.readexactly(tw.PREFIX.size),
                                                       max_payload=size)
            offer = tw.decode(await session.reader.readexactly(header_len))
            if not isinstance(offer, tw.ModelOffer) or offer.iteration != iteration:
                raise TrainerProtocolError(f"asked for the model of iteration {iteration}, the trainer sent {offer!r}")
            if payload_len != size:
                raise TrainerProtocolError(f"model offer of {payload_len} bytes, the model has {size}")
            return np.frombuffer(await session.reader.readexactly(payload_len), dtype="<f4")

    async def _push(self, session: _Session, layout: Layout, keys: list[int], payload: bytes) -> int:
        assert session.rank is not None
        await self._handovers(session, layout)
        flat = np.frombuffer(payload, dtype="<f4") if session.inline else None
        position = 0
        values: dict[int, np.ndarray | None] = {}
        for key in keys:
            span = layout.key_slice(key)
            if flat is not None:
                size = span.stop - span.start
                values[key] = flat[position:position + size]
                position += size
            else:
                if session.shm is None:
                    raise TrainerProtocolError("push before init on this connection")
                values[key] = session.shm[span]
        if not values:
            return -1
        return await self.ranks.push(session.rank, layout, values)

    async def _collect(self, session: _Session, layout: Layout, keys: list[int], *, average: bool,
                       inline_order: bool = False) -> bytes:
        """Wait for ``keys``' sums; write them to shared memory, or return them inline."""
        assert session.rank is not None
        if session.inline:
            sizes = [layout.tensors[k].size for k in keys]
            out = np.empty(sum(sizes) if inline_order else layout.total, dtype="<f4")
            starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64) if inline_order else None
            position = {k: (int(starts[i]) if starts is not None else layout.offsets[k]) for i, k in enumerate(keys)}
            target = out
        else:
            if session.shm is None:
                raise TrainerProtocolError("pull before init on this connection")
            position = {k: layout.offsets[k] for k in keys}
            target = session.shm

        iteration = self.ranks.pull_iteration(session.rank, keys[0]) if keys else -1
        # every DC's trainers and its gateway's LAN workers contributed: the mean is over all of them
        scale = np.float32(self.node.contributor_count(iteration))

        def sink(key: int, offset: int, values: np.ndarray) -> None:
            start = position[key] + offset
            dest = target[start:start + values.size]
            if average:
                np.divide(values, scale, out=dest)
            else:
                np.copyto(dest, values)

        await self.ranks.pull(session.rank, layout, keys, sink)
        return out.tobytes() if session.inline else b""
