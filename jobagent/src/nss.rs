//! Owner and group resolution through the host's NSS, from a static binary.
//!
//! musl (the static agent's libc) reads only `/etc/passwd`, `/etc/group`
//! and nscd; it loads no NSS modules, so users that exist only in SSSD,
//! LDAP, `extrausers` or systemd-userdb would be invisible. The agent
//! therefore asks the host's own `getent` (glibc's, which loads the modules
//! configured in `/etc/nsswitch.conf`), exec'd by the agent as root before
//! the job's fork, with an empty environment, stdin `/dev/null`, stderr
//! discarded, `--` before the key, and a timeout ([`GETENT_TIMEOUT`]): the
//! wait sleeps in `poll(2)` on the child's pidfd (no polling loop) and a
//! getent that does not answer in time is killed; the job is refused with
//! "lookup timed out after N s: getent passwd NAME". Lookups block: the
//! agent runs them on a blocking thread ([`crate::plan::plan_job_async`]),
//! never on the async runtime.
//! Three databases are used: `passwd NAME`, `group NAME` and
//! `initgroups NAME` (the supplementary groups `initgroups(3)` would set,
//! from every source; the primary group is added by the caller).
//!
//! When `/etc/nsswitch.conf` is absent or lists only `files` for passwd,
//! group and initgroups ([`files_only`]), getent would only read
//! `/etc/passwd` and `/etc/group`: the agent then parses them in-process
//! and spawns nothing. Host answers are cached for [`CACHE_TTL`] and
//! dropped as soon as one of [`STAMP_FILES`] changes ([`host_user`]).
//!
//! Only when no getent exists on the host (e.g. a minimal container) does
//! the agent fall back to libc (`getpwnam_r`, `getgrnam_r`,
//! `getgrouplist`), which for a musl build means files and nscd only.
//!
//! Hostile keys: names that are empty, start with `-`, or contain `:`, NUL,
//! `/` or whitespace are refused before exec. getent treats an all-digit key
//! as a uid/gid, so an answer whose name differs from the key is treated as
//! "no such entry" (owner `"0"` never resolves to root).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::NssError;

/// A passwd entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserEntry {
    /// Login name.
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Home directory.
    pub home: String,
    /// Login shell (may be empty).
    pub shell: String,
}

/// A group entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupEntry {
    /// Group name.
    pub name: String,
    /// Group id.
    pub gid: u32,
}

/// Where getent is looked for, in order.
pub const GETENT_PATHS: [&str; 2] = ["/usr/bin/getent", "/bin/getent"];

/// Longest wait for one getent answer (a slow LDAP server must not hang a
/// slot forever; the job is refused with the reason instead).
pub const GETENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Exit status of getent for "key not found".
const GETENT_NOT_FOUND: i32 = 2;

/// The host's NSS configuration.
pub const NSSWITCH: &str = "/etc/nsswitch.conf";

/// The files the `files` source reads.
pub const PASSWD: &str = "/etc/passwd";

/// The files the `files` source reads.
pub const GROUP: &str = "/etc/group";

/// How long a host lookup's answer is reused ([`host_user`] and
/// friends), unless one of [`STAMP_FILES`] changed first.
pub const CACHE_TTL: Duration = Duration::from_secs(5);

/// Files whose size and mtime are part of a cached answer: any change
/// (useradd, groupadd, an nsswitch edit, extrausers files) drops it.
pub const STAMP_FILES: [&str; 5] = [
    PASSWD,
    GROUP,
    NSSWITCH,
    "/var/lib/extrausers/passwd",
    "/var/lib/extrausers/group",
];

/// Where a resolver's answers come from.
#[derive(Debug, Clone)]
enum Source {
    /// Parse passwd and group files in-process (nsswitch says `files`).
    Files { passwd: PathBuf, group: PathBuf },
    /// Ask the host's getent (other NSS sources configured).
    Getent(PathBuf),
    /// musl's libc (no getent on the host).
    Libc,
}

/// A resolver: the passwd/group files in-process when the host's
/// nsswitch uses only `files` for passwd, group and initgroups, else
/// getent when available, else libc.
#[derive(Debug, Clone)]
pub struct Nss {
    source: Source,
    timeout: Duration,
}

