"""The base of every configuration error a model's ``config.json`` can raise.

:class:`ModelConfigError` is declared here, below the models, because the attention families'
sections live in a model's ``config.json`` (Dual Chunk Attention's ``DcaConfigError`` derives
from it) and the models (:mod:`dash_trt.models.config` hands it on under its old name) raise it
too; the tools catch this one class for any family.
"""

__all__ = ["ModelConfigError"]


class ModelConfigError(ValueError):
    """A model ``config.json`` is missing a key or holds a bad value: the base of every model
    family's config error, which the tools catch as this one."""
