"""Every wire's decoder against hostile input: it answers with its own typed error and nothing else,
never allocates for a length the input only declares, and error codes travel instead of words."""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netstorm import control, errors, frames, policywire
from netstorm import trainer_wire as tw
from netstorm.client import ERRORS, raise_for
from netstorm.control import ControlError, LayoutMismatch
from netstorm.errors import (
    ErrorCode,
    FrameError,
    IterationError,
    NetStormError,
    NodeGone,
    NonFinite,
    PeerLost,
    PolicyError,
    TooFarAhead,
    TrainerLimit,
    TrainerProtocolError,
    TrainerTimeout,
    UnknownTensor,
    WrongDtype,
    WrongShape,
)
from netstorm.policy import Policy
from netstorm.probe import LinkReport as ProbeLinkReport
from tests.test_control import SAMPLES as CONTROL_SAMPLES
from tests.test_trainer_wire import MESSAGES as TRAINER_SAMPLES

ROOT = Path(__file__).resolve().parent.parent

FRAME_SAMPLES: list[frames.Hello | frames.ChunkHeader | frames.ErrorFrame] = [
    frames.Hello(3, "abc"),
    frames.ErrorFrame("layout mismatch", ErrorCode.LAYOUT_MISMATCH),
    frames.ChunkHeader(iteration=7, chunk=3, root=2, phase=frames.Phase.UP, src=4, dst=5, origin=4, final=2,
                       version=11, t_send=1234.5, is_aux=True, path=(4, 5, 2), count=10),
]

# msgpack-able values of every kind, including the ones a schema must refuse (bools for ints, NaN,
# huge integers, bytes, nested containers).
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def control_body(message: control.Message) -> bytes:
    return control.encode(message)[control.LENGTH.size:]


def frame_header(header: frames.Hello | frames.ChunkHeader | frames.ErrorFrame) -> bytes:
    return header.encode()[frames.PREFIX_SIZE:]


def trainer_header(message: tw.Message) -> bytes:
    return tw.encode(message)[tw.PREFIX.size:]


def decode_frame_header(kind: frames.Kind, data: bytes) -> object:
    payload = 40 if kind is frames.Kind.CHUNK else 0
    return frames.decode_header(frames.Prefix(kind, len(data), payload), data)


# --- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("header", FRAME_SAMPLES, ids=lambda h: type(h).__name__)
def test_every_frame_header_round_trips(header: frames.Hello | frames.ChunkHeader | frames.ErrorFrame) -> None:
    assert decode_frame_header(header.KIND, frame_header(header)) == header


def test_an_error_carries_its_code_on_every_wire() -> None:
    assert control.decode(control_body(control.Error("no", ErrorCode.NO_POLICY))).code is ErrorCode.NO_POLICY  # type: ignore[attr-defined]
    assert msgpack.unpackb(control_body(control.Error("no")))["code"] == "protocol"
    reply = tw.decode(trainer_header(tw.ErrorReply(ErrorCode.UNKNOWN_TENSOR, "unknown tensor 'x'")))
    assert isinstance(reply, tw.ErrorReply) and reply.kind is ErrorCode.UNKNOWN_TENSOR
    frame = decode_frame_header(frames.Kind.ERROR, frame_header(frames.ErrorFrame("x", ErrorCode.MALFORMED)))
    assert isinstance(frame, frames.ErrorFrame) and frame.code is ErrorCode.MALFORMED


def test_one_link_report_for_probe_control_and_collector() -> None:
    assert ProbeLinkReport is control.LinkReport
    report = ProbeLinkReport(1, 2, 10.5, 3.0, 4, warm=False)
    assert control.decode(control_body(report)) == report


def test_a_pull_request_that_pushes_first_is_a_pull_request() -> None:
    assert not hasattr(tw, "PushPullRequest")
    push_pull = tw.PullRequest(("w",), True, push=True)
    assert tw.decode(trainer_header(push_pull)) == push_pull
    plain = msgpack.unpackb(trainer_header(tw.PullRequest(("w",), True)))
    assert "push" not in plain, "a pull that does not push is encoded as before push existed"


def test_frozen_structs_refuse_assignment_and_replace_keeps_the_rest() -> None:
    header = FRAME_SAMPLES[2]
    assert isinstance(header, frames.ChunkHeader)
    with pytest.raises(AttributeError):
        header.src = 9  # type: ignore[misc]
    hop = header.hop(5, 2, 99.0)
    assert (hop.src, hop.dst, hop.t_send, hop.iteration, hop.path) == (5, 2, 99.0, 7, (4, 5, 2))


# --- error codes -----------------------------------------------------------------------------------


def test_every_error_class_names_a_code() -> None:
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, NetStormError)]
    assert all(isinstance(c.code, ErrorCode) for c in classes)
    assert UnknownTensor.code is ErrorCode.UNKNOWN_TENSOR and issubclass(UnknownTensor, errors.LayoutError)
    assert LayoutMismatch.code is ErrorCode.LAYOUT_MISMATCH
    assert FrameError.code is ErrorCode.MALFORMED


