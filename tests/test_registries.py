"""One registry per extension point: every CLI's choices, the config's validation and the wires'
accepted names are the registry's, so an entry added there reaches them all."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from netstorm import config as config_mod
from netstorm import scenario
from netstorm import trainer_wire as tw
from netstorm.cli import build_parser
from netstorm.compression.methods import COMPRESSION, METHODS
from netstorm.compression.options import CompressionOptions
from netstorm.dcplanners import DC_PLANNERS, PLANNERS
from netstorm.emulation import systems
from netstorm.errors import ConfigError, NetStormError, PolicyError, TrainerProtocolError
from netstorm.planning.plan import plan
from netstorm.policy import Policy
from netstorm.registry import Registry, load
from netstorm.topologies import NAMES, TOPOLOGIES
from netstorm.trainers import synthetic, torch_ddp


def _choices(parser: argparse.ArgumentParser, flag: str) -> tuple[str, ...]:
    for action in parser._actions:
        if flag in action.option_strings:
            assert action.choices is not None, f"{flag} offers no choices"
            return tuple(action.choices)
        if isinstance(action, argparse._SubParsersAction):
            continue
    raise AssertionError(f"no {flag} flag")


@pytest.fixture(scope="module")
def commands() -> dict[str, argparse.ArgumentParser]:
    parser, _ = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_topology_flag_offers_the_registry_and_every_entry_plans(commands: dict[str, argparse.ArgumentParser]
                                                                       ) -> None:
    for command in ("scheduler", "local", "plan"):
        assert _choices(commands[command], "--topology") == NAMES, command
    rates = scenario.load("internet2-9").rates()
    for name, entry in TOPOLOGIES.items():
        policy = plan(rates, topology=name, num_roots=3, aux=False)
        assert Policy.from_wire(policy.to_wire()) == policy  # the wire accepts every registered name
        assert len(policy.roots) == (1 if entry.single_root or not entry.rooted else 3)
        assert callable(load(entry.builder))
    assert {s.topology for s in systems.SYSTEMS.values()} <= set(NAMES)  # the emulated systems name registered ones
    wire = plan(rates, topology="fapt", aux=False).to_wire()
    with pytest.raises(PolicyError, match="unknown topology 'ring'"):
        Policy.from_wire({**wire, "topology": "ring"})


def test_every_dc_planner_flag_and_the_config_follow_the_registry(commands: dict[str, argparse.ArgumentParser]
                                                                  ) -> None:
    assert DC_PLANNERS.names == PLANNERS
    for command in ("scheduler", "node", "plan", "emulate"):
        assert _choices(commands[command], "--dc-planner") == PLANNERS, command
    for name, entry in DC_PLANNERS.items():
        config_mod.Config(dc_planner=name).validate()
        assert callable(load(entry.target))
    with pytest.raises(ConfigError, match="dc_planner must be one of flat, aleph"):
        config_mod.Config(dc_planner="nope").validate()


def test_every_compression_flag_the_trainer_wire_and_the_options_follow_the_registry(
        commands: dict[str, argparse.ArgumentParser]) -> None:
    for command in ("scheduler", "node", "local"):
        assert _choices(commands[command], "--compression") == METHODS, command
    trainer = argparse.ArgumentParser()
    synthetic.add_arguments(trainer)
    assert _choices(trainer, "--compression") == METHODS
    assert _choices(torch_ddp.build_parser(), "--compression") == METHODS
    for name, entry in COMPRESSION.items():
        request = tw.InitRequest((("w", (4,), "float32"),), "", name)
        assert tw.decode(tw.encode(request)[tw.PREFIX.size:]) == request
        options = CompressionOptions(name)
        assert options.spec is entry and options.sparse == entry.sparse
        assert options.votes_of(20) == (3 if entry.consensus else 1)
    good = tw.encode(tw.InitRequest((("w", (4,), "float32"),), ""))[tw.PREFIX.size:]
    bad = msgspec.msgpack.encode({**msgspec.msgpack.decode(good), "compression": "zip"})
    with pytest.raises(TrainerProtocolError, match="compression"):
        tw.decode(bad)
    with pytest.raises(ConfigError, match="compression must be one of none, fediac, topk, fp16"):
        CompressionOptions("zip")


def test_a_registry_refuses_an_unknown_name_with_its_typed_error_and_every_choice() -> None:
    reg: Registry[int] = Registry("widget", {"a": 1, "b": 2}, PolicyError)
    assert reg.names == ("a", "b") and reg.get_entry("b") == 2 and reg.check("a") == "a"
    with pytest.raises(PolicyError, match=r"unknown widget 'c' \(one of a, b\)"):
        reg.get_entry("c")
    with pytest.raises(NetStormError):
        reg.check(3)
    with pytest.raises(ValueError):
        Registry("nothing", {}, PolicyError)


def test_the_emulators_compression_flag_takes_a_list_of_registered_methods() -> None:
    """`emulate --compression none,fediac` runs one row per entry; each entry must name a registered method."""
    parser, _ = build_parser(only="emulate")
    args = parser.parse_args(["emulate", "internet2-9", "--compression", "none,fediac:gia_reuse=4"])
    assert args.opt_compression == "none,fediac:gia_reuse=4"
    with pytest.raises(SystemExit):
        parser.parse_args(["emulate", "internet2-9", "--compression", "none,gzip"])
