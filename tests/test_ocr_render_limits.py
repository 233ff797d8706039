"""Issue 67 round 4 (a): ``dash-trt ocr --checkpoint`` takes ``dash-triton write``'s rendering
limits (``--render-page-seconds``, ``--render-seconds``, ``--render-memory-mb``: one definition of
the flags and of their check), applies them to the document processor in this process (a flate
bomb page is refused at a tiny page budget, the page named), refuses a bad value with exit 2
before any model is loaded, and with ``--server`` says they are not for it."""

from __future__ import annotations

import argparse
import io
import os

import pytest
from conftest import write_tiny_unlimited_ocr2
from test_render_limits import flate_bomb

from dash_trt.commands import ocr as O
from dash_trt.documents.render import RenderLimits
from dash_trt.serving import documents as SD

pytest.importorskip("pypdfium2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ("--render-page-seconds", "--render-seconds", "--render-memory-mb")
ALL = ["--render-page-seconds", "7", "--render-seconds", "70"]


def _ocr(*argv):
    p = argparse.ArgumentParser()
    O.add_parser(p.add_subparsers(dest="command"))
    out, err = io.StringIO(), io.StringIO()
    rc = O.ocr_main(p.parse_args(["ocr", *map(str, argv)]), out, err)
    return rc, out.getvalue(), err.getvalue()


class _Seen:
    """A stand-in DocumentOCR that keeps the limits it was given and transcribes nothing."""

    limits: list = []

    def __init__(self, folder, *, render_limits=None, **kw):
        _Seen.limits.append(render_limits)

    def close(self):
        pass

    def transcribe(self, sources, options, **kw):
        from types import SimpleNamespace

        page = SimpleNamespace(page=1, source=sources[0][0], text="x", tokens=[5], finish_reason="stop", seconds=0.0)
        return SimpleNamespace(pages=[page])


@pytest.fixture
def seen(monkeypatch):
    monkeypatch.setattr(SD, "DocumentOCR", _Seen)
    monkeypatch.setattr(_Seen, "limits", [])
    return _Seen.limits


@pytest.mark.parametrize(
    "given, limits",
    [
        ([], RenderLimits()),
        ([*ALL, "--render-memory-mb", "512"], RenderLimits(7, 70, 512)),
        (["--render-page-seconds", "0"], RenderLimits(page_seconds=0)),
    ],
)
def test_the_flags_reach_the_processor_in_this_process(tmp_path, seen, given, limits):
    (tmp_path / "d.png").write_bytes(b"x")
    rc, out, err = _ocr(tmp_path / "d.png", "--checkpoint", tmp_path, "--out", tmp_path / "o", "--no-progress", *given)
    assert rc == 0, out + err
    assert seen == [limits]
    assert "render" not in err


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_value_exits_2_naming_the_flag_before_any_model_loads(tmp_path, seen, flag, value):
    if flag == "--render-memory-mb" and value != "-1":
        value = "-5"  # an int flag: argparse refuses the rest itself
    (tmp_path / "d.png").write_bytes(b"x")
    rc, out, err = _ocr(tmp_path / "d.png", "--checkpoint", tmp_path, "--out", tmp_path / "o", flag, value)
    (line,) = err.strip().splitlines()
    assert rc == 2 and line.startswith(f"dash-trt ocr: error: {flag} must be a finite number >= 0"), err
    assert seen == []


def test_with_a_server_the_flags_are_noted_as_not_for_it():
    p = argparse.ArgumentParser()
    O.add_parser(p.add_subparsers(dest="command"))
    a = p.parse_args(["ocr", "x.pdf", "--server", "h:1", "--out", "o", "--render-seconds", "5"])
    err = io.StringIO()
    assert O._check_args(a, err) == 0
    assert "dash-trt ocr: note: --render-seconds are for --checkpoint" in err.getvalue()
    a = p.parse_args(["ocr", "x.pdf", "--server", "h:1", "--out", "o"])
    err = io.StringIO()
    assert O._check_args(a, err) == 0 and "render" not in err.getvalue()


def test_ocr_and_write_share_the_flags_and_their_help():
    from dash_trt.triton import cli

    p = argparse.ArgumentParser()
    O.add_parser(p.add_subparsers(dest="command"))
    sub = p._subparsers._group_actions[0].choices["ocr"]
    w = cli._parser()._subparsers._group_actions[0].choices["write"]
    for flag in FLAGS:
        (o,) = [x for x in sub._actions if flag in x.option_strings]
        (x,) = [x for x in w._actions if flag in x.option_strings]
        assert o.type is x.type and o.default is None and x.default is not None
        assert o.help == "with --checkpoint: " + x.help.replace("NAME_document", "the rendering worker")


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_write_refuses_the_same_bad_values(value):
    from dash_trt.triton import cli

    a = cli._parser().parse_args(["write", "--demo", "--out", "/nonexistent/x", "--render-seconds", value])
    err = io.StringIO()
    assert cli.write_main(a, io.StringIO(), err) == 2
    assert err.getvalue().startswith("dash-triton write: error: --render-seconds must be a finite number >= 0")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_unlimited_ocr2(tmp_path_factory, "uocr2limits")


def test_a_tiny_page_budget_refuses_a_flate_bomb_with_the_page_named(folder, tmp_path):
    """The real checkpoint path: the processor in this process renders within the flags' limits."""
    (tmp_path / "bomb.pdf").write_bytes(flate_bomb())
    rc, out, err = _ocr(
        tmp_path / "bomb.pdf",
        "--checkpoint",
        folder,
        "--out",
        tmp_path / "o",
        "--max-page-tokens",
        "3",
        "--no-progress",
        "--render-page-seconds",
        "1",
    )
    assert rc == 1, out + err
    assert "bomb.pdf page 1: rendering took more than the page's 1 CPU seconds of rendering" in out + err
