"""Build the PyTorch-exported models of the generalisation benchmark.

Each model is trained briefly on scikit-learn's bundled ``load_digits`` (1797 8x8 images, shipped
inside the scikit-learn wheel, so nothing is downloaded), exported to ONNX, and written with its
data to ``<out>/<name>/``; torch_minilm is pretrained instead, a sentence embedder on English
sentences (``_torch_minilm.py``):

- ``model.onnx``   opset 17, dynamic batch dimension
- ``calib.npz``    64 samples (key = model input name, axis 0 = sample, float32)
- ``eval.npz``     200 samples, disjoint from the calibration samples and from the training set
- ``eval.labels.npy``  integer labels of the eval samples (classifiers only)
- ``task.json``    name, family, exporter, metric (top1 / cosine / frames), inputs, outputs, ...
- ``reference_outputs.npz``  torch's float outputs on the eval samples, one at a time (key =
  output name), the reference the onnxruntime check compares against

(the same layout as the other builders' ``_export_common.write_model``)

The split of the 1797 images is fixed by a seeded permutation: 64 calibration images, 200
evaluation images, the other 1533 for training. Every model is seeded and trained with
``torch.use_deterministic_algorithms(True)`` on a fixed number of threads.

Run with the export environment (torch 2.13.0 CPU, onnx, onnxscript, scikit-learn; see
``requirements-export.txt``)::

    python -m venv benchmarks/.cache/venv-export
    benchmarks/.cache/venv-export/bin/pip install -r benchmarks/generalisation/requirements-export.txt
    benchmarks/.cache/venv-export/bin/python benchmarks/generalisation/build_torch.py

After exporting, the script checks every model in onnxruntime: in this interpreter when it has
onnxruntime, otherwise by running itself with ``--check`` under ``--ort-python`` (default: the
qcal environment ``$QCAL_PYTHON``, default ``python3``). ``--check`` needs
only numpy and onnxruntime.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _export_common as common
import _torch_minilm as minilm

DEFAULT_OUT, SEED, N_CALIB, N_EVAL = common.DEFAULT_OUT, common.SEED, common.N_CALIB, common.N_EVAL
OPSET = 17
THREADS = 1  # faster than 2 on this 2-core machine when anything else runs; bitwise-stable

ALL_MODELS = ("torch_cnn_bn", "torch_dwsep", "torch_gru_stream", "torch_encoder", "torch_vit",
              "torch_vad", "torch_prelu", "torch_minilm")


# --------------------------------------------------------------------------------------------
# data


def upsample(images: np.ndarray, size: int) -> np.ndarray:
    """[N, 8, 8] -> [N, 1, size, size], bilinear, normalised to about zero mean, unit std."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(images)[:, None]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return ((x - 0.305) / 0.376).numpy().astype(np.float32)


# --------------------------------------------------------------------------------------------
# models (torch is imported lazily so that --check runs without it)


