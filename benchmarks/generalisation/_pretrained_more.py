"""Two more pretrained models from other projects' wheels (see build_pretrained.py).

pretrained_filetype: magika 1.0.3's content-type classifier (``standard_v3_3``, a Keras model
exported for onnxruntime: LayerNorm and softmax spelled out), on the byte features magika reads
(the first and last 1024 bytes of a file, whitespace stripped, padded with 256) of files written
here in 24 formats (source code, markup, data, Pillow images, archives, random bytes). Metric:
top-1 agreement.

pretrained_vad: silero-vad 6.2.3's streaming voice-activity model (``silero_vad.onnx``: an If
chooses the 16 or 8 kHz path, STFT as a Conv, an LSTM cell, a sigmoid averaged over the chunk).
Speech is synthesised with Debian's espeak-ng (several voices, pauses, background noise) and
streamed in chunks of 512 samples at 16 kHz with silero's 64-sample context; each sample holds
the chunk and the state the float model carried into it, so the quantized model is judged
chunk by chunk from the same state. Metric: decisions (speech probability > 0.5).
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import shutil
import subprocess
import tarfile
import time
import wave
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

MAGIKA = ("magika", "1.0.3", "magika/models/standard_v3_3/model.onnx")
SILERO = ("silero-vad", "6.2.3", "silero_vad/data/silero_vad.onnx")
FILETYPE_CALIB, FILETYPE_EVAL = 64, 200
WORDS = ("data", "model", "value", "result", "table", "index", "count", "name", "file", "path",
         "error", "user", "time", "list", "item", "state", "input", "output", "config", "layer")
SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Calibration data streams through the model while observers collect statistics.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "Voice activity detection decides which frames contain speech and which are silence.",
    "Six spoons of fresh snow peas, five thick slabs of blue cheese, and maybe a snack.",
    "A large fawn jumped quickly over white zinc boxes in the morning light.",
    "We measured the error of every layer and kept the worst ones in floating point.",
)
_EPOCH = time.gmtime(1577836800)  # 2020-01-01
VOICES = ("en", "en-us", "en+f3", "en-gb", "en+m3", "en-us+f2")


def _words(rng: np.random.Generator, n: int) -> list[str]:
    return [str(w) for w in rng.choice(WORDS, n)]


def _image(rng: np.random.Generator, fmt: str) -> bytes:
    from PIL import Image

    h, w = int(rng.integers(16, 96)), int(rng.integers(16, 96))
    pixels = (rng.random((h, w, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    # a PDF states when it was made: a fixed date keeps the data the same from build to build
    dated = {"creationDate": _EPOCH, "modDate": _EPOCH} if fmt == "PDF" else {}
    Image.fromarray(pixels).save(buffer, format=fmt, **dated)
    return buffer.getvalue()


def _text_formats() -> dict[str, Callable[[np.random.Generator], str]]:
    def python(rng: np.random.Generator) -> str:
        a, b, c = _words(rng, 3)
        return (f"import os\nimport sys\n\n\ndef {a}_{b}({c}):\n    \"\"\"Return the {a}.\"\"\"\n"
                f"    for item in {c}:\n        if item > {rng.integers(99)}:\n"
                f"            return item\n    return None\n\n\nclass {a.title()}:\n"
                f"    def __init__(self):\n        self.{b} = []\n")

    def c_source(rng: np.random.Generator) -> str:
        a, b = _words(rng, 2)
        return (f"#include <stdio.h>\n#include <stdlib.h>\n\nstatic int {a}(int {b}) {{\n"
                f"    return {b} * {rng.integers(9)};\n}}\n\nint main(void) {{\n"
                f"    printf(\"%d\\n\", {a}({rng.integers(99)}));\n    return 0;\n}}\n")

    def javascript(rng: np.random.Generator) -> str:
        a, b = _words(rng, 2)
        return (f"const {a} = require('{b}');\n\nfunction {b}Of(x) {{\n  return x.map((v) => "
                f"v * {rng.integers(9)});\n}}\n\nmodule.exports = {{ {b}Of }};\n")

    def html(rng: np.random.Generator) -> str:
        body = "".join(f"<p>{' '.join(_words(rng, 8))}</p>\n" for _ in range(int(rng.integers(2, 6))))
        return (f"<!DOCTYPE html>\n<html>\n<head><title>{' '.join(_words(rng, 3))}</title></head>"
                f"\n<body>\n{body}</body>\n</html>\n")

    def xml(rng: np.random.Generator) -> str:
        items = "".join(f"  <{w} id=\"{i}\">{rng.integers(999)}</{w}>\n"
                        for i, w in enumerate(_words(rng, 6)))
        return f"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<root>\n{items}</root>\n"

    def json_text(rng: np.random.Generator) -> str:
        return json.dumps({w: [int(v) for v in rng.integers(0, 999, 3)] for w in _words(rng, 6)},
                          indent=2)

    def csv_text(rng: np.random.Generator) -> str:
        rows = [",".join(_words(rng, 4))]
        rows += [",".join(f"{v:.3f}" for v in rng.random(4)) for _ in range(20)]
        return "\n".join(rows) + "\n"

    def markdown(rng: np.random.Generator) -> str:
        return (f"# {' '.join(_words(rng, 3)).title()}\n\n{' '.join(_words(rng, 20))}.\n\n"
                f"## {' '.join(_words(rng, 2))}\n\n- {' '.join(_words(rng, 5))}\n"
                f"- {' '.join(_words(rng, 5))}\n\n```\n{' '.join(_words(rng, 4))}\n```\n")

    def shell(rng: np.random.Generator) -> str:
        a, b = _words(rng, 2)
        return (f"#!/bin/sh\nset -e\n{a.upper()}=\"${{1:-{b}}}\"\nfor f in *.{b}; do\n"
                f"  echo \"$f\" >> \"${a.upper()}.log\"\ndone\n")

    def ini(rng: np.random.Generator) -> str:
        return "".join(f"[{w}]\n{v} = {rng.integers(99)}\n\n"
                       for w, v in zip(_words(rng, 4), _words(rng, 4)))

    def yaml(rng: np.random.Generator) -> str:
        return "".join(f"{w}:\n  - {v}\n  - {rng.integers(99)}\n"
                       for w, v in zip(_words(rng, 5), _words(rng, 5)))

    def sql(rng: np.random.Generator) -> str:
        a, b, c = _words(rng, 3)
        return (f"CREATE TABLE {a} (\n  id INTEGER PRIMARY KEY,\n  {b} TEXT NOT NULL\n);\n"
                f"INSERT INTO {a} ({b}) VALUES ('{c}');\nSELECT {b} FROM {a} WHERE id > "
                f"{rng.integers(9)};\n")

    def css(rng: np.random.Generator) -> str:
        return "".join(f".{w} {{\n  margin: {rng.integers(9)}px;\n  color: #{rng.integers(4096):03x};"
                       "\n}\n" for w in _words(rng, 4))

    def prose(rng: np.random.Generator) -> str:
        return " ".join(_words(rng, 80)).capitalize() + ".\n"

    return {"python": python, "c": c_source, "javascript": javascript, "html": html, "xml": xml,
            "json": json_text, "csv": csv_text, "markdown": markdown, "shell": shell, "ini": ini,
            "yaml": yaml, "sql": sql, "css": css, "text": prose}


def _binary_formats() -> dict[str, Callable[[np.random.Generator], bytes]]:
    text = _text_formats()

    def archive(kind: str) -> Callable[[np.random.Generator], bytes]:
        def make(rng: np.random.Generator) -> bytes:
            payload = text["text"](rng).encode() * 4
            if kind == "gzip":
                return gzip.compress(payload, mtime=0)
            if kind == "bzip":
                return bz2.compress(payload)
            buffer = io.BytesIO()
            if kind == "zip":
                with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
                    z.writestr(zipfile.ZipInfo("a.txt", date_time=(2020, 1, 1, 0, 0, 0)),
                               payload)
            else:
                with tarfile.open(fileobj=buffer, mode="w") as t:
                    info = tarfile.TarInfo("a.txt")
                    info.size = len(payload)
                    t.addfile(info, io.BytesIO(payload))
            return buffer.getvalue()
        return make

    formats: dict[str, Callable[[np.random.Generator], bytes]] = {
        fmt.lower(): partial(_image, fmt=fmt)
        for fmt in ("PNG", "JPEG", "GIF", "BMP", "TIFF", "PDF")}
    formats.update({kind: archive(kind) for kind in ("gzip", "bzip", "zip", "tar")})
    formats["random"] = lambda rng: rng.integers(0, 256, int(rng.integers(500, 5000)),
                                                  dtype=np.uint8).tobytes()
    return formats


def _encoded(make: Callable[[np.random.Generator], str], rng: np.random.Generator) -> bytes:
    return make(rng).encode()


def magika_features(content: bytes) -> np.ndarray:
    """magika's input for one file: first and last 1024 bytes of the (4096-byte) blocks at either
    end, whitespace stripped, padded with 256."""
    begin = content[:4096].lstrip()[:1024]
    end = content[-4096:].rstrip()[-1024:]
    values = [*begin, *[256] * (1024 - len(begin)), *[256] * (1024 - len(end)), *end]
    return np.array(values, np.int32)


def filetype_features(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, 2048] features of files of formats taken in turn, each written afresh."""
    makers: list[Callable[[np.random.Generator], bytes]] = [
        partial(_encoded, make) for make in _text_formats().values()]
    makers += list(_binary_formats().values())
    return np.stack([magika_features(makers[i % len(makers)](rng)) for i in range(n)])


