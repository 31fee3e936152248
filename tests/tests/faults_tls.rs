//! AMQPS against a private RabbitMQ node with a TLS listener, certificates
//! made by the `openssl` CLI at test time (a CA and a server certificate
//! for `localhost` / 127.0.0.1):
//!
//! * a jobagent configured with an `amqps://` URL and `ca_file` connects
//!   and runs a job;
//! * with a CA that did not sign the server certificate, both
//!   `vq_common::amqp::connect` and the agent fail quickly with a clear
//!   certificate error instead of hanging.
//!
//! With a listener that requires client certificates (`verify_peer`,
//! `fail_if_no_peer_cert`):
//!
//! * `connect` and a jobagent configured with `cert_file`/`key_file` connect
//!   (still logging in with user/password) and the agent runs a job;
//! * without a client certificate, or with one signed by another CA, the
//!   connection fails quickly with a TLS error instead of hanging;
//! * a key that does not belong to the certificate fails before any network
//!   I/O with an error naming the key file.
//!
//! Root only: `cargo test -p vq-tests --test faults_tls -- --include-ignored`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use vq_common::config::BrokerConfig;
use vq_tests::accounts;
use vq_tests::harness::{
    build_bin, ensure_test_user, job, require_root, unique_cluster, wait_agent_up, AgentLaunch,
    TestBroker,
};
use vq_tests::rabbit_node::{NodeOptions, RabbitNode, TlsListener};

const POOL: &str = "tls";
/// Config of every agent here (the harness adds the suite's trust).
const AGENT_TOML: &str = "slots = 1\n";

fn openssl(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("run openssl")?;
    if !out.status.success() {
        bail!(
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Writes `<name>-ca.pem`/`<name>-ca.key` (a self-signed CA) into `dir`.
fn make_ca(dir: &Path, name: &str) -> anyhow::Result<()> {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN=vq test CA {name}"),
            "-keyout",
            &format!("{name}-ca.key"),
            "-out",
            &format!("{name}-ca.pem"),
        ],
    )
}

/// Writes `server.pem`/`server.key` signed by CA `ca` into `dir`.
fn make_server_cert(dir: &Path, ca: &str) -> anyhow::Result<()> {
    make_leaf(
        dir,
        ca,
        "server",
        "/CN=localhost",
        "subjectAltName = IP:127.0.0.1, DNS:localhost\n\
         basicConstraints = CA:FALSE\n\
         keyUsage = digitalSignature, keyEncipherment\n\
         extendedKeyUsage = serverAuth\n",
    )
}

/// Writes `<name>.pem`/`<name>.key` (mode 0600), a client certificate
/// signed by CA `ca`, into `dir`.
fn make_client_cert(dir: &Path, ca: &str, name: &str) -> anyhow::Result<()> {
    make_leaf(
        dir,
        ca,
        name,
        &format!("/CN=vq test client {name}"),
        "basicConstraints = CA:FALSE\n\
         keyUsage = digitalSignature, keyEncipherment\n\
         extendedKeyUsage = clientAuth\n",
    )?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        dir.join(format!("{name}.key")),
        std::fs::Permissions::from_mode(0o600),
    )?;
    Ok(())
}

/// Writes `<name>.pem`/`<name>.key` for subject `subj`, signed by CA `ca`
/// with the x509v3 extensions `ext`, into `dir`.
fn make_leaf(dir: &Path, ca: &str, name: &str, subj: &str, ext: &str) -> anyhow::Result<()> {
    let (key, csr, extfile, pem) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.ext"),
        format!("{name}.pem"),
    );
    openssl(
        dir,
        &[
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", subj, "-keyout", &key, "-out", &csr,
        ],
    )?;
    std::fs::write(dir.join(&extfile), ext)?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca}-ca.pem"),
            "-CAkey",
            &format!("{ca}-ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &extfile,
            "-out",
            &pem,
        ],
    )
}

