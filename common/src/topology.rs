//! AMQP 0-9-1 topology: exchange, queue and routing-key names, and the
//! arguments each queue is declared with.
//!
//! Every name is prefixed by the cluster name (default `vq`) so that several
//! installations can share one broker. The layout (DESIGN.md, "Message
//! topology"):
//!
//! | name | kind | use |
//! |---|---|---|
//! | `<c>.jobs` | direct exchange | jobs, routing key = pool |
//! | `<c>.jobs.<pool>` | quorum queue | the pool's job queue (virtual job table) |
//! | `<c>.dead` | fanout exchange | jobs that could not run |
//! | `<c>.jobs.dead` | quorum queue | dead-lettered jobs, reason in headers |
//! | `<c>.dead.watch` | quorum queue bound to `<c>.dead` | a copy of every dead letter, consumed by the controller: it publishes `job.<pool>.failed` for those RabbitMQ made |
//! | `<c>.events` | topic exchange | `job.<pool>.<state>`, `agent.<pool>.<kind>` |
//! | `<c>.submitted` | topic exchange, bound into `<c>.events` for `job.*.queued` and `job.*.held` | submitters' `queued` and `held` events |
//! | `<c>.hold` | direct exchange → quorum queue `<c>.held` (routing key = pool), dead-letters to `<c>.dead` | jobs with dependencies, until the controller releases them into their pool |
//! | `<c>.events.log` | stream | retained job events for `vq stat` |
//! | `<c>.demand` | fanout exchange → classic queue `<c>.demand` (single active consumer) | bridge demand |
//! | `<c>.control` | direct exchange, routing key = agent id | drain, resume, ask-delete, cancel |
//! | `<c>.control.<agent>` | exclusive queue | the agent's control inbox |
//! | `<c>.control` key `<c>.query.jobs` → exclusive server-named queue of the controller | job-table queries of `vq stat` |
//! | `<c>.replies` | direct exchange, routing key = the requester's `amq.gen-…` reply queue | the controller's answers to queries, the agents' answers to drain, resume and cancel |
//! | `<c>.lease` | direct exchange, routing key = lease queue name | lease copies |
//! | `<c>.lease.<agent>` | durable quorum queue | copies of the jobs the agent runs (leases) |
//! | `<c>.fence` | direct exchange → quorum queue `<c>.fence` (routing key = queue name) | agents the controller is fencing (deleting, then emptying their leases) |
//! | `<c>.agents` | direct exchange → quorum queue `<c>.agents` (routing key = queue name) | the agent registry |
//!
//! Nothing is published to the default exchange (`amq.default`): a
//! message meant for one queue goes to a named exchange of the cluster that
//! the queue is bound to, so every account's rights stay inside its
//! cluster's names ([`Permissions`]).

use std::fmt;

/// Binding key of the submissions exchange into the events exchange
/// ([`Topology::submitted_exchange`]).
pub const SUBMITTED_BINDING: &str = "job.*.queued";

/// Second binding key of the submissions exchange into the events
/// exchange: the `held` events of jobs with dependencies.
pub const HELD_BINDING: &str = "job.*.held";

/// Default cluster name.
pub const DEFAULT_CLUSTER: &str = "vq";

/// Delivery limit of pool queues (quorum `x-delivery-limit`): a job
/// redelivered more often is dead-lettered by the broker.
pub const POOL_DELIVERY_LIMIT: i64 = 10;

/// Header carried by a job message: how many times an agent running it was
/// lost (killed, VM gone) and the job was returned to its pool. Not the
/// broker's delivery count, which also counts plain disconnects.
pub const LOSSES_HEADER: &str = "x-vq-losses";

/// Header of an agent registry entry ([`Topology::agents_queue`]): the
/// agent's pool, so that a controller fences only agents of its own pools.
pub const POOL_HEADER: &str = "x-vq-pool";

/// Default number of losses after which a job is dead-lettered instead of
/// run again (a poison job that kills its agent or VM).
pub const DEFAULT_LOSS_LIMIT: u32 = 3;

/// AMQP header of a lease copy naming the claim it belongs to (a UUID
/// chosen by the claiming agent; see [`crate::lease`]).
pub const CLAIM_HEADER: &str = "x-vq-claim";

