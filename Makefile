# Tidal's two entry points for a fresh machine are `make demo` and `make test`; the other targets are their parts.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
ENV := source hack/env.sh &&

.PHONY: help env binaries monitoring-tools image-tools images lint format test test-unit test-kernels test-worker test-e2e demo demo-down crds clean-cache

help:
	@echo "make demo   - local control plane, helm install, SmolLM2 (a real small model), chat, sleep, wake, weight roll"
	@echo "make test   - install what is missing, ruff and mypy, then every test tier (unit, kernels, worker, e2e)"
	@echo "make images - the operator and worker images as OCI layouts (no registry needed), with their digests"

env:  ## Python environment outside the clone (hack/bootstrap-python.sh)
	@bash hack/bootstrap-python.sh

binaries:  ## kube-apiserver, controller-manager, scheduler, kubectl, etcd, helm from their Go modules, cached by version
	@bash hack/build-binaries.sh

monitoring-tools:  ## prometheus, promtool and the Prometheus Operator CRDs from their Go modules, cached by version
	@bash hack/install-monitoring.sh

image-tools:  ## debootstrap, umoci, skopeo, crun from Debian's packages (hack/image-tools.sh)
	@bash hack/image-tools.sh

images: env image-tools  ## both images into $$TIDAL_CACHE/images/oci (docs/IMAGES.md says how to push them)
	@$(ENV) python hack/images/build_images.py

lint: env
	@$(ENV) ruff check . && ruff format --check . && python hack/typecheck.py

format: env
	@$(ENV) ruff format . && ruff check --fix .

test: env binaries monitoring-tools lint
	@bash hack/image-tools.sh --optional
	@$(ENV) python -m pytest

test-unit: env monitoring-tools
	@$(ENV) python -m pytest tests/unit

test-kernels: env
	@$(ENV) python -m pytest tests/kernels

test-worker: env
	@$(ENV) python -m pytest tests/worker

test-e2e: env binaries monitoring-tools
	@$(ENV) python -m pytest tests/e2e

crds: env  ## rewrite crds/, the chart's CRD copy and docs/API.md from the pydantic spec
	@$(ENV) python -m tidal.operator.crdgen

demo: env binaries
	@$(ENV) bash hack/demo.sh

demo-down: env
	@$(ENV) tidal-devcluster down --dir "$${TIDAL_DEMO_DIR:-$$TIDAL_CACHE/demo}"

clean-cache:  ## forget the cached environment and binaries (the next run rebuilds them)
	@$(ENV) rm -rf "$$TIDAL_CACHE"
