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
  # Stamp the release into the binaries: kubectl, helm and the apiserver's /version report it, and version-skew
  # checks and charts' kubeVersion constraints read it.
  minor=$(echo "$KUBE_VERSION" | cut -d. -f2)
  stamp=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    stamp+=" -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
    stamp+=" -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  (cd hack/kube && go build -trimpath -ldflags="-s -w $stamp" -o "$TIDAL_BIN/kube.tmp" .)
  mv "$TIDAL_BIN/kube.tmp" "$TIDAL_BIN/kube"
  echo "built kube in $(( $(date +%s) - start )) s"
fi
for tool in kube-apiserver kube-controller-manager kube-scheduler kubectl etcd; do
  ln -sf kube "$TIDAL_BIN/$tool"
done
if [ ! -x "$TIDAL_BIN/helm" ]; then
  echo "building helm $HELM_VERSION..."
  start=$(date +%s)
  kube_minor=$(echo "$KUBE_VERSION" | cut -d. -f2)
  GOBIN="$TIDAL_BIN" go install -trimpath -ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
    -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$kube_minor" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  echo "built helm in $(( $(date +%s) - start )) s"
fi
echo "control-plane binaries ready: $TIDAL_BIN"
