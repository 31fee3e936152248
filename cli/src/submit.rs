//! `vq submit`: build a [`Job`] from a script's `#PBS` directives and
//! `qsub`-style options, check it against its pool's limits as the
//! controller publishes them ([`crate::limits`]), publish it to the pool
//! queue, print its id.
//!
//! Semantics (Torque `qsub`, adapted):
//!
//! * command-line options override script directives;
//! * the job runs in `-d DIR` if given, else in the submit directory (Torque
//!   would use `$HOME` and leave the submit directory in `PBS_O_WORKDIR`;
//!   vq starts the job where it was submitted, which is what scripts that
//!   `cd $PBS_O_WORKDIR` expect anyway, on a shared file system);
//! * stdout/stderr default to `<submit dir>/<name>.o<seq>` and `.e<seq>`;
//!   relative `-o`/`-e` paths are relative to the submit directory, and a
//!   path naming a directory (existing, or ending in `/`) gets the default
//!   file name inside it;
//! * the job name defaults to the script's file name (`STDIN` for stdin);
//! * `-V` copies the submit environment except `VQ_*` variables and any
//!   variable whose value contains the broker URL (it holds a password, and
//!   the job message is readable by the pool's agents); `-v` variables are
//!   added on top, and the `PBS_O_*` set last;
//! * the owner is always the invoking Unix user; the broker validates the
//!   message's `user_id` (the broker user) and the agent decides whether
//!   that broker user may submit for that owner.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use vq_common::amqp::{self, AmqpError};
use vq_common::messages::{
    job_shell, Job, JobEvent, Message, MAX_JOB_MESSAGE_BYTES, MAX_SCRIPT_BYTES, SCHEMA_VERSION,
};
use vq_common::pbs::{self, Directives, VarValue, Warning};
use vq_common::topology::{job_event_key, Topology};

use crate::error::{amqp_reply_code, CliError, SubmitError, NOT_FOUND};
use crate::events;
use crate::limits::Limits;
use crate::settings::Settings;

/// Pool used when neither `-q` nor `#PBS -q` names one.
pub const DEFAULT_POOL: &str = "default";

/// Facts about the submission that do not come from the script or options.
#[derive(Debug, Clone)]
pub struct SubmitContext {
    /// The new job's id.
    pub job_id: String,
    /// Invoking Unix user (the job owner).
    pub user: String,
    /// The user's home directory (from the password database).
    pub home: String,
    /// The user's login shell (from the password database).
    pub login_shell: String,
    /// Absolute submit directory.
    pub submit_dir: String,
    /// Submit host name.
    pub host: String,
    /// Submit environment.
    pub env: BTreeMap<String, String>,
    /// Submission time, Unix seconds.
    pub now: u64,
    /// Broker URL; variables holding it are not copied by `-V`.
    pub broker_url: String,
    /// Whether a path is an existing directory on the submit host (for
    /// `-o`/`-e` naming a directory).
    pub is_dir: fn(&Path) -> bool,
}

/// A job built from a script, plus what the user should be told.
#[derive(Debug, Clone)]
pub struct Built {
    /// The job.
    pub job: Job,
    /// Directives and options accepted but not (fully) honoured.
    pub warnings: Vec<Warning>,
}

/// Builds the job from `script` (named `script_name`, `-` for stdin), the
/// command-line options `flags`, and `ctx`. Pure apart from `ctx.is_dir`.
///
/// # Errors
/// [`SubmitError`].
pub fn build_job(
    script: &[u8],
    script_name: &str,
    flags: Directives,
    ctx: &SubmitContext,
) -> Result<Built, SubmitError> {
    if script.len() > MAX_SCRIPT_BYTES {
        return Err(SubmitError::ScriptTooLarge {
            size: script.len(),
            limit: MAX_SCRIPT_BYTES,
        });
    }
    let text = std::str::from_utf8(script).map_err(|_| SubmitError::ScriptNotText)?;
    if text.trim().is_empty() {
        return Err(SubmitError::EmptyScript);
    }
    let from_script = pbs::parse_script(text).map_err(|source| SubmitError::Directive {
        script: if script_name == "-" {
            "the script read from stdin".to_string()
        } else {
            script_name.to_string()
        },
        source,
    })?;
    let d = from_script.overridden_by(flags);
    let mut warnings = d.warnings.clone();

    let name = match &d.name {
        Some(n) => n.clone(),
        None if script_name == "-" => "STDIN".to_string(),
        None => pbs::sanitize_job_name(
            Path::new(script_name)
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default()
                .as_str(),
        ),
    };
    let pool = d.queue.clone().unwrap_or_else(|| DEFAULT_POOL.to_string());
    let submit_dir = ctx.submit_dir.clone();
    let workdir = match &d.workdir {
        Some(w) => absolute(&submit_dir, w),
        None => submit_dir.clone(),
    };

    let mut job = Job {
        schema: SCHEMA_VERSION,
        id: ctx.job_id.clone(),
        name,
        owner: ctx.user.clone(),
        group: d.group.clone(),
        pool: pool.clone(),
        script: text.to_string(),
        shell: d.shell.clone(),
        workdir: Some(workdir),
        env: BTreeMap::new(),
        stdout: None,
        stderr: None,
        join: d.join.unwrap_or_default(),
        walltime: d.walltime,
        slots: d.slots.unwrap_or(1),
        mem: d.mem,
        rerunnable: d.rerunnable.unwrap_or(true),
        umask: d.umask,
        submit_host: ctx.host.clone(),
        submitted_at: ctx.now,
        depend: d.depend.clone(),
    };
    let default_out = job.default_stdout(&submit_dir);
    let default_err = job.default_stderr(&submit_dir);
    job.stdout = Some(output_path(
        &submit_dir,
        d.stdout.as_deref(),
        &default_out,
        ctx.is_dir,
    ));
    job.stderr = Some(output_path(
        &submit_dir,
        d.stderr.as_deref(),
        &default_err,
        ctx.is_dir,
    ));
    job.env = environment(&d, ctx, &pool, &mut warnings);
    warnings.extend(script_warnings(
        text,
        job.shell.as_deref(),
        &ctx.login_shell,
    ));

    let size = job.encode().len();
    if size > MAX_JOB_MESSAGE_BYTES {
        return Err(SubmitError::JobTooLarge {
            size,
            limit: MAX_JOB_MESSAGE_BYTES,
        });
    }
    Ok(Built { job, warnings })
}

