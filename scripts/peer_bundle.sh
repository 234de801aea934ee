#!/usr/bin/env bash
# Everything the DeepSpeed peer (scripts/peer_deepspeed.py) needs on a GPU machine with no
# network, gathered here where the package registries are reachable:
#
#   scripts/peer_bundle.sh [DIR]        DIR defaults to build/peer (ignored by git; about 10 MB)
#
#   DIR/wheels   deepspeed built with DS_BUILD_OPS=0 (no compiled ops: the machine builds
#                cpu_adam / async_io on first use with its own nvcc and ninja) and the
#                pure-Python / manylinux wheels it needs that the GPU image lacks, for
#                PEER_PYTHON (default 3.12, the GPU image's python3)
#   DIR/libaio   libaio's headers and library (DeepSpeed's NVMe offload links -laio):
#                gpu_check.sh's `peer` stage points CPATH / LIBRARY_PATH / LD_LIBRARY_PATH here
#
# Carry DIR with the run (the device tool's `carry`), then: scripts/gpu_check.sh OUT peer
set -Eeuo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-$REPO/build/peer}
PY=${PYTHON:-python3}
PEER_PYTHON=${PEER_PYTHON:-3.12}
DEEPSPEED=${DEEPSPEED:-deepspeed==0.19.8}
mkdir -p "$DIR/wheels" "$DIR/src" "$DIR/libaio"
DIR=$(cd "$DIR" && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1

echo "[peer_bundle] $DEEPSPEED: source, then a wheel without compiled ops"
$PY -m pip download -q --no-deps --no-binary :all: "$DEEPSPEED" -d "$DIR/src"
DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation "$DIR"/src/deepspeed-*.tar.gz -w "$DIR/wheels"

# its requirements as the wheel states them (a release may add one), less those the GPU image
# has (torch, numpy); pip resolves theirs
requires() {
  $PY - "$DIR"/wheels/deepspeed-*.whl <<'PYEOF'
import re, sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
  name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
  meta = Parser().parsestr(z.read(name).decode())
for req in meta.get_all("Requires-Dist") or []:
  name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
  if "extra ==" not in req and name.lower() not in ("torch", "numpy"):
    print(req.split(";")[0].strip().replace(" ", ""))
PYEOF
}
mapfile -t REQUIRES < <(requires)
echo "[peer_bundle] its requirements the GPU image lacks, for Python $PEER_PYTHON: ${REQUIRES[*]}"
$PY -m pip download -q --only-binary :all: --python-version "$PEER_PYTHON" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$DIR/wheels" \
  "${REQUIRES[@]}"
for req in "${REQUIRES[@]}"; do  # each one has its wheel, or the GPU machine's install fails
  name=$(echo "$req" | sed -E 's/[<>=!~;].*//; s/[-_.]+/_/g' | tr 'A-Z' 'a-z')
  ls "$DIR/wheels" | sed -E 's/-.*//; s/[-_.]+/_/g' | tr 'A-Z' 'a-z' | grep -qx "$name" \
    || { echo "no wheel for deepspeed's requirement $req in $DIR/wheels"; exit 1; }
done

echo "[peer_bundle] libaio (headers and library)"
(cd "$DIR/src" && apt-get download libaio1 libaio-dev >/dev/null 2>&1) || {
  echo "apt-get download libaio1 libaio-dev failed: the NVMe peer needs libaio on the GPU machine"; exit 1; }
rm -rf "$DIR/libaio" && mkdir -p "$DIR/libaio/root" "$DIR/libaio/lib" "$DIR/libaio/include"
for deb in "$DIR"/src/libaio*.deb; do dpkg-deb -x "$deb" "$DIR/libaio/root"; done
cp -a "$(dirname "$(find "$DIR/libaio/root" -name libaio.so.1 | head -1)")"/libaio.so.1* "$DIR/libaio/lib/"
ln -sf libaio.so.1 "$DIR/libaio/lib/libaio.so"
cp "$(find "$DIR/libaio/root" -name libaio.h | head -1)" "$DIR/libaio/include/"
rm -rf "$DIR/libaio/root" "$DIR/src"
ls -la "$DIR/wheels" "$DIR/libaio/lib" "$DIR/libaio/include"
du -sh "$DIR"
