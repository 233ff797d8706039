"""The command lines that are no library's own: ``dash-trt`` (:mod:`.info`: info and --version;
``dash-trt ocr`` in :mod:`.ocr`) and ``dash-demo`` (:mod:`.demo`). A library with a command line
keeps its ``main`` (``dash-export`` in :mod:`dash_trt.export`, ``dash-triton`` in
:mod:`dash_trt.triton.cli`, ...); every command shares :mod:`dash_trt.cliutil`."""
