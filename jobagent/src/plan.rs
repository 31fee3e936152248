//! Pure job validation and launch planning: job + submitter + config + user
//! database → [`LaunchPlan`] or a [`Rejection`]. Everything the child needs
//! after `fork` is decided here, in the parent (STYLE practice 10).
//!
//! Paths are only checked for form here (absolute, no NUL): whether the
//! working directory and the shell exist and are usable is checked by the
//! job's process after it became the owner (`chdir`, `stat`, `access`), so
//! a job learns no more about a path than its owner could.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::path::PathBuf;
use std::time::Duration;

use vq_common::config::{AgentConfig, SubmitterRules};
use vq_common::messages::{Job, Join};

use crate::error::Rejection;
use crate::sys::Sys;

pub use vq_common::messages::FALLBACK_SHELL;

/// Everything needed to start one job, decided before `fork`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchPlan {
    /// Job id (for logs).
    pub job_id: String,
    /// Owner's login name.
    pub owner: String,
    /// User id the job runs as (never 0).
    pub uid: u32,
    /// Group id the job runs as.
    pub gid: u32,
    /// Supplementary groups (the owner's full group list).
    pub groups: Vec<u32>,
    /// Absolute shell path; the script is passed to it as a file argument.
    pub shell: CString,
    /// The script text.
    pub script: Vec<u8>,
    /// The complete job environment (nothing of the agent's), in order.
    pub env: Vec<(String, String)>,
    /// Working directory.
    pub cwd: CString,
    /// File that receives stdout (and stderr with `-j oe`).
    pub stdout: CString,
    /// File that receives stderr (and stdout with `-j eo`).
    pub stderr: CString,
    /// How the streams are joined.
    pub join: Join,
    /// File mode creation mask.
    pub umask: u32,
    /// Walltime limit.
    pub walltime: Duration,
    /// Time between SIGTERM and SIGKILL when the job is stopped, and the
    /// longest time leftover processes get after the main process exited.
    pub kill_grace: Duration,
    /// Cap on each output file, bytes (0 = none): `output-limit` past it.
    pub max_output_bytes: u64,
    /// Whether to use a cgroup v2 for the job when available.
    pub cgroups: bool,
    /// `memory.max` of the job's cgroup, bytes (0 = none).
    pub memory_max_bytes: u64,
    /// `cpu.max` quota per 100 ms period, microseconds (0 = none).
    pub cpu_quota_us: u64,
    /// Most processes of the job at once (`job_pids_max`, >= 1): `pids.max`
    /// of its cgroup, or `RLIMIT_NPROC` of the owner without one.
    pub pids_max: u64,
    /// The agent's state directory (records of running jobs live in
    /// `<state_dir>/running`).
    pub state_dir: PathBuf,
    /// Slots the job takes (`PBS_NP`), 1..=the agent's slots.
    pub slots: u32,
    /// `PBS_NODEFILE`: `<nodefile_dir>/<job id>`, written by the
    /// agent (root) before the job starts with `slots` lines of the host
    /// name, mode 0644, removed after the job ([`crate::supervise`]).
    pub nodefile: PathBuf,
    /// `memory.max` the job asked for (`-l mem`), bytes (0 = none): applied
    /// where the memory controller is delegated, skipped elsewhere (unlike
    /// [`LaunchPlan::memory_max_bytes`], the site's hard limit).
    pub requested_memory_bytes: u64,
    /// `cpu.max` quota from the job's slots (`slots` CPUs per
    /// [`CPU_PERIOD_US`]), microseconds: applied where the cpu controller
    /// is delegated, skipped elsewhere.
    pub requested_cpu_quota_us: u64,
}

/// The `PBS_NODEFILE` path of job `id` in `nodefile_dir` (the agent's
/// `nodefile_dir`; job ids are checked labels: no `/`, no leading `.`).
pub fn nodefile_path(nodefile_dir: &std::path::Path, id: &str) -> PathBuf {
    nodefile_dir.join(id)
}

/// The `cpu.max` period used for [`LaunchPlan::cpu_quota_us`], microseconds.
pub const CPU_PERIOD_US: u64 = 100_000;

fn cstring(field: &'static str, s: &str) -> Result<CString, Rejection> {
    CString::new(s).map_err(|_| Rejection::BadField {
        field,
        problem: "contains a NUL byte".into(),
    })
}

fn check_token(field: &'static str, s: &str) -> Result<(), Rejection> {
    if s.is_empty() {
        return Err(Rejection::BadField {
            field,
            problem: "is empty".into(),
        });
    }
    if s.contains(['/', '\0']) || s.chars().any(char::is_control) {
        return Err(Rejection::BadField {
            field,
            problem: format!("{s:?} contains '/', NUL or a control character"),
        });
    }
    Ok(())
}

