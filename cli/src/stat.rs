//! `vq stat`: a `qstat`-like table of jobs from the job-event stream.
//!
//! Only jobs that have started appear: a job waiting in its pool queue has
//! produced no event yet (`vq pools` shows how many wait).

use vq_common::messages::unix_now;
use vq_common::pbs::format_walltime;
use vq_common::topology::Topology;

use crate::error::CliError;
use crate::events::{find_job, read_job_events, summarize, JobSummary};
use crate::settings::Settings;

/// Which jobs to show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatQuery {
    /// Show every user's jobs (`-a`), not only the invoking user's.
    pub all: bool,
    /// Named jobs (ids or unique prefixes); empty = all visible jobs.
    pub job_ids: Vec<String>,
    /// The invoking user.
    pub user: String,
    /// Whether the invoking user is root (sees everything).
    pub is_root: bool,
}

/// Selects the jobs to show: the named ones (whoever owns them), else the
/// invoking user's (everyone's with `-a` or as root).
///
/// # Errors
/// [`CliError::UnknownJob`] or [`CliError::AmbiguousJob`] for a named job.
pub fn select<'a>(jobs: &'a [JobSummary], q: &StatQuery) -> Result<Vec<&'a JobSummary>, CliError> {
    if !q.job_ids.is_empty() {
        return q.job_ids.iter().map(|id| find_job(jobs, id)).collect();
    }
    Ok(jobs
        .iter()
        .filter(|j| q.all || q.is_root || j.owner == q.user)
        .collect())
}

/// Renders the table (header, rule, one line per job) at time `now`.
pub fn render(jobs: &[&JobSummary], now: f64) -> String {
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
                j.state.letter().to_string(),
                j.exit.map(|e| e.to_string()).unwrap_or_else(|| "-".into()),
                if j.agent.is_empty() {
                    "-".into()
                } else {
                    j.agent.clone()
                },
                j.elapsed(now)
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
    for r in &rows {
        out.push_str(&line(&r.iter().map(String::as_str).collect::<Vec<_>>()));
    }
    out
}

/// What `vq stat` does; returns the exit code.
///
/// # Errors
/// [`CliError`].
pub async fn run(settings: &Settings, all: bool, job_ids: Vec<String>) -> Result<i32, CliError> {
    let crate::term::InvokingUser {
        name: user,
        is_root,
        ..
    } = crate::term::invoking_user()?;
    let topo = Topology::new(&settings.cluster);
    let conn = vq_common::amqp::connect(&settings.broker, "vq stat")
        .await
        .map_err(CliError::broker("connect to the broker"))?;
    let events = read_job_events(&conn, &topo).await;
    let _ = conn.close(200, "bye".into()).await;
    let Some(events) = events? else {
        if job_ids.is_empty() {
            println!("no jobs");
            return Ok(0);
        }
        return Err(CliError::UnknownJob {
            job_id: job_ids[0].clone(),
        });
    };
    let jobs = summarize(&events);
    let query = StatQuery {
        all,
        job_ids,
        user,
        is_root,
    };
    let shown = select(&jobs, &query)?;
    if shown.is_empty() {
        println!("no jobs");
    } else {
        print!(
            "{}",
            crate::term::printable_lines(&render(&shown, unix_now()))
        );
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use vq_common::messages::{JobState, Outcome, Usage};

    use super::*;
    use crate::events::tests::ev;

    fn jobs() -> Vec<JobSummary> {
        summarize(&[
            ev("a1.vq", "alice", "ag1", 100.0, JobState::Started),
            ev("b1.vq", "bob", "ag2", 100.0, JobState::Started),
            ev(
                "a1.vq",
                "alice",
                "ag1",
                160.0,
                JobState::Finished {
                    outcome: Outcome::Exited { code: 0 },
                    usage: Usage {
                        wall_secs: 61.0,
                        ..Default::default()
                    },
                },
            ),
        ])
    }

    fn q(all: bool, ids: &[&str], user: &str) -> StatQuery {
        StatQuery {
            all,
            job_ids: ids.iter().map(|s| s.to_string()).collect(),
            user: user.into(),
            is_root: user == "root",
        }
    }

    #[test]
    fn users_see_their_own_jobs_unless_all() {
        let j = jobs();
        assert_eq!(select(&j, &q(false, &[], "alice")).unwrap().len(), 1);
        assert_eq!(select(&j, &q(true, &[], "alice")).unwrap().len(), 2);
        assert_eq!(select(&j, &q(false, &[], "root")).unwrap().len(), 2);
        assert_eq!(
            select(&j, &q(false, &["b1"], "alice")).unwrap()[0].owner,
            "bob"
        );
        assert!(select(&j, &q(false, &["zz"], "alice")).is_err());
    }

    #[test]
    fn the_table_is_aligned_and_shows_state_exit_and_elapsed() {
        let j = jobs();
        let shown: Vec<&JobSummary> = j.iter().collect();
        let text = render(&shown, 3700.0);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[0].starts_with("Job id "));
        assert!(
            lines[2].starts_with("a1.vq  n-a1.vq alice p    C 0    ag1   00:01:01"),
            "{text}"
        );
        assert!(lines[3].contains(" R -    ag2   01:00:00"), "{text}");
    }
}
