"""Named extension points: an ordered table of names, each with what the code needs to know about it.

A registry lives below everything that uses it (config, the CLI, the wires, the planners), so adding
an entry is one line in one place and every list of names follows. An entry that needs heavy code
(a planner) names it as ``"module:attribute"`` and is loaded only when used, so reading the names loads
nothing (a general node never imports a solver).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from netstorm.errors import NetStormError

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Name -> entry, in the order given (the first is the default where one is needed)."""

    def __init__(self, what: str, entries: Mapping[str, T], error: Callable[[str], NetStormError]) -> None:
        if not entries:
            raise ValueError(f"a registry of {what} needs at least one entry")
        self.what = what
        self._entries = dict(entries)
        self._error = error

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name, in order: the CLI's choices and the wire's accepted values."""
        return tuple(self._entries)

    def get_entry(self, name: object) -> T:
        """The entry of ``name``, or the registry's typed error naming every choice."""
        if not isinstance(name, str) or name not in self._entries:
            raise self._error(f"unknown {self.what} {name!r} (one of {', '.join(self._entries)})")
        return self._entries[name]

    def check(self, name: object) -> str:
        """``name`` if it is registered, else the registry's typed error."""
        self.get_entry(name)
        assert isinstance(name, str)
        return name


def load(target: str) -> Any:
    """The attribute ``"package.module:attribute"`` names (imported on first use)."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)
