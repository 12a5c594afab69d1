"""The trainer API: ``netstorm.connect()`` and its PUSH/PULL verbs.

See docs/ARCHITECTURE.md, *One chunk, from trainer to root and back*."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import socket
import tempfile
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import numpy as np

from netstorm import auth, authconn
from netstorm import trainer_wire as tw
from netstorm.compression.methods import METHODS
from netstorm.errors import (
    AuthError,
    ErrorCode,
    IterationError,
    LayoutError,
    LayoutMismatch,
    ModelTooLarge,
    NodeGone,
    NonFinite,
    PeerLost,
    TooFarAhead,
    TrainerAuthError,
    TrainerError,
    TrainerLimit,
    TrainerProtocolError,
    TrainerTimeout,
    UnknownTensor,
    WrongDtype,
    WrongShape,
)
from netstorm.layout import INT_DTYPES, INT_EXACT, TENSOR_DTYPES, Layout, TensorSpec, dtype_name

DEFAULT_TIMEOUT = 300.0
ENV_SOCKET = "NETSTORM_SOCKET"
ENV_SECRET = "NETSTORM_SECRET_FILE"
"""The job secret a TCP client proves when ``secret_file`` is not given (the option's variable)."""

ERRORS: dict[ErrorCode, type[TrainerError]] = {
    ErrorCode.UNKNOWN_TENSOR: UnknownTensor, ErrorCode.WRONG_SHAPE: WrongShape, ErrorCode.WRONG_DTYPE: WrongDtype,
    ErrorCode.PEER_LOST: PeerLost, ErrorCode.PEER_GONE: PeerLost, ErrorCode.NODE_GONE: NodeGone,
    ErrorCode.TIMEOUT: TrainerTimeout, ErrorCode.ITERATION_FAILED: IterationError, ErrorCode.INTERNAL: IterationError,
    ErrorCode.TRAINER_LIMIT: TrainerLimit, ErrorCode.TOO_FAR_AHEAD: TooFarAhead, ErrorCode.NON_FINITE: NonFinite,
    ErrorCode.AUTH: TrainerAuthError, ErrorCode.MODEL_TOO_LARGE: ModelTooLarge,
    ErrorCode.LAYOUT_MISMATCH: LayoutMismatch,
}
"""The exception a trainer raises for the code of a node's ErrorReply; any other code (the request broke
the protocol, or the node refused it) raises TrainerProtocolError."""


def resolve_address(address: str | os.PathLike[str] | None) -> tuple[str, str | tuple[str, int]]:
    """("unix", path) or ("tcp", (host, port)) from an address, or from NETSTORM_SOCKET."""
    if address is None:
        address = os.environ.get(ENV_SOCKET)
        if not address:
            raise NodeGone(f"no node address given and {ENV_SOCKET} is not set")
    text = os.fspath(address)
    if text.startswith("tcp://"):
        host, sep, port = text[len("tcp://"):].rpartition(":")
        if not sep or not port.isdigit():
            raise TrainerError(f"bad trainer address {text!r}: expected tcp://HOST:PORT")
        return "tcp", (host.strip("[]"), int(port))
    return "unix", text


SHM_PREFIX = "netstorm-"
"""Shared-memory files are named netstorm-<pid>-<random> in ``shm_directory()``; nodes map no others."""
MEMFD_NAME = "netstorm-model"
"""The name of a trainer's anonymous model memory (``/memfd:netstorm-model`` in /proc); nodes map no other."""
ENV_SHM = "NETSTORM_SHM"
"""How a Unix-socket trainer shares its model: "memfd" (default: anonymous) or "file" (named in /dev/shm)."""
ENV_MAX_MODEL = "NETSTORM_MAX_MODEL_BYTES"
"""The ``max_model_bytes`` option as a trainer reads it (its default is the option's)."""


def model_bound() -> int:
    """``max_model_bytes`` for this trainer: NETSTORM_MAX_MODEL_BYTES, else the option's default."""
    from netstorm.config import Config

    text = os.environ.get(ENV_MAX_MODEL, "")
    if not text:
        return Config.max_model_bytes
    try:
        bound = int(text)
    except ValueError:
        raise TrainerError(f"{ENV_MAX_MODEL} must be a number of bytes, got {text!r}") from None
    if bound <= 0:
        raise TrainerError(f"{ENV_MAX_MODEL} must be positive, got {bound}")
    return bound


def memory_available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), or a very large number
    where /proc/meminfo does not say."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def shm_free(directory: str) -> int:
    """Bytes a file in ``directory`` can still grow by (tmpfs's own size limit)."""
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize


