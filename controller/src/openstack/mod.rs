//! OpenStack client: credentials the way every OpenStack tool takes them
//! (`clouds.yaml`, `OS_*` variables; password and application credentials),
//! Keystone v3 tokens with the service catalog, and the few Nova and Glance
//! calls the controller needs, behind the [`CloudApi`] trait so that tests
//! use a fake.
//!
//! The HTTP client is reqwest with rustls; the process must install a rustls
//! crypto provider (ring) before [`HttpCloud::new`].
//!
//! One job per file: this module holds the API types and the trait; the
//! credentials ([`credentials`]: clouds.yaml, `OS_*`, the token request),
//! the HTTP plumbing ([`http`]: token and catalog, sending with one token
//! renewal, fault messages), the Nova server calls ([`compute`]: version
//! check, paginated list, create, delete, quota) and the name-to-id lookups
//! of flavors and images ([`lookup`]) live beside it.

use std::collections::BTreeMap;
use std::future::Future;

use vq_common::config::{Microversion, MIN_COMPUTE_MICROVERSION};

use crate::error::CloudError;

pub mod compute;
pub mod credentials;
pub mod http;
pub mod inventory;
pub mod lookup;

pub use compute::ComputeVersions;
pub use credentials::{clouds_yaml_candidates, AuthMethod, Credentials};
pub use http::HttpCloud;

/// Compute microversion requested when the config names none: 2.52 is the
/// first with server tags at create time (and 2.37+ requires `networks`).
pub const DEFAULT_COMPUTE_MICROVERSION: Microversion = MIN_COMPUTE_MICROVERSION;

/// A token is renewed when it has less than this left, seconds, or less
/// than half its lifetime, whichever is smaller ([`token_renew_margin_secs`]).
pub const TOKEN_RENEW_MARGIN_SECS: f64 = 300.0;

/// Seconds before its expiry at which a token that lives `lifetime_secs`
/// (Keystone's `expires_at - issued_at`) is renewed: the smaller of
/// [`TOKEN_RENEW_MARGIN_SECS`] and half its lifetime, so a short-lived
/// token (Keystone's `[token] expiration` below 600 s) is used for half
/// its life instead of being renewed on every request.
pub fn token_renew_margin_secs(lifetime_secs: f64) -> f64 {
    TOKEN_RENEW_MARGIN_SECS.min(lifetime_secs.max(0.0) / 2.0)
}

/// Servers asked for per page when listing.
pub const LIST_PAGE_SIZE: u32 = 200;

/// Pages followed at most when listing (a loop guard: 200 000 servers).
pub const MAX_PAGES: usize = 1000;

/// Metadata key holding the cluster name.
pub const META_CLUSTER: &str = "vq-cluster";
/// Metadata key holding the pool name.
pub const META_POOL: &str = "vq-pool";
/// Metadata key holding the agent id.
pub const META_AGENT: &str = "vq-agent";

/// The Nova tag every server of `cluster` carries.
pub fn cluster_tag(cluster: &str) -> String {
    format!("vq-cluster-{cluster}")
}

// ---------------------------------------------------------------- time

/// Parses an ISO 8601 / RFC 3339 timestamp as OpenStack writes them
/// (`2026-11-29T12:00:00Z`, `2026-11-29T12:00:00.000000Z`,
/// `2026-11-29T12:00:00+01:00`, or without a zone meaning UTC) into Unix
/// seconds.
pub fn parse_timestamp(s: &str) -> Option<f64> {
    let s = s.trim();
    let b = s.as_bytes();
    if b.len() < 19 || b[4] != b'-' || b[7] != b'-' || !(b[10] == b'T' || b[10] == b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, se) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || se > 60 {
        return None;
    }
    let mut rest = &s[19..];
    let mut frac = 0.0;
    if let Some(r) = rest.strip_prefix('.') {
        let end = r.find(|c: char| !c.is_ascii_digit()).unwrap_or(r.len());
        frac = format!("0.{}", &r[..end]).parse().ok()?;
        rest = &r[end..];
    }
    let offset = match rest {
        "" | "Z" | "z" => 0,
        z if (z.starts_with('+') || z.starts_with('-')) && z.len() == 6 => {
            let sign = if z.starts_with('-') { -1 } else { 1 };
            let oh: i64 = z.get(1..3)?.parse().ok()?;
            let om: i64 = z.get(4..6)?.parse().ok()?;
            sign * (oh * 3600 + om * 60)
        }
        _ => return None,
    };
    // Days from civil (Howard Hinnant's algorithm).
    let y2 = if mo <= 2 { y - 1 } else { y };
    let era = if y2 >= 0 { y2 } else { y2 - 399 } / 400;
    let yoe = y2 - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3600 + mi * 60 + se - offset) as f64 + frac)
}

// ---------------------------------------------------------------- API types

/// A server as listed by Nova.
#[derive(Debug, Clone, PartialEq)]
pub struct Server {
    /// Server id.
    pub id: String,
    /// Server name.
    pub name: String,
    /// Nova status (`BUILD`, `ACTIVE`, `ERROR`, `SHUTOFF`, `DELETED`, …).
    pub status: String,
    /// Task state (`deleting`, `spawning`, …), when Nova shows it.
    pub task_state: Option<String>,
    /// Creation time, Unix seconds.
    pub created: Option<f64>,
    /// Server metadata.
    pub metadata: BTreeMap<String, String>,
    /// Server tags.
    pub tags: Vec<String>,
    /// Fault message of an ERROR server, if any.
    pub fault: Option<String>,
}

