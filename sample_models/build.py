"""Rebuild every qcal sample model and its data, byte for byte.

Usage (from the repository root)::

    python sample_models/build.py

Dev-only dependencies, needed to rebuild but not to use or test qcal::

    torch==2.13.0 (CPU)   trains the digits CNN
    scikit-learn           ships the real 8x8 digits data (sklearn.datasets.load_digits)
    onnx, numpy            build the graphs and write the arrays
    onnxruntime            checks every written model against its reference

Every file is written into the folder that holds this script. Two runs with the same
library versions give byte-identical files: seeds are fixed, torch trains on one thread with
deterministic algorithms, graphs are built node by node with fixed names (no exporter), and the
.npz archives are written with fixed zip timestamps instead of ``np.savez``.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

if TYPE_CHECKING:
    import torch

OUT_DIR = Path(__file__).resolve().parent
OPSET = 17
# IR 8 is what onnx 1.13-1.14 wrote for opset 17; every onnxruntime that runs opset 17 loads it.
IR_VERSION = 8
PRODUCER = "qcal sample_models/build.py"
# Zip entries carry a timestamp; a fixed one keeps the archives byte-identical between runs.
ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)

DIGITS_SEED = 0
DIGITS_EVAL_SIZE = 450
DIGITS_CALIB_SIZE = 200
DIGITS_MIN_ACCURACY = 0.95
# Channels of conv1..conv3 and the hidden Gemm width. At 16/32/32 the whole network is so small
# that per-node overhead dominates and an int8 QDQ model runs slower than the float one in
# onnxruntime at batch 1; 32/64/64 gives the integer kernels enough work to win.
DIGITS_CHANNELS = (32, 64, 64)
DIGITS_HIDDEN = 64

BLOCK_SEED = 1
BLOCK_SEQ = 16
BLOCK_DIM = 32
BLOCK_HEADS = 4
BLOCK_MLP = 128
BLOCK_VOCAB = 512
BLOCK_SAMPLES = 64
LN_EPS = 1e-5
BN_EPS = 1e-5


# --------------------------------------------------------------------------- writing files


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def write_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write an uncompressed .npz that np.load reads, with no run-dependent bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=ZIP_DATE_TIME)
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3  # fixed, so the bytes do not depend on the host OS
            info.external_attr = 0o644 << 16
            archive.writestr(info, _npy_bytes(array))


def write_npy(path: Path, array: np.ndarray) -> None:
    path.write_bytes(_npy_bytes(array))


def write_model(path: Path, model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    path.write_bytes(model.SerializeToString())


# --------------------------------------------------------------------------- graph building


@dataclass
class GraphBuilder:
    """Collects named nodes and initializers; every name is checked to be new."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    _names: set[str] = field(default_factory=set)

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise ValueError(f"duplicate name {name!r}")
        self._names.add(name)
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        """Add an initializer (float arrays are stored as float32)."""
        array = np.asarray(value)
        if array.dtype.kind == "f":
            array = array.astype(np.float32)
        self.initializers.append(numpy_helper.from_array(array, self._claim(name)))
        return name

    def op(
        self,
        op_type: str,
        name: str,
        inputs: Sequence[str],
        output: str | None = None,
        **attrs: Any,
    ) -> str:
        """Add one node with one output, named ``output`` or ``<name>_out``."""
        out = self._claim(output if output is not None else f"{name}_out")
        self.nodes.append(
            helper.make_node(op_type, list(inputs), [out], name=self._claim(name), **attrs)
        )
        return out

    def model(
        self,
        graph_name: str,
        inputs: Sequence[onnx.ValueInfoProto],
        outputs: Sequence[onnx.ValueInfoProto],
        doc: str,
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, graph_name, list(inputs), list(outputs), self.initializers, doc_string=doc
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name=PRODUCER,
            ir_version=IR_VERSION,
        )
        return model


# --------------------------------------------------------------------------- digits CNN


@dataclass(frozen=True)
class DigitsSplit:
    train_x: np.ndarray  # float32 [n, 1, 8, 8] in [0, 1]
    train_y: np.ndarray  # int64 [n]
    calib_x: np.ndarray
    eval_x: np.ndarray
    eval_y: np.ndarray


