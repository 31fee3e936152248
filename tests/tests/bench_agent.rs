//! The agent benchmark of issue 14, run by `scripts/bench.sh` (never by
//! `make test`, which runs ignored tests too: it does nothing unless
//! `VQ_BENCH=1`, which bench.sh sets, and it asserts nothing about speed).
//!
//! On a private RabbitMQ node, one agent with 2 slots (default config,
//! cgroups on when the host delegates them), measured side by side with
//! the launch floor (`launch-floor`, tests/src/bin) in interleaved rounds:
//! * throughput of tiny jobs (`true`, owner `vqt-alice`, two output files):
//!   first `started` event to last final event;
//! * agent CPU per job: the agent's own utime+stime (`/proc/PID/stat`,
//!   its children, i.e. jobs and helpers, apart);
//! * publish confirm → script start on an idle agent, one job at a time:
//!   the script (`/bin/bash`) prints `$EPOCHREALTIME` as its first command;
//! * syscalls per tiny job (once, after the rounds): `strace -f -ff` on the
//!   agent, counting the agent's threads and its children up to their
//!   `execve` (getent helpers after exec counted apart, the job's own
//!   process excluded); the floor counted the same way.
//!
//! Knobs (environment): `BENCH_ROUNDS` (3), `BENCH_JOBS` (200 per round),
//! `BENCH_LATENCY_JOBS` (40 per round), `BENCH_STRACE_JOBS` (40),
//! `BENCH_CELERY` (path of a python with celery installed; optional).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use vq_common::messages::Job;
use vq_common::topology::Role;
use vq_tests::harness::{
    build_bin, ensure_test_user, job, require_root, start_agent_url, unique_cluster, wait_agent_up,
    EventTap, TestBroker, TestUser,
};
use vq_tests::rabbit_node::{NodeOptions, RabbitNode};

const POOL: &str = "bench";
const WAIT: Duration = Duration::from_secs(120);

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    s[(s.len() - 1) / 2]
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[i.clamp(1, s.len()) - 1]
}

/// (own, children) CPU seconds of `pid` from `/proc/PID/stat`.
fn cpu_of(pid: u32) -> anyhow::Result<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = stat.rsplit_once(')').context("stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the name start at field 3 (state): utime is 14, stime
    // 15, cutime 16, cstime 17.
    let tick = |i: usize| -> anyhow::Result<f64> { Ok(f[i - 3].parse::<f64>()? / 100.0) };
    Ok((tick(14)? + tick(15)?, tick(16)? + tick(17)?))
}

struct Bench {
    broker: TestBroker,
    tap: EventTap,
    alice: TestUser,
    out: tempfile::TempDir,
}

impl Bench {
    fn tiny(&self, name: &str, script: &str) -> Job {
        let mut j = job(POOL, &self.alice.name, name, script);
        let d = self.out.path().display();
        j.stdout = Some(format!("{d}/{}.o", j.id));
        j.stderr = Some(format!("{d}/{}.e", j.id));
        j
    }

    /// Publishes `jobs` at once and waits for all their final events:
    /// (seconds from the first `started` to the last final).
    async fn run_batch(&mut self, jobs: &[Job]) -> anyhow::Result<f64> {
        let ids: HashSet<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
        let from = self.tap.seen.len();
        futures_util::future::try_join_all(jobs.iter().map(|j| self.broker.publish_job(j))).await?;
        let mut first: Option<Instant> = None;
        let mut done = HashSet::new();
        let mut next = from;
        while done.len() < ids.len() {
            while next >= self.tap.seen.len() {
                if !self.tap.next_event(WAIT).await? {
                    bail!(
                        "no event for {WAIT:?}; {} of {} done",
                        done.len(),
                        ids.len()
                    );
                }
            }
            let (k, v) = &self.tap.seen[next];
            next += 1;
            let Some(id) = v["job_id"].as_str().filter(|id| ids.contains(id)) else {
                continue;
            };
            if k.ends_with(".started") {
                first.get_or_insert_with(Instant::now);
            } else if k.starts_with("job.") {
                if !(k.ends_with(".finished") && v["outcome"]["kind"] == "exited") {
                    bail!("job {id} did not exit: {k} {v}");
                }
                done.insert(id.to_string());
            }
        }
        let elapsed = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
        for j in jobs {
            for p in [&j.stdout, &j.stderr].into_iter().flatten() {
                let _ = std::fs::remove_file(p);
            }
        }
        Ok(elapsed)
    }

