"""Shared test settings: markers that skip without hardware, module-level grids."""

import importlib.util

import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SEEDS = [0, 1, 2]


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _has_tensorrt() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch)")
    skip_trt = pytest.mark.skip(reason="needs the TensorRT runtime (python package 'tensorrt' not found)")
    for item in items:
        if "gpu" in item.keywords and not _has_cuda():
            item.add_marker(skip_gpu)
        if "trt" in item.keywords and not _has_tensorrt():
            item.add_marker(skip_trt)
