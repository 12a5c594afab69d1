"""The emulator's torch-ddp trainer without a network: its tasks, its flags, and the learning curve it reports."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from netstorm.emulation.errors import EmulationError
from netstorm.emulation.runner import Options, add_run_arguments, chunk_flags, options_from_args, training
from netstorm.trainers.launch import TRAINERS, torch_ddp_args
from netstorm.trainers.tasks import TASKS

DATA = Path(__file__).parent / "data"


class Log:
    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records


def test_the_curve_comes_from_the_evaluating_rank_and_time_to_accuracy_sums_the_slowest_steps() -> None:
    rank0 = Log([{"iteration": k, "seconds": 1.0, "loss": 2.0 - k, "accuracy": acc, "overhead_s": 0.05}
                 for k, acc in enumerate([0.2, 0.5, 0.81, 0.9])])
    rank1 = Log([{"iteration": k, "seconds": 2.0 + k, "overhead_s": 0.1 * k} for k in range(4)])
    out = training([rank0, rank1], 4, 0.8)
    assert out["accuracy"] == [0.2, 0.5, 0.81, 0.9]
    assert out["loss"] == [2.0, 1.0, 0.0, -1.0]
    assert out["target_accuracy"] == 0.8
    assert out["iterations_to_accuracy"] == 3
    assert out["time_to_accuracy_s"] == pytest.approx(2.0 + 3.0 + 4.0)  # the slowest rank's steps 0..2
    assert out["overhead_s"] == pytest.approx([0.05, 0.1, 0.2, 0.3])
    # iterations 2..N: (0.1 + 0.2 + 0.3) / (3 + 4 + 5)
    assert out["integration_cost"] == pytest.approx(0.6 / 12, abs=1e-4)


def test_a_target_never_reached_and_a_backend_without_costs() -> None:
    out = training([Log([{"iteration": k, "seconds": 1.0, "loss": 1.0, "accuracy": 0.3} for k in range(3)])], 3, 0.8)
    assert out["time_to_accuracy_s"] is None and out["iterations_to_accuracy"] is None
    assert "integration_cost" not in out and "overhead_s" not in out


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("--bw-scale", type=float, default=1.0)
    parser.add_argument("--no-loss", action="store_true")
    add_run_arguments(parser)
    return parser.parse_args([str(DATA / "emu-4.toml"), *argv])


def test_trainer_and_task_are_choices_with_the_first_the_default() -> None:
    args = parse()
    assert (args.trainer, args.train) == (TRAINERS[0], None) == ("synthetic", None)  # a task is per trainer
    opts = options_from_args(parse("--trainer", "torch-ddp", "--system", "netstorm"))
    assert isinstance(opts, Options) and opts.train == next(iter(TASKS)) == "blobs"
    with pytest.raises(SystemExit):
        parse("--trainer", "horovod")
    with pytest.raises(SystemExit):
        parse("--trainer", "torch-ddp", "--train", "imagenet")


def test_torch_ddp_options_size_the_run_by_the_task_and_refuse_synthetic_only_flags() -> None:
    opts = options_from_args(parse("--trainer", "torch-ddp", "--train", "shapes", "--system", "netstorm,gloo"))
    assert isinstance(opts, Options)
    assert (opts.trainer, opts.train, opts.model) == ("torch-ddp", "shapes", "torch-ddp:shapes")
    assert opts.parameters() == TASKS["shapes"].parameters
    # the chunk size is cut from the task's model, not from --model's default (AlexNet)
    assert opts.config_flags[-4:] == chunk_flags(TASKS["shapes"].parameters, {}, roots=4)
    for flag in (["--overlap"], ["--compute-s", "1"], ["--lan-workers", "2"]):
        with pytest.raises(EmulationError, match="synthetic trainer"):
            options_from_args(parse("--trainer", "torch-ddp", *flag))


def test_the_launch_line_names_backend_task_rank_and_endpoint() -> None:
    netstorm = torch_ddp_args("netstorm", "blobs", rank=2, world=9, dc=3, iterations=5, out=Path("/o.jsonl"),
                              socket="/run/node-3.sock")
    assert netstorm[:2] == ["-m", "netstorm.trainers.torch_ddp"]
    assert netstorm[netstorm.index("--socket") + 1] == "/run/node-3.sock" and "--store" not in netstorm
    gloo = torch_ddp_args("gloo", "blobs", rank=0, world=9, dc=1, iterations=5, out=Path("/o.jsonl"),
                          store="10.0.0.1:29500", address="10.100.0.1")
    assert gloo[gloo.index("--address") + 1] == "10.100.0.1" and "--socket" not in gloo


@pytest.mark.torch
@pytest.mark.parametrize("name", list(TASKS))
def test_each_task_builds_its_declared_model_and_the_same_data_from_the_same_seed(name: str) -> None:
    import torch

    from netstorm.trainers import tasks

    model = tasks.build_model(name, seed=3)
    assert tasks.parameter_count(model) == TASKS[name].parameters
    x1, y1 = tasks.make_data(name, 11, 64)
    x2, y2 = tasks.make_data(name, 11, 64)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(tasks.make_data(name, 12, 64)[0], x1)
    loss, accuracy = tasks.evaluate(model, x1, y1)
    assert loss > 0 and 0.0 <= accuracy <= 1.0
    classes = {"blobs": tasks.BLOBS_CLASSES, "shapes": tasks.SHAPES_CLASSES}[name]
    assert model(x1).shape == (64, classes) and int(y1.max()) < classes
