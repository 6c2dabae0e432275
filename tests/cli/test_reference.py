"""docs/reference.md is `cbgen config reference`: made from the settings' own definitions, never stale."""

from __future__ import annotations

from pathlib import Path

from cbgen.cli import run_cli
from cbgen.cli._options import JOB_OPTIONS, SCORE_OPTIONS
from cbgen.cli.reference import PAGE, reference_markdown
from cbgen.config import BATCHING_FIELDS

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_current():
    committed = (ROOT / PAGE).read_text(encoding="utf-8")
    assert committed == reference_markdown(), f"{PAGE} is stale: run `cbgen config reference > {PAGE}`"


def test_every_flag_and_batching_key_is_on_the_page(capsys):
    assert run_cli(["config", "reference"]) == 0
    page = capsys.readouterr().out
    assert page == reference_markdown()
    for option in (*JOB_OPTIONS, *SCORE_OPTIONS):
        assert f"`{option.flags[0]}`" in page and f"| `{option.key}` |" in page
    for key in BATCHING_FIELDS:
        assert f"| `{key}` |" in page
