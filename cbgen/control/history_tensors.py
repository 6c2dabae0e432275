"""The device side of the history controls (cbgen.control.penalties): per sequence, the distinct token ids it has
seen (repetition_penalty) and the generated ones with their counts (presence and frequency penalties), kept on the
logits' device in pooled lists that each step updates with one indexed write, and the step's few host values sent
there in one copy each for integers and floats, without waiting for the device."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch


class History(Protocol):
    """What the device side reads of one sequence's host history (cbgen.control.penalties.History, a slot's key by
    identity): its tokens, prompt first, and how many of them are the prompt."""

    tokens: list[int]
    prompt_length: int


class Lists:
    """Per-sequence lists of distinct token ids on the device, pooled: slot s holds its ids in ids[s, :length] (and,
    when `counted`, how many times each came in counts[s, :length]), in the order first seen. The host keeps, per
    slot, each id's place and count, so it alone decides what to write and how long each list is."""

    def __init__(self, counted: bool) -> None:
        self.counted = counted  # generated tokens only, with counts (else prompt and generated, ids only)
        self.device: torch.device | None = None
        self.ids = torch.zeros(0, 0, dtype=torch.int64)
        self.counts = torch.zeros(0, 0)
        self.slot_of: dict[History, int] = {}
        self.free: list[int] = []
        self.place: list[dict[int, int]] = []  # per slot: id -> its place in the slot's list
        self.tally: list[list[int]] = []  # per slot: each place's count (counted lists)
        self.synced: list[int] = []  # per slot: how many of its history's tokens it has taken in
        self.writes: dict[tuple[int, int], tuple[int, int]] = {}  # (slot, place) -> (id, count), not yet written

    def on(self, device: torch.device) -> None:
        """Puts the pool on `device`: one that was on another starts over (each history is taken in again)."""
        if self.device != device:
            self.device = device
            self.ids = torch.zeros(0, 0, dtype=torch.int64, device=device)
            self.counts = torch.zeros(0, 0, device=device)
            self.slot_of, self.free, self.place, self.tally, self.synced, self.writes = {}, [], [], [], [], {}

    def take_in(self, history: History, vocab: int) -> tuple[int, int]:
        """(slot, list length) of `history`, its tokens not taken in yet queued to be written."""
        slot = self.slot_of.get(history)
        if slot is None:
            slot = self.free.pop() if self.free else len(self.place)
            if slot == len(self.place):
                self.place.append({})
                self.tally.append([])
                self.synced.append(0)
            self.place[slot], self.tally[slot], self.synced[slot] = {}, [], 0
            self.slot_of[history] = slot
        place, tally, tokens = self.place[slot], self.tally[slot], history.tokens
        start = max(self.synced[slot], history.prompt_length) if self.counted else self.synced[slot]
        for token in tokens[start:]:
            if token >= vocab:  # an id the logits do not have (a prompt's, past the model's head)
                continue
            at = place.get(token)
            if at is None:
                at = place[token] = len(tally)
                tally.append(0)
            elif not self.counted:
                continue
            tally[at] += 1
            self.writes[slot, at] = (token, tally[at])
        self.synced[slot] = len(tokens)
        return slot, len(tally)

    def release(self, history: History) -> None:
        slot = self.slot_of.pop(history, None)
        if slot is not None:
            self.free.append(slot)
            self.place[slot], self.tally[slot] = {}, []

    def write(self, upload: Upload) -> Callable[[], None]:
        """Queues the step's writes on `upload`; what then makes them on the device (after the upload is sent)."""
        if not self.writes:
            return lambda: None
        rows, width = len(self.place), max(len(t) for t in self.tally)
        if rows > self.ids.size(0) or width > self.ids.size(1):  # grown by doubling: rarely copied
            grown = (max(rows, 2 * self.ids.size(0), 16), max(width, 2 * self.ids.size(1), 64))
            ids = torch.zeros(grown, dtype=torch.int64, device=self.device)
            counts = torch.zeros(grown if self.counted else (0, 0), device=self.device)
            if self.ids.numel():
                ids[: self.ids.size(0), : self.ids.size(1)] = self.ids
                if self.counted:
                    counts[: self.counts.size(0), : self.counts.size(1)] = self.counts
            self.ids, self.counts = ids, counts
        where = np.fromiter((x for key in self.writes for x in key), dtype=np.int64, count=2 * len(self.writes))
        values = np.fromiter((x for value in self.writes.values() for x in value), dtype=np.int64,
                             count=2 * len(self.writes))
        self.writes = {}
        at = upload.ints(where.reshape(-1, 2).T.copy(), values.reshape(-1, 2).T.copy())
        tallies = upload.floats(values[1::2].astype(np.float32)) if self.counted else None

        def run() -> None:
            slots_places, id_count = upload.int_tensor(at[0]), upload.int_tensor(at[1])
            index = (slots_places[0], slots_places[1])
            self.ids.index_put_(index, id_count[0])
            if tallies is not None:
                self.counts.index_put_(index, upload.float_tensor(tallies))

        return run


class HistoryTensors:
    """The device side of the penalties: the seen ids of the sequences that use repetition_penalty and the generated
    ids and counts of those that use presence or frequency penalties (module docstring). One per step control; a
    sequence's slots are freed when it ends (`release`)."""

    def __init__(self) -> None:
        self.seen = Lists(counted=False)
        self.generated = Lists(counted=True)

    def release(self, history: History) -> None:
        self.seen.release(history)
        self.generated.release(history)

    def clear(self) -> None:
        self.seen, self.generated = Lists(counted=False), Lists(counted=True)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` without waiting for it: on a GPU through pinned memory (a copy from pageable
    memory may wait for the device's queue; torch's pinned allocator keeps the block until the copy is done)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class Upload:
    """Host arrays sent to the device together: one copy for all the integers (int64), one for the floats (float32),
    each without waiting (a copy to a GPU from host memory that waits would wait for the GPU's queued work too)."""

    def __init__(self) -> None:
        self._ints: list[np.ndarray] = []
        self._floats: list[np.ndarray] = []
        self._int_tensor = torch.empty(0, dtype=torch.int64)
        self._float_tensor = torch.empty(0)
        self._int_at: list[tuple[int, tuple[int, ...]]] = []
        self._float_at: list[tuple[int, tuple[int, ...]]] = []

    def ints(self, *arrays: np.ndarray) -> list[int]:
        return [self._add(self._ints, self._int_at, a.astype(np.int64, copy=False)) for a in arrays]

    def floats(self, array: np.ndarray) -> int:
        return self._add(self._floats, self._float_at, array.astype(np.float32, copy=False))

    @staticmethod
    def _add(arrays: list[np.ndarray], at: list[tuple[int, tuple[int, ...]]], array: np.ndarray) -> int:
        at.append((sum(a.size for a in arrays), array.shape))
        arrays.append(array)
        return len(at) - 1

    def send(self, device: torch.device) -> None:
        for arrays, dtype, name in ((self._ints, np.int64, "_int_tensor"), (self._floats, np.float32, "_float_tensor")):
            if arrays:
                host = np.concatenate([a.ravel() for a in arrays]) if len(arrays) > 1 else arrays[0].ravel()
                setattr(self, name, to_device(torch.from_numpy(np.ascontiguousarray(host, dtype=dtype)), device))

    def int_tensor(self, handle: int) -> torch.Tensor:
        start, shape = self._int_at[handle]
        return self._int_tensor[start: start + math.prod(shape)].view(shape)

    def float_tensor(self, handle: int) -> torch.Tensor:
        start, shape = self._float_at[handle]
        return self._float_tensor[start: start + math.prod(shape)].view(shape)