impl Nss {
    /// The host's resolver: [`PASSWD`] and [`GROUP`] read in-process when
    /// [`NSSWITCH`] is absent or lists only `files` for passwd, group and
    /// initgroups ([`files_only`]); otherwise the first of
    /// [`GETENT_PATHS`] that is a file, else libc.
    pub fn host() -> Self {
        let conf = std::fs::read_to_string(NSSWITCH).ok();
        if files_only(conf.as_deref()) {
            return Nss::files(PASSWD.into(), GROUP.into());
        }
        Nss::new(
            GETENT_PATHS.iter().map(PathBuf::from).find(|p| p.is_file()),
            GETENT_TIMEOUT,
        )
    }

    /// A resolver using `getent` (or libc when `None`) with `timeout`.
    pub fn new(getent: Option<PathBuf>, timeout: Duration) -> Self {
        let source = getent.map_or(Source::Libc, Source::Getent);
        Nss { source, timeout }
    }

    /// A resolver reading the passwd file `passwd` and the group file
    /// `group` in-process (the `files` NSS source).
    pub fn files(passwd: PathBuf, group: PathBuf) -> Self {
        Nss {
            source: Source::Files { passwd, group },
            timeout: GETENT_TIMEOUT,
        }
    }

    /// The getent in use, if any.
    pub fn getent(&self) -> Option<&Path> {
        match &self.source {
            Source::Getent(p) => Some(p),
            _ => None,
        }
    }

    /// Whether answers come from the passwd/group files in-process.
    pub fn is_files(&self) -> bool {
        matches!(self.source, Source::Files { .. })
    }

    /// Looks up user `name`; `Ok(None)` if it does not exist.
    ///
    /// # Errors
    /// [`NssError`] if the lookup itself fails or the name is unusable.
    pub fn user(&self, name: &str) -> Result<Option<UserEntry>, NssError> {
        check_name(name)?;
        let getent = match &self.source {
            Source::Files { passwd, .. } => return Ok(files_user(&read_db(passwd)?, name)),
            Source::Libc => return libc_user(name),
            Source::Getent(g) => g,
        };
        let Some(out) = run_getent(getent, "passwd", name, self.timeout)? else {
            return Ok(None);
        };
        let line = first_line(&out);
        let entry = parse_passwd(line)?;
        Ok((entry.name == name).then_some(entry))
    }

    /// Looks up group `name`; `Ok(None)` if it does not exist.
    ///
    /// # Errors
    /// [`NssError`] if the lookup itself fails or the name is unusable.
    pub fn group(&self, name: &str) -> Result<Option<GroupEntry>, NssError> {
        check_name(name)?;
        let getent = match &self.source {
            Source::Files { group, .. } => return Ok(files_group(&read_db(group)?, name)),
            Source::Libc => return libc_group(name),
            Source::Getent(g) => g,
        };
        let Some(out) = run_getent(getent, "group", name, self.timeout)? else {
            return Ok(None);
        };
        let entry = parse_group(first_line(&out))?;
        Ok((entry.name == name).then_some(entry))
    }

    /// All groups of `user`: `primary` first, then every supplementary
    /// group from every NSS source, without duplicates.
    ///
    /// # Errors
    /// [`NssError`] if the lookup fails.
    pub fn group_list(&self, user: &str, primary: u32) -> Result<Vec<u32>, NssError> {
        check_name(user)?;
        let getent = match &self.source {
            Source::Files { group, .. } => {
                return Ok(files_group_list(&read_db(group)?, user, primary))
            }
            Source::Libc => return libc_group_list(user, primary),
            Source::Getent(g) => g,
        };
        let out = run_getent(getent, "initgroups", user, self.timeout)?.unwrap_or_default();
        let mut groups = vec![primary];
        for gid in parse_initgroups(&out)? {
            if !groups.contains(&gid) {
                groups.push(gid);
            }
        }
        Ok(groups)
    }
}

