"""The settings sections that belong to one kind of stage each (cbgen.kinds: a kind's `own_section`): what a
score, embed, reward or chat job does besides what every job does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cbgen.config.setting import setting


@dataclass
class ScoreSection:
    choices: list[str] = setting(
        [], "Score each of these strings as a continuation of every row's prompt (rows may carry their own "
        "'choices' list instead): each one's summed and mean logprob, the probabilities among them, and the best. "
        "The prompt is computed once per row, whatever the number of choices. A label set such as 1,2,3,4,5 is the "
        "LLM-as-judge case. Comma-separated or repeated; spaces are kept, as they are part of the text scored "
        "(' yes, no' is ' yes' and ' no'). YAML: a list.")
    completion_column: str = setting(
        "completion", "Field holding the text to score after each row's prompt (or messages): its summed logprob, "
        "token count, mean logprob and perplexity. Dots reach into a nested value (answers.text).")
    text_column: str = setting(
        "text", "Field holding a text scored on its own, for rows without a prompt: every token after the first, "
        "for perplexity filtering. Dots reach into a nested value.")
    batch_tokens: int = setting(
        4096, "Tokens per forward pass: rows of similar length are packed into one padded batch up to this many "
        "(a longer row runs alone). Changes speed and memory; scores only by float rounding.")


@dataclass
class EmbedSection:
    text_column: str = setting(
        "text", "Field holding the text to embed (rows with a prompt, or a --template, embed that instead). Dots "
        "reach into a nested value.")
    pooling: Literal["auto", "mean", "cls", "max", "mean_sqrt_len", "last"] = setting(
        "auto", "How token vectors become one: auto takes the model's sentence-transformers pooling "
        "(1_Pooling/config.json), else the last token for a decoder model and the mean for an encoder. mean: "
        "over the text's tokens; cls: the first token's; max: per dimension; mean_sqrt_len: the sum over "
        "sqrt(length); last: the last token's (decoder embedding models).")
    normalize: bool | None = setting(
        None, "Scale each embedding to unit length (cosine similarity is then a dot product). Unset: as the "
        "model's sentence-transformers modules say (a Normalize module), else yes.")
    max_length: int | None = setting(
        None, "Tokens read per text; a longer text is cut to it and marked truncated. Unset: the model's own "
        "(sentence_bert_config.json's max_seq_length, else its position limit).")
    batch_tokens: int = setting(
        2048, "Tokens per forward pass: texts are batched up to this many. A BERT encoder's batches are packed "
        "end to end, so only real tokens count (larger batches ran slower on CPU: their activations leave the "
        "caches); other models' batches hold texts of similar length, padded tokens included. Changes speed and "
        "memory; embeddings only by float rounding.")
    packed: bool = setting(
        True, "Lay a batch's texts end to end with no padding, each attending to its own tokens (cbgen's compiled "
        "attention), where the model is a BERT encoder on CPU; elsewhere, or with --padded, batches are padded "
        "and run transformers' own attention. run.json says which ran, and why. Changes speed; embeddings only "
        "by float rounding.")


@dataclass
class RewardSection:
    completion_column: str = setting(
        "completion", "Field holding the answer to rate after each row's prompt (or messages), as the "
        "conversation's last assistant turn. A row with messages and no such field is rated as its messages "
        "stand. Dots reach into a nested value.")
    text_column: str = setting(
        "text", "Field holding a text rated as it is (no chat template), for rows without a prompt or messages.")
    max_length: int | None = setting(
        None, "Tokens read per conversation; a longer one is cut to it and marked truncated. Unset: the model's "
        "position limit.")
    batch_tokens: int = setting(
        8192, "Tokens per forward pass: conversations of similar length are batched up to this many (padded "
        "tokens included). Changes speed and memory; outputs only by float rounding.")


@dataclass
class ChatSection:
    max_turns: int = setting(
        2, "Assistant replies per conversation: it ends after this many (or sooner, when its listed user turns run "
        "out or the simulated user's message matches user_stop).")
    user_turns_column: str | None = setting(
        None, "Field holding a list of user messages, answered one after the other with the conversation so far "
        "(an MT-bench-style `turns` list). A row with a prompt or messages opens with them and the list follows; "
        "a row without opens with the list's first. Dots reach into a nested value.")
    user_template: str | None = setting(
        None, "The simulated user: a template (Jinja, TEXT or @FILE) over the row's fields and `messages`, the "
        "conversation so far, that the model is prompted with to write the next user message. A row without a "
        "prompt or messages has the simulated user open the conversation too (with `messages` empty).")
    user_system: str | None = setting(
        None, "System prompt of the simulated user (a template over the row's fields and `messages`, as "
        "user_template); unset: none.")
    user_stop: str | None = setting(
        None, "Regular expression: a simulated user's message in which it is found ends the conversation, and "
        "the message is left out (prompt the simulated user to write, say, <END> when it is done).")
    user_temperature: float | None = setting(
        None, "Sampling temperature of the simulated user; unset: the job's temperature. 0 is greedy.")
    user_max_new_tokens: int | None = setting(
        None, "Token cap of a simulated user's message; unset: the job's max_new_tokens.")
