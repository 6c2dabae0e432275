"""A pipeline file, read and checked: its stages, what each reads, and the order they run in.

    stages:
      - name: questions            # [A-Za-z_][A-Za-z0-9_]*: also its table name in SQL and its column downstream
        kind: generate             # generate (cbgen run), score (cbgen score) or sql (a DuckDB query)
        input: seed.parquet        # a file or dataset (relative to the pipeline file), or an earlier stage's name
        template: "Write a question about {{ topic }}."
        max_new_tokens: 64         # any job key, flat, as the Python API takes them
      - name: kept
        kind: sql
        query: "SELECT * FROM questions WHERE questions.finish_reason = 'stop'"
    defaults:                      # optional: keys every generate and score stage starts from
      model: HuggingFaceTB/SmolLM2-135M-Instruct

A stage's order is its dependencies': its input stage, or the stages its query reads. Nothing here loads a model or
reads a row; every mistake is a CbgenError naming the file, the stage and the key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cbgen.config.flat import closest, flat_keys
from cbgen.errors import CbgenError, first_line
from cbgen.kinds import KINDS, OWN_SECTIONS, Kind, kind_of
from cbgen.kinds.dedup import DEDUP_KEYS, DEFAULT_THRESHOLD
from cbgen.kinds.sql import QUERY_KEYS

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
STAGE_KEYS = ("name", "kind", "input", "query")
# an sql stage's key that lets its query read files: by default it reads the tables of the stages it names only
SQL_FILES_KEY = "read_files"
# what the pipeline decides for every stage, with why
OWNED = {
    "overwrite": "a stage whose settings changed starts over by itself",
    "num_shards": "give --num-shards with --stage on the command line",
    "shard_index": "give --shard-index with --stage on the command line",
    "output_format": "stages write Parquet, which keeps their columns' types for the next stages",
    "keep_columns": "a stage keeps every column of its input",
    "quiet": "give -q on the command line",
}
# keys whose value may be a file, found relative to the pipeline file
PATH_KEYS = ("json_schema", "grammar", "response_template", "model")
TEMPLATE_KEYS = ("template", "system")  # @FILE


@dataclass(frozen=True)
class Stage:
    name: str
    kind: str
    input: str | None  # an earlier stage's name, or a path (absolute when it exists); None for sql
    settings: dict[str, Any] = field(default_factory=dict)  # flat job keys, paths resolved
    query: str | None = None
    tables: tuple[str, ...] = ()  # sql: the stages its query reads
    input_is_stage: bool = False
    read_files: bool = False  # sql: the query may read files too (read_csv, read_parquet, ...), not only stages

    @property
    def of_kind(self) -> Kind:
        return kind_of(self.kind)

    @property
    def upstream(self) -> tuple[str, ...]:
        """The stages this one reads."""
        if not self.of_kind.over_rows:
            return self.tables
        return (self.input,) if self.input_is_stage and self.input is not None else ()


@dataclass(frozen=True)
class Pipeline:
    where: str  # the file, for messages ("pipeline.yaml"), or "the pipeline" for a dict
    base: Path  # relative paths are found from here
    stages: tuple[Stage, ...]  # in run order: every stage after those it reads

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise CbgenError(f"{self.where} has no stage {name!r}; its stages are: "
                         f"{', '.join(s.name for s in self.stages)}{closest(name, [s.name for s in self.stages])}")

    def readers(self, name: str) -> list[Stage]:
        """The stages that read `name`."""
        return [s for s in self.stages if name in s.upstream]

    def to_dict(self) -> dict[str, Any]:
        return {"stages": [{"name": s.name, "kind": s.kind, "input": s.input, "upstream": list(s.upstream),
                            **({"query": s.query} if s.query else {}),
                            **({SQL_FILES_KEY: True} if s.read_files else {}), "settings": s.settings}
                           for s in self.stages]}


def load_pipeline(source: str | Path | Mapping[str, Any]) -> Pipeline:
    """The pipeline of a YAML file (or of its contents as a dict, with paths relative to the working directory)."""
    if isinstance(source, Mapping):
        return _parse(dict(source), "the pipeline", Path.cwd())
    path = Path(source)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CbgenError(f"cannot read pipeline file '{path}': {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise CbgenError(f"{path}{where}: not valid YAML: {first_line(getattr(e, 'problem', None) or e)}") from None
    return _parse(data, str(path), path.resolve().parent)


def _parse(data: Any, where: str, base: Path) -> Pipeline:
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list) or not data["stages"]:
        raise CbgenError(f"{where}: a pipeline is a mapping with a non-empty 'stages:' list (each stage a mapping with "
                         "name, kind and its keys)")
    unknown = sorted(set(data) - {"stages", "defaults"})
    if unknown:
        raise CbgenError(f"{where}: unknown top-level key {unknown[0]!r}; a pipeline has 'stages' and 'defaults'")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise CbgenError(f"{where}: 'defaults' must be a mapping of job keys")
    _check_keys(defaults, f"{where}: defaults", None)
    stages: list[Stage] = []
    for i, raw in enumerate(data["stages"]):
        if not isinstance(raw, dict):
            raise CbgenError(f"{where}: stage {i + 1} must be a mapping (name, kind, ...)")
        stages.append(_stage(raw, i, defaults, where, base, [s.name for s in stages]))
    names = [s.name for s in stages]
    for stage in stages:
        for name in stage.upstream:
            if name not in names:
                what = "a stage nor a file" if stage.of_kind.over_rows else "a stage"
                raise CbgenError(f"{where}: stage {stage.name!r} reads {name!r}, which is not {what}; the stages "
                                 f"are: {', '.join(names)}{closest(name, names)}")
            if name == stage.name:
                raise CbgenError(f"{where}: stage {stage.name!r} reads itself")
    return Pipeline(where, base, tuple(_in_order(stages, where)))


def _stage(raw: dict[str, Any], index: int, defaults: dict[str, Any], where: str, base: Path,
           earlier: list[str]) -> Stage:
    name = raw.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise CbgenError(f"{where}: stage {index + 1} needs a 'name' of letters, digits and _ (not starting with a "
                         f"digit), got {name!r}: it becomes a table name in SQL and a column name downstream")
    if name in earlier:
        raise CbgenError(f"{where}: two stages are named {name!r}; names must be unique")
    here = f"{where}: stage {name!r}"
    kind = raw.get("kind")
    if kind not in KINDS:
        raise CbgenError(f"{here}: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    settings = {k: v for k, v in raw.items() if k not in STAGE_KEYS}
    if KINDS[kind].drops_duplicates:  # an earlier stage's table without its duplicates
        return _dedup_stage(raw, name, kind, here, earlier)
    if not KINDS[kind].over_rows:  # a query over earlier stages
        query = raw.get("query")
        if not isinstance(query, str) or not query.strip():
            raise CbgenError(f"{here}: an {kind} stage needs a 'query' (DuckDB SQL over earlier stages by name)")
        extra = sorted(set(raw) - {"name", "kind", *QUERY_KEYS})
        if extra:
            raise CbgenError(f"{here}: {KINDS[kind].setting_error('', extra[0], OWN_SECTIONS)}")
        read_files = raw.get(SQL_FILES_KEY, False)
        if not isinstance(read_files, bool):
            raise CbgenError(f"{here}: {SQL_FILES_KEY} must be true or false, got {read_files!r}")
        return Stage(name, kind, None, {}, query, _tables(query, here), read_files=read_files)
    if "query" in raw:
        raise CbgenError(f"{here}: 'query' is for sql stages; a {kind} stage reads its 'input'")
    source = raw.get("input")
    if not isinstance(source, str) or not source.strip():
        raise CbgenError(f"{here}: needs an 'input': a file, a dataset, or an earlier stage's name")
    _check_keys(settings, here, KINDS[kind])
    applied = {k: v for k, v in defaults.items() if _applies(k, KINDS[kind])} | settings
    resolved = {k: _resolve(k, v, base) for k, v in applied.items()}
    is_stage = bool(NAME.match(source)) and not (base / source).exists()
    if not is_stage and (base / Path(source).expanduser()).exists():
        source = str((base / Path(source).expanduser()).resolve())
    # else a stage, a hub dataset id, or a file that is missing (its reader says so)
    return Stage(name, kind, source, resolved, input_is_stage=is_stage)


def _dedup_stage(raw: dict[str, Any], name: str, kind: str, here: str, earlier: list[str]) -> Stage:
    """A dedup stage: its input stage's table (read as `SELECT *`), with the column it compares and its threshold
    checked."""
    extra = sorted(set(raw) - {"name", "kind", *DEDUP_KEYS})
    if extra:
        raise CbgenError(f"{here}: {KINDS[kind].setting_error('', extra[0], OWN_SECTIONS)}")
    source = raw.get("input")
    if not isinstance(source, str) or source not in earlier:
        raise CbgenError(f"{here}: 'input' must name an earlier stage (its table is deduplicated), got {source!r}"
                         + (closest(source, earlier) if isinstance(source, str) else ""))
    columns = [key for key in ("embedding_column", "text_column") if key in raw]
    if len(columns) != 1 or not isinstance(raw[columns[0]], str) or not raw[columns[0]].strip():
        raise CbgenError(f"{here}: give one of embedding_column (near-duplicates by cosine similarity, e.g. "
                         "vectors.embedding) and text_column (exact duplicates, e.g. answers.text), as a column name")
    threshold = raw.get("threshold", DEFAULT_THRESHOLD)
    if columns[0] == "text_column" and "threshold" in raw:
        raise CbgenError(f"{here}: threshold applies to embedding_column; text_column drops exact duplicates only")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1 <= threshold <= 1:
        raise CbgenError(f"{here}: threshold is a cosine similarity between -1 and 1, got {threshold!r}")
    settings = {columns[0]: raw[columns[0]].strip()} | (
        {"threshold": float(threshold)} if columns[0] == "embedding_column" else {})
    query = 'SELECT * FROM "' + source.replace('"', '""') + '"'
    return Stage(name, kind, None, settings, query, (source,))


def _check_keys(settings: dict[str, Any], here: str, kind: Kind | None) -> None:
    """Every key known, none the pipeline decides, and each one that `kind` takes (for defaults, None: that some
    kind takes)."""
    keys = flat_keys(kind.own_section if kind is not None else None)
    for key in settings:
        if key in OWNED:
            raise CbgenError(f"{here}: {key!r} is decided by the pipeline: {OWNED[key]}")
        if key in STAGE_KEYS:
            raise CbgenError(f"{here}: {key!r} belongs to a stage, not to defaults")
        if key not in keys:
            raise CbgenError(f"{here}: unknown key {key!r}{closest(key, list(keys) + list(STAGE_KEYS))}")
        error = kind.setting_error(keys[key][0], key, OWN_SECTIONS) if kind is not None else None
        if error is not None:
            raise CbgenError(f"{here}: {error}")


def _applies(key: str, kind: Kind) -> bool:
    """Whether a `defaults` key applies to a stage of `kind`."""
    return kind.default_applies(flat_keys(kind.own_section)[key][0], key, OWN_SECTIONS)


def _resolve(key: str, value: Any, base: Path) -> Any:
    """A value naming a file relative to the pipeline file, made absolute; anything else as it is."""
    if key == "adapter" and isinstance(value, (str, list)):
        return _adapter_folders(value, base)
    if not isinstance(value, str):
        return value
    if key in TEMPLATE_KEYS and value.startswith("@"):
        target = base / Path(value[1:]).expanduser()
        return "@" + str(target.resolve()) if target.exists() else value
    if key in PATH_KEYS and not value.lstrip().startswith("{"):
        target = base / Path(value).expanduser()
        return str(target.resolve()) if target.exists() else value
    return value


def _adapter_folders(value: str | list[Any], base: Path) -> str | list[Any]:
    """A stage's adapters (PATH or NAME=PATH, one or a list) with each folder found relative to the pipeline file."""
    from cbgen.config.adapters import split_spec

    def resolved(spec: Any) -> Any:
        if not isinstance(spec, str):
            return spec  # the setting's own check says what it must be
        name, location = split_spec(spec)
        target = base / Path(location).expanduser()
        location = str(target.resolve()) if target.exists() else location
        return f"{name}={location}" if name else location

    return resolved(value) if isinstance(value, str) else [resolved(spec) for spec in value]


