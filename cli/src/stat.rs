//! `vq stat`: a `qstat`-like view of the controller's job table.
//!
//! `vq stat` asks the controller over AMQP ([`vq_common::jobs::query`]): a
//! [`JobQuery`] to `<c>.control` with the key `<c>.query.jobs`, answered by
//! [`JobPage`]s on the caller's exclusive reply queue, page after page. No
//! answer within `--timeout` seconds (default [`QUERY_TIMEOUT`]) is an
//! error naming the exchange; `--from-stream` instead reads the whole
//! job-event stream and folds it with the same table (slow: seconds per
//! 10,000 jobs, bounded at 60 s of reading).
//!
//! Who sees what is the controller's rule (`[jobs] query_other_jobs`,
//! `[jobs] operators`); the CLI additionally shows only the invoking
//! user's jobs unless `-a`, `-u USER` or job ids are given (root sees all).

use std::time::Duration;

use vq_common::amqp;
use vq_common::jobs::{answer, JobPage, JobQuery, JobRecord, State, Visibility, MAX_PAGE};
use vq_common::messages::{unix_now, Message, SCHEMA_VERSION};
use vq_common::pbs::format_walltime;
use vq_common::topology::Topology;

use crate::error::CliError;
use crate::events::read_job_table;
use crate::reply::{Replies, Sent};
use crate::settings::Settings;

/// How long `vq stat` waits for the controller's answer by default.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

/// What `vq stat` was asked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatRequest {
    /// `-a`: every job the controller lets the caller see.
    pub all: bool,
    /// `-u USER`: only USER's jobs.
    pub user: Option<String>,
    /// `--state Q,R…`: only jobs in these states.
    pub states: Vec<State>,
    /// `--pool POOL`: only jobs of this pool (Torque's queue).
    pub pool: Option<String>,
    /// Named jobs (ids or unique prefixes).
    pub job_ids: Vec<String>,
}

/// How `vq stat` prints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Layout {
    /// One line per job.
    #[default]
    Table,
    /// `-s`: the table with each job's comment (failure reason) below its
    /// line, as Torque's `qstat -s`.
    TableWithComments,
    /// `-f`: Torque's `qstat -f` records.
    Full,
    /// `--json`: `{"complete": …, "jobs": [<record>…]}`.
    Json,
}

/// Parses `--state`: letters of `Q R C F X`, separated by commas or not
/// (`Q,R` or `QR`).
///
/// # Errors
/// [`CliError::Usage`] naming the bad letter.
pub fn parse_states(text: &str) -> Result<Vec<State>, CliError> {
    text.chars()
        .filter(|c| *c != ',' && !c.is_whitespace())
        .map(|c| {
            State::from_letter(c).ok_or_else(|| {
                CliError::Usage(format!(
                    "--state: {c:?} is not a job state (Q queued, R running, C completed, F failed, X cancelled)"
                ))
            })
        })
        .collect()
}

/// The first query of `req` for the invoking Unix user `me` (`is_root`:
/// root sees every job, as before).
pub fn first_query(req: &StatRequest, me: &str, is_root: bool) -> JobQuery {
    let owner = match (&req.user, req.all || is_root || !req.job_ids.is_empty()) {
        (Some(u), _) => Some(u.clone()),
        (None, true) => None,
        (None, false) => Some(me.to_string()),
    };
    JobQuery {
        schema: SCHEMA_VERSION,
        ids: req.job_ids.clone(),
        owner,
        states: req.states.clone(),
        pool: req.pool.clone(),
        after: None,
        limit: Some(MAX_PAGE),
    }
}

/// Elapsed run time of `r` at `now` (Unix seconds): the agent's wall time
/// once ended, else `now - started`.
pub fn elapsed(r: &JobRecord, now: f64) -> Option<u64> {
    let secs = match (r.usage, r.started_at, r.ended_at) {
        (Some(u), _, _) => u.wall_secs,
        (None, Some(s), Some(e)) => e - s,
        (None, Some(s), None) => now - s,
        _ => return None,
    };
    Some(secs.max(0.0).round() as u64)
}

