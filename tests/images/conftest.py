"""The image tier: builds images as `make images` does (hack/images/) and looks inside them."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The builder's modules import each other as siblings, as when hack/images/build_images.py runs as a script.
sys.path.insert(0, str(REPO / "hack" / "images"))
