"""The plans cbgen makes for a CUDA machine, checked on this CPU machine: a model's structure on torch's meta device
stands for one on the GPU, and CUDA's availability (and flash attention's) is mocked. Each test here failed before
the GPU path was fixed: flash attention with a step control, CUDA graphs forced on with one, the in-flight window,
the dtype, FA3, lm-eval's cuda:0, the scorer's choices under flash attention and the NCCL variable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers.utils
from transformers import LlamaConfig, LlamaForCausalLM

from cbgen.config import JobConfig
from cbgen.control.needs import StepPlan
from cbgen.control.sampling import SamplingPlan
from cbgen.engine.kv_sizing import WorkloadShape
from cbgen.engine.scope import STOCK, EngineScope
from cbgen.engine.setup import plan_engine
from cbgen.errors import CbgenError
from cbgen.model.load import LoadedModel, resolve_attn_implementation, resolve_dtype
from cbgen.model.source import ModelSource

VOCAB = 512


@pytest.fixture
def cuda(monkeypatch):
    """CUDA visible to torch (no kernel runs: the models stay on the meta device), flash attention not installed
    unless a test says so."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    flash = {2: False, 3: False}
    for version in flash:
        monkeypatch.setattr(transformers.utils, f"is_flash_attn_{version}_available",
                            lambda *a, version=version, **k: flash[version])
    return flash


def on_gpu(implementation: str = "sdpa") -> LoadedModel:
    """A small Llama's structure as if loaded on the GPU in bfloat16 with `implementation`."""
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, eos_token_id=2)
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config._attn_implementation = implementation  # as loading with flash attention installed sets it
    tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    return LoadedModel(model.eval(), tokenizer, ModelSource("tiny", "tiny"), "cuda", torch.bfloat16,  # type: ignore
                       implementation, 0.0)


def plan(loaded: LoadedModel, steps: StepPlan | None = None, **batching):
    job = JobConfig()
    job.batching.update(batching)
    workload = WorkloadShape(longest_prompt=64, max_new_tokens=16, num_return_sequences=1, requests=4000)
    return plan_engine(job, loaded, workload, SamplingPlan(False, None, None, None, VOCAB), steps)


LOGPROBS = StepPlan(VOCAB, None, formats=False, do_sample=False, capture=True, top_logprobs=5, seeds=False)


@pytest.mark.parametrize("flash_version", [2, 3])
@pytest.mark.parametrize("loaded_as", ["sdpa", "flash"])
def test_flash_attention_with_a_step_control_builds_no_dense_mask(cuda, flash_version, loaded_as):
    """Loaded with flash attention, or with sdpa that transformers' manager switches to flash by itself (where it is
    installed): the plan expects no dense mask, installs nothing of cbgen's CPU path, runs the step control in the
    synchronous loop, and the scope accepts the manager transformers builds that way."""
    cuda[flash_version] = True
    implementation = f"flash_attention_{flash_version}"
    loaded = on_gpu("sdpa" if loaded_as == "sdpa" else implementation)
    engine = plan(loaded, LOGPROBS)
    scope = engine.scope
    manager = SimpleNamespace(  # what transformers' manager is after init_continuous_batching and warmup
        continuous_batching_config=SimpleNamespace(varlen_compile_config=None, decode_compile_config=None),
        batch_processor=SimpleNamespace(inputs_and_outputs=SimpleNamespace(attention_mask=None)))
    with EngineScope(loaded.model, scope) as entered:
        loaded.model.config._attn_implementation = implementation  # the manager's switch_to_cb_friendly_attn
        entered._check_built(manager)  # raised "built without the dense attention mask" before
        loaded.model.config._attn_implementation = "sdpa"
        with pytest.raises(RuntimeError, match="runs the model with sdpa attention, and the plan was made for flash"):
            entered._check_built(manager)
    assert scope.implementation == implementation
    assert not scope.dense_mask and scope.describe()["dense_attention_mask"].startswith("not built")
    assert scope.attention == STOCK and scope.linear == "stock" and not scope.batch_invariant
    assert not scope.fused_layers and not scope.lazy_kv_cache and not scope.linear_kernel[0]
    assert engine.batching["use_cuda_graph"] is False and engine.batching["use_async_batching"] is False


