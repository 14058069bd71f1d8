"""The security settings: the config's `security` section and flags, the worker secret's sources,
the workers' max_k, client credentials, and how a client is told apart for the per-client limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import load_config
from router.client_limit import client_key
from specdec.rpc import worker_secret
from specdec.rpc.api_security import SecurityConfig
from specdec.rpc.client_credentials import ClientCredentials
from specdec.rpc.worker_config import WorkerConfig
from specdec.rpc.worker_host import advertised_host, bind_host

TOKEN = "t" * 32


def _config(tmp_path, text: str, **kw):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path, **kw)


def test_security_section_flags_and_print_config(tmp_path, monkeypatch):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    cfg = _config(tmp_path, f"target: {{model: m}}\nsecurity: {{tokens_file: {tokens}}}\n")
    assert cfg.security.token_auth and not cfg.security.tls and cfg.security.exempt == ["health"]
    cfg.security.check_files()
    assert cfg.security.tokens().accepts(TOKEN)
    printed = yaml.safe_dump(cfg.to_dict())
    assert str(tokens) in printed and TOKEN not in printed  # paths and names, never a secret
    # flags replace the section's keys
    over = _config(tmp_path, "target: {model: m}\n", security={"tls_cert": "c.pem", "tls_key": "k.pem", "exempt": []})
    assert over.security.tls and over.security.exempt == [] and over.security.tokens() is None
    with pytest.raises(ValueError, match="security.tls_cert: no such file"):
        over.security.check_files()
    for bad, match in (
        ({"tls_cert": "c.pem"}, "go together"),
        ({"tls_client_ca": "ca.pem"}, "needs TLS"),
        ({"exempt": ["metrics"]}, "security.exempt"),
        ({"token_file": "x"}, r"security.token_file: unknown key; did you mean \"tokens_file\""),
    ):
        with pytest.raises(ValueError, match=match):
            SecurityConfig.from_dict(bad)
    monkeypatch.setenv("SPECDEC_TEST_API_TOKENS", "")
    with pytest.raises(ValueError, match="no tokens"):
        SecurityConfig(tokens_env="SPECDEC_TEST_API_TOKENS").check_files()


def test_workers_max_k_follows_the_router(tmp_path):
    cfg = _config(tmp_path, "target: {model: m}\ndraft: {model: ngram}\nrouter: {k_policy: {k: 3, k_max: 9}}\n")
    assert cfg.target.worker.max_k == 9 and cfg.draft.worker.max_k == 9
    assert load_config(tmp_path / "c.yaml").to_dict()["target"]["max_k"] == 9
    with pytest.raises(ValueError, match="below router.k_policy.k_max"):
        _config(tmp_path, "target: {model: m, max_k: 4}\nrouter: {k_policy: {k: 3, k_max: 9}}\n")


def test_worker_host_node_binds_the_node_address():
    node = WorkerConfig(model="m", host="node")
    assert bind_host(node, "10.1.2.3") == advertised_host(node, "10.1.2.3") == "10.1.2.3"
    assert bind_host(WorkerConfig(model="m"), "10.1.2.3") == "127.0.0.1"
    wild = WorkerConfig(model="m", host="0.0.0.0")
    assert bind_host(wild, "10.1.2.3") == "0.0.0.0" and advertised_host(wild, "10.1.2.3") == "10.1.2.3"


def test_worker_secret_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(worker_secret.SECRET_ENV, raising=False)
    monkeypatch.delenv(worker_secret.SECRET_FILE_ENV, raising=False)
    assert worker_secret.current_secret() is None
    with pytest.raises(worker_secret.MissingSecret, match="SPECDEC_WORKER_SECRET"):
        worker_secret.require_secret()
    fresh = worker_secret.ensure_secret()  # a new one, set for this process (and what it starts)
    assert len(fresh) >= 32 and worker_secret.require_secret() == fresh
    assert worker_secret.ensure_secret() == fresh  # kept while it is there
    f = tmp_path / "secret"
    f.write_text("s" * 40 + "\n")
    assert worker_secret.ensure_secret(f) == "s" * 40 == worker_secret.current_secret()
    f.write_text("short")
    with pytest.raises(ValueError, match="16 characters"):
        worker_secret.ensure_secret(f)


def test_client_credentials(tmp_path, monkeypatch):
    f = tmp_path / "token"
    f.write_text(f"# ours\n{TOKEN}\nsecond-token-not-sent-xxxxxxxx\n")
    creds = ClientCredentials.load(str(f))
    assert creds.token == TOKEN and not creds.secure and TOKEN not in repr(creds)
    monkeypatch.setenv("SPECDEC_API_TOKEN", "e" * 20)
    assert ClientCredentials.load().token == "e" * 20 and ClientCredentials.load(token_env=None).token is None
    assert ClientCredentials.load(ca="ca.pem").secure and ClientCredentials(tls=True).secure
    with pytest.raises(ValueError, match="go together"):
        ClientCredentials(cert="c.pem")


def test_client_key_is_the_token_else_the_peer_address():
    a = client_key([("authorization", f"Bearer {TOKEN}")], "ipv4:10.0.0.1:5000")
    assert a == client_key([("authorization", f"Bearer {TOKEN}")], "ipv4:10.0.0.2:6000")  # same token
    assert TOKEN not in a and a != client_key([("authorization", "Bearer other-" + "x" * 20)], "ipv4:10.0.0.1:5000")
    assert client_key([], "ipv4:10.0.0.1:5000") == client_key([], "ipv4:10.0.0.1:5001") == "peer:ipv4:10.0.0.1"
    assert client_key([], "ipv6:[::1]:5000") == "peer:ipv6:[::1]"


def test_a_public_bind_without_tls_and_tokens_is_refused_unless_allowed(tmp_path):
    """configs/cluster.yaml binds 0.0.0.0: `specdec serve` starts it only with TLS and tokens, or
    with security.allow_insecure (cluster.launch.check_exposure, before anything starts)."""
    from cluster.launch import check_exposure

    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    tls = f"tls_cert: {tmp_path}/c.pem, tls_key: {tmp_path}/k.pem"
    cases = {
        "router: {host: 127.0.0.1}": True,
        "router: {host: '::1'}": True,
        "router: {host: 0.0.0.0}": False,
        f"router: {{host: 0.0.0.0}}\nsecurity: {{tokens_file: {tokens}}}": False,
        f"router: {{host: 0.0.0.0}}\nsecurity: {{{tls}}}": False,
        f"router: {{host: 0.0.0.0}}\nsecurity: {{{tls}, tokens_file: {tokens}}}": True,
        "router: {host: 10.0.0.5}\nsecurity: {allow_insecure: true}": True,
    }
    for text, starts in cases.items():
        cfg = _config(tmp_path, "target: {model: m}\n" + text + "\n")
        if starts:
            check_exposure(cfg)
            continue
        with pytest.raises(ValueError, match="beyond this machine without .*allow_insecure") as err:
            check_exposure(cfg)
        missing = str(err.value).split(" without ")[1].split(":")[0]  # what the message says is missing
        assert ("TLS" in missing, "tokens" in missing) == (not cfg.security.tls, not cfg.security.token_auth), text
    # the shipped cluster file is refused as it stands, and says how to fix it
    with pytest.raises(ValueError, match="security.tls_cert .* security.tokens_file"):
        check_exposure(load_config(Path(__file__).resolve().parents[2] / "configs" / "cluster.yaml"))