/// How long a claim marker lives unused, in milliseconds (8 days).
/// Running agents declare their markers again every
/// [`CLAIM_REFRESH_SECS`], which keeps them alive; a marker kept after its
/// job ended ([`crate::lease::may_delete_marker`]) goes after this long.
pub const CLAIM_TTL_MS: i64 = 8 * 24 * 3600 * 1000;

/// How often a running agent declares its claim markers again, seconds.
pub const CLAIM_REFRESH_SECS: u64 = 6 * 3600;

/// Retention of the job-event stream, as a RabbitMQ `x-max-age` value.
pub const EVENT_LOG_MAX_AGE: &str = "7D";

/// Size cap of the job-event stream, bytes (256 MiB).
pub const EVENT_LOG_MAX_BYTES: i64 = 256 * 1024 * 1024;

/// Time-to-live of demand messages, milliseconds (10 minutes): stale demand
/// must not keep VMs alive.
pub const DEMAND_TTL_MS: i64 = 600_000;

/// A queue argument value (converted to an AMQP field value by `amqp`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArgValue {
    /// A long string (`S`).
    Str(String),
    /// A signed 64-bit integer (`l`).
    Int(i64),
    /// A boolean (`t`).
    Bool(bool),
}

impl fmt::Display for ArgValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArgValue::Str(s) => write!(f, "{s:?}"),
            ArgValue::Int(i) => write!(f, "{i}"),
            ArgValue::Bool(b) => write!(f, "{b}"),
        }
    }
}

/// Queue declaration arguments, in declaration order.
pub type QueueArgs = Vec<(&'static str, ArgValue)>;

/// Kind of an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExchangeKind {
    /// Routes on exact routing key.
    Direct,
    /// Routes on routing-key patterns.
    Topic,
    /// Routes to every bound queue.
    Fanout,
}

/// Names of one installation's exchanges and queues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    cluster: String,
}

impl Topology {
    /// Topology for `cluster` (validated by the config layer with
    /// [`valid_name`]).
    pub fn new(cluster: impl Into<String>) -> Self {
        Topology {
            cluster: cluster.into(),
        }
    }

    /// The cluster name.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// Direct exchange that routes jobs to pool queues (routing key = pool).
    pub fn jobs_exchange(&self) -> String {
        format!("{}.jobs", self.cluster)
    }

    /// The job queue of `pool`.
    pub fn pool_queue(&self, pool: &str) -> String {
        format!("{}.jobs.{pool}", self.cluster)
    }

    /// Arguments of every pool queue: a quorum queue that dead-letters to
    /// [`Topology::dead_exchange`] after [`POOL_DELIVERY_LIMIT`] deliveries.
    pub fn pool_queue_args(&self) -> QueueArgs {
        vec![
            ("x-queue-type", ArgValue::Str("quorum".into())),
            ("x-delivery-limit", ArgValue::Int(POOL_DELIVERY_LIMIT)),
            (
                "x-dead-letter-exchange",
                ArgValue::Str(self.dead_exchange()),
            ),
        ]
    }

    /// Fanout exchange for jobs that could not run.
    pub fn dead_exchange(&self) -> String {
        format!("{}.dead", self.cluster)
    }

    /// Queue holding dead-lettered jobs.
    pub fn dead_queue(&self) -> String {
        format!("{}.jobs.dead", self.cluster)
    }

    /// Arguments of the dead-letter queue (a quorum queue).
    pub fn dead_queue_args(&self) -> QueueArgs {
        vec![("x-queue-type", ArgValue::Str("quorum".into()))]
    }

    /// Queue bound to [`Topology::dead_exchange`] beside
    /// [`Topology::dead_queue`]: a copy of every dead letter, consumed (and
    /// acked) by the controller, which publishes the `failed` event of
    /// every dead letter RabbitMQ made itself (delivery limit, TTL,
    /// rejection: no `x-vq-reason` header). `<c>.jobs.dead` keeps the
    /// letters for operators.
    pub fn dead_watch_queue(&self) -> String {
        format!("{}.dead.watch", self.cluster)
    }