@pytest.mark.parametrize(("code", "raised"), [
    (ErrorCode.UNKNOWN_TENSOR, UnknownTensor), (ErrorCode.WRONG_SHAPE, WrongShape),
    (ErrorCode.WRONG_DTYPE, WrongDtype), (ErrorCode.NODE_GONE, NodeGone), (ErrorCode.TIMEOUT, TrainerTimeout),
    (ErrorCode.PEER_LOST, PeerLost), (ErrorCode.PEER_GONE, PeerLost), (ErrorCode.TRAINER_LIMIT, TrainerLimit),
    (ErrorCode.TOO_FAR_AHEAD, TooFarAhead), (ErrorCode.NON_FINITE, NonFinite),
    (ErrorCode.ITERATION_FAILED, IterationError), (ErrorCode.INTERNAL, IterationError),
    (ErrorCode.PROTOCOL, TrainerProtocolError), (ErrorCode.MALFORMED, TrainerProtocolError),
    (ErrorCode.LAYOUT_MISMATCH, errors.LayoutMismatch), (ErrorCode.MODEL_TOO_LARGE, errors.ModelTooLarge),
    (ErrorCode.NOT_MEMBER, TrainerProtocolError),
])
def test_a_trainer_raises_the_class_of_the_code_whatever_the_words(code: ErrorCode, raised: type) -> None:
    with pytest.raises(raised) as info:
        raise_for(tw.ErrorReply(code, "words that name no class"), tw.PushReply, "push")
    assert type(info.value) is raised and str(info.value) == "words that name no class"
    assert set(ERRORS) <= set(ErrorCode)


def test_a_control_refusal_raises_the_class_of_its_code() -> None:
    mismatch = control.refusal(control.Error("words", ErrorCode.LAYOUT_MISMATCH), "scheduler: ")
    assert type(mismatch) is LayoutMismatch and str(mismatch) == "scheduler: words"
    assert type(control.refusal(control.Error("layout mismatch: said in words only"))) is ControlError


