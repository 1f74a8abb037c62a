"""Exposure (issue 13): services listen on 127.0.0.1 by default; the gateway serves TLS (with optional client
certificates) and checks an API key (UNAUTHENTICATED without it); request size is limited; the CLI client
speaks all of it and reports refusals in one line. Certificates are generated here (self-signed CA)."""
import datetime
import ipaddress
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from reliability_stack import (SERVING, answers_health, generate, health, references, spawn_gateway, start_stack,
                               stop, tiny_with_tokenizer, wait_for)

from specdec_tools.cli import main
from specdec_tools.local_stack import free_port
from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(300)
PROMPT = [5, 17, 3, 99, 42]
API_KEY = "k3y-" + "0123456789abcdef" * 2


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca, common_name: str, server: bool) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) signed by `ca`; server certificates name 127.0.0.1 and localhost."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    return _pem_key(key), builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("certs")
    ca, other_ca = make_ca("specdec test CA"), make_ca("some other CA")
    files = {"ca": ca[1].public_bytes(serialization.Encoding.PEM)}
    files["server.key"], files["server.crt"] = issue(ca, "gateway", server=True)
    files["client.key"], files["client.crt"] = issue(ca, "client", server=False)
    files["stranger.key"], files["stranger.crt"] = issue(other_ca, "stranger", server=False)
    files["api.key"] = (API_KEY + "\n").encode()
    paths = {}
    for name, data in files.items():
        paths[name] = folder / name
        paths[name].write_bytes(data)
    return paths


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_with_tokenizer(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    stack = start_stack(model_dir, tmp_path_factory.mktemp("logs"), "ngram")
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def expected(model_dir):
    return references(model_dir, [PROMPT], 8)[0]


def credentials(certs, client: str | None = None) -> grpc.ChannelCredentials:
    key_and_cert = {}
    if client:
        key_and_cert = dict(private_key=certs[f"{client}.key"].read_bytes(),
                            certificate_chain=certs[f"{client}.crt"].read_bytes())
    return grpc.ssl_channel_credentials(root_certificates=certs["ca"].read_bytes(), **key_and_cert)


def secure_gateway(stack, model_dir, tmp_path, certs, *extra):
    port = free_port()
    proc = spawn_gateway(f"127.0.0.1:{stack.ports['verifier']}", port, tmp_path / f"gateway-{port}.log",
                         "--model", model_dir, "--tls-cert", str(certs["server.crt"]),
                         "--tls-key", str(certs["server.key"]), *extra)
    return proc, f"127.0.0.1:{port}"


def listening(port: int) -> list[str]:
    """Local addresses of the LISTEN sockets on `port` (from /proc/net/tcp and tcp6; v4-mapped shown as v4)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hex_address, hex_port = local.rsplit(":", 1)
            if state != "0A" or int(hex_port, 16) != port:
                continue
            raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, len(hex_address), 8))
            ip = ipaddress.ip_address(raw)  # /proc prints each 32-bit word in host (little-endian) order
            found.append(str(getattr(ip, "ipv4_mapped", None) or ip))
    return found


def test_services_listen_on_loopback_only(stack):
    for name in ("gateway", "verifier", "drafter"):
        addresses = listening(stack.ports[name])
        assert addresses and set(addresses) == {"127.0.0.1"}, (name, addresses)


def test_tls_gateway_with_api_key(stack, model_dir, expected, tmp_path, certs):
    proc, address = secure_gateway(stack, model_dir, tmp_path, certs, "--api-key-file", str(certs["api.key"]),
                                   "--max-request-bytes", "65536")
    try:
        tls = credentials(certs)
        wait_for(lambda: answers_health(address, tls) and health(address, credentials=tls) == SERVING, 60,
                 "TLS gateway serving")  # health needs no key
        with grpc.insecure_channel(address) as plain:
            with pytest.raises(grpc.RpcError) as error:
                generate(gateway_pb2_grpc.GatewayStub(plain), PROMPT, 8, timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE  # no plaintext on a TLS port
        with grpc.secure_channel(address, tls) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for metadata in ((), (("authorization", "Bearer wrong-key-0123456789"),), (("authorization", API_KEY),)):
                for call in (lambda: generate(stub, PROMPT, 8, timeout=10, metadata=metadata),
                             lambda: stub.Info(gateway_pb2.InfoRequest(), timeout=10, metadata=metadata)):
                    with pytest.raises(grpc.RpcError) as error:
                        call()
                    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in error.value.details()
            good = (("authorization", f"Bearer {API_KEY}"),)
            assert generate(stub, PROMPT, 8, metadata=good)[0] == expected
            big = gateway_pb2.GenerateRequest(prompt="x" * 100_000)
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(big, timeout=10, metadata=good))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        cli = [sys.executable, "-m", "specdec", "generate", "--address", address, "--tls-ca", str(certs["ca"]),
               "--prompt-token-ids", ",".join(map(str, PROMPT)), "--max-tokens", "8", "--ignore-eos"]
        ok = subprocess.run(cli + ["--api-key-file", str(certs["api.key"])], capture_output=True, text=True,
                            timeout=120)
        assert ok.returncode == 0 and "finish: length" in ok.stderr and "8 completion tokens" in ok.stderr, ok.stderr
        assert main(["health", address, "--tls-ca", str(certs["ca"])]) == 0  # the CLI probe speaks TLS too
        refused = subprocess.run(cli, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    finally:
        stop(proc)


def test_client_certificates_required(stack, model_dir, expected, tmp_path, certs):
    proc, address = secure_gateway(stack, model_dir, tmp_path, certs, "--tls-client-ca", str(certs["ca"]))
    try:
        client = credentials(certs, "client")  # SERVING: the gateway reaches the verifier, not just listens
        wait_for(lambda: answers_health(address, client) and health(address, credentials=client) == SERVING, 60,
                 "mTLS gateway serving")
        for who in (None, "stranger"):  # no certificate, or one from another CA: the handshake fails
            with grpc.secure_channel(address, credentials(certs, who)) as channel:
                with pytest.raises(grpc.RpcError) as error:
                    generate(gateway_pb2_grpc.GatewayStub(channel), PROMPT, 8, timeout=10)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(address, credentials(certs, "client")) as channel:
            assert generate(gateway_pb2_grpc.GatewayStub(channel), PROMPT, 8)[0] == expected
    finally:
        stop(proc)


@pytest.mark.parametrize("flags,message", [
    (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
    (["--tls-cert", "missing.pem", "--tls-key", "missing.key"], "--tls-cert missing.pem: cannot read it"),
    (["--api-key-file", "missing.key"], "--api-key-file missing.key: cannot read it"),
    (["--max-request-bytes", "10"], "--max-request-bytes"),
])
def test_bad_security_flags_are_one_line_errors(flags, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(["gateway", "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