def speech(text: str, voice: str) -> np.ndarray:
    """`text` spoken by espeak-ng, float32 at 16 kHz."""
    if shutil.which("espeak-ng") is None:
        raise SystemExit("pretrained_vad needs espeak-ng (Debian: apt-get install espeak-ng)")
    wav = subprocess.run(["espeak-ng", "-v", voice, "-s", "150", "--stdout", text],
                         capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(wav)) as w:
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
    n = int(len(x) * 16000 / rate)
    return np.interp(np.linspace(0, len(x) - 1, n), np.arange(len(x)), x).astype(np.float32)


def audio_track(rng: np.random.Generator, sentences: list[int]) -> np.ndarray:
    """Sentences with pauses between them, at random levels, over faint noise."""
    parts = []
    for i in sentences:
        parts.append(rng.normal(0, 0.003, int(16000 * rng.uniform(0.3, 1.0))).astype(np.float32))
        parts.append(speech(SENTENCES[i], VOICES[i % len(VOICES)]) * rng.uniform(0.3, 1.0))
    x = np.concatenate(parts)
    return (x + rng.normal(0, 0.002, len(x))).astype(np.float32)


def stream_chunks(path: Path, audio: np.ndarray) -> dict[str, np.ndarray]:
    """silero's streaming inputs chunk by chunk, with the state the float model carries."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    state = np.zeros((2, 1, 128), np.float32)
    context = np.zeros((1, 64), np.float32)
    chunks, states = [], []
    rate = np.array(16000, np.int64)
    for k in range(len(audio) // 512):
        chunk = np.concatenate([context, audio[None, k * 512:(k + 1) * 512]], axis=1)
        chunks.append(chunk)
        states.append(state)
        _, state = session.run(None, {"input": chunk, "state": state, "sr": rate})
        context = chunk[:, -64:]
    return {"input": np.stack(chunks), "state": np.stack(states),
            "sr": np.full(len(chunks), 16000, np.int64)}
