"""torchft's process group on NetStorm: ``ProcessGroupNetStormFT()`` where a torchft user passes
``ProcessGroupGloo()`` to its ``Manager``, and the replica groups' collectives become sums at their DCs'
nodes (the ``netstorm`` backend, ``netstorm.torch.backend``). Requires torchft (the ``peers`` extra).

torchft's Manager reconfigures its group at every new quorum (``ProcessGroupWrapper.reconfigure`` with
the members' handles, in torchft/process_group.py); this wrapper's ``_create_pg`` then joins this DC's
node (``NETSTORM_SOCKET`` or the ``torch_socket`` option) as the rank and world torchft gave, leaving
the old connection first (its Bye frees the DC's place). The nodes keep their own membership: a new
quorum runs once every DC of the NetStorm job has a trainer at its node again, so a replica group lost
for good leaves the survivors' reconfigure waiting (docs: the note on the peer run).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

try:
    from torchft.process_group import ProcessGroupWrapper
except ImportError as exc:  # the peers extra is optional; say which one to install
    raise ImportError(f"netstorm.torch.torchft_group needs torchft (pip install 'netstorm[peers]'): {exc}") from exc

from netstorm.torch.backend import NetStormBackendError, ProcessGroupNetStorm, connect


class ProcessGroupNetStormFT(ProcessGroupWrapper):
    """A reconfigurable torchft group whose underlying group is ``ProcessGroupNetStorm``."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)

    def _create_pg(self, store: Any, rank: int, world_size: int) -> ProcessGroupNetStorm:
        """The quorum's group: this DC's node joined as torchft's ``rank`` of ``world_size`` (torchft's
        rendezvous ``store`` is not needed: the nodes agree the job's ranks themselves)."""
        group = connect(rank, world_size, self._timeout)
        if group.size() != world_size:
            group.shutdown()
            raise NetStormBackendError(f"netstorm backend under torchft: the quorum holds {world_size} replica "
                                       f"groups, but the nodes' job has {group.size()} ranks")
        return group

    def getBackendName(self) -> str:
        return "torchft-netstorm"

    def shutdown(self) -> None:
        """Leave the node (torchft's wrapper only drops its reference)."""
        pg: Any = getattr(self, "_pg", None)
        self._pg = None
        if isinstance(pg, ProcessGroupNetStorm):
            pg.shutdown()
