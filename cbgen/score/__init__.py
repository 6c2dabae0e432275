"""Scoring without generating (`cbgen score`): the model's own logprobs of given text, row by row.

    PromptRecord ──ScoreRenderer──▶ ScoreRequest ──Scorer──▶ Completion (with a Score) ──ScoreRows──▶ score row
     (target: completion,         (context ids +        (packed forward passes,             (sums, means,
      choices or a text)           continuations)        chunked log-softmax)                choices, best)

A row scores a completion after its prompt, each of its choices after its prompt (the prompt computed once, the
choices side by side behind it), or a text on its own. The rest of a job (reading, ids, shards, resume, writing)
is `cbgen run`'s own: cbgen.job.run runs a scoring job with the Scorer in the engine's place.
"""
