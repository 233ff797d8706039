"""Moved: the DASH models' Triton interface is :mod:`dash_trt.triton_protocol`, beneath both this
package and the OpenAI front door (:mod:`dash_trt.frontdoor`).

This module re-exports its names, for the ``model.py`` of repositories written before the move
and for user code; import :mod:`dash_trt.triton_protocol` instead.
"""

from __future__ import annotations

from ..triton_protocol import *  # noqa: F403
