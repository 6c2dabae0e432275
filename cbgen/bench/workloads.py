"""The workloads of `cbgen bench`, built from the model's own tokenizer and chat template, deterministically (a
seed per workload):

  mixed          chat questions of varied length, each with its own max_new_tokens drawn from 16..256
  shared-prefix  a few long system prompts, each shared by many short questions; short answers
  long-prompt    long documents to summarise in a few tokens (prefill-heavy)
  many-small     many short questions, short answers
  structured     requests for JSON records (a person with name, age, status, tags, address), run by cbgen twice:
                 under the records' JSON schema (`cbgen-json-schema`), then as free text (`cbgen`) with each request
                 capped at the length of its constrained answer, so that both do the same work; only cbgen paths run
  fixed          plain-text prompts of exactly 128 tokens, 64 new tokens each (end-of-sequence still stops a request):
                 the shape of llama.cpp's `llama-batched-bench -npp 128 -ntg 64 -npl 64`, for the llamacpp path
  sampling       64 requests for short Python functions, 128 new tokens, run by cbgen greedy (`cbgen`), sampled at
                 temperature 0.8 (`cbgen-sampled`), and seeded (`cbgen-seeded`, without batch invariance, then
                 `cbgen-seeded-invariant` with it, the default of a seeded job): what sampling costs per token
  scoring        nothing generated (cbgen score): half the rows judge an answer by the logprobs of the labels 1-5,
                 a quarter score a completion after its question, a quarter a document on its own; cbgen's scorer
                 against a plain loop of the model's forward over padded batches (cbgen.bench.scoring)
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

WORDS = (
    "river mountain engine harvest lantern market window silver garden theory signal orbit canvas thunder "
    "pattern bridge ocean library winter compass factory meadow crystal voyage rhythm castle planet forest "
    "machine ember quiet swift bright ancient hidden gentle distant golden frozen curious steady hollow "
    "measure explain compare describe imagine consider follow gather notice travel wonder balance"
).split()


@dataclass
class BenchWorkload:
    """Prompts and their caps. With per-request caps (`caps`), paths that cannot stop a request at its own cap
    (`generate_batch`, static batches) run to the largest cap and only tokens up to each request's cap count."""

    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    caps: list[int] | None = None
    schema: dict[str, Any] | None = None  # the structured workload's: the cbgen path also runs under it
    # the scoring workload's: per prompt, the continuations scored after it (none: the prompt is a text scored on its
    # own), and whether they are choices
    continuations: list[tuple[tuple[int, ...], ...]] | None = None
    choices: list[bool] | None = None
    sampling: bool = False  # the sampling workload's: the cbgen path runs greedy, sampled and seeded

    def cap(self, i: int) -> int:
        return self.caps[i] if self.caps else self.max_new_tokens

    def cut(self, requests: int, new_tokens: int, prompt_tokens: int | None = None) -> BenchWorkload:
        """The first `requests` prompts (each cut to its first `prompt_tokens`, where given), each capped at
        `new_tokens` new tokens: a smaller run of the same kind."""
        prompts = [p[:prompt_tokens] for p in self.prompts[:requests]]
        return BenchWorkload(self.name, prompts, new_tokens, schema=self.schema,
                             continuations=self.continuations[:requests] if self.continuations else None,
                             choices=self.choices[:requests] if self.choices else None, sampling=self.sampling)


def warm_up(workload: BenchWorkload) -> BenchWorkload:
    """First-call costs (weights packed, kernels built, buffers grown) paid off the clock on little work: the first
    16 tokens of two of `workload`'s prompts, 2 new tokens each."""
    return workload.cut(2, 2, 16)


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _chat(tokenizer, user: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


SIZES = {  # requests per workload; "small" fits a 2-core CPU in a few minutes per path
    "tiny": {"mixed": 4, "shared-prefix": 8, "long-prompt": 2, "many-small": 8, "structured": 4, "fixed": 4,
             "scoring": 8, "sampling": 4},
    "small": {"mixed": 96, "shared-prefix": 64, "long-prompt": 8, "many-small": 128, "structured": 64, "fixed": 64,
              "scoring": 128, "sampling": 64},
    "medium": {"mixed": 128, "shared-prefix": 256, "long-prompt": 32, "many-small": 512, "structured": 256,
               "fixed": 256, "scoring": 512, "sampling": 256},
}
ROLES = "nurse pilot chef teacher farmer engineer painter librarian".split()
CITIES = "Paris Lagos Osaka Lima Oslo Denver Cairo Perth".split()
RECORD_SCHEMA = {  # the structured workload's: bounded, so that a small greedy model cannot loop inside a string
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "status", "tags", "address"],
    "additionalProperties": False,
}


