"""Generate the package's gRPC code from proto/*.proto.

`python proto/generate.py` writes into servicer/proto/; `generate(out_dir)` is what the
freshness test calls to compare a fresh build with the committed files.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_DIR.parent / "servicer" / "proto"
PROTO_FILES = ("common.proto", "mlx_engine.proto", "vllm_engine.proto")
MODULES = [f"{Path(name).stem}_pb2" for name in PROTO_FILES]


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into out_dir and make the generated imports package-relative."""
    from grpc_tools import protoc  # dev dependency, only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(PROTO_DIR / name) for name in PROTO_FILES],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = sorted(p for p in out_dir.iterdir() if p.name.endswith((".py", ".pyi")))
    # protoc writes `import common_pb2`, which only works with the folder on sys.path.
    pattern = re.compile(rf"^import ({'|'.join(MODULES)})\b", re.MULTILINE)
    for path in written:
        text = path.read_text()
        path.write_text(pattern.sub(r"from . import \1", text))
    init = out_dir / "__init__.py"
    init.write_text('"""Generated gRPC code; regenerate with `make proto`."""\n')
    return [init, *written]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE_DIR):
        print(path)