    /// Arguments of the dead-letter watch queue (a quorum queue, no
    /// delivery limit: a watch message the controller could not handle
    /// goes back to it).
    pub fn dead_watch_queue_args(&self) -> QueueArgs {
        vec![("x-queue-type", ArgValue::Str("quorum".into()))]
    }

    /// Topic exchange for job and agent events.
    pub fn events_exchange(&self) -> String {
        format!("{}.events", self.cluster)
    }

    /// Topic exchange where submitters (`vq submit`, bridges) publish the
    /// `queued` (or `held`) event of each job they submitted (routing key
    /// `job.<pool>.queued`, `job.<pool>.held`). It is bound into
    /// [`Topology::events_exchange`] for `job.*.queued` and `job.*.held`
    /// only ([`SUBMITTED_BINDING`], [`HELD_BINDING`]), so a submitter can
    /// add those events to the event stream and nothing else: the
    /// events exchange itself stays writable by agents and the controller
    /// alone. Readers take a `queued` event's submitter from its
    /// broker-validated `user_id`.
    pub fn submitted_exchange(&self) -> String {
        format!("{}.submitted", self.cluster)
    }

    /// Direct exchange of held jobs (jobs with dependencies): submitters
    /// publish such a job here (routing key = its pool, mandatory,
    /// confirmed) instead of to [`Topology::jobs_exchange`]. Its name
    /// differs from the queue's on purpose: submitters get write on this
    /// exchange only, and write on a queue would let them bind
    /// [`Topology::held_queue`] to an exchange they can read (the events).
    pub fn held_exchange(&self) -> String {
        format!("{}.hold", self.cluster)
    }

    /// The held queue: every held job of the cluster, consumed by the
    /// leading controller only, which releases a job into its pool when its
    /// dependencies are satisfied (DESIGN.md, "Held jobs and
    /// dependencies"). Bound to [`Topology::held_exchange`] once per
    /// configured pool (routing key = pool), so a held job for a pool the
    /// controller does not serve is unroutable and `vq submit` says so, as
    /// for a pool queue.
    pub fn held_queue(&self) -> String {
        format!("{}.held", self.cluster)
    }

    /// Arguments of the held queue: a quorum queue with a single active
    /// consumer (two controllers overlapping for a moment never both hold
    /// held jobs) that dead-letters to [`Topology::dead_exchange`], without
    /// a delivery limit (every change of leader redelivers every held job:
    /// a limit would dead-letter jobs held for long).
    pub fn held_queue_args(&self) -> QueueArgs {
        vec![
            ("x-queue-type", ArgValue::Str("quorum".into())),
            ("x-single-active-consumer", ArgValue::Bool(true)),
            (
                "x-dead-letter-exchange",
                ArgValue::Str(self.dead_exchange()),
            ),
        ]
    }

    /// Stream retaining job events (`job.#`) for `vq stat`.
    pub fn event_log_queue(&self) -> String {
        format!("{}.events.log", self.cluster)
    }

    /// Arguments of the event-log stream.
    pub fn event_log_args(&self) -> QueueArgs {
        vec![
            ("x-queue-type", ArgValue::Str("stream".into())),
            ("x-max-age", ArgValue::Str(EVENT_LOG_MAX_AGE.into())),
            ("x-max-length-bytes", ArgValue::Int(EVENT_LOG_MAX_BYTES)),
        ]
    }

    /// Fanout exchange for demand messages.
    pub fn demand_exchange(&self) -> String {
        format!("{}.demand", self.cluster)
    }

    /// Demand queue, consumed by the active controller.
    pub fn demand_queue(&self) -> String {
        format!("{}.demand", self.cluster)
    }

    /// Arguments of the demand queue: single active consumer, demand expires
    /// after [`DEMAND_TTL_MS`].
    pub fn demand_queue_args(&self) -> QueueArgs {
        vec![
            ("x-single-active-consumer", ArgValue::Bool(true)),
            ("x-message-ttl", ArgValue::Int(DEMAND_TTL_MS)),
        ]
    }

