//! `vq-controller` stops within one deadline: the first SIGTERM stops
//! acting and lets the cycle in flight finish, up to the deadline
//! (`--shutdown-grace-secs`), then the process exits anyway; a second
//! signal exits at once. Runs the built binary against a "broker" that
//! accepts TCP connections and never answers, so the cycle hangs in its
//! broker connect (no broker, cloud or root needed). The tests wait for
//! events (the connection accepted, log lines, the exit), never for time.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Upper bound of every wait: a failure, never a synchronisation.
const PATIENCE: Duration = Duration::from_secs(60);

/// A broker that accepts connections and never says a word; each accepted
/// connection is announced on the receiver and held open.
fn silent_broker() -> (u16, mpsc::Receiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            held.push(conn);
            if tx.send(()).is_err() {
                return;
            }
        }
    });
    (port, rx)
}

/// A local port nothing listens on (Keystone: refused at once).
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Controller {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Controller {
    /// Starts the controller in `dir` against the silent broker on
    /// `broker_port`, with `args`.
    fn start(dir: &Path, broker_port: u16, args: &[&str]) -> Controller {
        let config = format!(
            r#"
cluster = "vq"
listen = "127.0.0.1:0"
interval_secs = 0.1
[broker]
url = "amqp://vq-ctl:pw@127.0.0.1:{broker_port}/%2f"
connect_timeout_secs = 3600
[pools.cms]
flavor = "m1"
image = "img"
agent_broker_url = "amqp://a:b@h/%2f"
"#
        );
        let path = dir.join("controller.toml");
        std::fs::write(&path, config).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_vq-controller"))
            .arg("--config")
            .arg(&path)
            .args(args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", dir)
            .env("RUST_LOG", "info")
            .env(
                "OS_AUTH_URL",
                format!("http://127.0.0.1:{}/v3", closed_port()),
            )
            .env("OS_USERNAME", "u")
            .env("OS_PASSWORD", "p")
            .env("OS_PROJECT_NAME", "proj")
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Controller {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for a log line containing `needle`.
    fn wait_log(&mut self, needle: &str) {
        let until = Instant::now() + PATIENCE;
        loop {
            if self.seen.iter().any(|l| l.contains(needle)) {
                return;
            }
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(_) => panic!("no log line with {needle:?}:\n{}", self.seen.join("\n")),
            }
        }
    }

    fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{name}");
    }

    /// Waits for the exit (its log's end, then the status); returns the
    /// status and every log line.
    fn wait_exit(&mut self) -> (ExitStatus, String) {
        let until = Instant::now() + PATIENCE;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("still running:\n{}", self.seen.join("\n"))
                }
            }
        }
        let status = self.child.wait().unwrap();
        (status, self.seen.join("\n"))
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_first_signal_gives_the_cycle_in_flight_one_deadline_then_the_controller_exits() {
    let dir = tempfile::tempdir().unwrap();
    let (port, accepted) = silent_broker();
    let mut ctl = Controller::start(dir.path(), port, &["--shutdown-grace-secs", "2"]);
    ctl.wait_log("serving /healthz");
    accepted
        .recv_timeout(PATIENCE)
        .expect("the cycle connects to the broker");
    ctl.signal("TERM");
    ctl.wait_log("shutting down gracefully");
    let asked = Instant::now();
    let (status, log) = ctl.wait_exit();
    let took = asked.elapsed();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("shutdown deadline passed"), "{log}");
    assert!(log.contains("vq-controller stopped"), "{log}");
    // The 2 s deadline ended it, not the 30 s default nor the 3600 s
    // connect timeout.
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(20),
        "stopped {took:?} after the request:\n{log}"
    );
}

#[test]
fn a_second_signal_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (port, accepted) = silent_broker();
    let mut ctl = Controller::start(dir.path(), port, &[]);
    ctl.wait_log("serving /healthz");
    accepted
        .recv_timeout(PATIENCE)
        .expect("the cycle connects to the broker");
    ctl.signal("TERM");
    ctl.wait_log("shutting down gracefully");
    let asked = Instant::now();
    ctl.signal("INT");
    let (status, log) = ctl.wait_exit();
    assert_eq!(status.code(), Some(130), "{log}");
    assert!(log.contains("second signal: exiting at once"), "{log}");
    assert!(!log.contains("shutdown deadline passed"), "{log}");
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "the 30 s deadline must not be waited out:\n{log}"
    );
}