def check_model_size(elements: int, bound: int, *, shared: str | None) -> None:
    """Refuse a model of ``elements`` float32 elements above ``bound`` bytes or the memory free (``shared``:
    the shared memory it will live in, "memfd" or a directory), before anything is allocated."""
    need = 4 * elements
    if need > bound:
        raise ModelTooLarge(f"init of {elements} elements ({need} bytes of float32) exceeds max_model_bytes = "
                            f"{bound} (NETSTORM_MAX_MODEL_BYTES); nothing was allocated")
    free = memory_available()
    where = "memory available"
    if shared not in (None, "memfd"):
        directory_free = shm_free(shared)
        if directory_free < free:
            free, where = directory_free, f"space free in {shared}"
    if need > free:
        raise ModelTooLarge(f"init of {elements} elements needs {need} bytes of shared memory, but only {free} "
                            f"bytes are {where}; nothing was allocated")


def sweep_shm(directory: str | None = None) -> list[str]:
    """Remove shared-memory files whose trainer is dead (netstorm-<pid>-*, the pid gone or started after the
    file was made): what a trainer killed before its node unlinked the file left behind."""
    where = Path(directory or shm_directory())
    removed: list[str] = []
    for path in where.glob(f"{SHM_PREFIX}*"):
        pid_text = path.name[len(SHM_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            started = _started(int(pid_text))
            if started is not None and started <= path.stat().st_mtime + 1.0:
                continue  # its trainer (or the process that made it) still runs
            path.unlink()
            removed.append(str(path))
        except OSError:
            continue
    return removed


def _started(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds), or None if there is none (a reused pid started later
    than the file it did not make)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def tcp_credentials(secret_file: str | os.PathLike[str] | None) -> authconn.Credentials | None:
    """The credentials a TCP trainer proves: ``secret_file``, else NETSTORM_SECRET_FILE, else none."""
    path = secret_file if secret_file is not None else os.environ.get(ENV_SECRET) or None
    return authconn.Credentials.from_file(path)


def shm_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _check_exact(name: str, array: np.ndarray) -> None:
    """Integer tensors reach the node as float32: their values must be within its exact range."""
    if array.dtype == np.int32 and array.size and int(np.max(np.abs(array.astype(np.int64)))) > INT_EXACT:
        raise WrongDtype(f"tensor {name!r}: int32 values beyond 2**24 are not carried exactly")


class Registry:
    """The trainer side's view of the registered tensors: checks, shared memory, result decoding."""

    def __init__(self, inline: bool, *, max_model_bytes: int | None = None, shm: str | None = None) -> None:
        self.inline = inline
        self.max_model_bytes = max_model_bytes if max_model_bytes is not None else model_bound()
        """The largest model ``init`` may name (``max_model_bytes``)."""
        self.shm_mode = shm if shm is not None else (os.environ.get(ENV_SHM) or "memfd")
        if self.shm_mode not in ("memfd", "file"):
            raise TrainerError(f"{ENV_SHM} must be memfd or file, got {self.shm_mode!r}")
        self.layout: Layout | None = None
        self.shm: np.ndarray | None = None
        self._mmap: mmap.mmap | None = None
        self._memfd = -1
        """The anonymous model memory, held open until the node has it (its init reply)."""
        self.num_workers = 0
        self.node_id = -1
        self.iteration = -1
        """The newest iteration the node has reported to this trainer (-1 before init)."""
        self.contributors: tuple[int, ...] = ()
        """The DCs whose gradients the latest result holds."""
        self.wan_bytes = 0
        """Bytes the node queued on WAN links for the latest result's iteration, as it replied."""
        self.gia_threshold = 0
        """The threshold FediAC's roots apply to the vote counts (0: none), as the node's init said."""
        self.provider: Callable[[], Mapping[str, np.ndarray]] | None = None
        """The trainer's current model, asked for when this DC hands it to an admitted DC."""

    def model_payload(self, wanted: tw.Message) -> tuple[tw.ModelOffer, bytes]:
        """The ``ModelOffer`` answering a node's ``ModelWanted``: every tensor, float32, layout order."""
        assert isinstance(wanted, tw.ModelWanted)
        layout = self._need_layout()
        if self.provider is None:
            raise TrainerError("the node asks for this trainer's model, but it has no model provider")
        model = self.provider()
        parts = []
        for spec in layout.tensors:
            if spec.name not in model:
                raise TrainerError(f"the model provider has no tensor {spec.name!r}")
            value = np.asarray(model[spec.name])
            if tuple(value.shape) != spec.shape:
                raise WrongShape(f"model provider: tensor {spec.name!r} has shape {tuple(value.shape)}, registered "
                                 f"{spec.shape}")
            parts.append(np.ascontiguousarray(value, dtype="<f4").tobytes())
        return tw.ModelOffer(wanted.iteration), b"".join(parts)

    def close(self) -> None:
        self.handed_over()
        self.shm = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def prepare_init(self, tensors: Mapping[str, np.ndarray], compression: str = "none",
                     votes: int = 0, bits: int = 0, gia_reuse: int = 1) -> tuple[tw.InitRequest, bytes, str]:
        """The init request, its inline payload (TCP) and the shared-memory path to unlink afterwards."""
        if not tensors:
            raise TrainerError("init needs at least one tensor")
        arrays = {name: np.asarray(value) for name, value in tensors.items()}
        for name, array in arrays.items():
            if dtype_name(array.dtype) not in TENSOR_DTYPES:
                raise WrongDtype(f"tensor {name!r}: dtype {array.dtype} not supported "
                                 f"(supported: {', '.join(TENSOR_DTYPES)})")
            _check_exact(name, array)
        if compression not in METHODS:
            raise TrainerError(f"compression must be one of {', '.join(METHODS)}, got {compression!r}")
        # before a spec, a layout or a byte of memory exists for it (a 10^6 x 10^6 view is refused here)
        check_model_size(sum(math.prod(array.shape) for array in arrays.values()), self.max_model_bytes,
                         shared=None if self.inline else self.shm_mode if self.shm_mode == "memfd"
                         else shm_directory())
        specs = [TensorSpec.of(name, array) for name, array in arrays.items()]
        # Only offsets matter here; the node cuts the chunks with the job's chunk_size.
        layout = Layout.build(specs, 1 << 62)
        self.layout = layout
        request_tensors = tuple((s.name, s.shape, s.dtype) for s in specs)
        if self.inline:
            payload = b"".join(np.ascontiguousarray(arrays[s.name], dtype="<f4").tobytes() for s in specs)
            return (tw.InitRequest(request_tensors, "", compression, votes, bits, gia_reuse),
                    payload, "")
        path = self._create_shm(layout.total * 4)
        assert self.shm is not None
        try:
            _place(self.shm, layout, [(key, arrays[spec.name]) for key, spec in enumerate(layout.tensors)])
        except BaseException:
            release_init(path)
            self.close()
            raise
        return (tw.InitRequest(request_tensors, path, compression, votes, bits, gia_reuse, fd=self._memfd),
                b"", path)

    def _create_shm(self, size: int) -> str:
        """The model's shared memory: an anonymous memfd ("" returned), or a named file (its path)."""
        self.close()
        if self.shm_mode == "memfd":
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
            path = ""
        else:
            sweep_shm()
            path = str(Path(shm_directory()) / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size) if size else None
        except OSError:
            os.close(fd)
            release_init(path)
            raise
        if path:
            os.close(fd)
        else:
            self._memfd = fd
        self.shm = np.frombuffer(self._mmap, dtype="<f4") if self._mmap is not None else np.zeros(0, "<f4")
        return path

    def handed_over(self) -> None:
        """The node holds the model's memory (or the init is over): this side needs no descriptor for it."""
        if self._memfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._memfd)
            self._memfd = -1

    def _need_layout(self) -> Layout:
        if self.layout is None:
            raise TrainerError("call init before push/pull")
        return self.layout

    def check(self, name: str, value: np.ndarray) -> int:
        """The tensor's key; UnknownTensor / WrongShape / WrongDtype naming it otherwise."""
        layout = self._need_layout()
        try:
            key = layout.key(name)
        except LayoutError:
            raise UnknownTensor(f"unknown tensor {name!r}: init registered "
                                f"{', '.join(layout.names()[:8])}{' ...' if len(layout.tensors) > 8 else ''}") \
                from None
        spec = layout.tensors[key]
        if tuple(value.shape) != spec.shape:
            raise WrongShape(f"tensor {name!r}: shape {tuple(value.shape)}, registered {spec.shape}")
        if dtype_name(value.dtype) != spec.dtype:
            raise WrongDtype(f"tensor {name!r}: dtype {value.dtype}, registered {spec.dtype}")
        _check_exact(name, value)
        return key

    def key(self, name: str) -> int:
        layout = self._need_layout()
        try:
            return layout.key(name)
        except LayoutError:
            raise UnknownTensor(f"unknown tensor {name!r}") from None

    def prepare_push(self, tensors: Mapping[str, np.ndarray]) -> tuple[tuple[str, ...], bytes]:
        """Check every tensor first (nothing is sent if one is wrong), then place the values."""
        layout = self._need_layout()
        arrays = {name: np.asarray(value) for name, value in tensors.items()}
        keys = [self.check(name, array) for name, array in arrays.items()]
        names = tuple(arrays)
        if self.inline:
            return names, b"".join(np.ascontiguousarray(a, dtype="<f4").tobytes() for a in arrays.values())
        assert self.shm is not None
        _place(self.shm, layout, list(zip(keys, arrays.values(), strict=True)))
        return names, b""

    def results(self, names: Sequence[str], payload: bytes | bytearray,
                keep: Collection[str] | None = None) -> dict[str, np.ndarray]:
        """Fresh arrays of the registered shapes and dtypes from the node's reply: of every name, or of
        those in ``keep`` (the others are neither copied nor converted)."""
        layout = self._need_layout()
        if not self.inline:
            assert self.shm is not None
            return _gather(self.shm, layout, [self.key(name) for name in names if keep is None or name in keep])
        flat = np.frombuffer(payload, dtype="<f4")
        out: dict[str, np.ndarray] = {}
        position = 0
        for name in names:
            key = self.key(name)
            spec = layout.tensors[key]
            values = flat[position:position + spec.size]
            position += spec.size
            if keep is not None and name not in keep:
                continue
            if spec.dtype in INT_DTYPES:  # the exact integer sum, whatever lane it travelled in
                out[name] = _rounded(values).reshape(spec.shape)
            else:
                out[name] = values.astype(TENSOR_DTYPES[spec.dtype], copy=True).reshape(spec.shape)
        if position != flat.size:
            raise TrainerProtocolError(f"node sent {flat.size} values for {position}")
        return out

    def accept_init(self, reply: tw.Message, names: Sequence[str],
                    payload: bytes | bytearray) -> dict[str, np.ndarray]:
        """Take the node's InitReply: who and where we are, and the agreed initial values."""
        assert isinstance(reply, tw.InitReply)
        self.handed_over()
        self.num_workers = reply.num_workers
        self.node_id = reply.node_id
        self.iteration = reply.iteration
        self.gia_threshold = reply.gia_threshold
        self.contributors = reply.contributors
        model = self.results(names, payload)
        if self.provider is None:
            kept = {name: _narrowest(value) for name, value in model.items()}
            self.provider = lambda: kept
        return model

    def accept_result(self, reply: tw.Message, names: Sequence[str], payload: bytes | bytearray,
                      keep: Collection[str] | None = None) -> dict[str, np.ndarray]:
        """Take a PullReply: the sums of ``names`` (those in ``keep``, if given), and how many contributed."""
        assert isinstance(reply, tw.PullReply)
        self.iteration = max(self.iteration, reply.iteration)
        self.num_workers = reply.workers
        self.wan_bytes = reply.wan_bytes
        if reply.contributors:
            self.contributors = reply.contributors
        return self.results(names, payload, keep)

    def payload_len(self, names: Sequence[str]) -> int:
        if not self.inline:
            return 0
        layout = self._need_layout()
        return 4 * sum(layout.tensors[self.key(n)].size for n in names)


def _runs(layout: Layout, keys: Sequence[int]) -> list[list[int]]:
    """``keys`` (in order) cut into runs of tensors adjacent in the flat model (key k, then k + 1), each
    one contiguous slice: a model of many small tensors is copied in a few large copies."""
    runs: list[list[int]] = []
    for key in keys:
        if runs and runs[-1][-1] + 1 == key:
            runs[-1].append(key)
        else:
            runs.append([key])
    return runs


def _place(shm: np.ndarray, layout: Layout, values: Sequence[tuple[int, np.ndarray]]) -> None:
    """Write each (key, array) into its slice of the shared model, converting as ``same_kind`` allows."""
    by_key = dict(values)
    for run in _runs(layout, sorted(by_key)):
        start, stop = layout.offsets[run[0]], layout.key_slice(run[-1]).stop
        if len(run) == 1:
            np.copyto(shm[start:stop].reshape(by_key[run[0]].shape), by_key[run[0]], casting="same_kind")
        else:
            np.concatenate([by_key[k].reshape(-1) for k in run], out=shm[start:stop], casting="same_kind")


def _gather(shm: np.ndarray, layout: Layout, keys: Sequence[int]) -> dict[str, np.ndarray]:
    """Fresh arrays of ``keys``' registered shapes and dtypes from the shared model: float32 tensors adjacent
    in the model share one copy (each its own view of it, nothing of the shared file), others convert
    straight from the shared model, a block at a time (no model-sized temporary beside the result)."""
    out: dict[str, np.ndarray] = {}
    floats = [key for key in keys if layout.tensors[key].dtype == "float32"]
    for run in _runs(layout, sorted(floats)):
        start = layout.offsets[run[0]]
        block = shm[start:layout.key_slice(run[-1]).stop].copy() if len(run) > 1 else None
        for key in run:
            spec = layout.tensors[key]
            span = layout.key_slice(key)
            values = block[span.start - start:span.stop - start] if block is not None else shm[span].copy()
            out[spec.name] = values.reshape(spec.shape)
    for key in keys:
        spec = layout.tensors[key]
        if spec.dtype == "float32":
            continue
        values = shm[layout.key_slice(key)]
        if spec.dtype in INT_DTYPES:  # the exact integer sum, whatever lane it travelled in
            out[spec.name] = _rounded(values).reshape(spec.shape)
        else:
            out[spec.name] = values.astype(TENSOR_DTYPES[spec.dtype], copy=True).reshape(spec.shape)
    return {layout.tensors[key].name: out[layout.tensors[key].name] for key in keys}


def _narrowest(value: np.ndarray) -> np.ndarray:
    """An int64 sum in the narrowest integer lane that holds it (the same float32 in a model offer): the
    default model provider keeps the initial values for as long as the trainer runs, and a compressed
    job's vote and value sums of a model's size are mostly zeros."""
    if value.dtype != np.int64 or value.size == 0:
        return value
    low, high = int(value.min()), int(value.max())
    for lane in (np.int8, np.int16, np.int32):
        info = np.iinfo(lane)
        if info.min <= low and high <= info.max:
            return value.astype(lane)
    return value


_ROUND_BLOCK = 1 << 20


def _rounded(values: np.ndarray) -> np.ndarray:
    """``np.rint(values).astype(np.int64)``, a block at a time: one float32 block of scratch, not a copy."""
    out = np.empty(values.size, dtype=np.int64)
    scratch = np.empty(min(_ROUND_BLOCK, values.size), dtype=values.dtype)
    for start in range(0, values.size, _ROUND_BLOCK):
        stop = min(start + _ROUND_BLOCK, values.size)
        np.rint(values[start:stop], out=scratch[:stop - start])
        out[start:stop] = scratch[:stop - start]
    return out


def release_init(path: str) -> None:
    """Remove an init's shared-memory file (the node has mapped it, or the init failed)."""
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def raise_for(reply: tw.Message, expected: type[tw.Message], context: str) -> None:
    if isinstance(reply, tw.ErrorReply):
        raise ERRORS.get(reply.kind, TrainerProtocolError)(reply.message)
    if not isinstance(reply, expected):
        raise TrainerProtocolError(f"{context}: node answered {reply.TYPE!r}, expected {expected.TYPE!r}")


class RegistryView:
    """What both clients report from their Registry (the blocking and the asyncio one share it)."""

    registry: Registry
    keeps_results = True
    """Its ``push_pull`` takes ``keep``: the names whose sums to hand back (the compression rounds ask
    for their few, not the model's zeros)."""

    @property
    def num_workers(self) -> int:
        """Workers whose gradients make up each sum in the latest iteration: every contributing DC's own
        trainer and the LAN workers its gateway aggregates (what ``average=True`` divides by)."""
        return self.registry.num_workers

    @property
    def contributors(self) -> tuple[int, ...]:
        """The DCs whose gradients the latest result holds: the membership the scheduler bound to its
        iteration (after init, the DC whose values every DC started from; empty for a trainer that
        replaced another and got its own values back)."""
        return self.registry.contributors

    @property
    def node_id(self) -> int:
        return self.registry.node_id

    @property
    def gia_threshold(self) -> int:
        """The threshold FediAC's roots apply to the vote counts (0: the sums come back as counts)."""
        return self.registry.gia_threshold

    @property
    def wan_bytes(self) -> int:
        """Bytes of chunk frames this DC's node queued on WAN links for the latest result's iteration (as
        of its reply; frames relayed later for it are not in). Summed over DCs: the iteration's traffic."""
        return self.registry.wan_bytes

    @property
    def iteration(self) -> int:
        """The newest iteration the node has reported (-1 before init)."""
        return self.registry.iteration

    def set_model_provider(self, provider: Callable[[], Mapping[str, np.ndarray]]) -> None:
        """What this trainer's current model is, when its DC hands the model to a DC admitted into the
        job (by default the dict ``init`` returned)."""
        self.registry.provider = provider


class Client(RegistryView):
    """A blocking connection to the general node of this DC."""

    def __init__(self, address: str | os.PathLike[str] | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 secret_file: str | os.PathLike[str] | None = None) -> None:
        kind, where = resolve_address(address)
        credentials = tcp_credentials(secret_file) if kind == "tcp" else None
        self.address = where
        self.timeout = timeout
        self.registry = Registry(inline=(kind == "tcp"))
        self._broken: str | None = None
        sock: socket.socket | None = None
        try:
            if kind == "tcp":
                assert isinstance(where, tuple)
                sock = socket.create_connection(where, timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if credentials is not None:
                    authconn.client_socket(credentials, sock, plane=auth.Plane.TRAINER, me=auth.TRAINER,
                                           timeout=timeout)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(timeout)
                sock.connect(str(where))
        except AuthError as exc:
            if sock is not None:
                sock.close()
            raise TrainerAuthError(f"the node at {where}: {exc}") from None
        except OSError as exc:
            if sock is not None:
                sock.close()
            raise NodeGone(f"cannot reach the node at {where}: {exc}") from None
        self._sock = sock

    # ---- I/O ----------------------------------------------------------------------------------------

    def _recv_exactly(self, size: int, context: str) -> bytearray:
        """``size`` bytes, received in place (a TCP result payload is the whole model: no second copy)."""
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            try:
                n = self._sock.recv_into(view[got:])
            except TimeoutError:
                raise TrainerTimeout(f"{context}: no answer from the node at {self.address} within "
                                     f"{self.timeout:g} s") from None
            except OSError as exc:
                raise NodeGone(f"{context}: the node at {self.address} is gone: {exc}") from None
            if n == 0:
                raise NodeGone(f"{context}: the node at {self.address} closed the connection")
            got += n
        return buf

    def _call(self, request: tw.Message, payload: bytes, expected: type[tw.Message],
              context: str) -> tuple[tw.Message, bytes | bytearray]:
        if self._broken is not None:
            raise NodeGone(f"{context}: this connection to the node at {self.address} is unusable after: "
                           f"{self._broken}")
        try:
            try:
                self._sock.sendall(tw.encode(request, len(payload)))
                if payload:
                    self._sock.sendall(payload)
            except TimeoutError:
                raise TrainerTimeout(f"{context}: the node at {self.address} did not accept the request within "
                                     f"{self.timeout:g} s") from None
            except OSError as exc:
                raise NodeGone(f"{context}: the node at {self.address} is gone: {exc}") from None
            while True:
                header_len, payload_len = tw.decode_prefix(self._recv_exactly(tw.PREFIX.size, context),
                                                           max_payload=1 << 40)
                reply = tw.decode(self._recv_exactly(header_len, context))
                data = self._recv_exactly(payload_len, context) if payload_len else b""
                if not isinstance(reply, tw.ModelWanted):
                    break
                offer, model = self.registry.model_payload(reply)
                self._sock.sendall(tw.encode(offer, len(model)))
                self._sock.sendall(model)
        except BaseException as exc:
            # A reply may still be on its way (also after Ctrl-C mid-request): later requests would read it
            # as theirs. Start over instead.
            self._broken = str(exc) if isinstance(exc, TrainerError) else f"{context}: {type(exc).__name__}"
            with contextlib.suppress(OSError):
                self._sock.close()
            raise
        raise_for(reply, expected, context)
        return reply, data

    # ---- verbs --------------------------------------------------------------------------------------

    def init(self, tensors: Mapping[str, np.ndarray], *, compression: str = "none",
             votes: int = 0, bits: int = 0, gia_reuse: int = 1) -> dict[str, np.ndarray]:
        """Register ``tensors``; returns the initial values every DC agrees on. Integer tensors (uint8, int8,
        int16, int32) are summed exactly and come back as int64 sums. ``compression="fp16"`` has the nodes
        send float chunks as float16 (every DC must register alike); FediAC and top-k run in the trainer
        (``netstorm.compression.session``) and say so here, with FediAC's threshold ``votes``, which the
        roots then apply to the vote counts, and its ``bits`` and ``gia_reuse`` (a gateway's LAN tier plans
        its rounds by them)."""
        request, payload, path = self.registry.prepare_init(tensors, compression, votes, bits, gia_reuse)
        try:
            reply, data = self._call(request, payload, tw.InitReply, "init")
        finally:
            release_init(path)
            self.registry.handed_over()
        return self.registry.accept_init(reply, list(tensors), data)

    def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = False, *,
                  keep: Collection[str] | None = None) -> dict[str, np.ndarray]:
        """One synchronous iteration: the sum (or mean over ``num_workers``) of every tensor given, or of
        those named in ``keep`` (a caller that needs a few of them is handed no copies of the rest)."""
        names, payload = self.registry.prepare_push(tensors)
        context = f"push_pull of iteration {self.iteration + 1}"
        reply, data = self._call(tw.PullRequest(names, average, push=True), payload, tw.PullReply, context)
        return self.registry.accept_result(reply, names, data, keep)

    def push(self, name: str, value: np.ndarray) -> None:
        """This DC's value of one tensor for its next iteration (returns once the node has it)."""
        names, payload = self.registry.prepare_push({name: value})
        self._call(tw.PushRequest(names), payload, tw.PushReply, f"push of {name!r}")

    def pull(self, name: str, average: bool = False) -> np.ndarray:
        """The sum (or mean) of one tensor from its oldest iteration not yet pulled."""
        self.registry.key(name)
        reply, data = self._call(tw.PullRequest((name,), average), b"", tw.PullReply, f"pull of {name!r}")
        return self.registry.accept_result(reply, (name,), data)[name]

    def close(self) -> None:
        """Say Bye (the node then knows this trainer left on purpose, not died) and close."""
        with contextlib.suppress(OSError):
            if self._broken is None:
                self._sock.sendall(tw.encode(tw.Bye()))
            self._sock.close()
        self.registry.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str | os.PathLike[str] | None = None, *, timeout: float = DEFAULT_TIMEOUT,
            secret_file: str | os.PathLike[str] | None = None) -> Client:
    """A client of this DC's general node: a Unix socket path, "tcp://host:port", or NETSTORM_SOCKET.
    Over TCP to a node with a job secret, the client proves ``secret_file`` (default: the file
    NETSTORM_SECRET_FILE names); a Unix socket is guarded by its file permissions instead.
    A LAN worker behind a DC gateway uses ``netstorm.connect_edge("edge://GATEWAY:PORT?worker=I")``."""
    if os.fspath(address if address is not None else os.environ.get(ENV_SOCKET, "")).startswith("edge://"):
        raise TrainerError("edge:// addresses are for netstorm.connect_edge (the LAN worker's edge mode)")
    return Client(address, timeout=timeout, secret_file=secret_file)
