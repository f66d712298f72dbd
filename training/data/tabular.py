"""Rows of a CSV or Parquet file, each with the place a message can name (``events.csv row 5 (line 6)``).

The format is read from the file: Parquet when it starts with the ``PAR1`` magic bytes, else CSV (plain or
gzipped; comma-separated, tab-separated when the name ends in ``.tsv`` / ``.tsv.gz``), with a header line. Parquet
is read with pyarrow (``pip install pyarrow``), in record batches.

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "log.csv"
    >>> _ = path.write_text("user_id,item_id\\nu1,A\\n")
    >>> table = open_table(path)
    >>> table.columns, [(row, values) for row, values in table.rows(["item_id"])]
    (['user_id', 'item_id'], [(1, ('A',))])
    >>> table.where(1)
    'log.csv row 1 (line 2)'
"""

from __future__ import annotations

import csv
import gzip
import io
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from recsvc.errors import UserError

PARQUET_MAGIC = b"PAR1"
GZIP_MAGIC = b"\x1f\x8b"
BATCH_ROWS = 65_536


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``, or a UserError that says how to get it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading or writing Parquet needs pyarrow: pip install pyarrow "
                        "(`make install` installs it; or use CSV)") from None
    return pq


@dataclass
class Table:
    """A CSV or Parquet file with a header: its column names and its data rows (numbered from 1)."""

    path: Path
    kind: str  # "csv" or "parquet"
    columns: list[str]
    _last_line: tuple[int, int] = field(default=(0, 0), repr=False)  # CSV: (latest data row, the line it ends on)

    def where(self, row: int) -> str:
        """The place of data row ``row`` in a message: ``"log.csv row 5 (line 6)"``, ``"log.parquet row 5"``."""
        last_row, line = self._last_line
        return f"{self.path.name} row {row}" + (f" (line {line})" if row == last_row and line else "")

    def require(self, name: str, role: str, flag: str) -> None:
        """A UserError naming the file, the column and the flag that names another when ``name`` is absent."""
        if name not in self.columns:
            found = ", ".join(repr(c) for c in self.columns) or "none"
            raise UserError(f"{self.path}: no column {name!r} (the {role}; columns found: {found}); "
                            f"name another with {flag}")

    def rows(self, names: Sequence[str]) -> Iterator[tuple[int, tuple[Any, ...]]]:
        """``(row number, values of ``names``)`` per data row; CSV values are strings ("" when empty), Parquet
        values Python objects (None when null)."""
        for name in names:
            if name not in self.columns:
                raise UserError(f"{self.path}: no column {name!r}")
        if self.kind == "parquet":
            yield from self._parquet_rows(list(names))
        else:
            yield from self._csv_rows(list(names))

    def _csv_rows(self, names: list[str]) -> Iterator[tuple[int, tuple[Any, ...]]]:
        index = [self.columns.index(n) for n in names]
        width = len(self.columns)
        with _open_csv(self.path) as fh:
            reader = csv.reader(fh, delimiter=_delimiter(self.path))
            try:
                next(reader, None)  # the header
                row = 0
                for record in reader:
                    if not record or (len(record) == 1 and not record[0].strip()):
                        continue  # a blank line
                    row += 1
                    self._last_line = (row, reader.line_num)
                    if len(record) != width:
                        raise UserError(f"{self.where(row)}: {len(record)} fields, the header has {width}")
                    yield row, tuple(record[i] for i in index)
            except csv.Error as exc:
                raise UserError(f"{self.path.name} line {reader.line_num}: malformed CSV: {exc}") from None
            except UnicodeDecodeError as exc:
                raise UserError(f"{self.path}: not UTF-8 text ({exc.reason})") from None
            except (OSError, EOFError, zlib.error) as exc:
                raise UserError(f"{self.path}: cannot read (corrupt or truncated gzip?): {exc}") from None

    def _parquet_rows(self, names: list[str]) -> Iterator[tuple[int, tuple[Any, ...]]]:
        pq = pyarrow_parquet()
        import pyarrow as pa

        row = 0
        try:
            for batch in pq.ParquetFile(self.path).iter_batches(batch_size=BATCH_ROWS, columns=names):
                columns = [batch.column(n).to_pylist() for n in names]
                for values in zip(*columns, strict=True):
                    row += 1
                    yield row, values
        except (pa.ArrowException, OSError) as exc:
            raise UserError(f"{self.path}: cannot read Parquet: {exc}") from None


def _delimiter(path: Path) -> str:
    name = path.name.lower()
    return "\t" if name.endswith((".tsv", ".tsv.gz")) else ","


def _open_csv(path: Path) -> IO[str]:
    with path.open("rb") as fh:
        magic = fh.read(2)
    if magic == GZIP_MAGIC:
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return path.open(encoding="utf-8-sig", newline="")


def open_table(path: str | Path, what: str = "input") -> Table:
    """The file's kind and header; a UserError when it is missing, empty or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} file not found: {path}")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic == PARQUET_MAGIC:
        pq = pyarrow_parquet()
        import pyarrow as pa

        try:
            names = list(pq.ParquetFile(path).schema_arrow.names)
        except (pa.ArrowException, OSError) as exc:
            raise UserError(f"{path}: cannot read Parquet: {exc}") from None
        return Table(path=path, kind="parquet", columns=names)
    try:
        with _open_csv(path) as fh:
            header = next(csv.reader(fh, delimiter=_delimiter(path)), None)
    except (csv.Error, UnicodeDecodeError, OSError, EOFError, zlib.error) as exc:
        raise UserError(f"{path}: cannot read a CSV header: {exc}") from None
    if not header:
        raise UserError(f"{path}: empty file (expected a header line naming the columns)")
    columns = [c.strip() for c in header]
    dupes = sorted({c for c in columns if columns.count(c) > 1})
    if dupes:
        raise UserError(f"{path}: header names column(s) {', '.join(map(repr, dupes))} more than once")
    return Table(path=path, kind="csv", columns=columns)
