"""Weights as the operator names them: a version and the directory (in the pod) it is read from.

The pair is the identity: the same version from another directory is other weights, so a change of
`spec.weights.source` alone rolls like a change of version. A source may be unknown (a worker or a status older than
the field reports none); it then matches any directory, so an older worker is taken at its version's word.
"""

import posixpath
from dataclasses import dataclass

from tidal.operator.api.constants import BASE_WEIGHTS_VERSION
from tidal.operator.api.spec import InferenceModelSpec, ModelVolume


@dataclass(frozen=True)
class Weights:
    version: str
    source: str | None  # directory in the pod; None: not known

    def same_as(self, other: "Weights") -> bool:
        """Same version, and the same directory wherever both are known."""
        if self.version != other.version:
            return False
        if self.source is None or other.source is None:
            return True
        return posixpath.normpath(self.source) == posixpath.normpath(other.source)

    def describe(self) -> str:
        return self.version if self.source is None else f"{self.version} from {self.source}"


def mount_path(volume: ModelVolume) -> str:
    """A hostPath is mounted at its own path, so the same path works on the node and in the pod (on the dev
    cluster pods are host processes and the mount does not happen at all)."""
    return volume.mounted_at()


def model_dir(spec: InferenceModelSpec) -> str:
    return posixpath.join(mount_path(spec.model.volume), spec.model.path)


def desired_weights(spec: InferenceModelSpec) -> Weights:
    """The weights the spec asks for; without spec.weights, model.path's as `base`."""
    if spec.weights is None:
        return Weights(BASE_WEIGHTS_VERSION, model_dir(spec))
    return Weights(spec.weights.version, posixpath.join(mount_path(spec.model.volume), spec.weights.source))
