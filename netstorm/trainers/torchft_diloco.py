"""One DC's torchft DiLoCo trainer: ``python -m netstorm.trainers.torchft_diloco --lighthouse ADDR ...``.

The peer of ``diloco_run``: the same task, data shard, AdamW inner steps, Nesterov outer SGD, seeds,
schedule options and JSON lines (``diloco_options``), but synchronized by torchft: a ``Manager`` of one
replica group per DC (its Lighthouse at ``--lighthouse``, ``ProcessGroupGloo`` between the DCs, or with
``--socket`` NetStorm's ``ProcessGroupNetStormFT`` through the DC's node) and ``torchft.local_sgd.DiLoCo``.
Each ``sync`` line carries the digest of the global state it started from (as ``diloco_run``'s) and
``digest_after``, the digest after its outer step, computed as NetStorm's ``GlobalState.digest``. Where
torchft has no counterpart an option is refused or mapped, and ``start`` says how (``torchft_options``
and ``fragment_groups``; the note on the peer run lists the differences).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from netstorm.diloco.schedule import Schedule, fragment_bounds
from netstorm.errors import ConfigError
from netstorm.trainers.diloco_options import add_options, emit, global_digest


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(prog="python -m netstorm.trainers.torchft_diloco")
    out.add_argument("--lighthouse", required=True, help="torchft's Lighthouse (http://HOST:PORT)")
    out.add_argument("--replica-id", default=None, help="this DC's replica group (default: dc<INDEX>)")
    out.add_argument("--hostname", default=None,
                     help="the address the other DCs reach this one at (default: the host's name)")
    out.add_argument("--socket", default=None,
                     help="run torchft's process group through this DC's NetStorm node (ProcessGroupNetStormFT) "
                          "instead of ProcessGroupGloo")
    add_options(out)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def torchft_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``torchft.local_sgd.DiLoCo`` for this command line.

    H, P and tau are torchft's ``sync_every``, the number of fragments and ``fragment_sync_delay``; the
    merge is ``fragment_update_alpha`` 0 (NetStorm's default: the fragment takes the global values).
    Any outer compression becomes ``should_quantize``, torchft's only one (row-wise 8-bit, Triton
    kernels; without Triton its Manager sends float32). Error feedback and a straggler deadline have no
    torchft counterpart and are refused rather than silently dropped."""
    if args.error_feedback:
        raise ConfigError("torchft's DiLoCo has no error feedback for its quantized all-reduce")
    if args.straggler_s is not None:
        raise ConfigError("torchft's DiLoCo has no straggler deadline (a late replica fails the quorum's "
                          "timeout instead)")
    Schedule(args.sync_every, args.fragments, args.fragment_delay)  # NetStorm's checks: torchft's are alike
    return {"sync_every": args.sync_every, "fragment_sync_delay": args.fragment_delay,
            "fragment_update_alpha": 0.0, "should_quantize": args.outer_compression != "none"}


