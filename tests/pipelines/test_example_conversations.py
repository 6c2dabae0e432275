"""examples/conversations/pipeline.yaml on the embedded models, as the README runs it (on its first 8 rows):
two-turn conversations with a simulated user, embedded, near-duplicates dropped, judged, and each topic's best
kept; every stage's rows once, the dedup's kept and dropped rows adding up, and the final dataset one conversation
per topic, its best-rated."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest

from cbgen.cli import run_cli
from cbgen.rows import read_shards

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "conversations"

pytestmark = [pytest.mark.embedded, pytest.mark.slow]


def test_the_conversations_example_keeps_each_topics_best_conversation(tmp_path):
    folder = tmp_path / "conversations"
    shutil.copytree(EXAMPLE, folder)
    topics = folder / "topics.jsonl"  # its first 4 topics (of 12), two personas each: the suite's time
    topics.write_text("".join(topics.read_text().splitlines(keepends=True)[:8]))
    out = tmp_path / "out"
    assert run_cli(["pipeline", str(folder / "pipeline.yaml"), "-o", str(out), "-q"]) == 0
    seeds = [json.loads(line) for line in (folder / "topics.jsonl").read_text().splitlines()]
    talks = {row["id"]: row for row in read_shards(out / "talks")}
    assert sorted(talks) == sorted(seed["id"] for seed in seeds)
    for row in talks.values():  # the simulated user opens, the teacher answers, twice
        assert row["error"] is None and row["num_turns"] == 2, row
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"] * 2
        assert all(m["content"].strip() for m in row["messages"])
    manifest = json.loads((out / "talks" / "run.json").read_text())
    assert manifest["counts"]["cached_prompt_tokens"] > 0  # the second reply found the first in the KV cache
    kept = [row["id"] for row in read_shards(out / "judge")]
    dropped = pq.read_table(out / "unique" / "duplicates.parquet").column("id").to_pylist()
    assert sorted(kept + dropped) == sorted(talks)
    best = datasets.load_dataset(str(out / "best"), split="train")
    by_topic = defaultdict(list)
    for row in read_shards(out / "judge"):
        by_topic[row["topic"]].append(sum(p * (i + 1) for i, p in enumerate(row["choice_probs"])))
    assert sorted(best["topic"]) == sorted(by_topic)  # one conversation per topic left after the dedup
    for topic, score in zip(best["topic"], best["expected_score"]):
        assert score == pytest.approx(max(by_topic[topic]))
    assert run_cli(["status", str(out)]) == 0
