"""The step control waits for the device at most twice a step, whatever the number of rows (cbgen.control.processor's
docstring): counted, not timed. The scores are tagged as device tensors (a torch.Tensor subclass; everything computed
from them, made with an explicit device or copied to one is tagged too), and a torch function mode counts every
operation that would make the host wait for a GPU: reading a device value on the host (.item(), .tolist(), .cpu(),
.numpy(), int(), float(), bool() and index use, a copy to another device), the operations whose output size depends
on device values (boolean-mask indexing, nonzero, masked_select, unique, repeat_interleave by a tensor), and copies
from the host to the device that are waited for (without non_blocking=True). Before the step control kept its work
on the device, a step of 8 rows made 48 to 60 such waits and one of 64 rows 223 to 291 (of them reads of device
values and data-sized operations: 33 to 43, and 208 to 274): int(), float() and two .tolist() per row for its token,
logprob and top-k, a bool() per loop-stopped row, the penalties' index building and copies. Now one, the step's one
copy of its tokens, logprobs and top-k to the host.
Steps run through StepControl.prepare/first/choose on fake request states, with every control at once: logprobs and
top 5, a JSON grammar on some rows, seeded sampling, repetition/presence/frequency penalties, min_p, logit bias, bad
words (ids and text), no_repeat_ngram, min_tokens and the loop stop. Also: llguidance's own bitmask helper (the GPU
path) masks exactly what the eager unpack masks, whatever the vocabulary's width."""

from __future__ import annotations

import json
import traceback
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from cbgen.chat.formats import ResponseFormat
from cbgen.control.penalties import CONTROLS_KWARG, Controls
from cbgen.control.processor import GRAMMAR_KWARG, SEED_KWARG, StepControl

STEPS = 4
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a_rather_long_field_name", "another_one"],
          "properties": {"a_rather_long_field_name": {"type": "string"}, "another_one": {"type": "integer"}}}
CONTROLS = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4, "no_repeat_ngram_size": 2,
            "min_p": 0.05, "min_tokens": 3, "logit_bias": {"28": -5.0, "100": 2.0}, "bad_words": ["the", [11, 12]],
            "loop_stop": 2}


class DeviceTensor(torch.Tensor):
    """A tensor that stands for one on the GPU (torch keeps the subclass through operations on it)."""


T = torch.Tensor
HOST_READS = {T.item, T.tolist, T.cpu, T.numpy, T.__int__, T.__float__, T.__bool__, T.__index__, T.__array__}
SIZED_BY_DATA = {torch.nonzero, T.nonzero, torch.masked_select, T.masked_select, torch.unique, T.unique,
                 torch.argwhere, T.argwhere}
INDEXING = {T.__getitem__, T.__setitem__, T.index_put_, T.index_put, torch.index_put}


def _device_of(args, kwargs):
    """The device a .to() call names, if any."""
    for value in [*args[1:], kwargs.get("device")]:
        if isinstance(value, (str, torch.device)):
            return value
        if isinstance(value, torch.Tensor):  # .to(other): other's device
            return value.device
    return None


