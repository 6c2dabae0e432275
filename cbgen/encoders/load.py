"""Loading an encoding model: an embedding model (its transformer, and the pooling and normalising its
sentence-transformers modules describe) or a sequence classifier (reward models, classifiers), with its tokenizer."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbgen.config import JobConfig
from cbgen.errors import CbgenError, first_line
from cbgen.model.source import ModelSource, source_of
from cbgen.process.quiet import quiet

# sentence-transformers' module types cbgen runs (modules.json); any other (Dense, ...) is refused by name
TRANSFORMER, POOLING, NORMALIZE = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
                                   "sentence_transformers.models.Normalize")
_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                  "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class Pooling:
    """How an embedding model's token vectors become one vector."""

    mode: str  # mean | cls | max | mean_sqrt_len | last
    normalize: bool
    chosen_by: str  # what said so: "sentence-transformers modules", "a decoder model", the job's settings


@dataclass
class LoadedEncoder:
    model: Any  # a transformers PreTrainedModel: the base model (embed) or a ...ForSequenceClassification (reward)
    tokenizer: Any
    source: ModelSource
    max_length: int  # tokens read per row; longer rows are cut to it
    load_seconds: float
    dtype: Any
    pooling: Pooling | None = None  # embed
    labels: tuple[str, ...] = ()  # reward: the output columns, one per model output
    label_names: tuple[str, ...] = ()  # reward: the model's own label names (id2label), for the best label
    activation: str = "none"  # reward: none (one output: the score), softmax (a classifier), sigmoid (multi-label)
    lowercase: bool = False  # sentence-transformers' do_lower_case
    decoder: bool = False  # a causal model: padding must not hide its last token from a classifier head
    random_weights: bool = False


def _read_json(location: str, name: str) -> Any:
    """A JSON file of the model's folder or hub repository, or None where it has none."""
    from transformers.utils import cached_file

    path = cached_file(location, name, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False)
    return json.loads(Path(path).read_text(encoding="utf-8")) if path else None


def _modules(location: str) -> tuple[str, Pooling | None, dict[str, Any]]:
    """Where the transformer's weights are, the pooling sentence-transformers' modules.json says, and its
    sentence_bert_config.json (max_seq_length, do_lower_case)."""
    modules = _read_json(location, "modules.json")
    if not modules:
        return location, None, {}
    types = [m.get("type", "") for m in modules]
    other = [t for t in types if t not in (TRANSFORMER, POOLING, NORMALIZE)]
    if other:
        raise CbgenError(f"--model {location}: its sentence-transformers modules include {other[0]!r}; cbgen runs "
                         "models made of a Transformer, a Pooling and a Normalize module")
    transformer = next(m for m in modules if m.get("type") == TRANSFORMER)
    path = transformer.get("path") or ""
    model_location = str(Path(location) / path) if path and Path(location).is_dir() else location
    pooling = None
    pool = next((m for m in modules if m.get("type") == POOLING), None)
    if pool is not None:
        config = _read_json(location, f"{pool['path']}/config.json") or {}
        modes = [mode for key, mode in _POOLING_MODES.items() if config.get(key)]
        if config.get("pooling_mode") in _POOLING_MODES.values():  # newer sentence-transformers spell it so
            modes = [config["pooling_mode"]]
        if len(modes) != 1:
            raise CbgenError(f"--model {location}: its pooling module asks for {modes or 'no mode'}; cbgen pools "
                             "with exactly one of mean, cls, max, mean_sqrt_len and last")
        pooling = Pooling(modes[0], NORMALIZE in types, "the model's sentence-transformers modules")
    settings = _read_json(location, "sentence_bert_config.json") or {}
    return model_location, pooling, settings


