"""The quantization plan: per-operator rules and the user's selection decide, for every node,
whether it is quantized and which tensors get Q/DQ. Public through `qcal.graph.model`.

Where it lives: `_rules` (the per-operator rule table `OP_RULES`: which inputs and outputs of
each op type are quantized), `_types` (the selection and the plan's targets and decisions),
`_selection` (the user's selection checked and applied, with the default exclusions of
`qcal.graph.traps`), `_planner` (`plan_quantization`), `_targets` (what the planner collects
and how it becomes targets), `_walk` (the graphs walked, bodies included) and `_unobserved`
(`leave_unobserved_float`, the plan narrowed after calibration).
"""

from __future__ import annotations

from qcal.graph.plan._planner import plan_quantization
from qcal.graph.plan._rules import OP_RULES, OP_RULES_DOC, OpRule, rules_table
from qcal.graph.plan._rules import SAME_SCALE_OPS as SAME_SCALE_OPS
from qcal.graph.plan._types import (
    ActivationTarget,
    BiasTarget,
    NodeDecision,
    QuantPlan,
    SelectionRules,
    WeightTarget,
)
from qcal.graph.plan._unobserved import leave_unobserved_float

__all__ = [
    "OP_RULES",
    "OP_RULES_DOC",
    "ActivationTarget",
    "BiasTarget",
    "NodeDecision",
    "OpRule",
    "QuantPlan",
    "SelectionRules",
    "WeightTarget",
    "leave_unobserved_float",
    "plan_quantization",
    "rules_table",
]
