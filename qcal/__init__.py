"""qcal: post-training calibration of ONNX models into QDQ models."""

__version__ = "0.1.0"
