//! Whether a held job may run: the pure rule the controller applies to
//! every held job after each change of the job table (DESIGN.md, "Held
//! jobs and dependencies"), and the reason `vq stat` shows for an `H` job.
//!
//! Torque's qsub(1) semantics for the types vq supports ([`DependKind`]):
//! `afterok:ID` is satisfied once job ID *completed* with exit status 0;
//! `afternotok:ID` once it ended otherwise (non-zero exit status, a signal
//! or walltime kill, a failure to start, a cancel); `afterany:ID` once it
//! ended in any way. A job with several dependencies (or several ids in
//! one) runs when all are satisfied, and is cancelled as soon as one of
//! them can never be.

use super::table::{FindError, JobRecord, JobTable, State};
use crate::messages::{DependKind, Dependency};

/// What to do with a held job now ([`decide`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Keep it held; the reason is the first dependency not yet satisfied,
    /// e.g. `held: afterok 123 not finished`.
    Wait(String),
    /// Every dependency is satisfied: publish it to its pool.
    Release,
    /// A dependency can never be satisfied: cancel it with this reason,
    /// e.g. `dependency afterok:123 can never be satisfied: 123 exited 1`.
    Never(String),
}

/// How one job depended on stands for `kind`.
enum One {
    Satisfied,
    Pending(String),
    Never(String),
}

/// How `r` (ended or not) ended, in words for a [`Decision::Never`]
/// reason: `exited 1`, `was cancelled`, `failed: <reason>`.
fn how_it_ended(r: &JobRecord) -> String {
    match r.state {
        State::Completed => match r.exit_status {
            Some(code) => format!("exited {code}"),
            None => "completed".into(),
        },
        State::Cancelled => "was cancelled".into(),
        State::Failed => match &r.reason {
            Some(why) => format!("failed: {why}"),
            None => "failed".into(),
        },
        s => s.word().into(),
    }
}

fn one(
    kind: DependKind,
    id: &str,
    submitter: &str,
    table: &JobTable,
    unknown_is_never: Option<u64>,
) -> One {
    let r = match table.find_by(id, submitter) {
        Ok(r) => r,
        Err(FindError::Ambiguous(ids)) => {
            return One::Never(format!("{id} names several jobs: {}", ids.join(", ")))
        }
        Err(FindError::Unknown) => {
            return match unknown_is_never {
                Some(grace) => One::Never(format!(
                    "{id} is not in the job table {grace} s after submission (unknown job id, or it ended longer ago than keep_completed)"
                )),
                None => One::Pending(format!("held: {} {id} unknown (yet)", kind.word())),
            }
        }
    };
    if !r.state.ended() {
        return One::Pending(format!("held: {} {id} not finished", kind.word()));
    }
    let ok = r.state == State::Completed && r.exit_status == Some(0);
    match kind {
        DependKind::AfterAny => One::Satisfied,
        DependKind::AfterOk if ok => One::Satisfied,
        DependKind::AfterNotOk if !ok => One::Satisfied,
        _ => One::Never(format!("{id} {}", how_it_ended(&r))),
    }
}

/// What to do with a held job whose dependencies are `depend`, given the
/// job table `table`, submitted by broker user `submitter` (validated by
/// the broker). An id is looked up among that submitter's jobs only
/// ([`JobTable::find_by`]: the exact id, else a unique prefix, so an id
/// kept as written by a `vq submit` that could not resolve it still works;
/// a prefix several of its ids share can never be satisfied): any
/// submitter may publish a job under any id, and another's job of the same
/// id must neither satisfy, nor doom, nor make ambiguous this one's
/// dependency (Torque assigns ids on its server; vq's are chosen by the
/// submitter, so a dependency names one's own job). An id the table does
/// not know is waited for, unless
/// `unknown_after_grace` is `Some(grace)` (the job was submitted at least
/// `grace` seconds ago, the controller's `depend_grace_secs`): then it can
/// never be satisfied. A [`Decision::Never`] of any dependency wins over
/// the [`Decision::Wait`] of another; the first of each, in order, gives
/// the reason. An empty `depend` is [`Decision::Release`].
pub fn decide(
    job_id: &str,
    depend: &[Dependency],
    submitter: &str,
    table: &JobTable,
    unknown_after_grace: Option<u64>,
) -> Decision {
    if let Some(path) = cycle(job_id, depend, submitter, table) {
        return Decision::Never(format!(
            "its dependencies can never be satisfied: they form a cycle ({})",
            path.join(" → ")
        ));
    }
    let mut wait = None;
    for d in depend {
        for id in &d.jobs {
            match one(d.kind, id, submitter, table, unknown_after_grace) {
                One::Satisfied => {}
                One::Pending(why) => {
                    wait.get_or_insert(why);
                }
                One::Never(how) => {
                    return Decision::Never(format!(
                        "dependency {}:{id} can never be satisfied: {how}",
                        d.kind.word()
                    ))
                }
            }
        }
    }
    match wait {
        Some(why) => Decision::Wait(why),
        None => Decision::Release,
    }
}

