//! Golden round-trips of the wire fixtures in `fixtures/`, and the check that
//! the published JSON Schemas in `schemas/` are up to date.
//!
//! Regenerate the schemas with `VQ_BLESS=1 cargo test -p vq-common --test wire`.

use std::path::PathBuf;

use vq_common::jobs::cancel::{CancelAnswer, CancelRequest};
use vq_common::jobs::State;
use vq_common::messages::{
    json_schemas, Control, ControlAnswer, ControlOutcome, ControlRequest, DecodeError,
    DeleteAnswer, Demand, Heartbeat, Job, JobEvent, JobState, Message,
};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn round_trip<M: Message>(name: &str) -> M {
    let bytes = fixture(name);
    let msg = M::decode(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
    let original: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let again: serde_json::Value = serde_json::from_slice(&msg.encode()).unwrap();
    assert_eq!(original, again, "{name} does not survive a round trip");
    msg
}

#[test]
fn every_fixture_survives_a_round_trip() {
    let job: Job = round_trip("job.json");
    assert_eq!(job.owner, "alice");
    assert_eq!(job.walltime, Some(86_400));
    // A message without `slots` (older writers) takes one slot.
    assert_eq!((job.slots, job.mem), (1, None));
    let wide: Job = round_trip("job-slots.json");
    assert_eq!((wide.slots, wide.mem), (4, Some(4 << 30)));
    round_trip::<JobEvent>("job-event-started.json");
    let ev: JobEvent = round_trip("job-event-finished.json");
    assert_eq!(ev.state.routing_word(), "finished");
    round_trip::<JobEvent>("job-event-walltime.json");
    round_trip::<JobEvent>("job-event-failed.json");
    let rerun: JobEvent = round_trip("job-event-started-rerun.json");
    assert_eq!(rerun.attempt, 2);
    let dup: JobEvent = round_trip("job-event-duplicate.json");
    let sub: JobEvent = round_trip("job-event-finished-submission.json");
    assert_eq!(sub.submission.as_deref(), Some("5c1d7e9a0b3f2468"));
    assert!(dup.duplicate.is_some());
    let queued: JobEvent = round_trip("job-event-queued.json");
    assert_eq!(queued.state.routing_word(), "queued");
    match &queued.state {
        JobState::Queued { request } => assert_eq!((request.slots, request.mem), (1, None)),
        other => panic!("{other:?}"),
    }
    let wide: JobEvent = round_trip("job-event-queued-slots.json");
    match &wide.state {
        JobState::Queued { request } => {
            assert_eq!((request.slots, request.mem), (4, Some(4 << 30)))
        }
        other => panic!("{other:?}"),
    }
    round_trip::<Heartbeat>("heartbeat.json");
    round_trip::<Demand>("demand.json");
    round_trip::<Control>("control-ask-delete.json");
    round_trip::<Control>("control-cancel.json");
    round_trip::<DeleteAnswer>("delete-answer.json");
    let drain: Control = round_trip("control-drain-reason.json");
    assert!(
        matches!(&drain, Control::Drain { reason: Some(r), .. } if r.starts_with("kernel")),
        "{drain:?}"
    );
    round_trip::<Control>("control-resume.json");
    let answer: ControlAnswer = round_trip("control-answer-drain.json");
    assert_eq!(
        (answer.request, &answer.outcome, answer.running.len()),
        (ControlRequest::Drain, &ControlOutcome::Done, 2)
    );
    let refused: ControlAnswer = round_trip("control-answer-refused.json");
    assert!(matches!(refused.outcome, ControlOutcome::Refused { .. }));
    assert_eq!(
        refused.job_id.as_deref(),
        Some("3f2a9c1e-5b7d-4e1a-9c0b-2d6f8e4a1b3c")
    );
    let hb: Heartbeat = round_trip("heartbeat-draining.json");
    assert_eq!(
        hb.drain_reason.as_deref(),
        Some("kernel update, ticket 4711")
    );
    let q: vq_common::jobs::JobQuery = round_trip("job-query.json");
    assert_eq!(q.states, [State::Queued, State::Running]);
    let page: vq_common::jobs::JobPage = round_trip("job-page.json");
    assert_eq!((page.jobs[0].letter, page.next), ('C', Some(41)));
    round_trip::<vq_common::pools::PoolQuery>("pool-query.json");
    let pools: vq_common::pools::PoolsPage = round_trip("pools-page.json");
    assert_eq!(pools.names(), ["cms", "short"]);
    assert_eq!(
        (pools.pools[0].memory_mb, pools.pools[1].memory_mb),
        (Some(8192), None)
    );
    let w: JobEvent = round_trip("job-event-withdrawn.json");
    assert_eq!(w.state.routing_word(), "cancelled");
    assert!(matches!(w.state, JobState::Withdrawn { reason: None, .. }));
    let never: JobEvent = round_trip("job-event-withdrawn-reason.json");
    assert!(matches!(
        &never.state,
        JobState::Withdrawn { reason: Some(r), .. } if r.contains("can never be satisfied")
    ));
    // A job without dependencies carries no `depend` (older readers), one
    // with them carries them in its message and its held event.
    assert!(job.depend.is_empty());
    let dependent: Job = round_trip("job-depend.json");
    assert_eq!(
        dependent
            .depend
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        [
            "afterok:3f2a9c1e-5b7d-4e1a-9c0b-2d6f8e4a1b3c:9e",
            "afterany:5a"
        ]
    );
    let held: JobEvent = round_trip("job-event-held.json");
    assert_eq!(held.state.routing_word(), "held");
    match &held.state {
        JobState::Held { request } => assert_eq!(request.depend, dependent.depend),
        other => panic!("{other:?}"),
    }
    let req: CancelRequest = round_trip("cancel-request.json");
    assert_eq!(req.job_id, "3f2a9c1e");
    assert!(matches!(
        round_trip::<CancelAnswer>("cancel-answer-withdrawn.json"),
        CancelAnswer::Withdrawn { .. }
    ));
    assert!(matches!(
        round_trip::<CancelAnswer>("cancel-answer-running.json"),
        CancelAnswer::Running { .. }
    ));
    assert!(matches!(
        round_trip::<CancelAnswer>("cancel-answer-refused.json"),
        CancelAnswer::Refused {
            kind: vq_common::jobs::cancel::Refusal::NotPermitted,
            ..
        }
    ));
}

#[test]
fn a_drain_from_an_older_cli_has_no_reason_and_an_older_heartbeat_no_drain_reason() {
    let old = br#"{"type":"drain","request_id":"r1"}"#;
    assert_eq!(
        Control::decode(old).unwrap(),
        Control::Drain {
            request_id: "r1".into(),
            reason: None
        }
    );
    let hb = Heartbeat::decode(&fixture("heartbeat.json")).unwrap();
    assert_eq!(hb.drain_reason, None);
    // And a reason-less drain encodes as older agents know it.
    let again = Control::Drain {
        request_id: "r1".into(),
        reason: None,
    };
    assert_eq!(again.encode(), old.to_vec());
}

#[test]
fn published_json_schemas_are_up_to_date() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../schemas");
    let bless = std::env::var_os("VQ_BLESS").is_some();
    let mut stale = Vec::new();
    for (name, text) in json_schemas() {
        let path = dir.join(name);
        if bless {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &text).unwrap();
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            stale.push(name);
        }
    }
    assert!(
        stale.is_empty(),
        "schemas/ is stale for {stale:?}: run `VQ_BLESS=1 cargo test -p vq-common --test wire`"
    );
}

