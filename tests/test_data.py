"""Calibration data sources: formats, discovery, limits, batching, hostile files, streaming."""

from __future__ import annotations

import gc
import io
import tracemalloc
import weakref
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qcal.calibration.data import (
    SYNTHETIC_FREE_DIM,
    SYNTHETIC_INT_HIGH,
    DataSource,
    SampleSubset,
    _read_tensor_header,
    content_order,
    find_nonfinite,
    iter_batches,
    name_samples,
    open_data,
    sample_digest,
    validate_data,
)
from qcal.graph.model import InputSpec
from qcal.numerics.errors import ConfigError, DataError

MODEL = "model.onnx"


def spec(name: str, dtype: Any, shape: tuple[int | str | None, ...]) -> InputSpec:
    return InputSpec(name=name, dtype=np.dtype(dtype), shape=shape)


IMAGE = spec("image", np.float32, ("N", 3, 4, 4))
IMAGE_DYN = spec("image", np.float32, ("N", 3, "H", "W"))
STEPS = spec("steps", np.int64, ())
MASK = spec("mask", np.bool_, ("N", 5))


def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def images(n: int, batch: int | None = None) -> np.ndarray:
    shape = (n, 3, 4, 4) if batch is None else (n, batch, 3, 4, 4)
    return rng().standard_normal(shape).astype(np.float32)


def open_npz(
    tmp_path: Path,
    inputs: list[InputSpec],
    compressed: bool = False,
    limit: int | None = None,
    **arrays: Any,
) -> DataSource:
    path = tmp_path / "data.npz"
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return open_data(path, model_path=tmp_path / MODEL, inputs=inputs, limit=limit)


def write_set(folder: Path, tensors: list[np.ndarray], names: list[str] | None = None) -> None:
    folder.mkdir(parents=True)
    for j, array in enumerate(tensors):
        tensor = numpy_helper.from_array(array, names[j] if names else "")
        (folder / f"input_{j}.pb").write_bytes(tensor.SerializeToString())


def collect(source: DataSource) -> list[dict[str, np.ndarray]]:
    return list(source.samples())


# ------------------------------------------------------------------------------------ npz file


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_same_rank_gives_batch_of_one_per_row(tmp_path: Path, compressed: bool) -> None:
    x = images(5)
    source = open_npz(tmp_path, [IMAGE], compressed, image=x)
    validate_data(source, [IMAGE])
    got = collect(source)
    assert source.kind == "npz" and not source.is_synthetic and source.num_samples() == 5
    assert len(got) == 5
    for i, sample in enumerate(got):
        np.testing.assert_array_equal(sample["image"], x[i : i + 1])


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_extra_rank_gives_full_feeds(tmp_path: Path, compressed: bool) -> None:
    x = images(4, batch=2)
    source = open_npz(tmp_path, [IMAGE], compressed, image=x)
    validate_data(source, [IMAGE])
    got = collect(source)
    assert [s["image"].shape for s in got] == [(2, 3, 4, 4)] * 4
    np.testing.assert_array_equal(np.stack([s["image"] for s in got]), x)


def test_npz_mixed_inputs_scalar_bool_and_int(tmp_path: Path) -> None:
    inputs = [IMAGE, STEPS, MASK]
    x, steps = images(3), np.arange(3, dtype=np.int64) * 7
    mask = rng().random((3, 5)) < 0.5
    source = open_npz(tmp_path, inputs, image=x, steps=steps, mask=mask)
    validate_data(source, inputs)
    got = collect(source)
    assert [list(s) for s in got] == [["image", "steps", "mask"]] * 3  # model input order
    for i, sample in enumerate(got):
        assert sample["steps"].shape == () and sample["steps"] == steps[i]
        np.testing.assert_array_equal(sample["mask"], mask[i : i + 1])
        assert sample["mask"].dtype == np.bool_


def test_npz_fortran_order_member_is_read(tmp_path: Path) -> None:
    x = np.asfortranarray(images(3))
    source = open_npz(tmp_path, [IMAGE], image=x)
    for i, sample in enumerate(collect(source)):
        np.testing.assert_array_equal(sample["image"], x[i : i + 1])


def test_npz_big_endian_is_read_as_native(tmp_path: Path) -> None:
    x = images(2)
    source = open_npz(tmp_path, [IMAGE], image=x.astype(">f4"))
    validate_data(source, [IMAGE])
    got = collect(source)
    assert got[0]["image"].dtype == np.float32
    np.testing.assert_array_equal(got[1]["image"], x[1:2])


def test_samples_gives_a_fresh_iterator_each_call(tmp_path: Path) -> None:
    x = images(4)
    source = open_npz(tmp_path, [IMAGE], image=x)
    first, second = source.samples(), source.samples()
    a0 = next(first)["image"]
    b0 = next(second)["image"]
    a1 = next(first)["image"]
    np.testing.assert_array_equal(a0, b0)
    np.testing.assert_array_equal(a1, x[1:2])
    assert len(collect(source)) == len(collect(source)) == 4


