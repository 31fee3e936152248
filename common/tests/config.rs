//! The configuration files as an operator writes them: every problem of a
//! file in one run, and the published config schemas in `schemas/` up to
//! date.
//!
//! Regenerate the schemas with `make schemas`
//! (`VQ_BLESS=1 cargo test -p vq-common --test config`).

use std::path::PathBuf;

use vq_common::config::check::KEYWORDS;
use vq_common::config::{
    json_schemas, parse, parse_checked, parse_identity, AgentConfig, ControllerConfig,
};
use vq_common::ConfigError;

fn problems<T: vq_common::config::Validate + std::fmt::Debug>(text: &str) -> Vec<String> {
    match parse::<T>("test.toml", text, toml::Table::new()) {
        Ok(cfg) => panic!("accepted: {cfg:?}"),
        Err(ConfigError::Invalid { problems, .. }) => problems,
        Err(e) => panic!("{e}"),
    }
}

fn assert_lists(all: &[String], needles: &[&str]) {
    let text = all.join("\n");
    for needle in needles {
        assert!(
            all.iter().any(|p| p.starts_with(needle)),
            "{needle:?} not in:\n{text}"
        );
    }
}

/// Appendix A of the architecture review: a type error no longer hides
/// the other type errors, the unknown key or the value errors.
#[test]
fn the_review_s_types_toml_lists_every_key() {
    let all = problems::<AgentConfig>(
        "pool = \"cms\"\nslots = \"four\"\nheartbeat_secs = \"often\"\nmin_uid = 0\ncolour = 1\n",
    );
    assert_lists(
        &all,
        &[
            "colour: unknown key",
            "heartbeat_secs: expected a number, found the string \"often\"",
            "slots: expected an integer, found the string \"four\"",
            "min_uid: 0 would allow jobs as root",
        ],
    );
    assert_eq!(all.len(), 4, "{all:#?}");
}

