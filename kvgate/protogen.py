"""Generate the gRPC stubs in `kvgate/v1/` from the `.proto` sources under `proto/`.

    python -m kvgate.protogen            regenerate into the repository root (what `make proto` runs)
    python -m kvgate.protogen --check    exit 1 if the committed stubs differ from a fresh generation
    python -m kvgate.protogen --out DIR  generate into DIR instead (with --check: compare DIR instead)

Exit status: 0 done or current, 1 stubs out of date (--check), 2 an expected error such as missing
grpcio-tools or a .proto that protoc rejects (one message on stderr, no traceback).

It runs the protoc bundled with grpcio-tools as
`protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/kvgate/v1/*.proto`, so the
generated modules import each other as `from kvgate.v1 import replica_pb2`. grpcio-tools is pinned in
the test extra because the output of different versions differs, and the committed stubs are compared
byte for byte with a fresh generation.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
# What protoc writes for each `x.proto`, as suffixes replacing `.proto`.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class ProtogenError(Exception):
    """An expected failure (missing tool, bad .proto), reported as one message without a traceback."""


def proto_sources(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto under `proto_root`, relative to it and sorted, so the generation is deterministic."""
    return sorted(path.relative_to(proto_root) for path in proto_root.rglob("*.proto"))


def generated_files(sources: Sequence[Path]) -> list[Path]:
    """The files protoc writes for `sources`, relative to the output root (e.g. kvgate/v1/replica_pb2.py)."""
    return sorted(
        source.with_name(source.stem + suffix) for source in sources for suffix in GENERATED_SUFFIXES
    )


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc over every .proto under `proto_root`, writing into `out_dir`.

    Returns the generated files, relative to `out_dir`. Raises ProtogenError when grpcio-tools is
    missing, there is no .proto, or protoc rejects a source (protoc prints its own message first).
    """
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise ProtogenError(
            f"grpcio-tools is not installed ({exc}); install the test extra: pip install -e '.[test]'"
        ) from exc
    sources = proto_sources(proto_root)
    if not sources:
        raise ProtogenError(f"no .proto files under {proto_root}")
    # protoc does not know where the well-known types (google/protobuf/*.proto) live; grpcio-tools
    # ships them. `python -m grpc_tools.protoc` adds this include itself, calling main() does not.
    well_known_types = Path(protoc.__file__).resolve().parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known_types}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        # protoc maps each file to its path under the include root (kvgate/v1/replica.proto); that
        # path, not this machine's, is what the stubs record, so the output is the same everywhere.
        *(str(proto_root / source) for source in sources),
    ]
    if protoc.main(args) != 0:
        raise ProtogenError("protoc failed; see its message above")
    return generated_files(sources)


def stale_files(committed_root: Path = REPO_ROOT, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Files under `committed_root` that a fresh generation would change, add or leave orphaned.

    That is: generated files that are missing or differ byte for byte, plus stubs whose .proto is
    gone (they would linger, importable but never updated). Writes nothing under `committed_root`.
    """
    with tempfile.TemporaryDirectory(prefix="kvgate-protogen-") as tmp:
        fresh_root = Path(tmp)
        expected = generate(fresh_root, proto_root)
        changed = [
            relative
            for relative in expected
            if not _same_bytes(fresh_root / relative, committed_root / relative)
        ]
    packages = sorted({relative.parts[0] for relative in expected})
    orphaned = [
        path.relative_to(committed_root)
        for package in packages
        for suffix in GENERATED_SUFFIXES
        for path in (committed_root / package).rglob("*" + suffix)
        if path.relative_to(committed_root) not in expected
    ]
    return sorted(set(changed) | set(orphaned))


def _same_bytes(fresh: Path, committed: Path) -> bool:
    return committed.is_file() and fresh.read_bytes() == committed.read_bytes()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvgate.protogen", description="Generate the gRPC stubs in kvgate/v1 from proto/."
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed stubs are not current (writes nothing)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="output root, or with --check the tree to compare (default: the repository root)",
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_files(committed_root=args.out)
            if stale:
                listing = "\n".join(f"  {path}" for path in stale)
                print(
                    f"generated stubs are out of date with proto/:\n{listing}\n"
                    "run `make proto` and commit the result",
                    file=sys.stderr,
                )
                return 1
            print("generated stubs are current")
            return 0
        for path in generate(args.out):
            print(f"wrote {args.out / path}")
        return 0
    except ProtogenError as exc:
        print(f"kvgate.protogen: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
