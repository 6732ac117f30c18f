"""Preparation passes: graph rewrites that ready a float model for quantization.

Each pass does one job, says whether it changed the model and raises `qcal.errors.ModelError`
when it cannot do its job; `qcal.model.prepare_model` runs them in order.
"""

from qcal.passes._base import PrepPass, StepResult
from qcal.passes.constants_to_initializers import ConstantsToInitializers
from qcal.passes.eliminate_identity import EliminateIdentity
from qcal.passes.fold_batchnorm import FoldBatchNorm
from qcal.passes.infer_shapes import InferShapes
from qcal.passes.name_nodes import NameNodes
from qcal.passes.upgrade_opset import UpgradeOpset

__all__ = [
    "ConstantsToInitializers",
    "EliminateIdentity",
    "FoldBatchNorm",
    "InferShapes",
    "NameNodes",
    "PrepPass",
    "StepResult",
    "UpgradeOpset",
]
