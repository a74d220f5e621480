"""Where a pod's files live under the node agent's state dir: <pods>/<namespace>/<name>/<uid>/.

The uid level keeps a recreated pod (same name, new uid) from mixing its logs with its predecessor's.
"""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PodDirs:
    root: Path

    @classmethod
    def of(cls, pods_dir: Path, namespace: str, name: str, uid: str) -> "PodDirs":
        return cls(pods_dir / namespace / name / uid)

    @classmethod
    def newest(cls, pods_dir: Path, namespace: str, name: str) -> "PodDirs":
        """The most recently created incarnation of a pod name (what a test usually means by "the pod")."""
        candidates = [p for p in (pods_dir / namespace / name).glob("*") if p.is_dir()]
        if not candidates:
            raise LookupError(f"no files for pod {namespace}/{name} under {pods_dir}")
        return cls(max(candidates, key=lambda p: p.stat().st_mtime_ns))

    def log(self, container: str) -> Path:
        return self.root / f"{container}.log"

    def previous_log(self, container: str) -> Path:
        return self.root / f"{container}.previous.log"

    def pidfile(self, container: str) -> Path:
        return self.root / f"{container}.pid"

    def termination_log(self, container: str) -> Path:
        """The file that stands in for the container's terminationMessagePath (see nodeagent/termination.py)."""
        return self.root / f"{container}.termination-log"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def workdir(self) -> Path:
        """The default working directory of the pod's processes (a scratch dir of its own)."""
        return self.root / "work"

    @property
    def applied_faults(self) -> Path:
        return self.root / "faults-applied"


def container_log(
    pods_dir: Path, namespace: str, name: str, container: str, uid: str | None = None, previous: bool = False
) -> Path:
    """The log file of a container's current run (or, with previous, of the run before its last restart)."""
    dirs = PodDirs.of(pods_dir, namespace, name, uid) if uid else PodDirs.newest(pods_dir, namespace, name)
    return dirs.previous_log(container) if previous else dirs.log(container)