    /// One job on the idle agent: (publish confirm → script start, publish
    /// confirm → `started` event received), in ms.
    async fn latency(&mut self) -> anyhow::Result<(f64, f64)> {
        let mut j = self.tiny("lat", "echo $EPOCHREALTIME\n");
        j.shell = Some("/bin/bash".into());
        self.broker.publish_job(&j).await?;
        let confirmed = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
        self.tap.job_event(&j.id, "started", WAIT).await?;
        let event = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
        let fin = self.tap.job_event(&j.id, "finished", WAIT).await?;
        if fin["outcome"]["kind"] != "exited" {
            bail!("latency job failed: {fin}");
        }
        let path = j.stdout.clone().context("stdout")?;
        let text = std::fs::read_to_string(&path)?;
        let start: f64 = text.trim().parse().with_context(|| format!("{text:?}"))?;
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_file(j.stderr.as_deref().unwrap_or_default());
        Ok(((start - confirmed) * 1e3, (event - confirmed) * 1e3))
    }
}

/// Runs the floor program for `n` jobs: (jobs/s, own CPU ms/job, children
/// CPU ms/job).
fn floor(bin: &Path, alice: &TestUser, dir: &Path, n: usize) -> anyhow::Result<(f64, f64, f64)> {
    let out = Command::new(bin)
        .args([
            alice.uid.to_string(),
            alice.uid.to_string(),
            String::new(),
            dir.display().to_string(),
            n.to_string(),
        ])
        .output()?;
    if !out.status.success() {
        bail!("launch-floor: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let f: Vec<&str> = text.split_whitespace().collect();
    let field = |name: &str| -> anyhow::Result<f64> {
        let i = f
            .iter()
            .position(|x| *x == name)
            .context(name.to_string())?;
        Ok(f[i + 1].parse()?)
    };
    Ok((
        field("jobs_per_s")?,
        field("cpu_self_ms_per_job")?,
        field("cpu_children_ms_per_job")?,
    ))
}

/// Syscall counts of an `strace -ff -o PREFIX` trace, following the
/// process tree from `root`: (agent: threads and children before their
/// execve, helpers after exec (getent), jobs after exec (excluded)).
fn count_trace(prefix: &Path, root: u32) -> anyhow::Result<(usize, usize, usize)> {
    let dir = prefix.parent().context("prefix dir")?;
    let stem = prefix
        .file_name()
        .context("prefix")?
        .to_string_lossy()
        .into_owned();
    let mut files: HashMap<u32, PathBuf> = HashMap::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(tid) = name.strip_prefix(&format!("{stem}.")) {
            if let Ok(tid) = tid.parse() {
                files.insert(tid, e.path());
            }
        }
    }
    let (mut agent, mut helpers, mut jobs) = (0, 0, 0);
    // (tid, whether this task is a thread or process that has not exec'd
    // yet and so runs the agent's code).
    let mut todo = vec![(root, true)];
    let mut seen = HashSet::new();
    let roots: Vec<u32> = files.keys().copied().collect();
    // Threads that existed when strace attached have no clone line: any
    // file not reached from the root but present at attach time is one of
    // the agent's threads (the caller passes the agent's pid as root).
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{root}/task")) {
        for t in tasks.flatten() {
            if let Ok(tid) = t.file_name().to_string_lossy().parse::<u32>() {
                if roots.contains(&tid) {
                    todo.push((tid, true));
                }
            }
        }
    }
    while let Some((tid, agent_code)) = todo.pop() {
        if !seen.insert(tid) {
            continue;
        }
        let Some(path) = files.get(&tid) else {
            continue;
        };
        let text = std::fs::read_to_string(path)?;
        let mut mine = agent_code;
        let mut helper = false;
        let mut first = true;
        for line in text.lines() {
            let is_call = line.split('(').next().is_some_and(|n| {
                !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            }) && line.contains('(');
            if !is_call {
                continue;
            }
            if mine {
                agent += 1;
            } else if helper {
                helpers += 1;
            } else {
                jobs += 1;
            }
            let call = line.split('(').next().unwrap_or_default();
            if mine && matches!(call, "clone" | "clone3" | "fork" | "vfork") {
                if let Some(child) = line
                    .rsplit_once("= ")
                    .and_then(|(_, r)| r.split_whitespace().next())
                    .and_then(|r| r.parse::<u32>().ok())
                {
                    // Threads and not-yet-exec'd children run agent code.
                    todo.push((child, true));
                }
            }
            if call == "execve" && line.contains(" = 0") && !(first && tid == root) {
                // From here on the task is another program.
                mine = false;
                helper = line.contains("getent");
            }
            first = false;
        }
    }
    Ok((agent, helpers, jobs))
}