/// What to create.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateServer {
    /// Server name (= agent id).
    pub name: String,
    /// Flavor id.
    pub flavor_ref: String,
    /// Image id.
    pub image_ref: String,
    /// User-data, raw (base64-encoded on the wire).
    pub user_data: Vec<u8>,
    /// Metadata (cluster, pool, agent).
    pub metadata: BTreeMap<String, String>,
    /// Tags (the cluster tag).
    pub tags: Vec<String>,
    /// Network id; `None` boots without a network.
    pub network: Option<String>,
    /// Key pair.
    pub key_name: Option<String>,
    /// Security group names.
    pub security_groups: Vec<String>,
    /// Availability zone.
    pub availability_zone: Option<String>,
}

/// Compute quota of the project (Nova's absolute limits).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quota {
    /// `maxTotalInstances`; `None` when unlimited (-1).
    pub max_instances: Option<u32>,
    /// `totalInstancesUsed`.
    pub used_instances: u32,
    /// `maxTotalCores`; `None` when unlimited or not reported.
    pub max_cores: Option<u32>,
    /// `totalCoresUsed`.
    pub used_cores: u32,
    /// `maxTotalRAMSize`, MiB; `None` when unlimited or not reported.
    pub max_ram_mib: Option<u64>,
    /// `totalRAMUsed`, MiB.
    pub used_ram_mib: u64,
}

impl Quota {
    /// Instances that may still be created; `None` when unlimited. `0`
    /// also when the cores or the RAM quota is used up (Nova refuses any
    /// create then, whatever the flavor); the flavor's size is not known
    /// here, so a partly used cores or RAM quota does not lower it.
    pub fn remaining(&self) -> Option<u32> {
        if self.cores_full() || self.ram_full() {
            return Some(0);
        }
        self.max_instances
            .map(|m| m.saturating_sub(self.used_instances))
    }

    /// Whether the cores quota is set and used up.
    pub fn cores_full(&self) -> bool {
        self.max_cores.is_some_and(|m| self.used_cores >= m)
    }

    /// Whether the RAM quota is set and used up.
    pub fn ram_full(&self) -> bool {
        self.max_ram_mib.is_some_and(|m| self.used_ram_mib >= m)
    }
}

/// The cloud operations the controller uses.
pub trait CloudApi: Send + Sync {
    /// Every server tagged `tag`, following pagination to the end: either
    /// the complete list or an error, never a partial view.
    fn list_servers(
        &self,
        tag: &str,
    ) -> impl Future<Output = Result<Vec<Server>, CloudError>> + Send;
    /// Creates a server; returns its id.
    fn create_server(
        &self,
        req: &CreateServer,
    ) -> impl Future<Output = Result<String, CloudError>> + Send;
    /// Deletes a server; a server that is already gone counts as deleted.
    fn delete_server(&self, id: &str) -> impl Future<Output = Result<(), CloudError>> + Send;
    /// Flavor id for a flavor name or id.
    fn resolve_flavor(&self, name: &str)
        -> impl Future<Output = Result<String, CloudError>> + Send;
    /// Image id for an image name or id.
    fn resolve_image(&self, name: &str) -> impl Future<Output = Result<String, CloudError>> + Send;
    /// The project's instance quota.
    fn quota(&self) -> impl Future<Output = Result<Quota, CloudError>> + Send;
}

/// Whether `s` looks like a UUID (then it is used as an id as it is).
pub fn looks_like_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| {
            if matches!(i, 8 | 13 | 18 | 23) {
                *c == b'-'
            } else {
                c.is_ascii_hexdigit()
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_lived_tokens_are_renewed_at_half_their_life() {
        // Keystone's default hour: 300 s before expiry.
        assert_eq!(token_renew_margin_secs(3600.0), 300.0);
        // 120 s tokens: renewed after 60 s, not on every request.
        assert_eq!(token_renew_margin_secs(120.0), 60.0);
        assert_eq!(token_renew_margin_secs(600.0), 300.0);
        assert_eq!(token_renew_margin_secs(-5.0), 0.0);
    }

    #[test]
    fn timestamps_parse_in_the_forms_openstack_writes() {
        assert_eq!(parse_timestamp("1970-01-01T00:00:00Z"), Some(0.0));
        assert_eq!(parse_timestamp("2000-03-01T00:00:00Z"), Some(951_868_800.0));
        assert_eq!(
            parse_timestamp("2026-11-29T12:00:00.500000Z"),
            Some(1_795_953_600.5)
        );
        assert_eq!(
            parse_timestamp("2026-11-29T13:00:00+01:00"),
            parse_timestamp("2026-11-29T12:00:00")
        );
        assert_eq!(parse_timestamp("yesterday"), None);
        assert_eq!(parse_timestamp("2026-13-01T00:00:00Z"), None);
    }

    #[test]
    fn errors_know_whether_they_are_transient() {
        let st = |status| CloudError::Status {
            op: "x".into(),
            status,
            message: String::new(),
            retry_after: None,
        };
        for s in [401, 409, 413, 429, 500, 503] {
            assert!(st(s).is_transient(), "{s}");
        }
        for s in [400, 403, 404] {
            assert!(!st(s).is_transient(), "{s}");
        }
    }

    #[test]
    fn uuids_are_recognised() {
        assert!(looks_like_uuid("6f2b9b4e-0c0a-4c55-9d51-0fa6e0c1e001"));
        assert!(!looks_like_uuid("cirros-fake"));
    }
}
