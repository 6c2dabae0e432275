"""A replacement of one process-wide name (a module attribute, a registry entry) that several engines need at once:
installed by the first that asks, removed by the last that leaves, and counted in one place.

cbgen installs such a replacement only as a dispatcher: it routes each call by the model that makes it (its config)
to what that model's engine asked for, and every other call to what was there before. So two engines in one process
each get their own plan's behaviour, and a model no engine holds runs as transformers would run it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class SharedPatch:
    """`install()` puts `replacement` in place on the first hold, and `release()` puts `read()`'s earlier value back
    on the last. `read` and `write` get and set the patched name; `original` is what was there before the first hold
    (None while nobody holds it)."""

    def __init__(self, name: str, read: Callable[[], Any], write: Callable[[Any], None], replacement: Any) -> None:
        self.name = name
        self.read = read
        self.write = write
        self.replacement = replacement
        self.original: Any = None
        self.holders = 0
        self.lock = threading.Lock()

    def hold(self) -> None:
        with self.lock:
            if self.holders == 0:
                current = self.read()
                self.original = current
                self.write(self.replacement)
            self.holders += 1

    def release(self) -> None:
        """Puts the original back on the last release; if someone replaced the dispatcher meanwhile, theirs stays."""
        with self.lock:
            self.holders -= 1
            if self.holders == 0:
                if self.read() is self.replacement:
                    self.write(self.original)
                self.original = None

    def serving(self) -> bool:
        """Whether the replacement is what the name holds now (someone may have replaced it after us)."""
        return self.holders > 0 and self.read() is self.replacement
