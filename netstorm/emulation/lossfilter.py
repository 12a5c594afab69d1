"""Packet loss without netem: a tc BPF classifier on a veth's egress that drops with probability p.

bcc compiles one SCHED_CLS program per distinct loss probability (the threshold is a compile-time
constant compared against ``bpf_get_prandom_u32``). ``tc`` attaches programs by pinned path, so the
program is pinned in a bpffs mounted for this run only, attached with ``tc filter ... bpf da
object-pinned`` to every interface that needs it, then unpinned and the mount removed: the attached
filters keep the program alive until their namespace goes away.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from netstorm.emulation.errors import EmulationError
from netstorm.emulation.netns import tc_batch

PROGRAM = r"""
#include <uapi/linux/pkt_cls.h>

int netstorm_loss(struct __sk_buff *skb) {
    if (bpf_get_prandom_u32() < LOSS_THRESHOLD)
        return TC_ACT_SHOT;
    return TC_ACT_OK;
}
"""


def threshold(probability: float) -> int:
    """The u32 below which a uniform random draw means "drop": round(p * 2**32)."""
    if not 0.0 < probability < 1.0:
        raise EmulationError(f"loss probability must be in (0, 1), got {probability}")
    return min(2**32 - 1, round(probability * 2**32))


def netem_available(namespace: str) -> bool:
    """Whether this kernel has netem: ask for a netem qdisc on ``lo`` of one of the run's own namespaces."""
    probe = subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"],
                           capture_output=True, text=True)
    if probe.returncode == 0:
        subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return True
    return False


def bcc_status() -> str | None:
    """None when bcc can be imported, else why not."""
    try:
        import bcc  # noqa: F401
    except Exception as exc:  # ImportError or a broken libbcc
        return f"bcc unavailable: {exc}"
    return None


def attach(targets: Mapping[tuple[str, str], float], bpf_dir: Path,
           on_mount: Callable[[Path], None] | None = None) -> None:
    """Drop packets leaving each (namespace, device) in ``targets`` with its probability.

    ``bpf_dir`` is created and a private bpffs mounted on it for the duration (``on_mount`` is told
    first, so a registry can record it for cleanup after a crash).
    """
    if not targets:
        return
    from bcc import BPF, libbcc

    bpf_dir.mkdir(parents=True, exist_ok=True)
    if on_mount is not None:
        on_mount(bpf_dir)
    _mount(bpf_dir)
    try:
        pinned: dict[int, Path] = {}
        modules = []
        for probability in sorted(set(targets.values())):
            limit = threshold(probability)
            module = BPF(text=PROGRAM.encode(), cflags=[f"-DLOSS_THRESHOLD={limit}U"])
            fn = module.load_func(b"netstorm_loss", BPF.SCHED_CLS)
            path = bpf_dir / f"loss_{limit}"
            if libbcc.lib.bpf_obj_pin(fn.fd, str(path).encode()) != 0:
                raise EmulationError(f"pin the loss filter at {path}: {os.strerror(abs(_errno()))}")
            pinned[limit] = path
            modules.append(module)
        by_namespace: dict[str, list[str]] = {}
        for (namespace, device), probability in sorted(targets.items()):
            path = pinned[threshold(probability)]
            by_namespace.setdefault(namespace, []).extend([
                f"qdisc add dev {device} clsact",
                f"filter add dev {device} egress bpf da object-pinned {path}",
            ])
        for namespace, lines in by_namespace.items():
            tc_batch(lines, namespace=namespace, what=f"attach the loss filter in {namespace}")
        for module in modules:
            module.cleanup()
    finally:
        release(bpf_dir)


DROP_ALL = 2**32 - 1
"""The threshold of a filter that drops every packet (all but one in 2**32 draws)."""


def attach_drop(namespace: str, device: str, bpf_dir: Path, *, pref: int) -> None:
    """Drop every packet arriving on ``device`` (ingress, filter preference ``pref``): a link gone down.
    ``tc filter del dev DEVICE ingress pref PREF`` brings it back. The bpffs is mounted only meanwhile."""
    from bcc import BPF, libbcc

    bpf_dir.mkdir(parents=True, exist_ok=True)
    _mount(bpf_dir)
    try:
        module = BPF(text=PROGRAM.encode(), cflags=[f"-DLOSS_THRESHOLD={DROP_ALL}U"])
        fn = module.load_func(b"netstorm_loss", BPF.SCHED_CLS)
        path = bpf_dir / "drop_all"
        if libbcc.lib.bpf_obj_pin(fn.fd, str(path).encode()) != 0:
            raise EmulationError(f"pin the drop filter at {path}: {os.strerror(abs(_errno()))}")
        subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "clsact"], capture_output=True)
        tc_batch([f"filter add dev {device} ingress pref {pref} bpf da object-pinned {path}"], namespace=namespace,
                 what=f"drop every packet arriving on {device} in {namespace}")
        module.cleanup()
    finally:
        release(bpf_dir)


def release(bpf_dir: Path) -> None:
    """Unpin everything under ``bpf_dir``, unmount it and remove it (absent is fine)."""
    if not bpf_dir.exists():
        return
    if os.path.ismount(bpf_dir):
        for entry in bpf_dir.iterdir():
            with contextlib.suppress(OSError):
                entry.unlink()
        subprocess.run(["umount", str(bpf_dir)], capture_output=True)
    with contextlib.suppress(OSError):
        bpf_dir.rmdir()


def _mount(bpf_dir: Path) -> None:
    proc = subprocess.run(["mount", "-t", "bpf", "bpf", str(bpf_dir)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulationError(f"mount a bpffs at {bpf_dir}: {proc.stderr.strip()}")


def _errno() -> int:
    import ctypes

    return ctypes.get_errno()