/// Waits up to `timeout` for `path` to contain `needle`; returns the text.
fn wait_log(path: &Path, needle: &str, timeout: Duration) -> anyhow::Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(needle) {
            return Ok(text);
        }
        if Instant::now() > deadline {
            bail!(
                "no {needle:?} in {} after {timeout:?}:\n{text}",
                path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn agents_connect_over_tls_with_the_configured_ca_and_fail_fast_with_a_wrong_one(
) -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let certs = tempfile::Builder::new().prefix("vq-tls-").tempdir()?;
    make_ca(certs.path(), "good")?;
    make_ca(certs.path(), "other")?;
    make_server_cert(certs.path(), "good")?;
    let good_ca = certs.path().join("good-ca.pem");
    let other_ca = certs.path().join("other-ca.pem");
    let node = RabbitNode::start_new(NodeOptions {
        tls: Some(TlsListener::new(
            good_ca.clone(),
            certs.path().join("server.pem"),
            certs.path().join("server.key"),
        )),
        ..Default::default()
    })
    .await?;
    let tls_port = node.tls_port().context("no TLS port")?;
    // The suite's agent account, over TLS.
    let agent = &accounts::suite().agent;
    let tls_url = agent.url(&format!("amqps://localhost:{tls_port}/%2f"));

    // The library: the right CA connects, a wrong one fails fast.
    let cfg = |ca: &Path| BrokerConfig {
        url: tls_url.clone(),
        ca_file: Some(ca.to_path_buf()),
        connect_timeout_secs: 20,
        ..Default::default()
    };
    let conn = vq_common::amqp::connect(&cfg(&good_ca), "vq-tests tls").await?;
    let _ = conn.close(200, "ok".into()).await;
    let t0 = Instant::now();
    let err = match vq_common::amqp::connect(&cfg(&other_ca), "vq-tests tls wrong ca").await {
        Ok(_) => bail!("connected although the CA did not sign the server certificate"),
        Err(e) => e,
    };
    let elapsed = t0.elapsed();
    let text = format!("{err:#} {:?}", std::error::Error::source(&err));
    eprintln!("wrong CA error after {elapsed:?}: {text}");
    ensure!(
        elapsed < Duration::from_secs(10),
        "wrong CA took {elapsed:?} (timeout 20 s): a hang, not an error"
    );
    ensure!(
        text.to_lowercase().contains("certificate") || text.contains("UnknownIssuer"),
        "the error does not say it is about the certificate: {text}"
    );

    // An agent over amqps with the right CA runs a job.
    let cluster = unique_cluster();
    let broker = TestBroker::connect_at(&node.broker(), &cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let good_dir = tempfile::tempdir()?;
    let good_log = good_dir.path().join("agent.log");
    let good_id = format!("{cluster}-tls1");
    let broker_toml = format!("ca_file = \"{}\"\n", good_ca.display());
    let _good = AgentLaunch {
        url: &tls_url,
        cluster: &cluster,
        pool: POOL,
        agent_id: &good_id,
        extra_toml: AGENT_TOML,
        broker_toml: &broker_toml,
        dir: good_dir.path(),
        stderr: Some(&good_log),
        args: &[],
        env: &[],
    }
    .spawn()?;
    wait_agent_up(&mut tap, &good_id).await.with_context(|| {
        format!(
            "agent log:\n{}",
            std::fs::read_to_string(&good_log).unwrap_or_default()
        )
    })?;
    let j = job(POOL, &alice.name, "tls", "echo over-tls\n");
    broker.publish_job(&j).await?;
    let fin = tap
        .job_event(&j.id, "finished", Duration::from_secs(30))
        .await?;
    ensure!(
        fin["agent"] == good_id.as_str(),
        "finished on the wrong agent: {fin}"
    );

    // An agent with a CA that did not sign the server's certificate logs a
    // certificate error quickly, never heartbeats, and retries.
    let bad_dir = tempfile::tempdir()?;
    let bad_log = bad_dir.path().join("agent.log");
    let bad_id = format!("{cluster}-tls2");
    let broker_toml = format!("ca_file = \"{}\"\n", other_ca.display());
    let t0 = Instant::now();
    let _bad = AgentLaunch {
        url: &tls_url,
        cluster: &cluster,
        pool: POOL,
        agent_id: &bad_id,
        extra_toml: AGENT_TOML,
        broker_toml: &broker_toml,
        dir: bad_dir.path(),
        stderr: Some(&bad_log),
        args: &[],
        env: &[],
    }
    .spawn()?;
    let text = wait_log(&bad_log, "reconnecting", Duration::from_secs(30))?;
    eprintln!("wrong-CA agent log after {:?}:\n{text}", t0.elapsed());
    let line = text
        .lines()
        .find(|l| l.contains("reconnecting"))
        .unwrap_or_default();
    ensure!(
        line.to_lowercase().contains("certificate") || line.contains("UnknownIssuer"),
        "the agent's error does not name the certificate problem: {line}"
    );
    ensure!(
        line.contains(&format!("localhost:{tls_port}")) && !line.contains(&agent.password),
        "the agent's error does not name the (redacted) broker URL: {line}"
    );
    let heard = tap
        .wait_for(
            Duration::from_secs(2),
            "heartbeat of the wrong-CA agent",
            |k, v| k.ends_with(".heartbeat") && v["agent"] == bad_id.as_str(),
        )
        .await;
    ensure!(heard.is_err(), "the wrong-CA agent heartbeated: {heard:?}");
    drop(_bad);

    // ca_file is the only trust store. SSL_CERT_FILE stands in for the
    // system store (rustls-native-certs reads it) and holds the CA that
    // signed the server's certificate. Without ca_file an agent trusts it
    // (the system roots are the default, and the test's stand-in works)...
    let sys_dir = tempfile::tempdir()?;
    let sys_log = sys_dir.path().join("agent.log");
    let sys_id = format!("{cluster}-tls3");
    let _sys = AgentLaunch {
        url: &tls_url,
        cluster: &cluster,
        pool: POOL,
        agent_id: &sys_id,
        extra_toml: AGENT_TOML,
        broker_toml: "",
        dir: sys_dir.path(),
        stderr: Some(&sys_log),
        args: &[],
        env: &[("SSL_CERT_FILE", good_ca.as_os_str())],
    }
    .spawn()?;
    wait_agent_up(&mut tap, &sys_id).await.with_context(|| {
        format!(
            "agent trusting the system store (SSL_CERT_FILE) log:\n{}",
            std::fs::read_to_string(&sys_log).unwrap_or_default()
        )
    })?;
    // ... but with a ca_file of another CA the system store is not
    // consulted: refused.
    let only_dir = tempfile::tempdir()?;
    let only_log = only_dir.path().join("agent.log");
    let only_id = format!("{cluster}-tls4");
    let broker_toml = format!("ca_file = \"{}\"\n", other_ca.display());
    let _only = AgentLaunch {
        url: &tls_url,
        cluster: &cluster,
        pool: POOL,
        agent_id: &only_id,
        extra_toml: AGENT_TOML,
        broker_toml: &broker_toml,
        dir: only_dir.path(),
        stderr: Some(&only_log),
        args: &[],
        env: &[("SSL_CERT_FILE", good_ca.as_os_str())],
    }
    .spawn()?;
    let text = wait_log(&only_log, "reconnecting", Duration::from_secs(30))?;
    let line = text
        .lines()
        .find(|l| l.contains("reconnecting"))
        .unwrap_or_default();
    ensure!(
        line.to_lowercase().contains("certificate") || line.contains("UnknownIssuer"),
        "ca_file did not replace the system store: {line}"
    );
    let heard = tap
        .wait_for(
            Duration::from_secs(2),
            "heartbeat of the ca_file-only agent",
            |k, v| k.ends_with(".heartbeat") && v["agent"] == only_id.as_str(),
        )
        .await;
    ensure!(
        heard.is_err(),
        "an agent whose ca_file does not hold the server's CA connected through the system store: {heard:?}"
    );
    broker.cleanup().await;
    Ok(())
}

/// Runs `bin` with `args`; returns its exit code and stderr.
fn run_check(bin: &Path, args: &[&std::ffi::OsStr]) -> anyhow::Result<(i32, String)> {
    let mut cmd = Command::new(bin);
    cmd.args(args);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("VQ_") || k.to_string_lossy().starts_with("OS_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd
        .output()
        .with_context(|| format!("run {}", bin.display()))?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// `--check-config` of both daemons parses the TLS files as a connect
/// does, and lists every unusable one with the other problems (exit 64):
/// a key of another certificate, an EC key with an RSA certificate, an
/// X.509 v1 certificate (blamed on the certificate, not the key), garbage
/// inside PEM markers, a CA file without a certificate. No broker needed.
#[test]
#[ignore = "builds the daemons and needs the openssl CLI"]
fn check_config_reports_unusable_tls_material() -> anyhow::Result<()> {
    let certs = tempfile::Builder::new().prefix("vq-tlscheck-").tempdir()?;
    let d = certs.path();
    make_ca(d, "good")?;
    make_client_cert(d, "good", "client")?;
    make_client_cert(d, "good", "stranger")?;
    // An X.509 v1 certificate: `x509 -req` without -extfile.
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            "client.csr",
            "-CA",
            "good-ca.pem",
            "-CAkey",
            "good-ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            "v1.pem",
        ],
    )?;
    openssl(
        d,
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            "ec.key",
        ],
    )?;
    std::fs::write(
        d.join("garbage.pem"),
        "-----BEGIN CERTIFICATE-----\n%% not base64 %%\n-----END CERTIFICATE-----\n",
    )?;
    std::fs::write(d.join("empty.pem"), "")?;
    use std::os::unix::fs::PermissionsExt;
    for key in ["ec.key", "client.key", "stranger.key"] {
        std::fs::set_permissions(d.join(key), std::fs::Permissions::from_mode(0o600))?;
    }
    let p = |name: &str| d.join(name).display().to_string();
    // (ca_file, cert_file, key_file, expected problems)
    let cases: Vec<(String, String, String, Vec<String>)> = vec![
        (
            p("good-ca.pem"),
            p("client.pem"),
            p("stranger.key"),
            vec![format!(
                "broker.key_file: {} does not match the certificate",
                p("stranger.key")
            )],
        ),
        (
            p("good-ca.pem"),
            p("client.pem"),
            p("ec.key"),
            vec![format!(
                "broker.key_file: {} does not match the certificate",
                p("ec.key")
            )],
        ),
        (
            p("good-ca.pem"),
            p("v1.pem"),
            p("client.key"),
            vec![
                format!("broker.cert_file: {} holds an X.509 version 1", p("v1.pem")),
                "-extfile".into(),
            ],
        ),
        (
            p("empty.pem"),
            p("garbage.pem"),
            p("client.key"),
            vec![
                format!(
                    "broker.ca_file: {} holds no PEM certificate",
                    p("empty.pem")
                ),
                format!("broker.cert_file: {} is not valid PEM", p("garbage.pem")),
            ],
        ),
        (
            p("garbage.pem"),
            p("client.pem"),
            p("client.key"),
            vec![format!(
                "broker.ca_file: {} is not valid PEM",
                p("garbage.pem")
            )],
        ),
    ];
    let agent = build_bin("vq-jobagent", "jobagent")?;
    let controller = build_bin("vq-controller", "vq-controller")?;
    for (ca, cert, key, needles) in &cases {
        let broker = format!(
            "[broker]\nurl = \"amqps://u:p@localhost:5671/%2f\"\nca_file = \"{ca}\"\n\
             cert_file = \"{cert}\"\nkey_file = \"{key}\"\n"
        );
        // Another problem in each file: listed together with the TLS one.
        let agent_toml = d.join("agent.toml");
        std::fs::write(&agent_toml, format!("pool = \"p\"\nslots = 0\n{broker}"))?;
        let identity = d.join("identity.toml");
        std::fs::write(&identity, "pool = \"p\"\nagent_id = \"a1\"\n")?;
        let (code, err) = run_check(
            &agent,
            &[
                "--check-config".as_ref(),
                "--config".as_ref(),
                agent_toml.as_os_str(),
                "--identity".as_ref(),
                identity.as_os_str(),
                "--state-dir".as_ref(),
                d.join("state").as_os_str(),
            ],
        )?;
        ensure!(code == 64, "jobagent --check-config exited {code}: {err}");
        for needle in needles.iter().map(String::as_str).chain(["slots: 0"]) {
            ensure!(err.contains(needle), "jobagent: {needle:?} not in:\n{err}");
        }
        let controller_toml = d.join("controller.toml");
        std::fs::write(
            &controller_toml,
            format!(
                "interval_secs = 0\n[pools.p]\nflavor = \"f\"\nimage = \"i\"\n\
                 agent_broker_url = \"amqps://a:b@h/%2f\"\n{broker}"
            ),
        )?;
        let (code, err) = run_check(
            &controller,
            &[
                "--check-config".as_ref(),
                "--config".as_ref(),
                controller_toml.as_os_str(),
            ],
        )?;
        ensure!(
            code == 64,
            "vq-controller --check-config exited {code}: {err}"
        );
        for needle in needles
            .iter()
            .map(String::as_str)
            .chain(["interval_secs: 0"])
        {
            ensure!(
                err.contains(needle),
                "vq-controller: {needle:?} not in:\n{err}"
            );
        }
    }
    Ok(())
}

/// Connects with `cfg` expecting a failure within 10 s (the timeout is
/// 20 s); returns the error's text with its sources.
async fn connect_fails_fast(cfg: &BrokerConfig, what: &str) -> anyhow::Result<String> {
    let t0 = Instant::now();
    let err = match vq_common::amqp::connect(cfg, what).await {
        Ok(c) => {
            let _ = c.close(200, "ok".into()).await;
            bail!("{what}: connected although it should have been refused");
        }
        Err(e) => e,
    };
    let elapsed = t0.elapsed();
    let mut text = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    eprintln!("{what}: error after {elapsed:?}: {text} ({err:?})");
    ensure!(
        elapsed < Duration::from_secs(10),
        "{what} took {elapsed:?} (timeout 20 s): a hang, not an error"
    );
    Ok(text)
}

/// Checks that `text` (a connect error) is the broker refusing the TLS
/// handshake: one of the TLS `alerts`, or the connection reset or closed
/// during the handshake (RabbitMQ may close the socket right after sending
/// the alert, before the client has read it: `Connection reset by peer`).
/// Anything else (a refused TCP connect, a timeout, an AMQP-level error) is
/// not a handshake refusal.
fn ensure_handshake_refused(text: &str, alerts: &[&str]) -> anyhow::Result<()> {
    if alerts.iter().any(|a| text.contains(a)) {
        return Ok(());
    }
    let lower = text.to_lowercase();
    let reset_or_eof = [
        "connection reset by peer",
        "os error 104",
        "unexpected end of file",
        "unexpectedeof",
        "peer closed connection without sending tls close_notify",
        "broken pipe",
    ];
    ensure!(
        reset_or_eof.iter().any(|r| lower.contains(r)),
        "neither a TLS alert ({alerts:?}) nor a reset/EOF during the handshake: {text}"
    );
    ensure!(
        !lower.contains("connection refused") && !lower.contains("timed out"),
        "not a handshake refusal: {text}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs root"]
async fn client_certificates_are_presented_when_the_broker_requires_them() -> anyhow::Result<()> {
    if !require_root() {
        return Ok(());
    }
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let certs = tempfile::Builder::new().prefix("vq-mtls-").tempdir()?;
    let d = certs.path();
    make_ca(d, "good")?;
    make_ca(d, "other")?;
    make_server_cert(d, "good")?;
    make_client_cert(d, "good", "client")?;
    make_client_cert(d, "other", "stranger")?;
    let good_ca = d.join("good-ca.pem");
    let node = RabbitNode::start_new(NodeOptions {
        tls: Some(TlsListener {
            require_peer_cert: true,
            ..TlsListener::new(good_ca.clone(), d.join("server.pem"), d.join("server.key"))
        }),
        ..Default::default()
    })
    .await?;
    let tls_port = node.tls_port().context("no TLS port")?;
    let tls_url = accounts::suite()
        .agent
        .url(&format!("amqps://localhost:{tls_port}/%2f"));
    let cfg = |client: Option<&str>| BrokerConfig {
        url: tls_url.clone(),
        ca_file: Some(good_ca.clone()),
        cert_file: client.map(|c| d.join(format!("{c}.pem"))),
        key_file: client.map(|c| d.join(format!("{c}.key"))),
        connect_timeout_secs: 20,
        ..Default::default()
    };
    // The config a daemon would load passes validation.
    let agent_cfg = vq_common::config::AgentConfig {
        pool: POOL.into(),
        broker: cfg(Some("client")),
        ..Default::default()
    };
    if let Err(problems) = agent_cfg.validate() {
        bail!("config problems: {problems:?}");
    }

    // The library: a certificate of the broker's CA connects.
    let conn = vq_common::amqp::connect(&cfg(Some("client")), "vq-tests mtls").await?;
    let _ = conn.close(200, "ok".into()).await;

    // No certificate: the broker ends the handshake, fast. (TLS 1.3 sends
    // certificate_required, TLS 1.2 handshake_failure; but the broker may
    // close the socket before the client reads the alert, and then the
    // client sees a reset or EOF instead: both are a refusal.)
    let text = connect_fails_fast(&cfg(None), "no client certificate").await?;
    ensure_handshake_refused(&text, &["CertificateRequired", "HandshakeFailure"])?;
    // A certificate of another CA: refused the same way.
    let text = connect_fails_fast(&cfg(Some("stranger")), "client cert of another CA").await?;
    ensure_handshake_refused(&text, &["UnknownCA", "BadCertificate"])?;
    // The refusals were about the certificates: the same node still takes
    // the client with its good certificate.
    let conn = vq_common::amqp::connect(&cfg(Some("client")), "vq-tests mtls again")
        .await
        .context("the good client certificate, after the refusals")?;
    let _ = conn.close(200, "ok".into()).await;
    // A key that is not the certificate's: refused before connecting, by
    // name.
    let mismatched = BrokerConfig {
        key_file: Some(d.join("stranger.key")),
        ..cfg(Some("client"))
    };
    let text = connect_fails_fast(&mismatched, "mismatched key").await?;
    ensure!(
        text.contains(&d.join("stranger.key").display().to_string())
            && text.contains("does not match the certificate"),
        "the mismatched-key error does not name the key file: {text}"
    );

    // An agent with the client certificate runs a job.
    let cluster = unique_cluster();
    let broker = TestBroker::connect_at(&node.broker(), &cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("agent.log");
    let id = format!("{cluster}-mtls1");
    let broker_toml = format!(
        "ca_file = \"{}\"\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
        good_ca.display(),
        d.join("client.pem").display(),
        d.join("client.key").display()
    );
    let _agent = AgentLaunch {
        url: &tls_url,
        cluster: &cluster,
        pool: POOL,
        agent_id: &id,
        extra_toml: AGENT_TOML,
        broker_toml: &broker_toml,
        dir: dir.path(),
        stderr: Some(&log),
        args: &[],
        env: &[],
    }
    .spawn()?;
    wait_agent_up(&mut tap, &id).await.with_context(|| {
        format!(
            "agent log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    })?;
    let j = job(POOL, &alice.name, "mtls", "echo over-mutual-tls\n");
    broker.publish_job(&j).await?;
    let fin = tap
        .job_event(&j.id, "finished", Duration::from_secs(30))
        .await?;
    ensure!(
        fin["agent"] == id.as_str(),
        "finished on the wrong agent: {fin}"
    );
    broker.cleanup().await;
    Ok(())
}
