#!/usr/bin/env bash
# Build the local control plane's binaries once per version into $TIDAL_BIN (outside the clone):
#   kube  - one multi-call binary (hack/kube) for kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
#           and etcd, from the k8s.io/kubernetes and go.etcd.io/etcd Go modules at the versions pinned in hack/kube/go.mod
#   helm  - from the helm.sh/helm/v3 Go module
# plus one symlink per tool name. A cold build takes ~15-25 minutes on 2 cores; later runs return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/env.sh
mkdir -p "$TIDAL_BIN"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
if [ ! -x "$TIDAL_BIN/kube" ]; then
  echo "building kube $KUBE_VERSION (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd)..."
  start=$(date +%s)
  (cd hack/kube && go build -trimpath -ldflags="-s -w" -o "$TIDAL_BIN/kube.tmp" .)
  mv "$TIDAL_BIN/kube.tmp" "$TIDAL_BIN/kube"
  echo "built kube in $(( $(date +%s) - start )) s"
fi
for tool in kube-apiserver kube-controller-manager kube-scheduler kubectl etcd; do
  ln -sf kube "$TIDAL_BIN/$tool"
done
if [ ! -x "$TIDAL_BIN/helm" ]; then
  echo "building helm $HELM_VERSION..."
  start=$(date +%s)
  GOBIN="$TIDAL_BIN" go install -trimpath -ldflags="-s -w" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  echo "built helm in $(( $(date +%s) - start )) s"
fi
echo "control-plane binaries ready: $TIDAL_BIN"