/// Shells that run a POSIX `sh` script as `sh` would.
const POSIX_SHELLS: [&str; 6] = ["sh", "bash", "dash", "ksh", "mksh", "zsh"];

/// Warnings about the script text itself:
/// - CRLF line endings (sbatch refuses such scripts: the shell sees a `\r`
///   at the end of every command);
/// - a `#!` interpreter line that the job will not honour: as with Torque,
///   the agent hands the script to [`job_shell`] (the `-S` shell, else the
///   owner's login shell `login_shell`, else `/bin/sh`), so `#!` is a
///   comment. A `#!/bin/sh` script run by a POSIX shell
///   ([`POSIX_SHELLS`]) is not warned about.
pub fn script_warnings(text: &str, shell: Option<&str>, login_shell: &str) -> Vec<Warning> {
    let mut out = Vec::new();
    if let Some(i) = text.split('\n').position(|l| l.ends_with('\r')) {
        out.push(Warning {
            line: Some(i + 1),
            message: "the script has DOS line endings (CRLF): the shell will see a \\r at the end \
                      of every line; convert it with `dos2unix` (sbatch refuses such scripts)"
                .into(),
        });
    }
    let Some(interp) = text
        .split('\n')
        .next()
        .map(|l| l.trim_end_matches('\r'))
        .and_then(|l| l.strip_prefix("#!"))
    else {
        return out;
    };
    let mut words = interp.split_whitespace();
    let Some(first) = words.next() else {
        return out;
    };
    let base = |p: &str| p.rsplit('/').next().unwrap_or(p).to_string();
    // `#!/usr/bin/env python3`: the interpreter is env's argument, found on
    // the PATH, so `-S` (an absolute path) cannot be given for certain.
    let (wanted, absolute) = if base(first) == "env" {
        match words.find(|w| !w.starts_with('-')) {
            Some(w) => (base(w), None),
            None => return out,
        }
    } else {
        (base(first), Some(first))
    };
    let runner = job_shell(shell, login_shell);
    let runs = base(runner);
    let compatible = runs == wanted || (wanted == "sh" && POSIX_SHELLS.contains(&runs.as_str()));
    if !compatible {
        let by = if shell.is_some() {
            "the -S shell"
        } else {
            "the owner's login shell; the #! line is a comment, as with Torque"
        };
        out.push(Warning {
            line: Some(1),
            message: format!(
                "the script asks for {wanted:?} (#!{}) but will be run by {runner} ({by}); \
                 use {} to run it with its interpreter",
                interp.trim(),
                match absolute {
                    Some(path) => format!("`-S {path}`"),
                    None =>
                        format!("`-S` with the absolute path of {wanted} (`command -v {wanted}`)"),
                }
            ),
        });
    }
    out
}

/// The job environment: `-V` copy, then `-v` variables, then `PBS_O_*`.
fn environment(
    d: &Directives,
    ctx: &SubmitContext,
    pool: &str,
    warnings: &mut Vec<Warning>,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    if d.export_all {
        for (k, v) in &ctx.env {
            let secret =
                k.starts_with("VQ_") || (!ctx.broker_url.is_empty() && v.contains(&ctx.broker_url));
            if !secret && pbs::valid_var_name(k) {
                env.insert(k.clone(), v.clone());
            }
        }
    }
    for (k, v) in &d.vars {
        let value = match v {
            VarValue::Given(s) => s.clone(),
            VarValue::FromEnvironment => match ctx.env.get(k) {
                Some(s) => s.clone(),
                None => {
                    warnings.push(Warning {
                        line: None,
                        message: format!(
                            "-v {k}: not set in the submit environment, exported empty"
                        ),
                    });
                    String::new()
                }
            },
        };
        env.insert(k.clone(), value);
    }
    let get = |k: &str| ctx.env.get(k).filter(|v| !v.is_empty()).cloned();
    env.insert(
        "PBS_O_HOME".into(),
        get("HOME").unwrap_or_else(|| ctx.home.clone()),
    );
    env.insert(
        "PBS_O_LOGNAME".into(),
        get("LOGNAME").unwrap_or_else(|| ctx.user.clone()),
    );
    env.insert(
        "PBS_O_SHELL".into(),
        get("SHELL").unwrap_or_else(|| ctx.login_shell.clone()),
    );
    env.insert("PBS_O_HOST".into(), ctx.host.clone());
    env.insert("PBS_O_WORKDIR".into(), ctx.submit_dir.clone());
    env.insert("PBS_O_QUEUE".into(), pool.to_string());
    if let Some(p) = get("PATH") {
        env.insert("PBS_O_PATH".into(), p);
    }
    for (var, from) in [
        ("PBS_O_LANG", "LANG"),
        ("PBS_O_MAIL", "MAIL"),
        ("PBS_O_TZ", "TZ"),
    ] {
        if let Some(v) = get(from) {
            env.insert(var.into(), v);
        }
    }
    if let Some(w) = &d.workdir {
        env.insert("PBS_O_INITDIR".into(), absolute(&ctx.submit_dir, w));
    }
    env
}

