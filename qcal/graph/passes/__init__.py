"""Preparation passes: graph rewrites that ready a float model for quantization.

Each pass does one job, says whether it changed the model and raises `qcal.numerics.errors.ModelError`
when it cannot do its job; `qcal.graph.model.prepare_model` runs them in order.
"""

from qcal.graph.passes._base import PrepPass, StepResult
from qcal.graph.passes.constants_to_initializers import ConstantsToInitializers
from qcal.graph.passes.conv_transpose_as_conv import ConvTransposeAsConv
from qcal.graph.passes.eliminate_identity import EliminateIdentity
from qcal.graph.passes.fold_batchnorm import FoldBatchNorm
from qcal.graph.passes.fold_constant_shapes import FoldConstantShapes
from qcal.graph.passes.fold_constant_weights import FoldConstantWeights
from qcal.graph.passes.fold_input_affine import FoldInputAffine
from qcal.graph.passes.fold_pad import FoldPad
from qcal.graph.passes.infer_shapes import InferShapes
from qcal.graph.passes.initializers_not_inputs import InitializersNotInputs
from qcal.graph.passes.inline_functions import InlineFunctions
from qcal.graph.passes.lower_einsum import LowerEinsum
from qcal.graph.passes.name_nodes import NameNodes
from qcal.graph.passes.pool_spatial_means import PoolSpatialMeans
from qcal.graph.passes.shuffle_as_gather import ShuffleAsGather
from qcal.graph.passes.sum_as_add import SumAsAdd
from qcal.graph.passes.unshare_biases import UnshareBiases
from qcal.graph.passes.upgrade_opset import UpgradeOpset
from qcal.graph.passes.widen_half import WidenHalf

__all__ = [
    "ConstantsToInitializers",
    "ConvTransposeAsConv",
    "EliminateIdentity",
    "FoldBatchNorm",
    "FoldConstantShapes",
    "FoldConstantWeights",
    "FoldInputAffine",
    "FoldPad",
    "InferShapes",
    "InitializersNotInputs",
    "InlineFunctions",
    "LowerEinsum",
    "NameNodes",
    "PoolSpatialMeans",
    "PrepPass",
    "ShuffleAsGather",
    "StepResult",
    "SumAsAdd",
    "UnshareBiases",
    "UpgradeOpset",
    "WidenHalf",
]
