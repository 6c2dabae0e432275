"""cbgen's compiled kernels and the folder they are cached in: a library in a folder another user could write is never
loaded (it is built again where only this user can write), the folders cbgen makes are its user's alone, and a job
says it is building before the minute that takes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from cbgen.kernels import build
from tests.helpers import fresh_caches


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "shared-cache"
    monkeypatch.setenv("CBGEN_CACHE_DIR", str(root))
    monkeypatch.delenv("CBGEN_KERNEL_CACHE_DIR", raising=False)  # the kernels under the cache folder, as by default
    return root


def _planted(folder: Path, name: str) -> Path:
    """A cached build of `name` as if someone had put it there: the library and the marker of a finished build."""
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"{build._module_name(name)}.so"
    library.write_bytes(b"\x7fELF planted")
    (folder / build._DONE).write_text("1.0\n")
    return library


def test_a_library_in_a_folder_others_can_write_is_never_loaded(cache, monkeypatch):
    import torch

    folder = build.build_folder("sampling")
    planted = _planted(folder, "sampling")
    os.chmod(cache, 0o777)  # a shared cache folder anyone can write (not sticky)
    loaded: list[str] = []
    compiled: list[Path] = []
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(str(path)))

    def compile_privately(name: str, where: Path) -> Path:
        compiled.append(where)
        return where / "built.so"

    monkeypatch.setattr(build, "_compile", compile_privately)
    state = build._load("sampling")
    assert str(planted) not in loaded
    assert compiled and compiled[0] != folder and str(cache) not in str(compiled[0])
    mode = compiled[0].stat().st_mode
    assert compiled[0].stat().st_uid == os.getuid() and not mode & (stat.S_IRWXG | stat.S_IRWXO)
    assert state.loaded and state.library == compiled[0] / "built.so"
    assert "can be written by other users" in (build.unsafe_reason(planted) or "")


def test_a_cache_folder_of_this_users_own_is_loaded_and_made_private(cache, monkeypatch):
    import torch

    loaded: list[str] = []
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(str(path)))
    monkeypatch.setattr(build, "_compile", lambda name, where: _planted(where, name))
    state = build._load("sampling")  # nothing cached yet: built into the cache, whose folders it makes 0700
    assert state.loaded and state.library is not None and state.library.parent == build.build_folder("sampling")
    for folder in (cache, cache / "kernels", build.build_folder("sampling")):
        assert not folder.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO), folder
    assert build._load("sampling").detail == "cached" and loaded == [str(state.library)]


def test_a_job_says_it_builds_the_kernels_before_it_waits(cache, monkeypatch):
    fresh_caches(monkeypatch, "kernel builds")  # none started in this process (another test's may have been)
    notice = build.build_notice()
    assert notice is not None and "once per machine, about a minute on 2 cores" in notice
    assert all(name in notice for name in build.GENERATION) and str(cache / "kernels") in notice
    monkeypatch.setattr(build, "_cached", lambda name: True)
    assert build.build_notice() is None
    monkeypatch.setattr(build, "_cached", lambda name: False)
    monkeypatch.setenv(build.DISABLE_ENV, "1")
    assert build.build_notice() is None


def test_the_kernels_folder_is_its_own_setting(tmp_path, monkeypatch):
    """A job with its own model cache (--model-cache-dir, CBGEN_CACHE_DIR) loads the kernels the machine built where
    CBGEN_KERNEL_CACHE_DIR says, instead of building them again under its cache."""
    monkeypatch.setenv("CBGEN_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("CBGEN_KERNEL_CACHE_DIR", str(tmp_path / "kernels-here"))
    assert build.build_folder("sampling").parent == tmp_path / "kernels-here"
    monkeypatch.delenv("CBGEN_KERNEL_CACHE_DIR")
    assert build.build_folder("sampling").parent == tmp_path / "models" / "kernels"