def _torch_models() -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class CnnBn(nn.Module):
        """Conv+BatchNorm+ReLU blocks, max pooling, global average pooling, MLP head with BN."""

        def __init__(self) -> None:
            super().__init__()

            def block(cin: int, cout: int) -> list[nn.Module]:
                return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

            self.features = nn.Sequential(
                *block(1, 16), *block(16, 16), nn.MaxPool2d(2),
                *block(16, 32), *block(32, 32), nn.MaxPool2d(2),
                *block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            )
            self.head = nn.Sequential(
                nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10)
            )

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            return self.head(self.features(image))

    class SqueezeExcite(nn.Module):
        def __init__(self, ch: int, hidden: int, gate: nn.Module) -> None:
            super().__init__()
            self.reduce = nn.Conv2d(ch, hidden, 1)
            self.expand = nn.Conv2d(hidden, ch, 1)
            self.gate = gate

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = x.mean((2, 3), keepdim=True)
            return x * self.gate(self.expand(F.relu(self.reduce(s))))

    class InvertedResidual(nn.Module):
        """MobileNetV2/V3 block: 1x1 expand, 3x3 depthwise, optional SE, 1x1 project (+ skip)."""

        def __init__(self, cin: int, cout: int, expand: int, stride: int, act: type[nn.Module],
                     se_gate: nn.Module | None) -> None:
            super().__init__()
            mid = cin * expand
            layers: list[nn.Module] = []
            if expand != 1:
                layers += [nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), act()]
            layers += [nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), act()]
            if se_gate is not None:
                layers.append(SqueezeExcite(mid, max(8, mid // 4), se_gate))
            layers += [nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)]
            self.body = nn.Sequential(*layers)
            self.skip = stride == 1 and cin == cout

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.body(x)
            return x + y if self.skip else y

    class DwSep(nn.Module):
        """MobileNet-style: HardSwish stem, depthwise-separable and inverted-residual blocks with
        ReLU6 / HardSwish, SE blocks gated by Sigmoid and by HardSigmoid, HardSwish MLP head."""

        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
            self.blocks = nn.Sequential(
                # plain depthwise-separable (MobileNetV1): dw 3x3 + BN + ReLU6, pw 1x1 + BN + ReLU6
                nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                nn.Conv2d(16, 24, 1, bias=False), nn.BatchNorm2d(24), nn.ReLU6(),
                InvertedResidual(24, 24, 3, 1, nn.ReLU6, None),
                InvertedResidual(24, 32, 3, 2, nn.ReLU6, nn.Sigmoid()),
                InvertedResidual(32, 32, 4, 1, nn.Hardswish, nn.Hardsigmoid()),
                InvertedResidual(32, 48, 4, 2, nn.Hardswish, nn.Hardsigmoid()),
                nn.Conv2d(48, 96, 1, bias=False), nn.BatchNorm2d(96), nn.Hardswish(),
            )
            self.head = nn.Sequential(nn.Linear(96, 128), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(128, 10))

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            x = self.blocks(self.stem(image))
            return self.head(x.mean((2, 3)))

    class PreluNet(nn.Module):
        """A face-recognition backbone's shape (MobileFaceNet, MTCNN, MediaPipe's detectors):
        Conv+BatchNorm+PReLU (one slope per channel), depthwise-separable residual blocks with
        PReLU, a strided stem, a linear embedding and a classifier over it."""

        def __init__(self) -> None:
            super().__init__()

            def unit(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1) -> list[nn.Module]:
                return [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                        nn.BatchNorm2d(cout), nn.PReLU(cout)]

            class Residual(nn.Module):
                def __init__(self, ch: int) -> None:
                    super().__init__()
                    self.body = nn.Sequential(*unit(ch, 2 * ch, 1), *unit(2 * ch, 2 * ch, groups=2 * ch),
                                              nn.Conv2d(2 * ch, ch, 1, bias=False), nn.BatchNorm2d(ch))

                def forward(self, x: torch.Tensor) -> torch.Tensor:
                    return x + self.body(x)

            self.features = nn.Sequential(
                *unit(1, 32, stride=2), *unit(32, 32, groups=32), Residual(32),
                *unit(32, 64, stride=2), Residual(64), Residual(64),
                *unit(64, 128, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.embed = nn.Sequential(nn.Linear(128, 64), nn.BatchNorm1d(64))
            self.head = nn.Linear(64, 10)

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(self.features(image)))

    class GruStream(nn.Module):
        """Streaming frame classifier: one chunk of frames and the GRU state in, per-frame logits
        and the new state out."""

        def __init__(self, feat: int = 16, hidden: int = 64) -> None:
            super().__init__()
            self.hidden = hidden
            self.inp = nn.Sequential(nn.Linear(feat, 32), nn.ReLU())
            self.gru = nn.GRU(32, hidden, batch_first=True)
            self.out = nn.Linear(hidden, 10)

        def forward(self, frames: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y, new_state = self.gru(self.inp(frames), state)
            return self.out(y), new_state

    class VadStream(nn.Module):
        """Voice-activity-style detector: a 1-D conv front end over the frame features, an LSTM
        carrying (h, c) between chunks, and one sigmoid probability per frame."""

        def __init__(self, feat: int = 16, hidden: int = 32) -> None:
            super().__init__()
            self.hidden = hidden
            self.front = nn.Sequential(nn.Conv1d(feat, 32, 3, padding=1), nn.ReLU())
            self.lstm = nn.LSTM(32, hidden, batch_first=True)
            self.out = nn.Linear(hidden, 1)

        def forward(self, frames: torch.Tensor, h: torch.Tensor, c: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            x = self.front(frames.transpose(1, 2)).transpose(1, 2)
            y, (h1, c1) = self.lstm(x, (h, c))
            return torch.sigmoid(self.out(y)), h1, c1

    class Attention(nn.Module):
        """Multi-head self-attention written out (no fused kernel): q/k/v projections, scaled
        dot products, an additive mask, softmax, output projection."""

        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            b, n, d = x.shape
            qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
            if bias is not None:
                scores = scores + bias
            out = scores.softmax(-1) @ v
            return self.proj(out.transpose(1, 2).reshape(b, n, d))

    class Block(nn.Module):
        """Pre-LayerNorm transformer block: x + attn(LN(x)); x + MLP(LN(x))."""

        def __init__(self, dim: int, heads: int, mlp: int, gelu: str) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.attn = Attention(dim, heads)
            self.ln2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(approximate=gelu), nn.Linear(mlp, dim))

        def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            x = x + self.attn(self.ln1(x), bias)
            return x + self.mlp(self.ln2(x))

    class Encoder(nn.Module):
        """Token encoder with a padding mask (1 = token, 0 = padding) turned into an additive
        attention bias the way Hugging Face BERT does ((1 - mask) * finfo.min), exact (erf) GELU,
        and a masked mean pool: the output is the embedding. The classifier head is used for
        training only and is not exported."""

        def __init__(self, tokens: int = 16, feat: int = 16, dim: int = 64, depth: int = 2) -> None:
            super().__init__()
            self.embed = nn.Linear(feat, dim)
            self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
            self.blocks = nn.ModuleList([Block(dim, 4, 2 * dim, "none") for _ in range(depth)])
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, 10)

        def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens) + self.pos
            bias = (1.0 - mask)[:, None, None, :] * torch.finfo(torch.float32).min
            for blk in self.blocks:
                x = blk(x, bias)
            x = self.norm(x)
            m = mask[:, :, None]
            return (x * m).sum(1) / m.sum(1).clamp(min=1.0)

    class TinyViT(nn.Module):
        """ViT: 4x4 patch Conv, class token, learned position embeddings stored on a 5x5 grid and
        resized with bicubic interpolation to the input's patch grid at every forward (as timm's
        dynamic image size does), pre-LN blocks with tanh-approximated GELU, class-token head."""

        def __init__(self, patch: int = 4, dim: int = 64, depth: int = 2, pos_grid: int = 5) -> None:
            super().__init__()
            self.patch = patch
            self.patch_embed = nn.Conv2d(1, dim, patch, patch)
            self.cls = nn.Parameter(torch.zeros(1, 1, dim))
            self.cls_pos = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, dim, pos_grid, pos_grid) * 0.02)
            self.blocks = nn.ModuleList([Block(dim, 4, 2 * dim, "tanh") for _ in range(depth)])
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, 10)

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            x = self.patch_embed(image)  # [B, D, H/p, W/p]
            pos = F.interpolate(self.pos, size=(x.shape[2], x.shape[3]), mode="bicubic", align_corners=False)
            x = (x + pos).flatten(2).transpose(1, 2)
            cls = (self.cls + self.cls_pos).expand(x.shape[0], -1, -1)
            x = torch.cat([cls, x], dim=1)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x)[:, 0])

    return {"CnnBn": CnnBn, "DwSep": DwSep, "PreluNet": PreluNet, "GruStream": GruStream, "Encoder": Encoder, "TinyViT": TinyViT,
            "VadStream": VadStream}


