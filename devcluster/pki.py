"""Certificates for the local control plane: one CA, the apiserver's serving cert, client certs, the SA key pair.

ECDSA P-256 everywhere: every Kubernetes component accepts it, and generating a key takes microseconds where RSA
takes tens of milliseconds (startup time matters on 2 cores).
"""

import datetime as dt
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)


@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate's user (CN) and groups (O), which the apiserver's x509 authenticator reads."""

    file_name: str
    user: str
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterPki:
    ca: Pem
    apiserver: Pem
    node_serving: Pem  # the node agent's log endpoint, which the apiserver dials for `kubectl logs`
    clients: dict[str, Pem]  # file name -> cert/key
    service_account_private: bytes
    service_account_public: bytes


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        # Back-dated a little so a clock a second behind does not reject a fresh cert.
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def make_ca(common_name: str = "tidal-devcluster-ca") -> tuple[Pem, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _new_key()
    name = _name(common_name)
    cert = (
        _builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)), key, cert


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    subject: x509.Name,
    usages: list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName] | None = None,
) -> Pem:
    key = _new_key()
    builder = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=False,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def serving_sans(first_service_ip: str, extra_dns: tuple[str, ...] = ()) -> list[x509.GeneralName]:
    dns = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
        *extra_dns,
    ]
    ips = ["127.0.0.1", first_service_ip]
    return [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]


def make_cluster_pki(first_service_ip: str, clients: list[ClientIdentity]) -> ClusterPki:
    """All key material of one cluster, in memory; writing it is the caller's concern."""
    ca_pem, ca_key, ca_cert = make_ca()
    apiserver = _leaf(
        ca_key, ca_cert, _name("kube-apiserver"), [ExtendedKeyUsageOID.SERVER_AUTH], serving_sans(first_service_ip)
    )
    node_serving = _leaf(
        ca_key,
        ca_cert,
        _name("tidal-node-agent"),
        [ExtendedKeyUsageOID.SERVER_AUTH],
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_pems = {
        c.file_name: _leaf(ca_key, ca_cert, _name(c.user, c.groups), [ExtendedKeyUsageOID.CLIENT_AUTH]) for c in clients
    }
    sa_key = _new_key()
    sa_public = sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return ClusterPki(ca_pem, apiserver, node_serving, client_pems, _key_pem(sa_key), sa_public)