/// Renders the table (header, rule, one line per job) at time `now`; with
/// `comments`, each job's reason on an indented line below it.
pub fn render(jobs: &[JobRecord], now: f64, comments: bool) -> String {
    let header = [
        "Job id", "Name", "User", "Pool", "S", "Exit", "Agent", "Elapsed",
    ];
    let rows: Vec<[String; 8]> = jobs
        .iter()
        .map(|j| {
            [
                j.id.clone(),
                j.name.clone(),
                j.owner.clone(),
                j.pool.clone(),
                j.letter.to_string(),
                j.exit_status
                    .map(|e| e.to_string())
                    .unwrap_or_else(|| "-".into()),
                if j.agent.is_empty() {
                    "-".into()
                } else {
                    j.agent.clone()
                },
                elapsed(j, now)
                    .map(format_walltime)
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[&str]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == cells.len() {
                s.push_str(cell);
            } else {
                s.push_str(&format!("{cell:<w$} "));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(&header);
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    out.push_str(&line(&rule.iter().map(String::as_str).collect::<Vec<_>>()));
    for (r, j) in rows.iter().zip(jobs) {
        out.push_str(&line(&r.iter().map(String::as_str).collect::<Vec<_>>()));
        if comments {
            if let Some(reason) = &j.reason {
                out.push_str(&format!("   {reason}\n"));
            }
        }
    }
    out
}

/// A Unix time as Torque prints it (`ctime(3)`: `Wed Dec  2 15:31:39
/// 2026`), in UTC.
pub fn ctime(secs: f64) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let t = secs.max(0.0) as i64;
    let (days, rem) = (t.div_euclid(86_400), t.rem_euclid(86_400));
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{} {} {:>2} {:02}:{:02}:{:02} {}",
        DAYS[days.rem_euclid(7) as usize],
        MONTHS[(month - 1) as usize],
        day,
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        year
    )
}

/// Renders Torque's `qstat -f` records of `jobs` at time `now`: `Job Id:
/// <id>` then `    attribute = value` lines, only those vq knows (times
/// in UTC).
pub fn render_full(jobs: &[JobRecord], now: f64) -> String {
    let mut out = String::new();
    for j in jobs {
        out.push_str(&format!("Job Id: {}\n", j.id));
        let mut attr = |k: &str, v: String| out.push_str(&format!("    {k} = {v}\n"));
        let req = j.request.as_ref();
        let host = req.map(|r| r.submit_host.as_str()).unwrap_or("");
        attr("Job_Name", j.name.clone());
        attr(
            "Job_Owner",
            if host.is_empty() {
                j.owner.clone()
            } else {
                format!("{}@{host}", j.owner)
            },
        );
        if let Some(u) = &j.usage {
            attr(
                "resources_used.cput",
                format_walltime((u.user_cpu_secs + u.system_cpu_secs).round() as u64),
            );
            attr(
                "resources_used.mem",
                format!("{}kb", u.max_rss_bytes / 1024),
            );
        }
        if let Some(e) = elapsed(j, now) {
            attr("resources_used.walltime", format_walltime(e));
        }
        attr("job_state", j.letter.to_string());
        attr("queue", j.pool.clone());
        if let Some(s) = &j.submitter {
            attr("submitter", s.clone());
        }
        if !j.agent.is_empty() {
            attr("exec_host", j.agent.clone());
        }
        if let Some(r) = req {
            if let Some(g) = &r.group {
                attr("egroup", g.clone());
            }
            if let Some(p) = &r.stdout {
                attr("Output_Path", p.clone());
            }
            if let Some(p) = &r.stderr {
                attr("Error_Path", p.clone());
            }
            attr(
                "Rerunable",
                if r.rerunnable { "True" } else { "False" }.into(),
            );
            if let Some(w) = r.walltime {
                attr("Resource_List.walltime", format_walltime(w));
            }
            if !r.submit_host.is_empty() {
                attr("submit_host", r.submit_host.clone());
            }
            if let Some(w) = &r.workdir {
                attr("init_work_dir", w.clone());
            }
            if !r.depend.is_empty() {
                let d: Vec<String> = r.depend.iter().map(ToString::to_string).collect();
                attr("depend", d.join(","));
            }
        }
        if let Some(t) = j.queued_at {
            attr("ctime", ctime(t));
            attr("qtime", ctime(t));
        }
        if let Some(t) = j.started_at {
            attr("start_time", ctime(t));
        }
        if let Some(t) = j.ended_at {
            attr("comp_time", ctime(t));
        }
        if let Some(t) = [j.queued_at, j.started_at, j.ended_at]
            .into_iter()
            .flatten()
            .reduce(f64::max)
        {
            attr("mtime", ctime(t));
        }
        if j.attempt > 0 {
            attr("run_count", j.attempt.to_string());
        }
        if let Some(x) = j.exit_status {
            attr("exit_status", x.to_string());
        }
        if let Some(c) = &j.reason {
            attr("comment", c.clone());
        }
        out.push('\n');
    }
    out
}

/// Renders `jobs` as `--json`: `{"complete": …, "jobs": [<record>…]}`.
pub fn render_json(jobs: &[JobRecord], complete: bool) -> String {
    serde_json::to_string_pretty(&serde_json::json!({
        "complete": complete,
        "jobs": jobs,
    }))
    .expect("records serialize")
        + "\n"
}

/// The controller's answers to the pages of `q`, asked on `conn` as
/// `settings`' broker user (`user_id`), each within `timeout`.
///
/// # Errors
/// [`CliError::NoController`] if no controller listens or answers in
/// time, [`CliError::NoSuchCluster`] if the cluster's exchanges do not
/// exist, [`CliError::QueryRefused`] with the controller's reason,
/// [`CliError::Broker`] otherwise.
pub async fn ask_controller(
    conn: &lapin::Connection,
    settings: &Settings,
    mut q: JobQuery,
    timeout: Duration,
) -> Result<(Vec<JobRecord>, bool), CliError> {
    let topo = Topology::new(&settings.cluster);
    let mut replies = Replies::open(conn, settings, "vq-stat").await?;
    let control = topo.control_exchange();
    let no_controller = |answered: bool| CliError::NoController {
        exchange: control.clone(),
        key: topo.job_query_key(),
        secs: timeout.as_secs_f64(),
        listening: answered,
    };
    let mut rows = Vec::new();
    let mut complete = true;
    loop {
        let props = amqp::json_properties::<JobQuery>()
            .with_delivery_mode(1)
            .with_user_id(settings.broker_user().as_str().into());
        let sent = replies
            .send(
                &control,
                &topo.job_query_key(),
                &q.encode(),
                props,
                timeout,
                "send the query to the controller",
            )
            .await?;
        let Sent::Routed { correlation } = sent else {
            return Err(no_controller(false));
        };
        let deadline = tokio::time::Instant::now() + timeout;
        let Some(d) = replies.answer(&correlation, deadline).await? else {
            return Err(no_controller(true));
        };
        let page = JobPage::decode(&d.data).map_err(|source| CliError::Decode {
            what: "the controller's job page".into(),
            source,
        })?;
        if let Some(problem) = page.error {
            return Err(CliError::QueryRefused { problem });
        }
        complete &= page.complete;
        rows.extend(page.jobs);
        match page.next {
            Some(n) if q.ids.is_empty() => q.after = Some(n),
            _ => break,
        }
    }
    replies.close().await;
    Ok((rows, complete))
}

/// The rows of `q` from a read of the whole event stream (`--from-stream`),
/// with the controller's default rule for the invoking user (own jobs;
/// root sees all).
///
/// # Errors
/// [`CliError::Broker`], or [`CliError::QueryRefused`] for an unknown job.
pub async fn from_stream(
    conn: &lapin::Connection,
    settings: &Settings,
    q: &JobQuery,
    me: &str,
    is_root: bool,
) -> Result<(Vec<JobRecord>, bool), CliError> {
    let topo = Topology::new(&settings.cluster);
    let table = read_job_table(conn, &topo).await?;
    let vis = Visibility {
        query_other_jobs: is_root || !q.ids.is_empty(),
        operators: Vec::new(),
    };
    let mut q = q.clone();
    q.limit = Some(u32::MAX);
    let page = answer(&table, true, &vis, Some(me), &q.encode());
    if let Some(problem) = page.error {
        return Err(CliError::QueryRefused { problem });
    }
    Ok((page.jobs, true))
}

/// Options of one `vq stat` run.
#[derive(Debug, Clone, Default)]
pub struct StatRun {
    /// What to show.
    pub request: StatRequest,
    /// How.
    pub layout: Layout,
    /// Read the stream instead of asking the controller.
    pub from_stream: bool,
    /// Answer timeout ([`QUERY_TIMEOUT`] when `None`).
    pub timeout: Option<Duration>,
}

/// What `vq stat` does; returns the exit code.
///
/// # Errors
/// [`CliError`].
pub async fn run(settings: &Settings, opts: StatRun) -> Result<i32, CliError> {
    let crate::term::InvokingUser {
        name: user,
        is_root,
        ..
    } = crate::term::invoking_user()?;
    let q = first_query(&opts.request, &user, is_root);
    let conn = vq_common::amqp::connect(&settings.broker, "vq stat")
        .await
        .map_err(CliError::broker("connect to the broker"))?;
    let got = if opts.from_stream {
        from_stream(&conn, settings, &q, &user, is_root).await
    } else {
        ask_controller(&conn, settings, q, opts.timeout.unwrap_or(QUERY_TIMEOUT)).await
    };
    let _ = conn.close(200, "bye".into()).await;
    let (jobs, complete) = got?;
    if !complete {
        eprintln!(
            "vq: warning: the controller is still reading the job-event stream (after a start or a broker reconnect); jobs may be missing or stale"
        );
    }
    let now = unix_now();
    let text = match opts.layout {
        Layout::Json => render_json(&jobs, complete),
        _ if jobs.is_empty() => "no jobs\n".into(),
        Layout::Table => render(&jobs, now, false),
        Layout::TableWithComments => render(&jobs, now, true),
        Layout::Full => render_full(&jobs, now),
    };
    print!("{}", crate::term::printable_lines(&text));
    Ok(0)
}

#[cfg(test)]
mod tests {
    use vq_common::messages::{JobRequest, Usage};

    use super::*;

    fn rec(id: &str, owner: &str, state: State) -> JobRecord {
        JobRecord {
            id: id.into(),
            submission: Some("s".into()),
            name: format!("n-{id}"),
            owner: owner.into(),
            pool: "p".into(),
            submitter: Some(owner.into()),
            state,
            letter: state.letter(),
            agent: String::new(),
            attempt: 0,
            exit_status: None,
            reason: None,
            request: Some(JobRequest {
                walltime: Some(3600),
                submit_host: "ui1".into(),
                ..Default::default()
            }),
            queued_at: Some(100.0),
            started_at: None,
            ended_at: None,
            usage: None,
        }
    }

    fn done() -> JobRecord {
        let mut r = rec("a1.vq", "alice", State::Completed);
        r.agent = "ag1".into();
        r.attempt = 1;
        r.started_at = Some(100.0);
        r.ended_at = Some(161.0);
        r.exit_status = Some(0);
        r.usage = Some(Usage {
            wall_secs: 61.0,
            user_cpu_secs: 30.0,
            system_cpu_secs: 0.4,
            max_rss_bytes: 2048 * 1024,
        });
        r
    }

    #[test]
    fn the_table_is_aligned_and_shows_state_exit_and_elapsed() {
        let mut running = rec("b1.vq", "bob", State::Running);
        running.agent = "ag2".into();
        running.started_at = Some(100.0);
        let mut failed = rec("c1.vq", "bob", State::Failed);
        failed.reason = Some("node lost".into());
        let jobs = [done(), running, failed];
        let text = render(&jobs, 3700.0, false);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert!(lines[0].starts_with("Job id "));
        assert!(
            lines[2].starts_with("a1.vq  n-a1.vq alice p    C 0    ag1   00:01:01"),
            "{text}"
        );
        assert!(lines[3].contains(" R -    ag2   01:00:00"), "{text}");
        assert!(lines[4].contains(" F -    -     -"), "{text}");
        let with = render(&jobs, 3700.0, true);
        assert_eq!(with.lines().nth(5), Some("   node lost"), "{with}");
    }

    #[test]
    fn the_full_view_follows_qstat_f() {
        let text = render_full(&[done()], 0.0);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "Job Id: a1.vq");
        for want in [
            "    Job_Name = n-a1.vq",
            "    Job_Owner = alice@ui1",
            "    job_state = C",
            "    queue = p",
            "    exec_host = ag1",
            "    exit_status = 0",
            "    Resource_List.walltime = 01:00:00",
            "    resources_used.walltime = 00:01:01",
            "    resources_used.cput = 00:00:30",
            "    resources_used.mem = 2048kb",
            "    ctime = Thu Jan  1 00:01:40 1970",
            "    start_time = Thu Jan  1 00:01:40 1970",
            "    mtime = Thu Jan  1 00:02:41 1970",
            "    run_count = 1",
        ] {
            assert!(lines.contains(&want), "{want:?} missing in\n{text}");
        }
        let mut failed = rec("f", "bob", State::Failed);
        failed.reason = Some("failed to start: no such user".into());
        let text = render_full(&[failed], 0.0);
        assert!(text.contains("    comment = failed to start: no such user\n"));
        assert!(!text.contains("exec_host"), "{text}");
        assert_eq!(ctime(1_764_689_499.0), "Tue Dec  2 15:31:39 2025");
        // A held job shows its dependencies and why it waits.
        let mut held = rec("h", "alice", State::Held);
        held.request = Some(JobRequest {
            depend: vec![vq_common::messages::Dependency {
                kind: vq_common::messages::DependKind::AfterOk,
                jobs: vec!["a1.vq".into(), "a2.vq".into()],
            }],
            ..Default::default()
        });
        held.reason = Some("held: afterok a1.vq not finished".into());
        let text = render_full(&[held], 0.0);
        for want in [
            "    job_state = H\n",
            "    depend = afterok:a1.vq:a2.vq\n",
            "    comment = held: afterok a1.vq not finished\n",
        ] {
            assert!(text.contains(want), "{want:?} missing in\n{text}");
        }
    }

    #[test]
    fn options_become_the_query() {
        assert_eq!(
            parse_states("Q,r").unwrap(),
            [State::Queued, State::Running]
        );
        assert!(matches!(parse_states("QZ"), Err(CliError::Usage(e)) if e.contains("'Z'")));
        let own = first_query(&StatRequest::default(), "alice", false);
        assert_eq!(own.owner.as_deref(), Some("alice"));
        let all = StatRequest {
            all: true,
            ..Default::default()
        };
        assert_eq!(first_query(&all, "alice", false).owner, None);
        assert_eq!(
            first_query(&StatRequest::default(), "root", true).owner,
            None
        );
        let u = StatRequest {
            user: Some("bob".into()),
            ..Default::default()
        };
        assert_eq!(
            first_query(&u, "alice", false).owner.as_deref(),
            Some("bob")
        );
        let ids = StatRequest {
            job_ids: vec!["x".into()],
            ..Default::default()
        };
        let q = first_query(&ids, "alice", false);
        assert_eq!((q.owner, q.ids), (None, vec!["x".to_string()]));
        let pool = StatRequest {
            pool: Some("gpu".into()),
            ..Default::default()
        };
        assert_eq!(
            first_query(&pool, "alice", false).pool.as_deref(),
            Some("gpu")
        );
        let json = render_json(&[done()], false);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["complete"], false);
        assert_eq!(v["jobs"][0]["exit_status"], 0);
    }
}
