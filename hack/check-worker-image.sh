#!/usr/bin/env bash
# Check the worker image on a machine without a GPU (root: chroot and mount): build it unless --no-build, unpack it
# (umoci), then, inside it as its non-root user, write a tiny random model (tidal.worker.testing.tiny_models), serve
# it on the CPU with `tidal-worker` and ask it for a chat completion; finally start `tidal-worker` on a missing model
# and read its termination message from /dev/termination-log, a world-writable file as the kubelet mounts it.
# Prints the image's digest, its compressed and unpacked sizes, the answer and the termination message.
#   bash hack/check-worker-image.sh [--no-build]
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/env.sh
layout="$TIDAL_CACHE/images/oci/tidal-worker"
tag=$(python -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
[ "${1:-}" = "--no-build" ] || python hack/images/build_images.py tidal-worker
work=$(mktemp -d /tmp/tidal-worker-check.XXXXXX)
rootfs="$work/bundle/rootfs"
cleanup() {
  if [ -n "${server:-}" ]; then kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; fi
  # Never delete through a mounted /proc.
  if mountpoint -q "$rootfs/proc"; then umount "$rootfs/proc" || umount -l "$rootfs/proc"; fi
  mountpoint -q "$rootfs/proc" || rm -rf "$work"
}
trap cleanup EXIT
echo "unpacking oci:$layout:$tag..."
umoci unpack --image "$layout:$tag" "$work/bundle" >/dev/null
mount -t proc proc "$rootfs/proc"
# Run as the image's user with the image's environment (config.json's process, as umoci wrote it from the image).
mapfile -t image_env < <(python -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))["process"]["env"]))' \
  "$work/bundle/config.json")
in_image() { env -i "${image_env[@]}" /usr/sbin/chroot --userspec=65532:65532 "$rootfs" "$@"; }
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

echo "writing a tiny llama and serving it on the CPU, inside the image as user 65532..."
in_image python -m tidal.worker.testing.tiny_models --arch llama --out /tmp/tiny-llama >/dev/null
# exec: $! is then the worker itself, which the cleanup stops.
(exec env -i "${image_env[@]}" /usr/sbin/chroot --userspec=65532:65532 "$rootfs" \
  tidal-worker --model /tmp/tiny-llama --device cpu --host 127.0.0.1 --port "$port" --log-level warning) &
server=$!
# Loading torch from a freshly unpacked image (nothing in the page cache) takes a minute or more on 2 cores.
start=$(date +%s)
until curl -sf http://127.0.0.1:$port/ready >/dev/null; do
  kill -0 "$server" 2>/dev/null || { echo "the worker exited before it was ready" >&2; exit 1; }
  [ $(( $(date +%s) - start )) -lt 600 ] || { echo "the worker was not ready within 600 s" >&2; exit 1; }
  sleep 2
done
ready_s=$(( $(date +%s) - start ))
answer=$(curl -sf http://127.0.0.1:$port/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}')
kill "$server" && wait "$server" 2>/dev/null || true
server=""

install -m 0666 /dev/null "$rootfs/dev/termination-log"
in_image tidal-worker --model /nonexistent --device cpu 2>/dev/null && { echo "a missing model must fail" >&2; exit 1; }
echo "image:        oci:$layout:$tag"
oci_fact() { python -c 'import pathlib, sys; sys.path.insert(0, "hack/images"); import oci; print(getattr(oci, sys.argv[1])(pathlib.Path(sys.argv[2]), sys.argv[3]))' "$@"; }
echo "digest:       $(oci_fact manifest_digest "$layout" "$tag")"
echo "compressed:   $(( $(oci_fact compressed_size "$layout" "$tag") / 1000000 )) MB"
echo "unpacked:     $(du -sm "$rootfs" --exclude=proc | cut -f1) MB"
echo "torch:        $(in_image python -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
echo "ready after:  ${ready_s} s"
echo "chat answer:  $answer"
echo "termination:  $(cat "$rootfs/dev/termination-log")"
