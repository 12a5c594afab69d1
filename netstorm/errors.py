"""The project's exception hierarchy: one base so callers can catch NetStorm failures as a whole."""

from __future__ import annotations


class NetStormError(Exception):
    """Base of every error NetStorm raises on purpose."""


class ConfigError(NetStormError):
    """A configuration value is missing, malformed or out of range."""


class ScenarioError(NetStormError):
    """A scenario file is malformed; the message names the file, the key or line, and the problem."""


class PolicyError(NetStormError):
    """A policy or its input (rates, roots, wire data) is malformed or cannot be planned."""