fn absolute(field: &'static str, p: &str) -> Result<(), Rejection> {
    if !p.starts_with('/') {
        return Err(Rejection::BadField {
            field,
            problem: format!("{p:?} is not an absolute path"),
        });
    }
    Ok(())
}

/// Validates `job` (published by broker user `submitter`) against `cfg` and
/// the host's user database, and builds its [`LaunchPlan`].
///
/// # Errors
/// The first [`Rejection`] found; its text is the reason reported in the
/// `job.<pool>.failed` event.
pub fn plan_job(
    job: &Job,
    submitter: Option<&str>,
    cfg: &AgentConfig,
    sys: &dyn Sys,
) -> Result<LaunchPlan, Rejection> {
    if job.pool != cfg.pool {
        return Err(Rejection::WrongPool {
            job_pool: job.pool.clone(),
            our_pool: cfg.pool.clone(),
        });
    }
    check_token("id", &job.id)?;
    check_token("name", &job.name)?;
    check_resources(job, cfg, sys.memory_bytes())?;
    if job.script.len() > cfg.max_script_bytes {
        return Err(Rejection::ScriptTooLarge {
            size: job.script.len(),
            limit: cfg.max_script_bytes,
        });
    }
    let submitter = submitter.ok_or(Rejection::NoSubmitter)?;
    if !cfg.submitters.allows(submitter, &job.owner) {
        return Err(Rejection::SubmitterNotAllowed {
            submitter: submitter.into(),
            owner: job.owner.clone(),
        });
    }
    let user = sys
        .user_by_name(&job.owner)
        .map_err(|source| Rejection::Lookup {
            what: "user",
            name: job.owner.clone(),
            source,
        })?
        .ok_or_else(|| Rejection::UnknownOwner {
            owner: job.owner.clone(),
        })?;
    if user.uid == 0 {
        return Err(Rejection::RootOwner {
            owner: user.name.clone(),
        });
    }
    if user.uid < cfg.min_uid {
        return Err(Rejection::UidBelowMin {
            owner: user.name.clone(),
            uid: user.uid,
            min_uid: cfg.min_uid,
        });
    }
    if cfg.deny_owners.contains(&user.name) {
        return Err(Rejection::OwnerDenied {
            owner: user.name.clone(),
        });
    }
    if !cfg.allow_owners.is_empty() && !cfg.allow_owners.contains(&user.name) {
        return Err(Rejection::OwnerNotAllowed {
            owner: user.name.clone(),
        });
    }
    let groups = sys
        .group_list(&user.name, user.gid)
        .map_err(|source| Rejection::Lookup {
            what: "group list of user",
            name: user.name.clone(),
            source,
        })?;
    let gid = match &job.group {
        None => user.gid,
        Some(name) => {
            let group = sys
                .group_by_name(name)
                .map_err(|source| Rejection::Lookup {
                    what: "group",
                    name: name.clone(),
                    source,
                })?
                .ok_or_else(|| Rejection::UnknownGroup {
                    group: name.clone(),
                })?;
            if group.gid != user.gid && !groups.contains(&group.gid) {
                return Err(Rejection::NotInGroup {
                    owner: user.name.clone(),
                    group: name.clone(),
                });
            }
            group.gid
        }
    };

    check_groups(&user.name, gid, &groups, cfg, sys)?;

    let workdir = job.workdir.clone().unwrap_or_else(|| user.home.clone());
    if !workdir.starts_with('/') {
        return Err(Rejection::Workdir {
            path: workdir.into(),
            problem: "is not an absolute path",
        });
    }
    let shell = vq_common::messages::job_shell(job.shell.as_deref(), &user.shell).to_string();
    if !shell.starts_with('/') {
        return Err(Rejection::Shell {
            path: PathBuf::from(shell),
            problem: "is not an absolute path",
        });
    }
    let stdout = job
        .stdout
        .clone()
        .unwrap_or_else(|| job.default_stdout(&workdir));
    let stderr = job
        .stderr
        .clone()
        .unwrap_or_else(|| job.default_stderr(&workdir));
    absolute("stdout", &stdout)?;
    absolute("stderr", &stderr)?;
    // Two separate opens of one file would overwrite each other: join them.
    let join = if stdout == stderr && job.join == Join::N {
        Join::Oe
    } else {
        job.join
    };
    let umask = job.umask.unwrap_or(cfg.default_umask);
    if umask > 0o777 {
        return Err(Rejection::BadField {
            field: "umask",
            problem: format!("{umask:o} is not a umask (0..=0o777)"),
        });
    }
    let walltime = job.walltime.unwrap_or(cfg.default_walltime_secs);
    if walltime == 0 {
        return Err(Rejection::BadField {
            field: "walltime",
            problem: "must be at least 1 second".into(),
        });
    }
    if walltime > cfg.max_walltime_secs {
        return Err(Rejection::BadField {
            field: "walltime",
            problem: format!(
                "{walltime} s is more than this pool's max_walltime_secs {}",
                cfg.max_walltime_secs
            ),
        });
    }
    check_label("id", &job.id, vq_common::messages::MAX_JOB_ID_BYTES)?;
    if job.id.len() > vq_common::messages::MAX_JOB_ID_BYTES {
        return Err(Rejection::BadField {
            field: "id",
            problem: format!(
                "is longer than {} bytes",
                vq_common::messages::MAX_JOB_ID_BYTES
            ),
        });
    }
    check_label("name", &job.name, 236)?;

    let env = job_environment(job, &user.name, &user.home, &shell, &workdir, cfg)?;
    Ok(LaunchPlan {
        job_id: job.id.clone(),
        owner: user.name.clone(),
        uid: user.uid,
        gid,
        groups,
        shell: cstring("shell", &shell)?,
        script: job.script.clone().into_bytes(),
        env,
        cwd: cstring("workdir", &workdir)?,
        stdout: cstring("stdout", &stdout)?,
        stderr: cstring("stderr", &stderr)?,
        join,
        umask,
        walltime: Duration::from_secs(walltime),
        kill_grace: Duration::from_secs(cfg.kill_grace_secs),
        max_output_bytes: cfg.max_output_bytes,
        cgroups: cfg.cgroups,
        memory_max_bytes: cfg.job_memory_max_bytes,
        cpu_quota_us: (cfg.job_cpu_max * CPU_PERIOD_US as f64).round() as u64,
        pids_max: cfg.job_pids_max,
        state_dir: cfg.state_dir.clone(),
        slots: job.slots,
        nodefile: nodefile_path(&cfg.nodefile_dir, &job.id),
        requested_memory_bytes: job.mem.unwrap_or(0),
        requested_cpu_quota_us: u64::from(job.slots) * CPU_PERIOD_US,
    })
}

