"""Regenerates the Python gRPC code of ``protos/recsvc/v1/recommender.proto`` into ``recsvc/service/gen/``.

Run ``python -m recsvc.service.proto_gen`` after editing the proto; the generated files are committed and a
test regenerates them into a temporary directory and compares byte for byte (drift fails the suite).
protoc writes ``from recsvc.v1 import recommender_pb2`` (the proto's package path); that import is
rewritten to the package-relative ``from . import recommender_pb2`` so the code lives in
``recsvc.service.gen``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_FILE = "recsvc/v1/recommender.proto"
GEN_DIR = Path(__file__).resolve().parent / "gen"
GENERATED = ("recommender_pb2.py", "recommender_pb2.pyi", "recommender_pb2_grpc.py")
_ABSOLUTE_IMPORT = "from recsvc.v1 import recommender_pb2 as"
_RELATIVE_IMPORT = "from . import recommender_pb2 as"


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Runs protoc (grpc_tools) and writes the generated modules into ``out_dir``; returns their paths."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(proto_root / PROTO_FILE),
        ]
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} for {proto_root / PROTO_FILE}")
        written = []
        for name in GENERATED:
            text = (Path(tmp) / "recsvc" / "v1" / name).read_text(encoding="utf-8")
            text = text.replace(_ABSOLUTE_IMPORT, _RELATIVE_IMPORT)
            target = out_dir / name
            target.write_text(text, encoding="utf-8")
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=GEN_DIR, help="output directory (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