/// Resolves an `-o`/`-e` value: absolute against `base`; a directory gets the
/// default file name inside it.
fn output_path(
    base: &str,
    given: Option<&str>,
    default: &str,
    is_dir: fn(&Path) -> bool,
) -> String {
    let Some(given) = given else {
        return default.to_string();
    };
    let path = absolute(base, given);
    if given.ends_with('/') || is_dir(Path::new(&path)) {
        let file = default.rsplit('/').next().unwrap_or(default);
        format!("{}/{file}", path.trim_end_matches('/'))
    } else {
        path
    }
}

/// `path` made absolute against `base` and lexically normalised (`.` and
/// `..` removed; `..` at the root stays at the root).
pub fn absolute(base: &str, path: &str) -> String {
    let joined = Path::new(base).join(path);
    let mut out = PathBuf::from("/");
    for c in joined.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out.to_string_lossy().into_owned()
}

/// Reads the script from `path` (`-` = stdin), at most one byte past
/// [`MAX_SCRIPT_BYTES`] so that an oversized script is detected without
/// reading it all.
///
/// # Errors
/// [`CliError::Read`].
pub fn read_script(path: &str) -> Result<Vec<u8>, CliError> {
    let limit = MAX_SCRIPT_BYTES as u64 + 1;
    let mut buf = Vec::new();
    let res = if path == "-" {
        std::io::stdin().lock().take(limit).read_to_end(&mut buf)
    } else {
        std::fs::File::open(path).and_then(|f| f.take(limit).read_to_end(&mut buf))
    };
    res.map_err(|source| CliError::Read {
        path: path.to_string(),
        source,
    })?;
    Ok(buf)
}

/// Gathers the submit context of the invoking user on this host.
///
/// # Errors
/// [`CliError::Environment`] if the user, directory or host name is unknown.
pub fn gather_context(settings: &Settings, job_id: String) -> Result<SubmitContext, CliError> {
    let user = crate::term::invoking_user()?;
    let submit_dir = std::env::current_dir().map_err(|e| CliError::Environment {
        what: "current directory".into(),
        source: Some(Box::new(e)),
    })?;
    let host = nix::unistd::gethostname()
        .map_err(|e| CliError::Environment {
            what: "host name".into(),
            source: Some(Box::new(e)),
        })?
        .to_string_lossy()
        .into_owned();
    let env = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    Ok(SubmitContext {
        job_id,
        user: user.name,
        home: user.home,
        login_shell: user.shell,
        submit_dir: submit_dir.to_string_lossy().into_owned(),
        host,
        env,
        now: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        broker_url: settings.broker.url.clone(),
        is_dir: Path::is_dir,
    })
}

/// A fresh job id: a random UUID and the cluster, `<uuid>.<cluster>` (like
/// Torque's `<seq>.<server>`).
pub fn new_job_id(cluster: &str) -> String {
    format!("{}.{cluster}", uuid::Uuid::new_v4())
}

/// How often `vq submit` asks the controller about a dependency id its
/// table does not know before refusing the job ([`check_dependencies`]).
pub const UNKNOWN_DEPENDENCY_TRIES: u32 = 3;

/// Pause between those questions.
pub const UNKNOWN_DEPENDENCY_RETRY: Duration = Duration::from_millis(500);

/// How the controller's job table answered for one `-W depend=` id
/// ([`dependency_answer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DependencyCheck {
    /// The table knows the job: its full id (a unique prefix is resolved).
    Known(String),
    /// The table does not know it, or several ids start with it: refused.
    Refused(String),
    /// The table is still being rebuilt: kept as written, with a warning.
    Unsure(String),
}