/// Whether the nsswitch configuration `conf` (`None`: no file) resolves
/// passwd, group and initgroups from `files` alone, so that reading
/// `/etc/passwd` and `/etc/group` in-process answers exactly as glibc
/// would. A database without a line uses `files` (glibc's default; a
/// missing `initgroups` line follows `group`); `[STATUS=action]` items are
/// ignored; any other source (`systemd`, `sss`, `ldap`, `compat`,
/// `extrausers`, …) means no.
pub fn files_only(conf: Option<&str>) -> bool {
    let Some(conf) = conf else {
        return true;
    };
    let sources = |db: &str| -> Option<Vec<String>> {
        let mut found = None;
        for line in conf.lines() {
            let line = line.split('#').next().unwrap_or_default();
            let Some((name, rest)) = line.split_once(':') else {
                continue;
            };
            if name.trim() != db {
                continue;
            }
            // Drop `[...]` action items (they may contain spaces).
            let mut plain = String::new();
            let mut depth = 0u32;
            for c in rest.chars() {
                match c {
                    '[' => depth += 1,
                    ']' => depth = depth.saturating_sub(1),
                    c if depth == 0 => plain.push(c),
                    _ => {}
                }
            }
            found = Some(plain.split_whitespace().map(str::to_string).collect());
        }
        found
    };
    let is_files = |s: Option<Vec<String>>| s.is_none_or(|s| s == ["files"]);
    let group = sources("group");
    let initgroups = sources("initgroups").or_else(|| group.clone());
    is_files(sources("passwd")) && is_files(group) && is_files(initgroups)
}

