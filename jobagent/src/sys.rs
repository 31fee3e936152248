//! The seam between job planning and the host: the user and group
//! database. [`HostSys`] asks the real system; `FakeSys` (test builds
//! only) is an in-memory fake that records every lookup, for unit tests of
//! `plan`.
//!
//! There are no file-system probes: the agent runs as root, and an answer
//! of root's ("does not exist" vs "permission denied") would tell a
//! submitter about paths its owner cannot see. The job's working directory
//! and shell are checked by the job's own process, as the owner
//! ([`crate::spawn`]).
//!
//! Static musl builds read only `/etc/passwd`, `/etc/group` and nscd, so
//! [`HostSys`] resolves users and groups through the host's `getent`
//! ([`crate::nss`]) to see SSSD, LDAP or extrausers users too.

#[cfg(test)]
use std::collections::BTreeMap;
#[cfg(test)]
use std::sync::Mutex;

use crate::error::NssError;
pub use crate::nss::{GroupEntry, UserEntry};

/// Host facts that job planning needs.
pub trait Sys: Send + Sync {
    /// Looks up a user by name; `Ok(None)` if there is none.
    ///
    /// # Errors
    /// [`NssError`] for a failed lookup (not "no such user").
    fn user_by_name(&self, name: &str) -> Result<Option<UserEntry>, NssError>;
    /// Looks up a group by name; `Ok(None)` if there is none.
    ///
    /// # Errors
    /// [`NssError`] for a failed lookup.
    fn group_by_name(&self, name: &str) -> Result<Option<GroupEntry>, NssError>;
    /// All groups of `user`, `primary` first, then every supplementary group
    /// from every NSS source, as `initgroups` would set them.
    ///
    /// # Errors
    /// [`NssError`] for a failed lookup.
    fn group_list(&self, user: &str, primary: u32) -> Result<Vec<u32>, NssError>;

    /// The VM's memory, bytes (`MemTotal` of `/proc/meminfo`); `None`
    /// when unknown.
    fn memory_bytes(&self) -> Option<u64> {
        meminfo_total(&std::fs::read_to_string("/proc/meminfo").ok()?)
    }
}

/// The real host: users and groups through [`crate::nss::Nss::host`] (the files
/// in-process when nsswitch says `files`, else getent, else libc), cached
/// briefly ([`crate::nss::host_user`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostSys;

impl Sys for HostSys {
    fn user_by_name(&self, name: &str) -> Result<Option<UserEntry>, NssError> {
        crate::nss::host_user(name)
    }

    fn group_by_name(&self, name: &str) -> Result<Option<GroupEntry>, NssError> {
        crate::nss::host_group(name)
    }

    fn group_list(&self, user: &str, primary: u32) -> Result<Vec<u32>, NssError> {
        crate::nss::host_group_list(user, primary)
    }
}

/// In-memory host for tests: users and groups with members.
/// Every call is recorded in [`FakeSys::calls`]. Test builds only: the
/// agent never carries it.
#[cfg(test)]
#[derive(Debug, Default)]
pub struct FakeSys {
    /// Users by name.
    pub users: BTreeMap<String, UserEntry>,
    /// Groups by name, with member names.
    pub groups: BTreeMap<String, (GroupEntry, Vec<String>)>,
    /// Recorded calls, e.g. `user_by_name(alice)`.
    pub calls: Mutex<Vec<String>>,
}

#[cfg(test)]
impl FakeSys {
    fn record(&self, call: String) {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(call);
    }

    /// Adds a user with home `/home/<name>` and shell `/bin/bash`, in a
    /// primary group of the same name and gid.
    pub fn with_user(mut self, name: &str, uid: u32) -> Self {
        let home = format!("/home/{name}");
        self.users.insert(
            name.into(),
            UserEntry {
                name: name.into(),
                uid,
                gid: uid,
                home,
                shell: "/bin/bash".into(),
            },
        );
        self.groups.insert(
            name.into(),
            (
                GroupEntry {
                    name: name.into(),
                    gid: uid,
                },
                Vec::new(),
            ),
        );
        self
    }

    /// Adds a group with `members`.
    pub fn with_group(mut self, name: &str, gid: u32, members: &[&str]) -> Self {
        self.groups.insert(
            name.into(),
            (
                GroupEntry {
                    name: name.into(),
                    gid,
                },
                members.iter().map(|m| m.to_string()).collect(),
            ),
        );
        self
    }
}

#[cfg(test)]
impl Sys for FakeSys {
    fn user_by_name(&self, name: &str) -> Result<Option<UserEntry>, NssError> {
        self.record(format!("user_by_name({name})"));
        Ok(self.users.get(name).cloned())
    }

    fn group_by_name(&self, name: &str) -> Result<Option<GroupEntry>, NssError> {
        self.record(format!("group_by_name({name})"));
        Ok(self.groups.get(name).map(|(g, _)| g.clone()))
    }

    fn group_list(&self, user: &str, primary: u32) -> Result<Vec<u32>, NssError> {
        self.record(format!("group_list({user},{primary})"));
        let mut out = vec![primary];
        for (g, members) in self.groups.values() {
            if g.gid != primary && members.iter().any(|m| m == user) {
                out.push(g.gid);
            }
        }
        Ok(out)
    }
}

/// `MemTotal` of a `/proc/meminfo` text, bytes.
pub fn meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}