def _tables(query: str, here: str) -> tuple[str, ...]:
    """The tables a query reads, from DuckDB's own parse of it (CTEs left out); the query must be one SELECT."""
    import json

    import duckdb

    parsed = json.loads(duckdb.connect().execute("SELECT json_serialize_sql(?)", [query]).fetchall()[0][0])
    if parsed.get("error"):
        message = parsed.get("error_message", "cannot parse it")
        if parsed.get("error_type") == "not implemented":
            message = "an sql stage's query is one SELECT statement (WITH ... SELECT included)"
        raise CbgenError(f"{here}: SQL error: {message}")
    if len(parsed.get("statements", [])) != 1:
        raise CbgenError(f"{here}: SQL error: an sql stage's query is one SELECT statement, not several")
    tables: set[str] = set()
    ctes: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "BASE_TABLE" and not node.get("schema_name"):
                tables.add(node["table_name"])
            ctes.update(entry["key"] for entry in (node.get("cte_map") or {}).get("map", []))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(parsed["statements"])
    return tuple(sorted(tables - ctes))


def sql_message(error: BaseException) -> str:
    """DuckDB's message on one line (it spreads one over several, with a caret under the query)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.strip().startswith("^")]
    return " ".join(lines)[:500]


def _in_order(stages: list[Stage], where: str) -> list[Stage]:
    """The stages with each one after all it reads (file order among the rest); a cycle is named."""
    by_name = {s.name: s for s in stages}
    ordered: list[Stage] = []
    state: dict[str, str] = {}

    def visit(stage: Stage, path: list[str]) -> None:
        if state.get(stage.name) == "done":
            return
        if state.get(stage.name) == "visiting":
            cycle = path[path.index(stage.name):] + [stage.name]
            raise CbgenError(f"{where}: stages read each other in a cycle: {' -> '.join(cycle)}; a stage can read "
                             "only stages that do not read it")
        state[stage.name] = "visiting"
        for name in stage.upstream:
            visit(by_name[name], path + [stage.name])
        state[stage.name] = "done"
        ordered.append(stage)

    for stage in stages:
        visit(stage, [])
    return ordered