def _plain(tokenizer, rng: random.Random, length: int) -> list[int]:
    """`length` tokens of plain text (no chat template), as llama-batched-bench's prompts are."""
    ids: list[int] = []
    while len(ids) < length:
        ids = list(tokenizer(" ".join(rng.choice(WORDS) for _ in range(2 * length))
                             .capitalize(), add_special_tokens=False)["input_ids"])
    return ids[:length]


def build_workloads(tokenizer, size: str = "small", names: Sequence[str] | None = None) -> list[BenchWorkload]:
    counts = SIZES[size]
    scale = {"tiny": 0.1, "small": 1.0, "medium": 1.0}[size]
    out = []
    for name in names or counts:
        rng = random.Random(name)
        n = counts[name]
        if name == "mixed":
            prompts = [_chat(tokenizer, " ".join(_sentence(rng, rng.randint(5, 20)) for _ in range(rng.randint(1, 6)))
                             + " Explain.") for _ in range(n)]
            top = 256 if size != "tiny" else 16
            out.append(BenchWorkload(name, prompts, top, [rng.randint(min(16, top), top) for _ in range(n)]))
        elif name == "shared-prefix":
            systems = [" ".join(_sentence(rng, 12) for _ in range(max(1, int(40 * scale)))) for _ in range(4)]
            prompts = [_chat(tokenizer, f"Question {i}: {_sentence(rng, 8)}", rng.choice(systems)) for i in range(n)]
            out.append(BenchWorkload(name, prompts, 8))
        elif name == "long-prompt":
            prompts = [_chat(tokenizer, " ".join(_sentence(rng, 14) for _ in range(max(1, int(70 * scale))))
                             + " Summarise in one sentence.") for _ in range(n)]
            out.append(BenchWorkload(name, prompts, 16))
        elif name == "many-small":
            prompts = [_chat(tokenizer, _sentence(rng, rng.randint(3, 10))) for _ in range(n)]
            out.append(BenchWorkload(name, prompts, 16))
        elif name == "structured":
            prompts = [_chat(tokenizer, f"Create a JSON record for a fictional {ROLES[i % 8]} who lives in "
                             f"{CITIES[i // 8 % 8]}, with name, age, status (active, inactive or pending), a few tags "
                             "and address (city and 5-digit zip).", "You output only JSON.") for i in range(n)]
            out.append(BenchWorkload(name, prompts, 160 if size != "tiny" else 24, schema=RECORD_SCHEMA))
        elif name == "fixed":
            length, new = (128, 64) if size != "tiny" else (32, 8)
            out.append(BenchWorkload(name, [_plain(tokenizer, rng, length) for _ in range(n)], new))
        elif name == "scoring":
            out.append(_scoring(tokenizer, rng, n, scale))
        elif name == "sampling":
            tasks = ("reverses a string", "sums a list", "counts vowels", "checks for a palindrome", "merges two "
                     "sorted lists", "finds the largest number", "removes duplicates", "computes a factorial")
            prompts = [_chat(tokenizer, f"Write a Python function that {tasks[i % 8]} (variant {i}).")
                       for i in range(n)]
            out.append(BenchWorkload(name, prompts, 128 if size != "tiny" else 8, sampling=True))
        else:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(counts)}")
    return out




def _scoring(tokenizer, rng: random.Random, n: int, scale: float) -> BenchWorkload:
    """Judged answers (labels 1-5), completions after their questions and documents, in a shuffled input order."""
    def text(sentences: int, words: tuple[int, int] = (6, 16)) -> str:
        return " ".join(_sentence(rng, rng.randint(*words)) for _ in range(max(1, int(sentences * scale))))

    def ids(value: str) -> tuple[int, ...]:
        return tuple(tokenizer(value, add_special_tokens=False)["input_ids"])

    labels = tuple(ids(label) for label in "12345")
    prompts, continuations, choices = [], [], []
    for i in range(n):
        kind = ("judge", "judge", "completion", "text")[i % 4]
        if kind == "judge":
            prompts.append(_chat(tokenizer, f"Question: {text(rng.randint(1, 3))}\nAnswer: {text(rng.randint(2, 8))}"
                                 "\nRate the answer from 1 to 5. Reply with one digit."))
            continuations.append(labels)
        elif kind == "completion":
            prompts.append(_chat(tokenizer, text(rng.randint(1, 4)) + " Explain."))
            continuations.append((ids(text(rng.randint(2, 10))),))
        else:
            prompts.append(list(tokenizer(text(rng.randint(4, 24)))["input_ids"]))
            continuations.append(())
        choices.append(kind == "judge")
    order = list(range(n))
    rng.shuffle(order)
    return BenchWorkload("scoring", [prompts[i] for i in order], 0, continuations=[continuations[i] for i in order],
                         choices=[choices[i] for i in order])


@dataclass
class Measurement:
    workload: str
    path: str
    seconds: float
    requests: int
    prompt_tokens: int
    generated_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.seconds

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.seconds
