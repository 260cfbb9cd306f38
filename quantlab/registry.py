"""Registry[T]: name -> entry, the one lookup every mode goes through (precisions, engines, quantized layers,
metrics). A miss is a QuantlabError with the closest name and the options, never a KeyError."""
from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterable, Iterator, TypeVar

from quantlab.errors import QuantlabError

T = TypeVar("T")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """'; did you mean 'x'?' for the closest choice, or ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


class Registry(Generic[T]):
    """An ordered name -> entry map. `what` names the kind in messages ("precision"), `knob` the config key that
    selects an entry ("+precision=NAME"), so an unknown name reads as a fix, not a lookup failure."""

    def __init__(self, what: str, knob: str):
        self.what, self.knob = what, knob
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Register entry under name and return it; a name registered twice is a ValueError (a bug, not bad input)."""
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of add()."""
        return lambda entry: self.add(name, entry)

    def get(self, name: str) -> T:
        """The entry called name; an unknown name is a QuantlabError (exit 2) with the closest name and the choices."""
        if name not in self._entries:
            raise QuantlabError(f"unknown {self.what} {name!r}{did_you_mean(name, self._entries)}",
                                fix=f"use {self.knob} with one of: {', '.join(self._entries)}")
        return self._entries[name]

    __getitem__ = get

    def find(self, predicate: Callable[[T], bool]) -> T | None:
        """The first entry, in registration order, for which predicate is true; None if there is none."""
        return next((e for e in self._entries.values() if predicate(e)), None)

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._entries)

    def items(self):
        """(name, entry) pairs in registration order."""
        return self._entries.items()

    def values(self):
        """Entries in registration order."""
        return self._entries.values()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
