"""What `pip install cbgen` asks of users' environments: ranges, not our build machines' exact wheels."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).parent.parent


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(r).name: Requirement(r) for r in project["dependencies"]}


def test_torch_is_a_range_and_our_exact_wheel_a_constraint():
    torch = requirements()["torch"]
    assert not any(spec.operator == "==" for spec in torch.specifier), "torch must not be pinned for users"
    assert torch.specifier.contains("2.13.0") and torch.specifier.contains("2.20.0")
    constraints = [line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    assert "torch==2.13.0" in constraints
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()  # the set-up commands use it


def test_flash_attention_is_an_optional_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "flash-attn" not in requirements()
    assert any(Requirement(r).name == "flash-attn" for r in project["optional-dependencies"]["flash"])
