"""Environment variables the operator sets on every worker container (the worker CLI reads TIDAL_* variables as its
options). They are derived from the spec, so `spec.worker.env` may not set them."""

MODEL = "TIDAL_MODEL"  # also passed as --model
PORT = "TIDAL_PORT"  # also passed as --port
HOST = "TIDAL_HOST"  # the pod IP: both APIs listen there (on the local dev cluster pods share the host's ports)
SERVED_MODEL_NAME = "TIDAL_SERVED_MODEL_NAME"
DTYPE = "TIDAL_DTYPE"
KV_CACHE_DTYPE = "TIDAL_KV_CACHE_DTYPE"
WEIGHT_DTYPE = "TIDAL_WEIGHT_DTYPE"
MAX_MODEL_LEN = "TIDAL_MAX_MODEL_LEN"
CONTROL_PORT = "TIDAL_CONTROL_PORT"
CONTROL_TOKEN = "TIDAL_CONTROL_TOKEN"
WEIGHTS_PATH = "TIDAL_WEIGHTS_PATH"
WEIGHTS_VERSION = "TIDAL_WEIGHTS_VERSION"
REPLICA = "TIDAL_REPLICA"
RANK = "TIDAL_RANK"
WORLD_SIZE = "TIDAL_WORLD_SIZE"
POD_NAME = "TIDAL_POD_NAME"
GROUP_SERVICE = "TIDAL_GROUP_SERVICE"
# Expert parallelism (set only when spec.expertParallel is above 1; a worker of a group of one ignores them).
GROUP_HOST = "TIDAL_GROUP_HOST"  # the pod IP: the group endpoint listens there
GROUP_PORT = "TIDAL_GROUP_PORT"
GROUP_TIMEOUT_S = "TIDAL_GROUP_TIMEOUT_S"
REDUNDANT_EXPERTS_PER_RANK = "TIDAL_REDUNDANT_EXPERTS_PER_RANK"
# Set on a rank created for a group that already runs: the expert slots its running members report, so that a rank
# created after a resize (world size N', members started for N) stacks the same number of slots as they do.
EXPERT_SLOTS_PER_RANK = "TIDAL_EXPERT_SLOTS_PER_RANK"
# Where the worker writes why it died: the container's terminationMessagePath, which Tidal sets (Kubernetes reads the
# file into the container's last state; the local dev cluster's node agent maps the path to a file of its own).
TERMINATION_MESSAGE_PATH = "TIDAL_TERMINATION_MESSAGE_PATH"

RESERVED_ENV_NAMES: tuple[str, ...] = (
    MODEL,
    PORT,
    HOST,
    SERVED_MODEL_NAME,
    DTYPE,
    KV_CACHE_DTYPE,
    WEIGHT_DTYPE,
    MAX_MODEL_LEN,
    CONTROL_PORT,
    CONTROL_TOKEN,
    WEIGHTS_PATH,
    WEIGHTS_VERSION,
    REPLICA,
    RANK,
    WORLD_SIZE,
    POD_NAME,
    GROUP_SERVICE,
    GROUP_HOST,
    GROUP_PORT,
    GROUP_TIMEOUT_S,
    REDUNDANT_EXPERTS_PER_RANK,
    EXPERT_SLOTS_PER_RANK,
    TERMINATION_MESSAGE_PATH,
)

# Weights change in place (POST /weights/update), so these two do not make a pod outdated when they change.
IN_PLACE_ENV_NAMES: frozenset[str] = frozenset({WEIGHTS_PATH, WEIGHTS_VERSION})
# Nor, for a rank of an expert-parallel group, does the group's shape: a group is resized by epochs (each names its
# group size), so a rank keeps the world size it started with, and the slot count comes from the running members.
# (A pod of expertParallel 1 keeps them in its hash, so its hash is what it was before groups could be resized.)
GROUP_SHAPE_ENV_NAMES: frozenset[str] = frozenset({WORLD_SIZE, EXPERT_SLOTS_PER_RANK})

# Worker options Tidal does not set but relies on staying unset: a control token file beside TIDAL_CONTROL_TOKEN makes
# the worker refuse to start, and a control host other than the pod's IP puts the control API where the operator
# cannot reach it. `spec.worker.env` may not set them either.
GUARDED_ENV_NAMES: tuple[str, ...] = ("TIDAL_CONTROL_TOKEN_FILE", "TIDAL_CONTROL_HOST")

# Two ways to size the worker's KV cache: a block count and a byte size. The worker refuses to start with both (exit
# code 2, so each pod would crash-loop); `spec.worker.env` may set one of them.
NUM_KV_BLOCKS = "TIDAL_NUM_KV_BLOCKS"
KV_CACHE_BYTES = "TIDAL_KV_CACHE_BYTES"
EXCLUSIVE_ENV_NAMES: tuple[tuple[str, str], ...] = ((NUM_KV_BLOCKS, KV_CACHE_BYTES),)
