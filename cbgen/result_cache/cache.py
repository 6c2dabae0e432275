"""A job's side of the result cache: answers the requests whose sequences it holds, before they reach the engine,
and keeps the sequences the engine computes.

    requests ──answer──▶ a request with its sequences found: `request.answered`, written as any other result
                        ╰──▶ the rest, to the engine ──▶ results ──remember──▶ the store

A found sequence is used when it is exact (see cbgen.result_cache.keys: the same numerics as this run, and
batch-invariant ones) or, where the job accepts near hits (`--cache-near-hits`), when it was computed with other
numerics; run.json counts each kind. Under another token cap an entry is used only where it is the answer: one that
ended on its own within the cap as it is, one cut by a cap at least as large cut again at this one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cbgen.records import Completion, Request, Score
from cbgen.result_cache.keys import Keyer, Numerics
from cbgen.result_cache.store import ResultStore

# the ends a sequence is kept with: its own end, the cap, or the loop stop (a rule of the request's own settings,
# which are part of its key)
ENDS = ("stop", "length", "repetition")

if TYPE_CHECKING:
    from cbgen.score.requests import ScoreRequest


@dataclass
class CacheCounts:
    """What run.json, the summary, `cbgen status` and the dataset card say of the cache in one run (requests)."""

    hits: int = 0  # answered exactly
    near_hits: int = 0  # answered by sequences computed with other numerics (asked for with --cache-near-hits)
    misses: int = 0  # computed (and then kept)
    not_cached: int = 0  # never cached: unseeded sampling, or an error
    stored: int = 0  # sequences written to the cache
    near_hits_skipped: int = 0  # held, but computed with other numerics: computed afresh

    def to_dict(self) -> dict[str, int]:
        return {"hits": self.hits, "near_hits": self.near_hits, "misses": self.misses, "not_cached": self.not_cached,
                "stored_sequences": self.stored, "near_hits_skipped": self.near_hits_skipped}


def _cut(tokens: list[Any] | None, cap: int) -> list[Any] | None:
    return tokens[:cap] if tokens is not None else None


class ResultCache:
    """A store seen by one job: its keys, its numerics, and whether near hits are taken."""

    def __init__(self, store: ResultStore, keyer: Keyer, numerics: Numerics, *, near: bool, max_bytes: int,
                 num_return_sequences: int, max_new_tokens: int, capture: bool, top_logprobs: int = 0) -> None:
        self.store = store
        self.keyer = keyer
        self.numerics = numerics
        self.near = near
        self.max_bytes = max_bytes
        self.n = num_return_sequences
        self.max_new_tokens = max_new_tokens
        self.capture = capture  # the job records logprobs (then a found sequence must have them)
        self.top_logprobs = top_logprobs  # a scoring job's alternatives per scored token
        self.counts = CacheCounts()
        self.touch = True  # a found entry counts as a use (the eviction order); a dry run only looks
        self.kept_entries: set[str] = set()  # held entries better than what this run computes: not written over

    @property
    def exact_possible(self) -> bool:
        """Whether this run's own numerics make exact hits (batch-invariant)."""
        return self.numerics.batch_invariant

    # -- generation ---------------------------------------------------------------------------------------------

    def answer(self, request: Request) -> Request:
        """Sets `request.answered` when every sequence of it is found and usable; else remembers its keys for
        `remember`."""
        if request.error is not None or request.input_ids is None:
            return request
        n = request.n or self.n
        keys = self.keyer.sequence_keys(request, n)
        if keys is None:
            self.counts.not_cached += 1
            return request
        request.cache_keys = keys
        cap = request.max_new_tokens or self.max_new_tokens
        found = []
        near = False
        for index, key in enumerate(keys):
            entry = self.store.get(key, touch=self.touch)
            if entry is None:
                continue
            if self._better_than_ours(entry, cap):
                self.kept_entries.add(key)
            usable = self._usable(entry, cap, request)
            if usable is None:
                continue
            completion, exact = usable
            completion.sample_index = index
            completion.request = request
            near = near or not exact
            found.append(completion)
        if len(found) < n:
            self.counts.misses += 1
            return request
        if near and not self.near:
            self.counts.near_hits_skipped += 1
            self.counts.misses += 1
            return request
        request.answered = found
        if near:
            self.counts.near_hits += 1
        else:
            self.counts.hits += 1
        return request

    def _better_than_ours(self, entry: dict[str, Any], cap: int) -> bool:
        """Whether a held entry is worth more than what this run would write over it: batch-invariant where this run
        is not (it serves exact hits), or with the same numerics and a longer sequence cut by a larger cap."""
        numerics = entry.get("numerics")
        if not isinstance(numerics, dict):
            return False
        if numerics.get("batch_invariant") and not self.numerics.batch_invariant:
            return True
        tokens = entry.get("tokens")
        return numerics == self.numerics.to_dict() and entry.get("finish") == "length" and isinstance(tokens, list) \
            and len(tokens) > cap

    def _usable(self, entry: dict[str, Any], cap: int, request: Request) -> tuple[Completion, bool] | None:
        """The entry as this request's sequence (and whether it is exact), or None when it is not its answer."""
        tokens = entry.get("tokens")
        if not isinstance(tokens, list) or entry.get("finish") not in ENDS:
            return None
        logprobs, top = entry.get("logprobs"), entry.get("top")
        if self.capture and logprobs is None:
            return None
        if request.top_logprobs:
            if top is None or entry.get("top_k", 0) < request.top_logprobs:
                return None
            top = [[ids[: request.top_logprobs], values[: request.top_logprobs]] for ids, values in top]
        else:
            top = None
        finish, text = entry["finish"], entry.get("text")
        if finish != "length" and len(tokens) > cap or finish == "length" and len(tokens) >= cap:
            tokens, logprobs, top, finish, text = tokens[:cap], _cut(logprobs, cap), _cut(top, cap), "length", None
        elif finish == "length":
            return None  # cut by a smaller cap than this request's: not its answer
        completion = Completion(request, 0, list(tokens), logprobs if self.capture else None, finish, None, text,
                                top_logprobs=[(list(ids), list(values)) for ids, values in top] if top else None)
        exact = self.numerics.batch_invariant and entry.get("numerics") == self.numerics.to_dict()
        return completion, exact

    def remember(self, group: list[Completion]) -> None:
        """Keeps each computed sequence of a request (not its errors, nor what the cache itself answered)."""
        request = group[0].request
        keys = request.cache_keys
        if request.answered is not None or keys is None:
            return
        cap = request.max_new_tokens or self.max_new_tokens
        for completion, key in zip(group, keys):
            if key in self.kept_entries:
                self.kept_entries.discard(key)
                continue
            if completion.error is not None or completion.finish_reason not in ENDS:
                continue
            top = completion.top_logprobs
            payload = {"tokens": completion.token_ids, "logprobs": completion.logprobs, "finish":
                       completion.finish_reason, "text": completion.text, "cap": cap,
                       "top": [[ids, values] for ids, values in top] if top else None,
                       "top_k": request.top_logprobs if top else 0, "numerics": self.numerics.to_dict()}
            if self.store.put(key, payload):
                self.counts.stored += 1

    # -- scores -------------------------------------------------------------------------------------------------

    def answer_score(self, request: ScoreRequest) -> ScoreRequest:
        """Sets a scoring row's result when held: exact where both runs scored each row alone (batch-invariant
        scoring) with the same numerics, else a near hit (used only with --cache-near-hits)."""
        inner = request.request
        if inner.error is not None or inner.input_ids is None:
            return request
        key = self.keyer.score_key(inner.ids, [list(c) for c in request.continuations], not request.continuations)
        inner.cache_keys = [key]
        entry = self.store.get(key, touch=self.touch)
        top = entry.get("top") if entry is not None else None
        if entry is None or not isinstance(entry.get("score"), dict) or self.capture and entry.get("logprobs") is None \
                or self.top_logprobs and (not top or entry.get("top_k", 0) < self.top_logprobs):
            self.counts.misses += 1
            return request
        exact = self.numerics.batch_invariant and entry.get("numerics") == self.numerics.to_dict()
        if self._better_than_ours(entry, 0):
            self.kept_entries.add(key)
        if not exact and not self.near:
            self.counts.near_hits_skipped += 1
            self.counts.misses += 1
            return request
        if top is not None:
            top = [(list(ids[: self.top_logprobs]), list(values[: self.top_logprobs])) for ids, values in top] \
                if self.top_logprobs else None
        inner.answered = [Completion(inner, 0, list(entry.get("tokens") or []),
                                     entry.get("logprobs") if self.capture else None, "stop", top_logprobs=top,
                                     score=Score(**entry["score"]))]
        if exact:
            self.counts.hits += 1
        else:
            self.counts.near_hits += 1
        return request

    def remember_score(self, group: list[Completion]) -> None:
        completion = group[0]
        request = completion.request
        if request.answered is not None or request.cache_keys is None or completion.error is not None:
            return
        if request.cache_keys[0] in self.kept_entries:
            self.kept_entries.discard(request.cache_keys[0])
            return
        score = completion.score
        top = completion.top_logprobs
        payload = {"tokens": completion.token_ids, "logprobs": completion.logprobs,
                   "top": [[ids, values] for ids, values in top] if top else None, "top_k": self.top_logprobs,
                   "score": {"logprob": score.logprob, "choice_logprobs": score.choice_logprobs,
                             "choice_tokens": score.choice_tokens} if score is not None else {},
                   "numerics": self.numerics.to_dict()}
        if self.store.put(request.cache_keys[0], payload):
            self.counts.stored += 1

    def kept(self, groups: Iterator[list[Completion]], *, scores: bool = False) -> Iterator[list[Completion]]:
        """The results as they come, each computed one kept on the way; the cache pruned at the end."""
        remember = self.remember_score if scores else self.remember
        try:
            for group in groups:
                remember(group)
                yield group
        finally:
            if self.counts.stored:
                self.store.prune(self.max_bytes)

    def report(self) -> dict[str, Any]:
        """What run.json says of the cache in this run."""
        return {"on": True, "directory": str(self.store.root.resolve()), "exact_hits_possible": self.exact_possible,
                "near_hit_policy": "used" if self.near else "computed afresh", **self.counts.to_dict()}
