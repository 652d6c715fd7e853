#!/usr/bin/env bash
# Fetch the wheels the GPU image lacks into <repo root>/.whl/ (git-ignored), for the device run.
#
#   bash tools/gpu_bench/fetch_wheels.sh          # needs PyPI; run on a networked machine
#
# The GPU image has Python 3.12, torch 2.11, transformers 5.17 and triton, but not torchtitan and
# its small dependencies. Pure-Python wheels for Python 3.12 are downloaded without dependencies,
# pinned to the versions this workspace's uv.lock resolves (the same set the gpu-anchor run used).
# typing_extensions goes to .whl/extra/: the bench installs it only when the image's copy is older
# than 4.14 (typeguard, under tyro, needs 4.14). Rerunning skips wheels already present.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$ROOT/.whl"
PIP="${PIP:-python3 -m pip}"

WHEELS=(
  torchtitan==0.3.0
  torchdata==0.11.0
  datasets==4.7.0
  tyro==1.0.17
  spmd_types==0.2.3
  torch_checkpointing==0.1.1
  dill==0.4.0
  multiprocess==0.70.18
  docstring_parser==0.18.0
  typeguard==4.6.1
  fsspec==2026.2.0          # datasets 4.7 needs <= 2026.2.0
)
EXTRA=(typing_extensions==4.16.0)

fetch() {  # DEST_DIR SPEC   (pip's notes about unreachable local index folders are dropped)
  $PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$1" "$2" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

mkdir -p "$DEST/extra"
for spec in "${WHEELS[@]}"; do fetch "$DEST" "$spec"; done
for spec in "${EXTRA[@]}"; do fetch "$DEST/extra" "$spec"; done

# Exactly one wheel per pinned name, nothing else (an older fetch of another version is an error).
status=0
check() {  # DIR SPEC...
  local dir=$1; shift
  local want=() spec name version
  for spec in "$@"; do
    name=${spec%%==*}; version=${spec##*==}
    want+=("${name}-${version}-")
    if ! ls "$dir"/"${name}-${version}"-*.whl >/dev/null 2>&1; then
      echo "fetch_wheels: missing ${name}-${version} in $dir" >&2; status=1
    fi
  done
  local f ok
  for f in "$dir"/*.whl; do
    ok=0
    for w in "${want[@]}"; do case "$(basename "$f")" in "$w"*) ok=1 ;; esac; done
    [ "$ok" = 1 ] || { echo "fetch_wheels: unexpected $(basename "$f") in $dir (remove it)" >&2; status=1; }
  done
}
check "$DEST" "${WHEELS[@]}"
check "$DEST/extra" "${EXTRA[@]}"
[ "$status" = 0 ] || exit 1
echo "fetch_wheels: $(ls "$DEST"/*.whl | wc -l) wheels + $(ls "$DEST"/extra/*.whl | wc -l) extra in $DEST ($(du -sh "$DEST" | cut -f1))"
