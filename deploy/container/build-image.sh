#!/usr/bin/env bash
# Builds a moelane container image FROM scratch (no base image is pulled): the moelane binary
# (debug info stripped), the shared libraries `ldd` lists, the dynamic loader, and an empty
# /tmp. Usage: deploy/container/build-image.sh BINARY TAG
#
# A CPU image as it is. For the CUDA path, build the binary with --features cuda: it loads
# libcuda, NVRTC, cuBLAS and NCCL at run time, which the NVIDIA container toolkit mounts into
# the container (`--gpus all`), so they are not copied here.
set -euo pipefail
bin=${1:?usage: build-image.sh BINARY TAG}
tag=${2:?usage: build-image.sh BINARY TAG}
[ -x "$bin" ] || { echo "build-image.sh: $bin is not an executable" >&2; exit 1; }
command -v docker >/dev/null || { echo "build-image.sh: docker is not installed" >&2; exit 1; }
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
root="$ctx/root"
mkdir -p "$root/tmp" "$root/model" "$root/state"
chmod 1777 "$root/tmp"
cp "$bin" "$root/moelane"
strip --strip-debug "$root/moelane" 2>/dev/null || true
# every library the binary links, and the loader, at the paths it asks for
ldd "$bin" | awk '/=> \// {print $3} /^[[:space:]]*\// {print $1}' | sort -u | while read -r lib; do
  [ -e "$lib" ] || continue
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
cat > "$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY root/ /
ENV HOME=/tmp
ENTRYPOINT ["/moelane"]
DOCKERFILE
docker build -q -t "$tag" "$ctx" >/dev/null
echo "$tag"