/// Refuses a job that asks for more than this VM has: more slots than the
/// agent's `slots`, or more memory (`-l mem`) than the VM's `memory`
/// bytes (`MemTotal`; `None` when unknown: not checked).
///
/// # Errors
/// [`Rejection::TooLarge`].
pub fn check_resources(job: &Job, cfg: &AgentConfig, memory: Option<u64>) -> Result<(), Rejection> {
    if job.slots == 0 {
        return Err(Rejection::BadField {
            field: "slots",
            problem: "must be at least 1".into(),
        });
    }
    if job.slots > cfg.slots {
        return Err(Rejection::TooLarge {
            what: "slots",
            asked: format!("{} slots (ppn/ncpus)", job.slots),
            have: format!("{} slots", cfg.slots),
        });
    }
    if let (Some(mem), Some(total)) = (job.mem, memory) {
        if mem > total {
            return Err(Rejection::TooLarge {
                what: "memory",
                asked: format!("mem={mem} bytes"),
                have: format!("{total} bytes of memory"),
            });
        }
    }
    Ok(())
}

/// Refuses a job with dependencies that does not come from the
/// controller's release: only a `user_id` among `rules.requeuers` (the
/// controller, which releases held jobs into their pool with the requeue
/// envelope) may deliver one; anyone else published it straight to the
/// pool queue, where it would run without waiting.
///
/// # Errors
/// [`Rejection::NotReleased`].
pub fn check_released(
    job: &Job,
    user_id: Option<&str>,
    rules: &SubmitterRules,
) -> Result<(), Rejection> {
    if job.depend.is_empty() || user_id.is_some_and(|u| rules.requeuers.iter().any(|r| r == u)) {
        return Ok(());
    }
    let depend: Vec<String> = job.depend.iter().map(ToString::to_string).collect();
    Err(Rejection::NotReleased {
        depend: depend.join(","),
    })
}

