"""The loop that grows conversations: every open conversation has exactly one turn queued or in the engine; when a
turn finishes, the conversation's next one is queued at once, and the engine takes it on its next admission (so
its prefix is still in the KV cache). New rows are opened while fewer than `window` conversations are open; queued
turns go first, so conversations finish and leave memory rather than pile up.

The engine reads the turns from `requests`, which says None ("nothing now") while the next turns wait on those in
flight (cbgen.engine.engine.Engine.run). Each finished conversation comes out as one group: the completions of
the turns this run computed, with the conversation itself (`Finished.conversation`) for its row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from cbgen.conversations.builder import TurnBuilder
from cbgen.conversations.state import ASSISTANT, Conversation, Rules, Turn
from cbgen.records import Completion, PromptRecord, Request

if TYPE_CHECKING:
    from cbgen.conversations.journal import TurnJournal

Compute = Callable[[Iterator[Request | None]], Iterable[list[Completion]]]


class Finished(list[Completion]):
    """A finished conversation's turns computed by this run (earlier runs' are in the journal, not here)."""

    def __init__(self, conversation: Conversation, completions: list[Completion]) -> None:
        super().__init__(completions)
        self.conversation = conversation


class Conversations:
    """`prepare` gives a rendered turn its own settings (the job's and the row's: sampling, seed, stops); `eos`
    are the end-of-sequence ids a reply may end with; `resumed` the finished turns an earlier run left in
    `journal`."""

    def __init__(self, builder: TurnBuilder, rules: Rules, prepare: Callable[[Request], Request], eos: frozenset[int],
                 *, window: int, journal: TurnJournal | None = None,
                 resumed: dict[str, list[Turn]] | None = None) -> None:
        self.builder, self.rules, self.prepare, self.eos = builder, rules, prepare, eos
        self.tokenizer = builder.tokenizer
        self.window = window
        self.journal = journal
        self.resumed = resumed or {}
        self.queue: deque[Request] = deque()
        # id(request) -> its conversation and who speaks, queued or in the engine
        self.waiting: dict[int, tuple[Conversation, str]] = {}
        self.open = 0  # conversations opened and not finished
        self.computed: dict[int, list[Completion]] = {}  # id(conversation) -> this run's completions of it
        self.done: deque[Finished] = deque()

    def run(self, records: Iterable[PromptRecord], compute: Compute) -> Iterator[Finished]:
        """Every conversation `records` open, each as it finishes; `compute` runs turns (the engine, through the
        result cache)."""
        for group in compute(self.requests(iter(records))):
            self._finished_turn(group[0])
            while self.done:
                yield self.done.popleft()
        while self.done:
            yield self.done.popleft()

    def requests(self, records: Iterator[PromptRecord]) -> Iterator[Request | None]:
        exhausted = False
        while True:
            if self.queue:
                yield self.queue.popleft()
            elif not exhausted and self.open < self.window:
                record = next(records, None)
                if record is None:
                    exhausted = True
                    continue
                self._start(Conversation.open(record, self.rules))
            elif self.waiting:
                yield None
            else:
                return

    def _start(self, conversation: Conversation) -> None:
        self.open += 1
        if conversation.error is not None:  # the row cannot open one: its error goes through the engine as a turn's
            self._queue(conversation, Request(self.builder.record(conversation, ASSISTANT), error=conversation.error),
                        ASSISTANT)
            return
        for turn in self.resumed.pop(conversation.record.id, ()):  # the turns an earlier run finished
            if conversation.next_role(self.rules) is None:
                break
            conversation.add(turn, self.rules)
        self._next(conversation)

    def _next(self, conversation: Conversation) -> None:
        """Queues the conversation's next turn, or hands it on as finished."""
        role = conversation.next_role(self.rules) if conversation.ended is None else None
        if role is None:
            self.open -= 1
            self.done.append(Finished(conversation, self.computed.pop(id(conversation), [])))
            return
        from cbgen.render.sandbox import RenderStopped

        try:
            request = self.builder.request(conversation, role)
        except RenderStopped:
            return  # the job is stopping while the simulated user's template renders: the turn is for a resume
        self._queue(conversation, self.prepare(request) if request.error is None else request, role)

    def _queue(self, conversation: Conversation, request: Request, role: str) -> None:
        self.waiting[id(request)] = (conversation, role)
        self.queue.append(request)

    def _finished_turn(self, completion: Completion) -> None:
        conversation, role = self.waiting.pop(id(completion.request))
        self.computed.setdefault(id(conversation), []).append(completion)
        if conversation.ended is None:  # else the row could not open one, and its error is said already
            turn = self._turn(completion, role)
            if self.journal is not None:
                self.journal.append(conversation.record.id, turn)
            conversation.add(turn, self.rules)
        self._next(conversation)

    def _turn(self, completion: Completion, role: str) -> Turn:
        tokens = completion.token_ids
        error = completion.error if completion.finish_reason == "error" else None
        text = "" if error else completion.text if completion.text is not None else \
            self.tokenizer.decode(tokens, skip_special_tokens=True)
        body = tokens[:-1] if tokens and tokens[-1] in self.eos else tokens
        # the reply's tokens spell its text exactly (no special token, no cut by a stop string): the next turn's
        # prompt holds them (cbgen.conversations.builder)
        spelled = list(body) if role == ASSISTANT and completion.text is None and not error \
            and self.tokenizer.decode(body) == text else None
        return Turn(role, text if role == ASSISTANT else text.strip(), list(tokens), completion.finish_reason,
                    completion.num_prompt_tokens, completion.num_cached_tokens, error, spelled)
