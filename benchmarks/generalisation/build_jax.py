"""Build the JAX (jax2tf + tf2onnx) models of the generalisation benchmark.

``jax_mixer``: an MLP-Mixer with one self-attention block, written in plain JAX (no flax/optax:
the parameters are a dict of arrays, Adam is written out), trained briefly on scikit-learn's
bundled ``load_digits`` (split as in ``_export_common.py``) and written to ``<out>/jax_mixer/``.

- input ``image`` [batch, 16, 16, 1] (NHWC, the digits upsampled), cut into 16 patches of 4x4
  by reshape/transpose, a linear patch embedding to 48 channels;
- 2 mixer blocks (token-mixing MLP over the 16 patches, channel-mixing MLP 48 -> 96 -> 48);
- 1 pre-norm self-attention block, 4 heads of 12, softmax written out as
  ``exp(s - max s) / sum exp(s - max s)``;
- final LayerNorm, mean over tokens, linear head to 10 logits (output ``logits``).

LayerNorm is written by hand the way a lot of JAX code has it: ``var = max(E[x^2] - E[x]^2, 0)``,
``(x - E[x]) * rsqrt(var + eps) * scale + bias``. GELU is the tanh approximation, written out.

Export: ``jax.experimental.jax2tf.convert(..., native_serialization=False, enable_xla=False,
polymorphic_shapes=["(b, 16, 16, 1)"])`` (plain TF ops, not an XlaCallModule, which tf2onnx
cannot convert), wrapped in a ``tf.function`` with a fixed input signature, then
``tf2onnx.convert.from_function``. The trained parameters are closed over and become ONNX
initializers.

Run with the TensorFlow environment (see ``requirements-tf.txt``)::

    benchmarks/.cache/venv-tf/bin/python benchmarks/generalisation/build_jax.py
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _export_common as common

common.pin_threads(2)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

OPSET = 15
SIZE = 16
PATCH = 4
DIM = 48
TOKEN_HIDDEN = 32
CHANNEL_HIDDEN = 96
HEADS = 4
N_MIXER = 2
EPOCHS = 12
BATCH = 64
LR = 3e-3
EPS = 1e-6
ALL_MODELS = ("jax_mixer",)


def init_params(key) -> dict:
    import jax
    import jax.numpy as jnp

    n_tok = (SIZE // PATCH) ** 2
    keys = iter(jax.random.split(key, 64))

    def dense(i: int, o: int) -> dict:
        lim = math.sqrt(6.0 / (i + o))  # Glorot uniform
        return {
            "w": jax.random.uniform(next(keys), (i, o), jnp.float32, -lim, lim),
            "b": jnp.zeros((o,), jnp.float32),
        }

    def ln(d: int) -> dict:
        return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}

    p = {
        "embed": dense(PATCH * PATCH, DIM),
        "mixers": [],
        "final_ln": ln(DIM),
        "head": dense(DIM, 10),
    }
    for _ in range(N_MIXER):
        p["mixers"].append(
            {
                "ln1": ln(DIM),
                "tok1": dense(n_tok, TOKEN_HIDDEN),
                "tok2": dense(TOKEN_HIDDEN, n_tok),
                "ln2": ln(DIM),
                "ch1": dense(DIM, CHANNEL_HIDDEN),
                "ch2": dense(CHANNEL_HIDDEN, DIM),
            }
        )
    p["attn"] = {"ln": ln(DIM), "qkv": dense(DIM, 3 * DIM), "proj": dense(DIM, DIM)}
    p["head"]["w"] = p["head"]["w"] * 0.1
    return p


def forward(p: dict, image):
    """image [b, 16, 16, 1] -> logits [b, 10]."""
    import jax
    import jax.numpy as jnp

    def layer_norm(x, q):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        mean_sq = jnp.mean(x * x, axis=-1, keepdims=True)
        var = jnp.maximum(mean_sq - mean * mean, 0.0)
        return (x - mean) * jax.lax.rsqrt(var + EPS) * q["scale"] + q["bias"]

    def gelu(x):
        return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))

    def dense(x, q):
        return x @ q["w"] + q["b"]

    b = image.shape[0]
    g = SIZE // PATCH
    x = image.reshape(b, g, PATCH, g, PATCH)
    x = x.transpose(0, 1, 3, 2, 4).reshape(b, g * g, PATCH * PATCH)
    x = dense(x, p["embed"])  # [b, tokens, dim]
    for m in p["mixers"]:
        y = layer_norm(x, m["ln1"]).transpose(0, 2, 1)  # [b, dim, tokens]
        y = dense(gelu(dense(y, m["tok1"])), m["tok2"]).transpose(0, 2, 1)
        x = x + y
        y = layer_norm(x, m["ln2"])
        x = x + dense(gelu(dense(y, m["ch1"])), m["ch2"])
    a = p["attn"]
    n = x.shape[1]
    hd = DIM // HEADS
    qkv = (
        dense(layer_norm(x, a["ln"]), a["qkv"]).reshape(b, n, 3, HEADS, hd).transpose(2, 0, 3, 1, 4)
    )
    q, k, v = qkv[0], qkv[1], qkv[2]  # [b, heads, n, hd]
    s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hd))
    e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
    attn = e / jnp.sum(e, axis=-1, keepdims=True)
    o = (attn @ v).transpose(0, 2, 1, 3).reshape(b, n, DIM)
    x = x + dense(o, a["proj"])
    x = layer_norm(x, p["final_ln"])
    return dense(jnp.mean(x, axis=1), p["head"])


def train(split: dict) -> tuple[dict, dict]:
    import jax
    import jax.numpy as jnp

    xs = {k: common.upsample(v[0], SIZE)[..., None] for k, v in split.items()}
    ys = {k: v[1] for k, v in split.items()}
    params = init_params(jax.random.PRNGKey(common.SEED))

    def loss_fn(p, x, y):
        logits = forward(p, x)
        logp = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    b1, b2, adam_eps = 0.9, 0.999, 1e-8

    @jax.jit
    def step(p, m, v, t, x, y, lr):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        m = jax.tree_util.tree_map(lambda a, b: b1 * a + (1 - b1) * b, m, g)
        v = jax.tree_util.tree_map(lambda a, b: b2 * a + (1 - b2) * b * b, v, g)
        mh = jax.tree_util.tree_map(lambda a: a / (1 - b1**t), m)
        vh = jax.tree_util.tree_map(lambda a: a / (1 - b2**t), v)
        p = jax.tree_util.tree_map(lambda a, c, d: a - lr * c / (jnp.sqrt(d) + adam_eps), p, mh, vh)
        return p, m, v, loss

    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    rng = np.random.default_rng(common.SEED)
    n = len(xs["train"])
    steps_per_epoch = n // BATCH
    total = EPOCHS * steps_per_epoch
    t = 0
    for _ in range(EPOCHS):
        order = rng.permutation(n)
        for i in range(steps_per_epoch):
            idx = order[i * BATCH : (i + 1) * BATCH]
            t += 1
            lr = LR * 0.5 * (1 + math.cos(math.pi * (t - 1) / total))  # cosine decay
            params, m, v, _loss = step(
                params, m, v, jnp.float32(t), xs["train"][idx], ys["train"][idx], jnp.float32(lr)
            )
    params = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), params)
    logits = np.asarray(jax.jit(forward)(params, xs["eval"]))
    acc = float((logits.argmax(1) == ys["eval"]).mean())
    spec = {
        "name": "jax_mixer",
        "family": "mlp-mixer+attention",
        "metric": "top1",
        "calib": {"image": xs["calib"]},
        "eval": {"image": xs["eval"]},
        "labels": ys["eval"],
        "accuracy": {"top1": acc},
        "description": f"plain-JAX MLP-Mixer ({N_MIXER} mixer blocks, dim {DIM}, 4x4 patches of 16x16 NHWC) + one "
        f"{HEADS}-head self-attention block; hand-written LayerNorm (max(E[x^2]-E[x]^2,0), rsqrt), "
        f"tanh GELU, exp/sum/div softmax; {EPOCHS} epochs Adam",
    }
    return params, spec


def export(params: dict, spec: dict, out: Path) -> dict:
    import jax
    import tensorflow as tf
    import tf2onnx
    from jax.experimental import jax2tf

    d = out / spec["name"]
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    kwargs = {
        "polymorphic_shapes": [f"(b, {SIZE}, {SIZE}, 1)"]
    }  # with_gradient=False adds PreventGradient, which tf2onnx lacks
    import inspect

    sig = inspect.signature(jax2tf.convert).parameters
    if "enable_xla" in sig:
        kwargs["enable_xla"] = False
    if "native_serialization" in sig:
        kwargs["native_serialization"] = False
    tf_forward = jax2tf.convert(lambda image: {"logits": forward(params, image)}, **kwargs)
    signature = [tf.TensorSpec((None, SIZE, SIZE, 1), tf.float32, name="image")]
    fn = tf.function(tf_forward, input_signature=signature, autograph=False)
    tf_logits = fn(tf.constant(spec["eval"]["image"]))["logits"].numpy()
    jax_logits = np.asarray(jax.jit(forward)(params, spec["eval"]["image"]))
    print(
        f"  jax vs tf (jax2tf) max |diff| = {np.abs(tf_logits - jax_logits).max():.2e}", flush=True
    )
    tf2onnx.convert.from_function(fn, input_signature=signature, opset=OPSET, output_path=str(path))
    import onnx

    outs = [o.name for o in onnx.load(str(path)).graph.output]
    if len(outs) != 1:
        raise SystemExit(f"expected one ONNX output, got {outs}")
    spec["reference"] = {outs[0]: jax_logits}
    spec["exporter"] = (
        "jax2tf.convert(native_serialization=False, enable_xla=False) + tf2onnx.convert.from_function"
    )
    spec["versions"] = {
        "jax": jax.__version__,
        "tensorflow": tf.__version__,
        "tf2onnx": tf2onnx.__version__,
        "jax2tf_kwargs": {k: v for k, v in kwargs.items()},
    }
    return common.write_model(spec, out)


def main() -> int:
    return common.builder_main(__doc__ or "", list(ALL_MODELS), lambda name, split: train(split), export)


if __name__ == "__main__":
    sys.exit(main())
