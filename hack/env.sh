# Sourced by the Makefile's recipes and .ci/run: where Tidal keeps what it builds and installs outside the clone.
# Everything heavy is keyed by version so a second run on the same machine reuses it.
export TIDAL_CACHE="${TIDAL_CACHE:-$HOME/.cache/tidal}"
export KUBE_VERSION="v1.36.3"
export HELM_VERSION="v3.19.0"
export TIDAL_BIN="${TIDAL_BIN:-$TIDAL_CACHE/bin/kube-$KUBE_VERSION-helm-$HELM_VERSION}"
# The venv holds an editable install of one clone at a time (the last to run `make`); set TIDAL_VENV to give another
# clone its own.
export TIDAL_VENV="${TIDAL_VENV:-$TIDAL_CACHE/venv-py$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
export PATH="$TIDAL_BIN:$TIDAL_VENV/bin:$PATH"
# Monitoring test tools (hack/install-monitoring.sh): Prometheus and promtool built from their Go module (which tags
# Prometheus 3.x as v0.3xx.y), and the Prometheus Operator's CRDs from its Go module, each under a versioned directory.
export PROMETHEUS_VERSION="3.16.0"
export PROMETHEUS_MODULE_VERSION="v0.316.0"
export PROMETHEUS_OPERATOR_VERSION="v0.85.0"
export TIDAL_PROMETHEUS_BIN="${TIDAL_PROMETHEUS_BIN:-$TIDAL_CACHE/bin/prometheus-$PROMETHEUS_VERSION}"
export TIDAL_PROMETHEUS_OPERATOR_CRDS="${TIDAL_PROMETHEUS_OPERATOR_CRDS:-$TIDAL_CACHE/prometheus-operator-$PROMETHEUS_OPERATOR_VERSION/crds}"
export PATH="$TIDAL_PROMETHEUS_BIN:$PATH"