def load_digits_split() -> DigitsSplit:
    """Split scikit-learn's 1797 digits into disjoint eval, calibration and training sets."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images.astype(np.float32) / np.float32(16.0)).reshape(-1, 1, 8, 8)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(DIGITS_SEED).permutation(len(labels))
    eval_idx = order[:DIGITS_EVAL_SIZE]
    calib_idx = order[DIGITS_EVAL_SIZE : DIGITS_EVAL_SIZE + DIGITS_CALIB_SIZE]
    train_idx = order[DIGITS_EVAL_SIZE + DIGITS_CALIB_SIZE :]
    return DigitsSplit(
        train_x=images[train_idx],
        train_y=labels[train_idx],
        calib_x=images[calib_idx],
        eval_x=images[eval_idx],
        eval_y=labels[eval_idx],
    )


def train_digits_cnn(split: DigitsSplit) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Train the CNN with torch on one thread.

    Returns:
        The float32 weights by ONNX initializer name, and torch's logits on the eval set.
    """
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(DIGITS_SEED)

    c1, c2, c3 = DIGITS_CHANNELS
    net = nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1),
        nn.BatchNorm2d(c1),
        nn.ReLU(),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.BatchNorm2d(c2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c2, c3, 3, padding=1),
        nn.BatchNorm2d(c3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c3, DIGITS_HIDDEN),
        nn.ReLU(),
        nn.Linear(DIGITS_HIDDEN, 10),
    )
    x = torch.from_numpy(split.train_x)
    y = torch.from_numpy(split.train_y)
    shuffle = torch.Generator().manual_seed(DIGITS_SEED)
    epochs, batch = 40, 32
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-3, weight_decay=1e-4)
    steps_per_epoch = math.ceil(len(y) / batch)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=2e-3, total_steps=epochs * steps_per_epoch
    )
    loss_fn = nn.CrossEntropyLoss()
    net.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=shuffle)
        for start in range(0, len(y), batch):
            idx = order[start : start + batch]
            optimizer.zero_grad()
            loss = loss_fn(net(_shift_augment(x[idx], shuffle)), y[idx])
            loss.backward()
            optimizer.step()
            schedule.step()
    net.eval()

    def arr(t: torch.Tensor) -> np.ndarray:
        return t.detach().numpy().astype(np.float32)

    weights: dict[str, np.ndarray] = {}
    for layer, conv, bn in (("conv1", 0, 1), ("conv2", 3, 4), ("conv3", 7, 8)):
        c, b = net[conv], net[bn]
        assert isinstance(c, nn.Conv2d) and isinstance(b, nn.BatchNorm2d)
        assert c.bias is not None and b.running_mean is not None and b.running_var is not None
        weights[f"{layer}.weight"] = arr(c.weight)
        weights[f"{layer}.bias"] = arr(c.bias)
        bn_name = layer.replace("conv", "bn")
        weights[f"{bn_name}.scale"] = arr(b.weight)
        weights[f"{bn_name}.bias"] = arr(b.bias)
        weights[f"{bn_name}.mean"] = arr(b.running_mean)
        weights[f"{bn_name}.var"] = arr(b.running_var)
    for layer, index in (("fc1", 12), ("fc2", 14)):
        lin = net[index]
        assert isinstance(lin, nn.Linear)
        weights[f"{layer}.weight"] = arr(lin.weight)
        weights[f"{layer}.bias"] = arr(lin.bias)

    with torch.no_grad():
        reference = arr(net(torch.from_numpy(split.eval_x)))
    return weights, reference


