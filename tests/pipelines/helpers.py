"""A small pipeline on the tiny model: seed topics, questions (template, JSON schema), two sampled answers each, a
1-5 judge by choice logprobs, and SQL keeping the best answer per question."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

TOPICS = ["rain", "tides", "bees", "volcanoes", "glaciers", "comets", "coral", "deserts", "tea", "ink", "salt",
          "owls"]
QUERY = """
SELECT questions.id AS question_id, topic, questions.parsed.question AS question, answers.text AS answer,
       CAST(judge.best_choice AS INTEGER) AS score
FROM judge
QUALIFY row_number() OVER (PARTITION BY questions.id ORDER BY judge.choice_logprobs[5] DESC, id) = 1
"""


def write_pipeline(folder: Path, model: Path, *, rows: int = 12, query: str = QUERY, **changes: Any) -> Path:
    """The pipeline file (and its seed and schema) in `folder`; `changes` maps a stage to keys set on it."""
    topics = [TOPICS[i % len(TOPICS)] + ("" if i < len(TOPICS) else f" {i}") for i in range(rows)]
    pq.write_table(pa.table({"topic": topics, "persona": [{"name": f"P{i}", "age": 20 + i} for i in range(rows)]}),
                   folder / "seed.parquet")
    (folder / "question.schema.json").write_text(json.dumps(
        {"type": "object", "properties": {"question": {"type": "string", "maxLength": 40}},
         "required": ["question"]}))
    stages: list[dict[str, Any]] = [
        {"name": "questions", "kind": "generate", "input": "seed.parquet", "json_schema": "question.schema.json",
         "template": "Write a question about {{ topic }} for {{ persona.name }}.", "max_new_tokens": 20},
        {"name": "answers", "kind": "generate", "input": "questions", "template": "Answer: {{ questions.text }}",
         "num_return_sequences": 2, "temperature": 0.8, "seed": 7, "max_new_tokens": 8},
        {"name": "judge", "kind": "score", "input": "answers", "choices": ["1", "2", "3", "4", "5"],
         "template": "Question: {{ questions.text }}\nAnswer: {{ answers.text }}\nScore from 1 to 5:"},
        {"name": "kept", "kind": "sql", "query": query},
    ]
    for stage in stages:
        stage.update(changes.get(stage["name"], {}))
    data = {"defaults": {"model": str(model), "dtype": "float32", "rows_per_shard": 3}, "stages": stages}
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def ids(directory: Path) -> Counter[str]:
    """How many rows each id has in a stage's output (all its shards)."""
    from cbgen.rows import read_shards

    found: Counter[str] = Counter()
    for part in [directory, *sorted(directory.glob("shard-*-of-*"))]:
        found.update(f"{r['id']}/{r.get('sample_index', 0)}" for r in read_shards(part))
    return found


def shard_times(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.glob("part-*.parquet")}
