"""Regular expressions shared by the API models. Written for both Python `re` and RE2 (the API server's engine):
no look-around, no back-references."""

DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A path inside the model volume: relative (the volume's mount point is prepended by the operator).
RELATIVE_PATH = r"^[A-Za-z0-9_.][-A-Za-z0-9_.+@/]*$"
# A `..` segment anywhere: matched with search semantics (CEL `matches` and Python `re.search` both search).
PARENT_SEGMENT = r"(^|/)[.][.](/|$)"
ABSOLUTE_PATH = r"^/[-A-Za-z0-9_.+@/]*$"
# Kubernetes quantities without sign or exponent ("500m", "4", "16Gi"): enough for CPU and memory requests.
QUANTITY = r"^([0-9]+([.][0-9]+)?|[.][0-9]+)([KMGTPE]i|[mkMGTPE])?$"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_.-]*$"
WEIGHTS_VERSION = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
# A label value (also a toleration's value): at most 63 characters, alphanumeric at both ends, or empty.
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
# A label or annotation key (also a toleration's key): a name of at most 63 characters, optionally under a DNS
# subdomain prefix (`example.com/name`). The prefix's own limit (253 characters) is QUALIFIED_NAME_PREFIX_LENGTH.
QUALIFIED_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
QUALIFIED_NAME_PREFIX_LENGTH = r"^([^/]{1,253}/)?[^/]*$"
# An annotation key: the same, but the API server lowercases it before the check, so the prefix may have capitals.
ANNOTATION_KEY = (
    r"^([A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?([.][A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
# No whitespace at either end (the API server refuses such a container image).
TRIMMED = r"^\S(.*\S)?$"
# A path that is only slashes: the root directory.
ROOT_PATH = r"^/+$"
# Mount points that break the container (SYSTEM_MOUNT_POINT, whatever the slashes): at or below /proc (the container
# runtime refuses nearly every mount there) and /sys (the kernel's view, which the GPU driver reads); at /dev (the
# device nodes, GPUs included) and /etc (passwd, hosts, resolv.conf) themselves. Below /dev and /etc is allowed:
# /dev/shm is the usual way to give PyTorch and NCCL more shared memory, /dev/infiniband holds RDMA devices, and
# /etc/ssl/certs a CA bundle.
SYSTEM_DIR = r"^/+((proc|sys)(/.*)?|dev/*|etc/*)$"
# A pod template's volume mount may not be there, nor at the root directory, nor have a `.` or `..` segment anywhere
# (another spelling of some directory). One expression, as the API server's cost estimate of a rule counts each match.
BAD_TEMPLATE_MOUNT = r"^/+((proc|sys)(/.*)?|dev/*|etc/*)?$|(^|/)[.][.]?(/|$)"
# Extended resource names such as nvidia.com/gpu or amd.com/gpu: a name of at most 63 characters under a domain.
RESOURCE_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-z0-9]([-a-z0-9_.]{0,61}[a-z0-9])?$"
