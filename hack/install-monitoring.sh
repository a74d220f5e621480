#!/usr/bin/env bash
# Install what the monitoring tests run against, once per version, outside the clone:
#   prometheus, promtool  - built from the github.com/prometheus/prometheus Go module into $TIDAL_PROMETHEUS_BIN, with
#                           only the Kubernetes service discovery compiled in (the tests discover the devcluster's
#                           pods and endpoints as the Prometheus Operator's configurations do; the other discovery
#                           plugins would only lengthen the build)
#   Prometheus Operator CRDs (ServiceMonitor, PodMonitor, PrometheusRule) - the YAML its Go module ships, copied into
#                           $TIDAL_PROMETHEUS_OPERATOR_CRDS, so the chart's monitoring objects meet their real schemas
# A cold build takes ~5-13 minutes on 2 cores; later runs return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/env.sh
export CGO_ENABLED=0 GOFLAGS=-mod=mod
if [ ! -x "$TIDAL_PROMETHEUS_BIN/prometheus" ] || [ ! -x "$TIDAL_PROMETHEUS_BIN/promtool" ]; then
  echo "building prometheus and promtool $PROMETHEUS_VERSION..."
  start=$(date +%s)
  mkdir -p "$TIDAL_PROMETHEUS_BIN.tmp"
  module=github.com/prometheus/prometheus
  GOBIN="$TIDAL_PROMETHEUS_BIN.tmp" go install -trimpath -tags remove_all_sd,enable_kubernetes_sd \
    -ldflags="-s -w -X github.com/prometheus/common/version.Version=$PROMETHEUS_VERSION" \
    "$module/cmd/prometheus@$PROMETHEUS_MODULE_VERSION" "$module/cmd/promtool@$PROMETHEUS_MODULE_VERSION"
  rm -rf "$TIDAL_PROMETHEUS_BIN" && mv "$TIDAL_PROMETHEUS_BIN.tmp" "$TIDAL_PROMETHEUS_BIN"
  echo "built prometheus and promtool in $(( $(date +%s) - start )) s"
fi
if [ ! -f "$TIDAL_PROMETHEUS_OPERATOR_CRDS/monitoring.coreos.com_prometheusrules.yaml" ]; then
  echo "fetching the Prometheus Operator $PROMETHEUS_OPERATOR_VERSION CRDs..."
  dir=$(go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
  mkdir -p "$TIDAL_PROMETHEUS_OPERATOR_CRDS.tmp"
  for kind in servicemonitors podmonitors prometheusrules; do
    cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml" "$TIDAL_PROMETHEUS_OPERATOR_CRDS.tmp/"
  done
  chmod u+w "$TIDAL_PROMETHEUS_OPERATOR_CRDS.tmp"/*
  rm -rf "$TIDAL_PROMETHEUS_OPERATOR_CRDS" && mv "$TIDAL_PROMETHEUS_OPERATOR_CRDS.tmp" "$TIDAL_PROMETHEUS_OPERATOR_CRDS"
fi
echo "monitoring tools ready: $("$TIDAL_PROMETHEUS_BIN/prometheus" --version 2>&1 | head -1);" \
  "CRDs in $TIDAL_PROMETHEUS_OPERATOR_CRDS"