def fragment_groups(sizes: list[int], fragments: int) -> list[tuple[int, int]]:
    """Parameter index ranges [a, b), one per fragment: torchft's fragments are modules, so a fragment
    holds whole tensors; each cut falls at the tensor boundary nearest NetStorm's (``fragment_bounds``)
    and every fragment keeps at least one tensor."""
    if fragments > len(sizes):
        raise ConfigError(f"{len(sizes)} parameter tensors cannot form {fragments} torchft fragments")
    bounds = fragment_bounds(sum(sizes), fragments)
    ends, total = [], 0
    for size in sizes:
        total += size
        ends.append(total)
    cuts = [0]
    for p in range(1, fragments):
        target = bounds[p][0]
        lo, hi = cuts[-1] + 1, len(sizes) - (fragments - p)
        cuts.append(min(range(lo, hi + 1), key=lambda i: abs(ends[i - 1] - target)))
    cuts.append(len(sizes))
    return list(itertools.pairwise(cuts))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    mapped = torchft_options(args)
    import torch
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import IS_TRITON_AVAILABLE, Manager

    from netstorm.trainers.realdata import build

    torch.set_num_threads(args.threads)
    task = build(args.train, args.dc_index, args.dcs, args.seed, args.batch)
    model = task.model
    params = list(model.parameters())
    groups = fragment_groups([p.numel() for p in params], args.fragments)
    fragments = [torch.nn.ParameterList(params[a:b]) for a, b in groups]
    inner = torch.optim.AdamW(model.parameters(), lr=task.lr)
    outers = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                              nesterov=args.outer_momentum > 0) for f in fragments]
    timeout = timedelta(seconds=args.timeout)
    steps = [0]

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict(), "step": steps[0]}

    def load_state_dict(state: dict[str, Any]) -> None:  # a replica that heals from a live one
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        steps[0] = int(state["step"])

    # the replica group's store: one process per DC, so this process hosts it
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = timed_group(timeout, args.hostname, args.socket)
    replica_id = args.replica_id or f"dc{args.dc_index}"
    manager = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
                      checkpoint_transport=checkpoint_transport(timeout, args.hostname),
                      use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=args.lighthouse, replica_id=replica_id,
                      hostname=args.hostname or socket.gethostname(), init_sync=False)
    dl = DiLoCo(manager, fragments, inner, outers, pin_memory=False, **mapped)
    probe = Probe(dl, manager, pg, outers, args.outer_momentum > 0)
    evaluator = copy.deepcopy(model)  # its parameters are views of the global ones torchft keeps
    with torch.no_grad():
        for p, value in zip(evaluator.parameters(), probe.global_params, strict=True):
            p.data = value
    with open(args.out, "a", encoding="utf-8") as out, dl:
        emit(out, "start", dc=args.dc_index, replica_id=replica_id, system="torchft", train=args.train,
             parameters=task.parameters, bytes=4 * task.parameters, joined_at=None, step=0, t=time.time(),
             torchft_options=mapped, quantized=mapped["should_quantize"] and IS_TRITON_AVAILABLE,
             fragment_groups=[list(g) for g in groups], process_group=pg.getBackendName(),
             fragment_elements=[sum(p.numel() for p in f.parameters()) for f in fragments])
        start = time.monotonic()
        compute = eval_s = 0.0
        seen = 0
        while steps[0] < args.steps:
            t0 = time.monotonic()
            x, y = task.batch(steps[0] + 1)
            loss = task.loss(model, x, y)
            loss.backward()
            remaining = args.compute_s - (time.monotonic() - t0)
            if remaining > 0:
                time.sleep(remaining)  # the padding --compute-s asks for: a GPU-class step's wall time
            probe.hook_s = 0.0
            steps[0] += 1
            inner.step()  # torchft's DiLoCo runs its part of the schedule in this step's hook
            inner.zero_grad()
            compute += (time.monotonic() - t0) - probe.hook_s
            for record in probe.records[seen:]:
                emit(out, "sync", **record)
            seen = len(probe.records)
            if probe.eval_due:
                probe.eval_due = False
                e0 = time.monotonic()
                eval_loss, accuracy = task.evaluate(evaluator)
                eval_s += time.monotonic() - e0
                emit(out, "eval", t_s=time.monotonic() - start - eval_s, step=steps[0], loss=eval_loss,
                     accuracy=accuracy)
        wall = time.monotonic() - start - eval_s
        for fragment in dl._fragments:  # a sync sent and not yet due: wait for it, leave it unapplied
            for work in fragment._allreduce_work:
                work.wait()
        emit(out, "end", steps=steps[0], wall_s=wall, compute_s=compute,
             compute_fraction=compute / wall if wall else None, digest=probe.digest().hex(),
             outer_steps=manager.current_step())
    manager.shutdown(wait=False)
    pg.shutdown()
    return 0


def timed_group(timeout: timedelta, hostname: str | None, node: str | None) -> Any:
    """torchft's ``ProcessGroupGloo`` (or, given this DC's ``node``, NetStorm's ``ProcessGroupNetStormFT``)
    that notes when each all-reduce completes (a sync's seconds) and, given ``hostname``, advertises that
    host for its rendezvous store instead of the machine's name."""
    base: Any
    if node is None:
        from torchft.process_group import ProcessGroupGloo
        base = ProcessGroupGloo
    else:
        import os

        from netstorm.torch.torchft_group import ProcessGroupNetStormFT
        base = ProcessGroupNetStormFT
        os.environ["NETSTORM_SOCKET"] = node  # what the netstorm backend joins

    class Timed(base):
        def __init__(self) -> None:
            super().__init__(timeout=timeout)
            self.done_at = 0.0

        def allreduce(self, tensors: Any, opts: Any) -> Any:
            work = super().allreduce(tensors, opts)
            work.get_future().then(self._done)
            return work

        def _done(self, _future: Any) -> None:
            self.done_at = time.monotonic()

        def wan_bytes(self) -> int | None:
            """Bytes this DC's node queued on WAN links so far (None on gloo: torchft does not count them)."""
            return None if node is None or self._pg is None else int(self._pg.stats().wan_bytes)

        def contributors(self) -> list[int] | None:
            """The DCs' node ids the newest sum held (None on gloo)."""
            return None if node is None or self._pg is None else list(self._pg.stats().contributors)

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            if node is not None or hostname is None:
                return super()._create_pg(store, rank, world_size)
            return bound_gloo(self, store, rank, world_size, hostname)

        def get_reconfigure_handle(self) -> str:
            handle: str = super().get_reconfigure_handle()
            if hostname is None:
                return handle
            import json
            fields = json.loads(handle)
            fields["store"] = f"{hostname}:{fields['store'].rsplit(':', 1)[1]}"
            return json.dumps(fields)

    return Timed()


