"""Generate the Python gRPC stubs in specdec/rpc/v1 from protos/ (one command), or check they are current.

    python -m specdec.rpc.codegen           # regenerate
    python -m specdec.rpc.codegen --check   # exit 1 if the committed stubs differ from freshly generated ones
"""
from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
PACKAGE = Path("specdec/rpc/v1")


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools
    protos = sorted((PROTOS / PACKAGE).glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}"] + [str(p.relative_to(PROTOS)) for p in protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in (out_root / PACKAGE).iterdir() if p.suffix in (".py", ".pyi"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the stubs are current")
    args = parser.parse_args(argv)
    target = ROOT / PACKAGE
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        if args.check:
            stale = [p.name for p in fresh if not (target / p.name).is_file()
                     or not filecmp.cmp(p, target / p.name, shallow=False)]
            if stale:
                print(f"generated protobuf code is stale: {', '.join(stale)}; run python -m specdec.rpc.codegen",
                      file=sys.stderr)
                return 1
            print(f"generated protobuf code is current ({len(fresh)} files)")
            return 0
        for p in fresh:
            shutil.copy(p, target / p.name)
        print(f"wrote {len(fresh)} files to {target}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
