"""Which loader a checkpoint needs: the one entry point of the tools that serve any model.

The checkpoint's family (:func:`dash_trt.models.families.family_of_checkpoint`: the family whose
``claims`` takes the folder's ``config.json``, else the DASH decoders') loads it with its
:attr:`~dash_trt.models.interface.ModelFamily.load`: a DASH checkpoint through
:func:`dash_trt.models.checkpoint.load_checkpoint`, another family's folder through its own
loader, which refuses what it cannot run with a message.
"""

from __future__ import annotations

import os

from .families import family_of_checkpoint

__all__ = ["load_model"]


def load_model(path: str | os.PathLike, *, allow_pickle: bool = False, model_class: str | type | None = None):
    """The model of a checkpoint, loaded by its family (:func:`family_of_checkpoint`): a DASH
    checkpoint (:func:`~dash_trt.models.checkpoint.load_checkpoint`, with ``allow_pickle`` and
    ``model_class``) or another family's folder (``model_class``, if given, must name the class
    the folder's config asks for, as the Triton service's ``module:Class`` does)."""
    return family_of_checkpoint(path).load(path, allow_pickle=allow_pickle, model_class=model_class)