    /// Direct exchange for control messages (routing key = agent id).
    pub fn control_exchange(&self) -> String {
        format!("{}.control", self.cluster)
    }

    /// Routing key of the controller's alarm probe, published to
    /// [`Topology::control_exchange`]: it contains a dot, so it is no agent
    /// id and the probe reaches no queue.
    pub fn probe_key(&self) -> String {
        format!("{}.probe", self.cluster)
    }

    /// Routing key of a job-table query ([`crate::jobs::JobQuery`]) on
    /// [`Topology::control_exchange`]: `<c>.query.jobs`, which contains
    /// dots, so it is no agent id; the controller's query queue is bound
    /// with it.
    pub fn job_query_key(&self) -> String {
        format!("{}.query.jobs", self.cluster)
    }

    /// Routing key of `vq cancel`'s requests to the controller
    /// ([`crate::jobs::cancel::CancelRequest`]) on
    /// [`Topology::control_exchange`]: `<c>.query.cancel` (no agent id).
    pub fn cancel_query_key(&self) -> String {
        format!("{}.query.cancel", self.cluster)
    }

    /// Routing key of `vq submit`'s question for the pools' limits
    /// ([`crate::pools::PoolQuery`]) on [`Topology::control_exchange`]:
    /// `<c>.query.pools` (no agent id).
    pub fn pool_query_key(&self) -> String {
        format!("{}.query.pools", self.cluster)
    }

    /// Direct exchange of the controller's answers to queries
    /// ([`crate::jobs::JobPage`]): routing key = the requester's
    /// `reply_to`, an exclusive server-named queue (`amq.gen-…`) the
    /// requester bound with its own name. Only the controller writes to it.
    pub fn replies_exchange(&self) -> String {
        format!("{}.replies", self.cluster)
    }

    /// The exclusive control queue of `agent`.
    pub fn control_queue(&self, agent: &str) -> String {
        format!("{}.control.{agent}", self.cluster)
    }

    /// The lease queue of `agent`: a copy of every job it has claimed and
    /// not yet released (DESIGN.md, "Leases").
    pub fn lease_queue(&self, agent: &str) -> String {
        format!("{}.lease.{agent}", self.cluster)
    }

    /// Direct exchange for lease copies: every lease queue is bound to it
    /// with its own name as the routing key.
    pub fn lease_exchange(&self) -> String {
        format!("{}.lease", self.cluster)
    }

    /// Arguments of every lease queue: a durable quorum queue without a
    /// delivery limit (scanning a lease queue requeues messages) and
    /// without dead-lettering (only the agent and the controller empty it).
    pub fn lease_queue_args(&self) -> QueueArgs {
        vec![("x-queue-type", ArgValue::Str("quorum".into()))]
    }

    /// Queue of agents being fenced: the controller publishes an agent id
    /// here (confirmed) before deleting its server, and removes it after it
    /// has emptied and deleted the agent's lease queue, so a controller
    /// restart in between loses no lease.
    pub fn fence_queue(&self) -> String {
        format!("{}.fence", self.cluster)
    }

    /// Direct exchange of the fence queue (bound with the queue's name as
    /// the routing key). Only the controller writes to it.
    pub fn fence_exchange(&self) -> String {
        format!("{}.fence", self.cluster)
    }

    /// Arguments of the fence queue (a quorum queue).
    pub fn fence_queue_args(&self) -> QueueArgs {
        vec![("x-queue-type", ArgValue::Str("quorum".into()))]
    }

    /// The claim marker of job `job_id` (see [`crate::lease`]): an empty
    /// durable queue whose declaration arguments name the agent and claim
    /// that own the job.
    pub fn claim_queue(&self, job_id: &str) -> String {
        format!("{}.claim.{job_id}", self.cluster)
    }