#[test]
fn every_state_change_has_its_own_stable_message_id() {
    let id = "3f2a9c1e-5b7d-4e1a-9c0b-2d6f8e4a1b3c";
    let ev = |name: &str| JobEvent::decode(&fixture(name)).unwrap().message_id();
    assert_eq!(ev("job-event-started.json"), format!("{id}.started.1"));
    assert_eq!(
        ev("job-event-started-rerun.json"),
        format!("{id}.started.2")
    );
    assert_eq!(ev("job-event-finished.json"), format!("{id}.finished"));
    assert_eq!(ev("job-event-failed.json"), "9e.failed");
    assert_eq!(
        ev("job-event-finished-submission.json"),
        format!("{id}.5c1d7e9a0b3f2468.finished")
    );
    assert_eq!(
        ev("job-event-queued.json"),
        format!("{id}.5c1d7e9a0b3f2468.queued")
    );
    assert_eq!(
        ev("job-event-held.json"),
        "7b1e0d4c-2a9f-4c3e-8d5b-6f0a1c2e3d4f.5c1d7e9a0b3f2468.held"
    );
    assert_eq!(
        ev("job-event-withdrawn.json"),
        format!("{id}.5c1d7e9a0b3f2468.withdrawn")
    );
    assert_eq!(
        ev("job-event-duplicate.json"),
        format!("{id}.duplicate.8a3f0c5e2b917d44")
    );
}