class Transfers(TorchFunctionMode):
    """Counts the operations on device tensors that would wait for the device, and tags the tensors that are made
    on the device (factories given a device, copies to one)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        on_device = any(isinstance(a, DeviceTensor) for a in tensors)
        wait = self._waits(func, args, kwargs) if on_device else self._uploads_and_waits(func, args, kwargs)
        if wait:
            where = next((f for f in reversed(traceback.extract_stack()[:-1]) if "/cbgen/" in f.filename), None)
            self.waits.append(f"{getattr(func, '__name__', func)} at {where.filename}:{where.lineno}"
                              if where else getattr(func, "__name__", str(func)))
        out = func(*args, **kwargs)
        if on_device and wait:  # what came back is on the host
            return tree_map(lambda t: t.as_subclass(torch.Tensor) if isinstance(t, DeviceTensor) else t, out)
        made_there = (not on_device and "device" in kwargs) or (func is T.to and _device_of(args, kwargs) is not None)
        if made_there:
            return tree_map(lambda t: t.as_subclass(DeviceTensor) if type(t) is torch.Tensor else t, out)
        return out

    @staticmethod
    def _uploads_and_waits(func, args, kwargs) -> bool:
        """A copy from the host to the device that waits (on a GPU, for all the work queued before it too)."""
        if func is T.to:
            return _device_of(args, kwargs) is not None and not kwargs.get("non_blocking", False)
        return func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None

    @staticmethod
    def _waits(func, args, kwargs) -> bool:
        if func in HOST_READS or func in SIZED_BY_DATA:
            return True
        if func is T.to:
            return _device_of(args, kwargs) is not None  # a copy to another device (or onto the host)
        if func is T.copy_:  # into a host tensor
            return not isinstance(args[0], DeviceTensor)
        if func in INDEXING:  # a boolean mask as an index
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            parts = index if isinstance(index, (tuple, list)) else (index,)
            return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
        if func in (torch.repeat_interleave, T.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        if func is torch.where:  # the one-argument form is nonzero
            return len(args) + len(kwargs) == 1
        return False


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    from cbgen.control.grammars import Grammars

    return Grammars(tokenizer, len(tokenizer))


def _requests(rows: int, vocab: int) -> list[SimpleNamespace]:
    controls = Controls.of(CONTROLS).key()
    schema = ResponseFormat("json_schema", json.dumps(SCHEMA, sort_keys=True)).key
    requests = []
    for i in range(rows):
        kwargs: dict = {SEED_KWARG: 1000 + i}
        if i % 4 == 0:
            kwargs[GRAMMAR_KWARG] = schema
        if i % 4 != 1:
            kwargs[CONTROLS_KWARG] = controls
        prompt = [(7 * i + j) % 900 + 20 for j in range(12 + i % 5)] + [vocab + 3]  # an id past the logits'
        generated = [42, 42] if i % 8 == 2 else []  # a loop already: the loop stop ends it on the first step
        state = SimpleNamespace(request_id=f"r{i}", initial_tokens=prompt, generated_tokens=generated,
                                logit_processor_kwargs=kwargs)
        requests.append(SimpleNamespace(state=state))
    return requests


def count_waits(rows: int, tokenizer, grammars, do_sample: bool = True) -> tuple[list[list[str]], StepControl]:
    """The operations that would wait for the device, per step, over STEPS steps of `rows` sequences."""
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    control = StepControl(vocab_size=vocab, grammars=grammars, do_sample=do_sample, capture=True, top_logprobs=5,
                          eos=(eos,), tokenizer=tokenizer)
    requests = _requests(rows, vocab)
    generator = torch.Generator().manual_seed(rows)
    waits = []
    for _ in range(STEPS):
        logits = (torch.randn(rows + 2, vocab, generator=generator) * 3).as_subclass(DeviceTensor)  # 2 prefilling
        with Transfers() as transfers:
            control.prepare(requests)
            scores = control.choose(control.first(logits))
        waits.append(transfers.waits)
        tokens = scores[:rows].argmax(dim=-1).as_subclass(torch.Tensor).tolist()  # transformers' own sampling
        for request, token in zip(requests, tokens):
            request.state.generated_tokens.append(token)
    return waits, control


@pytest.mark.parametrize("draw", ["compiled", "eager", "greedy"])
def test_a_step_waits_for_the_device_at_most_twice_whatever_the_rows(tokenizer, grammars, draw, monkeypatch):
    """The compiled draw runs on a CPU only; a GPU's draw is the eager one (the same arithmetic in torch operators)."""
    if draw == "eager":
        monkeypatch.setattr("cbgen.control.draw.draw_kernel", lambda: (None, "eager: for the test"))
    few, _ = count_waits(8, tokenizer, grammars, draw != "greedy")
    many, control = count_waits(64, tokenizer, grammars, draw != "greedy")
    counts = f"waits per step: {[len(s) for s in few]} at 8 rows, {[len(s) for s in many]} at 64; {many[0][:6]}"
    assert all(len(step) <= 2 for step in few + many), counts
    assert [len(step) for step in few] == [len(step) for step in many], counts  # not a wait more per row
    # the steps did what they count: every row recorded its logprobs and top 5, grammar rows followed their format
    records = {f"r{i}": control.take(f"r{i}") for i in range(64)}
    assert all(len(r.logprobs) == STEPS and len(r.top) == STEPS and len(r.top[0][0]) == 5
               for r in records.values() if r is not None)
    assert all(records[f"r{i}"].grammar for i in range(0, 64, 4)) and records["r2"].looped


def test_bitmask_helpers_agree():
    """llguidance's own helper (the GPU path; here without torch.compile's build, its operators run eagerly) masks
    what cbgen's eager unpack masks: vocabularies that are not a multiple of 32, and logits wider than the bitmask's
    words (every token past them masked)."""
    import torch._dynamo
    from llguidance.torch import apply_token_bitmask_inplace

    from cbgen.control.bitmask import _apply_bitmask

    generator = torch.Generator().manual_seed(3)
    for words, vocab in ((3, 70), (3, 96), (3, 100), (5, 150), (1536, 49152), (1536, 49157)):
        bitmask = torch.randint(-2**31, 2**31 - 1, (4, words), dtype=torch.int32, generator=generator)
        bitmask[0] = -1
        bitmask[1] = 0
        logits = torch.randn(4, vocab, generator=generator)
        ours, theirs = logits.clone(), logits.clone()
        _apply_bitmask(ours, bitmask)
        with torch._dynamo.config.patch(disable=True):
            apply_token_bitmask_inplace(theirs, bitmask)
        assert torch.equal(ours, theirs), (words, vocab)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little").astype(bool)
        assert torch.equal(torch.isfinite(ours), torch.from_numpy(bits) & torch.isfinite(logits))