/// Classifies the answer of a query for dependency id `id` of a job that
/// broker user `submitter` submits: `rows` (the records found) or the
/// controller's refusal `problem` ([`vq_common::jobs::answer`]'s wording).
/// A dependency names one of the submitter's own jobs (the controller
/// looks it up among them, [`vq_common::jobs::JobTable::find_by`]): any
/// submitter may choose any job id, so another's job of that id is no
/// dependency, and is refused here rather than cancelled later.
pub fn dependency_answer(
    id: &str,
    submitter: &str,
    rows: Option<&[vq_common::jobs::JobRecord]>,
    problem: Option<&str>,
) -> DependencyCheck {
    let not_yours = |what: &str| {
        DependencyCheck::Refused(format!(
            "{what}: a dependency names a job that you (broker user {submitter:?}) submitted"
        ))
    };
    match (rows, problem) {
        (Some([one, ..]), _) if one.submitter.as_deref() == Some(submitter) => {
            DependencyCheck::Known(one.id.clone())
        }
        (Some([one, ..]), _) => not_yours(&format!(
            "job {} was submitted by {}",
            one.id,
            one.submitter.as_deref().unwrap_or("an unknown submitter")
        )),
        (_, Some(p)) if p.starts_with("unknown job id") && p.contains("still reading") => {
            DependencyCheck::Unsure(p.to_string())
        }
        (_, Some(p)) if p.starts_with("unknown job id") || p.contains("is ambiguous") => {
            DependencyCheck::Refused(p.to_string())
        }
        (_, Some(p)) => not_yours(p),
        _ => DependencyCheck::Refused(format!("unknown job id {id:?}")),
    }
}

