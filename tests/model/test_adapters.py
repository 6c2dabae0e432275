"""cbgen.model.adapters on its own: how a job names adapters, what fits a model (read from the structure and the
safetensors header, before any weight loads), and a merge that is PEFT's and is taken back bit for bit."""

from __future__ import annotations

import pytest
import torch

from cbgen.config.adapters import check_specs, split_spec
from cbgen.errors import CbgenError
from cbgen.model import packs
from cbgen.model.adapter_fit import check_fits, misfit, other_base, short_name, with_hub_ids
from cbgen.model.adapters import applied, resolve
from tests.adapters import merged_model


def test_specs_name_adapters_or_give_the_jobs_own(tmp_path):
    assert split_spec("a=./x") == ("a", "./x") and split_spec("./x") == (None, "./x")
    assert split_spec("org/lora") == (None, "org/lora") and split_spec("gpt-4o=org/lora") == ("gpt-4o", "org/lora")
    odd = tmp_path / "x=y"
    odd.mkdir()
    assert split_spec(str(odd)) == (None, str(odd))  # an existing path is never split
    assert check_specs("./x") and check_specs(["./x", "a=./y", "b=./z"])
    assert not check_specs(["./x", "./y"])  # two without a name: which runs the rows that name none?
    assert not check_specs(["a=./x", "a=./y"]) and not check_specs([""])


def test_resolve_reads_each_adapter_and_names_the_jobs_own_by_its_folder(lora_adapters):
    adapters = resolve([str(lora_adapters["a"]), f"other={lora_adapters['b']}"])
    assert adapters is not None and adapters.default is not None
    assert adapters.default.name == "a" and adapters.names() == ["a", "other"]
    assert adapters.pick(None) is adapters.default and adapters.pick("other").folder == lora_adapters["b"]
    with pytest.raises(KeyError):
        adapters.pick("nope")
    assert adapters.named["other"].describe()["r"] == 8
    first, again = adapters.identity(), resolve([str(lora_adapters["a"]), f"other={lora_adapters['b']}"]).identity()
    assert first == again and first["by_name"]["a"] != first["by_name"]["other"]
    same_settings = resolve([str(lora_adapters["a2"])]).identity()["by_name"]["a2"]
    assert same_settings["config_sha256"] == first["by_name"]["a"]["config_sha256"]  # same settings,
    assert same_settings["weights_sha256"] != first["by_name"]["a"]["weights_sha256"]  # other weights


def test_what_is_not_an_adapter_is_one_line_before_any_model(tmp_path, lora_adapters):
    with pytest.raises(CbgenError, match="no such folder"):
        resolve([str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CbgenError, match="no adapter_config.json"):
        resolve([str(tmp_path / "empty")])
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    (prefix / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    with pytest.raises(CbgenError, match="cbgen runs LoRA adapters"):
        resolve([str(prefix)])


def test_misfits_are_found_from_the_structure_alone(tiny_model_dir, lora_adapters):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # no weights: what a job checks before its model loads
        structure = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    adapters = resolve([str(lora_adapters[name]) for name in ("a",)] + [f"b={lora_adapters['b']}"])
    check_fits(adapters, structure)  # fits: no error
    assert misfit(resolve([str(lora_adapters["dora"])]).default, structure) is None
    wide = misfit(resolve([str(lora_adapters["wide"])]).default, structure)
    assert wide is not None and "maps 128 inputs" in wide and "64" in wide
    deep = misfit(resolve([str(lora_adapters["deep"])]).default, structure)
    assert deep is not None and "model.layers.2.self_attn" in deep and "does not have" in deep
    rank = misfit(resolve([str(lora_adapters["rank"])]).default, structure)
    assert rank is not None and "rank 16" in rank and "rank 4" in rank
    with pytest.raises(CbgenError, match=r"^--adapter .*wide: does not fit the model: "):
        check_fits(resolve([str(lora_adapters["wide"])]), structure)


@pytest.mark.parametrize("name", ["a", "b", "dora", "embed"])
def test_the_merge_is_peft_merge_and_unload_and_is_taken_back_bit_for_bit(tiny_model_dir, lora_adapters, name):
    model = merged_model(tiny_model_dir, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storage = {k: v.data_ptr() for k, v in model.state_dict().items()}
    reference = merged_model(tiny_model_dir, lora_adapters[name]).state_dict()
    adapter = resolve([str(lora_adapters[name])]).default
    packs.kept(model.model.layers[0].self_attn.q_proj.weight, "test", lambda w: w.clone())
    with applied(model, adapter):
        assert packs.count() == 0  # packed for the old values: dropped
        state = model.state_dict()
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[k], reference[k]) for k in state), "bitwise PEFT's merged model"
        assert {k: v.data_ptr() for k, v in state.items()} == storage  # in place: views of them see it
        changed = [k for k in state if not torch.equal(state[k], before[k])]
        assert changed and all(k.endswith("weight") for k in changed)
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in after)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear and not hasattr(model, "peft_config")