# --------------------------------------------------------------------------------------------
# training


def train(model: Any, loss_fn: Any, arrays: list[np.ndarray], epochs: int, lr: float, batch: int = 64,
          weight_decay: float = 0.0) -> None:
    """Adam with a cosine schedule over ``epochs``; ``loss_fn(model, *batch_tensors)``."""
    import torch

    n = len(arrays[0])
    steps = epochs * ((n + batch - 1) // batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15)
    rng = np.random.default_rng(SEED + 1)
    tensors = [torch.from_numpy(a) for a in arrays]
    model.train()
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(n))
        for i in range(0, n, batch):
            idx = order[i:i + batch]
            loss = loss_fn(model, *(t[idx] for t in tensors))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    model.eval()


def _ce(logits: Any, labels: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits, labels)


# --------------------------------------------------------------------------------------------
# model builders: each returns a dict describing what to export


def build_image_classifier(name: str, cls_name: str, size: int, epochs: int, lr: float,
                           family: str, exporter: str, split: dict) -> dict:
    import torch

    models = _torch_models()
    torch.manual_seed(SEED)
    model = models[cls_name]()
    xs = {k: upsample(v[0], size) for k, v in split.items()}
    ys = {k: v[1] for k, v in split.items()}
    train(model, lambda m, x, y: _ce(m(x), y), [xs["train"], ys["train"]], epochs, lr, weight_decay=1e-4)
    with torch.no_grad():
        logits = model(torch.from_numpy(xs["eval"])).numpy()
    acc = float((logits.argmax(1) == ys["eval"]).mean())
    return {
        "name": name, "family": family, "exporter": exporter, "metric": "top1", "model": model,
        "inputs": ["image"], "outputs": ["logits"],
        "calib": {"image": xs["calib"]}, "eval": {"image": xs["eval"]}, "labels": ys["eval"],
        "export_args": (torch.from_numpy(xs["calib"][:2]),),
        "dynamic": {"image": {0: "batch"}},
        "accuracy": {"top1": acc},
        "description": f"{cls_name} on load_digits upsampled to {size}x{size}, {epochs} epochs",
    }


