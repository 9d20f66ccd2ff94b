"""Sweep results files: append-only JSON Lines or CSV, one row per finished point, crash-safe.

Each row is written with one write, flushed and fsynced, under an exclusive flock on the file, so a
sweep killed at any moment leaves every finished row intact and at most a partial last line, which
the next open truncates away (a malformed line elsewhere is an error, never guessed at). CSV files
whose header lacks a new row's columns are rewritten atomically (temp file, fsync, rename) with the
wider header. Rows read back keep their types: JSON Lines as written; CSV column by column (integers,
bools, floats, else text). Used by :mod:`fadev.sweep` and :mod:`fadev.training`; Parquet is an export format only.
"""
from __future__ import annotations

import json
import math
import os
import re

TEXT_COLUMNS = {"key", "kernel", "policy", "rounding", "loop_order", "normalize", "exp", "dist", "input_fmt", "device",
                "ref_kernel", "ref_policy", "ref_rounding", "ref_loop_order", "ref_normalize", "ref_exp",
                "policy_name", "ref_policy_name", "fadev_version"}
"""Sweep columns that CSV must read back as text whatever they look like (also stage.* and ref_stage.*)."""


def _file_kind(path):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: a results file is a str or os.PathLike path, got {type(path).__name__} {path!r}")
    ext = os.path.splitext(str(path))[1].lower()
    if ext in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if ext in (".csv", ".parquet"):
        return ext[1:]
    raise ValueError(f"results file {str(path)!r}: unknown extension {ext!r}; use .jsonl, .csv (or .parquet "
                     f"for export)")


def _csv_cell(value):
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)


def _parse(data, kind, path):
    """(rows, header, good) from a results file's bytes: rows as dicts (CSV: of strings), the CSV header,
    and the length of the newline-terminated prefix. Every row is written with its newline in one
    write, so only an unterminated tail can be a killed write: it is left out; any other malformed line
    is an error."""
    good = data.rfind(b"\n") + 1
    try:
        lines = data[:good].decode().split("\n")[:-1]
    except UnicodeDecodeError as e:
        raise ValueError(f"results file {str(path)!r} is not UTF-8 text ({e}); not a sweep results file") from None
    if kind == "jsonl":
        rows = []
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"results file {str(path)!r}: line {i} is not JSON: {line[:80]!r}") from None
            if not isinstance(row, dict) or not isinstance(row.get("key"), str):
                raise ValueError(f"results file {str(path)!r}: line {i} is not a sweep row (no 'key'): {line[:80]!r}")
            rows.append(row)
        return rows, None, good
    import csv
    table = list(csv.reader(lines))
    if not table:
        return [], None, good
    header = table[0]
    if "key" not in header:
        raise ValueError(f"results file {str(path)!r}: the CSV header has no 'key' column; not a sweep results file")
    for i, cells in enumerate(table[1:], 2):
        if len(cells) != len(header):
            raise ValueError(f"results file {str(path)!r}: line {i} has {len(cells)} fields, the header "
                             f"{len(header)}")
    return [dict(zip(header, cells)) for cells in table[1:]], header, good


