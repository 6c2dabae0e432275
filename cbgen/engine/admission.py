"""Admission: which requests may enter the engine, and when.

A request that can never run (longer than the model's context, or than the KV cache can ever hold) is failed before
admission: inside the manager it would stop the generation loop for every request. A request sharing a prompt prefix
with one that is computing it waits until that prefix is cached (the prefix gate).
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass
from math import ceil

from cbgen.records import Completion, Request
from cbgen.render.prompts import prefix_key


def rejection(request: Request, error: str, n: int) -> list[Completion]:
    """The sequences of a request refused before admission, each failed with `error` after its input location."""
    error = f"{request.record.location}: {error}"
    return [Completion(request, i, [], None, "error", error, rejected=True) for i in range(n)]


@dataclass
class Limits:
    """What bounds a request: the job's max_new_tokens, the model's context and, once the cache exists, its size."""

    max_new_tokens: int
    max_positions: int | None
    num_blocks: int | None = None
    page_size: int | None = None

    def max_new_for(self, request: Request) -> int:
        """The request's max_new_tokens (its own, else the job's), capped so prompt + generation stays within the
        model's context."""
        cap = request.max_new_tokens or self.max_new_tokens
        if self.max_positions is None:
            return cap
        return max(1, min(cap, self.max_positions - len(request.ids)))

    def never_fits(self, request: Request) -> str | None:
        """Why `request` can never run, or None. Must hold for any schedule, or the manager's loop would die."""
        length = len(request.ids)
        if self.max_positions is not None and length >= self.max_positions:
            return (f"prompt of {length} tokens does not fit the model's context of {self.max_positions} tokens; "
                    "shorten the prompt")
        if self.num_blocks and self.page_size:
            new = self.max_new_for(request)
            if ceil((length + new) / self.page_size) + 1 > self.num_blocks:
                return (f"prompt of {length} tokens + {new} new tokens can never fit in the KV cache "
                        f"({self.num_blocks * self.page_size} tokens); raise --num-blocks or --max-memory-percent, "
                        "or lower --max-new-tokens")
        return None


class Placement(enum.Enum):
    ALONE = "alone"  # nothing to share, or its prefix is cached already
    LEADER = "leader"  # the first of its prefix: computes it
    PARKED = "parked"  # waits until its leader has computed the prefix


class PrefixGate:
    """Admits the first request of each shared prefix and holds back the others until it has computed that prefix.

    The engine reuses a prefix's KV blocks only once they are computed. Requests sharing a prefix that are admitted
    together (what a sorted submission does) all compute it themselves, so followers wait here, at most `max_parked`
    of them, and go as soon as their leader's first token exists. A prefix is the first `key_tokens` tokens (one
    KV page: shorter prompts have no complete block to share). Prefixes seen computed are remembered (bounded), so
    later requests sharing them go straight in; if the engine has evicted those blocks meanwhile, they recompute.
    """

    def __init__(self, key_tokens: int, max_parked: int, enabled: bool = True, memory: int = 65536) -> None:
        self.key_tokens = key_tokens
        self.max_parked = max_parked
        self.enabled = enabled
        self.memory = memory
        self.ready: deque[Request] = deque()  # released followers, admitted before anything new
        self.waiting: dict[tuple[int, ...], list[Request]] = {}  # prefix -> parked followers
        self._leaders: dict[str, tuple[int, ...]] = {}  # request key -> the prefix it computes
        self._computing: set[tuple[int, ...]] = set()
        self._computed: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._parked = 0

    @property
    def full(self) -> bool:
        return self._parked >= self.max_parked

    def place(self, request: Request) -> Placement:
        prefix = self._prefix(request)
        if prefix is None or prefix in self._computed:
            return Placement.ALONE
        if prefix in self._computing:
            self.waiting.setdefault(prefix, []).append(request)
            self._parked += 1
            return Placement.PARKED
        return Placement.LEADER

    def lead(self, request: Request, key: str) -> None:
        """`request`, placed as a LEADER, is in the engine under `key`."""
        prefix = self._prefix(request)
        if prefix is None:  # a request with nothing to share is never a leader
            return
        self._leaders[key] = prefix
        self._computing.add(prefix)

    def prefix_computed(self, key: str) -> None:
        """The request `key` has produced a token (or ended): release the followers of its prefix."""
        prefix = self._leaders.pop(key, None)
        if prefix is None:
            return
        self._computing.discard(prefix)
        self._computed[prefix] = None
        if len(self._computed) > self.memory:
            self._computed.popitem(last=False)
        followers = self.waiting.pop(prefix, [])
        self._parked -= len(followers)
        self.ready.extend(followers)

    def _prefix(self, request: Request) -> tuple[int, ...] | None:
        return prefix_key(request.ids, self.key_tokens) if self.enabled else None
