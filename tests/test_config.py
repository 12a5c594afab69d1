from __future__ import annotations

import argparse
from typing import Any

import pytest

from netstorm import config
from netstorm.errors import ConfigError


def test_paper_defaults() -> None:
    c = config.Config()
    assert (c.chunk_size, c.primary_busy_bound, c.auxiliary_queue_length) == (1_000_000, 2, 1)
    assert (c.probe_chunk_num, c.update_time, c.update_rate) == (4, 5.0, 0.2)
    assert c.enable_awareness and c.enable_aux_path


def test_precedence_file_env_cli(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[netstorm]\nCHUNK_SIZE = 500\nupdate_time = 2.5\nenable_aux_path = false\n")
    c = config.resolve(file=f, environ={"NETSTORM_UPDATE_TIME": "7", "NETSTORM_PRIMARY_BUSY_BOUND": "3"},
                       overrides={"primary_busy_bound": "4"})
    assert c.chunk_size == 500
    assert c.update_time == 7.0
    assert c.primary_busy_bound == 4
    assert c.enable_aux_path is False


def test_cli_flags_cover_every_option(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(["--chunk-size", "10", "--enable-awareness", "off"])
    c = config.from_args(args, environ={})
    assert c.chunk_size == 10 and c.enable_awareness is False
    for name in config.FIELDS:
        assert hasattr(args, f"opt_{name}")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [({"chunk_size": 0}, "chunk_size"), ({"update_time": -1}, "update_time"),
     ({"chunk_size": "1.5"}, "chunk_size"), ({"enable_aux_path": "maybe"}, "enable_aux_path"),
     ({"bogus": 1}, "bogus"),
     ({"heartbeat_interval": 5.0}, r"heartbeat_timeout \(5\.0 s\) must exceed heartbeat_interval \(5\.0 s\)"),
     ({"dc_planner": "ring"}, "dc_planner must be one of flat, aleph, pahina, eina"),
     ({"dc_plan_time_limit": 0}, "dc_plan_time_limit"), ({"eina_depth": 1}, "eina_depth"),
     ({"dc_replan_change": -0.1}, "dc_replan_change")],
)
def test_bad_values_name_the_option(overrides, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        config.resolve(overrides=overrides)


def test_unknown_key_in_file(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("chunk_sise = 3\n")
    with pytest.raises(ConfigError, match="chunk_sise"):
        config.resolve(file=f)


def test_every_option_is_documented() -> None:
    assert set(config.DOCS) == set(config.FIELDS)
    assert all(config.DOCS[name] for name in config.FIELDS)


NUMERIC = sorted(name for name, field in config.FIELDS.items() if type(field.default) in (int, float))


@pytest.mark.parametrize("name", NUMERIC)
def test_every_numeric_option_refuses_what_it_cannot_take(name, tmp_path) -> None:
    """NaN slips through every range comparison, and a negative count or timeout through none of the
    options; each is refused with the option's name and where the value came from."""
    kind = type(config.FIELDS[name].default)
    bad = ["-1", "nan", "inf", "-inf"] if kind is float else ["-1", str(2**64)]
    for value in bad:
        with pytest.raises(ConfigError, match=rf"environment NETSTORM_{name.upper()}: .*{name}"):
            config.resolve(environ={f"NETSTORM_{name.upper()}": value})
    toml = tmp_path / "c.toml"
    toml.write_text(f"{name} = {'nan' if kind is float else -1}\n")
    with pytest.raises(ConfigError, match=rf"{toml}: .*{name}"):
        config.resolve(file=toml)
    with pytest.raises(ConfigError, match=name):
        invalid: dict[str, Any] = {name: float("nan") if kind is float else -1}
        config.Config(**invalid).validate()