# ------------------------------------------------------------------------------------ npz dir


def test_npz_dir_sorted_by_name_with_varying_shapes(tmp_path: Path) -> None:
    folder = tmp_path / "samples"
    folder.mkdir()
    sizes = {"b.npz": 6, "a.npz": 4, "c.npz": 8}
    for name, size in sizes.items():
        np.savez(folder / name, image=np.full((1, 3, size, size), size, np.float32))
    (folder / "notes.txt").write_text("ignored")
    (folder / ".hidden.npz").write_bytes(b"ignored")
    source = open_data(folder, model_path=tmp_path / MODEL, inputs=[IMAGE_DYN])
    validate_data(source, [IMAGE_DYN])
    assert source.kind == "npz-dir" and source.num_samples() == 3
    assert [s["image"].shape[-1] for s in collect(source)] == [4, 6, 8]


# ------------------------------------------------------------------------------------ npy files


@pytest.mark.parametrize("batch", [None, 2])
def test_npy_file_gives_what_the_same_array_in_an_npz_gives(tmp_path: Path, batch: int | None
                                                            ) -> None:
    x = np.asfortranarray(images(5, batch)) if batch else images(5, batch)
    np.save(tmp_path / "images.npy", x)
    source = open_data(tmp_path / "images.npy", model_path=tmp_path / MODEL, inputs=[IMAGE])
    validate_data(source, [IMAGE])
    got = collect(source)
    assert source.num_samples() == 5 and not source.is_synthetic
    expected = [x[i] if batch else x[i : i + 1] for i in range(5)]
    assert len(got) == 5 and all(list(s) == ["image"] for s in got)
    for sample, want in zip(got, expected, strict=True):
        assert sample["image"].dtype == np.float32
        np.testing.assert_array_equal(sample["image"], want)


def test_npy_dir_one_sample_per_file_beside_npz_files(tmp_path: Path) -> None:
    folder = tmp_path / "samples"
    folder.mkdir()
    for size, name in ((6, "b.npy"), (4, "a.npz"), (8, "c.NPY")):
        array = np.full((1, 3, size, size), size, np.float32)
        if name.endswith(".npz"):
            np.savez(folder / name, image=array)
        else:
            with open(folder / name, "wb") as fp:
                np.lib.format.write_array(fp, array)
    source = open_data(folder, model_path=tmp_path / MODEL, inputs=[IMAGE_DYN])
    validate_data(source, [IMAGE_DYN])
    assert [s["image"].shape[-1] for s in collect(source)] == [4, 6, 8]
    assert [float(s["image"].max()) for s in collect(source)] == [4.0, 6.0, 8.0]


def test_npy_for_a_model_of_several_inputs_names_them(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", images(2))
    with pytest.raises(DataError) as err:
        open_data(tmp_path / "x.npy", model_path=tmp_path / MODEL, inputs=[IMAGE, MASK])
    assert_one_line_naming(err, "x.npy", "2 inputs", "'image'", "'mask'", ".npz")
    folder = tmp_path / "samples"
    folder.mkdir()
    np.save(folder / "0.npy", images(1))
    source = open_data(folder, model_path=tmp_path / MODEL, inputs=[IMAGE, MASK])
    with pytest.raises(DataError) as err:
        validate_data(source, [IMAGE, MASK])
    assert_one_line_naming(err, "0.npy", "2 inputs")


def test_npy_object_truncated_and_garbage_files_are_refused(tmp_path: Path) -> None:
    objects = np.empty(2, dtype=object)
    objects[:] = [np.zeros(3), "x"]
    np.save(tmp_path / "evil.npy", objects, allow_pickle=True)
    with pytest.raises(DataError) as err:
        open_data(tmp_path / "evil.npy", model_path=tmp_path / MODEL, inputs=[IMAGE])
    assert_one_line_naming(err, "evil.npy", "object")
    (tmp_path / "junk.npy").write_bytes(b"not an array")
    with pytest.raises(DataError) as err:
        open_data(tmp_path / "junk.npy", model_path=tmp_path / MODEL, inputs=[IMAGE])
    assert_one_line_naming(err, "junk.npy")
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, images(4))
    (tmp_path / "cut.npy").write_bytes(buffer.getvalue()[: -(3 * 4 * 4 * 4 + 10)])
    source = open_data(tmp_path / "cut.npy", model_path=tmp_path / MODEL, inputs=[IMAGE])
    with pytest.raises(DataError) as err:
        collect(source)
    assert_one_line_naming(err, "cut.npy", "truncated")


# ------------------------------------------------------------------------------ onnx test data


