"""Names of the API and of the labels and annotations Tidal puts on the objects it owns."""

from typing import Final

GROUP: Final = "tidal.dev"
VERSION: Final = "v1alpha1"
# GROUP/VERSION spelled out: as a Final literal it has the type the resource model's apiVersion field accepts.
API_VERSION: Final = "tidal.dev/v1alpha1"
KIND: Final = "InferenceModel"
LIST_KIND = "InferenceModelList"
PLURAL = "inferencemodels"
SINGULAR = "inferencemodel"
# Other projects also define an `InferenceModel` kind (e.g. the Gateway API inference extension), so the short
# names carry the project's name and nothing generic like `im`.
SHORT_NAMES = ("tim", "tidalim")
CATEGORIES = ("tidal",)
CRD_NAME = f"{PLURAL}.{GROUP}"

# Labels on every child object. The app.kubernetes.io set is the common one tools understand; tidal.dev/* is ours.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MODEL = "tidal.dev/model"
LABEL_REPLICA = "tidal.dev/replica"
LABEL_RANK = "tidal.dev/rank"
LABEL_LEADER = "tidal.dev/leader"
# "true" while the pod's rank serves: always with expertParallel 1; with expert parallelism, while its rank steps in
# its group's current epoch (set by the operator from the worker's /state). The serving Service selects it.
LABEL_SERVING = "tidal.dev/serving"

APP_NAME = "tidal-worker"
MANAGED_BY = "tidal-operator"
PART_OF = "tidal"

# A hash of what a child was built from; the planner compares it instead of diffing whole manifests.
ANNOTATION_SPEC_HASH = "tidal.dev/spec-hash"

# The weights in `spec.model.path` when `spec.weights` is not set carry this version; users cannot claim it.
BASE_WEIGHTS_VERSION = "base"

# Port of every expert-parallel rank's group endpoint (epoch rendezvous, peer probes): the worker's default. One
# constant for all models: each pod has its own IP, so ranks of different models never collide on it.
GROUP_PORT = 7100

# Longest object name: the pod name `<name>-r<replica>-<rank>` and the Service name `<name>-group` must stay
# DNS labels (<= 63 characters) for every allowed replica and rank count.
MAX_NAME_LENGTH = 50

# The headless Service's suffix (builders/names.py). Model names may not end in it (a CEL rule on the CRD), so that
# no model's serving Service (named as the model) can be another model's headless Service.
GROUP_SERVICE_SUFFIX = "-group"
