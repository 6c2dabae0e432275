"""The job configuration: precedence, validation messages, and every ContinuousBatchingConfig field reachable."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from transformers.generation import ContinuousBatchingConfig

from cbgen.config import BATCHING_REDIRECTS, JobConfig, build_config, check_value, config_template
from cbgen.errors import CbgenError


def write(tmp_path, text: str):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_defaults_then_yaml_then_flags(tmp_path):
    path = write(tmp_path, "batching:\n  page_size: 32\n  max_batch_tokens: 512\ngeneration:\n  max_new_tokens: 9\n")
    job = build_config(path, {("batching", "page_size"): (64, "--page-size")})
    assert job.batching == {"page_size": 64, "max_batch_tokens": 512}  # flag beats YAML, YAML beats default
    assert job.generation.max_new_tokens == 9
    assert job.generation.temperature is None  # untouched default


def test_template_parses_to_the_defaults(tmp_path):
    """`cbgen config init` writes a template whose values are exactly the built-in defaults."""
    assert build_config(write(tmp_path, config_template())).to_dict() == JobConfig().to_dict()


def test_every_continuous_batching_field_is_reachable():
    """Each ContinuousBatchingConfig field is accepted in the batching section, or redirected with a reason."""
    for field in dataclasses.fields(ContinuousBatchingConfig):
        if field.name in BATCHING_REDIRECTS:
            with pytest.raises(CbgenError, match=field.name):
                check_value("batching", field.name, 1, f"job.yaml: batching.{field.name}")
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        value = {"page_size": 16, "scheduler_type": "prefill_first", "use_cuda_graph": [True, False]}.get(
            field.name, default
        )
        assert check_value("batching", field.name, value, "x") == (tuple(value) if isinstance(value, list) else value)
        # and the template documents it
        assert f"{field.name}:" in config_template() or field.name in BATCHING_REDIRECTS


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("batching:\n  page_size: 2\n", r"job.yaml: batching.page_size must be an integer of at least 4 \(got 2\)"),
        ("batching:\n  scheduler_type: lifo\n", r"batching.scheduler_type must be one of: fifo, prefill_first"),
        ("batching:\n  safety_margin: 1.5\n", r"batching.safety_margin must be a fraction in \[0, 1\] \(got 1.5\)"),
        ("batching:\n  pagesize: 64\n", r"unknown key 'pagesize' in section 'batching'; did you mean 'page_size'\?"),
        ("batchin:\n  page_size: 64\n", r"unknown section 'batchin'; did you mean 'batching'\?"),
        ("batching:\n  page_size: [1\n", r"job.yaml:3: YAML syntax error"),
        ("generation:\n  max_new_tokens: ten\n", r"generation.max_new_tokens must be a positive integer"),
        ("batching:\n  block_size: 64\n", r"batching.block_size: deprecated in transformers: use batching.page_size"),
        ("batching:\n  return_logprobs: true\n", r"set generation.logprobs"),
        ("model:\n  dtype: fp8\n", r"model.dtype must be one of: auto, bfloat16, float16, float32"),
        ("- a\n- b\n", r"expected a mapping of sections"),
    ],
)
def test_yaml_errors_name_the_key_or_line(tmp_path, yaml_text, message):
    with pytest.raises(CbgenError, match=message):
        build_config(write(tmp_path, yaml_text))


def test_yaml_syntax_error_line_number(tmp_path):
    path = write(tmp_path, "generation:\n  max_new_tokens: 5\n  temperature: : :\n")
    with pytest.raises(CbgenError, match=r"job.yaml:3: YAML syntax error"):
        build_config(path)


def test_missing_config_file_says_how_to_make_one(tmp_path):
    with pytest.raises(CbgenError, match=r"does not exist; create one with `cbgen config init"):
        build_config(tmp_path / "nope.yaml")


def test_int_is_accepted_where_a_float_goes_but_not_bool_for_int():
    assert check_value("generation", "temperature", 1, "--temperature") == 1.0
    with pytest.raises(CbgenError):
        check_value("batching", "page_size", True, "--page-size")


def test_greedy_with_several_sequences_is_refused_naming_every_spelling_of_the_way_out():
    for overrides in ({("generation", "num_return_sequences"): (3, "--num-return-sequences")},
                      {("generation", "num_return_sequences"): (3, "-n"), ("generation", "temperature"): (0, "--t")}):
        with pytest.raises(CbgenError, match=r"--num-return-sequences 3 needs sampling.*give --temperature \(YAML "
                                             r"generation.temperature, Python temperature=\) above 0"):
            build_config(None, overrides)


def test_greedy_with_temperature_is_refused():
    overrides = {("generation", "do_sample"): (False, "--greedy"), ("generation", "temperature"): (0.7, "--t")}
    with pytest.raises(CbgenError, match=r"greedy decoding ignores --temperature \(YAML generation.temperature, "
                                         r"Python temperature=\): drop --do-sample false \(YAML generation.do_sample: "
                                         r"false, Python do_sample=false\)"):
        build_config(None, overrides)


@pytest.mark.parametrize("extra", [{}, {("generation", "top_p"): (0.9, "--top-p")},
                                   {("generation", "do_sample"): (False, "--greedy")}])
def test_temperature_zero_is_greedy(extra):
    """As in OpenAI's API and vLLM: temperature 0 takes the most likely token, whatever top_p or top_k say."""
    job = build_config(None, {("generation", "temperature"): (0, "--temperature"), **extra})
    assert job.do_sample is False and job.generation.temperature == 0
    with pytest.raises(CbgenError, match=r"temperature 0 is greedy decoding, and the job asks to sample: drop "
                                         r"--do-sample true"):
        build_config(None, {("generation", "temperature"): (0, "--temperature"),
                            ("generation", "do_sample"): (True, "--do-sample")})
    with pytest.raises(CbgenError, match=r"--temperature must be a number >= 0 \(0 is greedy"):
        build_config(None, {("generation", "temperature"): (-0.5, "--temperature")})


def test_sampling_is_implied_by_a_sampling_parameter():
    job = build_config(None, {("generation", "top_p"): (0.9, "--top-p"),
                              ("generation", "num_return_sequences"): (2, "-n")})
    assert job.do_sample is True
    assert build_config(None).do_sample is False


def test_effective_config_round_trips_through_yaml(tmp_path):
    job = build_config(None, {("batching", "page_size"): (64, "--page-size"),
                              ("input", "keep_columns"): (["a", "b"], "--keep-columns")})
    again = build_config(write(tmp_path, job.to_yaml()))
    assert again.to_dict() == job.to_dict()
    assert yaml.safe_load(job.to_yaml())["batching"] == {"page_size": 64}