def test_onnx_test_data_sets_numeric_order_and_positions(tmp_path: Path) -> None:
    inputs = [IMAGE, STEPS]
    for k in (0, 2, 10):
        write_set(tmp_path / f"test_data_set_{k}", [images(1) + k, np.array(k, np.int64)])
    (tmp_path / "test_data_set_0" / "output_0.pb").write_bytes(b"not an input")
    source = open_data(tmp_path, model_path=tmp_path / "elsewhere" / MODEL, inputs=inputs)
    validate_data(source, inputs)
    assert source.kind == "onnx-test-data" and source.num_samples() == 3
    assert [int(s["steps"]) for s in collect(source)] == [0, 2, 10]


def test_onnx_test_data_single_set_folder(tmp_path: Path) -> None:
    write_set(tmp_path / "test_data_set_3", [images(1)])
    source = open_data(tmp_path / "test_data_set_3", model_path=tmp_path / MODEL, inputs=[IMAGE])
    validate_data(source, [IMAGE])
    np.testing.assert_array_equal(collect(source)[0]["image"], images(1))


def test_onnx_test_data_tensor_names_override_positions(tmp_path: Path) -> None:
    inputs = [IMAGE, STEPS]
    write_set(tmp_path / "test_data_set_0", [np.array(5, np.int64), images(1)], ["steps", "image"])
    source = open_data(tmp_path, model_path=tmp_path / MODEL, inputs=inputs)
    validate_data(source, inputs)
    sample = collect(source)[0]
    assert int(sample["steps"]) == 5 and sample["image"].shape == (1, 3, 4, 4)


@pytest.mark.parametrize(
    "tensor",
    [
        numpy_helper.from_array(images(2), "image"),
        numpy_helper.from_array(np.array(7, np.int64), ""),
        numpy_helper.from_array(np.ones((0, 3), np.bool_), "empty"),
        helper.make_tensor("floats", onnx.TensorProto.FLOAT, [2, 3], list(range(6))),
        helper.make_tensor("halves", onnx.TensorProto.FLOAT16, [4], [1.0, 2.0, 3.0, 4.0]),
        helper.make_tensor("ints", onnx.TensorProto.INT64, [2], [2**40, 3]),
        onnx.TensorProto(name="big", data_type=onnx.TensorProto.INT64, dims=[300, 70000]),
    ],
    ids=["raw", "scalar", "zero-size", "float_data", "float16", "int64_data", "header-only"],
)
def test_tensor_header_reader_agrees_with_onnx(tmp_path: Path, tensor: onnx.TensorProto) -> None:
    path = tmp_path / "input_0.pb"
    path.write_bytes(tensor.SerializeToString())
    header = _read_tensor_header(path)
    assert header.name == tensor.name
    assert header.data_type == tensor.data_type
    assert header.dims == tuple(tensor.dims)
    assert not header.is_external


# ----------------------------------------------------------------------------------- synthetic


def test_synthetic_shapes_types_and_determinism(tmp_path: Path) -> None:
    ids = spec("ids", np.int64, ("batch", "seq"))
    inputs = [IMAGE_DYN, ids, MASK, spec("half", np.float16, (None, 2))]
    source = open_data(None, model_path=tmp_path / MODEL, inputs=inputs, synthetic=3, seed=7)
    validate_data(source, inputs)
    first, again = collect(source), collect(source)
    other = collect(
        open_data(None, model_path=tmp_path / MODEL, inputs=inputs, synthetic=3, seed=8)
    )
    assert source.is_synthetic and source.kind == "synthetic" and source.path is None
    assert len(first) == 3
    sample = first[0]
    free = SYNTHETIC_FREE_DIM
    assert sample["image"].shape == (1, 3, free, free)
    assert sample["ids"].shape == (1, free) and sample["ids"].dtype == np.int64
    assert all(0 <= v < SYNTHETIC_INT_HIGH for s in first for v in s["ids"].ravel())
    assert sample["mask"].dtype == np.bool_ and sample["half"].dtype == np.float16
    for a, b in zip(first, again):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(first[0]["image"], other[0]["image"])


def test_synthetic_refuses_string_input(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="'text'"):
        open_data(
            None, model_path=tmp_path / MODEL, inputs=[spec("text", object, (1,))], synthetic=2
        )


# ----------------------------------------------------------------------------------- discovery


def test_discovers_calib_npz_beside_model_before_test_sets(tmp_path: Path) -> None:
    np.savez(tmp_path / "net.calib.npz", image=images(2))
    write_set(tmp_path / "test_data_set_0", [images(1)])
    source = open_data(None, model_path=tmp_path / "net.onnx", inputs=[IMAGE])
    assert source.kind == "npz" and source.path == tmp_path / "net.calib.npz"


def test_discovers_test_data_sets_beside_model(tmp_path: Path) -> None:
    write_set(tmp_path / "test_data_set_0", [images(1)])
    write_set(tmp_path / "test_data_set_1", [images(1)])
    source = open_data(None, model_path=tmp_path / "net.onnx", inputs=[IMAGE])
    assert source.kind == "onnx-test-data" and source.num_samples() == 2


