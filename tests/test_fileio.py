"""dash_trt.fileio: files written atomically get the umask's mode, whatever the writer does."""

import os
import stat

import pytest
import torch

from dash_trt.fileio import atomic_write


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("kind", ["safetensors", "torch", "text"])
def test_atomic_write_gives_the_umask_s_mode_whatever_the_writer(kind, tmp_path, umask_022):
    """safetensors' save_file leaves its file 0600; the written file must still be 0644 under
    umask 022 (a server running as another user reads the model repository), 0600 with private."""
    from safetensors.torch import save_file

    writers = {
        "safetensors": lambda tmp: save_file({"w": torch.ones(3)}, tmp),
        "torch": lambda tmp: torch.save({"w": 1}, tmp),
        "text": lambda tmp: open(tmp, "w").write("x"),  # noqa: SIM115 - closed on return
    }
    path = tmp_path / f"out.{kind}"
    atomic_write(str(path), writers[kind])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    atomic_write(str(path), writers[kind], private=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
