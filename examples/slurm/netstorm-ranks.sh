#!/bin/bash
# One host's ranks of one DC (netstorm-ddp.sbatch runs it on every host of the DC's allocation).
#
#   NETSTORM_HEAD=HOST NETSTORM_NODE_SOCKET=PATH NNODES=N RANKS_PER_HOST=K RDZV_ID=ID \
#       examples/slurm/netstorm-ranks.sh TRAIN...
#
# torchrun's rendezvous (c10d, at the DC's head host, port RDZV_PORT) spans this DC only, so WORLD_SIZE is
# the DC's ranks (N x K) and RANK counts within the DC; the netstorm process group turns them into the
# job's ranks at the nodes. On the head host a rank reaches the DC's node over its Unix socket, elsewhere
# over TCP (tcp://HEAD:7200), proving the job secret (NETSTORM_SECRET_FILE).
set -euo pipefail
: "${NETSTORM_HEAD:?the DC's head host (where its node runs)}"
: "${NETSTORM_NODE_SOCKET:?the Unix socket of the DC's node on the head host}"
NNODES=${NNODES:-1}
RANKS_PER_HOST=${RANKS_PER_HOST:-1}
RDZV_ID=${RDZV_ID:-netstorm}
RDZV_PORT=${RDZV_PORT:-29500}
TORCHRUN=${TORCHRUN:-torchrun}
if [ "$(hostname)" = "$NETSTORM_HEAD" ] || [ "$NETSTORM_HEAD" = localhost ] || [ "$NETSTORM_HEAD" = 127.0.0.1 ]; then
    export NETSTORM_SOCKET=$NETSTORM_NODE_SOCKET
else
    export NETSTORM_SOCKET=tcp://$NETSTORM_HEAD:7200
    export NETSTORM_SECRET_FILE=${NETSTORM_SECRET_FILE:-$HOME/.netstorm/job.secret}
fi
exec "$TORCHRUN" --nnodes "$NNODES" --nproc-per-node "$RANKS_PER_HOST" \
    --rdzv-backend c10d --rdzv-endpoint "$NETSTORM_HEAD:$RDZV_PORT" --rdzv-id "$RDZV_ID" "$@"
