"""The sections of a job configuration, each field with its default and its help text.

These dataclasses are the one source of cbgen's defaults and of what each setting means: the command-line help
(`cbgen.cli._options`) and the YAML template (`cbgen.config.template`) are both made from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from cbgen.config.batching import BATCHING_FIELDS
from cbgen.config.kind_sections import ChatSection, EmbedSection, RewardSection, ScoreSection
from cbgen.config.setting import setting
from cbgen.kinds import DEFAULT


def help_of(section: str, key: str) -> str:
    if section == "batching":
        return BATCHING_FIELDS[key].help
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == key).metadata["help"]


def default_of(section: str, key: str) -> Any:
    if section == "batching":
        return BATCHING_FIELDS[key].default
    return getattr(SECTIONS[section](), key)


MAX_LINE_BYTES = 32 << 20  # more than a prompt for a million-token context takes as JSON text
RANDOM_SHAPE_NAMES = "llama-1b, llama-3b, llama-8b, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, smollm2-135m"


@dataclass
class ModelSection:
    model: str | None = setting(
        None, "Hub id, local model folder, or .gguf file (its tokenizer comes from the same file); or random weights "
        f"for benchmarking: a config.json, or a shape name ({RANDOM_SHAPE_NAMES}). Default: the embedded "
        "SmolLM2-135M-Instruct.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = setting(
        "auto", "Weight and activation precision. auto: bfloat16 on CUDA (float16 on GPUs without bf16); on CPU, "
        "from the CPU-kind table: bfloat16 with bf16 matrix units (AMX or AVX-512 BF16), else float32.")
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "Where the model runs. auto: CUDA when visible (the first visible GPU: CUDA_VISIBLE_DEVICES picks).")
    attn_implementation: str | None = setting(
        None, "Attention: per-sequence (cbgen's CPU attention for continuous batching: each request attends only to "
        "its own KV), sdpa, paged|eager, or a flash_attention_* name. Default: what the model supports: on CPU "
        "per-sequence where it applies, else sdpa, else eager; on CUDA flash_attention_3, else flash_attention_2, "
        "when installed.")
    adapter: str | list[str] | None = setting(
        None, "LoRA adapters (PEFT folders or hub ids). PATH: for every row that names none. NAME=PATH (repeatable): "
        "one a row picks by its 'adapter' field (an OpenAI line by its body's 'model'). Merged into the base weights "
        "while its rows run: the answers of PEFT's merged model.")
    adapter_any_base: bool = setting(
        False, "Run adapters whose adapter_config.json names another base model (base_model_name_or_path) than "
        "--model. Off: refused before the model loads, since an adapter of the right shapes trained on another model "
        "gives wrong answers without an error; on: for the same model under two names.")
    trust_remote_code: bool = setting(
        False, "Allow the model folder's own Python code to run. Off unless you trust its author.")
    cache_dir: str | None = setting(
        None, "Where GGUF models converted to safetensors are cached, so only the first run dequantizes them. "
        "Default: $CBGEN_CACHE_DIR, else $XDG_CACHE_HOME/cbgen (~/.cache/cbgen).")
    use_cache: bool = setting(
        True, "Use (and fill) the converted-GGUF cache; off dequantizes the GGUF file on every run.")
    onednn_linear: bool = setting(
        False, "On CPU, run the float32 or bfloat16 linear layers through oneDNN with weights prepacked once at load, "
        "instead of torch's default matmul. float32 on AVX2: 1.06-1.22x a whole job. bfloat16 with bf16 units: each "
        "decode-sized matmul 1.3-2.2x as fast, whole jobs within noise (0.81-1.04x). Costs a second copy of the "
        "weights; results can differ from the stock path in the last bit, so a greedy token can differ at a "
        "near-tie.")
    quantize: Literal["auto", "none", "int8", "w8a8"] = setting(
        "auto", "Weights of the decoder layers' linear layers. int8: held as 8-bit integers with a scale per 32 inputs "
        "(GGUF's Q8_0 scheme), a quarter of float32's memory, computed by cbgen's compiled kernel on the CPU "
        "(batch-invariant), answering as the dequantized model. w8a8: the same weights, and each layer's input rows "
        "quantized to 8 bits too, as llama.cpp's Q8_0 path does: integer products (AVX-512 VNNI), faster than int8 "
        "and than bfloat16 where the CPU has VNNI, but answers that differ from the dequantized model's about as "
        "much as bfloat16's do (elsewhere a plain loop, slow). auto: int8 for a Q8_0 GGUF file (its own 8-bit "
        "values, read from the file as they are, embeddings included: about the file's size in memory), none "
        "otherwise. Not with adapters or --tp.")
    linear_row_buckets: bool | None = setting(
        None, "On CPU in bfloat16 or float16, run each linear layer at one of a few row counts (multiples of 8 up to "
        "64, then four per doubling), the extra rows zero. oneDNN keeps a compiled kernel (about 0.7 MB) for every "
        "row count it meets, so a long job of varied batches would hold hundreds: this keeps about 100, some 150 MB "
        "less for the embedded model, at the same speed within measurement noise. Default: on where it applies "
        "(bfloat16 or float16 on CPU in one process, without --onednn-linear).")
    fused_layers: bool | None = setting(
        None, "On CPU, compute each decoder layer of the architectures cbgen knows (Llama, Mistral, Qwen2, Qwen3) "
        "with fewer, larger operators: query/key/value and gate/up projections as one matmul each, rotary, norms "
        "and residuals in place. The same operators as transformers', so greedy tokens match it; the merged "
        "matmuls may round differently in the last bit. Default: on where the model fits (run.json says why not).")
    compiled_ops: bool | None = setting(
        None, "On CPU, run the fused decoder layers' RMSNorms (with the residual addition before the second), "
        "rotary embedding and SiLU * up as cbgen's compiled operators: one pass over the rows each, instead of some "
        "25 small eager operators a layer. The elementwise ones are bitwise transformers'; RMSNorm sums a row's "
        "squares in its own order (float32 may differ in the last bit). Built from C++ on first use, as the "
        "compiled attention. Default: on where they build and fit the model (run.json says why not).")
    compiled_linear: bool | None = setting(
        None, "On CPU, in a batch-invariant job, run the linear layers as cbgen's compiled kernel: every block of 64 "
        "rows x one panel of output columns (32 in float32 on AVX2, else 64) computed by oneDNN's micro-kernel in a "
        "fixed order, by one thread, so a row's bits are its own with no padded tiles (the fixed tiles' way: "
        "--no-compiled-linear). float32 on AVX2 and up, "
        "bfloat16 on CPUs with bfloat16 units. Built from C++ on first use, as the compiled attention. Default: on "
        "where it builds and fits the model (run.json says why not).")
    compiled_attention: bool | None = setting(
        None, "On CPU, attend with cbgen's compiled kernel: every query row of a step in one call per layer, keys "
        "and values read where they lie in the paged cache, each row's result depending on its own keys only "
        "(batch-invariant by construction). Built from C++ on first use (about 20 s with g++, cached under "
        "$CBGEN_KERNEL_CACHE_DIR, else $CBGEN_CACHE_DIR/kernels). Default: on where it builds and fits the model; "
        "without a compiler, or for a model it does not fit, cbgen's eager CPU attention runs and run.json says why.")
    batch_invariant: bool | None = setting(
        None, "Batch-invariant numerics: every linear layer in fixed-shape row tiles and every token's attention in a "
        "call shaped by its own position, so a sequence's tokens and logprobs are bitwise the same whatever shares "
        "its batches (batch limits, input order, resume, shards, --data-parallel). Default: on for every job where "
        "cbgen's compiled attention runs (it is invariant by construction, so only the linear tiles cost); else on "
        "for seeded jobs (--seed) where cbgen's eager CPU attention runs, off otherwise "
        "(docs/performance.md: the cost). Not with --tp. For cbgen score: on by default where the compiled "
        "attention runs (rows packed end to end, each attending its own tokens: no padding, each row's scores its "
        "own bits); elsewhere --batch-invariant scores every row in a forward pass of its own.")
    tp_size: int = setting(
        1, "Tensor parallel: shard the model over N processes, started with `torchrun --nproc-per-node N -m cbgen run "
        "... --tp N` (gloo on CPU, NCCL on GPUs). Rank 0 reads the input, writes the output and shows progress. A "
        "model whose attention heads do not split N ways shards only its MLP and embeddings.")


@dataclass
class InputSection:
    path: str | None = setting(
        None, "Prompts: a JSONL or Parquet file (or a folder of them), an OpenAI Batch API file, a Hugging Face "
        "dataset (save_to_disk folder, dataset folder or hub id); - reads JSONL from stdin.")
    same_input: bool = setting(
        False, "Resume a job that reads stdin: you say the feed is the one the earlier run read (cbgen cannot tell "
        "a stream's identity; without this a stdin job does not resume). Rows already written are skipped by id.")
    prompt_column: str | None = setting(
        None, "Field holding the prompt: text, a list of chat messages, or token ids. Dots reach into a nested "
        "value (talks.messages: a chat stage's conversations, in a pipeline). Default: each row's 'prompt', "
        "'messages' or 'input_ids'.")
    id_column: str | None = setting(
        None, "Field holding a unique id per row, copied to the output. Default: the rows' 'id' field when they have "
        "one (custom_id for OpenAI batch files), else the row number from 0.")
    keep_columns: list[str] = setting([], "Input fields copied into every output row; comma-separated or repeated.")
    raw_prompts: bool = setting(
        False, "Tokenize 'prompt' text as is, instead of as one user turn of the model's chat template (the default "
        "when the tokenizer has one).")
    format: Literal["auto", "jsonl", "parquet", "openai", "dataset"] = setting(
        "auto", "What the input is. auto: from the path: .jsonl/.json/.ndjson (OpenAI Batch API lines are recognised "
        "by their custom_id and body), .parquet, a folder of them, a dataset saved with save_to_disk, or a Hugging "
        "Face hub dataset id.")
    split: str | None = setting(
        None, "Dataset split to read (Hugging Face datasets). Default: train, or the only split.")
    subset: str | None = setting(None, "Dataset configuration (subset) name, for hub datasets that have several.")
    max_line_bytes: int = setting(
        MAX_LINE_BYTES, "Longest JSONL line read, in bytes; a longer one becomes that row's error record without "
        "being read into memory. The default holds a prompt for a million-token context.")
    template: str | None = setting(
        None, "Make each row's prompt from its columns: a Jinja2 template (TEXT, or @FILE) rendered with the row's "
        "fields as variables ({{ topic }}, {{ doc.title }}, loops); its result is the user turn, or the whole prompt "
        "with --raw-prompts. Rows then need no prompt field. A row lacking a variable becomes an error record.")
    system: str | None = setting(
        None, "A system turn before the prompt, itself a template over the row's columns (TEXT, or @FILE).")
    messages: list[dict] = setting(
        [], "Turns between the system turn and the template's user turn, each {role, content} with content a "
        "template over the row's columns: few-shot examples (YAML only).")
    max_render_chars: int | None = setting(
        None, "Largest prompt (and largest value inside it) a template may build for one row, in characters; a row "
        "whose template would go past it becomes an error record. Default: 16 characters per token of the model's "
        "context (131,072 for the embedded model), or 1,000,000 when the context cannot be read.")
    render_timeout: float = setting(
        10.0, "Most seconds a template may take to render one row; a row that takes longer becomes an error record.")


@dataclass
class GenerationSection:
    max_new_tokens: int = setting(256, "Most tokens generated per sequence.")
    do_sample: bool | None = setting(
        None, "Sample the next token, or always take the most likely one. Default: sample when temperature (above "
        "0), top_p or top_k is given, else greedy.")
    temperature: float | None = setting(
        None, "Sampling temperature; lower is more deterministic. 0 is greedy decoding (as in OpenAI's API and "
        "vLLM): top_p and top_k are then ignored.")
    top_p: float | None = setting(
        None, "Sample only from the smallest set of tokens whose probabilities add up to this (0-1].")
    top_k: int | None = setting(None, "Sample only from the k most likely tokens.")
    seed: int | None = setting(
        None, "Seed for sampling. A sequence's tokens then depend only on the seed, its input id, its sample index "
        "and the model: the same in any batch, order, shard or resumed run. Rows may carry their own seed.")
    num_return_sequences: int = setting(
        1, "Sequences per prompt (needs sampling); each is an output row with its sample_index.")
    logprobs: bool = setting(
        False, "Write the log-probability of every generated token: the model's own, before temperature, top-k, "
        "top-p and any output format.")
    stop_token_ids: list[int] = setting(
        [], "Extra token ids that end a sequence, besides the model's end-of-sequence tokens.")
    stop: list[str] = setting(
        [], "Strings that end a sequence as soon as they appear (the request is cancelled then, not run to "
        "max_new_tokens); the text is cut before the string and finish_reason is 'stop'. Rows may add their own "
        "with a 'stop' field.")
    top_logprobs: int | None = setting(
        None, "Also write, for every generated token, this many (1-20) of the most likely tokens with their "
        "logprobs, from the model's own distribution.")
    repetition_penalty: float | None = setting(
        None, "Divide the logit of every token already in the prompt or the generated text by this (multiply it when "
        "negative), as transformers and vLLM define it: 1 is off, 1.1-1.3 discourages repeats. Rows may carry their "
        "own.")
    presence_penalty: float | None = setting(
        None, "Subtract this from the logit of every token the sequence has generated at least once (OpenAI's "
        "definition, -2 to 2; positive favours new tokens). Rows may carry their own.")
    frequency_penalty: float | None = setting(
        None, "Subtract this times the number of times a token was generated from its logit (OpenAI's definition, "
        "-2 to 2). Rows may carry their own.")
    no_repeat_ngram_size: int | None = setting(
        None, "Never let an n-gram of this many tokens occur twice in prompt and generated text together "
        "(transformers' definition). Rows may carry their own.")
    min_p: float | None = setting(
        None, "When sampling, drop the tokens whose probability is below this fraction of the most likely token's "
        "(after temperature, top-k and top-p). Rows may carry their own.")
    min_tokens: int | None = setting(
        None, "Generate at least this many tokens: end-of-sequence tokens are held back until then, and stop "
        "strings count only where they end after them. Rows may carry their own.")
    logit_bias: dict = setting(
        {}, "Add a bias to chosen tokens' logits: a JSON object of token id -> -100 to 100 (OpenAI's logit_bias; "
        "-100 bans a token, 100 all but forces it). Rows may carry their own.")
    bad_words: list[str] = setting(
        [], "Text the model must never write: a token that would complete a bad word in the text so far is banned, "
        "whatever tokens would spell it (not only the word's own tokenization). Rows may add their own, also as "
        "token-id lists (transformers' bad_words_ids).")
    ignore_eos: bool = setting(
        False, "Never choose an end-of-sequence token (as llama.cpp's --ignore-eos): every sequence runs to "
        "max_new_tokens, for benchmarks and fixed-length jobs.")
    loop_stop: int | None = setting(
        None, "End a sequence once its generated tokens end with one span (up to loop_stop_span tokens) repeated "
        "this many times in a row: finish_reason 'repetition', counted in the summary and run.json, instead of "
        "burning max_new_tokens on a loop. 4 with a loop_stop_span of 64 catches the loops small models fall into, "
        "paragraphs said over included. Default: off.")
    loop_stop_span: int | None = setting(None, "Longest span, in tokens, that the loop stop looks for. Default: 32.")
    json_schema: str | None = setting(
        None, "Make every output a JSON value that validates against this JSON schema: a file, or the schema "
        "inline. Rows may carry their own response_format.")
    json_object: bool = setting(False, "Make every output a JSON object.")
    regex: str | None = setting(None, "Make every output match this regular expression, whole.")
    choice: list[str] = setting([], "Make every output exactly one of these strings.")
    grammar: str | None = setting(
        None, "Make every output follow this grammar: a file in Lark (llguidance's dialect) or GBNF.")
    chat_template_kwargs: dict = setting(
        {}, "Variables for the chat template, as a JSON object: a reasoning model's switches such as "
        "{\"enable_thinking\": false}. OpenAI lines may add their own (body.chat_template_kwargs, reasoning_effort).")
    response_template: str | None = setting(
        None, "How to split a chat reply into reasoning, tool calls and content when the tokenizer carries no response "
        "template of its own (transformers' format, a JSON file), or 'think' for <think>...</think> reasoning.")
    response_format: dict | None = setting(
        None, "The same as the flags above, in OpenAI's shape: {type: json_schema, json_schema: {name, schema}}, "
        "{type: json_object}, or cbgen's {type: regex, pattern}, {type: choice, choices}, {type: grammar, grammar}.")


@dataclass
class OutputSection:
    dir: str = setting("cbgen-out", "Directory for the shards and run.json.")
    format: Literal["jsonl", "parquet", "openai"] = setting(
        "jsonl", "Shard format: jsonl or parquet (a row per sequence, readable with datasets.load_dataset), or "
        "openai (a line per request, as OpenAI's Batch API output file has it).")
    rows_per_shard: int = setting(
        10_000, "Rows per shard file; a shard appears under its final name only once complete.")
    overwrite: bool = setting(False, "Delete the results of an earlier run in the output directory first.")


@dataclass
class RunSection:
    max_in_flight: int | None = setting(
        None, "Requests handed to the engine at once; results are written as they finish, so memory stays bounded. "
        "Default: twice max_requests_per_batch (512 when transformers chooses that).")
    quiet: bool = setting(False, "No progress display and no summary; errors are still printed.")
    request_timeout: float | None = setting(
        None, "Seconds a request may take once handed to the engine; a slower one is cancelled and recorded as "
        "failed. Default: no limit.")
    max_errors: int | None = setting(
        None, "Stop the job (resumable) once more than this many requests have failed. Default: never.")
    commit_interval: float = setting(
        60.0, "Commit the open shard at least every this many seconds, so a killed job loses little work.")
    data_parallel: int = setting(
        1, "Engine processes on this node, each with its own copy of the model: on CPU each gets its share of the "
        "cores (threads split and pinned), on GPUs its own device. One process reads and writes; work goes to "
        "whichever replica has room.")
    executor: Literal["local", "ray"] = setting(
        "local", "Where the shards run: here (local), or each as a task on a Ray cluster (ray: needs --num-shards; "
        "RAY_ADDRESS names the cluster, else a local one starts; pip install 'cbgen[ray]').")
    ray_num_cpus: float | None = setting(None, "CPUs each Ray task asks for. Default: 1.")
    ray_num_gpus: float | None = setting(None, "GPUs each Ray task asks for. Default: 0.")
    num_shards: int | None = setting(
        None, "Split the input into this many parts by a stable hash of the id, one per job; each writes to "
        "DIR/shard-IIIII-of-NNNNN. Default: CBGEN_NUM_SHARDS, else the Slurm array size (SLURM_ARRAY_TASK_COUNT).")
    shard_index: int | None = setting(
        None, "Which part this job runs, from 0. Default: JOB_COMPLETION_INDEX (a Kubernetes Indexed Job), else the "
        "Slurm array task (SLURM_ARRAY_TASK_ID minus SLURM_ARRAY_TASK_MIN).")
    redo: list[Literal["failed", "length"]] = setting(
        [], "In an existing output directory, generate again only the requests whose record is an error (failed) or "
        "was cut by the token cap (length), with the job's current generation settings (which may differ from the "
        "first run's; the others must match, as for a resume). Comma-separated or repeated. Each id stays in the "
        "shards exactly once, with its latest answer; run.json keeps the history.")
    prefix_gating: bool = setting(
        True, "Admit the first request of each shared prompt prefix, and the others once it has computed the "
        "prefix, so they reuse its KV cache instead of all computing it at once.")
    result_cache: bool = setting(
        True, "Keep every finished sequence (and score) in the result cache, and answer from it the requests whose "
        "sequences it already holds, so a rerun into a new directory, a pipeline stage changed for some rows, or an "
        "overlapping input computes only what is new. A cached answer is used only when it is exact (computed with "
        "this run's batch-invariant numerics: what a fresh run would give, bit for bit) unless cache_near_hits. "
        "Off also with CBGEN_RESULT_CACHE=off, unless --cache names a directory.")
    cache: str | None = setting(
        None, "Directory of the result cache; tasks of a Slurm array and replicas may share it, on one node or a "
        "shared filesystem. Default: $CBGEN_CACHE_DIR/results, else ~/.cache/cbgen/results.")
    cache_max_size: float = setting(
        4.0, "Most gigabytes (10^9 bytes) the result cache keeps: after a run that added to it, the least recently "
        "used answers go first.")
    cache_near_hits: bool = setting(
        False, "Also take cached answers computed with other numerics (not batch-invariant, another attention or "
        "linear kind, another machine or version): close to a fresh run's, not always bitwise the same. run.json "
        "counts them apart. Scores are exact hits only from batch-invariant scoring (cbgen score --batch-invariant).")


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "input": InputSection,
    "generation": GenerationSection,
    "batching": dict,  # ContinuousBatchingConfig fields, only those set by the user
    "output": OutputSection,
    "run": RunSection,
    "score": ScoreSection,  # cbgen score: what is scored (cbgen.score)
    "embed": EmbedSection,  # cbgen embed: what is embedded and how (cbgen.encoders)
    "reward": RewardSection,  # kind: reward: what is rated (cbgen.encoders)
    "chat": ChatSection,  # kind: chat: how conversations go on (cbgen.conversations)
}


@dataclass
class JobConfig:
    """Everything a job needs, validated. `batching` holds only the ContinuousBatchingConfig fields the user set.
    `kind` says whether it generates (cbgen run) or scores (cbgen score)."""

    model: ModelSection = field(default_factory=ModelSection)
    input: InputSection = field(default_factory=InputSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    batching: dict[str, Any] = field(default_factory=dict)
    output: OutputSection = field(default_factory=OutputSection)
    run: RunSection = field(default_factory=RunSection)
    score: ScoreSection = field(default_factory=ScoreSection)
    embed: EmbedSection = field(default_factory=EmbedSection)
    reward: RewardSection = field(default_factory=RewardSection)
    chat: ChatSection = field(default_factory=ChatSection)
    kind: str = DEFAULT  # one of cbgen.kinds.JOB_KINDS, set by the command (cbgen run, cbgen score), not by the YAML

    @property
    def do_sample(self) -> bool:
        """Whether the job samples: as asked, else when a sampling setting is given; temperature 0 is greedy."""
        g = self.generation
        if g.do_sample is not None:
            return g.do_sample
        if g.temperature == 0:
            return False
        return any(v is not None for v in (g.temperature, g.top_p, g.top_k))

    def to_dict(self) -> dict[str, Any]:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS if name != "batching"}
        out["batching"] = dict(self.batching)
        return {name: out[name] for name in SECTIONS}

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)