def test_no_code_reads_an_error_by_its_words() -> None:
    pattern = re.compile(r"in str\((exc|e|error|err)\)|\.message\.startswith\(|in reply\.message")
    offenders = [f"{path.relative_to(ROOT)}:{n}" for package in ("netstorm", "node", "scheduler", "bpf")
                 for path in sorted((ROOT / package).rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


# --- fuzzing: random bytes -------------------------------------------------------------------------


def _only(error: type[Exception], decode: Callable[[Any], object], data: Any) -> None:
    """``decode(data)`` returns or raises ``error``; any other exception fails the test."""
    with contextlib.suppress(error):
        decode(data)


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_raise_only_typed_errors(data: bytes) -> None:
    _only(ControlError, control.decode, data)
    _only(TrainerProtocolError, tw.decode, data)
    for kind in frames.Kind:
        _only(FrameError, lambda d, k=kind: decode_frame_header(k, d), data)  # type: ignore[misc]
    _only(FrameError, lambda d: frames.decode_prefix(d, max_frame_bytes=1 << 20), data)


@FUZZ
@given(value=VALUES)
def test_random_msgpack_values_raise_only_typed_errors(value: Any) -> None:
    data = msgpack.packb(value)
    _only(ControlError, control.decode, data)
    _only(TrainerProtocolError, tw.decode, data)
    for kind in frames.Kind:
        _only(FrameError, lambda d, k=kind: decode_frame_header(k, d), data)  # type: ignore[misc]
    if isinstance(value, dict):
        _only(PolicyError, Policy.from_wire, value)


# --- fuzzing: structurally valid messages with one wrong value ------------------------------------------


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(data, dict):
        for key, value in data.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            out += _paths(value, (*prefix, i))
    return out


def _replaced(body: bytes, where: int, value: Any) -> bytes:
    data = msgpack.unpackb(body, strict_map_key=False)
    paths = _paths(data)[1:]
    if not paths:
        return msgpack.packb(value)
    path = paths[where % len(paths)]
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return msgpack.packb(data)


@FUZZ
@given(which=st.integers(min_value=0), where=st.integers(min_value=0), value=VALUES)
def test_control_messages_with_a_wrong_value_raise_only_control_errors(which: int, where: int, value: Any) -> None:
    data = _replaced(control_body(CONTROL_SAMPLES[which % len(CONTROL_SAMPLES)]), where, value)
    try:
        message = control.decode(data)
    except ControlError:
        return
    assert control_body(control.decode(control_body(message))) == control_body(message)  # NaN != NaN


@FUZZ
@given(which=st.integers(min_value=0), where=st.integers(min_value=0), value=VALUES)
def test_trainer_messages_with_a_wrong_value_raise_only_protocol_errors(which: int, where: int, value: Any) -> None:
    data = _replaced(trainer_header(TRAINER_SAMPLES[which % len(TRAINER_SAMPLES)]), where, value)
    try:
        message = tw.decode(data)
    except TrainerProtocolError:
        return
    assert trainer_header(tw.decode(trainer_header(message))) == trainer_header(message)


@FUZZ
@given(which=st.integers(min_value=0), where=st.integers(min_value=0), value=VALUES)
def test_frame_headers_with_a_wrong_value_raise_only_frame_errors(which: int, where: int, value: Any) -> None:
    header = FRAME_SAMPLES[which % len(FRAME_SAMPLES)]
    data = _replaced(frame_header(header), where, value)
    try:
        decoded = decode_frame_header(header.KIND, data)
    except FrameError:
        return
    assert isinstance(decoded, frames.Hello | frames.ChunkHeader | frames.ErrorFrame)
    if isinstance(decoded, frames.ChunkHeader):
        assert decoded.iteration >= 0 and decoded.count >= 0 and math.isfinite(decoded.t_send)
    assert frame_header(decode_frame_header(header.KIND, frame_header(decoded))) == frame_header(decoded)  # type: ignore[arg-type]


# --- declared lengths --------------------------------------------------------------------------------


DECLARED = {
    "str32 of 4 GiB": b"\xdb\xff\xff\xff\xff",
    "bin32 of 4 GiB": b"\xc6\xff\xff\xff\xff",
    "array32 of 4 G items": b"\xdd\xff\xff\xff\xff",
    "map32 of 4 G pairs": b"\xdf\xff\xff\xff\xff",
}


def _in_field(prefix: dict[str, Any], name: str, declared: bytes) -> bytes:
    """A map whose last field ``name`` holds only the header of a value of huge declared length."""
    head = msgpack.packb(prefix)
    assert 0x80 <= head[0] <= 0x8E  # a fixmap: one more entry fits in its first byte
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb(name) + declared


CASES: list[tuple[str, type[Exception], Callable[[bytes], object], bytes]] = []
for _what, _declared in DECLARED.items():
    CASES += [
        (f"control frame: {_what}", ControlError, control.decode, _declared),
        (f"control field: {_what}", ControlError, control.decode,
         _in_field({"v": 1, "type": "register_ack", "config": {}, "scheduler_time": 0.0}, "members", _declared)),
        (f"policy in a reply: {_what}", ControlError, control.decode,
         _in_field({"v": 1, "type": "policy_reply", "iteration": 1, "version": 1}, "policy", _declared)),
        (f"trainer header: {_what}", TrainerProtocolError, tw.decode,
         _in_field({"v": 1, "type": "push"}, "names", _declared)),
        (f"chunk header: {_what}", FrameError, lambda d: decode_frame_header(frames.Kind.CHUNK, d),
         _in_field({"it": 1}, "path", _declared)),
        (f"hello: {_what}", FrameError, lambda d: decode_frame_header(frames.Kind.HELLO, d),
         _in_field({"node_id": 1}, "layout_hash", _declared)),
    ]


@pytest.mark.parametrize(("error", "decode", "data"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_declared_length_beyond_the_input_is_refused_without_allocating_it(
        error: type[Exception], decode: Callable[[bytes], object], data: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(error):
            decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, f"decoding {len(data)} bytes allocated {peak} bytes"


def test_input_nested_beyond_the_recursion_limit_is_a_typed_error() -> None:
    deep = b"\x91" * 100_000 + b"\x00"
    with pytest.raises(ControlError):
        control.decode(deep)
    with pytest.raises(ControlError):
        control.decode(_in_field({"v": 1, "type": "policy_reply", "iteration": 1, "version": 1}, "policy", deep))
    with pytest.raises(TrainerProtocolError):
        tw.decode(deep)
    with pytest.raises(FrameError):
        decode_frame_header(frames.Kind.CHUNK, deep)


def test_bounds_refuse_what_no_run_sends() -> None:
    with pytest.raises(ControlError, match=r"\$\.node_id"):
        control.decode(msgpack.packb({"v": 1, "type": "heartbeat", "node_id": -1, "t": 0.0}))
    with pytest.raises(TrainerProtocolError, match="length"):
        tw.decode(msgpack.packb({"v": 1, "type": "push", "names": ["x" * 5000]}))
    with pytest.raises(FrameError, match=r"\$\.layout_hash"):
        decode_frame_header(frames.Kind.HELLO, msgpack.packb({"node_id": 1, "layout_hash": "h" * 65}))
    with pytest.raises(PolicyError, match="wire version"):
        policywire.parse({**plan_wire(), "wire": 2})


def plan_wire() -> dict[str, Any]:
    from netstorm.planning.plan import plan
    return plan({(1, 2): 10.0, (2, 1): 10.0, (2, 3): 5.0, (3, 2): 5.0}).to_wire()
