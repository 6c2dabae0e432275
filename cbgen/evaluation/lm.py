"""`lm_eval --model cbgen`: lm-eval's three request types on cbgen's scorer and engine.

    loglikelihood          (context, continuation) ─TemplateLM's split─▶ token ids ─scorer─▶ (sum, is_greedy)
    loglikelihood_rolling  text ─lm-eval's rolling windows─▶ (context, continuation) ids ─scorer─▶ Σ per text
    generate_until         (context, gen_kwargs) ─ids, cap, stops─▶ engine (continuous batching) ─▶ text cut at stops

The tokenization follows `--model hf` to the letter (the context split, the prefix token for an empty context, the
left truncation, the windows, the stop handling), so the two backends see the same token ids and differ only by
how fast they compute: the scorer packs rows of similar length into forward passes bounded in tokens, and
generation runs on transformers' continuous batching instead of static batches that wait for their longest row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from cbgen.errors import CbgenError

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

    from cbgen.config import JobConfig
    from cbgen.model.load import LoadedModel

DEFAULT_MAX_GEN_TOKS = 256  # as --model hf
# lm-eval's generation kwargs that are cbgen job settings of the same meaning (the others are refused by name)
SAMPLING_KWARGS = ("temperature", "top_p", "top_k")
# what lm-eval itself passes to every model (its --batch_size, --max_batch_size, --device): cbgen batches
# continuously, so the first two have nothing to set; the device is taken when it can be had
HARNESS_ARGS = ("batch_size", "max_batch_size", "device")


class CbgenLM(TemplateLM):
    """A cbgen model for lm-eval. Every model argument is a cbgen setting by its YAML name (`model`, `dtype`,
    `max_batch_tokens`, `page_size`, `batch_invariant`, ...); an unknown one fails naming the closest."""

    def __init__(self, model: str | None = None, max_length: int | None = None, **args: Any) -> None:
        super().__init__()
        from cbgen.api import Generator
        from cbgen.config.flat import keyword_overrides

        harness = {name: args.pop(name) for name in HARNESS_ARGS if name in args}
        settings = dict(args)
        device = harness.get("device")
        if device is not None and "device" not in settings:
            chosen = harness_device(str(device))
            if chosen is not None:
                settings["device"] = chosen
        self._settings = {**settings, **({"model": model} if model is not None else {})}
        try:  # checked here, so that the message names lm-eval's model args
            keyword_overrides(self._settings)
        except TypeError as error:  # lm-eval's message names the model args, not a Python call
            raise CbgenError(f"--model_args: {str(error).replace('unexpected keyword argument', 'unknown setting')}"
                             ) from None
        self.generator = Generator(model, progress=False, **settings)
        self.loaded: LoadedModel = self.generator.loaded
        self.tokenizer = self.loaded.tokenizer
        self._max_length = max_length

    # -- what lm-eval asks of a model --------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context becomes (the BOS token, else EOS), as --model hf."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return int(self._max_length)
        from lm_eval.models.utils import resolve_max_length

        return resolve_max_length(self.loaded.model.config, self.tokenizer)

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """As --model hf: the tokenizer's own default for special tokens, none added to a text that starts with
        the BOS token."""
        from lm_eval.models.utils import has_bos_prefix

        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            options = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **options)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt))

    # -- loglikelihood -----------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: Sequence[tuple[Any, list[int], list[int]]], **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """(summed logprob, whether each token was the model's greedy choice) of each continuation after its
        context, in the order given. Continuations of one context (a multiple-choice question's choices) are scored
        side by side behind it, the context computed once."""
        pairs = [self._fit(list(context), list(continuation)) for _, context, continuation in requests]
        results = self._score(pairs)
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's logprob, every token predicted once, in windows of the model's context (lm-eval's rules)."""
        windows: list[tuple[None, list[int], list[int]]] = []
        counts = []
        for (text,) in (request.args for request in requests):
            found = [make_disjoint_window(window) for window in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            windows += [(None, context, continuation) for context, continuation in found]
            counts.append(len(found))
        scores = self._loglikelihood_tokens(windows)  # a text's windows have contexts of their own
        results, at = [], 0
        for request, count in zip(requests, counts):
            total = sum(score for score, _ in scores[at:at + count])
            at += count
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            results.append(total)
        return results

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """A pair cut on the left to the model's context as --model hf cuts it (the continuation kept whole)."""
        if not continuation:
            raise CbgenError("loglikelihood: an empty continuation has nothing to score")
        if len(continuation) > self.max_length:
            raise CbgenError(f"loglikelihood: a continuation of {len(continuation)} tokens is longer than the "
                             f"model's context ({self.max_length}); give a larger max_length or a shorter target")
        whole = (context + continuation)[-(self.max_length + 1):]
        return whole[: len(whole) - len(continuation)], continuation

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        from cbgen.job.sequence import score_in_memory
        from cbgen.progress import NullProgress
        from cbgen.records import PromptRecord, Request, ScoreTarget
        from cbgen.score.requests import ScoreRequest

        contexts: dict[tuple[int, ...], list[int]] = {}  # a context's ids -> the pairs scored after it
        for index, (ids, _) in enumerate(pairs):
            contexts.setdefault(tuple(ids), []).append(index)
        requests = []
        for row, (context, members) in enumerate(contexts.items()):
            continuations = tuple(tuple(pairs[i][1]) for i in members)
            target = ScoreTarget(choices=("",) * len(members))  # scored as choices: side by side, one context
            requests.append(ScoreRequest(Request(PromptRecord(str(row), row, f"request {members[0]}", target=target),
                                                 input_ids=list(context)), continuations))
        scored = score_in_memory(self._job(kind="score"), self.loaded, requests, NullProgress(), top_logprobs=1)
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for completion, members in zip(scored, contexts.values()):
            if completion.finish_reason == "error":
                raise CbgenError(f"cbgen could not score {completion.error}")
            assert completion.score is not None and completion.score.choice_tokens is not None
            start = 0
            for index, length in zip(members, completion.score.choice_tokens):
                tokens = completion.token_ids[start:start + length]
                top = (completion.top_logprobs or [])[start:start + length]
                values = (completion.logprobs or [])[start:start + length]
                results[index] = (float(sum(values)), _greedy(tokens, top))
                start += length
        return results

    # -- generate_until ----------------------------------------------------------------------------------------

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, stopped at its `until` strings (and EOS) and cut before them, as --model hf
        returns it; requests with the same sampling settings share one continuous-batching run."""
        eos = str(self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False))
        groups: dict[str, list[_Generation]] = {}
        for index, (context, raw) in enumerate(request.args for request in requests):
            kwargs = normalize_gen_kwargs(dict(raw), DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            cap = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - cap
            if room <= 0:
                raise CbgenError(f"generate_until: max_gen_toks {cap} leaves no room for a prompt in the model's "
                                 f"context ({self.max_length})")
            sampling = _sampling(kwargs)
            wanted = _Generation(index, self.tok_encode(context)[-room:], cap, until, sampling)
            groups.setdefault(repr(sorted(sampling.items())), []).append(wanted)
        texts = [""] * len(requests)
        for members in groups.values():
            rows = [{"id": str(m.index), "input_ids": m.ids, "max_new_tokens": m.cap, "stop": [s for s in m.until if s]}
                    for m in members]
            by_index = {m.index: m for m in members}
            for result in self.generator.generate(rows, **members[0].sampling):
                wanted = by_index[int(result.id)]
                if result.finish_reason == "error":
                    raise CbgenError(f"cbgen could not generate for request {wanted.index}: {result.error}")
                text = str(self.tokenizer.decode(result.token_ids, skip_special_tokens=True))
                texts[wanted.index] = postprocess_generated_text(text, wanted.until, None)
        for request, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    def _job(self, kind: str) -> JobConfig:
        """The job the model args describe (the Generator's own settings), as a job of `kind`."""
        from cbgen.config import build_config
        from cbgen.config.flat import keyword_overrides
        from cbgen.kinds import kind_of

        return build_config(None, keyword_overrides(self._settings, own_section=kind_of(kind).own_section), kind=kind)


@dataclass(frozen=True)
class _Generation:
    """One generate_until request as cbgen runs it: its context's token ids, cap, stops and sampling settings."""

    index: int
    ids: list[int]
    cap: int
    until: list[str]
    sampling: dict[str, Any]


def _greedy(tokens: list[int], top: list[tuple[list[int], list[float]]]) -> bool:
    """Whether every scored token was the model's most likely one (lm-eval's is_greedy)."""
    return len(top) == len(tokens) and all(ids and ids[0] == token for (ids, _), token in zip(top, tokens))


def _sampling(kwargs: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's generation kwargs (normalized: do_sample and temperature set) as cbgen settings."""
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = kwargs.pop("temperature", 0.0)
    chosen = {name: kwargs.pop(name) for name in SAMPLING_KWARGS[1:] if kwargs.get(name) is not None}
    if kwargs:
        raise CbgenError(f"generate_until: cbgen has no setting for the generation kwargs {sorted(kwargs)}; it takes "
                         f"do_sample, until, max_gen_toks and {', '.join(SAMPLING_KWARGS)}")
    if not do_sample or not temperature:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(temperature), **chosen}


def harness_device(device: str) -> str | None:
    """cbgen's device setting for lm-eval's --device (cuda:0 unless told, which every model is given), or None to
    keep cbgen's own choice: a CUDA device only where CUDA is visible here (lm-eval passes cuda:0 on a CPU machine
    too), as cbgen's "cuda", the first visible GPU; another index is refused in one line (CUDA_VISIBLE_DEVICES
    picks the GPU)."""
    kind, _, index = device.partition(":")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
        if index not in ("", "0"):
            raise CbgenError(f"lm-eval's --device {device}: cbgen runs on the first visible GPU; choose that GPU with "
                             f"CUDA_VISIBLE_DEVICES={index} and --device cuda")
        return "cuda"
    if kind == "cpu":
        return "cpu"
    raise CbgenError(f"lm-eval's --device {device}: cbgen runs on cpu or cuda; give --device cpu or --device cuda")