    /// Declaration arguments of a claim marker owned by claim `claim` of
    /// agent `agent`: a classic queue (markers hold no messages; quorum
    /// would cost a Raft group per job) that expires after
    /// [`CLAIM_TTL_MS`] unused, dead-lettering to the cluster's dead-letter
    /// exchange with routing key `"<agent> <claim>"`. RabbitMQ compares
    /// these arguments on every declaration, so only the owner's
    /// declaration succeeds; the routing key also shows operators who owns
    /// a job (`rabbitmqctl list_queues name arguments`).
    pub fn claim_queue_args(&self, agent: &str, claim: &str) -> QueueArgs {
        vec![
            ("x-queue-type", ArgValue::Str("classic".into())),
            ("x-expires", ArgValue::Int(CLAIM_TTL_MS)),
            (
                "x-dead-letter-exchange",
                ArgValue::Str(self.dead_exchange()),
            ),
            (
                "x-dead-letter-routing-key",
                ArgValue::Str(format!("{agent} {claim}")),
            ),
        ]
    }

    /// Registry of agents that may hold leases: every agent process
    /// publishes its id here (confirmed) before it pulls its first job, and
    /// the controller removes an id when it fences that agent. It lets a
    /// (stateless, restarted) controller find the lease queue of an agent
    /// whose server vanished while nobody listened to its heartbeats.
    pub fn agents_queue(&self) -> String {
        format!("{}.agents", self.cluster)
    }

    /// Direct exchange of the agent registry (bound with the queue's name
    /// as the routing key).
    pub fn agents_exchange(&self) -> String {
        format!("{}.agents", self.cluster)
    }

    /// Arguments of the agent registry (a quorum queue without a delivery
    /// limit: the controller scans it by reading and returning entries).
    pub fn agents_queue_args(&self) -> QueueArgs {
        vec![("x-queue-type", ArgValue::Str("quorum".into()))]
    }
}

/// Routing key of a job event: `job.<pool>.<word>`.
pub fn job_event_key(pool: &str, word: &str) -> String {
    format!("job.{pool}.{word}")
}

/// Routing key of an agent event: `agent.<pool>.<word>` (`heartbeat`,
/// `answer`, `drained`).
pub fn agent_event_key(pool: &str, word: &str) -> String {
    format!("agent.{pool}.{word}")
}

/// Binding pattern for all job events.
pub const ALL_JOB_EVENTS: &str = "job.#";

/// Binding pattern for all agent events.
pub const ALL_AGENT_EVENTS: &str = "agent.#";

/// Whether `name` is a valid cluster, pool or agent name: 1–64 characters of
/// `a-z A-Z 0-9 _ -`. Dots are excluded because names are joined with dots
/// into queue names and routing keys.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The kind of broker account a component of a cluster logs in with
/// (README.md, "Broker accounts and trust").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// `vq submit` / `vq cancel` / `vq stat` users and bridges.
    Submitter,
    /// The controller (declares the whole topology, fences agents).
    Controller,
    /// A jobagent.
    Agent,
    /// An operator account that reads (takes) dead letters.
    Inspector,
}

impl Role {
    /// Every role, in documentation order.
    pub const ALL: [Role; 4] = [
        Role::Submitter,
        Role::Controller,
        Role::Agent,
        Role::Inspector,
    ];

    /// Lower-case name: `submitter`, `controller`, `agent`, `inspector`.
    pub fn name(self) -> &'static str {
        match self {
            Role::Submitter => "submitter",
            Role::Controller => "controller",
            Role::Agent => "agent",
            Role::Inspector => "inspector",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Role {
    type Err = String;

    /// Parses [`Role::name`]; the error lists the valid names.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| {
                format!("unknown role {s:?} (one of: submitter, controller, agent, inspector)")
            })
    }
}

/// The RabbitMQ permissions of one [`Role`] on one virtual host: three
/// regular expressions (Erlang `re`, matched against exchange and queue
/// names; RabbitMQ does not tell exchanges from queues here) for the
/// configure, write and read operations
/// (<https://www.rabbitmq.com/docs/access-control>). This is the one copy
/// of the rule: README.md, `scripts/demo.sh` (through `vq-controller
/// --print-permissions`) and the tests' accounts all come from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permissions {
    /// Declare and delete (`exchange.declare`, `queue.declare`,
    /// `queue.delete`).
    pub configure: String,
    /// Publish to an exchange; bind a queue (write on the queue).
    pub write: String,
    /// Consume from and `basic.get` a queue; bind to an exchange (read on
    /// the exchange).
    pub read: String,
}

