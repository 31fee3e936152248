//! `jobagent --check-config`: the config file, the identity file and the
//! host-name default are checked in one round, and every problem comes out
//! in one run (architecture review, appendix A). Runs the built binary
//! with a clean environment: no broker and no root needed.

use std::path::Path;
use std::process::Command;

/// Runs `jobagent --check-config` on `config` (and `identity`, if any) in
/// `dir`; returns (exit code, stdout, stderr).
fn check(dir: &Path, config: &str, identity: Option<&str>) -> (i32, String, String) {
    let cfg = dir.join("jobagent.toml");
    std::fs::write(&cfg, config).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_jobagent"));
    cmd.arg("--check-config")
        .arg("--config")
        .arg(&cfg)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env_clear()
        .env("PATH", "/usr/bin:/bin");
    if let Some(text) = identity {
        let id = dir.join("identity.toml");
        std::fs::write(&id, text).unwrap();
        cmd.arg("--identity").arg(id);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn assert_all(err: &str, needles: &[&str]) {
    for needle in needles {
        assert!(err.contains(needle), "{needle:?} not in:\n{err}");
    }
}

/// The review's `types.toml`: the unknown key, both type errors and the
/// value error in one run.
#[test]
fn the_review_s_types_toml_names_every_key() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = check(
        dir.path(),
        "pool = \"cms\"\nagent_id = \"a1\"\nslots = \"four\"\nheartbeat_secs = \"often\"\n\
         min_uid = 0\ncolour = 1\n",
        None,
    );
    assert_eq!(code, 64, "{err}");
    assert_all(
        &err,
        &[
            "colour: unknown key",
            "slots: expected an integer, found the string \"four\"",
            "heartbeat_secs: expected a number, found the string \"often\"",
            "min_uid: 0 would allow jobs as root",
        ],
    );
}

#[test]
fn identity_problems_come_out_with_the_config_s() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = check(
        dir.path(),
        "slots = \"four\"\ndefault_umask = 0o1777\n",
        Some("pool = \"cms\"\nagent_id = 12\nloss_limit = \"three\"\n"),
    );
    assert_eq!(code, 64, "{err}");
    let id = dir.path().join("identity.toml");
    assert_all(
        &err,
        &[
            &format!(
                "identity file {}: agent_id: expected a string, found the integer 12",
                id.display()
            ),
            &format!(
                "identity file {}: loss_limit: expected an integer",
                id.display()
            ),
            "slots: expected an integer, found the string \"four\"",
            "default_umask: 1777 is not a umask",
        ],
    );
}

#[test]
fn a_good_config_and_identity_are_valid() {
    let dir = tempfile::tempdir().unwrap();
    let (code, out, err) = check(
        dir.path(),
        "slots = 2\n",
        Some("pool = \"cms\"\nagent_id = \"vq-cms-1\"\nloss_limit = 5\n"),
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("pool cms agent vq-cms-1"), "{out}");
}
