"""Graph: ONNX models in and out, and what happens to their graphs.

Owns reading, validating and writing models (external data and models over 2 GiB in
`qcal.graph.files`), the preparation passes, the plan of what to quantize and why (default
exclusions included), the Q/DQ writer and deterministic names.

May import: `qcal.numerics`.
"""
