"""cbgen as an lm-evaluation-harness backend (docs/evaluation.md):

    cbgen eval --model_args model=HuggingFaceTB/SmolLM2-135M-Instruct,dtype=float32 --tasks ... --include_path ...

lm-eval's `--model cbgen` is `CbgenLM` (cbgen.evaluation.lm): one loaded model for the whole evaluation, its three
request types answered by cbgen's own scorer (`loglikelihood`, `loglikelihood_rolling`) and engine
(`generate_until`), with lm-eval's own tokenization rules so that the numbers are the ones `--model hf` gives.

lm-eval finds a model by name in its registry, which a package joins by calling `register_model` when it is
imported; lm-eval 0.4.13 and earlier read no plugin entry point. cbgen also declares one (`lm_eval.models`:
`cbgen = cbgen.evaluation.lm:CbgenLM`, the group lm-eval merged upstream in its PR 4013), so that `lm_eval --model
cbgen` works with the first release that reads it. `cbgen eval` is lm-eval's own command line with cbgen registered
first; from Python, `cbgen.evaluation.register()` and then `lm_eval.simple_evaluate(model="cbgen", ...)`.
Installed with the `eval` extra: `pip install 'cbgen[eval]'`.
"""

from __future__ import annotations

from cbgen.errors import CbgenError

NAME = "cbgen"


def register() -> None:
    """Makes `cbgen` a model name lm-eval knows (idempotent)."""
    try:
        import lm_eval.models  # noqa: F401  # lm-eval's own names first: it reads them only into an empty registry
        from lm_eval.api.registry import model_registry, register_model
    except ImportError as error:
        raise CbgenError("lm-evaluation-harness is not installed: pip install 'cbgen[eval]'") from error
    if NAME in model_registry:
        return
    from cbgen.evaluation.lm import CbgenLM

    register_model(NAME)(CbgenLM)
