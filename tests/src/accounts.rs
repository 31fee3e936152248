//! Broker accounts per role for tests, with exactly the documented
//! permissions ([`vq_common::topology::Permissions`], README.md "Broker
//! accounts and trust").
//!
//! `rabbitmqctl` starts an Erlang VM per call (about a second), so every
//! set of accounts is created with one `rabbitmqctl import_definitions`
//! call, which creates or resets users and their permissions at once and
//! leaves everything else alone.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};
use vq_common::topology::{Permissions, Role};

/// One broker account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// The role whose permissions it has.
    pub role: Role,
    /// User name.
    pub user: String,
    /// Password.
    pub password: String,
}

impl Account {
    /// `base` (an `amqp://` or `amqps://` URL, with or without a user)
    /// with this account's user and password instead of its own.
    pub fn url(&self, base: &str) -> String {
        let (scheme, rest) = base.split_once("://").unwrap_or(("amqp", base));
        let rest = match rest.split_once('/') {
            Some((auth, path)) => (auth, Some(path)),
            None => (rest, None),
        };
        let host = rest.0.rsplit_once('@').map_or(rest.0, |(_, h)| h);
        match rest.1 {
            Some(path) => format!("{scheme}://{}:{}@{host}/{path}", self.user, self.password),
            None => format!("{scheme}://{}:{}@{host}", self.user, self.password),
        }
    }
}

/// What the accounts may reach.
#[derive(Debug, Clone, Copy)]
pub enum Clusters<'a> {
    /// One cluster, by name: [`Permissions::for_role`].
    Named(&'a str),
    /// Every cluster whose name matches a regular expression:
    /// [`Permissions::for_role_matching`].
    Matching(&'a str),
}

impl Clusters<'_> {
    /// The permissions of `role` on these clusters.
    pub fn permissions(self, role: Role) -> Permissions {
        match self {
            Clusters::Named(c) => Permissions::for_role(role, c),
            Clusters::Matching(re) => Permissions::for_role_matching(role, re),
        }
    }
}

/// The RabbitMQ definitions document (users and permissions on vhost `/`)
/// of `accounts`, each with its permissions.
pub fn definitions(accounts: &[(Account, Permissions)]) -> serde_json::Value {
    let users: Vec<_> = accounts
        .iter()
        .map(|(a, _)| serde_json::json!({"name": a.user, "password": a.password, "tags": ""}))
        .collect();
    let permissions: Vec<_> = accounts
        .iter()
        .map(|(a, p)| {
            serde_json::json!({
                "user": a.user, "vhost": "/",
                "configure": p.configure, "write": p.write, "read": p.read,
            })
        })
        .collect();
    serde_json::json!({"users": users, "permissions": permissions})
}

/// Creates or resets `accounts` with the permissions of their roles on
/// `clusters`, through `import` (given the path of a definitions file; e.g.
/// [`import_shared`] or a private node's `ctl`).
///
/// # Errors
/// If the file cannot be written or `import` fails.
pub fn create(
    accounts: &[Account],
    clusters: Clusters<'_>,
    import: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let with: Vec<_> = accounts
        .iter()
        .map(|a| (a.clone(), clusters.permissions(a.role)))
        .collect();
    create_with(&with, import)
}

/// [`create`] with explicit permissions per account (e.g. a role's minus
/// one, to test a refusal).
///
/// # Errors
/// If the file cannot be written or `import` fails.
pub fn create_with(
    accounts: &[(Account, Permissions)],
    import: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("definitions.json");
    std::fs::write(&path, serde_json::to_vec(&definitions(accounts))?)?;
    import(&path)
}

/// Imports definitions file `path` into the machine's shared broker with
/// `rabbitmqctl import_definitions`.
///
/// # Errors
/// If rabbitmqctl cannot be run or fails.
pub fn import_shared(path: &Path) -> anyhow::Result<()> {
    let out = Command::new("rabbitmqctl")
        .arg("-q")
        .arg("import_definitions")
        .arg(path)
        .output()
        .context("run rabbitmqctl import_definitions")?;
    if !out.status.success() {
        bail!(
            "rabbitmqctl import_definitions failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// An account named `user` for `role`, with a password derived from the
/// name (test brokers only).
pub fn account(role: Role, user: &str) -> Account {
    Account {
        role,
        user: user.into(),
        password: format!("{user}-secret"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_get_the_accounts_credentials() {
        let a = account(Role::Agent, "vqt-agent");
        assert_eq!(
            a.url("amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=5"),
            "amqp://vqt-agent:vqt-agent-secret@127.0.0.1:5672/%2f?heartbeat=5"
        );
        assert_eq!(
            a.url("amqps://localhost:5671"),
            "amqps://vqt-agent:vqt-agent-secret@localhost:5671"
        );
    }
}