def test_nothing_beside_model_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        open_data(None, model_path=tmp_path / "net.onnx", inputs=[IMAGE])
    message = str(err.value)
    assert "--data" in message and "--synthetic" in message and "net.calib.npz" in message
    assert "\n" not in message


# --------------------------------------------------------------------------------------- limit


def test_limit_caps_every_format(tmp_path: Path) -> None:
    np.savez(tmp_path / "one.npz", image=images(5))
    folder = tmp_path / "dir"
    folder.mkdir()
    for i in range(4):
        np.savez(folder / f"{i}.npz", image=images(1))
    for k in range(3):
        write_set(tmp_path / "sets" / f"test_data_set_{k}", [images(1)])
    for path in (tmp_path / "one.npz", folder, tmp_path / "sets", None):
        source = open_data(
            path,
            model_path=tmp_path / MODEL,
            inputs=[IMAGE],
            limit=2,
            synthetic=None if path else 9,
        )
        validate_data(source, [IMAGE])
        assert source.num_samples() == 2 and len(collect(source)) == 2


@pytest.mark.parametrize("limit", [0, -1])
def test_limit_below_one_is_a_config_error(tmp_path: Path, limit: int) -> None:
    np.savez(tmp_path / "d.npz", image=images(2))
    with pytest.raises(ConfigError, match="--limit"):
        open_data(tmp_path / "d.npz", model_path=tmp_path / MODEL, inputs=[IMAGE], limit=limit)


def test_synthetic_with_data_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--synthetic"):
        open_data(tmp_path / "d.npz", model_path=tmp_path / MODEL, inputs=[IMAGE], synthetic=2)
    with pytest.raises(ConfigError, match="--synthetic"):
        open_data(None, model_path=tmp_path / MODEL, inputs=[IMAGE], synthetic=0)


# ------------------------------------------------------------------------------------ batching