def structure_of(folder, **change):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, **change))


def test_an_embedding_adapter_fits_where_its_merge_is_exact(tiny_model_dir, lora_adapters):
    embed = resolve([str(lora_adapters["embed"])]).default
    assert misfit(embed, structure_of(tiny_model_dir)) is None  # the tiny model's embeddings are its own
    tied = misfit(embed, structure_of(tiny_model_dir, tie_word_embeddings=True))  # shared with the output layer
    assert tied is not None and "model.embed_tokens" in tied and "tie_word_embeddings" in tied


def test_an_adapter_carrying_another_models_embeddings_is_refused_and_the_model_kept(tiny_model_dir, lora_adapters):
    model = merged_model(tiny_model_dir, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CbgenError, match=r"^--adapter .*embed-other: it carries its own copy of a layer's weights"):
        with applied(model, resolve([str(lora_adapters["embed-other"])]).default):
            pass
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert type(model.model.embed_tokens) is torch.nn.Embedding and not hasattr(model, "peft_config")


@pytest.mark.parametrize(("base", "names", "same"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", ["SmolLM2-135M-Instruct.Q4_1.gguf"], True),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", ["/models/smollm2-135m-instruct/"], True),
    ("Qwen/Qwen3-4B", ["Qwen/Qwen3-4B-GGUF", "Qwen3-4B-Q8_0.gguf"], True),
    ("meta-llama/Llama-3.2-1B", ["meta-llama/Llama-3.2-1B-Instruct"], False),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", ["llama-1b"], False),
    ("", ["anything"], True),  # an adapter that names no base: nothing to compare
    ("HuggingFaceTB/SmolLM2-135M-Instruct", ["/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/ab12"], True),
])
def test_an_adapters_base_model_is_compared_by_name(lora_adapters, base, names, same):
    adapter = resolve([str(lora_adapters["a"])]).default
    config = adapter.config | {"base_model_name_or_path": base}
    named = type(adapter)(adapter.name, adapter.spec, adapter.folder, config)
    assert (other_base(named, with_hub_ids(names)) is None) == same
    assert short_name("SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct"


def test_a_merge_that_fails_leaves_the_model_as_it_was(tiny_model_dir, lora_adapters):
    model = merged_model(tiny_model_dir, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CbgenError, match="cannot be merged into the model"):
        with applied(model, resolve([str(lora_adapters["wide"])]).default):
            pass
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_two_adapters_that_would_share_a_name_are_refused_naming_both(lora_adapters, tmp_path):
    """The job's own adapter is named after its folder: another adapter given that name would take its place in the
    job's table (its rows, cache keys, resume fingerprint and run.json would name one and run the other)."""
    import shutil

    clash = tmp_path / "one" / "x"
    shutil.copytree(lora_adapters["a"], clash)
    with pytest.raises(CbgenError) as error:
        resolve([str(clash), f"x={lora_adapters['b']}"])
    message = str(error.value)
    assert "two adapters are called 'x'" in message and f"x={lora_adapters['b']}" in message
    assert f"{clash} (the job's own, named after its folder)" in message and "\n" not in message
    with pytest.raises(CbgenError, match="two adapters are called 'y'"):
        resolve([f"y={lora_adapters['a']}", f"y={lora_adapters['b']}"])
    same = resolve([str(clash), f"x={clash}"])  # one folder named twice is one adapter
    assert same is not None and [a.folder for a in same.all] == [clash]
    both = resolve([str(clash), f"b={lora_adapters['b']}"])
    assert both is not None and both.pick(None).folder == clash and both.pick("x").folder == clash


class _Interrupted(BaseException):
    pass


@pytest.mark.parametrize("failure", ["unpickling", "type", "interrupt"])
def test_a_merge_stopped_by_any_exception_leaves_the_base_model(tiny_model_dir, lora_adapters, monkeypatch, failure):
    """Whatever stops PEFT midway (a .bin adapter that does not unpickle, a config value of the wrong type, Ctrl-C
    inside the merge), the model's modules and weights are the base's bit for bit; an Exception is one line."""
    import pickle

    from peft.tuners.lora import LoraLayer, LoraModel

    model = merged_model(tiny_model_dir, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    raised = {"unpickling": pickle.UnpicklingError("invalid load key, 'x'"),
              "type": TypeError("'<' not supported between instances of 'str' and 'int'"),
              "interrupt": _Interrupted()}[failure]
    merge = LoraModel.merge_and_unload

    def fails_halfway(self, *args, **kwargs):
        layer = next(m for m in self.model.modules() if isinstance(m, LoraLayer))
        layer.merge()  # some weights already merged when it stops
        raise raised

    monkeypatch.setattr(LoraModel, "merge_and_unload", fails_halfway)
    expected = _Interrupted if failure == "interrupt" else CbgenError
    with pytest.raises(expected) as error:
        with applied(model, resolve([str(lora_adapters["a"])]).default):
            pass
    if failure != "interrupt":
        assert "cannot be merged into the model" in str(error.value) and "\n" not in str(error.value)
    monkeypatch.setattr(LoraModel, "merge_and_unload", merge)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(isinstance(m, LoraLayer) for m in model.modules()) and not hasattr(model, "peft_config")


def test_a_second_thread_is_refused_before_it_touches_the_weights(tiny_model_dir, lora_adapters):
    """One model, two threads: while one holds the weights (an adapter merged), another asking to run with its own
    adapter (or the base) is refused at once, and the weights come back to the base after; many times over."""
    import threading

    from cbgen.model.adapters import weights_held

    model = merged_model(tiny_model_dir, None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adapters = resolve([f"a={lora_adapters['a']}", f"b={lora_adapters['b']}"])
    refused, done = [], []
    for _ in range(20):
        inside, leave = threading.Event(), threading.Event()

        def first(inside=inside, leave=leave):
            with applied(model, adapters.pick("a")):
                inside.set()
                leave.wait(5)
            done.append(True)

        thread = threading.Thread(target=first)
        thread.start()
        inside.wait(5)
        merged = {k: v.clone() for k, v in model.state_dict().items()}
        for other in (adapters.pick("b"), None):
            with pytest.raises(CbgenError, match="already generating in another engine"):
                with applied(model, other):
                    pass
            refused.append(other)
        with pytest.raises(CbgenError, match="already generating in another engine"):
            with weights_held(model):
                pass
        assert all(torch.equal(v, merged[k]) for k, v in model.state_dict().items())  # untouched by the refusals
        leave.set()
        thread.join(5)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert len(done) == 20 and len(refused) == 40
    with applied(model, adapters.pick("b")):  # free again: this thread may hold it, and nest
        with weights_held(model):
            pass


def test_a_relative_path_with_one_slash_is_a_folder_first_then_a_hub_id_that_must_resolve(lora_adapters, tmp_path,
                                                                                           monkeypatch):
    import shutil

    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CbgenError, match=r"^--adapter adapters/legal: no such folder, and not a hub adapter found"):
        resolve(["adapters/legal"])  # not on disk, and no hub repo of that name in reach: named, not a silent download
    shutil.copytree(lora_adapters["a"], tmp_path / "adapters" / "legal")
    assert resolve(["adapters/legal"]).default.folder == tmp_path / "adapters" / "legal"  # the folder wins
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: asked.append(repo) or str(lora_adapters["b"]))
    assert resolve(["owner/repo"]).default.folder == lora_adapters["b"] and asked == ["owner/repo"]  # a hub id
