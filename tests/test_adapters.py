"""LoRA adapters end to end on the tiny model (adapters made by PEFT in the tests: tests/conftest.py): a job's answers
are PEFT's merged model's, for one adapter and for rows that mix two and none; a row's bits do not depend on the other
adapters of its job; an adapter is part of the job's identity by its content; and what cannot run is one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cbgen.cli import run_cli
from cbgen.rows import read_shards
from tests.adapters import greedy, merged_model
from tests.helpers import write_jsonl

PROMPTS = ["Hello!", "Name three rivers.", "What is the capital of France?", "Write a poem about the sea.",
           "2+2?", "Tell me about owls.", "Why is the sky blue?", "List some colours."]
NEW = 10


def cbgen(tiny_model_dir, *args) -> int:
    return run_cli(["run", *map(str, args), "--model", str(tiny_model_dir), "--dtype", "float32", "-q"])


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def references(tiny_model_dir, lora_adapters, tokenizer):
    """Each prompt's greedy tokens from the base model and from PEFT's merged models of adapters a and b."""
    found = {}
    for name in (None, "a", "b"):
        model = merged_model(tiny_model_dir, lora_adapters[name] if name else None)
        found[name] = [greedy(model, chat_ids(tokenizer, p), NEW, tokenizer.eos_token_id) for p in PROMPTS]
    assert found["a"] != found[None] and found["b"] != found[None] and found["a"] != found["b"], \
        "the adapters change the answers (else equality below would prove nothing)"
    return found


def test_a_job_with_one_adapter_answers_as_the_merged_model(tiny_model_dir, lora_adapters, references, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, prompts, "-o", out, "--max-new-tokens", NEW, "--adapter", lora_adapters["a"]) == 0
    rows = {r["id"]: r["token_ids"] for r in read_shards(out)}
    assert [rows[f"q{i}"] for i in range(len(PROMPTS))] == references["a"]
    manifest = json.loads((out / "run.json").read_text())
    (adapter,) = manifest["model"]["adapters"]
    assert adapter["name"] == "a" and adapter["default"] and adapter["r"] == 4 and len(adapter["weights_sha256"]) == 64
    card = (out / "README.md").read_text()
    assert "adapters:" in card and f"`a` ({lora_adapters['a']}, the rows that name none)" in card


def mixed_rows(names: list[str | None]) -> list[dict]:
    return [{"id": f"q{i}", "prompt": p, **({"adapter": n} if n else {})}
            for i, (p, n) in enumerate(zip(PROMPTS, names, strict=False))]


MIX = ["a", None, "b", "a", "b", None, "a", "b"]


def test_rows_mixing_two_adapters_and_none_answer_as_their_merged_models(tiny_model_dir, lora_adapters, references,
                                                                          tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", mixed_rows(MIX))
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, prompts, "-o", out, "--max-new-tokens", NEW, "--logprobs", "--keep-columns",
                 "adapter", "--adapter", f"a={lora_adapters['a']}", "--adapter", f"b={lora_adapters['b']}") == 0
    rows = {r["id"]: r for r in read_shards(out)}
    for i, name in enumerate(MIX):
        assert rows[f"q{i}"]["token_ids"] == references[name][i], (i, name)
        assert rows[f"q{i}"].get("adapter") == name
    names = {a["name"]: a["default"] for a in json.loads((out / "run.json").read_text())["model"]["adapters"]}
    assert names == {"a": False, "b": False}


def test_an_openai_line_picks_an_adapter_by_its_model(tiny_model_dir, lora_adapters, references, tmp_path):
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": NEW}}
             for i, model in enumerate(["b", "gpt-4o-mini", "a"])]
    batch = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, batch, "-o", out, "--adapter", f"a={lora_adapters['a']}", "--adapter",
                 f"b={lora_adapters['b']}") == 0
    rows = {r["id"]: r["token_ids"] for r in read_shards(out)}
    # another model name is answered by the job's model, as before adapters existed
    assert [rows["r0"], rows["r1"], rows["r2"]] == [references["b"][0], references[None][1], references["a"][2]]


def test_a_rows_bits_do_not_depend_on_the_other_adapters_of_its_job(tiny_model_dir, lora_adapters, tmp_path):
    """Batch invariance with adapters: the a rows alone, and among b rows and base rows in another order and smaller
    batches, give the same tokens and bitwise the same logprobs (in the dtype the machine picks)."""
    adapters = ["--adapter", f"a={lora_adapters['a']}", "--adapter", f"b={lora_adapters['b']}"]
    common = ["--model", str(tiny_model_dir), "-q", "--max-new-tokens", NEW, "--logprobs", "--batch-invariant",
              *adapters]
    alone = write_jsonl(tmp_path / "alone.jsonl", [r for r in mixed_rows(MIX) if r.get("adapter") == "a"])
    mixed = write_jsonl(tmp_path / "mixed.jsonl", list(reversed(mixed_rows(MIX))))
    assert run_cli(["run", str(alone), "-o", str(tmp_path / "alone"), *map(str, common)]) == 0
    assert run_cli(["run", str(mixed), "-o", str(tmp_path / "mixed"), "--max-requests-per-batch", "3",
                    *map(str, common)]) == 0
    alone_rows = {r["id"]: r for r in read_shards(tmp_path / "alone")}
    mixed_rows_ = {r["id"]: r for r in read_shards(tmp_path / "mixed")}
    assert alone_rows
    for key, row in alone_rows.items():
        assert mixed_rows_[key]["token_ids"] == row["token_ids"]
        assert mixed_rows_[key]["logprobs"] == row["logprobs"]  # bitwise: the same floats


def test_a_resume_with_other_adapter_weights_refuses_and_the_cache_keys_on_them(tiny_model_dir, lora_adapters,
                                                                                 tmp_path, capsys):
    adapter = tmp_path / "lora"
    shutil.copytree(lora_adapters["a"], adapter)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS[:4])])
    cache = tmp_path / "cache"
    args = [prompts, "--max-new-tokens", NEW, "--adapter", adapter, "--cache", cache]
    assert cbgen(tiny_model_dir, *args, "-o", tmp_path / "first") == 0
    first = [r["token_ids"] for r in sorted(read_shards(tmp_path / "first"), key=lambda r: r["id"])]
    shutil.copy(lora_adapters["a2"] / "adapter_model.safetensors", adapter / "adapter_model.safetensors")
    capsys.readouterr()
    assert cbgen(tiny_model_dir, *args, "-o", tmp_path / "first") == 2  # the same path, other weights
    error = capsys.readouterr().err
    assert "holds a run of a different job" in error and "adapters.by_name.lora.weights_sha256" in error
    assert cbgen(tiny_model_dir, *args, "-o", tmp_path / "second") == 0  # other weights: no cached answer is theirs
    second = json.loads((tmp_path / "second" / "run.json").read_text())
    assert second["result_cache"]["hits"] == 0
    assert [r["token_ids"] for r in sorted(read_shards(tmp_path / "second"), key=lambda r: r["id"])] != first
    shutil.copy(lora_adapters["a"] / "adapter_model.safetensors", adapter / "adapter_model.safetensors")
    assert cbgen(tiny_model_dir, *args, "-o", tmp_path / "third") == 0  # the first weights again: all cached
    third = json.loads((tmp_path / "third" / "run.json").read_text())
    assert third["result_cache"]["hits"] == 4
    assert [r["token_ids"] for r in sorted(read_shards(tmp_path / "third"), key=lambda r: r["id"])] == first


@pytest.mark.parametrize(("make", "expected"), [
    (lambda a, tmp: tmp / "missing", "no such folder"),
    (lambda a, tmp: a["wide"], "does not fit the model: its update of model.layers.0.self_attn.q_proj maps 128"),
    (lambda a, tmp: a["deep"], "does not fit the model: it adapts model.layers.2.self_attn"),
    (lambda a, tmp: a["rank"], "says rank 16"),
])
def test_an_adapter_that_cannot_run_is_one_line_before_the_model_loads(tiny_model_dir, lora_adapters, tmp_path,
                                                                       capsys, monkeypatch, make, expected):
    from cbgen.model import load as model_load

    def no_weights(source, settings, tp, weights, *args):  # the structure may load, the weights must not
        assert not weights, "the weights loaded before the adapter was checked"
        return loading(source, settings, tp, weights, *args)

    loading = model_load._load
    monkeypatch.setattr(model_load, "_load", no_weights)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi"}])
    code = cbgen(tiny_model_dir, prompts, "-o", tmp_path / "out", "--adapter", make(lora_adapters, tmp_path))
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_row_naming_an_unknown_adapter_is_its_error_record_and_the_rest_run(tiny_model_dir, lora_adapters,
                                                                               references, tmp_path):
    rows = mixed_rows(["a", None, "b"])
    rows[2]["adapter"] = "c"
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, prompts, "-o", out, "--max-new-tokens", NEW, "--adapter",
                 f"a={lora_adapters['a']}") == 1  # some rows failed
    found = {r["id"]: r for r in read_shards(out)}
    assert found["q0"]["token_ids"] == references["a"][0] and found["q1"]["token_ids"] == references[None][1]
    assert found["q2"]["finish_reason"] == "error"
    assert "names adapter 'c', not one of the job's (a): give it with --adapter c=PATH" in found["q2"]["error"]
    # a job without adapters: `adapter` is a column like any other (a dataset may have one for its own reasons), not
    # a setting: every row runs on the base model, and the column is kept where asked
    plain = tmp_path / "plain"
    rows[1]["adapter"] = 7  # not even a name
    prompts = write_jsonl(tmp_path / "p2.jsonl", rows)
    assert cbgen(tiny_model_dir, prompts, "-o", plain, "--max-new-tokens", NEW, "--keep-columns", "adapter") == 0
    found = {r["id"]: r for r in read_shards(plain)}
    assert all(found[f"q{i}"]["token_ids"] == references[None][i] for i in range(3))
    assert [found[f"q{i}"]["adapter"] for i in range(3)] == ["a", 7, "c"]


def test_adapters_where_they_cannot_run_are_refused_in_one_line(tiny_model_dir, lora_adapters, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi", "completion": " there"}])
    assert run_cli(["score", str(prompts), "-o", str(tmp_path / "s"), "--model", str(tiny_model_dir), "-q",
                    "--adapter", f"a={lora_adapters['a']}"]) == 2
    assert "every row runs with the job's one adapter" in capsys.readouterr().err
    from dataclasses import replace

    from cbgen.config import build_config
    from cbgen.config.build import check_combinations
    from cbgen.config.flat import keyword_overrides
    from cbgen.errors import CbgenError

    job = build_config(None, keyword_overrides({"adapter": str(lora_adapters["a"])}))
    with pytest.raises(CbgenError, match="cbgen embed runs a model that cbgen does not merge LoRA adapters into"):
        check_combinations(replace(job, kind="embed"))  # a pipeline's embed stage with an adapter
    assert cbgen(tiny_model_dir, prompts, "-o", tmp_path / "r", "--adapter", lora_adapters["a"], "--data-parallel",
                 2) == 2
    assert "drop --tp and --data-parallel" in capsys.readouterr().err
    assert cbgen(tiny_model_dir, prompts, "-o", tmp_path / "r", "--adapter", lora_adapters["a"], "--adapter",
                 lora_adapters["b"]) == 2
    assert "at most one without a name" in capsys.readouterr().err


def test_an_adapter_made_for_another_model_runs_only_when_told(tiny_model_dir, lora_adapters, references, tmp_path,
                                                               capsys):
    renamed = tmp_path / "another-model"  # the same weights under another name: what cbgen cannot tell apart
    shutil.copytree(tiny_model_dir, renamed)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    assert cbgen(renamed, prompts, "-o", tmp_path / "refused", "--max-new-tokens", NEW, "--adapter",
                 lora_adapters["a"]) == 2
    err = capsys.readouterr().err
    assert f"made for {tiny_model_dir}" in err and "--adapter-any-base" in err and len(err.strip().splitlines()) == 1
    out = tmp_path / "out"
    assert cbgen(renamed, prompts, "-o", out, "--max-new-tokens", NEW, "--adapter", lora_adapters["a"],
                 "--adapter-any-base") == 0
    rows = {r["id"]: r["token_ids"] for r in read_shards(out)}
    assert [rows[f"q{i}"] for i in range(len(PROMPTS))] == references["a"]


def test_an_embedding_adapter_answers_as_its_merged_model(tiny_model_dir, lora_adapters, tokenizer, references,
                                                          tmp_path):
    model = merged_model(tiny_model_dir, lora_adapters["embed"])
    expected = [greedy(model, chat_ids(tokenizer, p), NEW, tokenizer.eos_token_id) for p in PROMPTS[:4]]
    assert expected != references[None][:4], "the adapter changes the answers"
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS[:4])])
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, prompts, "-o", out, "--max-new-tokens", NEW, "--adapter", lora_adapters["embed"]) == 0
    rows = {r["id"]: r["token_ids"] for r in read_shards(out)}
    assert [rows[f"q{i}"] for i in range(4)] == expected


def test_a_jobs_adapters_are_resolved_once(tiny_model_dir, lora_adapters, references, tmp_path, monkeypatch):
    """The engine, the result cache, the resume fingerprint, run.json and the card read one table: a hub adapter is
    looked up once for the whole job (each used to look it up again)."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: asked.append(repo) or str(lora_adapters["a"]))
    hub_id = f"tests/{tmp_path.name}"  # a name no other test asks for
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS)])
    out = tmp_path / "out"
    assert cbgen(tiny_model_dir, prompts, "-o", out, "--max-new-tokens", NEW, "--adapter", hub_id) == 0
    assert asked == [hub_id]
    rows = {r["id"]: r["token_ids"] for r in read_shards(out)}
    assert [rows[f"q{i}"] for i in range(len(PROMPTS))] == references["a"]
    (adapter,) = json.loads((out / "run.json").read_text())["model"]["adapters"]
    assert adapter["source"] == hub_id and adapter["name"] == tmp_path.name