/// Most held jobs a cycle search visits ([`cycle`]): a chain longer than
/// this is not searched further (it waits, as any).
const CYCLE_SEARCH_LIMIT: usize = 1000;

/// The path `job_id → … → job_id` if job `job_id`'s dependencies `depend`
/// lead back to it through held jobs of `submitter` (a job that depends on
/// itself, or two that depend on each other): such a job would be held
/// for ever. Depth-first over the held jobs' recorded dependencies
/// ([`JobRequest::depend`](crate::messages::JobRequest)), at most
/// [`CYCLE_SEARCH_LIMIT`] jobs.
fn cycle(
    job_id: &str,
    depend: &[Dependency],
    submitter: &str,
    table: &JobTable,
) -> Option<Vec<String>> {
    fn ids(depend: &[Dependency]) -> impl Iterator<Item = &String> {
        depend.iter().flat_map(|d| d.jobs.iter())
    }
    let mut seen = std::collections::HashSet::new();
    // (job, its path from job_id)
    let mut stack: Vec<(String, Vec<String>)> = ids(depend)
        .map(|id| (id.clone(), vec![job_id.to_string()]))
        .collect();
    while let Some((id, path)) = stack.pop() {
        let Ok(r) = table.find_by(&id, submitter) else {
            continue;
        };
        let mut path = path;
        path.push(r.id.clone());
        if r.id == job_id {
            return Some(path);
        }
        if r.state != State::Held || !seen.insert(r.id.clone()) || seen.len() > CYCLE_SEARCH_LIMIT {
            continue;
        }
        if let Some(q) = &r.request {
            for next in ids(&q.depend) {
                stack.push((next.clone(), path.clone()));
            }
        }
    }
    None
}

