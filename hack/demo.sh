#!/usr/bin/env bash
# `make demo`: a local control plane, the chart, a tiny model, one completion. Needs `source hack/env.sh` (the Makefile
# does it) and the binaries from `make binaries`. Leaves the cluster running; `make demo-down` stops it.
set -euo pipefail

DEMO_DIR="${TIDAL_DEMO_DIR:-$TIDAL_CACHE/demo}"
MODELS=/tmp/tidal-models  # the hostPath in examples/tiny-model.yaml
NS=default
RELEASE=tidal
OPERATOR_NS=tidal-system

step() { printf '\n==> %s\n' "$*"; }

# `up` refuses to start over a running cluster: stop an earlier demo first (a no-op when none runs).
tidal-devcluster down --dir "$DEMO_DIR"

step "starting the local control plane in $DEMO_DIR"
tidal-devcluster up --dir "$DEMO_DIR"
export KUBECONFIG="$DEMO_DIR/kubeconfig"
export HELM_CONFIG_HOME="$DEMO_DIR/helm-home/config" HELM_CACHE_HOME="$DEMO_DIR/helm-home/cache"
export HELM_DATA_HOME="$DEMO_DIR/helm-home/data"

step "helm install $RELEASE charts/tidal (operator, CRD, RBAC) into $OPERATOR_NS"
helm install "$RELEASE" charts/tidal --namespace "$OPERATOR_NS" --create-namespace --wait --timeout 3m
kubectl -n "$OPERATOR_NS" get pods -o wide

step "writing the tiny example model to $MODELS/tiny-llama"
python -m tidal.worker.testing.tiny_models --arch llama --out "$MODELS/tiny-llama"

step "kubectl apply -f examples/tiny-model.yaml"
kubectl -n "$NS" apply -f examples/tiny-model.yaml
if ! kubectl -n "$NS" wait --for=jsonpath='{.status.phase}'=Ready inferencemodel.tidal.dev/tiny --timeout=5m; then
    kubectl -n "$NS" describe inferencemodel.tidal.dev/tiny
    kubectl -n "$OPERATOR_NS" logs deploy/"$RELEASE"-operator --tail 50 || true
    exit 1
fi

# The devcluster has no Service VIPs: talk to the replica leader's pod IP.
LEADER=$(kubectl -n "$NS" get pods -l tidal.dev/model=tiny,tidal.dev/leader=true -o jsonpath='{.items[0].metadata.name}')
IP=$(kubectl -n "$NS" get pod "$LEADER" -o jsonpath='{.status.podIP}')
PORT=$(kubectl -n "$NS" get inferencemodel.tidal.dev/tiny -o jsonpath='{.spec.serving.port}')
step "POST http://$IP:$PORT/v1/completions (pod $LEADER; random tiny weights, so the text is noise)"
curl -sS --fail-with-body "http://$IP:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "tiny", "prompt": "The tide comes in and", "max_tokens": 16, "temperature": 0}'
echo

step "kubectl get inferencemodels"
kubectl -n "$NS" get inferencemodels.tidal.dev -o wide

cat <<EOT

The cluster keeps running. To use it:
  source hack/env.sh; export KUBECONFIG=$KUBECONFIG
  kubectl describe tim tiny                                              # conditions, per-rank table, events
  kubectl patch tim tiny --type merge -p '{"spec":{"sleep":{"state":"Asleep"}}}'   # sleep (Awake wakes it)
  kubectl -n $OPERATOR_NS logs deploy/$RELEASE-operator                  # the operator
  curl http://$IP:$PORT/v1/completions -H 'Content-Type: application/json' -d '{"model":"tiny","prompt":"Hi","max_tokens":8}'
Stop it with: make demo-down
EOT