impl Permissions {
    /// The minimal permissions of `role` in cluster `cluster` (a valid
    /// name, see [`valid_name`]; regex characters are escaped).
    pub fn for_role(role: Role, cluster: &str) -> Self {
        Self::template(role, &regex_escape(cluster))
    }

    /// [`Permissions::for_role`] for every cluster whose name matches the
    /// regular expression `cluster_re` (e.g. `t[0-9a-f]{10}` for the tests'
    /// clusters): the same rule, with `<c>` replaced by `(?:cluster_re)`.
    pub fn for_role_matching(role: Role, cluster_re: &str) -> Self {
        Self::template(role, &format!("(?:{cluster_re})"))
    }

    fn template(role: Role, c: &str) -> Self {
        let (configure, write, read) = match role {
            Role::Submitter => (
                r"^amq\.gen-.*".to_string(),
                format!(
                    r"^({c}\.jobs|{c}\.hold|{c}\.submitted|{c}\.demand|{c}\.control|amq\.gen-.*)$"
                ),
                format!(r"^({c}\.events|{c}\.events\.log|{c}\.replies|amq\.gen-.*)$"),
            ),
            Role::Controller => {
                let all = format!(r"^({c}\..*|amq\.gen-.*)$");
                (all.clone(), all.clone(), all)
            }
            Role::Agent => (
                format!(
                    r"^{c}\.(jobs|dead|events|demand|control|lease|agents|(jobs|lease|control)\.[^.]+|claim\..+)$"
                ),
                format!(r"^{c}\.(events|dead|lease|agents|replies|(jobs|lease|control)\.[^.]+)$"),
                format!(
                    r"^{c}\.(jobs|dead|lease|control|agents|(jobs|lease|control)\.[^.]+|claim\..+)$"
                ),
            ),
            Role::Inspector => (
                "^$".to_string(),
                "^$".to_string(),
                format!(r"^{c}\.jobs\.dead$"),
            ),
        };
        Permissions {
            configure,
            write,
            read,
        }
    }
}

/// `s` with every regular-expression metacharacter backslash-escaped.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        if r"\.^$|?*+()[]{}".contains(ch) {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_prefixed_by_the_cluster() {
        let t = Topology::new("farm1");
        assert_eq!(t.pool_queue("cms"), "farm1.jobs.cms");
        assert_eq!(t.control_queue("farm1-cms-1"), "farm1.control.farm1-cms-1");
        assert_eq!(job_event_key("cms", "started"), "job.cms.started");
        assert_eq!(t.lease_queue("farm1-cms-1"), "farm1.lease.farm1-cms-1");
        assert_eq!(t.fence_queue(), "farm1.fence");
        assert_eq!(t.dead_watch_queue(), "farm1.dead.watch");
        assert_eq!(
            (t.held_exchange(), t.held_queue()),
            ("farm1.hold".to_string(), "farm1.held".to_string())
        );
        assert_eq!(t.lease_exchange(), "farm1.lease");
        assert!(!valid_name(&t.probe_key()));
    }

    #[test]
    fn permissions_name_only_the_clusters_resources() {
        let p = Permissions::for_role(Role::Agent, "farm1");
        assert_eq!(
            p.write,
            r"^farm1\.(events|dead|lease|agents|replies|(jobs|lease|control)\.[^.]+)$"
        );
        let any = Permissions::for_role_matching(Role::Inspector, "t[0-9a-f]{10}");
        assert_eq!(any.read, r"^(?:t[0-9a-f]{10})\.jobs\.dead$");
        for role in Role::ALL {
            assert_eq!(role.name().parse::<Role>(), Ok(role));
            let p = Permissions::for_role(role, "farm1");
            for re in [&p.configure, &p.write, &p.read] {
                assert!(
                    re.starts_with('^') && re.ends_with(['$', '*']),
                    "{role}: {re}"
                );
            }
        }
        assert!("root".parse::<Role>().is_err());
    }

    #[test]
    fn names_with_dots_or_wildcards_are_invalid() {
        assert!(valid_name("cms-long_1"));
        for bad in ["", "a.b", "a#", "a*", "a b", &"x".repeat(65)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
