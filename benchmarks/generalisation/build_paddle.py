"""Build the PaddlePaddle (paddle2onnx-exported) models of the generalisation benchmark.

Models (trained briefly on scikit-learn's bundled ``load_digits``, split as in
``_export_common.py``), each written to ``<out>/<name>/`` (see ``_export_common.py``):

- ``paddle_cnn``: a small ResNet-like CNN, NCHW input ``image`` [batch, 1, 16, 16]:
  Conv2D + BatchNorm2D + ReLU stem, two residual blocks (the second strided, with a 1x1
  Conv2D + BN shortcut), AdaptiveAvgPool2D(1), Flatten, Linear -> 10 logits.
- ``paddle_lstm``: Linear + ReLU embedding of each image row, a 1-layer ``paddle.nn.LSTM``,
  Linear -> 10 logits per row (input ``rows`` [batch, 8, 8], time = image row), metric
  ``frames`` (every row is tagged with the digit's class).

Both are exported with ``paddle.onnx.export`` (paddle2onnx) at opset 13.

Run with the Paddle environment (see ``requirements-paddle.txt``)::

    python -m venv benchmarks/.cache/venv-paddle
    benchmarks/.cache/venv-paddle/bin/pip install -r benchmarks/generalisation/requirements-paddle.txt
    benchmarks/.cache/venv-paddle/bin/python benchmarks/generalisation/build_paddle.py

paddle2onnx folds constants with Polygraphy, which tries to ``pip install`` onnxruntime,
onnx_graphsurgeon and sympy when they are missing; the requirements file lists them so that it
never has to (and this script sets ``POLYGRAPHY_AUTOINSTALL_DEPS=0``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _export_common as common

common.pin_threads(2)
os.environ.setdefault("POLYGRAPHY_AUTOINSTALL_DEPS", "0")
os.environ.setdefault("GLOG_minloglevel", "2")

OPSET = 13
SIZE = 16
ALL_MODELS = ("paddle_cnn", "paddle_lstm")


def _paddle():
    import paddle

    paddle.set_device("cpu")
    paddle.seed(common.SEED)
    return paddle


def versions() -> dict:
    import paddle
    import paddle2onnx

    return {"paddlepaddle": paddle.__version__, "paddle2onnx": paddle2onnx.__version__}


def _train(model, xs: np.ndarray, ys: np.ndarray, epochs: int, lr: float, loss_fn) -> None:
    paddle = _paddle()
    steps = epochs * (len(xs) // 64)
    sched = paddle.optimizer.lr.CosineAnnealingDecay(learning_rate=lr, T_max=steps)
    opt = paddle.optimizer.Adam(learning_rate=sched, parameters=model.parameters())
    rng = np.random.default_rng(common.SEED)
    model.train()
    for _ in range(epochs):
        order = rng.permutation(len(xs))
        for i in range(len(xs) // 64):
            idx = order[i * 64 : (i + 1) * 64]
            loss = loss_fn(model(paddle.to_tensor(xs[idx])), paddle.to_tensor(ys[idx]))
            loss.backward()
            opt.step()
            opt.clear_grad()
            sched.step()
    model.eval()


def build_cnn(split: dict):
    paddle = _paddle()
    nn = paddle.nn
    F = paddle.nn.functional

    class Block(nn.Layer):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2D(cin, cout, 3, stride, 1, bias_attr=False)
            self.bn1 = nn.BatchNorm2D(cout, momentum=0.9)
            self.conv2 = nn.Conv2D(cout, cout, 3, 1, 1, bias_attr=False)
            self.bn2 = nn.BatchNorm2D(cout, momentum=0.9)
            self.short = None
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(
                    nn.Conv2D(cin, cout, 1, stride, bias_attr=False),
                    nn.BatchNorm2D(cout, momentum=0.9),
                )

        def forward(self, x):
            y = F.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return F.relu(y + (x if self.short is None else self.short(x)))

    class ResNetTiny(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2D(1, 16, 3, 1, 1, bias_attr=False),
                nn.BatchNorm2D(16, momentum=0.9),
                nn.ReLU(),
            )
            self.block1 = Block(16, 16, 1)
            self.block2 = Block(16, 32, 2)
            self.pool = nn.AdaptiveAvgPool2D(1)
            self.fc = nn.Linear(32, 10)

        def forward(self, image):
            x = self.block2(self.block1(self.stem(image)))
            return self.fc(paddle.flatten(self.pool(x), 1))

    xs = {k: common.upsample(v[0], SIZE)[:, None] for k, v in split.items()}
    ys = {k: v[1] for k, v in split.items()}
    model = ResNetTiny()
    _train(model, xs["train"], ys["train"], 6, 5e-3, F.cross_entropy)
    with paddle.no_grad():
        logits = model(paddle.to_tensor(xs["eval"])).numpy()
    spec = {
        "name": "paddle_cnn",
        "family": "resnet",
        "metric": "top1",
        "calib": {"image": xs["calib"]},
        "eval": {"image": xs["eval"]},
        "labels": ys["eval"],
        "accuracy": {"top1": float((logits.argmax(1) == ys["eval"]).mean())},
        "input_spec": [paddle.static.InputSpec([None, 1, SIZE, SIZE], "float32", "image")],
        "description": "Paddle ResNet-like CNN (Conv2D/BatchNorm2D/ReLU stem, 2 residual blocks, the second "
        "strided with a 1x1 conv shortcut, AdaptiveAvgPool2D, Linear) on load_digits 16x16 NCHW, "
        "6 epochs",
    }
    return model, spec


def build_lstm(split: dict):
    paddle = _paddle()
    nn = paddle.nn
    F = paddle.nn.functional
    steps = 8

    class RowTagger(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 32)
            self.lstm = nn.LSTM(32, 48, num_layers=1, time_major=False)
            self.out = nn.Linear(48, 10)

        def forward(self, rows):
            y, _ = self.lstm(F.relu(self.embed(rows)))
            return self.out(y)

    xs = {k: ((v[0] - 0.305) / 0.376).astype(np.float32) for k, v in split.items()}
    ys = {k: v[1] for k, v in split.items()}
    weights = paddle.to_tensor(np.linspace(0.25, 1.0, steps, dtype=np.float32))

    def loss_fn(logits, y):
        # every row carries the digit's label; later rows see more of the digit, so weigh more
        per = F.cross_entropy(
            logits, paddle.tile(y[:, None, None], [1, steps, 1]), reduction="none"
        )
        return (per.squeeze(-1) * weights).mean()

    model = RowTagger()
    _train(model, xs["train"], ys["train"], 15, 5e-3, loss_fn)
    with paddle.no_grad():
        pred = model(paddle.to_tensor(xs["eval"])).numpy().argmax(-1)
    spec = {
        "name": "paddle_lstm",
        "family": "rnn",
        "metric": "frames",
        "calib": {"rows": xs["calib"]},
        "eval": {"rows": xs["eval"]},
        "labels": None,
        "accuracy": {
            "frames_vs_label": float((pred == ys["eval"][:, None]).mean()),
            "last_step_top1": float((pred[:, -1] == ys["eval"]).mean()),
        },
        "input_spec": [paddle.static.InputSpec([None, steps, 8], "float32", "rows")],
        "description": "Paddle Linear+ReLU row embedding, nn.LSTM(48), per-row Linear logits tagging each of the "
        "8 image rows of load_digits with the digit class, 15 epochs",
        "notes": "metric frames: per-step argmax agreement; eval.labels.npy is not written (labels are per image)",
    }
    return model, spec


def export(model, spec: dict, out: Path) -> dict:
    import onnx
    import paddle

    d = out / spec["name"]
    d.mkdir(parents=True, exist_ok=True)
    paddle.onnx.export(model, str(d / "model"), input_spec=spec["input_spec"], opset_version=OPSET)
    outs = [o.name for o in onnx.load(str(d / "model.onnx")).graph.output]
    key = spec["input_spec"][0].name
    with paddle.no_grad():
        ref = model(paddle.to_tensor(spec["eval"][key]))
    ref = ref if isinstance(ref, (list, tuple)) else [ref]
    if len(ref) != len(outs):
        raise SystemExit(
            f"{spec['name']}: {len(outs)} ONNX outputs {outs}, {len(ref)} paddle outputs"
        )
    spec["reference"] = {name: r.numpy() for name, r in zip(outs, ref)}
    spec["exporter"] = "paddle.onnx.export (paddle2onnx)"
    spec["versions"] = versions()
    return common.write_model(spec, out)


BUILDERS = {"paddle_cnn": build_cnn, "paddle_lstm": build_lstm}


def main() -> int:
    return common.builder_main(__doc__ or "", list(ALL_MODELS), lambda name, split: BUILDERS[name](split), export)


if __name__ == "__main__":
    sys.exit(main())
