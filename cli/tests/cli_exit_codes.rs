//! Exit codes of the `vq` CLI that need no broker account: an unreachable
//! broker (69) and bad usage (64). The CLI against a real broker is tested
//! in `tests/tests/cli_submit.rs` (vq-tests, with the suite's broker
//! accounts).

use std::process::Command;

#[test]
fn an_unreachable_broker_exits_69() {
    let out = Command::new(env!("CARGO_BIN_EXE_vq"))
        .env("VQ_BROKER_URL", "amqp://nobody:secret@127.0.0.1:1/%2f")
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .args(["stat"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(69),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_usage_exits_64() {
    let out = Command::new(env!("CARGO_BIN_EXE_vq"))
        .args(["submit", "-k", "oe", "x"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let out = Command::new(env!("CARGO_BIN_EXE_vq"))
        .env("XDG_CONFIG_HOME", "/nonexistent")
        .args(["submit", "/nonexistent/script.pbs"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read /nonexistent/script.pbs"));
}

#[test]
fn a_bad_reason_or_timeout_of_drain_and_resume_exits_64_before_connecting() {
    for args in [
        &["drain", "ag1", "--reason", "two\nlines"][..],
        &["resume", "ag1", "--timeout", "0"],
        &["drain", "ag1", "--timeout", "nan"],
        &["cancel", "j1", "--timeout=-1"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_vq"))
            // Nothing listens here: a connection attempt would exit 69.
            .env("VQ_BROKER_URL", "amqp://nobody:secret@127.0.0.1:1/%2f")
            .env("XDG_CONFIG_HOME", "/nonexistent")
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(
            stderr.contains("--reason") || stderr.contains("--timeout"),
            "{args:?}: {stderr}"
        );
    }
}
