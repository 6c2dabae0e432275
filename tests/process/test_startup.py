"""A command's process start: torch's CPU allocator asked for transparent huge pages (cbgen.process.startup)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# a command that allocates 200 MB with torch and prints how much of the process is in huge pages
_CODE = ("import cbgen.cli as cli\n"
         "def command():\n"
         "    def run(**kw):\n"
         "        import torch\n"
         "        x = torch.ones(50_000_000)\n"
         "        huge = [l for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')]\n"
         "        print(int(huge[0].split()[1]))\n"
         "    return run\n"
         "cli.command = command\n"
         "cli.run_cli([])\n")


def _huge_kb(env_value: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", _CODE], env=env, capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1])


def _mode() -> str:
    found = re.search(r"\[(\w+)\]", MODE.read_text()) if MODE.exists() else None
    return found.group(1) if found else "absent"


@pytest.mark.skipif(_mode() != "madvise", reason="huge pages are asked for per allocation only where the kernel's "
                    "mode is madvise (always gives them anyway, never refuses them)")
def test_a_command_s_large_tensors_sit_in_huge_pages_unless_the_user_says_no():
    assert _huge_kb(None) >= 100_000  # most of the 200 MB in 2 MB pages
    assert _huge_kb("0") == 0  # the user's own setting wins

