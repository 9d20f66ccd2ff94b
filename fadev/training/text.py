"""Byte-level text for the Llama training-drift workload: real text every machine has, no download.

The default corpus is the source of the running interpreter's standard library: every ``*.py`` file under
``sysconfig.get_paths()["stdlib"]`` (site-packages, dist-packages and __pycache__ excluded), in sorted
order of their paths relative to that folder (about 31 MB in 1,800 files for CPython 3.11). ``data=PATH``
takes any text file or folder instead (a folder: every file under it, hidden names and __pycache__ excluded).

Tokens: the 256 byte values, then :data:`BOS`, :data:`EOS`, :data:`PAD` (:data:`VOCAB` = 259). Each file
becomes BOS, its bytes, EOS; the files of one split are concatenated into one token stream.

Split (deterministic, by file): a file is held out when the first 8 bytes of sha256(its relative path,
"/"-separated, UTF-8) as a big-endian integer, modulo 10,000, fall below ``HELD_OUT * 10,000``; a single
file (``data`` naming a file) is split instead at ``1 - HELD_OUT`` of its bytes, the tail held out.

Batches: update ``step`` reads ``batch`` windows of ``seq + 1`` tokens of the training stream starting at
``np.random.default_rng([data_seed, step]).integers(0, len - seq, batch)`` -- a function of (step, seed)
only, so a resumed run sees the data of an uninterrupted one. Held-out loss reads ``n`` windows at evenly
spaced starts of the held-out stream.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sysconfig

import numpy as np

BOS, EOS, PAD = 256, 257, 258
VOCAB = 259
HELD_OUT = 0.05
"""Fraction of the files (by hash of their relative path) held out for evaluation."""
STDLIB = "stdlib"
"""``data`` naming the standard-library corpus (a folder of that name: write ``./stdlib``)."""
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token streams (uint16) of the two splits, the files in each, and ``fingerprint``: sha256 (12 hex
    digits) of every file's relative path and bytes, in order -- what a resumed run checks."""

    source: str
    train: np.ndarray
    held_out: np.ndarray
    train_files: tuple
    held_out_files: tuple
    fingerprint: str


def held_out(relpath: str) -> bool:
    """Whether the file at ``relpath`` ("/"-separated) belongs to the held-out split (module docstring)."""
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return h % 10_000 < HELD_OUT * 10_000


def files(data=None) -> list:
    """[(relative path, absolute path)] of the corpus ``data`` (None or "stdlib": the standard library's
    ``*.py``; a folder: its files; a file: itself), sorted by relative path. ValueError naming ``data`` when
    it does not exist or holds no file."""
    if data is None or data == STDLIB:
        root, suffix = sysconfig.get_paths()["stdlib"], ".py"
    else:
        if not isinstance(data, (str, os.PathLike)):
            raise TypeError(f"data: expected a path, got {type(data).__name__}")
        root, suffix = os.fspath(data), ""
        if os.path.isfile(root):
            return [(os.path.basename(root), os.path.abspath(root))]
        if not os.path.isdir(root):
            raise ValueError(f"data: {root!r} is neither a file nor a folder")
    out = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in names:
            path = os.path.join(folder, name)
            if name.endswith(suffix) and not name.startswith(".") and os.path.isfile(path):
                out.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
    if not out:
        raise ValueError(f"data: no {'*' + suffix + ' ' if suffix else ''}file under {root!r}")
    return sorted(out)


def _stream(texts) -> np.ndarray:
    parts = []
    for text in texts:
        parts += [np.array([BOS], np.uint16), np.frombuffer(text, np.uint8).astype(np.uint16),
                  np.array([EOS], np.uint16)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


@functools.lru_cache(maxsize=2)
def load(data=None) -> Corpus:
    """The corpus ``data`` (see :func:`files`) split and tokenised (module docstring)."""
    found = files(data)
    digest = hashlib.sha256()
    texts = {}
    for rel, path in found:
        with open(path, "rb") as fh:
            texts[rel] = fh.read()
        digest.update(rel.encode("utf-8") + b"\0" + len(texts[rel]).to_bytes(8, "big") + texts[rel])
    source = sysconfig.get_paths()["stdlib"] if data in (None, STDLIB) else os.path.abspath(data)
    if len(found) == 1 and data not in (None, STDLIB):
        rel, text = found[0][0], texts[found[0][0]]
        cut = int(len(text) * (1 - HELD_OUT))
        return Corpus(source, _stream([text[:cut]]), _stream([text[cut:]]), (rel,), (rel,), digest.hexdigest()[:12])
    test = [rel for rel, _ in found if held_out(rel)]
    train = [rel for rel, _ in found if not held_out(rel)]
    return Corpus(source, _stream(texts[r] for r in train), _stream(texts[r] for r in test), tuple(train), tuple(test),
                  digest.hexdigest()[:12])


def check(corpus: Corpus, seq: int):
    """ValueError naming ``data`` unless both splits hold at least one window of ``seq + 1`` tokens."""
    for name, tokens in (("training", corpus.train), ("held-out", corpus.held_out)):
        if len(tokens) < seq + 1:
            raise ValueError(f"data: the {name} split of {corpus.source!r} has {len(tokens)} tokens, fewer than one "
                             f"window of seq + 1 = {seq + 1}: give more text or a shorter seq")


def _windows(tokens, starts, seq):
    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq + 1)
    w = tokens[idx].astype(np.int64)
    return w[:, :-1], w[:, 1:]


def batch(tokens: np.ndarray, step: int, size: int, seq: int, data_seed: int = 0) -> tuple:
    """(inputs, targets), int64 arrays (size, seq): the training windows of update ``step`` (module docstring)."""
    starts = np.random.default_rng([data_seed, step]).integers(0, len(tokens) - seq, size)
    return _windows(tokens, starts, seq)


def eval_windows(tokens: np.ndarray, n: int, seq: int) -> tuple:
    """(inputs, targets) of ``n`` windows at evenly spaced starts of ``tokens`` (the held-out stream)."""
    starts = np.linspace(0, len(tokens) - seq - 1, n).astype(np.int64)
    return _windows(tokens, starts, seq)


__all__ = ["Corpus", "load", "files", "held_out", "check", "batch", "eval_windows", "BOS", "EOS", "PAD", "VOCAB",
           "HELD_OUT", "STDLIB"]
