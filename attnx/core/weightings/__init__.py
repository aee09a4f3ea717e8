"""Weightings F: how a row of scores becomes attention weights.

* :mod:`~attnx.core.weightings.base`: :class:`Pointwise` and :class:`RowNormalizer`, their
  traits (:data:`TRAITS`) and the helpers their constructors share.
* :mod:`~attnx.core.weightings.pointwise`: the built-in pointwise families, one public
  constructor each (``power(p=3)`` is ``get_weighting("power:p=3")``).
* :mod:`~attnx.core.weightings.rownorm` (SSMax, softpick, stick-breaking) and
  :mod:`~attnx.core.weightings.simplex` (sparsemax, entmax): the whole-row normalizers, as
  functions of a score array and as weighting constructors (``ssmax_weighting``, ...).
* :mod:`~attnx.core.weightings.registry`: the name index (``"name:k=v"`` strings) over the
  constructors; :func:`register_weighting` adds one.
* :mod:`~attnx.core.weightings.apply`: :func:`weights`, a weighting applied to a dense array.
"""

from attnx.core.weightings.apply import apply_weighting, pointwise_weights, weights
from attnx.core.weightings.base import (
    NORMALIZATIONS,
    TRAITS,
    LogF,
    Normalization,
    Pointwise,
    RowNormalizer,
    Weighting,
    WeightingLike,
    WeightingParam,
    check_normalization,
    label,
)
from attnx.core.weightings.pointwise import (
    POINTWISE_KERNELS,
    boxcar,
    elu_plus_one,
    epanechnikov,
    exp,
    gaussian,
    power,
    relu,
    relu2,
    sigmoid,
    softmax,
    softmax_plus_one,
    softplus,
    taylor_exp,
    triangular,
)
from attnx.core.weightings.registry import (
    BUILTIN,
    describe_weightings,
    get_weighting,
    list_weightings,
    parse_weighting_name,
    register_weighting,
    unregister_weighting,
)
from attnx.core.weightings.rownorm import (
    softpick_weighting,
    ssmax_weighting,
    stick_breaking_weighting,
)
from attnx.core.weightings.simplex import (
    entmax15_weighting,
    entmax_weighting,
    sparsemax_weighting,
)

__all__ = [
    "BUILTIN", "NORMALIZATIONS", "POINTWISE_KERNELS", "TRAITS", "LogF", "Normalization",
    "Pointwise",
    "RowNormalizer", "Weighting", "WeightingLike", "WeightingParam", "apply_weighting", "boxcar",
    "check_normalization", "describe_weightings", "elu_plus_one", "entmax15_weighting",
    "entmax_weighting", "epanechnikov", "exp", "gaussian", "get_weighting", "label",
    "list_weightings", "parse_weighting_name", "pointwise_weights", "power",
    "register_weighting", "relu", "relu2", "sigmoid", "softmax", "softmax_plus_one",
    "softpick_weighting", "softplus", "sparsemax_weighting", "ssmax_weighting",
    "stick_breaking_weighting", "taylor_exp", "triangular", "unregister_weighting", "weights",
]