fn read_db(path: &Path) -> Result<Vec<u8>, NssError> {
    std::fs::read(path).map_err(|source| NssError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// The entry lines of a passwd or group file: comments, blank lines and
/// NIS `+`/`-` lines skipped (glibc's files source skips them too).
fn entry_lines(text: &[u8]) -> impl Iterator<Item = &[u8]> {
    text.split(|b| *b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .filter(|l| !l.is_empty() && !matches!(l[0], b'#' | b'+' | b'-'))
}

/// User `name` in passwd file contents `text` (the first well-formed line
/// with that exact name; malformed lines are skipped, as glibc does).
pub fn files_user(text: &[u8], name: &str) -> Option<UserEntry> {
    entry_lines(text)
        .filter_map(|l| parse_passwd(l).ok())
        .find(|u| u.name == name)
}

/// Group `name` in group file contents `text`.
pub fn files_group(text: &[u8], name: &str) -> Option<GroupEntry> {
    entry_lines(text)
        .filter_map(|l| parse_group(l).ok())
        .find(|g| g.name == name)
}

/// The groups of `user` from group file contents `text`, as
/// `initgroups(3)` with the `files` source sets them: `primary` first,
/// then every group listing `user` as a member, without duplicates.
pub fn files_group_list(text: &[u8], user: &str, primary: u32) -> Vec<u32> {
    let mut groups = vec![primary];
    for line in entry_lines(text) {
        let Ok(g) = parse_group(line) else {
            continue;
        };
        let members = line.rsplit(|b| *b == b':').next().unwrap_or_default();
        if members.split(|b| *b == b',').any(|m| m == user.as_bytes()) && !groups.contains(&g.gid) {
            groups.push(g.gid);
        }
    }
    groups
}

/// A cached answer of the host resolver.
#[derive(Debug, Clone)]
enum Answer {
    User(Option<UserEntry>),
    Group(Option<GroupEntry>),
    List(Vec<u32>),
}

/// Size and mtime of each of [`STAMP_FILES`] (`None` when absent).
type Stamp = Vec<Option<(u64, std::time::SystemTime)>>;

fn stamp() -> Stamp {
    STAMP_FILES
        .iter()
        .map(|f| {
            std::fs::metadata(f)
                .ok()
                .and_then(|m| Some((m.len(), m.modified().ok()?)))
        })
        .collect()
}

/// Host answers by (database, key), with when and against which
/// [`Stamp`] they were found.
type Cache = std::collections::HashMap<(&'static str, String), (Instant, Stamp, Answer)>;

static HOST_CACHE: std::sync::Mutex<Option<Cache>> = std::sync::Mutex::new(None);

/// `lookup` of (`db`, `key`) through the host cache: a previous answer
/// younger than [`CACHE_TTL`] found with the same [`Stamp`] is reused;
/// errors are never cached. The cache holds at most 1,024 keys (it is
/// emptied when full).
fn cached(
    db: &'static str,
    key: &str,
    lookup: impl FnOnce(&Nss) -> Result<Answer, NssError>,
) -> Result<Answer, NssError> {
    let now = Instant::now();
    let st = stamp();
    let k = (db, key.to_string());
    {
        let guard = HOST_CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, s, a)) = guard.as_ref().and_then(|c| c.get(&k)) {
            if now.duration_since(*at) < CACHE_TTL && *s == st {
                return Ok(a.clone());
            }
        }
    }
    // The lookup itself runs without the lock (a slow getent must not
    // hold up other lookups).
    let answer = lookup(&Nss::host())?;
    let mut guard = HOST_CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let cache = guard.get_or_insert_with(Default::default);
    if cache.len() >= 1024 {
        cache.clear();
    }
    cache.insert(k, (now, st, answer.clone()));
    Ok(answer)
}

/// [`Nss::user`] of the host resolver ([`Nss::host`]), cached briefly
/// ([`CACHE_TTL`], dropped when a [`STAMP_FILES`] file changes).
///
/// # Errors
/// As [`Nss::user`].
pub fn host_user(name: &str) -> Result<Option<UserEntry>, NssError> {
    check_name(name)?;
    match cached("passwd", name, |n| n.user(name).map(Answer::User))? {
        Answer::User(u) => Ok(u),
        _ => Nss::host().user(name),
    }
}

/// [`Nss::group`] of the host resolver, cached as [`host_user`].
///
/// # Errors
/// As [`Nss::group`].
pub fn host_group(name: &str) -> Result<Option<GroupEntry>, NssError> {
    check_name(name)?;
    match cached("group", name, |n| n.group(name).map(Answer::Group))? {
        Answer::Group(g) => Ok(g),
        _ => Nss::host().group(name),
    }
}

/// [`Nss::group_list`] of the host resolver, cached as [`host_user`]
/// (keyed by user and primary group).
///
/// # Errors
/// As [`Nss::group_list`].
pub fn host_group_list(user: &str, primary: u32) -> Result<Vec<u32>, NssError> {
    check_name(user)?;
    let key = format!("{user}:{primary}");
    match cached("initgroups", &key, |n| {
        n.group_list(user, primary).map(Answer::List)
    })? {
        Answer::List(l) => Ok(l),
        _ => Nss::host().group_list(user, primary),
    }
}

fn check_name(name: &str) -> Result<(), NssError> {
    if name.is_empty()
        || name.starts_with('-')
        || name.len() > 256
        || name
            .chars()
            .any(|c| c == ':' || c == '/' || c.is_whitespace() || c.is_control())
    {
        return Err(NssError::BadName { name: name.into() });
    }
    Ok(())
}

fn first_line(out: &[u8]) -> &[u8] {
    out.split(|b| *b == b'\n').next().unwrap_or_default()
}

/// Runs `getent DATABASE -- KEY`; `Ok(None)` for "not found".
fn run_getent(
    getent: &Path,
    database: &'static str,
    key: &str,
    timeout: Duration,
) -> Result<Option<Vec<u8>>, NssError> {
    let exec_err = |source| NssError::Exec {
        getent: getent.display().to_string(),
        source,
    };
    let mut child = Command::new(getent)
        .args([database, "--", key])
        .env_clear()
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(exec_err)?;
    let mut stdout = child
        .stdout
        .take()
        .ok_or_else(|| exec_err(std::io::Error::other("getent stdout pipe missing")))?;
    // Read on a helper thread so a full pipe cannot block the timeout.
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        // 1 MiB is far more than any passwd/group/initgroups answer.
        let _ = (&mut stdout).take(1 << 20).read_to_end(&mut buf);
        buf
    });
    if !exits_within(&mut child, timeout).map_err(exec_err)? {
        // Not reaped yet, so the pid is still this child's.
        let _ = child.kill();
        let _ = child.wait();
        return Err(NssError::Timeout {
            getent: getent.display().to_string(),
            database,
            key: key.into(),
            secs: timeout.as_secs_f64(),
        });
    }
    let status = child.wait().map_err(exec_err)?;
    let out = reader.join().unwrap_or_default();
    match status.code() {
        Some(0) => Ok(Some(out)),
        Some(GETENT_NOT_FOUND) => Ok(None),
        code => Err(NssError::Status {
            getent: getent.display().to_string(),
            database,
            status: code.unwrap_or_else(|| {
                -std::os::unix::process::ExitStatusExt::signal(&status).unwrap_or(0)
            }),
        }),
    }
}