/// [`plan_job`] on a blocking thread, so that owner and group lookups
/// (`getent`, each bounded by [`crate::nss::GETENT_TIMEOUT`]; a slow
/// LDAP/SSSD answers in seconds) never stall the async runtime: heartbeats
/// and control keep running while a job is planned. Clones `job`, `cfg`
/// and `sys` for the thread.
///
/// # Errors
/// As [`plan_job`]; a lookup that timed out is a [`Rejection::Lookup`] whose
/// source says so ("lookup timed out after N s: getent passwd NAME");
/// [`Rejection::PlanningFailed`] if the planning thread panicked.
pub async fn plan_job_async<S: Sys + Clone + 'static>(
    job: &Job,
    submitter: Option<&str>,
    cfg: &AgentConfig,
    sys: &S,
) -> Result<LaunchPlan, Rejection> {
    let (job, submitter, cfg, sys) = (
        job.clone(),
        submitter.map(str::to_owned),
        cfg.clone(),
        sys.clone(),
    );
    tokio::task::spawn_blocking(move || plan_job(&job, submitter.as_deref(), &cfg, &sys))
        .await
        .unwrap_or_else(|e| Err(Rejection::PlanningFailed(e)))
}

/// Group policy: gid 0 only with `allow_group_zero`; none of the owner's
/// groups (primary, job group, supplementary) in `deny_groups`; at least one
/// in `allow_groups` when that is set. Config group names that do not exist
/// on the host match nothing.
fn check_groups(
    owner: &str,
    gid: u32,
    groups: &[u32],
    cfg: &AgentConfig,
    sys: &dyn Sys,
) -> Result<(), Rejection> {
    let member = |g: u32| g == gid || groups.contains(&g);
    if !cfg.allow_group_zero && member(0) {
        return Err(Rejection::GroupZero {
            owner: owner.into(),
        });
    }
    let resolve = |name: &String| -> Result<Option<u32>, Rejection> {
        Ok(sys
            .group_by_name(name)
            .map_err(|source| Rejection::Lookup {
                what: "group",
                name: name.clone(),
                source,
            })?
            .map(|g| g.gid))
    };
    for name in &cfg.deny_groups {
        if resolve(name)?.is_some_and(member) {
            return Err(Rejection::GroupDenied {
                owner: owner.into(),
                group: name.clone(),
            });
        }
    }
    if !cfg.allow_groups.is_empty() {
        let mut allowed = false;
        for name in &cfg.allow_groups {
            if resolve(name)?.is_some_and(member) {
                allowed = true;
                break;
            }
        }
        if !allowed {
            return Err(Rejection::GroupNotAllowed {
                owner: owner.into(),
            });
        }
    }
    Ok(())
}

/// The job environment, built from nothing: the job's variables, then the
/// PBS set and the owner's identity, which win over the job's. Nothing of
/// the agent's own environment (credentials, `LD_*`, config paths) is
/// passed.
///
/// Non-UTF-8 bytes cannot arrive: the job message is JSON and its `env` is
/// a map of strings, so a non-UTF-8 value is a decode error (the job is
/// refused as malformed, never a panic). Variables such as `LD_PRELOAD` or
/// `BASH_ENV` in the job's own `-v` list are passed, as PBS does: they
/// affect only processes that already run as the owner.
///
/// # Errors
/// [`Rejection::BadField`] for a name that is empty or contains `=` or NUL,
/// or a value that contains NUL.
pub fn job_environment(
    job: &Job,
    user: &str,
    home: &str,
    shell: &str,
    workdir: &str,
    cfg: &AgentConfig,
) -> Result<Vec<(String, String)>, Rejection> {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in &job.env {
        if k.is_empty() || k.contains(['=', '\0']) {
            return Err(Rejection::BadField {
                field: "env",
                problem: format!("variable name {k:?} is empty or contains '=' or NUL"),
            });
        }
        if v.contains('\0') {
            return Err(Rejection::BadField {
                field: "env",
                problem: format!("value of {k:?} contains NUL"),
            });
        }
        env.insert(k.clone(), v.clone());
    }
    let np = job.slots.to_string();
    let nodefile = nodefile_path(&cfg.nodefile_dir, &job.id)
        .to_string_lossy()
        .into_owned();
    let fixed = [
        ("PBS_JOBID", job.id.as_str()),
        ("PBS_JOBNAME", job.name.as_str()),
        ("PBS_O_WORKDIR", workdir),
        ("PBS_QUEUE", job.pool.as_str()),
        ("PBS_O_QUEUE", job.pool.as_str()),
        ("PBS_O_HOST", job.submit_host.as_str()),
        ("PBS_ENVIRONMENT", "PBS_BATCH"),
        ("PBS_NP", np.as_str()),
        ("PBS_NUM_PPN", np.as_str()),
        ("PBS_NUM_NODES", "1"),
        ("PBS_NODEFILE", nodefile.as_str()),
        ("HOME", home),
        ("USER", user),
        ("LOGNAME", user),
        ("SHELL", shell),
        ("PATH", cfg.job_path.as_str()),
    ];
    for (k, v) in fixed {
        if v.contains('\0') {
            return Err(Rejection::BadField {
                field: "env",
                problem: format!("value of {k} contains NUL"),
            });
        }
        env.insert(k.into(), v.into());
    }
    Ok(env.into_iter().collect())
}

