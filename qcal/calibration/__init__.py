"""Calibration: data in, statistics out.

Owns the calibration data sources (one reader per format), onnxruntime sessions, the collection
loop that feeds observers, and the graph rewrites that exist only for collection (in-graph
min/max reduction, exposing subgraph tensors).

May import: `qcal.numerics`, `qcal.graph`.
"""
