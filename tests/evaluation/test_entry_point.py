"""lm-eval's plugin entry point names the class `cbgen eval` registers, so that a release of lm-eval that reads the
`lm_eval.models` group finds `--model cbgen` without cbgen's own command."""

from __future__ import annotations

from importlib.metadata import entry_points


def test_the_lm_eval_entry_point_loads_the_class_cbgen_eval_registers():
    from lm_eval.api.registry import get_model

    from cbgen.evaluation import NAME, register

    found = [e for e in entry_points(group="lm_eval.models") if e.name == NAME]
    assert len(found) == 1, "pyproject.toml declares no lm_eval.models entry point named cbgen (pip install -e .)"
    register()
    assert found[0].load() is get_model(NAME)
