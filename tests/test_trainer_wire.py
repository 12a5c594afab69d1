"""Trainer <-> node messages: exact round trips and typed rejections."""

from __future__ import annotations

import msgpack
import pytest

from netstorm import trainer_wire as tw
from netstorm.errors import ErrorCode, TrainerProtocolError

MESSAGES: list[tw.Message] = [
    tw.InitRequest((("w", (3, 4), "float32"), ("b", (), "float16")), "/dev/shm/x"),
    tw.InitReply(3, 0, 9, "abcd"),
    tw.PushRequest(("w", "b")),
    tw.PushReply(7),
    tw.PullRequest(("w",), True),
    tw.PullRequest(("w", "b"), False, push=True),
    tw.PullReply(7, ("w", "b"), 4),
    tw.ErrorReply(ErrorCode.TIMEOUT, "iteration 7 timed out"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.TYPE)
def test_round_trip(message: tw.Message):
    frame = tw.encode(message, 12)
    header_len, payload_len = tw.decode_prefix(frame[:tw.PREFIX.size], max_payload=100)
    assert payload_len == 12 and header_len == len(frame) - tw.PREFIX.size
    assert tw.decode(frame[tw.PREFIX.size:]) == message


def test_rejections():
    def packed(obj: object) -> bytes:
        return msgpack.packb(obj)
    cases = {
        "not valid msgpack": b"\xc1",
        "must be a map": packed([1]),
        "version 2": packed({"v": 2, "type": "push", "names": []}),
        "version None": packed({"type": "push", "names": []}),
        "unknown message type 'reboot'": packed({"v": 1, "type": "reboot"}),
        r"unknown message type \[1\]": packed({"v": 1, "type": [1]}),
        "push: .*unknown field `force`": packed({"v": 1, "type": "push", "names": [], "force": True}),
        r"push: Expected `str`, got `int` - at `\$\.names\[0\]`": packed({"v": 1, "type": "push", "names": [1]}),
        r"pull: Expected `bool`, got `int` - at `\$\.average`":
            packed({"v": 1, "type": "pull", "names": [], "average": 1}),
        r"init: Expected `int`, got `bool` - at `\$\.tensors\[0\]\[1\]\[0\]`":
            packed({"v": 1, "type": "init", "tensors": [["w", [True], "float32"]], "shm": ""}),
        r"error: Invalid enum value 'weird' - at `\$\.kind`":
            packed({"v": 1, "type": "error", "kind": "weird", "message": ""}),
    }
    for message, data in cases.items():
        with pytest.raises(TrainerProtocolError, match=message):
            tw.decode(data)
    with pytest.raises(TrainerProtocolError, match="exceeds the registered model"):
        tw.decode_prefix(tw.PREFIX.pack(10, 101), max_payload=100)