/// Every key of the agent's config with a value of the wrong type: each
/// one is listed with its dotted path, nested tables included.
#[test]
fn an_agent_config_with_every_key_of_the_wrong_type_lists_every_key() {
    let text = r#"
cluster = 1
pool = 2
agent_id = 3
slots = "four"
min_uid = "1000"
deny_owners = "bob"
allow_owners = [1]
heartbeat_secs = "often"
default_walltime_secs = 1.5
max_walltime_secs = "long"
loss_limit = -1
control_admins = "ops"
kill_grace_secs = true
default_umask = "022"
job_path = ["/bin"]
state_dir = 4
nodefile_dir = 4
max_script_bytes = "big"
deny_groups = 5
allow_groups = [true]
allow_group_zero = "no"
max_output_bytes = -5
cgroups = "yes"
job_memory_max_bytes = "1G"
job_cpu_max = "two"
job_pids_max = "many"
metrics_listen = 9101
[broker]
url = 5
ca_file = 6
cert_file = 7
key_file = 8
connect_timeout_secs = "ten"
confirm_timeout_secs = -1
heartbeat_secs = 70000
[submitters]
trusted = "bridge"
same_name = "yes"
grants = { carol = "dave" }
requeuers = 9
"#;
    let all = problems::<AgentConfig>(text);
    let keys = [
        "cluster",
        "pool",
        "agent_id",
        "slots",
        "min_uid",
        "deny_owners",
        "allow_owners[0]",
        "heartbeat_secs",
        "default_walltime_secs",
        "max_walltime_secs",
        "loss_limit",
        "control_admins",
        "kill_grace_secs",
        "default_umask",
        "job_path",
        "state_dir",
        "nodefile_dir",
        "max_script_bytes",
        "deny_groups",
        "allow_groups[0]",
        "allow_group_zero",
        "max_output_bytes",
        "cgroups",
        "job_memory_max_bytes",
        "job_cpu_max",
        "job_pids_max",
        "metrics_listen",
        "broker.url",
        "broker.ca_file",
        "broker.cert_file",
        "broker.key_file",
        "broker.connect_timeout_secs",
        "broker.confirm_timeout_secs",
        "broker.heartbeat_secs",
        "submitters.trusted",
        "submitters.same_name",
        "submitters.grants.carol",
        "submitters.requeuers",
    ];
    let with_colon: Vec<String> = keys.iter().map(|k| format!("{k}: ")).collect();
    assert_lists(
        &all,
        &with_colon.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    // Every top-level field of the schema was given a wrong value.
    let schema = vq_common::config::json_schemas()
        .into_iter()
        .find(|(n, _)| *n == "agent-config.schema.json")
        .unwrap()
        .1;
    let schema: serde_json::Value = serde_json::from_str(&schema).unwrap();
    for field in schema["properties"].as_object().unwrap().keys() {
        assert!(
            keys.iter().any(|k| k.starts_with(field.as_str())),
            "{field} not tried"
        );
    }
    // The keys set aside take their defaults; the one value problem left
    // is the pool's, which is now missing.
    assert_eq!(
        all.iter()
            .filter(|p| p.starts_with("pool: missing"))
            .count(),
        0,
        "a key with a type error is not also reported missing:\n{all:#?}"
    );
}

/// The controller's config the same way, pools included.
#[test]
fn a_controller_config_with_every_key_of_the_wrong_type_lists_every_key() {
    let text = r#"
cluster = 1
listen = 9180
interval_secs = "ten"
heartbeat_timeout_secs = [60]
loss_limit = "3"
[broker]
url = false
[openstack]
cloud = 1
clouds_yaml = 2
compute_microversion = 2.52
[pools.cms]
flavor = 1
image = 2
network = 3
key_name = 4
security_groups = "default"
availability_zone = 5
user_data_template = 6
agent_broker_url = 7
min = "0"
max = "ten"
slots = 1.0
boot_timeout_secs = "600"
idle_secs = -1
cooldown_secs = "30"
scale_down_delay_secs = -5
min_lifetime_secs = "300"
[pools.atlas]
flavor = "m1"
image = "img"
agent_broker_url = "amqp://a:b@h/%2f"
min = 3
max = 1
min_lifetime_secs = 2592001
scale_down_delay_secs = 99999999
"#;
    let all = problems::<ControllerConfig>(text);
    let mut needles = vec![
        "cluster: ",
        "listen: ",
        "interval_secs: ",
        "heartbeat_timeout_secs: ",
        "loss_limit: ",
        "broker.url: ",
        "openstack.cloud: ",
        "openstack.clouds_yaml: ",
        "openstack.compute_microversion: ",
    ];
    for key in [
        "flavor: ",
        "image: ",
        "network: ",
        "key_name: ",
        "security_groups: ",
        "availability_zone: ",
        "user_data_template: ",
        "agent_broker_url: ",
        "min: ",
        "max: ",
        "slots: ",
        "boot_timeout_secs: ",
        "idle_secs: ",
        "cooldown_secs: ",
        "scale_down_delay_secs: ",
        "min_lifetime_secs: ",
    ] {
        needles.push(Box::leak(format!("pools.cms.{key}").into_boxed_str()));
    }
    // A value problem of another pool comes out in the same run.
    needles.push("pools.atlas: min 3 is greater than max 1");
    needles.push("pools.atlas.min_lifetime_secs: 2592001 is more than 30 days");
    needles.push("pools.atlas.scale_down_delay_secs: 99999999 is more than 30 days");
    assert_lists(&all, &needles);
}

#[test]
fn a_partly_wrong_config_still_gives_its_good_keys() {
    let checked = parse_checked::<ControllerConfig>(
        "t",
        "interval_secs = \"x\"\n[openstack]\ncloud = \"prod\"\n[pools.cms]\nslots = \"a\"\n",
        toml::Table::new(),
    )
    .unwrap();
    assert_eq!(checked.config.openstack.cloud.as_deref(), Some("prod"));
    assert_eq!(checked.config.interval_secs, 10.0);
    assert!(checked.config.pools.contains_key("cms"));
    assert_lists(&checked.problems, &["interval_secs: ", "pools.cms.slots: "]);
}

#[test]
fn an_identity_file_lists_every_problem() {
    let err =
        parse_identity("pool = 1\nbroker_url = 2\nloss_limit = \"x\"\ncolour = 3\n").unwrap_err();
    assert_lists(
        &err,
        &[
            "pool: expected a string, found the integer 1",
            "broker_url: expected a string",
            "loss_limit: expected an integer",
            "colour: unknown key",
            "agent_id: missing",
        ],
    );
    let id = parse_identity("pool = \"cms\"\nagent_id = \"vq-cms-1\"\n").unwrap();
    assert_eq!(
        (id.pool.as_str(), id.agent_id.as_str()),
        ("cms", "vq-cms-1")
    );
}

/// Walks a schema's keyword positions (not property names, `$defs` names
/// or data under `default`/`enum`/`const`/`examples`).
fn keywords_of(schema: &serde_json::Value, out: &mut Vec<String>) {
    let Some(obj) = schema.as_object() else {
        return;
    };
    for (k, v) in obj {
        out.push(k.clone());
        match k.as_str() {
            "properties" | "$defs" => {
                for sub in v.as_object().into_iter().flat_map(|m| m.values()) {
                    keywords_of(sub, out);
                }
            }
            "anyOf" | "oneOf" => {
                for sub in v.as_array().into_iter().flatten() {
                    keywords_of(sub, out);
                }
            }
            "items" | "additionalProperties" => keywords_of(v, out),
            _ => {}
        }
    }
}

/// The key check understands every keyword the generated schemas use, so
/// no rule of a schema is silently skipped.
#[test]
fn the_key_check_knows_every_keyword_of_the_config_schemas() {
    for (name, text) in json_schemas() {
        let schema: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut found = Vec::new();
        keywords_of(&schema, &mut found);
        let unknown: Vec<_> = found
            .iter()
            .filter(|k| !KEYWORDS.contains(&k.as_str()))
            .collect();
        assert!(unknown.is_empty(), "{name} uses {unknown:?}");
        assert_eq!(
            schema["additionalProperties"],
            serde_json::Value::Bool(false),
            "{name} must refuse unknown keys"
        );
    }
}

#[test]
fn published_config_schemas_are_up_to_date() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../schemas");
    let bless = std::env::var_os("VQ_BLESS").is_some();
    let mut stale = Vec::new();
    for (name, text) in json_schemas() {
        let path = dir.join(name);
        if bless {
            std::fs::write(&path, &text).unwrap();
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            stale.push(name);
        }
    }
    assert!(
        stale.is_empty(),
        "schemas/ is stale for {stale:?}: run `make schemas`"
    );
}