def test_score_takes_the_jobs_adapter(tiny_model_dir, lora_adapters, tokenizer, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "x", "prompt": "Name a river.", "completion": " The Nile."}])
    out = tmp_path / "out"
    assert run_cli(["score", str(prompts), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32", "-q",
                    "--adapter", str(lora_adapters["b"])]) == 0
    (row,) = read_shards(out)
    model = merged_model(tiny_model_dir, lora_adapters["b"])
    context = chat_ids(tokenizer, "Name a river.")
    completion = tokenizer(" The Nile.", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([context + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(context) - 1 : -1], dim=-1).gather(1, torch.tensor(completion)[:, None])
    assert row["logprob"] == pytest.approx(float(logprobs.sum()), abs=1e-3)
    base = merged_model(tiny_model_dir, None)
    with torch.no_grad():
        plain = torch.log_softmax(base(torch.tensor([context + completion])).logits[0].float()[len(context) - 1 : -1],
                                  dim=-1).gather(1, torch.tensor(completion)[:, None])
    assert abs(float(plain.sum()) - row["logprob"]) > 1e-2  # the adapter changed the score


def test_the_python_api_and_the_evaluation_backend_take_an_adapter(tiny_model_dir, lora_adapters, references):
    import cbgen
    from cbgen.evaluation.lm import CbgenLM

    with cbgen.Generator(str(tiny_model_dir), dtype="float32", adapter=str(lora_adapters["a"])) as generator:
        results = generator.generate(PROMPTS[:3], max_new_tokens=NEW)
    assert [r.token_ids for r in results] == references["a"][:3]
    lm = CbgenLM(str(tiny_model_dir), dtype="float32", adapter=str(lora_adapters["b"]))
    from lm_eval.api.instance import Instance

    context, continuation = "Name a river:", " The Nile"
    ((logprob, _),) = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    whole, head = lm.tok_encode(context + continuation), lm.tok_encode(context)  # lm-eval's split of the pair
    model = merged_model(tiny_model_dir, lora_adapters["b"])
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float()
    expected = torch.log_softmax(logits[len(head) - 1 : -1], dim=-1).gather(1, torch.tensor(whole[len(head):])[:, None])
    assert logprob == pytest.approx(float(expected.sum()), abs=1e-3)


def test_cbgen_eval_moves_adapter_into_the_model_args():
    from cbgen.cli.eval_cmd import with_adapter

    assert with_adapter(["--tasks", "t", "--adapter", "./lora"]) == ["--tasks", "t", "--model_args", "adapter=./lora"]
    assert with_adapter(["--model_args", "dtype=float32", "--adapter=./lora", "--limit", "2"]) == [
        "--model_args", "dtype=float32,adapter=./lora", "--limit", "2"]
    assert with_adapter(["--model_args=model=m", "--adapter", "x"]) == ["--model_args=model=m,adapter=x"]
    assert with_adapter(["--tasks", "t"]) == ["--tasks", "t"]


def test_a_pipeline_stage_takes_its_adapter_and_the_next_stage_runs_on_the_base_model(tiny_model_dir, lora_adapters,
                                                                                       references, tmp_path):
    import yaml

    from cbgen.pipelines import load_pipeline
    from cbgen.pipelines.runner import PipelineRun

    shutil.copytree(lora_adapters["a"], tmp_path / "lora")
    write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS[:3])])
    stage = {"kind": "generate", "input": "p.jsonl", "max_new_tokens": NEW}
    spec = {"defaults": {"model": str(tiny_model_dir), "dtype": "float32"},
            "stages": [stage | {"name": "tuned", "adapter": "lora"}, stage | {"name": "plain"}]}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(spec))
    run = PipelineRun(load_pipeline(tmp_path / "pipeline.yaml"), tmp_path / "out")
    assert run.run().exit_code == 0
    assert run.models.loads == 1  # one load of the base weights for both stages
    tuned = {r["id"]: r["token_ids"] for r in read_shards(tmp_path / "out" / "tuned")}
    plain = {r["id"]: r["token_ids"] for r in read_shards(tmp_path / "out" / "plain")}
    assert [tuned[f"q{i}"] for i in range(3)] == references["a"][:3]  # the folder found beside the pipeline file
    assert [plain[f"q{i}"] for i in range(3)] == references[None][:3]  # the adapter left the weights with its stage


