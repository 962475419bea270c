"""Regenerate the etcd backend's gRPC stubs from the .proto files committed beside them.

    python3 scripts/gen_etcd_stubs.py

Reads django_dlock/backends/etcd/etcdrpc/{auth,kv,rpc}.proto and rewrites
auth_pb2.py, kv_pb2.py, rpc_pb2.py and rpc_pb2_grpc.py there. Needs PyPI (pip),
nothing else: it makes a throwaway virtualenv and installs GRPCIO_TOOLS in it
from a wheel.

Why its own virtualenv and not the dev group: every grpcio-tools release pins
protobuf to one major version, and the version it is decides the floor of the
etcd extra. The code protoc emits refuses to import on a protobuf older than
the protoc that wrote it (runtime_version.ValidateProtobufRuntimeVersion), and
rpc_pb2_grpc.py on a grpcio older than the grpcio-tools that wrote it
(GRPC_GENERATED_VERSION). grpcio-tools 1.74.0 writes protobuf 6.31.1 code,
which protobuf 6.31.1 and later 6.x and 7.x import without a warning; keeping
it in the dev group would pin the dev virtualenv to protobuf < 7. Changing
GRPCIO_TOOLS changes the floors: update the etcd extra in pyproject.toml.

protoc gets the files under their package path (django_dlock/backends/etcd/
etcdrpc/rpc.proto, not rpc.proto), so that the descriptors' file names are
this package's and never clash with another copy of etcd's (etcd3 registers
rpc.proto). The modules then register their messages in a pool of their
own (_pool.py says why) rather than the default one, and their absolute
imports of each other are made relative, so the package works wherever it is
imported from.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

GRPCIO_TOOLS = "1.74.0"
ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "django_dlock/backends/etcd/etcdrpc"
PROTOS = ["auth.proto", "kv.proto", "rpc.proto"]
#: Only rpc.proto declares services; the others would get an empty _pb2_grpc.
SERVICES = ["rpc.proto"]
HEADER = (
    "# Written by scripts/gen_etcd_stubs.py (grpcio-tools {tools}) from {proto} here,\n"
    "# etcd's API (Apache License 2.0: LICENSE and README.md here). Do not edit.\n"
)


def protoc(tools_python: Path, work: Path) -> Path:
    """Run protoc on package-shaped copies of the protos; returns the output root."""
    src = work / "src"
    out = work / "out"
    (src / PACKAGE).mkdir(parents=True)
    (out / PACKAGE).mkdir(parents=True)
    for name in PROTOS:
        text = (ROOT / PACKAGE / name).read_text()
        # etcd's protos import each other by bare file name (import "kv.proto").
        text = re.sub(r'^import "(\w+\.proto)";', rf'import "{PACKAGE}/\1";', text, flags=re.M)
        (src / PACKAGE / name).write_text(text)
    files = [f"{PACKAGE}/{name}" for name in PROTOS]
    grpc_files = [f"{PACKAGE}/{name}" for name in SERVICES]
    subprocess.run(
        [tools_python, "-m", "grpc_tools.protoc", f"-I{src}", f"--python_out={out}", *files],
        check=True,
    )
    subprocess.run(
        [tools_python, "-m", "grpc_tools.protoc", f"-I{src}", f"--grpc_python_out={out}",
         *grpc_files],
        check=True,
    )  # fmt: skip
    return out


def use_own_pool(text: str, name: str) -> str:
    """Register the file's messages in _pool.POOL instead of protobuf's default pool."""
    default = "_descriptor_pool.Default().AddSerializedFile("
    if text.count(default) != 1:
        raise SystemExit(f"{name}: expected one {default}...) to redirect")
    text = text.replace(default, "_POOL.AddSerializedFile(")
    marker = "# @@protoc_insertion_point(imports)\n"
    if text.count(marker) != 1:
        raise SystemExit(f"{name}: no imports insertion point")
    return text.replace(marker, marker + "from ._pool import POOL as _POOL\n")


def main() -> int:
    dotted = PACKAGE.replace("/", ".")
    with tempfile.TemporaryDirectory(prefix="gen_etcd_stubs-") as tmp:
        work = Path(tmp)
        venv.create(work / "venv", with_pip=True)
        tools_python = work / "venv" / "bin" / "python"
        subprocess.run(
            [tools_python, "-m", "pip", "install", "--quiet", "--only-binary", ":all:",
             f"grpcio-tools=={GRPCIO_TOOLS}"],
            check=True,
        )  # fmt: skip
        out = protoc(tools_python, work) / PACKAGE
        written = sorted(out.glob("*.py"))
        for path in written:
            text = path.read_text()
            # from django_dlock.backends.etcd.etcdrpc import kv_pb2 as ... -> from . import ...
            text = text.replace(f"from {dotted} import ", "from . import ")
            if path.name.endswith("_pb2.py"):
                text = use_own_pool(text, path.name)
            if re.search(rf"^(from|import) {re.escape(dotted)}", text, re.M):
                raise SystemExit(f"{path.name}: an import of {dotted} is left absolute")
            proto = path.name.replace("_pb2_grpc.py", ".proto").replace("_pb2.py", ".proto")
            text = HEADER.format(tools=GRPCIO_TOOLS, proto=proto) + text
            (ROOT / PACKAGE / path.name).write_text(text)
    print("wrote", ", ".join(f"{PACKAGE}/{p.name}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
