"""The node agent's log endpoint over real TLS: only the apiserver's kubelet-client identity may read logs."""

import ssl

import httpx
import pytest

from tidal.devcluster.config import ClusterConfig
from tidal.devcluster.nodeagent.layout import PodDirs
from tidal.devcluster.nodeagent.logserver import serve, tail_lines
from tidal.devcluster.pki import make_cluster_pki
from tidal.devcluster.plan import ADMIN, KUBELET_CLIENT, client_identities


@pytest.fixture
def endpoint(tmp_path):
    cfg = ClusterConfig()
    pki = make_cluster_pki(cfg.first_service_ip, client_identities(cfg))
    files = {}
    for name, data in {
        "ca.crt": pki.ca.cert,
        "serving.crt": pki.node_serving.cert,
        "serving.key": pki.node_serving.key,
        "kubelet.crt": pki.clients[KUBELET_CLIENT.file_name].cert,
        "kubelet.key": pki.clients[KUBELET_CLIENT.file_name].key,
        "admin.crt": pki.clients[ADMIN.file_name].cert,
        "admin.key": pki.clients[ADMIN.file_name].key,
    }.items():
        files[name] = tmp_path / name
        files[name].write_bytes(data)
    pods = tmp_path / "pods"
    dirs = PodDirs.of(pods, "ns", "web", "uid-1")
    dirs.root.mkdir(parents=True)
    dirs.log("main").write_text("one\ntwo\nthree\n")
    dirs.previous_log("main").write_text("before the restart\n")
    server, port = serve(pods, files["serving.crt"], files["serving.key"], files["ca.crt"])
    yield port, files
    server.shutdown()


def _client(files, who: str | None) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(files["ca.crt"]))
    if who:
        ctx.load_cert_chain(str(files[f"{who}.crt"]), str(files[f"{who}.key"]))
    return httpx.Client(verify=ctx, timeout=5)


def test_logs_are_served_to_the_apiserver_identity_only(endpoint):
    port, files = endpoint
    url = f"https://127.0.0.1:{port}/containerLogs/ns/web/main"
    with _client(files, "kubelet") as apiserver:
        assert apiserver.get(url).text == "one\ntwo\nthree\n"
        assert apiserver.get(url, params={"tailLines": "2"}).text == "two\nthree\n"
        assert apiserver.get(url, params={"previous": "true"}).text == "before the restart\n"
        assert apiserver.get(f"https://127.0.0.1:{port}/containerLogs/ns/other/main").status_code == 404
    with _client(files, "admin") as admin:
        assert admin.get(url).status_code == 403
    with _client(files, None) as anonymous:
        assert anonymous.get(f"https://127.0.0.1:{port}/healthz").text == "ok"
        assert anonymous.get(url).status_code == 403


def test_tail_lines():
    assert tail_lines(b"a\nb\nc", 2) == b"b\nc"
    assert tail_lines(b"a\n", 5) == b"a\n"
