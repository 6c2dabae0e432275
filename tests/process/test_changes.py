"""cbgen.process.changes: every temporary change cbgen makes to the process is undone by the scope that made it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from cbgen.process.changes import Environ, PathEntry, Threads


def test_environ_sets_and_puts_back(monkeypatch):
    monkeypatch.delenv("CBGEN_TEST_A", raising=False)
    monkeypatch.setenv("CBGEN_TEST_B", "before")
    with Environ({"CBGEN_TEST_A": "1", "CBGEN_TEST_B": "2"}) as change:
        assert os.environ["CBGEN_TEST_A"] == "1" and os.environ["CBGEN_TEST_B"] == "2" and change.problem() is None
        os.environ["CBGEN_TEST_B"] = "changed behind its back"
        assert "CBGEN_TEST_B" in change.problem()
        os.environ["CBGEN_TEST_B"] = "2"
    assert "CBGEN_TEST_A" not in os.environ and os.environ["CBGEN_TEST_B"] == "before"
    assert change.problem() is None
    os.environ["CBGEN_TEST_B"] = "left changed"
    assert "after the scope" in change.problem()


def test_environ_keeps_a_users_own_setting(monkeypatch):
    monkeypatch.setenv("CBGEN_TEST_A", "0")
    with Environ({"CBGEN_TEST_A": "1"}, keep_set=True):
        assert os.environ["CBGEN_TEST_A"] == "0"
    assert os.environ["CBGEN_TEST_A"] == "0"


def test_overlapping_holders_share_and_the_last_puts_back(monkeypatch):
    monkeypatch.delenv("CBGEN_TEST_A", raising=False)
    first, second = Environ({"CBGEN_TEST_A": "1"}), Environ({"CBGEN_TEST_A": "1"})
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert os.environ["CBGEN_TEST_A"] == "1"  # the second still holds it
    with pytest.raises(RuntimeError, match="held as '1' by another scope, not '2'"):
        Environ({"CBGEN_TEST_A": "2"}).__enter__()
    second.__exit__(None, None, None)
    assert "CBGEN_TEST_A" not in os.environ


def test_a_path_entry_is_shared_by_threads_and_taken_out_after_the_last(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    folder = str(tmp_path)
    inside, go = threading.Barrier(3), threading.Event()
    seen = []

    def build():
        with PathEntry(folder):
            inside.wait()
            go.wait()
            seen.append(os.environ["PATH"].split(os.pathsep)[0])

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    inside.wait()
    assert os.environ["PATH"] == f"{folder}:/usr/bin:/bin"  # once, not once per holder
    go.set()
    for thread in threads:
        thread.join()
    assert seen == [folder, folder] and os.environ["PATH"] == "/usr/bin:/bin"


def test_threads_are_put_back_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(ZeroDivisionError), Threads(1) as change:
        assert torch.get_num_threads() == 1 and change.problem() is None
        1 / 0  # noqa: B018
    assert torch.get_num_threads() == before and change.problem() is None


def test_a_kernel_build_puts_path_back(monkeypatch, tmp_path):
    """Building a kernel puts the ninja package's folder on PATH for the build (torch runs `ninja` by name) and takes
    it out again: the process's PATH after the build is what it was."""
    ninja = pytest.importorskip("ninja")
    from torch.utils import cpp_extension

    from cbgen.kernels import build

    no_ninja = str(tmp_path / "bin")  # a PATH on which no ninja is found
    monkeypatch.setenv("PATH", no_ninja)
    during = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: during.append(os.environ["PATH"]) or "lib.so")
    build._compile("sampling", tmp_path)
    assert during == [f"{ninja.BIN_DIR}:{no_ninja}"] and os.environ["PATH"] == no_ninja


@pytest.mark.parametrize("name", ["TQDM_DISABLE", "THP_MEM_ALLOC_ENABLE"])
def test_importing_the_command_line_changes_no_environment(name):
    """A program that imports cbgen.cli (or runs a command in its own process) keeps its environment: TQDM_DISABLE
    (other libraries' bars off) and THP_MEM_ALLOC_ENABLE (torch's allocator in huge pages) are set while a command
    runs, and taken away after."""
    code = (f"import os; import cbgen.cli as cli; print({name!r} in os.environ); "
            f"seen = []; cli.command = lambda: lambda **kw: seen.append(os.environ.get({name!r})); "
            f"cli.run_cli([]); print(seen, {name!r} in os.environ)")
    env = {k: v for k, v in os.environ.items() if k != name}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["False", "['1'] False"]
