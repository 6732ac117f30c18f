"""Range selection from a histogram by name: percentile, entropy (KL divergence) or mse.

Each method is a pure function of a :class:`~qcal.numerics.histogram.Histogram` that returns a
:class:`RangeSelection`; its ``stats`` is a :class:`~qcal.numerics.observers.MinMaxStats` that
goes through the preset's ``compute_qparams`` like a min-max range, so every preset works with
every method. Work is vectorized over candidates and bins; only channels are looped over. The
methods live in ``_percentile``, ``_entropy`` and ``_mse``; :func:`select_range` runs one by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from qcal.numerics.errors import ConfigError
from qcal.numerics.histogram._entropy import entropy_range
from qcal.numerics.histogram._mse import mse_range
from qcal.numerics.histogram._percentile import percentile_range
from qcal.numerics.histogram._result import QuantRecipe, RangeSelection
from qcal.numerics.histogram._snapshot import Histogram

__all__ = ["RANGE_METHODS", "select_range"]

RANGE_METHODS = ("percentile", "entropy", "mse")


def select_range(
    histogram: Histogram,
    method: str,
    recipe: QuantRecipe | None = None,
    *,
    percentile: float = 99.99,
    symmetric_percentile: bool = True,
    bins: int = 2048,
    quantized_bins: int = 128,
) -> RangeSelection:
    """Run one range method by name (the registry of :data:`RANGE_METHODS`).

    Args:
        histogram: an observer state.
        method: "percentile", "entropy" or "mse".
        recipe: the tensor recipe (required by mse).
        percentile: for percentile.
        symmetric_percentile: percentile of |x| (True) or two-sided (False).
        bins: |x| bins for entropy.
        quantized_bins: quantization levels for entropy.

    Raises:
        ConfigError: unknown method, bad parameters, or mse without a recipe.
    """
    methods: Mapping[str, Callable[[], RangeSelection]] = {
        "percentile": lambda: percentile_range(
            histogram, percentile, symmetric=symmetric_percentile
        ),
        "entropy": lambda: entropy_range(histogram, bins=bins, quantized_bins=quantized_bins),
        "mse": lambda: mse_range(histogram, _need_recipe(recipe)),
    }
    if method not in methods:
        raise ConfigError(
            f"method: {method!r} is not a histogram method; choose one of {', '.join(methods)}"
        )
    return methods[method]()


def _need_recipe(recipe: QuantRecipe | None) -> QuantRecipe:
    if recipe is None:
        raise ConfigError("method mse needs the tensor's recipe (its scheme) to measure errors")
    return recipe