@pytest.mark.parametrize("batch_size", [1, 2, 3, 5, 7])
def test_batches_join_samples_in_order(tmp_path: Path, batch_size: int) -> None:
    x = images(5)
    source = open_npz(tmp_path, [IMAGE], image=x)
    batches = list(iter_batches(source, [IMAGE], batch_size))
    counts = [n for _, n in batches]
    assert sum(counts) == 5 and all(n <= batch_size for n in counts)
    assert len(batches) == -(-5 // batch_size)
    assert [feed["image"].shape[0] for feed, _ in batches] == counts
    np.testing.assert_array_equal(np.concatenate([f["image"] for f, _ in batches]), x)


def test_batches_of_full_feeds_concatenate_their_batches(tmp_path: Path) -> None:
    x = images(4, batch=2)
    source = open_npz(tmp_path, [IMAGE], image=x)
    batches = list(iter_batches(source, [IMAGE], 3))
    assert [(f["image"].shape[0], n) for f, n in batches] == [(6, 3), (2, 1)]


@pytest.mark.parametrize(
    "inputs",
    [[spec("image", np.float32, (1, 3, 4, 4))], [IMAGE, STEPS]],
    ids=["fixed-batch", "scalar-input"],
)
def test_no_joining_when_dim0_is_fixed_or_missing(tmp_path: Path, inputs: list[InputSpec]) -> None:
    arrays = {"image": images(3), "steps": np.arange(3, dtype=np.int64)}
    used: dict[str, Any] = {s.name: arrays[s.name] for s in inputs}
    np.savez(tmp_path / "d.npz", **used)
    source = open_data(tmp_path / "d.npz", model_path=tmp_path / MODEL, inputs=inputs)
    validate_data(source, inputs)
    assert [n for _, n in iter_batches(source, inputs, 4)] == [1, 1, 1]


def test_batches_flush_where_shapes_change(tmp_path: Path) -> None:
    folder = tmp_path / "samples"
    folder.mkdir()
    for i, size in enumerate([4, 4, 4, 6, 6, 4]):
        np.savez(folder / f"{i}.npz", image=np.full((1, 3, size, size), i, np.float32))
    source = open_data(folder, model_path=tmp_path / MODEL, inputs=[IMAGE_DYN])
    batches = list(iter_batches(source, [IMAGE_DYN], 2))
    assert [(f["image"].shape, n) for f, n in batches] == [
        ((2, 3, 4, 4), 2),
        ((1, 3, 4, 4), 1),
        ((2, 3, 6, 6), 2),
        ((1, 3, 4, 4), 1),
    ]
    order = np.concatenate([f["image"][:, 0, 0, 0] for f, _ in batches])
    np.testing.assert_array_equal(order, np.arange(6))


@pytest.mark.parametrize("batch_size", [0, -2])
def test_batch_size_below_one_is_a_config_error(tmp_path: Path, batch_size: int) -> None:
    source = open_npz(tmp_path, [IMAGE], image=images(2))
    with pytest.raises(ConfigError, match="batch-size"):
        iter_batches(source, [IMAGE], batch_size)


# ------------------------------------------------------------------------------ hostile input


def assert_one_line_naming(err: pytest.ExceptionInfo[Exception], *parts: str) -> None:
    message = str(err.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, (part, message)


def test_npz_object_array_is_refused(tmp_path: Path) -> None:
    objects = np.empty(2, dtype=object)
    objects[:] = [np.zeros(3), "x"]
    np.savez(tmp_path / "evil.npz", image=images(2), meta=objects, allow_pickle=True)
    with pytest.raises(DataError) as err:
        open_data(tmp_path / "evil.npz", model_path=tmp_path / MODEL, inputs=[IMAGE])
    assert_one_line_naming(err, "evil.npz", "'meta'", "object")


def test_npz_dir_object_array_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "samples"
    folder.mkdir()
    np.savez(folder / "0.npz", image=np.array([[1.0]], dtype=object), allow_pickle=True)
    source = open_data(folder, model_path=tmp_path / MODEL, inputs=[IMAGE])
    for check in (lambda: validate_data(source, [IMAGE]), lambda: collect(source)):
        with pytest.raises(DataError) as err:
            check()
        assert_one_line_naming(err, "0.npz", "'image'", "object")


@pytest.mark.parametrize(
    ("arrays", "parts"),
    [
        (
            {"img": images(2), "steps": np.zeros(2, np.int64)},
            ["missing input 'image'", "'img' is not a model input"],
        ),
        (
            {"image": images(2), "steps": np.zeros(2, np.int64), "extra": np.zeros(2)},
            ["'extra' is not a model input"],
        ),
        ({"image": images(2)}, ["missing input 'steps'"]),
    ],
    ids=["wrong-name", "extra", "missing"],
)
def test_npz_names_must_match(tmp_path: Path, arrays: dict[str, Any], parts: list[str]) -> None:
    inputs = [IMAGE, STEPS]
    source = open_npz(tmp_path, inputs, **arrays)
    with pytest.raises(DataError) as err:
        validate_data(source, inputs)
    assert_one_line_naming(err, "data.npz", *parts)
    with pytest.raises(DataError):
        collect(source)


def test_an_extra_array_of_another_length_is_named_as_no_input(tmp_path: Path) -> None:
    """Not "arrays hold different numbers of samples": the extra array is the fault."""
    with pytest.raises(DataError) as err:
        open_npz(tmp_path, [IMAGE, STEPS], image=images(4), steps=np.zeros(4, np.int64),
                 junk=np.zeros(3))
    assert_one_line_naming(err, "data.npz", "'junk' is not a model input")


@pytest.mark.parametrize(
    ("array", "parts"),
    [
        (images(2).astype(np.float64), ["dtype float64", "float32"]),
        (np.zeros((2, 3, 4), np.float32), ["rank 3", "expected rank 4 or 5"]),
        (np.zeros((2, 1, 1, 3, 4, 4), np.float32), ["rank 6"]),
        (np.zeros((2, 3, 5, 4), np.float32), ["size 5 on axis 2", "expects 4"]),
    ],
    ids=["dtype", "rank-low", "rank-high", "fixed-dim"],
)
def test_npz_dtype_rank_and_dims_must_match(
    tmp_path: Path, array: np.ndarray, parts: list[str]
) -> None:
    source = open_npz(tmp_path, [IMAGE], image=array)
    with pytest.raises(DataError) as err:
        validate_data(source, [IMAGE])
    assert_one_line_naming(err, "data.npz", "'image'", *parts)


def test_npz_dir_checks_every_file(tmp_path: Path) -> None:
    folder = tmp_path / "samples"
    folder.mkdir()
    np.savez(folder / "0.npz", image=images(1))
    np.savez(folder / "1.npz", image=images(1).astype(np.float16))
    source = open_data(folder, model_path=tmp_path / MODEL, inputs=[IMAGE])
    with pytest.raises(DataError) as err:
        validate_data(source, [IMAGE])
    assert_one_line_naming(err, "1.npz", "'image'", "float16", "float32")


def test_npz_dir_wrong_rank_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "samples"
    folder.mkdir()
    np.savez(folder / "0.npz", image=images(2))  # 4-D: fine
    np.savez(folder / "1.npz", image=images(1)[0])  # 3-D: batch axis dropped
    source = open_data(folder, model_path=tmp_path / MODEL, inputs=[IMAGE])
    with pytest.raises(DataError) as err:
        validate_data(source, [IMAGE])
    assert_one_line_naming(err, "1.npz", "'image'", "rank 3", "rank 4")


def test_fixed_batch_that_data_cannot_fill(tmp_path: Path) -> None:
    fixed = spec("image", np.float32, (4, 3, 4, 4))
    source = open_npz(tmp_path, [fixed], image=images(8))  # rows of 1, model wants 4
    with pytest.raises(DataError) as err:
        validate_data(source, [fixed])
    assert_one_line_naming(err, "data.npz", "'image'", "size 1 on axis 0", "expects 4",
                           "array of rank 5")
    # What the message says to do works: each sample whole, on one more axis.
    whole = open_npz(tmp_path, [fixed], image=images(8).reshape(2, 4, 3, 4, 4))
    validate_data(whole, [fixed])
    assert [s["image"].shape for s in whole.samples()] == [(4, 3, 4, 4)] * 2


def test_npz_arrays_of_different_lengths(tmp_path: Path) -> None:
    with pytest.raises(DataError) as err:
        open_npz(tmp_path, [IMAGE, STEPS], image=images(3), steps=np.zeros(2, np.int64))
    assert_one_line_naming(err, "data.npz", "'image' has 3", "'steps' has 2")


def test_onnx_test_data_mismatches_name_the_file(tmp_path: Path) -> None:
    write_set(tmp_path / "test_data_set_0", [images(1).astype(np.float64)])
    source = open_data(tmp_path, model_path=tmp_path / MODEL, inputs=[IMAGE])
    with pytest.raises(DataError) as err:
        validate_data(source, [IMAGE])
    assert_one_line_naming(err, "input_0.pb", "'image'", "float64")


def test_onnx_test_data_extra_position(tmp_path: Path) -> None:
    write_set(tmp_path / "test_data_set_0", [images(1), images(1)])
    source = open_data(tmp_path, model_path=tmp_path / MODEL, inputs=[IMAGE])
    with pytest.raises(DataError) as err:
        validate_data(source, [IMAGE])
    assert_one_line_naming(err, "input_1.pb", "position 1", "'image'")


def test_onnx_test_data_duplicate_position(tmp_path: Path) -> None:
    write_set(tmp_path / "test_data_set_0", [images(1)])
    (tmp_path / "test_data_set_0" / "input_00.pb").write_bytes(
        (tmp_path / "test_data_set_0" / "input_0.pb").read_bytes()
    )
    source = open_data(tmp_path, model_path=tmp_path / MODEL, inputs=[IMAGE])
    with pytest.raises(DataError) as err:
        validate_data(source, [IMAGE])
    assert_one_line_naming(err, "input_0", "position 0")


def test_onnx_test_data_missing_input(tmp_path: Path) -> None:
    write_set(tmp_path / "test_data_set_0", [images(1)])
    source = open_data(tmp_path, model_path=tmp_path / MODEL, inputs=[IMAGE, STEPS])
    with pytest.raises(DataError) as err:
        validate_data(source, [IMAGE, STEPS])
    assert_one_line_naming(err, "test_data_set_0", "missing input 'steps'")


@pytest.mark.parametrize(
    "payload",
    [b"\xff\xff\xff", numpy_helper.from_array(images(1)).SerializeToString()[:-10]],
    ids=["garbage", "truncated"],
)
def test_broken_pb_is_a_data_error(tmp_path: Path, payload: bytes) -> None:
    (tmp_path / "test_data_set_0").mkdir()
    (tmp_path / "test_data_set_0" / "input_0.pb").write_bytes(payload)
    source = open_data(tmp_path, model_path=tmp_path / MODEL, inputs=[IMAGE])
    for check in (lambda: validate_data(source, [IMAGE]), lambda: collect(source)):
        with pytest.raises(DataError) as err:
            check()
        assert_one_line_naming(err, "input_0.pb")


def test_pb_payload_shorter_than_dims(tmp_path: Path) -> None:
    tensor = numpy_helper.from_array(images(1), "image")
    tensor.raw_data = tensor.raw_data[:-4]
    (tmp_path / "test_data_set_0").mkdir()
    (tmp_path / "test_data_set_0" / "input_0.pb").write_bytes(tensor.SerializeToString())
    source = open_data(tmp_path, model_path=tmp_path / MODEL, inputs=[IMAGE])
    validate_data(source, [IMAGE])  # headers are consistent; the payload is not
    with pytest.raises(DataError) as err:
        collect(source)
    assert_one_line_naming(err, "input_0.pb")


def test_external_pb_is_refused(tmp_path: Path) -> None:
    tensor = numpy_helper.from_array(images(1), "image")
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", "../../secret.bin"
    (tmp_path / "test_data_set_0").mkdir()
    (tmp_path / "test_data_set_0" / "input_0.pb").write_bytes(tensor.SerializeToString())
    source = open_data(tmp_path, model_path=tmp_path / MODEL, inputs=[IMAGE])
    with pytest.raises(DataError, match="externally"):
        collect(source)


@pytest.mark.parametrize("payload", [b"not a zip", b""], ids=["not-zip", "empty-file"])
def test_unreadable_npz(tmp_path: Path, payload: bytes) -> None:
    (tmp_path / "bad.npz").write_bytes(payload)
    with pytest.raises(DataError) as err:
        open_data(tmp_path / "bad.npz", model_path=tmp_path / MODEL, inputs=[IMAGE])
    assert_one_line_naming(err, "bad.npz")


def test_truncated_npz_member_fails_while_streaming(tmp_path: Path) -> None:
    npy = io.BytesIO()
    np.lib.format.write_array(npy, images(4))
    path = tmp_path / "data.npz"
    with zipfile.ZipFile(path, "w") as zf:  # a valid zip whose .npy member lacks its last rows
        zf.writestr("image.npy", npy.getvalue()[: -(3 * 4 * 4 * 4 + 10)])
    source = open_data(path, model_path=tmp_path / MODEL, inputs=[IMAGE])
    with pytest.raises(DataError) as err:
        collect(source)
    assert_one_line_naming(err, "data.npz", "'image'", "truncated")


@pytest.mark.parametrize("kind", ["npz", "npz-dir", "sets", "folder"])
def test_empty_data_set(tmp_path: Path, kind: str) -> None:
    if kind == "npz":
        np.savez(tmp_path / "d.npz", image=np.zeros((0, 3, 4, 4), np.float32))
        path = tmp_path / "d.npz"
    else:
        path = tmp_path / "d"
        path.mkdir()
        if kind == "sets":
            (path / "test_data_set_0").mkdir()
    with pytest.raises(DataError) as err:
        open_data(path, model_path=tmp_path / MODEL, inputs=[IMAGE])
    assert_one_line_naming(err, str(path))


def test_missing_path_and_unsupported_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        open_data(tmp_path / "nope.npz", model_path=tmp_path / MODEL, inputs=[IMAGE])
    (tmp_path / "data.csv").write_text("1,2")
    with pytest.raises(DataError, match="data.csv"):
        open_data(tmp_path / "data.csv", model_path=tmp_path / MODEL, inputs=[IMAGE])


def test_nan_and_inf_pass_through_and_are_named(tmp_path: Path) -> None:
    x = images(3)
    x[1, 0, 0, 0] = np.nan
    x[2, 1, 1, 1] = -np.inf
    inputs = [IMAGE, STEPS]
    source = open_npz(tmp_path, inputs, image=x, steps=np.arange(3, dtype=np.int64))
    validate_data(source, inputs)  # values are not scanned here
    assert [find_nonfinite(s) for s in collect(source)] == [[], ["image"], ["image"]]


# ------------------------------------------------------------------------------------ streaming


def test_npz_source_keeps_no_reference_to_yielded_arrays(tmp_path: Path) -> None:
    source = open_npz(tmp_path, [IMAGE, STEPS], image=images(6), steps=np.arange(6))
    it = source.samples()
    for _ in range(5):
        sample = next(it)
        refs = [weakref.ref(a) for a in sample.values()]
        del sample
        gc.collect()
        # dropped by the consumer = gone, while the iterator is still live and mid-stream
        assert all(r() is None for r in refs)


@pytest.mark.parametrize("compressed", [False, True])
def test_streaming_peak_memory_does_not_grow_with_data(tmp_path: Path, compressed: bool) -> None:
    n, row = 200, (1, 64, 256)  # 64 KiB per sample, 12.8 MiB in all
    data = np.random.default_rng(1).standard_normal((n, *row)).astype(np.float32)
    inputs = [spec("x", np.float32, ("N", 64, 256))]
    source = open_npz(tmp_path, inputs, compressed, x=data[:, 0])
    del data
    sample_bytes = 64 * 256 * 4
    tracemalloc.start()
    try:
        validate_data(source, inputs)
        _, validate_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        total = 0
        for feed, count in iter_batches(source, inputs, 4):
            total += count
            del feed
        _, stream_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == n
    assert validate_peak < sample_bytes  # headers only
    assert stream_peak < 16 * sample_bytes  # a few batches' worth, not 200 samples


def test_folder_with_npz_files_and_test_sets_is_ambiguous(tmp_path: Path) -> None:
    np.savez(tmp_path / "0.npz", image=images(1))
    write_set(tmp_path / "test_data_set_0", [images(1)])
    with pytest.raises(DataError) as err:
        open_data(tmp_path, model_path=tmp_path / "elsewhere" / MODEL, inputs=[IMAGE])
    assert_one_line_naming(err, str(tmp_path), ".npz", "test_data_set_")


def test_scalar_input_needs_a_sample_axis(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", image=images(1), steps=np.int64(3))
    source = open_data(tmp_path / "d.npz", model_path=tmp_path / MODEL, inputs=[IMAGE, STEPS])
    with pytest.raises(DataError) as err:
        validate_data(source, [IMAGE, STEPS])
    assert_one_line_naming(err, "d.npz", "'steps'", "rank 0", "expected rank 1")


def test_string_inputs_of_test_data_sets_are_passed_through(tmp_path: Path) -> None:
    """Only float tensors are quantized: a string input is read and fed to the model as it is."""
    from click.testing import CliRunner
    from onnx import numpy_helper

    from qcal.cli import main

    _save_string_and_float_model(tmp_path / "m.onnx")
    folder = tmp_path / "test_data_set_0"
    folder.mkdir()
    inputs = (np.array([["a", "b", "c"]], dtype=object), np.array([[1.0, -2.0, 0.5]], np.float32))
    for i, (name, value) in enumerate(zip(("s", "x"), inputs)):
        (folder / f"input_{i}.pb").write_bytes(numpy_helper.from_array(value, name).SerializeToString())
    result = CliRunner().invoke(main, ["calibrate", "--min-product-macs", "0", str(tmp_path / "m.onnx"), "--data",
                                       str(folder), "-o", str(tmp_path / "q.onnx"), "--report",
                                       str(tmp_path / "q.json"), "--no-fallback", "-q"])
    assert result.exit_code == 0, result.output
    quantized = onnx.load(tmp_path / "q.onnx")
    assert any(n.op_type == "QuantizeLinear" for n in quantized.graph.node)


def test_strings_in_an_npz_are_sent_to_the_format_that_carries_them(tmp_path: Path) -> None:
    """An .npz holds strings as unicode (refused: not the model's type) or as a pickled object
    array (refused: never unpickled); both messages name the .pb files the test above reads."""
    from click.testing import CliRunner

    from qcal.cli import main

    _save_string_and_float_model(tmp_path / "m.onnx")
    x = np.ones((2, 1, 3), np.float32)
    np.savez(tmp_path / "unicode.npz", s=np.array([[["a", "b", "c"]]] * 2), x=x)
    np.savez(tmp_path / "objects.npz", s=np.array([[["a", "b", "c"]]] * 2, dtype=object), x=x)
    for data, said in (("unicode.npz", "model expects strings"), ("objects.npz", "pickled")):
        result = CliRunner().invoke(main, ["calibrate", str(tmp_path / "m.onnx"), "--data",
                                           str(tmp_path / data), "-o", str(tmp_path / "q.onnx"),
                                           "-q"])
        assert result.exit_code == 5, result.output
        assert said in result.output and "test_data_set_K/input_J.pb" in result.output
        assert not (tmp_path / "q.onnx").exists()


def _save_string_and_float_model(path: Path) -> None:
    """A model of a string input `s` it copies out and a float input `x` a MatMul reads."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["s"], ["s_out"], name="copy"),
         helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("s", TensorProto.STRING, [1, 3]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("s_out", TensorProto.STRING, [1, 3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        initializer=[numpy_helper.from_array(np.ones((3, 2), np.float32), "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              path)


class _Rows:
    """A source of single-row samples that counts how many it reads."""

    kind, path, is_synthetic = "npz", None, False

    def __init__(self, rows: np.ndarray) -> None:
        self.rows, self.read = rows, 0

    def num_samples(self) -> int:
        return len(self.rows)

    def samples(self) -> Any:
        for row in self.rows:
            self.read += 1
            yield {"x": row[None]}


def test_content_order_ranks_samples_by_digest_whatever_the_data_order() -> None:
    rows = np.random.default_rng(3).standard_normal((12, 4)).astype(np.float32)
    digests = [sample_digest({"x": row[None]}) for row in rows]
    order = content_order(_Rows(rows))
    assert order.finite == 12 and [digests[p] for p in order.positions] == sorted(digests)
    flipped = content_order(_Rows(rows[::-1]))
    assert [len(rows) - 1 - p for p in flipped.positions] == order.positions  # first to last


def test_content_order_puts_samples_holding_nan_or_inf_last() -> None:
    rows = np.random.default_rng(4).standard_normal((6, 3)).astype(np.float32)
    rows[1, 2], rows[4, 0] = np.nan, -np.inf
    order = content_order(_Rows(rows))
    assert order.finite == 4 and sorted(order.positions[4:]) == [1, 4]


def test_sample_subset_gives_its_positions_in_the_order_asked_reading_no_further() -> None:
    rows = np.arange(20, dtype=np.float32).reshape(10, 2)
    source = _Rows(rows)
    subset = SampleSubset(source, [6, 1, 3])
    assert subset.num_samples() == 3
    got = [s["x"][0, 0] for s in subset.samples()]
    assert got == [12.0, 2.0, 6.0]
    assert source.read == 7  # up to position 6, not beyond
    assert list(SampleSubset(source, []).samples()) == []
    assert [s["x"][0, 0] for s in SampleSubset(source, [9, 0]).samples()] == [18.0, 0.0]


def test_errors_name_a_subsets_samples_by_their_positions_in_the_data() -> None:
    subset = SampleSubset(_Rows(np.zeros((10, 2), np.float32)), [0, 1, 3, 4, 7])
    assert name_samples(subset, 0, 2) == "samples 0-1"
    assert name_samples(subset, 1, 2) == "samples 1, 3"
    assert name_samples(subset, 4, 1) == "sample 7"
    assert name_samples(None, 5, 3) == "samples 5-7"  # a plain source: counted in order