def _shift_augment(batch: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Shift each image by up to one pixel: digits are not always centred the same way."""
    import torch

    padded = torch.nn.functional.pad(batch, (1, 1, 1, 1))
    offsets = torch.randint(0, 3, (len(batch), 2), generator=generator)
    return torch.stack(
        [padded[i, :, dy : dy + 8, dx : dx + 8] for i, (dy, dx) in enumerate(offsets.tolist())]
    )


def digits_cnn_model(w: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """Conv+BN+Relu x2, MaxPool, Conv+BN+Relu, GlobalAveragePool, Flatten, Gemm+Relu, Gemm.

    BatchNormalization stays a separate node with its running statistics, as exporters write
    it before optimisation.
    """
    g = GraphBuilder()
    x = "image"
    for layer in ("conv1", "conv2", "conv3"):
        bn = layer.replace("conv", "bn")
        x = g.op(
            "Conv",
            layer,
            [
                x,
                g.const(f"{layer}.weight", w[f"{layer}.weight"]),
                g.const(f"{layer}.bias", w[f"{layer}.bias"]),
            ],
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
        )
        x = g.op(
            "BatchNormalization",
            bn,
            [x] + [g.const(f"{bn}.{p}", w[f"{bn}.{p}"]) for p in ("scale", "bias", "mean", "var")],
            epsilon=BN_EPS,
        )
        x = g.op("Relu", f"{layer}_relu", [x])
        if layer == "conv2":
            x = g.op("MaxPool", "pool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = g.op("GlobalAveragePool", "gap", [x])
    x = g.op("Flatten", "flatten", [x], axis=1)
    x = g.op(
        "Gemm",
        "fc1",
        [x, g.const("fc1.weight", w["fc1.weight"]), g.const("fc1.bias", w["fc1.bias"])],
        transB=1,
    )
    x = g.op("Relu", "fc1_relu", [x])
    g.op(
        "Gemm",
        "fc2",
        [x, g.const("fc2.weight", w["fc2.weight"]), g.const("fc2.bias", w["fc2.bias"])],
        output="logits",
        transB=1,
    )
    return g.model(
        "digits_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        "CNN for scikit-learn's 8x8 digits; image = pixel / 16 in [0, 1]; logits of 0..9.",
    )


def build_digits() -> float:
    """Train, write the digits model and data; return the float eval accuracy."""
    split = load_digits_split()
    weights, reference = train_digits_cnn(split)
    model = digits_cnn_model(weights)
    path = OUT_DIR / "digits_cnn.onnx"
    write_model(path, model)
    logits = _run(path, {"image": split.eval_x})
    np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=1e-4)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == split.eval_y))
    if accuracy < DIGITS_MIN_ACCURACY:
        raise SystemExit(f"digits_cnn.onnx: eval accuracy {accuracy:.4f} < {DIGITS_MIN_ACCURACY}")
    write_npz(OUT_DIR / "digits_cnn.calib.npz", {"image": split.calib_x})
    write_npz(OUT_DIR / "digits_cnn.eval.npz", {"image": split.eval_x})
    write_npy(OUT_DIR / "digits_cnn.eval.labels.npy", split.eval_y)
    return accuracy


# --------------------------------------------------------------------------- transformer block


def block_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Seeded weights, each matrix scaled by 1/sqrt(fan_in) so activations keep their size."""

    def dense(fan_in: int, fan_out: int) -> np.ndarray:
        return (rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in)).astype(np.float32)

    def small(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    d, m = BLOCK_DIM, BLOCK_MLP
    return {
        "ln1.gamma": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        "ln1.beta": small(d),
        "attn.q.weight": dense(d, d),
        "attn.q.bias": small(d),
        "attn.k.weight": dense(d, d),
        "attn.k.bias": small(d),
        "attn.v.weight": dense(d, d),
        "attn.v.bias": small(d),
        "attn.out.weight": dense(d, d),
        "attn.out.bias": small(d),
        "ln2.gamma": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        "ln2.beta": small(d),
        "mlp.fc1.weight": dense(d, m),
        "mlp.fc1.bias": small(m),
        "mlp.fc2.weight": dense(m, d),
        "mlp.fc2.bias": small(d),
    }


def block_tokens(rng: np.random.Generator, embedding: np.ndarray, count: int) -> np.ndarray:
    """Embeddings of token ids drawn with Zipf-like frequencies, plus sinusoidal positions."""
    ranks = np.arange(1, BLOCK_VOCAB + 1, dtype=np.float64)
    frequency = 1.0 / ranks
    ids = rng.choice(BLOCK_VOCAB, size=(count, BLOCK_SEQ), p=frequency / frequency.sum())
    position = np.arange(BLOCK_SEQ, dtype=np.float64)[:, None]
    rate = np.exp(-math.log(10000.0) * np.arange(0, BLOCK_DIM, 2) / BLOCK_DIM)
    encoding = np.zeros((BLOCK_SEQ, BLOCK_DIM))
    encoding[:, 0::2] = np.sin(position * rate)
    encoding[:, 1::2] = np.cos(position * rate)
    return (embedding[ids] + encoding).astype(np.float32)


def block_reference(x: np.ndarray, w: Mapping[str, np.ndarray]) -> np.ndarray:
    """The block in float64 numpy, to check the graph against."""
    from math import erf

    def norm(t: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
        centred = t - t.mean(-1, keepdims=True)
        std = np.sqrt((centred**2).mean(-1, keepdims=True) + LN_EPS)
        return np.asarray(centred / std * gamma + beta)

    def heads(t: np.ndarray) -> np.ndarray:
        n = t.shape[0]
        return np.asarray(t.reshape(n, BLOCK_SEQ, BLOCK_HEADS, -1).transpose(0, 2, 1, 3))

    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    x = x.astype(np.float64)
    h = norm(x, w64["ln1.gamma"], w64["ln1.beta"])
    q, k, v = (heads(h @ w64[f"attn.{p}.weight"] + w64[f"attn.{p}.bias"]) for p in "qkv")
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(BLOCK_DIM // BLOCK_HEADS)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    context = (probs @ v).transpose(0, 2, 1, 3).reshape(x.shape)
    r = x + context @ w64["attn.out.weight"] + w64["attn.out.bias"]
    u = norm(r, w64["ln2.gamma"], w64["ln2.beta"]) @ w64["mlp.fc1.weight"] + w64["mlp.fc1.bias"]
    gelu = 0.5 * u * (1.0 + np.vectorize(erf)(u / math.sqrt(2.0)))
    return np.asarray(r + gelu @ w64["mlp.fc2.weight"] + w64["mlp.fc2.bias"])


def _decomposed_layer_norm(
    g: GraphBuilder, x: str, prefix: str, w: Mapping[str, np.ndarray]
) -> str:
    """LayerNormalization spelled out: (x - mean) / sqrt(var + eps) * gamma + beta."""
    mean = g.op("ReduceMean", f"{prefix}_mean", [x], axes=[-1], keepdims=1)
    centred = g.op("Sub", f"{prefix}_sub", [x, mean])
    square = g.op("Pow", f"{prefix}_pow", [centred, g.const(f"{prefix}.two", np.array(2.0))])
    var = g.op("ReduceMean", f"{prefix}_var", [square], axes=[-1], keepdims=1)
    shifted = g.op("Add", f"{prefix}_add_eps", [var, g.const(f"{prefix}.eps", np.array(LN_EPS))])
    std = g.op("Sqrt", f"{prefix}_sqrt", [shifted])
    normed = g.op("Div", f"{prefix}_div", [centred, std])
    scaled = g.op(
        "Mul", f"{prefix}_mul_gamma", [normed, g.const(f"{prefix}.gamma", w[f"{prefix}.gamma"])]
    )
    return g.op(
        "Add", f"{prefix}_add_beta", [scaled, g.const(f"{prefix}.beta", w[f"{prefix}.beta"])]
    )


def _linear(
    g: GraphBuilder, x: str, prefix: str, w: Mapping[str, np.ndarray], output: str | None = None
) -> str:
    """MatMul by a [in, out] weight, then Add of the bias (how exporters write nn.Linear on 3-D input)."""
    node = prefix.replace(".", "_")
    y = g.op("MatMul", f"{node}_matmul", [x, g.const(f"{prefix}.weight", w[f"{prefix}.weight"])])
    return g.op(
        "Add", f"{node}_add", [y, g.const(f"{prefix}.bias", w[f"{prefix}.bias"])], output=output
    )


def transformer_block_model(w: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """Pre-LN encoder block: x + Attn(LN1(x)), then r + MLP(LN2(r)); 4 heads, GELU MLP."""
    g = GraphBuilder()
    head_dim = BLOCK_DIM // BLOCK_HEADS
    # Reshape shapes use 0 ("copy this dim") for the symbolic batch.
    split_heads = g.const(
        "attn.split_heads_shape", np.array([0, 0, BLOCK_HEADS, head_dim], np.int64)
    )
    merge_heads = g.const("attn.merge_heads_shape", np.array([0, 0, BLOCK_DIM], np.int64))

    h = _decomposed_layer_norm(g, "tokens", "ln1", w)
    projected = {p: _linear(g, h, f"attn.{p}", w) for p in "qkv"}
    split = {p: g.op("Reshape", f"attn_{p}_reshape", [projected[p], split_heads]) for p in "qkv"}
    q = g.op("Transpose", "attn_q_transpose", [split["q"]], perm=[0, 2, 1, 3])
    k = g.op("Transpose", "attn_k_transpose", [split["k"]], perm=[0, 2, 3, 1])
    v = g.op("Transpose", "attn_v_transpose", [split["v"]], perm=[0, 2, 1, 3])
    scores = g.op("MatMul", "attn_scores_matmul", [q, k])
    inv_sqrt = g.const("attn.inv_sqrt_head_dim", np.array(1.0 / math.sqrt(head_dim)))
    scaled = g.op("Mul", "attn_scores_scale", [scores, inv_sqrt])
    probs = g.op("Softmax", "attn_softmax", [scaled], axis=-1)
    context = g.op("MatMul", "attn_context_matmul", [probs, v])
    context = g.op("Transpose", "attn_context_transpose", [context], perm=[0, 2, 1, 3])
    context = g.op("Reshape", "attn_context_reshape", [context, merge_heads])
    attended = _linear(g, context, "attn.out", w)
    r = g.op("Add", "attn_residual", ["tokens", attended])

    n = g.op(
        "LayerNormalization",
        "ln2",
        [r, g.const("ln2.gamma", w["ln2.gamma"]), g.const("ln2.beta", w["ln2.beta"])],
        axis=-1,
        epsilon=LN_EPS,
    )
    u = _linear(g, n, "mlp.fc1", w)
    # GELU(u) = 0.5 * u * (1 + erf(u / sqrt(2))), as exporters write it below opset 20.
    erf = g.op(
        "Erf",
        "mlp_gelu_erf",
        [g.op("Div", "mlp_gelu_div", [u, g.const("mlp.sqrt2", np.array(math.sqrt(2.0)))])],
    )
    one_plus = g.op("Add", "mlp_gelu_add_one", [erf, g.const("mlp.one", np.array(1.0))])
    gated = g.op("Mul", "mlp_gelu_mul", [u, one_plus])
    gelu = g.op("Mul", "mlp_gelu_half", [gated, g.const("mlp.half", np.array(0.5))])
    mlp = _linear(g, gelu, "mlp.fc2", w)
    g.op("Add", "mlp_residual", [r, mlp], output="hidden")

    shape: list[str | int] = ["N", BLOCK_SEQ, BLOCK_DIM]
    return g.model(
        "transformer_block",
        [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, shape)],
        "Pre-LN transformer encoder block: seq 16, d_model 32, 4 heads, GELU MLP of 128.",
    )


def build_transformer_block() -> None:
    rng = np.random.default_rng(BLOCK_SEED)
    weights = block_weights(rng)
    embedding = rng.standard_normal((BLOCK_VOCAB, BLOCK_DIM))
    calib = block_tokens(rng, embedding, BLOCK_SAMPLES)
    evaluation = block_tokens(rng, embedding, BLOCK_SAMPLES)
    path = OUT_DIR / "transformer_block.onnx"
    write_model(path, transformer_block_model(weights))
    for tokens in (calib, evaluation):
        hidden = _run(path, {"tokens": tokens})
        np.testing.assert_allclose(hidden, block_reference(tokens, weights), rtol=1e-4, atol=1e-4)
    write_npz(OUT_DIR / "transformer_block.calib.npz", {"tokens": calib})
    write_npz(OUT_DIR / "transformer_block.eval.npz", {"tokens": evaluation})


# --------------------------------------------------------------------------- main


def _run(path: Path, feed: Mapping[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    (output,) = session.run(None, dict(feed))
    return np.asarray(output)


def main() -> None:
    accuracy = build_digits()
    build_transformer_block()
    print(f"digits_cnn.onnx: float top-1 on digits_cnn.eval.npz = {accuracy:.4f}")
    for path in sorted(OUT_DIR.iterdir()):
        if path.suffix in {".onnx", ".npz", ".npy"}:
            print(f"{path.name:32} {path.stat().st_size:>8} bytes")


if __name__ == "__main__":
    main()
