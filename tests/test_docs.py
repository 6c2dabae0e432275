"""The README stays a front page that a newcomer can read, and its links and the docs' links lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_quick_start_has_the_two_set_up_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"(?m)^(make \S+)", start.split("```bash", 1)[1].split("```", 1)[0])
    assert commands == ["make example", "make test"]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"(?m)^example: install$", makefile) and re.search(r"(?m)^test: install$", makefile)


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 120  # the reference lives in docs/
