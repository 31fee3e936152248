//! Broker accounts per role for tests, with exactly the documented
//! permissions ([`vq_common::topology::Permissions`], README.md "Broker
//! accounts and trust").
//!
//! `rabbitmqctl` starts an Erlang VM per call (about a second), so every
//! set of accounts is created with one `rabbitmqctl import_definitions`
//! call, which creates or resets users and their permissions at once and
//! leaves everything else alone.
//!
//! Most tests use the suite's fixed accounts ([`suite`]): one per role plus
//! an untrusted submitter, allowed on every test cluster ([`TEST_CLUSTERS`]),
//! created once per test process on the shared broker
//! ([`crate::harness::shared_broker`]) and once per private node
//! ([`crate::rabbit_node::RabbitNode::start_new`]). Nothing in the suite logs
//! in as `guest`.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

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

/// Regular expression matching every cluster name the tests make
/// ([`crate::harness::unique_cluster`]: `t` and 10 hex digits); the suite's
/// accounts have their roles' permissions on all of them
/// ([`Permissions::for_role_matching`]).
pub const TEST_CLUSTERS: &str = "t[0-9a-f]{10}";

/// The suite's broker accounts, each with exactly its role's documented
/// permissions on [`TEST_CLUSTERS`].
///
/// User names are `vqt-<what>-<8 hex>`, the hex a hash of the account's
/// permissions: test processes of checkouts whose
/// [`Permissions`] differ (a branch that changes a role's rule) use
/// different users on the shared broker, instead of resetting each other's
/// permissions mid-test. Processes with the same rule import the same
/// definitions, which is idempotent.
#[derive(Debug, Clone)]
pub struct Suite {
    /// The controller: declares the topology, publishes control messages
    /// (agents list it in `control_admins`) and requeues fenced jobs (agents
    /// list it in `[submitters].requeuers`).
    pub controller: Account,
    /// Every agent.
    pub agent: Account,
    /// A bridge: a submitter the agents trust to submit for any owner
    /// (`[submitters].trusted`).
    pub submitter: Account,
    /// A submitter nobody trusts (no Unix user of its name, not in
    /// `trusted`, `grants` or `control_admins`): its jobs and control
    /// messages must be refused.
    pub untrusted: Account,
    /// An operator reading dead letters.
    pub inspector: Account,
}

impl Suite {
    /// Every account.
    pub fn all(&self) -> [&Account; 5] {
        [
            &self.controller,
            &self.agent,
            &self.submitter,
            &self.untrusted,
            &self.inspector,
        ]
    }

    /// The account of `role` (the trusted [`Suite::submitter`] for
    /// [`Role::Submitter`]).
    pub fn of(&self, role: Role) -> &Account {
        match role {
            Role::Controller => &self.controller,
            Role::Agent => &self.agent,
            Role::Submitter => &self.submitter,
            Role::Inspector => &self.inspector,
        }
    }

    /// Creates or resets every account through `import` (see [`create`]).
    ///
    /// # Errors
    /// If the file cannot be written or `import` fails.
    pub fn create(&self, import: impl FnOnce(&Path) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let all: Vec<Account> = self.all().into_iter().cloned().collect();
        create(&all, Clusters::Matching(TEST_CLUSTERS), import)
    }

    /// The agent config lines that trust these accounts, as the README
    /// tells an operator to: `control_admins` (a top-level key) holds the
    /// controller. Put it before any table.
    pub fn agent_admins_toml(&self) -> String {
        format!("control_admins = [\"{}\"]\n", self.controller.user)
    }

    /// The agent's `[submitters]` table for these accounts: the bridge
    /// [`Suite::submitter`] is trusted, the controller is the requeuer,
    /// owners submit for themselves (`same_name`, the default).
    pub fn agent_submitters_toml(&self) -> String {
        format!(
            "[submitters]\ntrusted = [\"{}\"]\nrequeuers = [\"{}\"]\n",
            self.submitter.user, self.controller.user
        )
    }
}

/// A broker the tests reach, with the [`suite`]'s accounts on it: its
/// address and the URL each account logs in with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerAt {
    base: String,
}

impl BrokerAt {
    /// The broker at `base`, an `amqp://` or `amqps://` URL (a user and
    /// password in it are ignored: every URL this gives carries an
    /// account's own).
    pub fn new(base: impl Into<String>) -> Self {
        BrokerAt { base: base.into() }
    }

    /// The URL the suite's account of `role` logs in with.
    pub fn url(&self, role: Role) -> String {
        suite().of(role).url(&self.base)
    }

    /// The URL `account` logs in with.
    pub fn url_of(&self, account: &Account) -> String {
        account.url(&self.base)
    }
}

/// The suite's accounts (the same in every test process of one checkout).
pub fn suite() -> &'static Suite {
    static SUITE: OnceLock<Suite> = OnceLock::new();
    SUITE.get_or_init(|| {
        let named = |role: Role, what: &str| {
            let p = Clusters::Matching(TEST_CLUSTERS).permissions(role);
            let hash = fnv1a(&[what, role.name(), &p.configure, &p.write, &p.read]);
            account(role, &format!("vqt-{what}-{:08x}", hash as u32))
        };
        Suite {
            controller: named(Role::Controller, "controller"),
            agent: named(Role::Agent, "agent"),
            submitter: named(Role::Submitter, "submitter"),
            untrusted: named(Role::Submitter, "untrusted"),
            inspector: named(Role::Inspector, "inspector"),
        }
    })
}

/// 64-bit FNV-1a of `parts` (each followed by a 0 byte): stable across
/// processes and toolchains, unlike `std`'s hasher.
fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parts.iter().flat_map(|p| p.bytes().chain([0])) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suites_accounts_are_distinct_and_match_the_test_clusters() {
        let s = suite();
        let users: std::collections::BTreeSet<_> = s.all().iter().map(|a| &a.user).collect();
        assert_eq!(users.len(), 5, "{users:?}");
        assert!(s.all().iter().all(|a| a.user.starts_with("vqt-")));
        assert_eq!(s.of(Role::Submitter), &s.submitter);
        assert_eq!(s.untrusted.role, Role::Submitter);
        let re = regex::Regex::new(&format!("^(?:{TEST_CLUSTERS})$")).unwrap();
        for _ in 0..20 {
            assert!(re.is_match(&crate::harness::unique_cluster()));
        }
        assert!(s.agent_submitters_toml().contains(&s.submitter.user));
        assert!(!s.agent_submitters_toml().contains(&s.untrusted.user));
    }

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
