//! `vq-controller --check-config`: the config file and the OpenStack
//! credentials are checked in one round, and every problem comes out in
//! one run (architecture review, appendix A). Runs the built binary with a
//! clean environment: no broker, cloud or root needed.

use std::path::Path;
use std::process::Command;

/// Runs `vq-controller --check-config --config <config>` with only `PATH`,
/// `HOME = dir` and `env`; returns (exit code, stdout, stderr).
fn check(dir: &Path, config: &str, env: &[(&str, String)]) -> (i32, String, String) {
    let path = dir.join("controller.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vq-controller"))
        .arg("--check-config")
        .arg("--config")
        .arg(&path)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", dir)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(dir)
        .output()
        .unwrap();
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

const BAD: &str = r#"
cluster = "vq"
interval_secs = "often"
[pools.cms]
flavor = "m1"
image = "img"
agent_broker_url = "amqp://a:b@h/%2f"
slots = "four"
min = 3
max = 1
"#;

#[test]
fn type_value_and_missing_credentials_problems_come_out_in_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let (code, _, err) = check(dir.path(), BAD, &[]);
    assert_eq!(code, 64, "{err}");
    assert_all(
        &err,
        &[
            "interval_secs: expected a number, found the string \"often\"",
            "pools.cms.slots: expected an integer, found the string \"four\"",
            "pools.cms: min 3 is greater than max 1",
            "openstack: no usable credentials: incomplete OpenStack credentials from OS_* \
             environment: auth_url, password, username or user_id, project_name or project_id",
        ],
    );
}

#[test]
fn application_credential_fields_are_checked_with_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let clouds = dir.path().join("clouds.yaml");
    std::fs::write(
        &clouds,
        "clouds:\n  prod:\n    auth_type: v3applicationcredential\n    auth:\n      \
         auth_url: https://keystone.example.org:5000/v3\n",
    )
    .unwrap();
    let config = format!(
        "{BAD}[openstack]\ncloud = \"prod\"\nclouds_yaml = \"{}\"\n",
        clouds.display()
    );
    let (code, _, err) = check(dir.path(), &config, &[]);
    assert_eq!(code, 64, "{err}");
    assert_all(
        &err,
        &[
            "interval_secs: expected a number",
            "pools.cms: min 3 is greater than max 1",
            "openstack: no usable credentials: incomplete OpenStack credentials from clouds.yaml",
            "application_credential_secret, application_credential_id or \
             application_credential_name",
        ],
    );
    // An unknown cloud is named with the files searched, in the same run.
    let (code, _, err) = check(
        dir.path(),
        &config.replace("cloud = \"prod\"", "cloud = \"dev\""),
        &[],
    );
    assert_eq!(code, 64, "{err}");
    assert_all(
        &err,
        &[
            "pools.cms.slots: expected an integer",
            "openstack: no usable credentials: cloud \"dev\" is not defined in any clouds.yaml",
        ],
    );
}

#[test]
fn a_good_config_with_credentials_is_valid() {
    let dir = tempfile::tempdir().unwrap();
    let good = BAD
        .replace("interval_secs = \"often\"\n", "")
        .replace("slots = \"four\"\n", "")
        .replace("min = 3", "min = 0");
    let os = [
        (
            "OS_AUTH_URL",
            "https://keystone.example.org:5000/v3".to_string(),
        ),
        ("OS_USERNAME", "vq".to_string()),
        ("OS_PASSWORD", "secret".to_string()),
        ("OS_PROJECT_NAME", "batch".to_string()),
    ];
    let (code, out, err) = check(dir.path(), &good, &os);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("valid (1 pool(s): cms; OpenStack credentials from OS_* environment)"),
        "{out}"
    );
    // The same credentials, a type error in the file: still refused.
    let (code, _, err) = check(dir.path(), &format!("listen = 9180\n{good}"), &os);
    assert_eq!(code, 64, "{err}");
    assert_all(&err, &["listen: expected a string, found the integer 9180"]);
}

#[test]
fn an_unreadable_config_and_missing_credentials_are_listed_together() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vq-controller"))
        .args(["--check-config", "--config"])
        .arg(dir.path().join("nonexistent.toml"))
        .env_clear()
        .env("HOME", dir.path())
        .current_dir(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert_all(
        &err,
        &[
            "cannot read config file",
            "openstack: no usable credentials",
        ],
    );
}
