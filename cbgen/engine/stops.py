"""Stop strings: where a streamed sequence first shows one of its stop strings, found by decoding only a window of
recent tokens per step."""

from __future__ import annotations

from collections.abc import Callable


class StopStrings:
    """Finds where a sequence reaches one of its stop strings, decoding only a window of recent tokens per step."""

    def __init__(self, stops: tuple[str, ...], decode: Callable[[list[int]], str]) -> None:
        self.stops = stops
        self.decode = decode
        # a token decodes to at least one byte: this many tokens hold any stop string, with room for merges
        self.window = 4 * max(len(s.encode("utf-8")) for s in stops) + 4

    def find(self, tokens: list[int], start: int, hold: int = 0) -> tuple[int, str] | None:
        """The first k > start such that tokens[:k] show a stop string, with the text cut before it; or None.
        `hold` (min_tokens): only a stop string that ends after the text of the first `hold` tokens counts."""
        floor: int | None = None  # the text length of the first `hold` tokens, decoded once a stop shows
        for k in range(max(start, hold, 0) + 1, len(tokens) + 1):
            tail = self.decode(tokens[max(0, k - self.window):k])
            if any(stop in tail for stop in self.stops):
                if floor is None:
                    floor = len(self.decode(tokens[:hold])) if hold else 0
                text = self.decode(tokens[:k])
                found = [i for i in (text.find(stop, max(0, floor - len(stop) + 1)) for stop in self.stops) if i >= 0]
                if found:
                    return k, text[:min(found)]
        return None
