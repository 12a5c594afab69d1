"""Making slab room for bpf_timer allocations: the size classes, the kernel's BTF, the pinned CPU."""

from __future__ import annotations

import os

import pytest

from bpf.timer_memory import SlabRoom, kmalloc_class, pipes_share_the_timer_class, struct_size


@pytest.mark.parametrize(("size", "klass"), [(1, 8), (8, 8), (9, 16), (64, 64), (65, 96), (96, 96), (97, 128),
                                             (128, 128), (129, 192), (144, 192), (176, 192), (192, 192),
                                             (193, 256), (257, 512), (4096, 4096)])
def test_kmalloc_classes_by_hand(size: int, klass: int) -> None:
    assert kmalloc_class(size) == klass


def test_a_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        kmalloc_class(0)


@pytest.mark.bcc
def test_struct_sizes_come_from_the_kernel_btf() -> None:
    timer, pipe, cb = struct_size("bpf_hrtimer"), struct_size("pipe_inode_info"), struct_size("bpf_async_cb")
    assert timer is not None and pipe is not None and cb is not None
    assert timer > cb   # a bpf_hrtimer embeds the common async callback part and adds an hrtimer
    assert struct_size("no_such_struct_in_any_kernel") is None
    assert pipes_share_the_timer_class() == (kmalloc_class(timer) == kmalloc_class(pipe))


def test_the_room_pins_one_cpu_and_restores_the_affinity() -> None:
    before = os.sched_getaffinity(0)
    with SlabRoom() as room:
        assert os.sched_getaffinity(0) == {min(before)}
        made = room.make(pipes=8)
        assert made == room.usable
        assert room.rounds == int(made)
    assert os.sched_getaffinity(0) == before
