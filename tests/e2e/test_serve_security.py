"""The router's gRPC front secured (router/security.py), through a real cluster on the
tiny llama: TLS with a bearer api key and a request-size limit, then mutual TLS. The
certificates are made at test time by trustme: one CA signs the server's certificate
(127.0.0.1, localhost) and a client's; a second CA, that the server does not trust,
signs an impostor's client certificate.

One cluster per configuration (a class each, so the first is stopped before the second
starts); each ends with Served.stop's check that every KV pool is free, which goes
through the secured channel too."""

from __future__ import annotations

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving import Served, start_ray
from tiny_models import tiny_model_dir

from pdserve.client import Client, make_request
from pdserve.router.security import UNAUTHENTICATED_MESSAGE

pytestmark = pytest.mark.slow

API_KEY = "test-key-0123456789"
MAX_REQUEST_BYTES = 64 << 10
MAX_TOKENS = 6
PROMPT = [1, 500, 77, 9]


class PKI:
    """PEM files under `root`: ca.pem, server.pem/server.key, client.pem/client.key (signed
    by ca.pem), impostor.pem/impostor.key (signed by another CA), other_ca.pem."""

    def __init__(self, root):
        ca, other = trustme.CA(), trustme.CA()
        self.ca = str(root / "ca.pem")
        ca.cert_pem.write_to_path(self.ca)
        self.other_ca = str(root / "other_ca.pem")
        other.cert_pem.write_to_path(self.other_ca)
        for name, issuer, identities in (("server", ca, ("127.0.0.1", "localhost")),
                                         ("client", ca, ("client@pdserve.test",)),
                                         ("impostor", other, ("client@pdserve.test",))):
            cert = issuer.issue_cert(*identities)
            cert.private_key_pem.write_to_path(str(root / f"{name}.key"))
            for i, pem in enumerate(cert.cert_chain_pems):
                pem.write_to_path(str(root / f"{name}.pem"), append=i > 0)
            setattr(self, name, (str(root / f"{name}.pem"), str(root / f"{name}.key")))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


def _serve(pki: PKI, client_cert: bool, **router_kw) -> Served:
    start_ray()
    cert, key = pki.server
    client_kw = {"tls_ca_file": pki.ca, "api_key": API_KEY}
    if client_cert:
        client_kw |= {"tls_client_cert_file": pki.client[0],
                      "tls_client_key_file": pki.client[1]}
    return Served(str(tiny_model_dir("llama")), prefill_blocks=32, decode_blocks=32,
                  router_kw={"tls_cert_file": cert, "tls_key_file": key, "api_key": API_KEY,
                             **router_kw},
                  client_kw=client_kw)


def _code_and_details(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def _generate(client: Client) -> tuple[list[int], str, str]:
    return client.generate(make_request(PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        ignore_eos=True))


@pytest.fixture(scope="class")
def tls_served(pki):
    s = _serve(pki, client_cert=False, max_request_bytes=MAX_REQUEST_BYTES)
    yield s
    s.stop()           # every KV pool free, checked through the TLS + key channel


@pytest.fixture(scope="class")
def mtls_served(pki):
    s = _serve(pki, client_cert=True, tls_client_ca_file=pki.ca)
    yield s
    s.stop()           # checked through the mTLS channel, with the client certificate


class TestTLSWithApiKey:
    @pytest.fixture
    def served(self, tls_served):
        return tls_served

    def test_generate_streams_and_status_works(self, served):
        msgs = list(served.client.stream(make_request(PROMPT, max_tokens=MAX_TOKENS,
                                                      temperature=0, ignore_eos=True)))
        assert len(msgs) > 1 and sum(len(m.token_ids) for m in msgs) == MAX_TOKENS
        assert msgs[-1].finish_reason == "length"
        st = served.client.status()
        assert {w.role for w in st.workers} == {"prefill", "decode"}

    @pytest.mark.parametrize("api_key", [None, "wrong-key"])
    def test_missing_or_wrong_key_is_unauthenticated(self, served, pki, api_key):
        with Client(served.address, tls_ca_file=pki.ca, api_key=api_key) as c:
            for call in (lambda: _generate(c), c.status):
                assert _code_and_details(call) == (grpc.StatusCode.UNAUTHENTICATED,
                                                   UNAUTHENTICATED_MESSAGE)

    def test_health_check_needs_no_key(self, served, pki):
        with open(pki.ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(f.read())
        with grpc.secure_channel(served.address, creds) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING

    def test_plaintext_client_is_refused(self, served):
        with Client(served.address, api_key=API_KEY) as c:
            code, _ = _code_and_details(c.status)
        assert code == grpc.StatusCode.UNAVAILABLE

    def test_server_signed_by_an_untrusted_ca_is_refused(self, served, pki):
        with Client(served.address, tls_ca_file=pki.other_ca, api_key=API_KEY) as c:
            code, _ = _code_and_details(c.status)
        assert code == grpc.StatusCode.UNAVAILABLE

    def test_request_beyond_max_request_bytes_is_resource_exhausted(self, served):
        big = make_request("x" * MAX_REQUEST_BYTES, max_tokens=1)
        assert big.ByteSize() > MAX_REQUEST_BYTES
        code, _ = _code_and_details(lambda: served.client.generate(big))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        ids, _, _ = _generate(served.client)     # and the server still serves
        assert len(ids) == MAX_TOKENS


class TestMutualTLS:
    @pytest.fixture
    def served(self, mtls_served):
        return mtls_served

    def test_client_with_certificate_is_served(self, served):
        ids, _, reason = _generate(served.client)
        assert len(ids) == MAX_TOKENS and reason == "length"

    @pytest.mark.parametrize("cert", [None, "impostor"])
    def test_client_without_a_trusted_certificate_is_refused(self, served, pki, cert):
        kw = {}
        if cert:
            kw = dict(zip(("tls_client_cert_file", "tls_client_key_file"), getattr(pki, cert)))
        with Client(served.address, tls_ca_file=pki.ca, api_key=API_KEY, **kw) as c:
            code, _ = _code_and_details(c.status)
        assert code == grpc.StatusCode.UNAVAILABLE

    def test_client_certificate_without_api_key_is_unauthenticated(self, served, pki):
        with Client(served.address, tls_ca_file=pki.ca, tls_client_cert_file=pki.client[0],
                    tls_client_key_file=pki.client[1]) as c:
            assert _code_and_details(c.status)[0] == grpc.StatusCode.UNAUTHENTICATED
