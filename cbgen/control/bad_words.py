"""Bad words: text and token sequences a request never generates.

Two kinds, as a request's `bad_words` lists them:
- a token-id sequence (transformers' `bad_words_ids`): its last token is banned wherever the tokens before it end the
  sequence (prompt and generated together), so the sequence never occurs; a single id is banned outright. As
  transformers' NoBadWordsLogitsProcessor, a single end-of-sequence id is left alone (a job must be able to end).
- a string: banned as text, whatever tokens would spell it. vLLM bans a string's one or two tokenizations (as is and
  after a space); a model spells the same text from other pieces too ("hel" + "lo"), so cbgen works on the text:
  each token's text is known once per tokenizer, and at each step a token is banned when the text so far followed
  by the token's text would contain the word, that is when the token's text contains the word, or starts with the
  rest of a word whose beginning ends the text so far. The cost is one short decode per row and step, and a scan of
  the vocabulary per distinct word remainder (kept).

Special tokens' text is not text the reply shows, so no string bans them. A character split over byte-level pieces
(part of a multi-byte UTF-8 character in each token) is not seen as that character: a non-ASCII word spelled byte
by byte across tokens is not stopped.
"""

from __future__ import annotations

import weakref
from functools import cached_property
from typing import Any

import torch

BadWord = str | tuple[int, ...]


class VocabText:
    """Each token's text as it reads after other text (a leading space kept, as a SentencePiece tokenizer drops it
    from a text's first token), for one tokenizer and vocabulary. `VocabText.of` keeps one per tokenizer, so that a
    Generator's calls decode the vocabulary once (0.4 s for 49,152 tokens on a 2-core CPU)."""

    _made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, tokenizer: Any, vocab_size: int) -> VocabText:
        made = cls._made.get(tokenizer)
        if made is None or made.vocab_size != vocab_size:
            made = cls._made[tokenizer] = cls(tokenizer, vocab_size)
        return made

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        anchor = tokenizer.encode("a", add_special_tokens=False)
        self.anchor = anchor[:1]
        self._anchor_text = self._decode(self.anchor)
        self._starting: dict[str, torch.Tensor] = {}
        self._containing: dict[str, torch.Tensor] = {}

    def _decode(self, ids: list[int]) -> str:
        backend = getattr(self.tokenizer, "_tokenizer", None)  # a fast tokenizer's own: the same text, each step
        if backend is not None and hasattr(backend, "decode"):  # without transformers' per-call conversions
            return backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def text(self, ids: list[int]) -> str:
        """The text of `ids` as it reads after other text."""
        text = self._decode(self.anchor + ids)
        return text[len(self._anchor_text):] if text.startswith(self._anchor_text) else self._decode(ids)

    @cached_property
    def texts(self) -> list[str]:
        known = min(len(self.tokenizer), self.vocab_size)
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        decoded = self.tokenizer.batch_decode([self.anchor + [i] for i in range(known)], skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False)
        cut = len(self._anchor_text)
        texts = ["" if i in special else (t[cut:] if t.startswith(self._anchor_text) else t)
                 for i, t in enumerate(decoded)]
        return texts + [""] * (self.vocab_size - known)

    def starting_with(self, text: str) -> torch.Tensor:
        if text not in self._starting:
            self._starting[text] = torch.tensor([i for i, t in enumerate(self.texts) if t.startswith(text)],
                                                dtype=torch.long)
        return self._starting[text]

    def containing(self, text: str) -> torch.Tensor:
        if text not in self._containing:
            self._containing[text] = torch.tensor([i for i, t in enumerate(self.texts) if text in t],
                                                  dtype=torch.long)
        return self._containing[text]


class BadWords:
    """One request's bad words, ready to apply a step at a time: the ids banned whatever came before (`always`: single
    ids, and every token whose text holds a whole word), kept on the scores' device once per set, and those that
    depend on the tokens so far (`following`), worked out on the host each step."""

    def __init__(self, words: tuple[BadWord, ...], eos: tuple[int, ...] = (), vocab: VocabText | None = None) -> None:
        sequences = [w for w in words if not isinstance(w, str) and not (len(w) == 1 and w[0] in eos)]
        self.single = torch.tensor(sorted({w[0] for w in sequences if len(w) == 1}), dtype=torch.long)
        self.multi = [w for w in sequences if len(w) > 1]
        self.strings = sorted({w for w in words if isinstance(w, str)}, key=len)
        if self.strings and vocab is None:
            raise ValueError("string bad words need the tokenizer's vocabulary")
        self.vocab = vocab
        self.longest = max((len(w) for w in self.strings), default=0)
        self.on: dict[tuple[torch.device, int], torch.Tensor] = {}  # `always` on a device, cut to a logits width
        # (cbgen.control.penalties copies it there once)

    @cached_property
    def always(self) -> torch.Tensor:
        """The ids banned after any tokens, each once."""
        parts = [self.single]
        if self.strings:
            assert self.vocab is not None
            parts += [self.vocab.containing(word) for word in self.strings]
        return torch.unique(torch.cat(parts)) if len(parts) > 1 else self.single

    def following(self, tokens: list[int]) -> list[torch.Tensor]:
        """The ids that must not come after `tokens` (prompt and generated) because of them, as host index tensors:
        a token sequence's last id where the tokens end with its beginning, and the tokens whose text would finish a
        word that the text so far begins."""
        out = []
        ends = [w[-1] for w in self.multi if len(tokens) >= len(w) - 1 and tuple(tokens[len(tokens) - len(w) + 1:])
                == w[:-1]]
        if ends:
            out.append(torch.tensor(ends, dtype=torch.long))
        if self.strings and self.longest > 1:
            assert self.vocab is not None
            # enough recent tokens to hold a word's longest proper beginning (a token holds at least a byte)
            tail = self.vocab.text(tokens[-4 * self.longest:])[-(self.longest - 1):]
            for word in self.strings:
                out.extend(self.vocab.starting_with(word[j:]) for j in range(1, len(word))
                           if tail.endswith(word[:j]))
        return out

    def banned(self, tokens: list[int]) -> list[torch.Tensor]:
        """The token ids that must not come after `tokens` (prompt and generated), as index tensors."""
        return ([self.always] if self.always.numel() else []) + self.following(tokens)
