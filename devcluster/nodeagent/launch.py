"""What to run for one container start: argv, environment and working directory (no process I/O here).

The environment is the agent's own (PATH, the virtualenv, caches; minus its API access), then the node's
additions (HOSTNAME, CUDA_VISIBLE_DEVICES, KUBECONFIG for the pod's identity), then the container's env (its
terminationMessagePath mapped to the container's own file).
"""

import os
from pathlib import Path
from typing import Any

from tidal.devcluster.nodeagent.allocators import container_gpus, visible_devices
from tidal.devcluster.nodeagent.container import LaunchPlan
from tidal.devcluster.nodeagent.envresolve import EnvContext, EnvError, container_argv, container_env
from tidal.devcluster.nodeagent.termination import map_to_host_file

NO_COMMAND = "the tidal node agent runs commands, not images: set the container's `command`"


def base_env(agent_env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in agent_env.items() if not k.startswith(("KUBE", "CUDA_VISIBLE_DEVICES"))}


def plan_launch(
    pod: dict[str, Any],
    container: dict[str, Any],
    ctx: EnvContext,
    gpu_ids: list[int],
    kubeconfig: Path | None,
    workdir: Path,
    termination_log: Path,
) -> LaunchPlan:
    """Raises EnvError (the container waits with CreateContainerConfigError) when it cannot start yet.

    `termination_log`: the container's own file for its termination message, which its environment names wherever
    it names the container's terminationMessagePath."""
    env = base_env(dict(os.environ))
    env["HOSTNAME"] = pod["metadata"]["name"]
    # A container without a GPU request sees no GPU, as with the device plugin on a real node.
    gpus = visible_devices(gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
    env["CUDA_VISIBLE_DEVICES"] = gpus if container_gpus(container) > 0 else ""
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    env.update(map_to_host_file(container_env(pod, container, ctx), container, termination_log))
    argv = container_argv(container, env)
    if not argv:
        raise EnvError(NO_COMMAND)
    return LaunchPlan(argv, env, Path(container.get("workingDir") or workdir))
