"""`cbgen score`: the model's own logprobs of given text, for every row of a file, without generating."""

from __future__ import annotations

from typing import Any

from cbgen.cli._options import ConfigFile, InputPath, score_options
from cbgen.cli.run import job_command

EPILOG = (
    "[bold]Examples[/bold]\n\n"
    "  cbgen score answers.jsonl -o scores/   [dim]# rows with prompt (or messages) and completion[/dim]\n\n"
    "  cbgen score docs.parquet --text-column body -o ppl/   [dim]# perplexity of each document[/dim]\n\n"
    "  cbgen score rated.jsonl --template 'Rate this answer 1-5: {{ answer }}' --choices 1,2,3,4,5 -o judged/\n\n"
    "[bold]What a row scores[/bold]: its 'choices' (or --choices), each as a continuation of its prompt; else its "
    "completion (--completion-column) after its prompt; else, with no prompt, its text (--text-column) on its "
    "own. Prompts are rendered as cbgen run renders them (chat template with the generation prompt, --template, "
    "--raw-prompts). A row that cannot be scored (an empty completion, choices that are not strings, a text "
    "longer than the context) becomes an error record; the job goes on.\n\n"
    "[bold]Output[/bold]: DIR/part-00000.jsonl ... with one row per input row (id, num_prompt_tokens, "
    "num_scored_tokens, logprob, mean_logprob, perplexity, choices, choice_logprobs, choice_mean_logprobs, "
    "choice_probs, best_choice, error, \\[token_ids, logprobs, top_logprobs], kept columns) and DIR/run.json. "
    "Logprobs are the model's own log-softmax. Resuming, sharding, --redo failed, status and merge work as for "
    "cbgen run.\n\n"
    "[bold]Exit codes[/bold]: 0 every row scored · 1 some rows failed (they are in the output with their error) · 2 "
    "usage, configuration or input-file error · 3 unexpected internal error (CBGEN_DEBUG=1 shows the traceback) · 4 "
    "stopped after more than --max-errors failures · 75 stopped by SIGTERM or Ctrl-C (resumable)."
)


@score_options
def score(
    input_path: InputPath = None,
    config: ConfigFile = None,
    *,
    overrides: dict[tuple[str, str], tuple[Any, str]],
):
    """Score text with the model: completions after their prompts, choices, or texts on their own."""
    job_command(input_path, config, overrides, "score", "cbgen score")
