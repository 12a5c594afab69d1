"""The emulator's error type (kept here so the project's shared error module stays untouched)."""

from __future__ import annotations

from netstorm.errors import NetStormError


class EmulationError(NetStormError):
    """The WAN emulator could not build, change or tear down its network; the message names the step."""