def test_a_chat_stage_answers_with_the_jobs_adapter(tiny_model_dir, lora_adapters, tokenizer, references, tmp_path):
    import yaml

    from cbgen.pipelines import load_pipeline
    from cbgen.pipelines.runner import PipelineRun

    write_jsonl(tmp_path / "q.jsonl", [{"id": f"q{i}", "turns": [p]} for i, p in enumerate(PROMPTS[:2])])
    spec = {"stages": [{"name": "talks", "kind": "chat", "input": "q.jsonl", "user_turns_column": "turns",
                        "max_turns": 1, "max_new_tokens": NEW, "model": str(tiny_model_dir), "dtype": "float32",
                        "adapter": str(lora_adapters["a"])}]}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(spec))
    assert PipelineRun(load_pipeline(tmp_path / "pipeline.yaml"), tmp_path / "out").run().exit_code == 0
    rows = {r["id"]: r for r in read_shards(tmp_path / "out" / "talks")}
    for i in range(2):
        reply = rows[f"q{i}"]["messages"][-1]
        assert reply["role"] == "assistant"
        said = {k: tokenizer.decode(references[k][i], skip_special_tokens=True).strip() for k in ("a", None)}
        assert said["a"] != said[None]  # the adapter changes this answer, so the check below can fail
        assert reply["content"].strip() == said["a"]  # the chat stage keeps the reply as decoded
