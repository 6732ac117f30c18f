"""Build the Keras (tf2onnx-exported) models of the generalisation benchmark.

Models (trained briefly on scikit-learn's bundled ``load_digits``, split as in
``_export_common.py``), each written to ``<out>/<name>/`` (see ``_export_common.py``):

- ``keras_cnn``: a MobileNet-like Keras CNN, NHWC input ``image`` [batch, 16, 16, 1] as Keras has
  it: Conv2D + BatchNormalization + ReLU, DepthwiseConv2D + BN + Swish, 1x1 Conv2D, an inverted
  residual block with an Add skip, a strided inverted residual, GlobalAveragePooling2D, Dropout,
  Dense with a softmax (the model outputs probabilities). Exported with
  ``tf2onnx.convert.from_keras``.
- ``keras_lstm``: a Keras LSTM tagger over the rows of the digit (input ``rows`` [batch, 8, 8]:
  time = image row), per-step Dense + softmax, metric ``frames`` (every row is tagged with the
  digit's class). tf2onnx turns the Keras LSTM into an ONNX ``LSTM`` node.

Run with the TensorFlow environment (see ``requirements-tf.txt``)::

    python -m venv benchmarks/.cache/venv-tf
    benchmarks/.cache/venv-tf/bin/pip install -r benchmarks/generalisation/requirements-tf.txt
    benchmarks/.cache/venv-tf/bin/python benchmarks/generalisation/build_keras.py

After exporting, the script checks each model in onnxruntime against Keras's own outputs (under
``$QCAL_PYTHON``, default ``python3``, when this interpreter lacks onnxruntime).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _export_common as common

common.pin_threads(2)

OPSET = 15
ALL_MODELS = ("keras_cnn", "keras_lstm")


def _tf():
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(2)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()
    return tf


def versions() -> dict:
    import keras
    import tensorflow as tf
    import tf2onnx

    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "tf2onnx": tf2onnx.__version__,
    }


def build_cnn(split: dict) -> tuple[object, dict]:
    tf = _tf()
    L = tf.keras.layers
    tf.keras.utils.set_random_seed(common.SEED)
    size = 16
    xs = {k: common.upsample(v[0], size)[..., None] for k, v in split.items()}
    ys = {k: v[1] for k, v in split.items()}

    def conv_bn(x, filters, kernel, act, strides=1, name=""):
        x = L.Conv2D(
            filters, kernel, strides=strides, padding="same", use_bias=False, name=f"{name}conv"
        )(x)
        x = L.BatchNormalization(momentum=0.9, name=f"{name}bn")(x)
        return L.Activation(act, name=f"{name}{act}")(x) if act else x

    def dw_bn(x, act, strides=1, name=""):
        x = L.DepthwiseConv2D(3, strides=strides, padding="same", use_bias=False, name=f"{name}dw")(
            x
        )
        x = L.BatchNormalization(momentum=0.9, name=f"{name}dwbn")(x)
        return L.Activation(act, name=f"{name}dw{act}")(x)

    def inverted_residual(x, cout, expand, strides, name):
        cin = x.shape[-1]
        y = conv_bn(x, cin * expand, 1, "swish", name=f"{name}_expand_")
        y = dw_bn(y, "swish", strides, name=f"{name}_")
        y = conv_bn(y, cout, 1, None, name=f"{name}_project_")
        if strides == 1 and cin == cout:
            y = L.Add(name=f"{name}_add")([x, y])
        return y

    inp = L.Input((size, size, 1), name="image")
    x = conv_bn(inp, 16, 3, "relu", name="stem_")
    x = dw_bn(x, "swish", name="sep_")
    x = conv_bn(x, 24, 1, "relu", name="sep_pw_")
    x = inverted_residual(x, 24, 2, 1, "ir1")
    x = inverted_residual(x, 32, 2, 2, "ir2")
    x = inverted_residual(x, 32, 2, 1, "ir3")
    x = conv_bn(x, 64, 1, "relu", name="head_")
    x = L.GlobalAveragePooling2D(name="gap")(x)
    x = L.Dropout(0.2, name="drop")(x)
    out = L.Dense(10, activation="softmax", name="probs")(x)
    model = tf.keras.Model(inp, out, name="keras_cnn")
    model.compile(
        optimizer=tf.keras.optimizers.Adam(5e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(xs["train"], ys["train"], batch_size=64, epochs=8, shuffle=True, verbose=0)
    probs = model(xs["eval"], training=False).numpy()
    acc = float((probs.argmax(1) == ys["eval"]).mean())
    spec = {
        "name": "keras_cnn",
        "family": "mobilenet",
        "metric": "top1",
        "calib": {"image": xs["calib"]},
        "eval": {"image": xs["eval"]},
        "labels": ys["eval"],
        "accuracy": {"top1": acc},
        "signature": [tf.TensorSpec((None, size, size, 1), tf.float32, name="image")],
        "output_names": ["probs"],
        "description": "Keras CNN (Conv2D/BN/ReLU, DepthwiseConv2D/BN/Swish, inverted residuals with Add, "
        "GAP, Dense+softmax) on load_digits upsampled to 16x16 NHWC, 8 epochs",
    }
    return model, spec


def build_lstm(split: dict) -> tuple[object, dict]:
    tf = _tf()
    L = tf.keras.layers
    tf.keras.utils.set_random_seed(common.SEED)
    xs = {
        k: ((v[0] - 0.305) / 0.376).astype(np.float32) for k, v in split.items()
    }  # [N, 8 rows, 8]
    ys = {k: v[1] for k, v in split.items()}
    steps = 8
    inp = L.Input((steps, 8), name="rows")
    x = L.Dense(32, activation="relu", name="embed")(inp)
    x = L.LSTM(48, return_sequences=True, name="lstm")(x)
    x = L.LayerNormalization(name="ln")(x)
    out = L.Dense(10, activation="softmax", name="frame_probs")(x)
    model = tf.keras.Model(inp, out, name="keras_lstm")
    model.compile(optimizer=tf.keras.optimizers.Adam(5e-3), loss="sparse_categorical_crossentropy")
    frame_labels = np.repeat(ys["train"][:, None], steps, 1)
    # later rows carry more of the digit: weight the loss towards the end of the sequence
    weights = np.broadcast_to(np.linspace(0.25, 1.0, steps, dtype=np.float32), frame_labels.shape)
    model.fit(
        xs["train"],
        frame_labels,
        sample_weight=weights,
        batch_size=64,
        epochs=15,
        shuffle=True,
        verbose=0,
    )
    probs = model(xs["eval"], training=False).numpy()
    pred = probs.argmax(-1)
    spec = {
        "name": "keras_lstm",
        "family": "rnn",
        "metric": "frames",
        "calib": {"rows": xs["calib"]},
        "eval": {"rows": xs["eval"]},
        "labels": None,
        "accuracy": {
            "frames_vs_label": float((pred == ys["eval"][:, None]).mean()),
            "last_step_top1": float((pred[:, -1] == ys["eval"]).mean()),
        },
        "signature": [tf.TensorSpec((None, steps, 8), tf.float32, name="rows")],
        "output_names": ["frame_probs"],
        "description": "Keras Dense+LSTM(48, return_sequences)+LayerNormalization+Dense/softmax tagging each "
        "of the 8 image rows of load_digits with the digit class, 15 epochs",
        "notes": "metric frames: per-step argmax agreement; eval.labels.npy is not written (labels are per image)",
    }
    return model, spec


def export(model, spec: dict, out: Path) -> dict:
    import tf2onnx

    d = out / spec["name"]
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    tf2onnx.convert.from_keras(
        model, input_signature=spec["signature"], opset=OPSET, output_path=str(path)
    )
    import onnx

    onnx_outputs = [o.name for o in onnx.load(str(path)).graph.output]
    ref = model(spec["eval"][spec["signature"][0].name], training=False)
    ref = ref if isinstance(ref, (list, tuple)) else [ref]
    spec["reference"] = {name: r.numpy() for name, r in zip(onnx_outputs, ref)}
    spec["exporter"] = "tf2onnx.convert.from_keras"
    spec["versions"] = versions()
    return common.write_model(spec, out)


BUILDERS = {"keras_cnn": build_cnn, "keras_lstm": build_lstm}


def main() -> int:
    return common.builder_main(__doc__ or "", list(ALL_MODELS), lambda name, split: BUILDERS[name](split), export)


if __name__ == "__main__":
    sys.exit(main())