def bound_gloo(wrapper: Any, store: Any, rank: int, world_size: int, hostname: str) -> Any:
    """torchft's ``ProcessGroupGloo._create_pg`` with gloo's device bound to ``hostname``: by default gloo
    advertises what the machine's name resolves to, a loopback address inside a DC's namespace, so every
    rank would dial its own namespace and the full mesh never connects."""
    import torch
    import torch.distributed as dist

    gloo: Any = dist.ProcessGroupGloo  # private options API: typed loosely on purpose
    options = gloo._Options()
    options._devices = [gloo.create_device(hostname=hostname)]
    options._timeout = wrapper._timeout
    backend = gloo(store, rank, world_size, options)
    backend._set_sequence_number_for_group()
    if wrapper._global_ranks:
        backend.options.global_ranks_in_group = wrapper._global_ranks
    if wrapper._group_rank and wrapper._group_world_size:
        backend.options.group_name = f"torchft_{wrapper._uuid}_rank_{wrapper._group_rank % wrapper._group_world_size}"
    group = dist.ProcessGroup(store, rank, world_size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def checkpoint_transport(timeout: timedelta, hostname: str | None) -> Any:
    """torchft's HTTP checkpoint transport (how a replica heals), advertising ``hostname`` when given:
    its own address is the machine's name, which other namespaces cannot reach."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class Advertised(HTTPTransport):
        def address(self) -> str:
            if hostname is None:
                return str(super().address())
            return f"http://{hostname}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return Advertised(timeout=timeout, num_chunks=0)


class Probe:
    """Wraps the DiLoCo's hook and each fragment's prepare and perform: seconds, digests and records."""

    def __init__(self, dl: Any, manager: Any, pg: Any, outers: list[Any], momentum: bool) -> None:
        self.dl, self.manager, self.pg, self.outers, self.momentum = dl, manager, pg, outers, momentum
        self.global_params: list[Any] = [f.original_parameters[name] for f in dl._fragments
                                         for name, _ in f._model_fragment.named_parameters()]
        self.records: list[dict[str, Any]] = []
        self.hook_s = 0.0
        """Seconds this inner step spent in torchft's hook (quorum, sends, waits, outer step): not compute."""
        self.eval_due = False
        self.index = 0
        self._failures = 0
        self._sent: dict[int, tuple[float, float, str, int | None]] = {}
        hook = dl._step_post_hook

        def timed_hook(*a: Any) -> None:
            began = time.monotonic()
            try:
                hook(*a)
            finally:
                self.hook_s += time.monotonic() - began
        dl._step_post_hook = timed_hook  # read by DiLoCo.__enter__, when it registers the hook
        for i, fragment in enumerate(dl._fragments):
            fragment.prepare_sync = self._prepare(i, fragment.prepare_sync)
            fragment.perform_sync = self._perform(i, fragment.perform_sync)

    def digest(self) -> bytes:
        buffers = []
        if self.momentum:
            for outer in self.outers:
                for group in outer.param_groups:
                    for p in group["params"]:
                        buffer = outer.state.get(p, {}).get("momentum_buffer")
                        buffers.append(buffer if buffer is not None else p.new_zeros(p.shape))
        return global_digest(self.global_params, buffers, self.manager.current_step())

    def _prepare(self, fragment: int, prepare: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            self._sent[fragment] = (time.monotonic(), time.time(), self.digest().hex(), self.pg.wan_bytes())
            prepare()
        return run

    def _perform(self, fragment: int, perform: Callable[[], bool]) -> Callable[[], bool]:
        def run() -> bool:
            waited = time.monotonic()
            committed = perform()
            done = time.monotonic()
            began, wall, before, wan = self._sent.pop(fragment)
            wan_now = self.pg.wan_bytes()
            arrived = self.pg.done_at if self.pg.done_at >= began else done
            self.records.append({
                "index": self.index, "fragment": fragment, "seconds": arrived - began, "began": wall,
                "contributors": self.pg.contributors(),
                "weight": self.manager.num_participants(), "left_out": not self.manager.is_participating(),
                "attempts": self._failures + 1,
                "wan_bytes": None if wan is None or wan_now is None else wan_now - wan, "digest": before,
                "committed": committed, "digest_after": self.digest().hex(), "wait_s": done - waited})
            self.index += 1
            self._failures = 0 if committed else self._failures + 1
            if committed and fragment == len(self.dl._fragments) - 1:
                self.eval_due = True
            return committed
        return run


if __name__ == "__main__":
    sys.exit(main())
