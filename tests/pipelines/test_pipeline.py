"""`cbgen pipeline` as a user runs it: the whole recipe into a dataset, reruns that skip what is done, a changed
stage that reruns itself and what follows only, one model load shared by stages, --stage with shards, --redo per
stage, status, and bad pipelines refused before any model loads."""

from __future__ import annotations

import json
import shutil

import datasets
import pyarrow.parquet as pq
import pytest
import yaml
from huggingface_hub import DatasetCard

import cbgen
from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.pipelines.helpers import TOPICS, ids, shard_times, write_pipeline


def pipeline(file, out, *extra) -> int:
    return run_cli(["pipeline", str(file), "-o", str(out), "-q", *map(str, extra)])


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory):
    """The whole pipeline run once for the module, and a pristine copy of its folder (a pipeline's stages know it by
    its files' paths, so each test gets the run back in the same folder: `ran`)."""
    folder = tmp_path_factory.mktemp("pipeline")
    file = write_pipeline(folder, tiny_model_dir)
    assert pipeline(file, folder / "out") == 0
    pristine = tmp_path_factory.mktemp("pristine") / "copy"
    shutil.copytree(folder, pristine, symlinks=True)
    return folder, pristine


@pytest.fixture
def ran(finished):
    """A finished run of the pipeline for the test alone (which may rerun, change or extend it): the module's run,
    put back as it was in its own folder, the pipeline file, seed and schema beside it as write_pipeline leaves
    them."""
    folder, pristine = finished
    shutil.rmtree(folder)
    shutil.copytree(pristine, folder, symlinks=True)
    return folder / "pipeline.yaml", folder / "out"


def test_the_recipe_ends_in_a_dataset_with_one_best_answer_per_question(ran):
    file, out = ran
    questions = list(read_shards(out / "questions"))
    assert len(questions) == len(TOPICS)
    assert all(q["parsed"] is not None and set(q["parsed"]) == {"question"} for q in questions
               if q["finish_reason"] == "stop")
    assert all(q["parsed"] is None for q in questions if q["finish_reason"] == "length")
    assert any(q["finish_reason"] == "stop" for q in questions), "no question ended: nothing was checked"
    answers = pq.read_table(out / ".tables" / "answers.parquet").to_pylist()
    # two sequences per question, each id made unique; the question and the seed columns carried on
    assert [a["id"] for a in answers] == [f"{i}-{k}" for i in range(len(TOPICS)) for k in range(2)]
    assert all(a["questions"]["text"] and a["topic"] and a["persona"]["name"] for a in answers)
    judged = pq.read_table(out / ".tables" / "judge.parquet").to_pylist()
    assert all(len(j["judge"]["choice_logprobs"]) == 5 and j["answers"]["text"] is not None for j in judged)
    final = datasets.load_dataset(str(out / "kept"), split="train")
    assert sorted(final["question_id"]) == sorted(str(i) for i in range(len(TOPICS)))  # each question once
    best = {}
    for j in judged:  # the best answer of each question, by the judge's logprob of "5" (then by id)
        key = j["questions"]["id"]
        if key not in best or j["judge"]["choice_logprobs"][4] > best[key]["judge"]["choice_logprobs"][4]:
            best[key] = j
    for row in final:
        assert row["answer"] == best[row["question_id"]]["answers"]["text"]
        assert row["score"] == int(best[row["question_id"]]["judge"]["best_choice"])
    card = DatasetCard.load(out / "kept" / "README.md")
    assert card.data["cbgen"]["stage"] == "kept" and card.data["cbgen"]["reads"] == ["judge"]
    assert len(cbgen.load(out / "kept")) == len(TOPICS)