/// Checks every `-W depend=` id of `job` against the controller's job
/// table (a [`vq_common::jobs::JobQuery`] per id, as `vq stat ID` asks)
/// and replaces unique prefixes by the full ids; an unknown id is asked
/// about [`UNKNOWN_DEPENDENCY_TRIES`] times (its job's `queued` event may
/// be on its way to the table). When no controller
/// answers, the job is submitted as written with a warning: the controller
/// then cancels it if an id stays unknown for `[jobs] depend_grace_secs`.
///
/// # Errors
/// [`SubmitError::Dependency`] for an unknown or ambiguous id;
/// [`CliError::Broker`] or [`CliError::NoSuchCluster`] from the query.
pub async fn check_dependencies(
    conn: &lapin::Connection,
    settings: &Settings,
    job: &mut Job,
) -> Result<(), CliError> {
    let timeout = crate::stat::QUERY_TIMEOUT;
    let submitter = settings.broker_user();
    for d in &mut job.depend {
        for id in &mut d.jobs {
            let q = vq_common::jobs::JobQuery {
                schema: SCHEMA_VERSION,
                ids: vec![id.clone()],
                owner: None,
                states: Vec::new(),
                pool: None,
                after: None,
                limit: None,
            };
            let mut tries = 0;
            let check = loop {
                tries += 1;
                let check = match crate::stat::ask_controller(conn, settings, q.clone(), timeout)
                    .await
                {
                    Ok((rows, _)) => dependency_answer(id, &submitter, Some(&rows), None),
                    Err(CliError::QueryRefused { problem }) => {
                        dependency_answer(id, &submitter, None, Some(&problem))
                    }
                    Err(e @ CliError::NoController { .. }) => {
                        eprintln!(
                            "vq: warning: cannot check the dependencies against the job table ({}); the job is held as written, and the controller cancels it if a dependency stays unknown",
                            crate::term::printable(&vq_common::error::chain(&e))
                        );
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                };
                // A job submitted a moment ago: its `queued` event may not
                // have reached the controller's table yet.
                match check {
                    DependencyCheck::Refused(_) | DependencyCheck::Unsure(_)
                        if tries < UNKNOWN_DEPENDENCY_TRIES =>
                    {
                        tokio::time::sleep(UNKNOWN_DEPENDENCY_RETRY).await;
                    }
                    other => break other,
                }
            };
            match check {
                DependencyCheck::Known(full) => *id = full,
                DependencyCheck::Unsure(problem) => {
                    eprintln!("vq: warning: dependency {id}: {problem}; submitted as written");
                }
                DependencyCheck::Refused(problem) => {
                    return Err(SubmitError::Dependency {
                        id: id.clone(),
                        problem,
                    }
                    .into())
                }
            }
        }
    }
    Ok(())
}

/// Publishes `job` to its pool queue with a publisher confirm: routing key =
/// pool, mandatory, `message_id` = job id, `user_id` = `broker_user`. A job
/// with dependencies goes to the held exchange instead
/// ([`Topology::held_exchange`], the controller's held queue), with the
/// same routing key.
///
/// # Errors
/// [`CliError::NoSuchPool`] if no queue is bound for the pool,
/// [`CliError::NoSuchCluster`] if the jobs exchange does not exist,
/// [`CliError::Broker`] otherwise.
pub async fn publish_job(
    ch: &lapin::Channel,
    topo: &Topology,
    job: &Job,
    broker_user: &str,
    timeout: Duration,
) -> Result<(), CliError> {
    let props = amqp::json_properties::<Job>()
        .with_message_id(job.id.as_str().into())
        .with_user_id(broker_user.into());
    let exchange = if job.depend.is_empty() {
        topo.jobs_exchange()
    } else {
        topo.held_exchange()
    };
    let res = amqp::publish_confirmed(
        ch,
        &exchange,
        &job.pool,
        &job.encode(),
        props,
        true,
        timeout,
    )
    .await;
    match res {
        Ok(()) => Ok(()),
        Err(AmqpError::Unroutable { .. }) => Err(CliError::NoSuchPool {
            pool: job.pool.clone(),
            cluster: topo.cluster().to_string(),
            known: None,
        }),
        Err(e) if amqp_reply_code(&e) == Some(NOT_FOUND) => Err(CliError::NoSuchCluster {
            cluster: topo.cluster().to_string(),
            exchange,
        }),
        // Not confirmed in time (e.g. a broker memory/disk alarm blocks
        // publishing): the broker may still read the job later.
        Err(source @ AmqpError::Timeout { .. }) => Err(CliError::Broker {
            action: format!(
                "submit job {} to pool {:?} (unconfirmed: it may still be queued when the broker accepts publishing again; check `vq stat {}` before submitting it again)",
                job.id, job.pool, job.id
            ),
            source: Box::new(source),
        }),
        Err(source) => Err(CliError::Broker {
            action: format!("submit job {} to pool {:?}", job.id, job.pool),
            source: Box::new(source),
        }),
    }
}

/// Publishes the `queued` event of `job` (whose message body was `body`),
/// its `held` event for a job with dependencies,
/// to the submissions exchange ([`Topology::submitted_exchange`]) with a
/// publisher confirm, `user_id` = `broker_user`, on its own channel (a
/// broker refusal closes only that channel). Call it once the job's own
/// publish is confirmed.
///
/// # Errors
/// [`CliError::Broker`].
pub async fn publish_queued(
    conn: &lapin::Connection,
    topo: &Topology,
    job: &Job,
    body: &[u8],
    broker_user: &str,
    timeout: Duration,
) -> Result<(), CliError> {
    let word = if job.depend.is_empty() {
        "queued"
    } else {
        "held"
    };
    let action = || format!("publish the {word} event of job {}", job.id);
    let ch = amqp::confirm_channel(conn)
        .await
        .map_err(CliError::broker(action()))?;
    let event = if job.depend.is_empty() {
        JobEvent::queued(job, body, broker_user)
    } else {
        JobEvent::held(job, body, broker_user)
    };
    let props = amqp::event_properties(&event).with_user_id(broker_user.into());
    let res = amqp::publish_confirmed(
        &ch,
        &topo.submitted_exchange(),
        &job_event_key(&job.pool, event.state.routing_word()),
        &event.encode(),
        props,
        false,
        timeout,
    )
    .await
    .map_err(CliError::broker(action()));
    let _ = ch.close(200, "ok".into()).await;
    res
}

/// What `vq submit` does after parsing its arguments; returns the exit code
/// (0, or with `wait` the job's exit status; see
/// [`events::wait_exit_code`]).
///
/// # Errors
/// [`CliError`].
pub async fn run(
    settings: &Settings,
    script_path: &str,
    flags: Directives,
    wait: bool,
) -> Result<i32, CliError> {
    let script = read_script(script_path)?;
    let ctx = gather_context(settings, new_job_id(&settings.cluster))?;
    let built = build_job(&script, script_path, flags, &ctx)?;
    for w in &built.warnings {
        eprintln!("vq: warning: {w}");
    }
    let mut job = built.job;
    let topo = Topology::new(&settings.cluster);
    let conn = amqp::connect(&settings.broker, "vq submit")
        .await
        .map_err(CliError::broker("connect to the broker"))?;
    let limits = crate::limits::ask(&conn, settings, crate::limits::LIMITS_TIMEOUT).await;
    let result = match &limits {
        Limits::Known(page) => crate::limits::check(page, &job),
        Limits::Unchecked(_) => Ok(()),
    };
    let result = match result {
        Ok(()) => check_dependencies(&conn, settings, &mut job).await,
        Err(e) => Err(e),
    };
    let result = match result {
        Ok(()) => submit_on(&conn, settings, &topo, &job, &limits, wait).await,
        Err(e) => Err(e),
    };
    let _ = conn.close(200, "bye".into()).await;
    match result {
        Err(CliError::NoSuchPool {
            pool,
            cluster,
            known: None,
        }) => {
            let known = match limits.pool_names() {
                Some(names) => Some(names),
                None => crate::pools::pool_names(settings).await,
            };
            Err(CliError::NoSuchPool {
                pool,
                cluster,
                known,
            })
        }
        other => other,
    }
}

async fn submit_on(
    conn: &lapin::Connection,
    settings: &Settings,
    topo: &Topology,
    job: &Job,
    limits: &Limits,
    wait: bool,
) -> Result<i32, CliError> {
    let ch = amqp::confirm_channel(conn)
        .await
        .map_err(CliError::broker("open a channel"))?;
    // Subscribe before publishing so that a fast job's events are not missed.
    let events = if wait {
        Some(events::subscribe_job_events(conn, topo, &job.pool).await?)
    } else {
        None
    };
    let timeout = Duration::from_secs(settings.broker.confirm_timeout_secs);
    publish_job(&ch, topo, job, &settings.broker_user(), timeout).await?;
    tracing::info!(job_id = %job.id, pool = %job.pool, "job submitted");
    println!("{}", job.id);
    // Said once the job is queued: a job that cannot be queued gets its
    // error alone.
    if let Limits::Unchecked(why) = limits {
        eprintln!(
            "{}",
            crate::limits::unchecked_warning(job, &crate::term::printable(why))
        );
    }
    // The job is queued whatever happens to its `queued` event: without it
    // `vq stat` shows the job from its start on.
    if let Err(e) = publish_queued(
        conn,
        topo,
        job,
        &job.encode(),
        &settings.broker_user(),
        timeout,
    )
    .await
    {
        eprintln!(
            "vq: warning: job {} is {}, but {}; `vq stat` shows it once it starts",
            job.id,
            if job.depend.is_empty() {
                "queued"
            } else {
                "held"
            },
            crate::term::printable(&vq_common::error::chain(&e))
        );
    }
    let Some(consumer) = events else {
        return Ok(0);
    };
    events::wait_for_job(consumer, &job.id, &settings.broker_user()).await
}

#[cfg(test)]
mod tests {
    use vq_common::messages::Join;

    use super::*;

    fn ctx() -> SubmitContext {
        let env: BTreeMap<String, String> = [
            ("HOME", "/home/alice"),
            ("PATH", "/usr/bin:/bin"),
            ("LOGNAME", "alice"),
            ("SHELL", "/bin/zsh"),
            ("FOO", "from-env"),
            ("VQ_BROKER_URL", "amqp://alice:pw@mq/%2f"),
            ("MY_URL", "x amqp://alice:pw@mq/%2f"),
            ("BASH_FUNC_m%%", "() { :; }"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        SubmitContext {
            job_id: "0badc0de-1111-2222-3333-444455556666.vq".into(),
            user: "alice".into(),
            home: "/home/alice".into(),
            login_shell: "/bin/bash".into(),
            submit_dir: "/home/alice/work".into(),
            host: "ui01".into(),
            env,
            now: 1_700_000_000,
            broker_url: "amqp://alice:pw@mq/%2f".into(),
            is_dir: |p| p == Path::new("/home/alice/logs"),
        }
    }

    fn flags(opts: &[(char, Option<&str>)]) -> Directives {
        let mut d = Directives::default();
        for (o, v) in opts {
            d.apply_option(*o, *v, None).unwrap();
        }
        d
    }

    #[test]
    fn a_bare_script_gets_torque_defaults() {
        let b = build_job(
            b"#!/bin/sh\necho hi\n",
            "sub/run.sh",
            Directives::default(),
            &ctx(),
        )
        .unwrap();
        let j = b.job;
        assert_eq!(j.name, "run.sh");
        assert_eq!(j.pool, "default");
        assert_eq!(j.owner, "alice");
        assert_eq!(j.workdir.as_deref(), Some("/home/alice/work"));
        assert_eq!(
            j.stdout.as_deref(),
            Some("/home/alice/work/run.sh.o0badc0de")
        );
        assert_eq!(
            j.stderr.as_deref(),
            Some("/home/alice/work/run.sh.e0badc0de")
        );
        assert_eq!(j.join, Join::N);
        assert!(j.rerunnable);
        assert_eq!(j.walltime, None);
        assert_eq!(j.shell, None);
        assert_eq!(j.submit_host, "ui01");
        assert_eq!(j.submitted_at, 1_700_000_000);
        assert_eq!(
            j.env.get("PBS_O_WORKDIR").map(String::as_str),
            Some("/home/alice/work")
        );
        assert_eq!(
            j.env.get("PBS_O_HOME").map(String::as_str),
            Some("/home/alice")
        );
        assert_eq!(
            j.env.get("PBS_O_SHELL").map(String::as_str),
            Some("/bin/zsh")
        );
        assert_eq!(
            j.env.get("PBS_O_PATH").map(String::as_str),
            Some("/usr/bin:/bin")
        );
        assert_eq!(
            j.env.get("PBS_O_QUEUE").map(String::as_str),
            Some("default")
        );
        assert!(!j.env.contains_key("FOO"), "no -V, no copy");
        assert_eq!(Job::decode(&j.encode()).unwrap(), j);
    }

    #[test]
    fn dependencies_reach_the_job_and_the_command_line_replaces_the_scripts() {
        use vq_common::messages::DependKind;
        let script = b"#PBS -W depend=afterok:a1:a2,afterany:b1\necho\n";
        let b = build_job(script, "job.pbs", flags(&[]), &ctx()).unwrap();
        let words: Vec<String> = b.job.depend.iter().map(ToString::to_string).collect();
        assert_eq!(words, ["afterok:a1:a2", "afterany:b1"]);
        assert_eq!(Job::decode(&b.job.encode()).unwrap(), b.job);
        let b = build_job(
            script,
            "job.pbs",
            flags(&[('W', Some("depend=afternotok:c1"))]),
            &ctx(),
        )
        .unwrap();
        assert_eq!(b.job.depend.len(), 1);
        assert_eq!(b.job.depend[0].kind, DependKind::AfterNotOk);
        let err =
            build_job(b"#PBS -W depend=before:1\necho\n", "j", flags(&[]), &ctx()).unwrap_err();
        assert!(
            vq_common::error::chain(&err).contains("not supported"),
            "{err}"
        );
    }

    #[test]
    fn dependency_ids_are_resolved_refused_or_kept_by_the_tables_answer() {
        let rec: vq_common::jobs::JobRecord = serde_json::from_value(serde_json::json!({
            "id": "3f2a9c1e-5b7d.vq", "submission": null, "name": "n", "owner": "bob",
            "pool": "p", "submitter": "alice", "state": "running", "letter": "R", "agent": "",
            "attempt": 1, "exit_status": null, "reason": null, "request": null,
            "queued_at": null, "started_at": null, "ended_at": null, "usage": null
        }))
        .unwrap();
        assert_eq!(
            dependency_answer("3f2a", "alice", Some(std::slice::from_ref(&rec)), None),
            DependencyCheck::Known("3f2a9c1e-5b7d.vq".into())
        );
        assert!(matches!(
            dependency_answer("zz", "alice", None, Some("unknown job id \"zz\"")),
            DependencyCheck::Refused(p) if p.contains("unknown job id")
        ));
        assert!(matches!(
            dependency_answer(
                "3",
                "alice",
                None,
                Some("job id \"3\" is ambiguous: 3a, 3b")
            ),
            DependencyCheck::Refused(_)
        ));
        assert!(matches!(
            dependency_answer(
                "zz",
                "alice",
                None,
                Some("unknown job id \"zz\" (the controller is still reading the event stream)")
            ),
            DependencyCheck::Unsure(_)
        ));
        // Another user's job, hidden or seen, is no dependency.
        assert!(matches!(
            dependency_answer("b1", "alice", None, Some("job b1 is not yours (owner bob): ...")),
            DependencyCheck::Refused(p) if p.contains("not yours") && p.contains("that you (broker user \"alice\") submitted")
        ));
        assert!(matches!(
            dependency_answer("3f2a", "mallory", Some(&[rec]), None),
            DependencyCheck::Refused(p) if p.contains("was submitted by alice")
        ));
    }

    #[test]
    fn the_command_line_overrides_the_script() {
        let script =
            b"#PBS -N fromscript\n#PBS -q a\n#PBS -l walltime=10:00\n#PBS -o out.txt\necho\n";
        let b = build_job(
            script,
            "job.pbs",
            flags(&[
                ('q', Some("b")),
                ('l', Some("walltime=1:00:00")),
                ('j', Some("oe")),
            ]),
            &ctx(),
        )
        .unwrap();
        assert_eq!(b.job.name, "fromscript");
        assert_eq!(b.job.pool, "b");
        assert_eq!(b.job.walltime, Some(3600));
        assert_eq!(b.job.join, Join::Oe);
        assert_eq!(b.job.stdout.as_deref(), Some("/home/alice/work/out.txt"));
        assert_eq!(b.job.env.get("PBS_O_QUEUE").map(String::as_str), Some("b"));
    }

    #[test]
    fn paths_are_resolved_against_the_submit_directory() {
        let b = build_job(
            b"true\n",
            "-",
            flags(&[
                ('d', Some("../scratch/./x")),
                ('o', Some("../logs")),
                ('e', Some("errs/")),
            ]),
            &ctx(),
        )
        .unwrap();
        assert_eq!(b.job.name, "STDIN");
        assert_eq!(b.job.workdir.as_deref(), Some("/home/alice/scratch/x"));
        assert_eq!(
            b.job.stdout.as_deref(),
            Some("/home/alice/logs/STDIN.o0badc0de")
        );
        assert_eq!(
            b.job.stderr.as_deref(),
            Some("/home/alice/work/errs/STDIN.e0badc0de")
        );
        assert_eq!(
            b.job.env.get("PBS_O_INITDIR").map(String::as_str),
            Some("/home/alice/scratch/x")
        );
        assert_eq!(absolute("/a", "/../../b"), "/b");
    }

    #[test]
    fn export_all_copies_the_environment_but_not_broker_secrets() {
        let b = build_job(
            b"#PBS -V\ntrue\n",
            "j",
            flags(&[('v', Some("FOO,BAR=1,MISSING"))]),
            &ctx(),
        )
        .unwrap();
        let env = &b.job.env;
        assert_eq!(env.get("FOO").map(String::as_str), Some("from-env"));
        assert_eq!(env.get("BAR").map(String::as_str), Some("1"));
        assert_eq!(env.get("MISSING").map(String::as_str), Some(""));
        assert_eq!(env.get("PATH").map(String::as_str), Some("/usr/bin:/bin"));
        assert!(!env.contains_key("VQ_BROKER_URL"));
        assert!(!env.contains_key("MY_URL"));
        assert!(!env.contains_key("BASH_FUNC_m%%"));
        assert!(b.warnings.iter().any(|w| w.message.contains("MISSING")));
        assert!(
            !b.job.encode().windows(2).any(|w| w == b"pw"),
            "password leaked"
        );
    }

    #[test]
    fn v_without_export_all_takes_only_named_variables() {
        let b = build_job(b"#PBS -v FOO\ntrue\n", "j", Directives::default(), &ctx()).unwrap();
        assert_eq!(b.job.env.get("FOO").map(String::as_str), Some("from-env"));
        assert!(!b.job.env.contains_key("PATH"));
    }

    #[test]
    fn bad_scripts_are_refused_with_the_reason() {
        let big = vec![b'#'; MAX_SCRIPT_BYTES + 1];
        assert!(matches!(
            build_job(&big, "j", Directives::default(), &ctx()),
            Err(SubmitError::ScriptTooLarge { .. })
        ));
        assert!(matches!(
            build_job(b"\xff\xfe", "j", Directives::default(), &ctx()),
            Err(SubmitError::ScriptNotText)
        ));
        assert!(matches!(
            build_job(b" \n\n", "j", Directives::default(), &ctx()),
            Err(SubmitError::EmptyScript)
        ));
        let err = build_job(
            b"#PBS -q ok\n#PBS -k oe\ntrue\n",
            "j.pbs",
            Directives::default(),
            &ctx(),
        )
        .unwrap_err();
        match err {
            SubmitError::Directive { script, source } => {
                assert_eq!(script, "j.pbs");
                assert_eq!(source.line(), Some(2));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_huge_environment_is_refused() {
        let mut c = ctx();
        c.env
            .insert("BIG".into(), "x".repeat(MAX_JOB_MESSAGE_BYTES));
        assert!(matches!(
            build_job(b"#PBS -V\ntrue\n", "j", Directives::default(), &c),
            Err(SubmitError::JobTooLarge { .. })
        ));
    }

    #[test]
    fn the_example_scripts_build_without_warnings() {
        let examples = [
            ("hello.pbs", include_str!("../../examples/hello.pbs")),
            ("compute.pbs", include_str!("../../examples/compute.pbs")),
            ("env.pbs", include_str!("../../examples/env.pbs")),
        ];
        let mut c = ctx();
        c.env.insert("DEMO_FROM_SUBMIT".into(), "hi".into());
        for (name, text) in examples {
            let b = build_job(text.as_bytes(), name, Directives::default(), &c).unwrap();
            assert!(b.warnings.is_empty(), "{name}: {:?}", b.warnings);
            assert_eq!(b.job.pool, "default", "{name}");
            assert!(b.job.walltime.is_some_and(|w| w <= 120), "{name}");
        }
        let env = build_job(
            examples[2].1.as_bytes(),
            "env.pbs",
            Directives::default(),
            &ctx(),
        )
        .unwrap()
        .job
        .env;
        assert_eq!(env.get("GREETING").map(String::as_str), Some("bonjour"));
        let compute = build_job(examples[1].1.as_bytes(), "c", Directives::default(), &ctx())
            .unwrap()
            .job;
        assert_eq!(
            compute.stdout.as_deref(),
            Some("/home/alice/work/compute.out")
        );
        assert_eq!(
            compute.stderr.as_deref(),
            Some("/home/alice/work/compute.err")
        );
    }

    #[test]
    fn crlf_line_endings_are_warned_about_with_the_first_line() {
        let b = build_job(
            b"#!/bin/bash\necho a\r\necho b\r\n",
            "dos.sh",
            Directives::default(),
            &ctx(),
        )
        .unwrap();
        let w: Vec<String> = b.warnings.iter().map(ToString::to_string).collect();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("line 2: "), "{w:?}");
        assert!(w[0].contains("CRLF") && w[0].contains("dos2unix"), "{w:?}");
        // Directives of a CRLF script do not keep the carriage return.
        let b = build_job(
            b"#PBS -N dos\r\n#PBS -l walltime=60\r\necho a\r\n",
            "dos.sh",
            Directives::default(),
            &ctx(),
        )
        .unwrap();
        assert_eq!(b.job.name, "dos");
        assert_eq!(b.job.walltime, Some(60));
    }

    #[test]
    fn an_interpreter_line_the_shell_will_not_honour_is_warned_about() {
        let py = b"#!/usr/bin/env python3\nprint('hi')\n";
        let b = build_job(py, "p.py", Directives::default(), &ctx()).unwrap();
        let w: Vec<String> = b.warnings.iter().map(ToString::to_string).collect();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("line 1: "), "{w:?}");
        assert!(
            w[0].contains("python3") && w[0].contains("/bin/bash") && w[0].contains("-S"),
            "{w:?}"
        );
        assert!(
            !w[0].contains("`-S python3`") && w[0].contains("absolute path of python3"),
            "-S needs an absolute path: {w:?}"
        );
        // With -S naming the interpreter, nothing to say.
        let b = build_job(
            py,
            "p.py",
            flags(&[('S', Some("/usr/bin/python3"))]),
            &ctx(),
        )
        .unwrap();
        assert!(b.warnings.is_empty(), "{:?}", b.warnings);
        // A POSIX sh script run by bash is fine; a bash script run by csh is not.
        let sh = b"#!/bin/sh\necho hi\n";
        assert!(build_job(sh, "s", Directives::default(), &ctx())
            .unwrap()
            .warnings
            .is_empty());
        let mut csh = ctx();
        csh.login_shell = "/bin/tcsh".into();
        let b = build_job(b"#!/bin/bash\necho hi\n", "s", Directives::default(), &csh).unwrap();
        assert_eq!(b.warnings.len(), 1, "{:?}", b.warnings);
        assert!(
            b.warnings[0].to_string().contains("`-S /bin/bash`"),
            "{:?}",
            b.warnings
        );
        // No login shell: the agent falls back to /bin/sh.
        let mut none = ctx();
        none.login_shell = String::new();
        let b = build_job(b"#!/bin/bash\necho hi\n", "s", Directives::default(), &none).unwrap();
        assert!(
            b.warnings[0].to_string().contains("/bin/sh"),
            "{:?}",
            b.warnings
        );
        // No #! line: nothing to compare.
        assert!(build_job(b"echo hi\n", "s", Directives::default(), &csh)
            .unwrap()
            .warnings
            .is_empty());
    }

    #[test]
    fn job_ids_are_unique_and_carry_the_cluster() {
        let a = new_job_id("farm");
        assert!(a.ends_with(".farm"));
        assert_ne!(a, new_job_id("farm"));
    }
}
