"""The control plane's planned command lines and certificates (pure, no processes)."""

import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID
from pydantic import ValidationError

from tidal.devcluster.config import ClusterConfig, resolve_binaries
from tidal.devcluster.layout import StateLayout
from tidal.devcluster.pki import make_cluster_pki
from tidal.devcluster.plan import Ports, client_identities, control_plane

PORTS = Ports(etcd_client=1001, etcd_peer=1002, apiserver=1003, controller_manager=1004, scheduler=1005)
BINARIES = {
    name: Path(f"/bin/{name}") for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
}


def flags(argv: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in argv[1:])


def test_apiserver_flags_enable_rbac_node_authz_and_token_requests(tmp_path):
    cfg = ClusterConfig(state_dir=tmp_path, service_cidr="10.77.0.0/16")
    specs = {s.name: s for s in control_plane(cfg, StateLayout(tmp_path), PORTS, BINARIES)}
    api = flags(specs["kube-apiserver"].argv)
    assert api["authorization-mode"] == "Node,RBAC"
    assert api["bind-address"] == "127.0.0.1" and api["secure-port"] == "1003"
    assert api["etcd-servers"] == "http://127.0.0.1:1001"
    assert api["service-cluster-ip-range"] == "10.77.0.0/16"
    assert {"service-account-issuer", "service-account-signing-key-file", "service-account-key-file"} <= set(api)
    assert specs["kube-apiserver"].health.url == "https://127.0.0.1:1003/readyz"


def test_controller_manager_runs_gc_namespaces_service_accounts_and_the_hpa_without_leader_election(tmp_path):
    cfg = ClusterConfig(state_dir=tmp_path)
    specs = {s.name: s for s in control_plane(cfg, StateLayout(tmp_path), PORTS, BINARIES)}
    cm = flags(specs["kube-controller-manager"].argv)
    controllers = cm["controllers"].split(",")
    for needed in (
        "garbage-collector-controller",
        "namespace-controller",
        "serviceaccount-controller",
        "serviceaccount-token-controller",
        "horizontal-pod-autoscaler-controller",
    ):
        assert needed in controllers
    assert cm["horizontal-pod-autoscaler-sync-period"] == "2s"
    assert cm["leader-elect"] == "false" and cm["use-service-account-credentials"] == "true"
    assert flags(specs["kube-scheduler"].argv)["leader-elect"] == "false"


def test_serving_cert_names_loopback_localhost_and_the_first_service_ip():
    cfg = ClusterConfig(service_cidr="10.77.0.0/16")
    pki = make_cluster_pki(cfg.first_service_ip, client_identities(cfg))
    cert = x509.load_pem_x509_certificate(pki.apiserver.cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.77.0.1"}
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    ca = x509.load_pem_x509_certificate(pki.ca.cert)
    cert.verify_directly_issued_by(ca)


def test_client_certs_carry_user_and_groups():
    cfg = ClusterConfig(node_name="gpu-node")
    pki = make_cluster_pki(cfg.first_service_ip, client_identities(cfg))
    admin = x509.load_pem_x509_certificate(pki.clients["admin"].cert).subject
    assert admin.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    node = x509.load_pem_x509_certificate(pki.clients["node"].cert).subject
    assert node.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:node:gpu-node"
    assert node.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"


def test_config_is_validated_with_clear_errors(tmp_path):
    with pytest.raises(ValidationError, match="service_cidr"):
        ClusterConfig(service_cidr="10.0.0.0/30")
    with pytest.raises(ValidationError):
        ClusterConfig(gpus=-1)
    assert ipaddress.ip_address(ClusterConfig().first_service_ip)


def test_missing_binaries_name_the_build_command(tmp_path):
    with pytest.raises(RuntimeError, match=r"kube-apiserver.*hack/build-binaries.sh"):
        resolve_binaries(ClusterConfig(bin_dir=tmp_path))


def test_busy_loopback_subnets_come_from_listening_sockets():
    from tidal.devcluster.ports import busy_loopback_subnets

    proc_net_tcp = (
        "  sl  local_address rem_address   st tx_queue rx_queue\n"
        "   0: 018F007F:1F90 00000000:0000 0A 00000000:00000000\n"  # 127.0.143.1:8080 listening
        "   1: 0100007F:1F91 00000000:0000 0A 00000000:00000000\n"  # 127.0.0.1 (the control plane)
        "   2: 0105007F:1F92 0100007F:D431 01 00000000:00000000\n"  # 127.0.5.1, established only
    )
    assert busy_loopback_subnets(proc_net_tcp) == {143, 0}