class ResultsFile:
    """An append-only results file held under an exclusive lock: the rows already in it, and append()."""

    def __init__(self, path):
        """Open (creating it and its folder) and lock ``path``; RuntimeError if another sweep holds it."""
        import fcntl
        self.path, self.kind = str(path), _file_kind(path)
        if self.kind == "parquet":
            raise ValueError(f"results file {self.path!r}: Parquet cannot be appended row by row; run into a "
                             f".jsonl file and export(path, 'results.parquet') afterwards")
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.fh = open(self.path, "a+b")
        try:
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.fh.close()
            raise RuntimeError(f"results file {self.path!r} is locked by another running sweep") from None
        self.rows, self.header = self._read()

    def _read(self):
        """Parse the file; truncate away an unterminated last line (a sweep killed mid-write)."""
        self.fh.seek(0)
        data = self.fh.read()
        rows, header, good = _parse(data, self.kind, self.path)
        if good < len(data):
            self.fh.truncate(good)
            self.fh.flush()
            os.fsync(self.fh.fileno())
        return rows, header

    def append(self, row):
        if self.kind == "jsonl":
            data = json.dumps(row, separators=(",", ":")) + "\n"
        else:
            import csv
            import io
            if self.header is None or not set(row) <= set(self.header):
                self._widen([c for c in row if c not in (self.header or [])])
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerow([_csv_cell(row.get(c)) for c in self.header])
            data = buf.getvalue()
        self.fh.seek(0, os.SEEK_END)
        self.fh.write(data.encode())
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def _widen(self, new_columns):
        """CSV only: rewrite the file with more header columns."""
        rows, header = self._read()
        self.header = (header or []) + new_columns
        self._rewrite(rows)

    def drop(self, keys):
        """Rewrite the file without the rows whose key is in ``keys`` (a rerun retrying failed points)."""
        rows, self.header = self._read()
        self.rows = [r for r in rows if r["key"] not in keys]
        self._rewrite(self.rows)

    def _rewrite(self, rows):
        """Replace the file by ``rows`` (as read: CSV rows of strings under self.header) atomically: temp
        file, fsync, rename, then lock the new file."""
        import csv
        import fcntl
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as out:
            if self.kind == "jsonl":
                out.writelines(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
            else:
                writer = csv.writer(out, lineterminator="\n")
                writer.writerow(self.header)
                for row in rows:
                    writer.writerow([row.get(c, "") for c in self.header])
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        old, self.fh = self.fh, open(self.path, "a+b")
        fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        old.close()

    def typed_rows(self):
        """The rows that were in the file when it was opened (less dropped ones), as dicts of Python values."""
        return _typed_rows(self.rows, self.header, self.kind)

    def close(self):
        self.fh.close()


_INT_TEXT = re.compile(r"-?[0-9]+\Z")


def _is_text(name):
    return name in TEXT_COLUMNS or name.startswith(("stage.", "ref_stage."))


def _csv_values(name, cells):
    """A CSV column's cells as Python values: ints, bools or floats when every non-empty cell is one,
    else strings (always for the text columns); empty cells are None."""
    present = [c for c in cells if c != ""]
    if _is_text(name):
        convert = str
    elif present and all(_INT_TEXT.match(c) for c in present):
        convert = int
    elif present and all(c in ("True", "False") for c in present):
        convert = "True".__eq__
    else:
        try:
            [float(c) for c in present]
            convert = float
        except ValueError:
            convert = str
    return [None if c == "" else convert(c) for c in cells]


def _typed_rows(rows, header, kind):
    """Rows as dicts of Python values (JSON Lines: as written; CSV: typed column by column)."""
    if kind == "jsonl":
        return rows
    columns = {c: _csv_values(c, [r[c] for r in rows]) for c in header or []}
    return [{c: columns[c][i] for c in columns} for i in range(len(rows))]


def frame(rows):
    """A DataFrame from row dicts: int columns stay integers (Int64 when some are missing), bool columns
    bool ('boolean' when missing), all-missing and text columns object (None)."""
    import pandas as pd
    n, data = len(rows), {}
    for name in dict.fromkeys(c for r in rows for c in r):
        values = [r.get(name) for r in rows]
        present = [v for v in values if v is not None]
        kinds = {type(v) for v in present}
        if present and kinds <= {bool}:
            dtype = "bool" if len(present) == n else "boolean"
        elif present and kinds <= {int}:
            dtype = "int64" if len(present) == n else "Int64"
        elif present and kinds <= {int, float}:
            dtype, values = "float64", [math.nan if v is None else float(v) for v in values]
        else:
            dtype = object
        data[name] = pd.Series(values, dtype=dtype)
    return pd.DataFrame(data, index=range(n))


def load(path):
    """Results of a sweep (.jsonl or .csv; .parquet with pyarrow) as a pandas DataFrame, one row per point
    in file order; a partial last line (a sweep killed mid-write) is ignored. A key that appears on several
    lines (a file appended to twice, files concatenated) is one row: its last line's, at its first place, as
    a rerun reads the file, so :func:`aggregate` counts it once. Integer columns stay integers (pandas'
    nullable Int64 where a value is missing), missing values are None/NaN/<NA>."""
    import pandas as pd
    kind = _file_kind(path)
    if kind == "parquet":
        _need_pyarrow("read")
        return pd.read_parquet(path)
    with open(path, "rb") as fh:
        rows, header, _good = _parse(fh.read(), kind, path)
    rows = _typed_rows(rows, header, kind)
    return frame(list({r["key"]: r for r in rows}.values()))


def _need_pyarrow(what):
    import importlib
    try:
        importlib.import_module("pyarrow")
    except ImportError:
        raise ImportError(f"cannot {what} Parquet: pyarrow is not installed (pip install pyarrow), or use .csv / "
                          f".jsonl") from None


def export(results, path):
    """Write results (a DataFrame or a results file path) to ``path``: .csv, .jsonl or .parquet (needs
    pyarrow; ImportError naming it otherwise). Returns the path."""
    import pandas as pd
    kind = _file_kind(path)
    df = results if isinstance(results, pd.DataFrame) else load(results)
    if kind == "parquet":
        _need_pyarrow("write")
        df.to_parquet(path, index=False)
    elif kind == "csv":
        df.to_csv(path, index=False)
    else:
        with open(path, "w") as out:  # json, not DataFrame.to_json: that rounds floats to 15 digits
            for row in df.to_dict("records"):
                out.write(json.dumps({k: None if _missing(v) else _plain(v) for k, v in row.items()},
                                     separators=(",", ":")) + "\n")
    return str(path)


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def _missing(v):
    """None or pandas' NA (a NaN float stays NaN: a metric's value, not a missing one)."""
    return v is None or type(v).__name__ == "NAType"
