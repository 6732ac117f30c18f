"""Calibration data: sources that stream model feeds, their validation, and batching.

A *sample* is one full model feed: a dict from model input name to array, with the model's batch
dimension (of size 1 when the data has none of its own). Sources read one sample at a time and
keep no reference to what they yielded, so memory does not grow with the size of the data set.
Each source is an iterable: every call of `samples()` gives a fresh iterator from the start.

Formats (`open_data`):

- ``.npz`` file, one array per model input, axis 0 = sample. An array of the model input's rank
  gives samples ``x[i:i+1]`` (the model's dim 0 is the batch); one of rank + 1 gives ``x[i]`` (a
  full feed per sample). Members are read row by row from the zip stream, stored or deflated:
  only one sample per input is in memory. Exception: a member saved in Fortran order has no
  contiguous rows and is read whole (logged as a warning).
- ``.npy`` file, for a model with one input: that input's array, read as the same array in an
  ``.npz`` file.
- A folder of ``.npz`` (or, for a model with one input, ``.npy``) files, one sample (full feed)
  each, in file-name order; shapes may differ between samples. Each file is read when its turn
  comes.
- ONNX model-zoo folders ``test_data_set_K/input_J.pb`` (J = position among the model inputs; if
  every file of a set names a model input in its ``name`` field, the names are used instead), in
  numeric order of K. Each file is read when its turn comes.
- Synthetic: N random samples from the model's input specs (see `SyntheticSource`).

`validate_data` reads only headers: the ``.npy`` headers inside the zips, and the dims/type/name
fields of the TensorProto files (tensor payloads are skipped, not read). Values are not scanned
for NaN/Inf there; `find_nonfinite` names the culprit once a problem shows up. `content_order`
reads every sample once (its digest, and whether its numbers are all finite), to pick samples by
content rather than by position.

Layout: `_source` (sample and source types, name matching shared by every reader), one reader
module per format (`_npz_file`, `_npz_dir` over the ``.npy`` reading of `_npy`, in zips or plain,
`_onnx_test_data`, `_synthetic`), `_open` (the entry point that picks the reader), `_validate`
(checks against the model inputs, non-finite values), `_batches` (joining samples) and `_content`
(samples chosen by their content, whatever the data's order).
"""

from __future__ import annotations

from qcal.calibration.data._batches import iter_batches, unjoinable_input
from qcal.calibration.data._content import (
    ContentOrder,
    SampleSubset,
    content_order,
    name_samples,
    sample_digest,
)
from qcal.calibration.data._npz_dir import NpzDirSource
from qcal.calibration.data._npz_file import NpzSource
from qcal.calibration.data._onnx_test_data import OnnxTestDataSource
from qcal.calibration.data._onnx_test_data import (
    _read_tensor_header as _read_tensor_header,  # tests read headers directly
)
from qcal.calibration.data._open import open_data
from qcal.calibration.data._source import ArrayInfo, DataSource, SampleLayout
from qcal.calibration.data._synthetic import (
    SYNTHETIC_FREE_DIM,
    SYNTHETIC_INT_HIGH,
    SyntheticSource,
)
from qcal.calibration.data._validate import find_nonfinite, validate_data
from qcal.calibration.runtime import Feed

__all__ = [
    "SYNTHETIC_FREE_DIM",
    "SYNTHETIC_INT_HIGH",
    "ArrayInfo",
    "ContentOrder",
    "DataSource",
    "Feed",
    "NpzDirSource",
    "NpzSource",
    "OnnxTestDataSource",
    "SampleLayout",
    "SampleSubset",
    "SyntheticSource",
    "content_order",
    "find_nonfinite",
    "iter_batches",
    "name_samples",
    "open_data",
    "sample_digest",
    "unjoinable_input",
    "validate_data",
]