/// Whether `child` exits within `timeout`. Sleeps in `poll(2)` on the
/// child's pidfd until it exits or the time is up (no polling loop); only
/// kernels without `pidfd_open` (before 5.3) check every 5 ms. Does not reap.
fn exits_within(child: &mut std::process::Child, timeout: Duration) -> std::io::Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let deadline = Instant::now() + timeout;
    let pid = rustix::process::Pid::from_raw(child.id() as i32)
        .ok_or_else(|| std::io::Error::other("child without a pid"))?;
    let pidfd = match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => Some(fd),
        Err(rustix::io::Errno::NOSYS) => None,
        Err(e) => return Err(e.into()),
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match &pidfd {
            Some(fd) => {
                // Whole milliseconds, rounded up, so a wake-up is never early.
                let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
                let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
                match poll(
                    &mut fds,
                    PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
                ) {
                    Ok(0) if left.is_zero() => return Ok(false),
                    Ok(0) | Err(nix::errno::Errno::EINTR) => {}
                    Ok(_) => return Ok(true),
                    Err(e) => return Err(e.into()),
                }
            }
            None => {
                // Kernels before 5.3 only.
                if child.try_wait()?.is_some() {
                    return Ok(true);
                }
                if left.is_zero() {
                    return Ok(false);
                }
                std::thread::sleep(left.min(Duration::from_millis(5)));
            }
        }
    }
}

fn field_u32(database: &'static str, line: &[u8], s: &str) -> Result<u32, NssError> {
    s.parse().map_err(|_| NssError::Parse {
        database,
        line: String::from_utf8_lossy(line).into_owned(),
    })
}

/// Parses one `passwd` line `name:pw:uid:gid:gecos:home:shell`.
///
/// # Errors
/// [`NssError::Parse`] for a line without 7 fields, with a non-numeric
/// uid/gid, or that is not UTF-8.
pub fn parse_passwd(line: &[u8]) -> Result<UserEntry, NssError> {
    let bad = || NssError::Parse {
        database: "passwd",
        line: String::from_utf8_lossy(line).into_owned(),
    };
    let text = std::str::from_utf8(line).map_err(|_| bad())?;
    let f: Vec<&str> = text.split(':').collect();
    if f.len() != 7 || f[0].is_empty() {
        return Err(bad());
    }
    Ok(UserEntry {
        name: f[0].into(),
        uid: field_u32("passwd", line, f[2])?,
        gid: field_u32("passwd", line, f[3])?,
        home: f[5].into(),
        shell: f[6].into(),
    })
}

/// Parses one `group` line `name:pw:gid:members`.
///
/// # Errors
/// [`NssError::Parse`] for a malformed line.
pub fn parse_group(line: &[u8]) -> Result<GroupEntry, NssError> {
    let bad = || NssError::Parse {
        database: "group",
        line: String::from_utf8_lossy(line).into_owned(),
    };
    let text = std::str::from_utf8(line).map_err(|_| bad())?;
    let f: Vec<&str> = text.split(':').collect();
    if f.len() != 4 || f[0].is_empty() {
        return Err(bad());
    }
    Ok(GroupEntry {
        name: f[0].into(),
        gid: field_u32("group", line, f[2])?,
    })
}

/// Parses `getent initgroups` output: `name gid gid …` (whitespace
/// separated; the name may be followed by no gid at all).
///
/// # Errors
/// [`NssError::Parse`] for a non-numeric gid.
pub fn parse_initgroups(out: &[u8]) -> Result<Vec<u32>, NssError> {
    let line = first_line(out);
    let text = String::from_utf8_lossy(line);
    text.split_whitespace()
        .skip(1)
        .map(|g| field_u32("initgroups", line, g))
        .collect()
}

fn libc_user(name: &str) -> Result<Option<UserEntry>, NssError> {
    Ok(nix::unistd::User::from_name(name)
        .map_err(NssError::Libc)?
        .map(|u| UserEntry {
            name: u.name,
            uid: u.uid.as_raw(),
            gid: u.gid.as_raw(),
            home: u.dir.to_string_lossy().into_owned(),
            shell: u.shell.to_string_lossy().into_owned(),
        }))
}

fn libc_group(name: &str) -> Result<Option<GroupEntry>, NssError> {
    Ok(nix::unistd::Group::from_name(name)
        .map_err(NssError::Libc)?
        .map(|g| GroupEntry {
            name: g.name,
            gid: g.gid.as_raw(),
        }))
}

