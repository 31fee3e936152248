//! The seam between job planning and the host: user and group database and
//! file-system probes. [`HostSys`] asks the real system; [`FakeSys`] is an
//! in-memory fake that records every lookup, for unit tests of `plan`.
//!
//! Static musl builds read only `/etc/passwd`, `/etc/group` and nscd, so
//! [`HostSys`] resolves users and groups through the host's `getent`
//! ([`crate::identity`]) to see SSSD, LDAP or extrausers users too.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use crate::error::NssError;
use crate::identity::Nss;

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
    /// Whether `path` is a directory (following symlinks).
    fn is_dir(&self, path: &Path) -> bool;
    /// Whether `path` is a regular file (following symlinks).
    fn is_file(&self, path: &Path) -> bool;
}

/// The real host: users and groups through [`Nss::host`] (getent, else
/// libc), paths through `stat`.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostSys;

impl Sys for HostSys {
    fn user_by_name(&self, name: &str) -> Result<Option<UserEntry>, NssError> {
        Nss::host().user(name)
    }

    fn group_by_name(&self, name: &str) -> Result<Option<GroupEntry>, NssError> {
        Nss::host().group(name)
    }

    fn group_list(&self, user: &str, primary: u32) -> Result<Vec<u32>, NssError> {
        Nss::host().group_list(user, primary)
    }

    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn is_file(&self, path: &Path) -> bool {
        path.is_file()
    }
}

/// In-memory host for tests: users, groups with members, existing paths.
/// Every call is recorded in [`FakeSys::calls`].
#[derive(Debug, Default)]
pub struct FakeSys {
    /// Users by name.
    pub users: BTreeMap<String, UserEntry>,
    /// Groups by name, with member names.
    pub groups: BTreeMap<String, (GroupEntry, Vec<String>)>,
    /// Existing directories.
    pub dirs: Vec<String>,
    /// Existing regular files.
    pub files: Vec<String>,
    /// Recorded calls, e.g. `user_by_name(alice)`.
    pub calls: Mutex<Vec<String>>,
}

impl FakeSys {
    fn record(&self, call: String) {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(call);
    }

    /// Adds a user with home `/home/<name>` (also added as a directory) and
    /// shell `/bin/bash` (added as a file), in a primary group of the same
    /// name and gid.
    pub fn with_user(mut self, name: &str, uid: u32) -> Self {
        let home = format!("/home/{name}");
        self.users.insert(
            name.into(),
            UserEntry {
                name: name.into(),
                uid,
                gid: uid,
                home: home.clone(),
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
        self.dirs.push(home);
        self.files.push("/bin/bash".into());
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

    fn is_dir(&self, path: &Path) -> bool {
        self.record(format!("is_dir({})", path.display()));
        self.dirs.iter().any(|d| Path::new(d) == path)
    }

    fn is_file(&self, path: &Path) -> bool {
        self.record(format!("is_file({})", path.display()));
        self.files.iter().any(|f| Path::new(f) == path)
    }
}