def build_vit(split: dict, exporter: str) -> dict:
    d = build_image_classifier("torch_vit", "TinyViT", 28, 12, 3e-3, "vit", exporter, split)
    # height and width are dynamic too, so the position-embedding Resize stays in the graph
    d["dynamic"] = {"image": {0: "batch", 2: "height", 3: "width"}}
    d["description"] += "; position embeddings 5x5 -> 7x7 bicubic at run time"
    return d


def build_gru(split: dict, exporter: str) -> dict:
    """Images at 16x16: 16 rows = 16 frames of 16 features; streamed as two chunks of 8 frames.

    Trained on whole 16-frame sequences with every frame labelled with the digit (later frames
    weigh more). Calibration and evaluation samples are chunks: the first half of an image with a
    zero state, and the second half with the state torch's float model left after the first half,
    as a streaming runtime would feed them. 32 + 100 images give 64 + 200 chunks.
    """
    import torch
    import torch.nn.functional as F

    models = _torch_models()
    torch.manual_seed(SEED)
    model = models["GruStream"]()
    seq = {k: upsample(v[0], 16)[:, 0] for k, v in split.items()}  # [N, 16 frames, 16 features]
    ys = {k: v[1] for k, v in split.items()}
    weights = torch.linspace(0.2, 1.0, 16)

    def loss_fn(m: Any, x: Any, y: Any) -> Any:
        h0 = torch.zeros(1, x.shape[0], m.hidden)
        logits, _ = m(x, h0)  # [B, T, 10]
        per = F.cross_entropy(logits.reshape(-1, 10), y.repeat_interleave(16), reduction="none")
        return (per.reshape(-1, 16) * weights).mean()

    train(model, loss_fn, [seq["train"], ys["train"]], 20, 1e-2)

    def chunks(x: np.ndarray) -> dict[str, np.ndarray]:
        with torch.no_grad():
            t = torch.from_numpy(x)
            h0 = torch.zeros(1, len(x), model.hidden)
            _, h1 = model(t[:, :8], h0)
        frames = np.stack([x[:, :8], x[:, 8:]], 1).reshape(-1, 8, 16)  # image i -> rows 2i, 2i+1
        state = np.stack([h0.numpy()[0], h1.numpy()[0]], 1).reshape(-1, model.hidden)
        return {"frames": frames.astype(np.float32), "state": state[None].transpose(1, 0, 2).astype(np.float32)}

    calib = chunks(seq["calib"][: N_CALIB // 2])
    ev = chunks(seq["eval"][: N_EVAL // 2])
    with torch.no_grad():
        logits, _ = model(torch.from_numpy(seq["eval"]), torch.zeros(1, N_EVAL, model.hidden))
    pred = logits.numpy().argmax(-1)
    last = float((pred[:, -1] == ys["eval"]).mean())
    frames = float((pred == ys["eval"][:, None]).mean())
    return {
        "name": "torch_gru_stream", "family": "rnn-streaming", "exporter": exporter, "metric": "frames",
        "model": model, "inputs": ["frames", "state"], "outputs": ["logits", "state_out"],
        "calib": calib, "eval": ev, "labels": None,
        # state is [num_layers=1, batch, hidden]; samples are stacked on axis 0 of the .npz, so the
        # stored array is [N, 1, hidden] = one [1, 1, hidden] state per sample (batch dimension 1)
        "export_args": (torch.from_numpy(calib["frames"][:1]), torch.from_numpy(calib["state"][:1].transpose(1, 0, 2))),
        "dynamic": None,
        "accuracy": {"last_frame_top1": last, "frame_top1": frames},
        "description": "Linear+ReLU -> GRU(32, 64) -> Linear per frame; 8-frame chunks of 16x16 digit rows with carried state",
        "npz_layout_note": "state: npz [N, 1, 64] stacked per sample; model input [1, 1, 64] (num_layers, batch, hidden)",
    }


def build_vad(split: dict, exporter: str) -> dict:
    """Rows of 16x16 digits as 16 frames of 16 features; a frame is "active" when its ink passes
    the median row ink (the activity a detector flags). Streamed as two chunks of 8 frames with the
    LSTM state carried, as in `build_gru`; the output is one sigmoid probability per frame."""
    import torch
    import torch.nn.functional as F

    models = _torch_models()
    torch.manual_seed(SEED)
    model = models["VadStream"]()
    seq = {k: upsample(v[0], 16)[:, 0] for k, v in split.items()}  # [N, 16 frames, 16 features]
    threshold = float(np.median(seq["train"].sum(-1)))
    active = {k: (v.sum(-1) > threshold).astype(np.float32) for k, v in seq.items()}

    def zeros(n: int) -> tuple[Any, Any]:
        return torch.zeros(1, n, model.hidden), torch.zeros(1, n, model.hidden)

    def loss_fn(m: Any, x: Any, y: Any) -> Any:
        p, _, _ = m(x, *zeros(x.shape[0]))
        return F.binary_cross_entropy(p[..., 0], y)

    train(model, loss_fn, [seq["train"], active["train"]], 20, 1e-2)

    def chunks(x: np.ndarray) -> dict[str, np.ndarray]:
        with torch.no_grad():
            h0, c0 = zeros(len(x))
            _, h1, c1 = model(torch.from_numpy(x[:, :8]), h0, c0)
        frames = np.stack([x[:, :8], x[:, 8:]], 1).reshape(-1, 8, 16)
        h = np.stack([h0.numpy()[0], h1.numpy()[0]], 1).reshape(-1, model.hidden)
        c = np.stack([c0.numpy()[0], c1.numpy()[0]], 1).reshape(-1, model.hidden)
        return {"frames": frames.astype(np.float32), "h": h[None].transpose(1, 0, 2).astype(np.float32),
                "c": c[None].transpose(1, 0, 2).astype(np.float32)}

    calib = chunks(seq["calib"][: N_CALIB // 2])
    ev = chunks(seq["eval"][: N_EVAL // 2])
    with torch.no_grad():
        p, _, _ = model(torch.from_numpy(seq["eval"]), *zeros(N_EVAL))
    frames = float(((p.numpy()[..., 0] > 0.5) == (active["eval"] > 0.5)).mean())
    return {
        "name": "torch_vad", "family": "vad-streaming", "exporter": exporter, "metric": "decisions",
        "model": model, "inputs": ["frames", "h", "c"], "outputs": ["speech_prob", "h_out", "c_out"],
        "calib": calib, "eval": ev, "labels": None,
        "export_args": (torch.from_numpy(calib["frames"][:1]),
                        torch.from_numpy(calib["h"][:1].transpose(1, 0, 2)),
                        torch.from_numpy(calib["c"][:1].transpose(1, 0, 2))),
        "dynamic": None,
        "accuracy": {"frame_decisions": frames},
        "description": "Conv1d+ReLU -> LSTM(32, 32) -> Linear -> sigmoid per frame; 8-frame chunks "
                       "of 16x16 digit rows (active: row ink above the median) with carried state",
        "npz_layout_note": "h, c: npz [N, 1, 32] stacked per sample; model input [1, 1, 32]",
    }


def build_encoder(split: dict, exporter: str) -> dict:
    """16x16 images cut into 16 patches of 4x4 (16 features) as tokens, in raster order; each
    sample keeps a seeded number (9-16) of leading tokens, the rest is padding (zeros, mask 0)."""
    import torch
    import torch.nn.functional as F

    models = _torch_models()
    torch.manual_seed(SEED)
    model = models["Encoder"]()
    rng = np.random.default_rng(SEED + 2)

    def tokens(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = upsample(images, 16)[:, 0]  # [N, 16, 16]
        t = x.reshape(-1, 4, 4, 4, 4).transpose(0, 1, 3, 2, 4).reshape(-1, 16, 16)
        lengths = rng.integers(9, 17, size=len(x))
        mask = (np.arange(16)[None] < lengths[:, None]).astype(np.float32)
        return (t * mask[:, :, None]).astype(np.float32), mask

    data = {k: tokens(v[0]) for k, v in split.items()}
    ys = {k: v[1] for k, v in split.items()}

    def loss_fn(m: Any, t: Any, mask: Any, y: Any) -> Any:
        return F.cross_entropy(m.head(m(t, mask)), y)

    train(model, loss_fn, [data["train"][0], data["train"][1], ys["train"]], 20, 2e-3, weight_decay=1e-4)
    with torch.no_grad():
        emb = model(torch.from_numpy(data["eval"][0]), torch.from_numpy(data["eval"][1]))
        acc = float((model.head(emb).numpy().argmax(1) == ys["eval"]).mean())
    return {
        "name": "torch_encoder", "family": "transformer-encoder", "exporter": exporter, "metric": "cosine",
        "model": model, "inputs": ["tokens", "mask"], "outputs": ["embedding"],
        "calib": {"tokens": data["calib"][0], "mask": data["calib"][1]},
        "eval": {"tokens": data["eval"][0], "mask": data["eval"][1]}, "labels": None,
        "export_args": (torch.from_numpy(data["calib"][0][:2]), torch.from_numpy(data["calib"][1][:2])),
        "dynamic": {"tokens": {0: "batch"}, "mask": {0: "batch"}},
        "accuracy": {"head_top1": acc},
        "description": "2 pre-LN blocks, 4 heads, dim 64, erf GELU, padding mask -> finfo.min bias, masked mean pool; "
                       "digit head (training only) reported as head_top1",
    }


def build(name: str, split: dict) -> dict:
    if name == "torch_cnn_bn":
        return build_image_classifier(name, "CnnBn", 28, 5, 3e-3, "cnn", "torchscript", split)
    if name == "torch_dwsep":
        spec = build_image_classifier(name, "DwSep", 32, 6, 5e-3, "mobilenet", "dynamo", split)
        # the dynamo exporter writes opset 18; converting down to 17 fails on ReduceMean (axes
        # input -> attribute), so this one stays at 18
        spec["opset"] = 18
        spec["notes"] = ("opset 18: the dynamo exporter's down-conversion to 17 fails on ReduceMean "
                         "(axes input -> attribute)")
        return spec
    if name == "torch_prelu":
        return build_image_classifier(name, "PreluNet", 48, 6, 3e-3, "prelu cnn", "torchscript",
                                      split)
    if name == "torch_gru_stream":
        return build_gru(split, "torchscript")
    if name == "torch_vad":
        return build_vad(split, "torchscript")
    if name == "torch_encoder":
        return build_encoder(split, "dynamo")
    if name == "torch_vit":
        return build_vit(split, "dynamo")
    if name == "torch_minilm":  # pretrained; the digits split is not used
        return minilm.build_minilm("torchscript")
    raise ValueError(name)


# --------------------------------------------------------------------------------------------
# export


def export(spec: dict, path: Path) -> tuple[str, str | None]:
    """Export with the spec's exporter; fall back to TorchScript if dynamo fails.
    Returns (exporter used, reason for a fallback or None)."""
    import torch

    model, args = spec["model"], spec["export_args"]
    names = {"input_names": spec["inputs"], "output_names": spec["outputs"]}
    if spec["exporter"] == "dynamo":
        try:
            dyn = None
            if spec["dynamic"]:
                dims: dict[str, Any] = {}  # one torch.export.Dim per label, shared between inputs
                dyn = {}
                for inp, axes in spec["dynamic"].items():
                    dyn[inp] = {ax: dims.setdefault(label, torch.export.Dim(label)) for ax, label in axes.items()}
            with torch.no_grad():
                prog = torch.onnx.export(model, args, dynamo=True, opset_version=spec.get("opset", OPSET),
                                         dynamic_shapes=dyn, external_data=False, verbose=False, **names)
            prog.save(str(path), external_data=False)
            strip_stack_traces(path)
            return "dynamo", None
        except Exception as err:  # noqa: BLE001 - any exporter failure means: use the old exporter
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            print(f"  dynamo export failed ({reason}); falling back to TorchScript", flush=True)
            fallback: str | None = reason
    else:
        fallback = None
    with torch.no_grad():
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=spec.get("opset", OPSET),
                          dynamic_axes=spec["dynamic"], do_constant_folding=True, **names)
    return "torchscript", fallback


def strip_stack_traces(path: Path) -> None:
    """Drop the dynamo exporter's per-node Python stack traces (absolute paths and line numbers of
    this machine: the bytes would change with every edit of this file); its other metadata stays."""
    import onnx

    m = onnx.load(str(path))
    for node in m.graph.node:
        keep = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        del node.metadata_props[:]
        node.metadata_props.extend(keep)
    onnx.save(m, str(path))


def torch_outputs(spec: dict) -> dict[str, np.ndarray]:
    """Torch's outputs on every eval sample, one at a time (batch 1), stacked on axis 0."""
    import torch

    model = spec["model"]
    n = len(next(iter(spec["eval"].values())))
    outs: dict[str, list[np.ndarray]] = {o: [] for o in spec["outputs"]}
    with torch.no_grad():
        for i in range(n):
            args = [torch.from_numpy(spec["eval"][k][i:i + 1]) for k in spec["inputs"]]
            res = model(*args)
            res = res if isinstance(res, tuple) else (res,)
            for o, r in zip(spec["outputs"], res):
                outs[o].append(r.numpy())
    # every output has a leading dimension of 1 per sample (GRU state: num_layers = 1)
    return {o: np.concatenate(v, 0) for o, v in outs.items()}


def versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("torch", "onnx", "onnxscript", "numpy", "scikit-learn")}


def write_model(spec: dict, out: Path) -> dict:
    """Export `spec`'s model, then write it as every builder does (`_export_common.write_model`),
    with which exporter ran (dynamo or TorchScript, and why it fell back) in task.json."""
    d = out / spec["name"]
    d.mkdir(parents=True, exist_ok=True)
    model_path = d / "model.onnx"
    requested = spec["exporter"]
    used, fallback = export(spec, model_path)
    if (d / "torch_outputs.npz").exists():  # the name of earlier builds
        (d / "torch_outputs.npz").unlink()
    task = common.write_model({
        **spec, "reference": torch_outputs(spec),
        "versions": {**versions(), **spec.get("versions_extra", {})},
        "exporter": f"torch.onnx.export(dynamo={used == 'dynamo'})",
        "task_extra": {**spec.get("task_extra", {}), "exporter_kind": used,
                       "exporter_requested": requested, "exporter_fallback_reason": fallback},
    }, out)
    return {"task": task, "summary": common.onnx_summary(model_path)}


# --------------------------------------------------------------------------------------------
# onnxruntime check (numpy + onnxruntime only)


# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder [default: {DEFAULT_OUT}]")
    ap.add_argument("--models", default=",".join(ALL_MODELS), help="comma-separated subset of " + ",".join(ALL_MODELS))
    ap.add_argument("--check", action="store_true", help="only check existing exports in onnxruntime")
    ap.add_argument("--no-check", action="store_true", help="skip the onnxruntime check")
    ap.add_argument("--ort-python", help="interpreter with onnxruntime for the check")
    ap.add_argument("--threads", type=int, default=THREADS, help=f"torch threads [default: {THREADS}]")
    args = ap.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in ALL_MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(ALL_MODELS)}")
    if args.check:
        return common.check(args.out, names)

    import warnings

    import torch

    # the legacy exporter's "use dynamo instead" notice, once per TorchScript export
    warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
    # the GRU's initial state is a model input, which is what this warning asks for
    warnings.filterwarnings("ignore", message=".*batch_size other than 1, with a variable length with GRU.*")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    split = common.digits_split()
    print(f"torch {torch.__version__}, {args.threads} threads, digits split "
          + ", ".join(f"{k} {len(v[1])}" for k, v in split.items()), flush=True)
    t_all = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        spec = build(name, split)
        t_train = time.perf_counter() - t0
        info = write_model(spec, args.out)
        acc = ", ".join(f"{k} {v:.3f}" for k, v in spec["accuracy"].items())
        print(f"{name}: float eval {acc} | exporter {info['task']['exporter_kind']}"
              f"{' (fallback)' if info['task']['exporter_fallback_reason'] else ''} | opset "
              f"{info['summary']['opset']} | {info['summary']['nodes']} nodes | train {t_train:.1f}s, "
              f"total {time.perf_counter() - t0:.1f}s", flush=True)
        print(f"  ops: {info['summary']['op_types']}", flush=True)
        if info["summary"]["resize_modes"]:
            print(f"  Resize modes: {info['summary']['resize_modes']}", flush=True)
    print(f"built {len(names)} model(s) in {time.perf_counter() - t_all:.1f}s -> {args.out}", flush=True)
    if args.no_check:
        return 0
    return common.run_check(args.out, names, args.ort_python)


if __name__ == "__main__":
    sys.exit(main())