/// Runs `f` under `strace -f -ff -o PREFIX -p pid` and returns the counts
/// of [`count_trace`].
async fn strace_agent<F, Fut>(pid: u32, dir: &Path, f: F) -> anyhow::Result<(usize, usize, usize)>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    use std::io::BufRead;
    let prefix = dir.join("agent");
    let mut st = Command::new("strace")
        .args(["-f", "-ff", "-qq", "-o"])
        .arg(&prefix)
        .args(["-p", &pid.to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .context("run strace (apt-get install strace)")?;
    // Wait until strace has attached: the trace file of the main thread
    // exists and it has written something.
    let main = dir.join(format!("agent.{pid}"));
    let t = Instant::now();
    while std::fs::metadata(&main).map_or(0, |m| m.len()) == 0 {
        if t.elapsed() > Duration::from_secs(30) {
            bail!("strace did not attach");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = f().await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(st.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )?;
    let stderr = st.stderr.take();
    st.wait()?;
    if let Some(e) = stderr {
        for l in std::io::BufReader::new(e).lines().map_while(Result::ok) {
            eprintln!("strace: {l}");
        }
    }
    r?;
    count_trace(&prefix, pid)
}

/// Syscalls of the floor for `n` jobs, counted as the agent's are.
fn strace_floor(bin: &Path, alice: &TestUser, dir: &Path, n: usize) -> anyhow::Result<usize> {
    let prefix = dir.join("floor");
    let out_dir = dir.join("out");
    std::fs::create_dir_all(&out_dir)?;
    nix::unistd::chown(&out_dir, Some(nix::unistd::Uid::from_raw(alice.uid)), None)?;
    let st = Command::new("strace")
        .args(["-f", "-ff", "-qq", "-o"])
        .arg(&prefix)
        .arg(bin)
        .args([
            alice.uid.to_string(),
            alice.uid.to_string(),
            String::new(),
            out_dir.display().to_string(),
            n.to_string(),
        ])
        .stdout(Stdio::null())
        .status()?;
    if !st.success() {
        bail!("strace launch-floor: {st}");
    }
    // The root is the task whose first call is the execve of the floor.
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(tid) = name
            .strip_prefix("floor.")
            .and_then(|t| t.parse::<u32>().ok())
        else {
            continue;
        };
        let text = std::fs::read_to_string(e.path())?;
        if text
            .lines()
            .next()
            .is_some_and(|l| l.starts_with("execve(") && l.contains("launch-floor"))
        {
            return Ok(count_trace(&prefix, tid)?.0);
        }
    }
    bail!("no root task in the floor's trace")
}

/// Celery beside vq, when `BENCH_CELERY` names a python with celery: 2
/// prefork workers running `/bin/true` through `subprocess` (no user
/// switch, no output files), `n` tasks: tasks/s.
fn celery(python: &str, node: &RabbitNode, dir: &Path, n: usize) -> anyhow::Result<f64> {
    node.ctl(&["-q", "add_user", "vqcelery", "vqcelery"]).ok();
    node.ctl(&[
        "-q",
        "set_permissions",
        "-p",
        "/",
        "vqcelery",
        ".*",
        ".*",
        ".*",
    ])?;
    let url = format!("amqp://vqcelery:vqcelery@127.0.0.1:{}//", node.port());
    std::fs::write(
        dir.join("vqbench_tasks.py"),
        format!(
            "import subprocess\nfrom celery import Celery\n\
             app = Celery('vqbench', broker='{url}', backend='rpc://')\n\
             app.conf.worker_prefetch_multiplier = 4\n\
             @app.task\ndef true():\n    return subprocess.call(['/bin/true'])\n"
        ),
    )?;
    std::fs::write(
        dir.join("vqbench_run.py"),
        format!(
            "import time\nfrom vqbench_tasks import true\n\
             true.delay().get(timeout=120)\n\
             t = time.time()\nrs = [true.delay() for _ in range({n})]\n\
             for r in rs: assert r.get(timeout=300) == 0\n\
             print('celery_tasks_per_s %.1f' % ({n} / (time.time() - t)))\n"
        ),
    )?;
    let mut worker = vq_tests::harness::ChildGuard::spawn({
        let mut c = Command::new(python);
        c.current_dir(dir)
            .args([
                "-m",
                "celery",
                "-A",
                "vqbench_tasks",
                "worker",
                "--concurrency=2",
                "--pool=prefork",
                "--loglevel=WARNING",
            ])
            .env("C_FORCE_ROOT", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    })?;
    let out = Command::new(python)
        .current_dir(dir)
        .arg("vqbench_run.py")
        .output()?;
    worker.signal(nix::sys::signal::Signal::SIGTERM);
    worker.wait_timeout(Duration::from_secs(30));
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .with_context(|| {
            format!(
                "celery run: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: scripts/bench.sh"]
async fn agent_beside_the_launch_floor() -> anyhow::Result<()> {
    if std::env::var_os("VQ_BENCH").is_none() {
        eprintln!("bench_agent: a benchmark, skipped (scripts/bench.sh runs it with VQ_BENCH=1)");
        return Ok(());
    }
    if !require_root() {
        return Ok(());
    }
    let rounds = knob("BENCH_ROUNDS", 3);
    let n = knob("BENCH_JOBS", 200);
    let lat_n = knob("BENCH_LATENCY_JOBS", 40);
    let strace_n = knob("BENCH_STRACE_JOBS", 40);
    let floor_bin = build_bin("vq-tests", "launch-floor")?;
    let alice = ensure_test_user("vqt-alice", 2001)?;
    let node = RabbitNode::start_new(NodeOptions::default()).await?;
    let cluster = unique_cluster();
    let broker = TestBroker::connect_at(&node.broker(), &cluster, &[POOL]).await?;
    let mut tap = broker.tap_events().await?;
    let agent_id = format!("{cluster}-a1");
    let agent = start_agent_url(
        &node.role_url(Role::Agent),
        &cluster,
        POOL,
        &agent_id,
        "slots = 2\n",
    )?;
    wait_agent_up(&mut tap, &agent_id).await?;
    let pid = agent.guard.id();
    let out = tempfile::tempdir()?;
    nix::unistd::chown(
        out.path(),
        Some(nix::unistd::Uid::from_raw(alice.uid)),
        None,
    )?;
    let mut b = Bench {
        broker,
        tap,
        alice,
        out,
    };
    // Warm-up: caches, connections, the first cgroup.
    let warm: Vec<Job> = (0..10).map(|_| b.tiny("warm", "true\n")).collect();
    b.run_batch(&warm).await?;

    let (mut f_rate, mut f_cpu, mut f_child) = (vec![], vec![], vec![]);
    let (mut v_rate, mut v_cpu, mut v_child) = (vec![], vec![], vec![]);
    let (mut lat, mut lat_ev) = (vec![], vec![]);
    let mut cel = vec![];
    let celery_py = std::env::var("BENCH_CELERY").ok();
    for round in 0..rounds {
        let (r, c, ch) = floor(&floor_bin, &b.alice, b.out.path(), n)?;
        f_rate.push(r);
        f_cpu.push(c);
        f_child.push(ch);
        let jobs: Vec<Job> = (0..n).map(|_| b.tiny("tiny", "true\n")).collect();
        let (own0, ch0) = cpu_of(pid)?;
        let secs = b.run_batch(&jobs).await?;
        let (own1, ch1) = cpu_of(pid)?;
        v_rate.push((n - 1) as f64 / secs);
        v_cpu.push((own1 - own0) * 1e3 / n as f64);
        v_child.push((ch1 - ch0) * 1e3 / n as f64);
        for _ in 0..lat_n {
            let (s, e) = b.latency().await?;
            lat.push(s);
            lat_ev.push(e);
        }
        if let Some(py) = &celery_py {
            let d = tempfile::tempdir()?;
            cel.push(celery(py, &node, d.path(), n)?);
        }
        println!(
            "round {round}: floor {r:.1} jobs/s {c:.3}+{ch:.3} ms CPU/job; vq {:.1} jobs/s agent {:.3} ms CPU/job (children {:.3}){}",
            v_rate[round],
            v_cpu[round],
            v_child[round],
            cel.last().map_or(String::new(), |c| format!("; celery {c:.1} tasks/s"))
        );
    }

    let trace = tempfile::tempdir()?;
    let strace_jobs: Vec<Job> = (0..strace_n).map(|_| b.tiny("strace", "true\n")).collect();
    let (agent_calls, helper_calls, job_calls) = {
        let b = &mut b;
        strace_agent(pid, trace.path(), || async move {
            b.run_batch(&strace_jobs).await.map(drop)
        })
        .await?
    };
    let floor_trace = tempfile::tempdir()?;
    let floor_calls = strace_floor(&floor_bin, &b.alice, floor_trace.path(), strace_n)?;

    let per = |x: usize| x as f64 / strace_n as f64;
    let (fr, vr) = (median(&f_rate), median(&v_rate));
    println!(
        "\n## agent benchmark: {rounds} interleaved rounds, {n} tiny jobs each, 2 slots; medians"
    );
    println!("| figure | vq | launch floor | ratio |");
    println!("|---|---|---|---|");
    println!(
        "| tiny jobs (`true`) throughput | {vr:.1} jobs/s | {fr:.1} jobs/s one core (× 2 slots = {:.1}) | vq = {:.1} % of floor × slots |",
        fr * 2.0,
        100.0 * vr / (fr * 2.0)
    );
    println!(
        "| agent CPU per job (own) | {:.2} ms | {:.2} ms (parent) | {:.1}× |",
        median(&v_cpu),
        median(&f_cpu),
        median(&v_cpu) / median(&f_cpu)
    );
    println!(
        "| CPU of children per job (job, helpers) | {:.2} ms | {:.2} ms | |",
        median(&v_child),
        median(&f_child)
    );
    println!(
        "| syscalls per tiny job (agent + pre-exec) | {:.0} (+ {:.0} in getent helpers; job's own {:.0} excluded) | {:.0} | {:.1}× |",
        per(agent_calls),
        per(helper_calls),
        per(job_calls),
        per(floor_calls),
        (per(agent_calls) + per(helper_calls)) / per(floor_calls)
    );
    println!(
        "| publish confirm → script start, idle agent ({} jobs) | p50 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms | | |",
        lat.len(),
        percentile(&lat, 50.0),
        percentile(&lat, 95.0),
        percentile(&lat, 99.0)
    );
    println!(
        "| publish confirm → `started` event received | p50 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms | | |",
        percentile(&lat_ev, 50.0),
        percentile(&lat_ev, 95.0),
        percentile(&lat_ev, 99.0)
    );
    match celery_py {
        Some(_) => println!(
            "| Celery (2 prefork workers, `/bin/true` via subprocess, no user switch, no files) | {:.1} tasks/s | | vq = {:.2}× Celery |",
            median(&cel),
            vr / median(&cel)
        ),
        None => println!("| Celery | not measured (BENCH_CELERY unset) | | |"),
    }
    println!("per-round: floor {f_rate:.1?} vq {v_rate:.1?} celery {cel:.1?}");
    drop(agent);
    b.broker.cleanup().await;
    Ok(())
}
