#!/usr/bin/env bash
# The tools the image builds use, from Debian's own packages: debootstrap (the root file systems), umoci (OCI
# layouts), skopeo (inspecting and pushing them) and crun (running the operator image in its test). Installed once,
# as root, with apt-get; elsewhere they must be there already. With --optional (`make test`) a non-root user without
# them gets a note instead of an error: the image tests skip there, since debootstrap and chroot need root anyway.
set -euo pipefail
missing=()
for tool in debootstrap umoci skopeo crun; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "image tools missing: ${missing[*]}; install them (apt-get install ${missing[*]}) or run as root" >&2
  [ "${1:-}" = "--optional" ] && exit 0
  exit 1
fi
echo "installing ${missing[*]} from Debian's packages..."
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