def test_rerun_skips_every_finished_stage(ran, capsys):
    file, out = ran
    before = {stage: shard_times(out / stage) for stage in ("questions", "answers", "judge", "kept")}
    assert run_cli(["pipeline", str(file), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["state"] for s in report["stages"]] == ["up to date"] * 4
    assert {stage: shard_times(out / stage) for stage in before} == before


def test_a_changed_stage_reruns_with_the_stages_after_it_and_only_those(ran, tiny_model_dir, capsys):
    file, out = ran
    before = {stage: shard_times(out / stage) for stage in ("questions", "answers", "judge", "kept")}
    write_pipeline(file.parent, tiny_model_dir, answers={"max_new_tokens": 6})
    assert run_cli(["pipeline", str(file), "-o", str(out), "--json", "-q"]) == 0
    states = {s["stage"]: s["state"] for s in json.loads(capsys.readouterr().out)["stages"]}
    assert states == {"questions": "up to date", "answers": "ran", "judge": "ran", "kept": "ran"}
    assert shard_times(out / "questions") == before["questions"]
    assert all(r["num_generated_tokens"] <= 6 for r in read_shards(out / "answers"))
    assert max(ids(out / "answers").values()) == 1 and max(ids(out / "judge").values()) == 1


def test_stages_of_one_model_share_one_load_and_score_as_a_job_alone(tiny_model_dir, tmp_path):
    from cbgen.pipelines import load_pipeline
    from cbgen.pipelines.runner import PipelineRun

    out = tmp_path / "out"
    run = PipelineRun(load_pipeline(write_pipeline(tmp_path, tiny_model_dir, rows=4)), out)
    assert run.run().exit_code == 0
    assert run.models.loads == 1  # generate, generate, score: one model
    # the judge, after generation used the same model object, scores as a scoring job on its own does
    alone = tmp_path / "alone"
    assert run_cli(["score", str(out / ".tables" / "answers.parquet"), "-o", str(alone), "--model",
                    str(tiny_model_dir), "--dtype", "float32", "--choices", "1,2,3,4,5", "-q", "--template",
                    "Question: {{ questions.text }}\nAnswer: {{ answers.text }}\nScore from 1 to 5:"]) == 0
    staged = {r["id"]: r["choice_logprobs"] for r in read_shards(out / "judge")}
    for row in read_shards(alone):
        assert row["choice_logprobs"] == pytest.approx(staged[row["id"]], abs=1e-4)


def test_one_stage_at_a_time_in_shards_as_slurm_arrays_run_it(tiny_model_dir, tmp_path, capsys):
    file = write_pipeline(tmp_path, tiny_model_dir, rows=6)
    out = tmp_path / "out"
    assert pipeline(file, out, "--stage", "answers") == 2  # what it reads is not there yet
    assert "stage 'questions' is not complete" in capsys.readouterr().err
    assert pipeline(file, out, "--stage", "questions") == 0
    for index in (0, 1):
        assert pipeline(file, out, "--stage", "answers", "--num-shards", 2, "--shard-index", index) == 0
    assert pipeline(file, out, "--stage", "judge", "--num-shards", 2, "--shard-index", 1) == 0
    assert pipeline(file, out, "--stage", "kept") == 2  # the judge's shard 0 has not run
    assert "stage 'judge' is not complete" in capsys.readouterr().err
    assert run_cli(["status", str(out), "--json"]) == 1
    stages = {s["stage"]: s for s in json.loads(capsys.readouterr().out)["stages"]}
    assert stages["answers"]["state"] == "complete" and stages["answers"]["done"] == 6
    assert stages["judge"]["state"] == "incomplete" and stages["kept"]["state"] == "not started"
    assert run_cli(["pipeline", str(file), "-o", str(out), "-q", "--json"]) == 0  # the rest, on one machine
    states = {s["stage"]: s["state"] for s in json.loads(capsys.readouterr().out)["stages"]}
    assert states == {"questions": "up to date", "answers": "up to date", "judge": "ran", "kept": "ran"}
    assert sorted(ids(out / "judge").values()) == [1] * 12
    assert run_cli(["status", str(out)]) == 0
    assert "complete" in capsys.readouterr().out


def test_redo_applies_to_the_stage_named(tiny_model_dir, tmp_path):
    file = write_pipeline(tmp_path, tiny_model_dir, rows=4, questions={"max_new_tokens": 3})
    out = tmp_path / "out"
    assert pipeline(file, out) == 0
    cut = [r["id"] for r in read_shards(out / "questions") if r["finish_reason"] == "length"]
    assert cut  # 3 tokens are too few for the schema's JSON
    write_pipeline(tmp_path, tiny_model_dir, rows=4, questions={"max_new_tokens": 40})
    assert pipeline(file, out, "--stage", "questions", "--redo", "length") == 0
    redone = {r["id"]: r for r in read_shards(out / "questions")}
    assert sorted(redone) == [str(i) for i in range(4)]  # each row still once
    assert all(redone[i]["num_generated_tokens"] > 3 or redone[i]["finish_reason"] == "stop" for i in cut)
    history = json.loads((out / "questions" / "run.json").read_text())
    assert history["redos"][-1]["requests"] == len(cut)


BAD = [
    ({"answers": {"input": "questionz"}}, "stage 'answers' reads 'questionz', which is not a stage nor a file"),
    ({"questions": {"input": "judge"}}, "in a cycle: questions -> judge -> answers -> questions"),
    ({"kept": {"query": "SELECT * FROM judge WHERE judge.best > 3"}}, "stage 'kept': SQL error: Binder Error"),
    ({"kept": {"query": "SELECT * FROM judgee"}}, "stage 'kept' reads 'judgee', which is not a stage"),
    ({"kept": {"query": "SELEC 1"}}, "stage 'kept': SQL error: syntax error"),
    ({"kept": {"query": "DELETE FROM judge"}}, "one SELECT statement"),
    ({"questions": {"template": "About {{ topik }}."}}, "stage 'questions': '"),
    ({"answers": {"template": "{{ questions.txt }}"}}, "column 'questions' has no field 'txt'; its fields are: id,"),
    ({"judge": {"template": "{{ answers.text }}", "choices": []}}, "stage 'judge': nothing to score"),
    ({"judge": {"max_new_tokens": 3}}, "'max_new_tokens' is a generation setting; a score stage generates nothing"),
    ({"answers": {"overwrite": True}}, "'overwrite' is decided by the pipeline"),
    ({"answers": {"temprature": 0.5}}, "unknown key 'temprature'; did you mean 'temperature'?"),
    ({"answers": {"max_new_tokens": -1}}, "stage 'answers': max_new_tokens must be a positive integer"),
    ({"answers": {"model": "no/such-model-here"}}, "stage 'answers'"),
]


@pytest.mark.parametrize(("changes", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_bad_pipelines_exit_2_before_any_model_loads(tiny_model_dir, tmp_path, capsys, changes, message):
    file = write_pipeline(tmp_path, tiny_model_dir, rows=2, **changes)
    out = tmp_path / "out"
    assert pipeline(file, out) == 2
    err = capsys.readouterr().err
    assert message in err and str(file) in err and err.count("\n") == 1, err
    assert not out.exists()  # nothing ran


def test_a_pipeline_as_a_dict_through_the_api(tiny_model_dir, tmp_path, monkeypatch):
    file = write_pipeline(tmp_path, tiny_model_dir, rows=3)
    monkeypatch.chdir(tmp_path)  # a dict's relative paths start from the working directory
    data = yaml.safe_load(file.read_text())
    data["stages"] = data["stages"][:1] + [{"name": "short", "kind": "sql",
                                            "query": "SELECT id, topic, questions.text AS text FROM questions"}]
    report = cbgen.pipeline(data, tmp_path / "api-out", progress=False)
    assert report.exit_code == 0 and [s.name for s in report.stages] == ["questions", "short"]
    assert cbgen.load(tmp_path / "api-out" / "short")["topic"] == TOPICS[:3]


def test_redo_over_the_whole_pipeline_leaves_done_rows_alone(ran, capsys):
    file, out = ran
    before = {stage: shard_times(out / stage) for stage in ("questions", "answers", "judge", "kept")}
    # no row failed and none was cut in the judge (a score is never cut): nothing is redone, nothing after reruns
    assert run_cli(["pipeline", str(file), "-o", str(out), "-q", "--json", "--redo", "failed"]) == 0
    states = {s["stage"]: s["state"] for s in json.loads(capsys.readouterr().out)["stages"]}
    assert states["kept"] == "up to date"
    assert {stage: shard_times(out / stage) for stage in before} == before


def test_a_stage_plans_the_columns_its_run_writes(tool_model_dir, tmp_path):
    """A model whose tokenizer brings its own response template: its generate stage writes `reasoning` and
    `tool_calls`, and the pipeline plans that stage's table with the same function as the run, so an sql stage that
    reads `reasoning` is planned (it was refused before any model loaded), runs, and gets the column."""
    (tmp_path / "seed.jsonl").write_text("".join(json.dumps({"topic": t}) + "\n" for t in TOPICS[:4]))
    data = {"defaults": {"model": str(tool_model_dir), "dtype": "float32"}, "stages": [
        {"name": "answers", "kind": "generate", "input": "seed.jsonl", "template": "Tell me about {{ topic }}.",
         "max_new_tokens": 6},
        {"name": "thoughts", "kind": "sql",
         "query": "SELECT id, answers.reasoning IS NULL AS no_reasoning FROM answers ORDER BY id"}]}
    file = tmp_path / "pipeline.yaml"
    file.write_text(yaml.safe_dump(data, sort_keys=False))
    assert pipeline(file, tmp_path / "out") == 0
    answers = list(read_shards(tmp_path / "out" / "answers"))
    assert len(answers) == 4 and all("reasoning" in row and "tool_calls" in row for row in answers)
    thoughts = sorted(read_shards(tmp_path / "out" / "thoughts"), key=lambda row: row["id"])
    assert [row["id"] for row in thoughts] == sorted(row["id"] for row in answers)
    assert all(row["no_reasoning"] == (answer["reasoning"] is None)
               for row, answer in zip(thoughts, sorted(answers, key=lambda r: r["id"])))


def test_an_sql_stage_reads_its_stages_tables_only_unless_it_opts_in_to_files(ran, tmp_path, capsys):
    """DuckDB's external access is off for sql stages: reading a file, COPY, ATTACH or INSTALL is refused before any
    model loads, naming the key that opts in; with it, the query reads the file."""
    file, out = ran
    (tmp_path / "extra.csv").write_text("topic,weight\nrain,3\n")
    data = yaml.safe_load(file.read_text())
    outside = f"SELECT * FROM read_csv('{tmp_path / 'extra.csv'}')"
    for query in (outside, "SELECT * FROM read_csv('/etc/passwd')",
                  f"SELECT questions.id FROM questions, read_csv('{tmp_path / 'extra.csv'}') e WHERE e.weight > 1"):
        data["stages"] = data["stages"][:1] + [{"name": "peek", "kind": "sql", "query": query}]
        file.write_text(yaml.safe_dump(data, sort_keys=False))
        assert pipeline(file, out) == 2
        err = capsys.readouterr().err
        assert "stage 'peek'" in err and "Permission Error" in err and "`read_files: true` on the stage" in err
    data["stages"] = data["stages"][:1] + [{"name": "peek", "kind": "sql", "read_files": True,
                                           "query": f"SELECT e.topic, e.weight FROM questions, read_csv("
                                                    f"'{tmp_path / 'extra.csv'}') e LIMIT 1"}]
    file.write_text(yaml.safe_dump(data, sort_keys=False))
    assert pipeline(file, out) == 0
    assert list(read_shards(out / "peek")) == [{"topic": "rain", "weight": 3}]
    data["stages"][1]["read_files"] = "yes"
    file.write_text(yaml.safe_dump(data, sort_keys=False))
    assert pipeline(file, out) == 2 and "read_files must be true or false" in capsys.readouterr().err
