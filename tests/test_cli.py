"""The README's main job: dash-demo runs the paged operator and checks it."""

import io

import pytest
import torch

from dash_trt.commands import demo


def test_demo_passes_and_reports(capsys):
    stream = io.StringIO()
    assert demo.run_demo(seed=3, sequences=2, pages=2, decode_steps=5, kv_block_size=16, stream=stream)
    text = stream.getvalue()
    assert "RESULT: paged operator matches the reference" in text
    assert text.count("-> OK") == 2


def test_demo_main_exit_codes(capsys, monkeypatch):
    assert demo.demo_main(["--sequences", "1", "--pages", "2", "--decode-steps", "3"]) == 0
    assert "matches the reference" in capsys.readouterr().out
    # A broken operator must turn into a failing exit code, not a printed "OK".
    real = demo.paged_dash_attention

    def broken(*a, **kw):
        out, routing = real(*a, **kw)
        return out + 0.1, routing

    monkeypatch.setattr(demo, "paged_dash_attention", broken)
    assert demo.demo_main(["--sequences", "1", "--pages", "2", "--decode-steps", "3"]) == 1
    assert "DOES NOT match" in capsys.readouterr().out


def test_demo_rejects_bad_arguments(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        demo.demo_main(["--pages", "0"])
    assert e.value.code == 2
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            demo.demo_main(["--device", "cuda"])
        assert "no CUDA device" in capsys.readouterr().err
    for bad, message in (("bogus", "is not a device"), ("meta", "only cpu and cuda")):
        with pytest.raises(SystemExit) as e:
            demo.demo_main(["--device", bad])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_model_load_errors_from_a_triton_log():
    from dash_trt.triton.server import model_load_errors

    log = (
        'I1201 14:03:22.303905 20811 model_lifecycle.cc:777] "loading: dash:1"\n'
        "E1201 14:03:22.599982 20811 model_lifecycle.cc:642] \"failed to load 'dash' version 1: Internal: "
        'CheckpointError: /r/dash/1/model.pt is not a readable PyTorch checkpoint"\n'
        "E1201 14:03:22.599982 20811 model_lifecycle.cc:642] \"failed to load 'dash' version 1: again\"\n"
        "| dash        | 1       | UNAVAILABLE: Internal: CheckpointError: ... |\n"
    )
    assert model_load_errors(log) == [
        "model 'dash' version 1 failed to load: Internal: CheckpointError: "
        "/r/dash/1/model.pt is not a readable PyTorch checkpoint"
    ]
    assert model_load_errors("no errors here") == []


@pytest.mark.parametrize(
    "argv",
    [
        ["dash_trt.export"],
        ["dash_trt.compare"],
        ["dash_trt.build"],
        ["dash_trt.triton.cli", "write"],
        ["dash_trt.triton.cli", "serve"],
        ["dash_trt.triton.cli", "openai"],
        ["dash_trt.triton.cli", "probe"],
        ["dash_trt.triton.client"],
        ["dash_trt.commands.info"],
        ["dash_trt.triton.loadtest"],
        ["dash_trt.commands.demo"],
    ],
)
def test_every_command_line_builds_its_parser_and_prints_help(argv):
    """An option defined twice (argparse raises at parser construction) breaks a whole command."""
    import subprocess
    import sys

    code = (
        "import runpy, sys; sys.argv = ['x', *sys.argv[1:], '--help']; "
        f"runpy.run_module({argv[0]!r}, run_name='__main__')"
    )
    res = subprocess.run([sys.executable, "-c", code, *argv[1:]], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout and "Traceback" not in res.stderr
    assert "Exit codes: 0" in " ".join(res.stdout.split()), "--help must list the exit codes"


def test_load_test_reports_a_bad_checkpoint_in_one_line(tmp_path):
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "dash_trt.triton.loadtest", "--checkpoint", str(tmp_path / "none.pt"), "--no-check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [f"loadtest: error: checkpoint not found: {tmp_path / 'none.pt'}"]


def test_openai_endpoint_without_a_triton_server_says_so_in_one_line():
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nothing listens on: bound here, never accepting
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        res = subprocess.run(
            [sys.executable, "-m", "dash_trt.triton.cli", "openai", "--url", f"127.0.0.1:{port}", "--port", "9999"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dash-triton openai: error: ") and "refused" in lines[0], lines
    res = subprocess.run(
        [sys.executable, "-m", "dash_trt.triton.cli", "openai", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and res.stderr.strip() == "dash-triton openai: error: --port must be 1..65535, got 70000"


def _commands():
    """Every console script the package installs (its entry points), and the load test."""
    from importlib.metadata import entry_points

    found = {e.name: e.value for e in entry_points(group="console_scripts") if e.value.startswith("dash_trt.")}
    assert {"dash-export", "dash-build", "dash-compare", "dash-demo", "dash-client", "dash-triton"} <= set(found)
    return sorted(found.items()) + [("dash-loadtest", "dash_trt.triton.loadtest:main")]


@pytest.mark.parametrize("name,target", _commands())
def test_an_unexpected_error_is_one_line_and_exit_70_with_the_traceback_under_verbose(
    name, target, monkeypatch, capsys
):
    """A bug (here planted in argparse, which every command calls first) is neither a traceback
    on the user's terminal nor exit 1 (a mismatch): one line naming the error, exit 70; with
    --verbose, the traceback before it; Ctrl-C one line, exit 130."""
    import argparse
    import importlib

    from dash_trt.cliutil import EXIT_INTERNAL, EXIT_INTERRUPTED

    module, func = target.split(":")
    main = getattr(importlib.import_module(module), func)
    monkeypatch.delenv("DASH_TRT_VERBOSE", raising=False)

    def planted(self, *args, **kwargs):
        raise RuntimeError("planted bug\n  on two lines")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", planted)
    assert main(["anything"]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        f"{name}: internal error: RuntimeError: planted bug on two lines (rerun with "
        f"--verbose for the traceback, and please report it)"
    ]
    assert main(["anything", "--verbose"]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and "in planted" in err
    assert err.strip().splitlines()[-1].startswith(f"{name}: internal error: RuntimeError: planted bug")

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", interrupted)
    assert main(["anything"]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == f"{name}: interrupted"


def test_probe_without_a_server_or_with_a_bad_timeout_says_so_in_one_line():
    import io
    import socket

    from dash_trt.triton.cli import main

    with socket.socket() as s:  # a port nothing listens on: bound here, never accepting
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        out, err = io.StringIO(), io.StringIO()
        assert main(["probe", "--url", f"127.0.0.1:{port}", "--timeout", "5"], stdout=out, stderr=err) == 3
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"dash-triton probe: error: no Triton server at 127.0.0.1:{port}: StatusCode.UNAVAILABLE"
    ), lines
    assert out.getvalue() == ""
    err = io.StringIO()
    assert main(["probe", "--timeout", "0"], stdout=io.StringIO(), stderr=err) == 2
    assert err.getvalue().strip() == "dash-triton probe: error: --timeout must be > 0, got 0"


@pytest.mark.parametrize(
    "argv",
    [
        ["dash_trt.export"],
        ["dash_trt.compare"],
        ["dash_trt.build"],
        ["dash_trt.triton.cli"],
        ["dash_trt.triton.client"],
        ["dash_trt.triton.loadtest"],
        ["dash_trt.commands.demo"],
        ["dash_trt.commands.info"],
    ],
)
def test_every_command_prints_the_same_version_line(argv):
    """--version: the package's version with the kernel ABI and plugin versions it expects, the
    same line from every command, and the version the installed metadata carries."""
    import subprocess
    import sys
    from importlib.metadata import version

    import dash_trt
    from dash_trt.attention.dash.attributes import PLUGIN_VERSION
    from dash_trt.attention.dash.cuda import ABI_VERSION

    code = f"import runpy, sys; sys.argv = ['x', '--version']; runpy.run_module({argv[0]!r}, run_name='__main__')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == f"dash-trt {dash_trt.__version__} (kernel ABI {ABI_VERSION}, plugin {PLUGIN_VERSION})"
    assert version("dash-trt") == dash_trt.__version__  # pyproject.toml and the package agree


def test_info_reports_what_is_found_and_what_is_missing(monkeypatch, tmp_path):
    import io
    import json

    from dash_trt.commands import info

    monkeypatch.setenv("DASH_TRT_LIBRARY", str(tmp_path / "none.so"))
    monkeypatch.setattr("dash_trt.attention.dash.cuda.library_path", lambda: None)
    out = io.StringIO()
    assert info.main(["info", "--json"], stdout=out) == 0
    got = json.loads(out.getvalue())
    assert got["dash_trt"]["line"] == info.version_line()
    assert got["kernels"]["path"] is None and got["kernels"]["status"].startswith("not found")
    assert got["onnxruntime"]["status"] == "ok" and "CPUExecutionProvider" in got["onnxruntime"]["providers"]
    assert set(got) == {"dash_trt", "torch", "kernels", "gpu", "tensorrt", "onnxruntime", "onnx", "triton"}
    out = io.StringIO()
    assert info.main(["info"], stdout=out) == 0
    text = out.getvalue()
    assert text.splitlines()[0] == info.version_line() and "kernel library: not found" in text
    # two ONNX Runtime distributions writing the same module are named
    real = info._dist_version
    monkeypatch.setattr(info, "_dist_version", lambda d: "1.20.0" if d == "onnxruntime-gpu" else real(d))
    assert "onnxruntime and onnxruntime-gpu are both installed" in info._onnxruntime()["warning"]


def test_kernel_architectures_are_named_as_torch_names_them():
    from dash_trt.attention.dash.cuda import arch_names, runs_on

    assert arch_names("80-real,89-real,90") == ("sm_80", "sm_89", "sm_90", "compute_90")
    assert arch_names("80-real;90-virtual") == ("sm_80", "compute_90")
    assert arch_names("native") == ("native",)
    archs = arch_names("80-real,89-real,90")
    assert runs_on((8, 0), archs) and runs_on((8, 6), archs)  # sm_80 machine code runs on sm_86
    assert runs_on((8, 9), archs) and runs_on((9, 0), archs)
    assert runs_on((10, 0), archs) and runs_on((12, 0), archs)  # newer GPUs JIT the compute_90 PTX
    assert not runs_on((7, 5), archs)
    assert not runs_on((10, 0), arch_names("80-real,90-real"))  # no PTX: nothing for sm_100
    # the default list: Hopper's machine code architecture-specific (90a), plain Hopper PTX
    default = arch_names("80-real;89-real;90a-real;90-virtual")
    assert default == ("sm_80", "sm_89", "sm_90a", "compute_90")
    assert runs_on((9, 0), ("sm_90a",)) and not runs_on((9, 1), ("sm_90a",)) and not runs_on((10, 0), ("sm_90a",))
    assert not runs_on((10, 0), arch_names("90a"))  # arch-specific PTX is not forward compatible either
    assert runs_on((10, 0), default) and runs_on((9, 0), default) and runs_on((8, 6), default)


def test_plugin_is_found_in_the_installation_or_through_the_environment(monkeypatch, tmp_path):
    from dash_trt import libraries

    plugin = tmp_path / libraries.PLUGIN_NAME
    static = tmp_path / libraries.STATIC_PLUGIN_NAME
    monkeypatch.setenv("DASH_TRT_PLUGIN", str(plugin))
    assert libraries.plugin_path() is None and libraries.plugin_path(libraries.STATIC_PLUGIN_NAME) is None
    plugin.write_bytes(b"x")
    assert libraries.plugin_path() == plugin and libraries.plugin_path(libraries.STATIC_PLUGIN_NAME) is None
    static.write_bytes(b"x")
    assert libraries.plugin_path(libraries.STATIC_PLUGIN_NAME) == static
    # without the variable: the package's own lib/ folder (where a wheel puts both)
    monkeypatch.delenv("DASH_TRT_PLUGIN")
    lib = tmp_path / "pkg" / "lib"
    lib.mkdir(parents=True)
    (lib / libraries.PLUGIN_NAME).write_bytes(b"x")
    monkeypatch.setattr(libraries, "__file__", str(tmp_path / "pkg" / "libraries.py"))
    assert libraries.plugin_path() == lib / libraries.PLUGIN_NAME


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_dash_client_without_tritonclient_exits_2_with_the_install_hint(monkeypatch, protocol):
    """Without tritonclient, `dash-client` says what to install and exits 2 (bad setup, as its
    --help says for arguments), not 70 with an internal ModuleNotFoundError."""
    import sys

    from dash_trt.triton import client as C

    for name in [m for m in sys.modules if m == "tritonclient" or m.startswith("tritonclient.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "tritonclient", None)
    err = io.StringIO()
    assert C.main(["--protocol", protocol, "--prompt", "<PAGE><image>x"], stdout=io.StringIO(), stderr=err) == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dash-client: error: tritonclient is not installed"), lines
    assert lines[0].endswith("pip install 'dash-trt[triton]'")