def load_encoder(job: JobConfig) -> LoadedEncoder:
    """The job's model as its kind reads it: embed (job.embed) or reward (job.reward). Raises CbgenError for
    anything the user can fix."""
    from cbgen.model.load import resolve_device, resolve_dtype

    source = source_of(job)
    if source.gguf_file or source.random_weights:
        raise CbgenError(f"--model {source.name}: a {job.kind} job reads a transformers model folder or hub id "
                         "(GGUF files and random shapes are generators)")
    device = resolve_device(job.model.device)
    dtype = resolve_dtype(job.model.dtype, device)
    started = time.perf_counter()
    try:
        with quiet("transformers"):
            loaded = _load(job, source, dtype, device)
    except CbgenError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise CbgenError(f"--model {source.name}: cannot load it for a {job.kind} job: {first_line(e, 300)}") from e
    loaded.load_seconds = time.perf_counter() - started
    return loaded


def _load(job: JobConfig, source: ModelSource, dtype: Any, device: str) -> LoadedEncoder:
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    remote = job.model.trust_remote_code
    from cbgen.kinds import EncoderKind, kind_of

    kind = kind_of(job.kind)
    embed = isinstance(kind, EncoderKind) and kind.pooled
    location, pooling, st_settings = _modules(source.location) if embed else (source.location, None, {})
    config = AutoConfig.from_pretrained(location, trust_remote_code=remote)
    tokenizer = AutoTokenizer.from_pretrained(source.location if embed else location, trust_remote_code=remote)
    decoder = config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    kwargs = {"dtype": dtype, "trust_remote_code": remote}
    factory = AutoModel if embed else AutoModelForSequenceClassification
    from cbgen.model.load import LOADING  # one load at a time in a process (see there)

    with LOADING:
        model = factory.from_pretrained(location, **kwargs).to(device).eval()
    limit = _max_length(config, tokenizer, st_settings.get("max_seq_length"))
    tokenizer.model_max_length = 1 << 62  # rows are cut to max_length by cbgen, which says so: no warning per row
    section = job.embed if embed else job.reward
    max_length = min(section.max_length, limit) if section.max_length is not None else limit
    loaded = LoadedEncoder(model, tokenizer, source, max_length, 0.0, dtype,
                           lowercase=bool(st_settings.get("do_lower_case")), decoder=decoder)
    if embed:
        loaded.pooling = _pooling(job, pooling, decoder)
    else:
        _labels(loaded, config)
    return loaded


def _max_length(config: Any, tokenizer: Any, st_max: int | None) -> int:
    """sentence-transformers' max_seq_length, else the smaller of the model's position limit and the tokenizer's."""
    if st_max:
        return int(st_max)
    limits = [v for v in (getattr(config, "max_position_embeddings", None), tokenizer.model_max_length)
              if isinstance(v, int) and 0 < v < 10**7]
    return min(limits) if limits else 512


def _pooling(job: JobConfig, found: Pooling | None, decoder: bool) -> Pooling:
    e = job.embed
    base = found or Pooling("last" if decoder else "mean", True,
                            "a decoder model: its last token" if decoder else "an encoder model: the mean")
    mode = base.mode if e.pooling == "auto" else e.pooling
    normalize = base.normalize if e.normalize is None else e.normalize
    chosen = base.chosen_by if (e.pooling == "auto" and e.normalize is None) else "the job's settings"
    return Pooling(mode, normalize, chosen)


def _labels(loaded: LoadedEncoder, config: Any) -> None:
    """A classifier's output columns: `reward` for a model of one output (a reward model), else one column per
    label (its probability), named by the model's id2label."""
    n = int(getattr(config, "num_labels", 1))
    if n == 1:
        loaded.labels, loaded.label_names, loaded.activation = ("reward",), ("reward",), "none"
        return
    names = [str(config.id2label.get(i, f"LABEL_{i}")) for i in range(n)]
    columns = [_column(name) for name in names]
    if len(set(columns)) != n:
        columns = [f"label_{i}" for i in range(n)]
    loaded.labels, loaded.label_names = tuple(columns), tuple(names)
    loaded.activation = "sigmoid" if getattr(config, "problem_type", None) == "multi_label_classification" \
        else "softmax"


def _column(label: str) -> str:
    """A label as a column name: lower case, letters, digits and underscores, not one of the row's own names."""
    import re

    name = re.sub(r"[^0-9a-z_]+", "_", label.lower()).strip("_") or "label"
    return f"label_{name}" if name in ("id", "num_tokens", "truncated", "error", "label") or name[0].isdigit() \
        else name