def test_sdpa_without_flash_keeps_the_mask_and_asks_transformers_for_graphs(cuda):
    engine = plan(on_gpu("sdpa"))
    assert engine.scope.implementation == "sdpa" and engine.scope.dense_mask
    assert "use_cuda_graph" not in engine.batching and "use_async_batching" not in engine.batching
    no_switch = plan(on_gpu("sdpa"), auto_switch_to_flash=False)
    cuda[2] = True
    assert no_switch.scope.implementation == "sdpa"
    assert plan(on_gpu("sdpa"), auto_switch_to_flash=False).scope.implementation == "sdpa"
    assert plan(on_gpu("sdpa")).scope.implementation == "flash_attention_2"


@pytest.mark.parametrize("forced", [{"use_cuda_graph": True}, {"use_cuda_graph": (False, True)},
                                    {"use_async_batching": True}])
def test_graphs_forced_on_with_a_step_control_are_refused_in_one_line(cuda, forced):
    name = next(iter(forced))
    with pytest.raises(CbgenError, match=f"batching.{name} is on, and this job needs cbgen's step control "
                                         r"\(logprobs, top 5 logprobs\)") as raised:
        plan(on_gpu(), LOGPROBS, **forced)
    assert "\n" not in str(raised.value)
    assert plan(on_gpu(), None, **forced).batching[name] == forced[name]  # no step control: the user's choice


def test_the_in_flight_window_keeps_transformers_largest_batch_fed(cuda):
    from transformers.generation.continuous_batching.initialization import FALLBACK_DEFAULTS

    assert FALLBACK_DEFAULTS["max_requests_per_batch"] == 1024
    assert plan(on_gpu()).settings.max_in_flight == 2 * 1024
    assert plan(on_gpu(), max_requests_per_batch=64).settings.max_in_flight == 128


def test_dtype_and_attention_chosen_for_the_gpu(cuda, monkeypatch):
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # a V100 or T4
    assert resolve_dtype("auto", "cuda") == torch.float16
    assert resolve_attn_implementation(None, "cuda") is None
    cuda[2] = True
    assert resolve_attn_implementation(None, "cuda") == "flash_attention_2"
    cuda[3] = True
    assert resolve_attn_implementation(None, "cuda") == "flash_attention_3"
    assert resolve_attn_implementation(None, "cuda", supports_flash=lambda: False) is None
    assert resolve_attn_implementation(None, "cpu") is None


def test_lm_eval_device_cuda_0_is_cbgens_cuda(cuda, monkeypatch):
    """lm-eval gives every model --device (cuda:0 unless told): on a GPU machine that is cbgen's cuda."""
    import cbgen.api
    from cbgen.evaluation.lm import CbgenLM

    made: list[dict] = []

    class Recording:
        def __init__(self, model, **settings):
            made.append(settings)
            self.loaded = SimpleNamespace(tokenizer=None)

    monkeypatch.setattr(cbgen.api, "Generator", Recording)
    CbgenLM(model="tiny", device="cuda:0", batch_size=8)
    assert made[-1]["device"] == "cuda"
    from cbgen.evaluation.lm import harness_device

    assert harness_device("cuda") == "cuda" and harness_device("cpu") == "cpu"
    with pytest.raises(CbgenError, match="--device cuda:1: cbgen runs on the first visible GPU; choose that GPU "
                                         "with CUDA_VISIBLE_DEVICES"):
        harness_device("cuda:1")
    with pytest.raises(CbgenError, match="--device mps: cbgen runs on cpu or cuda"):
        harness_device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    CbgenLM(model="tiny", device="cuda:0")  # lm-eval's default on a machine without CUDA: cbgen's own choice
    assert "device" not in made[-1]


def test_the_nccl_variable_is_set_before_the_process_group_starts(cuda, monkeypatch):
    """NCCL reads NCCL_GRAPH_MIXING_SUPPORT once, when the process group starts under --tp on GPUs."""
    import torch.distributed as dist

    from cbgen.parallel import tensor

    seen: list[str | None] = []
    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT", raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: seen.append(
        __import__("os").environ.get("NCCL_GRAPH_MIXING_SUPPORT")))
    monkeypatch.setattr(dist, "new_group", lambda backend: "group")
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    job = JobConfig()
    job.model.tp_size, job.model.device = 2, "cuda"
    assert tensor.setup(job, {"WORLD_SIZE": "2", "LOCAL_RANK": "0"}) is not None
    assert seen == ["0"]
    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT")
    job.batching["disable_nccl_graph_mixing"] = False
    tensor.setup(job, {"WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert seen == ["0", None]
