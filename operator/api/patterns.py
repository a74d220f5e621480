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
# Extended resource names such as nvidia.com/gpu or amd.com/gpu.
RESOURCE_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$"
WEIGHTS_VERSION = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