/// The reason shown for a held job (`vq stat -s`, `-f`, `/jobs`): the
/// [`Decision::Wait`] reason of [`decide`] without the grace rule, or what
/// the controller is about to do.
pub fn held_reason(
    job_id: &str,
    depend: &[Dependency],
    submitter: &str,
    table: &JobTable,
) -> String {
    match decide(job_id, depend, submitter, table, None) {
        Decision::Wait(why) => why,
        Decision::Release => "held: dependencies satisfied, being released".into(),
        Decision::Never(why) => format!("held: {why} (being cancelled)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{JobEvent, JobRequest, JobState, Outcome, Usage};

    fn ev(id: &str, state: JobState) -> JobEvent {
        let mut e = JobEvent::about(None, id, "p", "ag", Some("alice"), state);
        e.owner = "alice".into();
        e.submission = Some("s".into());
        e
    }

    fn finished(outcome: Outcome) -> JobState {
        JobState::Finished {
            outcome,
            usage: Usage::default(),
        }
    }

    /// A table with jobs in every state that matters: `q` queued, `h`
    /// held, `r` running, `ok` exited 0, `bad` exited 1, `sig` killed by a
    /// signal, `x` cancelled while queued, `xr` cancelled while running,
    /// `f` failed.
    fn table() -> JobTable {
        let mut t = JobTable::new();
        let q = || JobState::Queued {
            request: JobRequest::default(),
        };
        let h = || JobState::Held {
            request: JobRequest::default(),
        };
        let evs = [
            ev("q", q()),
            ev("h", h()),
            ev("r", JobState::Started),
            ev("ok", JobState::Started),
            ev("ok", finished(Outcome::Exited { code: 0 })),
            ev("bad", finished(Outcome::Exited { code: 1 })),
            ev("sig", finished(Outcome::Signaled { signal: 9 })),
            ev("x", q()),
            ev(
                "x",
                JobState::Withdrawn {
                    by: "alice".into(),
                    reason: None,
                },
            ),
            ev("xr", JobState::Started),
            ev("xr", finished(Outcome::Cancelled)),
            ev(
                "f",
                JobState::Failed {
                    reason: "node lost".into(),
                },
            ),
        ];
        for e in &evs {
            t.apply(e, Some(&e.message_id()));
        }
        t
    }

    fn dep(kind: DependKind, jobs: &[&str]) -> Dependency {
        Dependency {
            kind,
            jobs: jobs.iter().map(|j| j.to_string()).collect(),
        }
    }

    #[test]
    fn every_kind_against_every_outcome() {
        use DependKind::{AfterAny, AfterNotOk, AfterOk};
        let t = table();
        // (kind, job, expected: 'W'ait, 'R'elease, 'N'ever)
        let cases = [
            (AfterOk, "q", 'W'),
            (AfterOk, "h", 'W'),
            (AfterOk, "r", 'W'),
            (AfterOk, "ok", 'R'),
            (AfterOk, "bad", 'N'),
            (AfterOk, "sig", 'N'),
            (AfterOk, "x", 'N'),
            (AfterOk, "xr", 'N'),
            (AfterOk, "f", 'N'),
            (AfterNotOk, "q", 'W'),
            (AfterNotOk, "r", 'W'),
            (AfterNotOk, "ok", 'N'),
            (AfterNotOk, "bad", 'R'),
            (AfterNotOk, "sig", 'R'),
            (AfterNotOk, "x", 'R'),
            (AfterNotOk, "xr", 'R'),
            (AfterNotOk, "f", 'R'),
            (AfterAny, "q", 'W'),
            (AfterAny, "h", 'W'),
            (AfterAny, "r", 'W'),
            (AfterAny, "ok", 'R'),
            (AfterAny, "bad", 'R'),
            (AfterAny, "x", 'R'),
            (AfterAny, "f", 'R'),
        ];
        for (kind, job, want) in cases {
            let got = match decide("me", &[dep(kind, &[job])], "alice", &t, Some(120)) {
                Decision::Wait(_) => 'W',
                Decision::Release => 'R',
                Decision::Never(_) => 'N',
            };
            assert_eq!(got, want, "{}:{job}", kind.word());
        }
    }

    #[test]
    fn reasons_name_the_dependency_and_how_its_job_ended() {
        use DependKind::{AfterAny, AfterNotOk, AfterOk};
        let t = table();
        assert_eq!(
            decide("me", &[dep(AfterOk, &["r"])], "alice", &t, None),
            Decision::Wait("held: afterok r not finished".into())
        );
        assert_eq!(
            decide("me", &[dep(AfterOk, &["bad"])], "alice", &t, None),
            Decision::Never("dependency afterok:bad can never be satisfied: bad exited 1".into())
        );
        assert_eq!(
            decide("me", &[dep(AfterOk, &["f"])], "alice", &t, None),
            Decision::Never(
                "dependency afterok:f can never be satisfied: f failed: node lost".into()
            )
        );
        assert_eq!(
            decide("me", &[dep(AfterNotOk, &["ok"])], "alice", &t, None),
            Decision::Never("dependency afternotok:ok can never be satisfied: ok exited 0".into())
        );
        // All must hold: one pending keeps it waiting, one never cancels it
        // even when another is still pending.
        assert_eq!(
            decide(
                "me",
                &[dep(AfterOk, &["ok", "q"]), dep(AfterAny, &["bad"])],
                "alice",
                &t,
                None
            ),
            Decision::Wait("held: afterok q not finished".into())
        );
        assert_eq!(
            decide(
                "me",
                &[dep(AfterOk, &["ok"]), dep(AfterAny, &["bad", "x"])],
                "alice",
                &t,
                None
            ),
            Decision::Release
        );
        assert!(matches!(
            decide("me", &[dep(AfterAny, &["q"]), dep(AfterOk, &["x"])], "alice", &t, None),
            Decision::Never(w) if w.contains("afterok:x") && w.contains("x was cancelled")
        ));
        assert_eq!(decide("me", &[], "alice", &t, None), Decision::Release);
    }

    #[test]
    fn an_unknown_id_is_waited_for_until_the_grace_has_passed() {
        let t = table();
        // A unique prefix names its job; a shared one never can.
        assert_eq!(
            decide("me", &[dep(DependKind::AfterOk, &["o"])], "alice", &t, None),
            Decision::Release
        );
        let mut two = table();
        for id in ["ab1", "ab2"] {
            let e = ev(id, JobState::Started);
            two.apply(&e, Some(&e.message_id()));
        }
        assert!(matches!(
            decide("me", &[dep(DependKind::AfterAny, &["ab"])], "alice", &two, None),
            Decision::Never(w) if w.contains("ab names several jobs: ab1, ab2")
        ));
        let d = [dep(DependKind::AfterOk, &["nosuch"])];
        assert_eq!(
            decide("me", &d, "alice", &t, None),
            Decision::Wait("held: afterok nosuch unknown (yet)".into())
        );
        assert!(matches!(
            decide("me", &d, "alice", &t, Some(120)),
            Decision::Never(w) if w.contains("nosuch is not in the job table 120 s after submission")
        ));
        assert_eq!(
            held_reason("me", &d, "alice", &t),
            "held: afterok nosuch unknown (yet)"
        );
        assert_eq!(
            held_reason("me", &[dep(DependKind::AfterOk, &["r"])], "alice", &t),
            "held: afterok r not finished"
        );
    }

    /// Another submitter's job under the same id (any submitter may publish
    /// any id) neither satisfies, nor dooms, nor makes ambiguous a
    /// dependency: it names the dependent job's submitter's own job.
    #[test]
    fn another_submitter_s_job_of_the_same_id_is_not_the_dependency() {
        let mut t = table();
        // mallory publishes her own "q" (alice's is queued) and it ends 0,
        // and her "bad" that exits 0, and an "ok2" beside alice's "ok".
        let mut forged = |id: &str, state: JobState| {
            let mut e = JobEvent::about(None, id, "p", "ag", Some("mallory"), state);
            e.owner = "mallory".into();
            e.submission = Some(format!("m-{id}"));
            t.apply(&e, Some(&e.message_id()));
        };
        let q = || JobState::Queued {
            request: JobRequest::default(),
        };
        for id in ["q", "bad", "ok2"] {
            forged(id, q());
            forged(id, JobState::Started);
            forged(id, finished(Outcome::Exited { code: 0 }));
        }
        assert_eq!(
            decide("me", &[dep(DependKind::AfterOk, &["q"])], "alice", &t, None),
            Decision::Wait("held: afterok q not finished".into()),
            "mallory's q is not alice's"
        );
        assert!(matches!(
            decide("me", &[dep(DependKind::AfterOk, &["bad"])], "alice", &t, None),
            Decision::Never(w) if w.contains("bad exited 1")
        ));
        assert_eq!(
            decide("me", &[dep(DependKind::AfterOk, &["o"])], "alice", &t, None),
            Decision::Release,
            "mallory's ok2 does not make alice's prefix o ambiguous"
        );
        assert_eq!(
            decide(
                "me",
                &[dep(DependKind::AfterOk, &["q"])],
                "mallory",
                &t,
                None
            ),
            Decision::Release,
            "mallory's own q"
        );
    }

    /// A job that depends on itself, or held jobs that depend on each
    /// other, can never run: cancelled with the cycle, not held for ever.
    #[test]
    fn a_dependency_cycle_is_never_satisfied() {
        let mut t = table();
        let held = |id: &str, on: &str| {
            let mut e = ev(
                id,
                JobState::Held {
                    request: JobRequest {
                        depend: vec![dep(DependKind::AfterOk, &[on])],
                        ..JobRequest::default()
                    },
                },
            );
            e.submission = Some(format!("s-{id}"));
            e
        };
        for e in [
            held("cyc-a", "cyc-b"),
            held("cyc-b", "cyc-a"),
            held("me", "me"),
            held("w", "q"),
        ] {
            t.apply(&e, Some(&e.message_id()));
        }
        assert!(matches!(
            decide("cyc-a", &[dep(DependKind::AfterOk, &["cyc-b"])], "alice", &t, None),
            Decision::Never(w) if w.contains("cycle (cyc-a → cyc-b → cyc-a)")
        ));
        assert!(matches!(
            decide("me", &[dep(DependKind::AfterAny, &["me"])], "alice", &t, None),
            Decision::Never(w) if w.contains("cycle (me → me)")
        ));
        // A chain through a held job that waits on a queued one is no cycle.
        assert_eq!(
            decide("x2", &[dep(DependKind::AfterOk, &["w"])], "alice", &t, None),
            Decision::Wait("held: afterok w not finished".into())
        );
    }
}