/// Job ids and names end up in file names, logs, events and terminals: 1 to
/// `max` characters, no control characters, no `/`, not starting with `.`
/// or `-` (the PBS job-name rules, extended to ids).
fn check_label(field: &'static str, value: &str, max: usize) -> Result<(), Rejection> {
    let problem = if value.is_empty() {
        Some("is empty".to_string())
    } else if value.chars().count() > max {
        Some(format!("is longer than {max} characters"))
    } else if value
        .chars()
        .any(|c| c.is_control() || c == '/' || c.is_whitespace())
    {
        Some("contains a control character, white space or '/'".to_string())
    } else if value.starts_with('.') || value.starts_with('-') {
        Some("starts with '.' or '-'".to_string())
    } else {
        None
    };
    match problem {
        Some(problem) => Err(Rejection::BadField { field, problem }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::NssError;
    use crate::sys::FakeSys;

    fn cfg() -> AgentConfig {
        AgentConfig {
            pool: "p".into(),
            submitters: vq_common::config::SubmitterRules {
                trusted: vec!["bridge".into()],
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn job(owner: &str) -> Job {
        serde_json::from_value(serde_json::json!({
            "id": "42-x", "name": "sim", "owner": owner, "pool": "p",
            "script": "echo hi", "env": {"FOO": "bar", "PATH": "/evil"},
        }))
        .unwrap()
    }

    fn sys() -> FakeSys {
        FakeSys::default()
            .with_user("alice", 2001)
            .with_user("low", 500)
            .with_user("root", 0)
            .with_group("physics", 3000, &["alice"])
            .with_group("other", 3001, &[])
    }

    #[test]
    fn a_valid_job_gets_the_owner_ids_and_a_clean_pbs_environment() {
        let plan = plan_job(&job("alice"), Some("alice"), &cfg(), &sys()).unwrap();
        assert_eq!((plan.uid, plan.gid), (2001, 2001));
        assert_eq!(plan.groups, vec![2001, 3000]);
        assert_eq!(plan.cwd.to_str().unwrap(), "/home/alice");
        assert_eq!(plan.stdout.to_str().unwrap(), "/home/alice/sim.o42");
        assert_eq!(plan.stderr.to_str().unwrap(), "/home/alice/sim.e42");
        let env: BTreeMap<_, _> = plan.env.iter().cloned().collect();
        assert_eq!(env["FOO"], "bar");
        assert_eq!(
            env["PATH"], "/usr/local/bin:/usr/bin:/bin",
            "job may not set PATH"
        );
        assert_eq!(env["PBS_JOBID"], "42-x");
        assert_eq!(env["PBS_O_WORKDIR"], "/home/alice");
        assert_eq!(env["PBS_ENVIRONMENT"], "PBS_BATCH");
        assert_eq!(env["USER"], "alice");
        assert_eq!(
            env.len(),
            17,
            "13 + PBS_NP, PBS_NUM_PPN, PBS_NUM_NODES, PBS_NODEFILE"
        );
    }

    #[test]
    fn a_walltime_past_the_maximum_or_a_hostile_id_or_name_is_refused() {
        let (s, c) = (sys(), cfg());
        let mut j = job("alice");
        j.walltime = Some(u64::MAX);
        let err = plan_job(&j, Some("alice"), &c, &s).unwrap_err();
        assert!(
            matches!(
                err,
                Rejection::BadField {
                    field: "walltime",
                    ..
                }
            ),
            "{err}"
        );
        for bad_id in [
            "",
            "a/b",
            "esc\u{1b}[2J",
            "-rf",
            ".hidden",
            "sp ace",
            &"x".repeat(129),
        ] {
            let mut j = job("alice");
            j.id = bad_id.into();
            let err = plan_job(&j, Some("alice"), &c, &s).unwrap_err();
            assert!(
                matches!(err, Rejection::BadField { field: "id", .. }),
                "{bad_id:?}: {err}"
            );
        }
        let mut j = job("alice");
        j.name = "a\nb".into();
        assert!(plan_job(&j, Some("alice"), &c, &s).is_err());
        let mut j = job("alice");
        j.walltime = Some(c.max_walltime_secs);
        assert!(plan_job(&j, Some("alice"), &c, &s).is_ok());
    }

    #[test]
    fn root_low_uids_and_unknown_owners_are_refused() {
        let s = sys();
        let c = cfg();
        let r = |o: &str| plan_job(&job(o), Some("bridge"), &c, &s).unwrap_err();
        assert!(matches!(r("root"), Rejection::RootOwner { .. }));
        assert!(matches!(r("low"), Rejection::UidBelowMin { uid: 500, .. }));
        assert!(matches!(r("nobody-here"), Rejection::UnknownOwner { .. }));
    }

    #[test]
    fn submitter_rules_are_enforced() {
        let s = sys();
        let c = cfg();
        assert!(matches!(
            plan_job(&job("alice"), None, &c, &s),
            Err(Rejection::NoSubmitter)
        ));
        assert!(matches!(
            plan_job(&job("alice"), Some("mallory"), &c, &s),
            Err(Rejection::SubmitterNotAllowed { .. })
        ));
        assert!(plan_job(&job("alice"), Some("bridge"), &c, &s).is_ok());
    }

    #[test]
    fn a_job_with_dependencies_runs_only_when_the_controller_released_it() {
        let mut rules = cfg().submitters;
        rules.requeuers.push("vq-controller".into());
        let mut j = job("alice");
        assert!(check_released(&j, Some("alice"), &rules).is_ok());
        j.depend = vec![vq_common::messages::Dependency {
            kind: vq_common::messages::DependKind::AfterOk,
            jobs: vec!["12".into()],
        }];
        assert!(check_released(&j, Some("vq-controller"), &rules).is_ok());
        for user in [Some("alice"), Some("bridge"), None] {
            let err = check_released(&j, user, &rules).unwrap_err();
            assert!(
                err.to_string().contains("dependencies (afterok:12)"),
                "{err}"
            );
        }
    }

    #[test]
    fn groups_must_exist_and_contain_the_owner() {
        let s = sys();
        let c = cfg();
        let mut j = job("alice");
        j.group = Some("physics".into());
        assert_eq!(plan_job(&j, Some("alice"), &c, &s).unwrap().gid, 3000);
        j.group = Some("other".into());
        assert!(matches!(
            plan_job(&j, Some("alice"), &c, &s),
            Err(Rejection::NotInGroup { .. })
        ));
        j.group = Some("ghosts".into());
        assert!(matches!(
            plan_job(&j, Some("alice"), &c, &s),
            Err(Rejection::UnknownGroup { .. })
        ));
    }

    #[test]
    fn bad_environment_paths_and_names_are_refused() {
        let s = sys();
        let c = cfg();
        let mut j = job("alice");
        j.env.insert("A=B".into(), "x".into());
        assert!(matches!(
            plan_job(&j, Some("alice"), &c, &s),
            Err(Rejection::BadField { field: "env", .. })
        ));
        let mut j = job("alice");
        j.name = "../../etc/x".into();
        assert!(matches!(
            plan_job(&j, Some("alice"), &c, &s),
            Err(Rejection::BadField { field: "name", .. })
        ));
        let mut j = job("alice");
        j.workdir = Some("relative/dir".into());
        assert!(matches!(
            plan_job(&j, Some("alice"), &c, &s),
            Err(Rejection::Workdir { .. })
        ));
        let mut j = job("alice");
        j.shell = Some("zsh".into());
        assert!(matches!(
            plan_job(&j, Some("alice"), &c, &s),
            Err(Rejection::Shell { .. })
        ));
        let mut j = job("alice");
        j.pool = "q".into();
        assert!(matches!(
            plan_job(&j, Some("alice"), &c, &s),
            Err(Rejection::WrongPool { .. })
        ));
    }

    #[test]
    fn the_planner_never_probes_paths_so_root_reveals_nothing_about_them() {
        let s = sys();
        let mut j = job("alice");
        j.workdir = Some("/root/secret".into());
        j.shell = Some("/root/bin/sh".into());
        let plan = plan_job(&j, Some("alice"), &cfg(), &s).unwrap();
        assert_eq!(plan.cwd.to_str().unwrap(), "/root/secret");
        assert_eq!(plan.shell.to_str().unwrap(), "/root/bin/sh");
        let calls = s.calls.lock().unwrap();
        assert!(
            calls.iter().all(|c| !c.contains("/root")),
            "paths are checked by the job as the owner: {calls:?}"
        );
    }

    #[test]
    fn group_zero_is_refused_unless_configured() {
        let mut s = sys().with_group("root", 0, &["alice"]);
        let c = cfg();
        assert!(matches!(
            plan_job(&job("alice"), Some("alice"), &c, &s),
            Err(Rejection::GroupZero { .. })
        ));
        let mut allow = cfg();
        allow.allow_group_zero = true;
        assert!(plan_job(&job("alice"), Some("alice"), &allow, &s)
            .unwrap()
            .groups
            .contains(&0));
        // A primary group 0 is refused too, and so is `-W group=root`.
        s.groups.remove("root");
        s.users.get_mut("alice").unwrap().gid = 0;
        assert!(matches!(
            plan_job(&job("alice"), Some("alice"), &c, &s),
            Err(Rejection::GroupZero { .. })
        ));
        let s = sys().with_group("root", 0, &[]);
        let mut j = job("alice");
        j.group = Some("root".into());
        assert!(matches!(
            plan_job(&j, Some("alice"), &c, &s),
            Err(Rejection::NotInGroup { .. }) | Err(Rejection::GroupZero { .. })
        ));
    }

    #[test]
    fn the_full_group_list_is_used_and_group_lists_apply() {
        let s = sys();
        let plan = plan_job(&job("alice"), Some("alice"), &cfg(), &s).unwrap();
        assert_eq!(
            plan.groups,
            vec![2001, 3000],
            "primary first, then NSS list"
        );
        let mut c = cfg();
        c.deny_groups = vec!["physics".into()];
        assert!(matches!(
            plan_job(&job("alice"), Some("alice"), &c, &s),
            Err(Rejection::GroupDenied { .. })
        ));
        let mut c = cfg();
        c.allow_groups = vec!["other".into(), "no-such-group".into()];
        assert!(matches!(
            plan_job(&job("alice"), Some("alice"), &c, &s),
            Err(Rejection::GroupNotAllowed { .. })
        ));
        c.allow_groups.push("physics".into());
        assert!(plan_job(&job("alice"), Some("alice"), &c, &s).is_ok());
    }

    #[test]
    fn hostile_environment_names_are_refused_and_ld_vars_pass() {
        let s = sys();
        let c = cfg();
        for bad in ["", "A=B", "=", "A\0B"] {
            let mut j = job("alice");
            j.env.insert(bad.into(), "x".into());
            assert!(
                matches!(
                    plan_job(&j, Some("alice"), &c, &s),
                    Err(Rejection::BadField { field: "env", .. })
                ),
                "{bad:?}"
            );
        }
        let mut j = job("alice");
        j.env.insert("V".into(), "a\0b".into());
        assert!(plan_job(&j, Some("alice"), &c, &s).is_err());
        let mut j = job("alice");
        j.env.insert("LD_PRELOAD".into(), "/home/alice/x.so".into());
        j.env.insert("HOME".into(), "/root".into());
        j.env.insert("USER".into(), "root".into());
        let env: BTreeMap<_, _> = plan_job(&j, Some("alice"), &c, &s)
            .unwrap()
            .env
            .into_iter()
            .collect();
        assert_eq!(env["LD_PRELOAD"], "/home/alice/x.so");
        assert_eq!(env["HOME"], "/home/alice", "identity variables win");
        assert_eq!(env["USER"], "alice");
    }

    #[test]
    fn limits_come_from_the_config() {
        let mut c = cfg();
        c.job_cpu_max = 1.5;
        c.job_memory_max_bytes = 1 << 30;
        c.max_output_bytes = 4096;
        c.job_pids_max = 64;
        let plan = plan_job(&job("alice"), Some("alice"), &c, &sys()).unwrap();
        assert_eq!(plan.pids_max, 64);
        assert_eq!(plan.cpu_quota_us, 150_000);
        assert_eq!(plan.memory_max_bytes, 1 << 30);
        assert_eq!(plan.max_output_bytes, 4096);
    }

    #[test]
    fn deny_and_allow_lists_apply() {
        let s = sys();
        let mut c = cfg();
        c.deny_owners = vec!["alice".into()];
        assert!(matches!(
            plan_job(&job("alice"), Some("alice"), &c, &s),
            Err(Rejection::OwnerDenied { .. })
        ));
        let mut c = cfg();
        c.allow_owners = vec!["bob".into()];
        assert!(matches!(
            plan_job(&job("alice"), Some("alice"), &c, &s),
            Err(Rejection::OwnerNotAllowed { .. })
        ));
    }

    /// Users through a real [`crate::nss::Nss`] (a fake getent), the
    /// rest empty.
    #[derive(Clone)]
    struct NssSys(crate::nss::Nss);

    impl Sys for NssSys {
        fn user_by_name(&self, name: &str) -> Result<Option<crate::sys::UserEntry>, NssError> {
            self.0.user(name)
        }
        fn group_by_name(&self, name: &str) -> Result<Option<crate::sys::GroupEntry>, NssError> {
            self.0.group(name)
        }
        fn group_list(&self, user: &str, primary: u32) -> Result<Vec<u32>, NssError> {
            self.0.group_list(user, primary)
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_hanging_owner_lookup_times_out_with_a_reason_while_the_runtime_keeps_running() {
        use std::time::Instant;
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("getent");
        std::fs::write(&fake, "#!/bin/sh\nexec sleep 30\n").unwrap();
        std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let timeout = Duration::from_millis(500);
        let sys = NssSys(crate::nss::Nss::new(Some(fake), timeout));
        // Another task on this single-threaded runtime: it ticks every 20 ms
        // and records when.
        let ticks = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
        let ticker = {
            let ticks = ticks.clone();
            tokio::spawn(async move {
                let mut every = tokio::time::interval(Duration::from_millis(20));
                loop {
                    every.tick().await;
                    ticks.lock().unwrap().push(Instant::now());
                }
            })
        };
        tokio::task::yield_now().await;
        // A test thread forking while the script above was still open for
        // writing makes its exec fail with ETXTBSY for a moment.
        for _ in 0..50 {
            let t0 = Instant::now();
            let r = plan_job_async(&job("alice"), Some("alice"), &cfg(), &sys).await;
            let t1 = Instant::now();
            let err = r.unwrap_err();
            if let Rejection::Lookup {
                source: NssError::Exec { source, .. },
                ..
            } = &err
            {
                if source.raw_os_error() == Some(nix::libc::ETXTBSY) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            }
            let reason = crate::error::chain(&err);
            assert!(
                matches!(
                    err,
                    Rejection::Lookup {
                        source: NssError::Timeout { .. },
                        ..
                    }
                ),
                "{reason}"
            );
            assert!(
                reason.contains("timed out after 0.5 s") && reason.contains("passwd alice"),
                "{reason}"
            );
            assert!(t1 - t0 < Duration::from_secs(3), "took {:?}", t1 - t0);
            let during = ticks
                .lock()
                .unwrap()
                .iter()
                .filter(|t| **t > t0 && **t < t1)
                .count();
            // 500 ms at one tick per 20 ms: about 25.
            assert!(
                during >= 10,
                "the runtime stalled during the lookup: {during} ticks in {:?}",
                t1 - t0
            );
            ticker.abort();
            return;
        }
        panic!("getent stayed busy (ETXTBSY)");
    }

    #[test]
    fn a_job_of_n_slots_gets_pbs_np_and_a_nodefile_and_its_cgroup_request() {
        let mut c = cfg();
        c.slots = 4;
        let mut j = job("alice");
        j.slots = 3;
        j.mem = Some(1 << 30);
        let plan = plan_job(&j, Some("alice"), &c, &sys()).unwrap();
        let env: BTreeMap<_, _> = plan.env.iter().cloned().collect();
        assert_eq!(env["PBS_NP"], "3");
        assert_eq!(env["PBS_NUM_PPN"], "3");
        assert_eq!(env["PBS_NUM_NODES"], "1");
        let nodefile = c.nodefile_dir.join("42-x");
        assert_eq!(env["PBS_NODEFILE"], nodefile.to_str().unwrap());
        assert_eq!(plan.nodefile, nodefile);
        assert_eq!(plan.slots, 3);
        assert_eq!(plan.requested_memory_bytes, 1 << 30);
        assert_eq!(plan.requested_cpu_quota_us, 3 * CPU_PERIOD_US);
        // A job without the field takes one slot.
        let plan = plan_job(&job("alice"), Some("alice"), &c, &sys()).unwrap();
        let env: BTreeMap<_, _> = plan.env.iter().cloned().collect();
        assert_eq!(env["PBS_NP"], "1");
        assert_eq!(plan.requested_memory_bytes, 0);
    }

    #[test]
    fn a_job_larger_than_the_vm_is_refused_with_what_it_asked_and_what_there_is() {
        let mut c = cfg();
        c.slots = 2;
        let mut j = job("alice");
        j.slots = 4;
        let e = plan_job(&j, Some("alice"), &c, &sys()).unwrap_err();
        assert!(
            matches!(e, Rejection::TooLarge { what: "slots", .. }),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "job asks for 4 slots (ppn/ncpus), more than this VM has (2 slots): it cannot run in this pool"
        );
        let mut j = job("alice");
        j.mem = Some(8 << 30);
        let e = check_resources(&j, &c, Some(4 << 30)).unwrap_err();
        assert!(e.to_string().contains("mem=8589934592 bytes"), "{e}");
        assert!(
            check_resources(&j, &c, None).is_ok(),
            "unknown memory: not checked"
        );
        assert_eq!(
            crate::sys::meminfo_total("MemTotal:       16318504 kB\nMemFree: 1 kB\n"),
            Some(16_318_504 * 1024)
        );
    }
}
