"""Operations: Prometheus metrics, TLS, loopback by default, no prompt contents in INFO logs."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator
from dataclasses import replace

import grpc
import httpx
import pytest
from conftest import demo_config
from prometheus_client.parser import text_string_to_metric_families
from support import ServerThread, generate

from servicer.cli import config_from_args, parse_args


@pytest.fixture(scope="module")
def metered(demo_dir) -> Iterator[ServerThread]:
    config = demo_config(demo_dir)
    config = replace(config, metrics_port=0)
    with ServerThread(config) as running:
        yield running


def _scrape(running: ServerThread) -> dict[str, dict[tuple, float]]:
    body = httpx.get(f"http://127.0.0.1:{running.server.metrics_port}/metrics").text
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_metrics_endpoint_counts_requests_tokens_latency_and_errors(metered, prompts):
    with metered.channel() as chan:
        ok = generate(chan, prompts[0], temperature=0, max_tokens=7, ignore_eos=True)
        unary = generate(chan, prompts[1], stream=False, max_tokens=3, ignore_eos=True)
        bad = generate(chan, [], max_tokens=3)
    assert ok.error is None and unary.error is None
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT
    m = _scrape(metered)
    assert m["mlx_worker_requests_total"][(("outcome", "length"),)] == 2
    assert m["mlx_worker_requests_total"][(("outcome", "invalid_argument"),)] == 1
    assert m["mlx_worker_errors_total"][(("kind", "invalid_request"),)] == 1
    assert m["mlx_worker_prompt_tokens_total"][()] == len(prompts[0]) + len(prompts[1])
    assert m["mlx_worker_generated_tokens_total"][()] == 10
    assert m["mlx_worker_time_to_first_token_seconds_count"][()] == 2
    assert m["mlx_worker_inter_token_latency_seconds_count"][()] >= 1
    assert m["mlx_worker_engine_step_seconds_count"][()] >= 10
    assert m["mlx_worker_waiting_requests"][()] == 0
    assert m["mlx_worker_running_requests"][()] == 0


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls(demo_dir, tmp_path, reference, prompts):
    cert, key = _self_signed(tmp_path)
    config = demo_config(demo_dir)
    config = replace(config, tls_cert=cert, tls_key=key)
    with ServerThread(config) as running:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        options = [("grpc.ssl_target_name_override", "localhost")]
        with grpc.secure_channel(running.address, credentials, options) as chan:
            outcome = generate(chan, prompts[0], temperature=0, max_tokens=5, ignore_eos=True)
            assert outcome.tokens == reference.greedy(prompts[0], 5)
        with grpc.insecure_channel(running.address) as plain:
            assert generate(plain, prompts[0], max_tokens=2, timeout=5).error is not None


def test_cli_binds_loopback_unless_told_and_tls_needs_both_files():
    assert config_from_args(parse_args([])).host == "127.0.0.1"
    assert config_from_args(parse_args(["--host", "0.0.0.0"])).host == "0.0.0.0"
    with pytest.raises(SystemExit):
        parse_args(["--tls-cert", "cert.pem"])


def test_prompt_contents_never_reach_info_logs(server, channel, caplog):
    caplog.set_level(logging.INFO)
    secret = [401, 402, 403, 404, 405, 406, 407, 408]
    generate(channel, secret, request_id="secret-request", max_tokens=3, ignore_eos=True)
    generate(channel, [*secret, 10**6], request_id="secret-bad", max_tokens=3)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert "401, 402" not in logged and "401 402" not in logged