fn libc_group_list(user: &str, primary: u32) -> Result<Vec<u32>, NssError> {
    let name = std::ffi::CString::new(user).map_err(|_| NssError::BadName { name: user.into() })?;
    let list = nix::unistd::getgrouplist(&name, nix::unistd::Gid::from_raw(primary))
        .map_err(NssError::Libc)?;
    let mut groups = vec![primary];
    for g in list {
        if !groups.contains(&g.as_raw()) {
            groups.push(g.as_raw());
        }
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwd_group_and_initgroups_lines_parse() {
        let u = parse_passwd(b"alice:x:2001:2001:Alice,,,:/home/alice:/bin/bash").unwrap();
        assert_eq!(
            (
                u.name.as_str(),
                u.uid,
                u.gid,
                u.home.as_str(),
                u.shell.as_str()
            ),
            ("alice", 2001, 2001, "/home/alice", "/bin/bash")
        );
        let g = parse_group(b"physics:x:3000:alice,bob").unwrap();
        assert_eq!((g.name.as_str(), g.gid), ("physics", 3000));
        assert_eq!(
            parse_initgroups(b"alice                3000 3001\n").unwrap(),
            vec![3000, 3001]
        );
        assert_eq!(parse_initgroups(b"alice   \n").unwrap(), Vec::<u32>::new());
    }

    #[test]
    fn malformed_entries_are_errors_not_panics() {
        for bad in [
            &b"alice:x:notanumber:1:g:/h:/bin/sh"[..],
            b"alice:x:1:1",
            b"",
            b"a:x:1:1:g:/h:/bin/sh:extra",
            b"\xff\xfe:x:1:1:g:/h:/s",
        ] {
            assert!(parse_passwd(bad).is_err(), "{bad:?}");
        }
        assert!(parse_group(b"g:x:-1:").is_err());
        assert!(parse_initgroups(b"alice 12 x").is_err());
    }

    #[test]
    fn nsswitch_files_only_decides_in_process_parsing() {
        assert!(files_only(None));
        assert!(files_only(Some("passwd: files\ngroup:   files\n")));
        assert!(files_only(Some("# comment\nhosts: dns\n")));
        assert!(files_only(Some(
            "passwd: files [NOTFOUND=return]\ngroup: files # local\nshadow: files sss\n"
        )));
        for conf in [
            "passwd: files systemd\ngroup: files\n",
            "passwd: files\ngroup: files extrausers\n",
            "passwd: compat\n",
            "passwd: files\ngroup: files\ninitgroups: files sss\n",
            "passwd: sss files\n",
            "passwd:\n",
        ] {
            assert!(!files_only(Some(conf)), "{conf:?}");
        }
        // The last line for a database wins, as in glibc.
        assert!(files_only(Some("passwd: ldap\npasswd: files\n")));
    }

    const PASSWD_FILE: &[u8] = b"# users\n\
        root:x:0:0:root:/root:/bin/bash\n\
        \n\
        broken:x:notanumber:1::/h:/bin/sh\n\
        +nisuser::::::\n\
        alice:x:2001:2001:Alice,,,:/home/alice:/bin/bash\r\n\
        alice:x:9999:9999:dup:/nope:/bin/sh\n\
        bob:x:2002:2002::/home/bob:";

    const GROUP_FILE: &[u8] = b"root:x:0:\n\
        # physics\n\
        physics:x:3000:bob,alice\n\
        chem:x:3001:alicex,xalice\n\
        bad:x:nope:alice\n\
        bio:x:3002:alice\n\
        alice:x:2001:\n\
        dup:x:3000:alice\n";

    #[test]
    fn passwd_and_group_files_parse_like_the_files_source() {
        let alice = files_user(PASSWD_FILE, "alice").unwrap();
        assert_eq!(
            (alice.uid, alice.gid, alice.home.as_str()),
            (2001, 2001, "/home/alice")
        );
        assert_eq!(files_user(PASSWD_FILE, "bob").unwrap().shell, "");
        assert_eq!(files_user(PASSWD_FILE, "broken"), None);
        assert_eq!(files_user(PASSWD_FILE, "+nisuser"), None);
        assert_eq!(files_user(PASSWD_FILE, "0"), None);
        assert_eq!(files_user(PASSWD_FILE, "# users"), None);
        assert_eq!(files_group(GROUP_FILE, "physics").unwrap().gid, 3000);
        assert_eq!(files_group(GROUP_FILE, "bad"), None);
        assert_eq!(files_group(GROUP_FILE, "nosuch"), None);
        // Supplementary groups: exact member names only, primary first, no
        // duplicates, malformed lines skipped.
        assert_eq!(
            files_group_list(GROUP_FILE, "alice", 2001),
            vec![2001, 3000, 3002]
        );
        assert_eq!(files_group_list(GROUP_FILE, "bob", 2002), vec![2002, 3000]);
        assert_eq!(files_group_list(GROUP_FILE, "carol", 5), vec![5]);
    }

    #[test]
    fn a_files_resolver_reads_the_given_files_and_spawns_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (p, g) = (dir.path().join("passwd"), dir.path().join("group"));
        std::fs::write(&p, PASSWD_FILE).unwrap();
        std::fs::write(&g, GROUP_FILE).unwrap();
        let nss = Nss::files(p.clone(), g);
        assert!(nss.is_files() && nss.getent().is_none());
        assert_eq!(nss.user("alice").unwrap().unwrap().uid, 2001);
        assert_eq!(nss.user("0").unwrap(), None);
        assert_eq!(nss.group("bio").unwrap().unwrap().gid, 3002);
        assert_eq!(
            nss.group_list("alice", 2001).unwrap(),
            vec![2001, 3000, 3002]
        );
        assert!(matches!(nss.user("a:b"), Err(NssError::BadName { .. })));
        std::fs::remove_file(&p).unwrap();
        assert!(matches!(nss.user("alice"), Err(NssError::Read { .. })));
    }

    #[test]
    fn host_lookups_are_cached_and_match_the_uncached_answer() {
        let direct = Nss::host().user("root").unwrap();
        assert_eq!(host_user("root").unwrap(), direct);
        assert_eq!(host_user("root").unwrap(), direct);
        assert_eq!(host_user("vq-no-such-user-y").unwrap(), None);
        assert_eq!(
            host_group_list("root", 0).unwrap(),
            Nss::host().group_list("root", 0).unwrap()
        );
        assert!(matches!(host_user("-x"), Err(NssError::BadName { .. })));
    }

    #[test]
    fn hostile_names_are_refused_before_any_exec() {
        let nss = Nss::new(Some(PathBuf::from("/nonexistent/getent")), GETENT_TIMEOUT);
        for name in ["", "-s", "--help", "a:b", "a b", "a\nroot", "a/b", "a\0b"] {
            assert!(
                matches!(nss.user(name), Err(NssError::BadName { .. })),
                "{name:?}"
            );
        }
    }

    #[test]
    fn a_numeric_key_does_not_resolve_to_another_user() {
        if !Path::new("/usr/bin/getent").is_file() {
            return;
        }
        let nss = Nss::new(Some("/usr/bin/getent".into()), GETENT_TIMEOUT);
        // getent passwd 0 answers root; the agent must not accept it for
        // owner "0".
        assert_eq!(nss.user("0").unwrap(), None);
        assert_eq!(nss.group("0").unwrap(), None);
        assert_eq!(nss.user("root").unwrap().unwrap().uid, 0);
        assert_eq!(nss.user("vq-no-such-user-x").unwrap(), None);
    }

    #[test]
    fn a_hanging_getent_times_out_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("getent");
        std::fs::write(&fake, "#!/bin/sh\nexec sleep 30\n").unwrap();
        std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let nss = Nss::new(Some(fake), Duration::from_millis(300));
        // Another test thread that forks while the script above was still
        // open for writing makes its exec fail with ETXTBSY for a moment
        // (the classic fork/exec race of tests that write executables).
        for _ in 0..50 {
            let t = Instant::now();
            match nss.user("alice") {
                Err(NssError::Exec { source, .. })
                    if source.raw_os_error() == Some(nix::libc::ETXTBSY) =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                other => {
                    assert!(matches!(other, Err(NssError::Timeout { .. })), "{other:?}");
                    assert!(t.elapsed() < Duration::from_secs(5));
                    return;
                }
            }
        }
        panic!("getent stayed busy (ETXTBSY)");
    }
}