#[test]
fn a_job_id_submitted_again_after_its_job_ended_gets_other_message_ids() {
    let first = JobEvent::decode(&fixture("job-event-finished.json")).unwrap();
    let started = |body: &[u8]| {
        let mut e = first.clone().of_submission(body);
        e.state = vq_common::messages::JobState::Started;
        e.message_id()
    };
    let a = first.clone().of_submission(b"first submission");
    let b = first.clone().of_submission(b"second submission");
    assert_ne!(a.message_id(), b.message_id());
    assert_ne!(started(b"first submission"), started(b"second submission"));
    // Every copy of one submission names it alike.
    assert_eq!(
        a.message_id(),
        first
            .clone()
            .of_submission(b"first submission")
            .message_id()
    );
}

#[test]
fn a_queued_event_is_the_jobs_request_without_script_or_environment() {
    let job = Job::decode(&fixture("job.json")).unwrap();
    assert!(!job.script.is_empty() && !job.env.is_empty());
    let body = job.encode();
    let ev = JobEvent::queued(&job, &body, "alice-broker");
    let text = String::from_utf8(ev.encode()).unwrap();
    assert!(!text.contains(job.script.trim()), "{text}");
    for (k, v) in &job.env {
        assert!(
            !text.contains(&format!("\"{k}\"")) && !text.contains(v.as_str()),
            "{text}"
        );
    }
    assert_eq!(ev.submission, Some(vq_common::messages::fingerprint(&body)));
    assert_eq!(ev.submitter.as_deref(), Some("alice-broker"));
    let JobState::Queued { request } = &ev.state else {
        panic!("{ev:?}")
    };
    assert_eq!(request.walltime, job.walltime);
    assert_eq!(request.submit_host, job.submit_host);
}

#[test]
fn a_delivered_job_event_must_be_routed_as_its_body_says() {
    let finished = fixture("job-event-finished.json");
    let ev = JobEvent::decode(&finished).unwrap();
    let key = |word: &str| vq_common::topology::job_event_key(&ev.pool, word);
    assert!(JobEvent::decode_delivered(&finished, &key("finished"), None).is_ok());
    // A result routed as `queued` (the one key a submitter can route into
    // the events exchange) or to another pool is refused.
    for wrong in [key("queued"), "job.other.finished".to_string()] {
        let err = JobEvent::decode_delivered(&finished, &wrong, None).unwrap_err();
        assert!(matches!(err, DecodeError::Misrouted { .. }), "{err}");
    }
    // A queued event's submitter is the broker-validated user, not its
    // body's claim.
    let queued = fixture("job-event-queued.json");
    let got = JobEvent::decode_delivered(&queued, &key("queued"), Some("bob")).unwrap();
    assert_eq!(got.submitter.as_deref(), Some("bob"));
    let got = JobEvent::decode_delivered(&queued, &key("queued"), None).unwrap();
    assert_eq!(got.submitter, None);
    // So is a held event's, which must be routed as `held`.
    let held = fixture("job-event-held.json");
    let got = JobEvent::decode_delivered(&held, &key("held"), Some("bob")).unwrap();
    assert_eq!(got.submitter.as_deref(), Some("bob"));
    let err = JobEvent::decode_delivered(&held, &key("queued"), Some("bob")).unwrap_err();
    assert!(matches!(err, DecodeError::Misrouted { .. }), "{err}");
    // Other events keep the submitter the agent judged the job by.
    let sub = fixture("job-event-finished-submission.json");
    let e = JobEvent::decode(&sub).unwrap();
    let got = JobEvent::decode_delivered(&sub, &key("finished"), Some("agent-account")).unwrap();
    assert_eq!(got.submitter, e.submitter);
}
