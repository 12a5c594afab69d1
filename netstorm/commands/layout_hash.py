"""``netstorm layout-hash MODEL``: print the layout hash every node of a job computes for a trainer that
registers MODEL, for the scheduler's ``layout_hash`` (which then refuses any other model at once).

MODEL is a model name or size as trainers take it (``alexnet``, ``resnet50``, ``61.1M``, ``1e6/8``), or a
``.npz`` file of the model's arrays (``numpy.savez(path, **model)``; a PyTorch model's
``{name: tensor.numpy() for name, tensor in model.state_dict().items()}``), of which only names, shapes
and dtypes are read. The hash covers the job's ``chunk_size`` and ``compression`` (and FediAC's threshold):
give the same options, or the same ``--config`` file, as the scheduler.
"""

from __future__ import annotations

import argparse

from netstorm import config as config_module

NAME = "layout-hash"
HELP = "print the layout hash of MODEL (a model name or size, or a .npz of its arrays) for the scheduler's layout_hash"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="alexnet, resnet50, a parameter count (61.1M, 1e6/8: COUNT/LAYERS), or a .npz file")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="the job's workers, for FediAC's threshold when fediac_votes is 0")
    config_module.add_arguments(parser, (), ("chunk_size", "compression", "fediac_votes"))


def run(args: argparse.Namespace) -> int:
    from netstorm.compression.methods import COMPRESSION
    from netstorm.compression.options import VOTES
    from netstorm.errors import ConfigError
    from netstorm.joblayout import job_layout, model_specs

    config = config_module.from_args(args)
    specs = model_specs(args.model)
    needs_workers = COMPRESSION.get_entry(config.compression).consensus and not config.fediac_votes \
        and any(spec.name == VOTES for spec in specs)
    if needs_workers and args.workers < 1:
        raise ConfigError(f"with compression {config.compression} and fediac_votes 0 the hash covers a threshold "
                          f"derived from the job's workers: give --workers N (or --fediac-votes)")
    layout = job_layout(specs, config.chunk_size, config.compression, config.compression,
                        votes=config.fediac_votes, workers=max(1, args.workers))
    print(layout.hash)
    return 0
