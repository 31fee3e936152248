//! vq-cloudsim speaks Keystone v3 + Nova v2.1 + Glance v2 the way the real
//! services do, boots agents, and injects faults. No root needed: the "agent"
//! is a shell script that records its arguments and starts a detached job.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine;
use reqwest::StatusCode;
use serde_json::{json, Value};
use vq_tests::cloudsim::{Sim, SimConfig, SimHandle, WORKER_IMAGE_ID};

const FAKE_AGENT: &str = r#"#!/bin/sh
# $1=--config $2=CONFIG $3=--identity $4=IDENTITY $5=--state-dir $6=STATE
vm=$(dirname "$4")
printf '%s\n' "$@" > "$vm/args.txt"
env > "$vm/env.txt"
setsid sleep 300 &
echo $! > "$vm/job.pid"
echo $$ > "$vm/agent.pid"
exec sleep 300
"#;

struct Cloud {
    sim: Option<SimHandle>,
    dir: tempfile::TempDir,
    http: reqwest::Client,
}

impl Cloud {
    async fn start(tune: impl FnOnce(&mut SimConfig)) -> Result<Self> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir()?;
        let agent = dir.path().join("fake-agent.sh");
        std::fs::write(&agent, FAKE_AGENT)?;
        std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755))?;
        let agent_config = dir.path().join("agent.toml");
        std::fs::write(&agent_config, "# fake\n")?;
        let mut config = SimConfig::new(dir.path().join("state"), agent, agent_config);
        config.boot_delay = Duration::from_millis(200);
        config.delete_delay = Duration::from_millis(200);
        config.app_cred = Some(("appcred-1".into(), "appcred-secret".into()));
        tune(&mut config);
        let sim = Sim::start(config).await?;
        Ok(Self {
            sim: Some(sim),
            dir,
            http: reqwest::Client::new(),
        })
    }

    fn base(&self) -> String {
        self.sim.as_ref().map(|s| s.base_url()).unwrap_or_default()
    }

    fn nova(&self, path: &str) -> String {
        format!("{}/compute/v2.1{path}", self.base())
    }

    fn vm_dir(&self, id: &str) -> PathBuf {
        self.dir.path().join("state/vms").join(id)
    }

    async fn token_with(&self, body: Value) -> Result<reqwest::Response> {
        Ok(self
            .http
            .post(format!("{}/identity/v3/auth/tokens", self.base()))
            .json(&body)
            .send()
            .await?)
    }

    async fn token(&self) -> Result<String> {
        let resp = self.token_with(password_auth("demo-secret")).await?;
        if resp.status() != StatusCode::CREATED {
            bail!("token request answered {}", resp.status());
        }
        Ok(resp
            .headers()
            .get("X-Subject-Token")
            .context("no X-Subject-Token")?
            .to_str()?
            .to_string())
    }

    async fn call(
        &self,
        method: reqwest::Method,
        url: &str,
        token: &str,
        mv: &str,
        body: Option<Value>,
    ) -> Result<(StatusCode, reqwest::header::HeaderMap, Value)> {
        let mut req = self
            .http
            .request(method, url)
            .header("X-Auth-Token", token)
            .header("OpenStack-API-Version", format!("compute {mv}"));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let text = resp.text().await?;
        let json = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))?
        };
        Ok((status, headers, json))
    }

    async fn get(&self, path: &str, token: &str) -> Result<(StatusCode, Value)> {
        let (s, _, v) = self
            .call(reqwest::Method::GET, &self.nova(path), token, "2.96", None)
            .await?;
        Ok((s, v))
    }

    async fn create(&self, token: &str, server: Value) -> Result<(StatusCode, Value)> {
        let (s, _, v) = self
            .call(
                reqwest::Method::POST,
                &self.nova("/servers"),
                token,
                "2.96",
                Some(json!({ "server": server })),
            )
            .await?;
        Ok((s, v))
    }

    async fn create_ok(&self, token: &str, server: Value) -> Result<String> {
        let (status, body) = self.create(token, server).await?;
        if status != StatusCode::ACCEPTED {
            bail!("create answered {status}: {body}");
        }
        Ok(body["server"]["id"].as_str().context("no id")?.to_string())
    }

    async fn wait_status(&self, token: &str, id: &str, want: &str) -> Result<Value> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (status, body) = self.get(&format!("/servers/{id}"), token).await?;
            if status == StatusCode::OK && body["server"]["status"] == want {
                return Ok(body["server"].clone());
            }
            if Instant::now() > deadline {
                bail!("server {id} never reached {want}: {status} {body}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn faults(&self, faults: Value) -> Result<Value> {
        let resp = self
            .http
            .post(format!("{}/_sim/faults", self.base()))
            .json(&faults)
            .send()
            .await?;
        if !resp.status().is_success() {
            bail!("faults answered {}", resp.status());
        }
        Ok(resp.json().await?)
    }
}

impl Drop for Cloud {
    fn drop(&mut self) {
        drop(self.sim.take());
    }
}

fn password_auth(password: &str) -> Value {
    json!({"auth": {
        "identity": {"methods": ["password"], "password": {"user": {
            "name": "demo", "domain": {"name": "Default"}, "password": password}}},
        "scope": {"project": {"name": "demo", "domain": {"id": "default"}}}
    }})
}

fn user_data(identity: &str) -> String {
    let doc = format!(
        "#cloud-config\nwrite_files:\n  - path: /etc/vq/identity.toml\n    permissions: '0600'\n    content: |\n{}",
        identity.lines().map(|l| format!("      {l}\n")).collect::<String>()
    );
    base64::engine::general_purpose::STANDARD.encode(doc)
}

fn server(name: &str) -> Value {
    json!({"name": name, "flavorRef": "1", "imageRef": WORKER_IMAGE_ID, "networks": "none"})
}

fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
        Err(_) => false,
    }
}

async fn read_pid(path: &Path) -> Result<i32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if let Ok(pid) = text.trim().parse() {
                return Ok(pid);
            }
        }
        if Instant::now() > deadline {
            bail!("{} never appeared", path.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn tokens_are_issued_refused_validated_and_expire() -> Result<()> {
    let cloud = Cloud::start(|_| {}).await?;
    let clouds_yaml = std::fs::read_to_string(cloud.dir.path().join("state/clouds.yaml"))?;
    assert!(clouds_yaml.contains("cloudsim:"), "{clouds_yaml}");
    assert!(clouds_yaml.contains(&format!("{}/identity/v3", cloud.base())));

    let bad = cloud.token_with(password_auth("wrong")).await?;
    assert_eq!(bad.status(), StatusCode::UNAUTHORIZED);
    let body: Value = bad.json().await?;
    assert_eq!(body["error"]["code"], 401);
    assert_eq!(body["error"]["title"], "Unauthorized");

    let good = cloud.token_with(password_auth("demo-secret")).await?;
    assert_eq!(good.status(), StatusCode::CREATED);
    let token = good.headers()["X-Subject-Token"].to_str()?.to_string();
    let body: Value = good.json().await?;
    let catalog = body["token"]["catalog"].as_array().context("catalog")?;
    let compute = catalog
        .iter()
        .find(|s| s["type"] == "compute")
        .context("compute")?;
    let public = compute["endpoints"]
        .as_array()
        .context("endpoints")?
        .iter()
        .find(|e| e["interface"] == "public")
        .context("public endpoint")?;
    assert_eq!(public["url"], cloud.nova(""));
    assert_eq!(public["region_id"], "RegionOne");
    assert!(body["token"]["expires_at"]
        .as_str()
        .is_some_and(|t| t.ends_with('Z')));

    let app = cloud
        .token_with(
            json!({"auth": {"identity": {"methods": ["application_credential"],
            "application_credential": {"id": "appcred-1", "secret": "appcred-secret"}}}}),
        )
        .await?;
    assert_eq!(app.status(), StatusCode::CREATED);
    let wrong_app = cloud
        .token_with(
            json!({"auth": {"identity": {"methods": ["application_credential"],
            "application_credential": {"id": "appcred-1", "secret": "nope"}}}}),
        )
        .await?;
    assert_eq!(wrong_app.status(), StatusCode::UNAUTHORIZED);

    let validated = cloud
        .http
        .get(format!("{}/identity/v3/auth/tokens", cloud.base()))
        .header("X-Auth-Token", &token)
        .header("X-Subject-Token", &token)
        .send()
        .await?;
    assert_eq!(validated.status(), StatusCode::OK);

    let (status, _) = cloud.get("/servers", &token).await?;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = cloud.get("/servers", "not-a-token").await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(body["error"]["code"], 401);

    cloud.faults(json!({"expire_tokens_now": true})).await?;
    let (status, _) = cloud.get("/servers", &token).await?;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "expired token still accepted"
    );
    let fresh = cloud.token().await?;
    assert_eq!(cloud.get("/servers", &fresh).await?.0, StatusCode::OK);

    let short = Cloud::start(|c| c.token_ttl = Duration::from_millis(300)).await?;
    let t = short.token().await?;
    assert_eq!(short.get("/flavors/detail", &t).await?.0, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        short.get("/flavors/detail", &t).await?.0,
        StatusCode::UNAUTHORIZED
    );
    Ok(())
}

#[tokio::test]
async fn versions_and_microversions_are_negotiated_like_nova() -> Result<()> {
    let cloud = Cloud::start(|_| {}).await?;
    let doc: Value = cloud.http.get(cloud.nova("/")).send().await?.json().await?;
    assert_eq!(doc["version"]["id"], "v2.1");
    assert_eq!(doc["version"]["version"], "2.96");
    let token = cloud.token().await?;
    let (status, headers, _) = cloud
        .call(
            reqwest::Method::GET,
            &cloud.nova("/servers"),
            &token,
            "2.52",
            None,
        )
        .await?;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["OpenStack-API-Version"], "compute 2.52");
    assert_eq!(headers["X-OpenStack-Nova-API-Version"], "2.52");
    let (status, _, body) = cloud
        .call(
            reqwest::Method::GET,
            &cloud.nova("/servers"),
            &token,
            "2.200",
            None,
        )
        .await?;
    assert_eq!(status, StatusCode::NOT_ACCEPTABLE, "{body}");
    let (status, body) = cloud.get("/flavors/detail", &token).await?;
    assert_eq!(status, StatusCode::OK);
    let names: Vec<&str> = body["flavors"]
        .as_array()
        .context("flavors")?
        .iter()
        .filter_map(|f| f["name"].as_str())
        .collect();
    assert_eq!(names, ["m1.tiny", "m1.small", "m1.medium"]);
    let images: Value = cloud
        .http
        .get(format!("{}/image/v2/images?name=vq-worker", cloud.base()))
        .header("X-Auth-Token", &token)
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(images["images"][0]["id"], WORKER_IMAGE_ID);
    assert_eq!(images["images"].as_array().map(Vec::len), Some(1));
    Ok(())
}

#[tokio::test]
async fn a_server_builds_then_boots_its_agent_with_the_identity() -> Result<()> {
    let cloud = Cloud::start(|c| c.boot_delay = Duration::from_millis(500)).await?;
    let token = cloud.token().await?;
    let mut spec = server("vq-p1-a");
    spec["user_data"] = json!(user_data("pool = \"p1\"\nagent_id = \"vq-p1-a\"\n"));
    spec["metadata"] = json!({"vq-cluster": "vq", "vq-pool": "p1"});
    let (status, body) = cloud.create(&token, spec).await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert!(body["server"]["adminPass"].is_string());
    let id = body["server"]["id"].as_str().context("id")?.to_string();

    let (_, shown) = cloud.get(&format!("/servers/{id}"), &token).await?;
    assert_eq!(shown["server"]["status"], "BUILD");
    assert_eq!(shown["server"]["OS-EXT-STS:task_state"], "spawning");
    assert_eq!(shown["server"]["metadata"]["vq-pool"], "p1");

    let active = cloud.wait_status(&token, &id, "ACTIVE").await?;
    assert_eq!(active["OS-EXT-STS:vm_state"], "active");
    assert!(active["OS-EXT-STS:task_state"].is_null());

    let vm = cloud.vm_dir(&id);
    read_pid(&vm.join("agent.pid")).await?;
    let identity = vm.join("identity.toml");
    assert_eq!(
        std::fs::read_to_string(&identity)?,
        "pool = \"p1\"\nagent_id = \"vq-p1-a\"\n"
    );
    assert_eq!(
        std::fs::metadata(&identity)?.permissions().mode() & 0o777,
        0o600
    );
    let args: Vec<String> = std::fs::read_to_string(vm.join("args.txt"))?
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(args[0], "--config");
    assert!(args[1].ends_with("agent.toml"));
    assert_eq!(args[2], "--identity");
    assert_eq!(Path::new(&args[3]), identity);
    assert_eq!(args[4], "--state-dir");
    assert_eq!(Path::new(&args[5]), vm.join("state"));
    let env = std::fs::read_to_string(vm.join("env.txt"))?;
    assert!(
        !env.contains("CARGO"),
        "agent environment not cleared:\n{env}"
    );

    let sims: Value = cloud
        .http
        .get(format!("{}/_sim/servers", cloud.base()))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(sims["servers"][0]["agent_running"], true);

    // No identity in the user data: the VM is ACTIVE but runs no agent.
    let black_hole = cloud.create_ok(&token, server("vq-p1-hole")).await?;
    cloud.wait_status(&token, &black_hole, "ACTIVE").await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!cloud.vm_dir(&black_hole).join("args.txt").exists());
    Ok(())
}

#[tokio::test]
async fn deleting_a_server_kills_the_agent_tree_and_the_server_disappears() -> Result<()> {
    let cloud = Cloud::start(|_| {}).await?;
    let token = cloud.token().await?;
    let mut spec = server("vq-p1-del");
    spec["user_data"] = json!(user_data("pool = \"p1\"\n"));
    let id = cloud.create_ok(&token, spec).await?;
    cloud.wait_status(&token, &id, "ACTIVE").await?;
    let agent = read_pid(&cloud.vm_dir(&id).join("agent.pid")).await?;
    let job = read_pid(&cloud.vm_dir(&id).join("job.pid")).await?;
    assert!(alive(agent) && alive(job));

    let (status, _, _) = cloud
        .call(
            reqwest::Method::DELETE,
            &cloud.nova(&format!("/servers/{id}")),
            &token,
            "2.96",
            None,
        )
        .await?;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, body) = cloud.get(&format!("/servers/{id}"), &token).await?;
    if status == StatusCode::OK {
        assert_eq!(body["server"]["OS-EXT-STS:task_state"], "deleting");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = cloud.get(&format!("/servers/{id}"), &token).await?;
        if status == StatusCode::NOT_FOUND {
            assert_eq!(body["itemNotFound"]["code"], 404);
            break;
        }
        if Instant::now() > deadline {
            bail!("server never disappeared");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!alive(agent), "agent {agent} survived the delete");
    assert!(!alive(job), "job {job} (own session) survived the delete");
    let (status, _, _) = cloud
        .call(
            reqwest::Method::DELETE,
            &cloud.nova(&format!("/servers/{id}")),
            &token,
            "2.96",
            None,
        )
        .await?;
    assert_eq!(status, StatusCode::NOT_FOUND);
    Ok(())
}

/// An agent whose job leaves its process tree at once: a double fork puts
/// the job in its own session under init (or the nearest subreaper), as a
/// daemonising job does. Like the jobagent, it runs the job in a cgroup
/// below its own (`vq-job-1`). `agent.pid` is written after the job is
/// orphaned.
const DAEMONISING_AGENT: &str = r#"#!/bin/sh
vm=$(dirname "$4")
mnt=$(awk '/ - cgroup2 / {print $5; exit}' /proc/self/mountinfo)
cg="$mnt$(sed -n 's/^0:://p' /proc/self/cgroup)"
mkdir "$cg/vq-job-1"
( echo 0 > "$cg/vq-job-1/cgroup.procs"
  setsid sleep 300 </dev/null >/dev/null 2>&1 &
  echo $! > "$vm/job.pid.tmp" && mv "$vm/job.pid.tmp" "$vm/job.pid" )
echo $$ > "$vm/agent.pid.tmp" && mv "$vm/agent.pid.tmp" "$vm/agent.pid"
exec sleep 300
"#;

/// Whether the system mounts cgroup v2 at all (the containment of a VM
/// needs it; without it the sim falls back to killing the process tree).
fn cgroup2_mounted() -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| {
        m.lines().any(|l| {
            l.split_once(" - ")
                .is_some_and(|(_, post)| post.starts_with("cgroup2 "))
        })
    })
}

/// Root with cgroup v2, else prints why the test is skipped.
fn can_contain_vms() -> bool {
    if !vq_tests::harness::require_root() {
        return false;
    }
    if !cgroup2_mounted() {
        eprintln!("skipped: no cgroup v2 mounted");
        return false;
    }
    true
}

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')')
        .next()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

async fn sim_server(cloud: &Cloud, id: &str) -> Result<Value> {
    let sims: Value = cloud
        .http
        .get(format!("{}/_sim/servers", cloud.base()))
        .send()
        .await?
        .json()
        .await?;
    sims["servers"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["id"] == id))
        .cloned()
        .with_context(|| format!("server {id} not in /_sim/servers: {sims}"))
}

/// Delete the server and wait until Nova answers 404 for it.
async fn delete_and_wait_gone(cloud: &Cloud, token: &str, id: &str) -> Result<()> {
    let (status, _, _) = cloud
        .call(
            reqwest::Method::DELETE,
            &cloud.nova(&format!("/servers/{id}")),
            token,
            "2.96",
            None,
        )
        .await?;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let deadline = Instant::now() + Duration::from_secs(10);
    while cloud.get(&format!("/servers/{id}"), token).await?.0 != StatusCode::NOT_FOUND {
        if Instant::now() > deadline {
            bail!("server {id} never disappeared");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The VM's cgroup as `/_sim/servers` reports it (checked to hold the
/// agent), if any; whether there is one is asserted after the kill checks.
async fn vm_cgroup(cloud: &Cloud, id: &str, agent: i32) -> Result<Option<PathBuf>> {
    let sim = sim_server(cloud, id).await?;
    let Some(cgroup) = sim["cgroup"].as_str().map(PathBuf::from) else {
        return Ok(None);
    };
    let procs = std::fs::read_to_string(cgroup.join("cgroup.procs"))?;
    assert!(
        procs.lines().any(|l| l.trim() == agent.to_string()),
        "agent {agent} not in {}: {procs}",
        cgroup.display()
    );
    Ok(Some(cgroup))
}

/// The VM had a cgroup and its deletion removed it.
fn assert_cgroup_removed(id: &str, cgroup: Option<PathBuf>) -> Result<()> {
    let cgroup = cgroup.with_context(|| format!("server {id} ran in no cgroup"))?;
    assert!(!cgroup.exists(), "{} left behind", cgroup.display());
    Ok(())
}

#[tokio::test]
#[ignore = "needs root"]
async fn deleting_a_server_kills_a_job_that_left_the_agent_s_process_tree() -> Result<()> {
    if !can_contain_vms() {
        return Ok(());
    }
    let scripts = tempfile::tempdir()?;
    let agent_bin = scripts.path().join("daemonising-agent.sh");
    std::fs::write(&agent_bin, DAEMONISING_AGENT)?;
    std::fs::set_permissions(&agent_bin, std::fs::Permissions::from_mode(0o755))?;
    let cloud = Cloud::start(|c| c.agent_bin = agent_bin.clone()).await?;
    let token = cloud.token().await?;
    let mut spec = server("vq-p1-daemon");
    spec["user_data"] = json!(user_data("pool = \"p1\"\n"));
    let id = cloud.create_ok(&token, spec).await?;
    cloud.wait_status(&token, &id, "ACTIVE").await?;
    let agent = read_pid(&cloud.vm_dir(&id).join("agent.pid")).await?;
    let job = read_pid(&cloud.vm_dir(&id).join("job.pid")).await?;
    assert!(alive(agent) && alive(job));
    assert_ne!(parent_of(job), Some(agent), "job {job} not orphaned");
    let cgroup = vm_cgroup(&cloud, &id, agent).await?;
    if let Some(cgroup) = &cgroup {
        let job_cgroup = cgroup.join("vq-job-1");
        let procs = std::fs::read_to_string(job_cgroup.join("cgroup.procs"))?;
        assert!(
            procs.lines().any(|l| l.trim() == job.to_string()),
            "job {job} not in the nested {}: {procs}",
            job_cgroup.display()
        );
    }

    delete_and_wait_gone(&cloud, &token, &id).await?;
    assert!(!alive(agent), "agent {agent} survived the delete");
    assert!(
        !alive(job),
        "daemonised job {job} survived the deletion of its VM"
    );
    assert_cgroup_removed(&id, cgroup)
}

#[tokio::test]
#[ignore = "needs root"]
async fn deleting_a_server_kills_the_jobs_its_killed_agent_left_behind() -> Result<()> {
    if !can_contain_vms() {
        return Ok(());
    }
    let cloud = Cloud::start(|_| {}).await?;
    let token = cloud.token().await?;
    let mut spec = server("vq-p1-kill9");
    spec["user_data"] = json!(user_data("pool = \"p1\"\n"));
    let id = cloud.create_ok(&token, spec).await?;
    cloud.wait_status(&token, &id, "ACTIVE").await?;
    let agent = read_pid(&cloud.vm_dir(&id).join("agent.pid")).await?;
    let job = read_pid(&cloud.vm_dir(&id).join("job.pid")).await?;
    let cgroup = vm_cgroup(&cloud, &id, agent).await?;

    // The agent dies alone (kill -9); the VM stays up with its job in it.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent),
        nix::sys::signal::Signal::SIGKILL,
    )?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while sim_server(&cloud, &id).await?["agent_running"] != false {
        if Instant::now() > deadline {
            bail!("the sim never saw agent {agent} exit");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(alive(job), "job {job} died with its agent");
    assert_ne!(parent_of(job), Some(agent), "job {job} not orphaned");

    delete_and_wait_gone(&cloud, &token, &id).await?;
    assert!(
        !alive(job),
        "job {job} of the killed agent survived the deletion of its VM"
    );
    assert_cgroup_removed(&id, cgroup)
}

#[tokio::test]
async fn listing_paginates_with_markers_and_next_links() -> Result<()> {
    let cloud = Cloud::start(|c| c.quota_instances = 20).await?;
    let token = cloud.token().await?;
    let mut ids = Vec::new();
    for i in 0..7 {
        ids.push(
            cloud
                .create_ok(&token, server(&format!("vq-p1-{i}")))
                .await?,
        );
    }
    let mut seen = Vec::new();
    let mut url = cloud.nova("/servers/detail?limit=3");
    let mut pages = 0;
    loop {
        let (status, _, body) = cloud
            .call(reqwest::Method::GET, &url, &token, "2.96", None)
            .await?;
        assert_eq!(status, StatusCode::OK, "{body}");
        pages += 1;
        let page = body["servers"].as_array().context("servers")?;
        assert!(page.len() <= 3);
        seen.extend(
            page.iter()
                .filter_map(|s| s["id"].as_str().map(str::to_string)),
        );
        match body["servers_links"][0]["href"].as_str() {
            Some(next) => {
                assert_eq!(body["servers_links"][0]["rel"], "next");
                assert!(next.contains("/servers/detail?"), "{next}");
                url = next.to_string();
            }
            None => break,
        }
        assert!(pages < 10, "pagination does not end");
    }
    assert_eq!(pages, 3);
    let mut want = ids.clone();
    want.reverse(); // newest first
    assert_eq!(seen, want);

    // A full last page still gets a next link, which then yields nothing.
    let (_, body) = cloud.get("/servers?limit=7", &token).await?;
    assert!(body["servers_links"][0]["href"].is_string());
    let (_, body) = cloud
        .get(&format!("/servers?limit=7&marker={}", ids[0]), &token)
        .await?;
    assert_eq!(body["servers"].as_array().map(Vec::len), Some(0));
    assert!(body.get("servers_links").is_none());

    let (status, body) = cloud.get("/servers?marker=no-such-server", &token).await?;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        body["badRequest"]["message"],
        "marker [no-such-server] not found"
    );
    Ok(())
}

#[tokio::test]
async fn tag_name_and_status_filters_select_servers() -> Result<()> {
    let cloud = Cloud::start(|_| {}).await?;
    let token = cloud.token().await?;
    let mut a = server("vq-p1-a");
    a["tags"] = json!(["vq", "vq-pool-p1"]);
    let mut b = server("vq-p2-b");
    b["tags"] = json!(["vq", "vq-pool-p2"]);
    let a = cloud.create_ok(&token, a).await?;
    let b = cloud.create_ok(&token, b).await?;
    let other = cloud.create_ok(&token, server("someone-else")).await?;

    let ids = |body: &Value| -> Vec<String> {
        body["servers"]
            .as_array()
            .map(|l| {
                l.iter()
                    .filter_map(|s| s["id"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (_, body) = cloud
        .get("/servers/detail?tags=vq,vq-pool-p1", &token)
        .await?;
    assert_eq!(ids(&body), std::slice::from_ref(&a));
    assert_eq!(body["servers"][0]["tags"], json!(["vq", "vq-pool-p1"]));
    let (_, body) = cloud.get("/servers?tags=vq", &token).await?;
    assert_eq!(ids(&body), [b.clone(), a.clone()]);
    let (_, body) = cloud.get("/servers?name=%5Evq-p2-", &token).await?;
    assert_eq!(ids(&body), std::slice::from_ref(&b));
    let (_, body) = cloud.get("/servers?name=else", &token).await?;
    assert_eq!(ids(&body), [other]);
    let (_, body) = cloud.get("/servers?status=ACTIVE", &token).await?;
    assert!(ids(&body).is_empty(), "nothing is ACTIVE yet");
    cloud.wait_status(&token, &a, "ACTIVE").await?;
    let (_, body) = cloud
        .get("/servers?status=active&tags=vq-pool-p1", &token)
        .await?;
    assert_eq!(ids(&body), [a]);

    // Tags need 2.52; below that Nova rejects them.
    let mut old = server("x");
    old["tags"] = json!(["vq"]);
    let (status, _, body) = cloud
        .call(
            reqwest::Method::POST,
            &cloud.nova("/servers"),
            &token,
            "2.51",
            Some(json!({"server": old})),
        )
        .await?;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    Ok(())
}

#[tokio::test]
async fn create_requests_are_validated_like_nova() -> Result<()> {
    let cloud = Cloud::start(|_| {}).await?;
    let token = cloud.token().await?;
    let mut no_net = server("x");
    no_net.as_object_mut().map(|o| o.remove("networks"));
    let (status, body) = cloud.create(&token, no_net.clone()).await?;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body["badRequest"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("'networks' is a required property")));
    let (status, _, _) = cloud
        .call(
            reqwest::Method::POST,
            &cloud.nova("/servers"),
            &token,
            "2.36",
            Some(json!({"server": no_net})),
        )
        .await?;
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "networks are optional below 2.37"
    );

    let mut keyed = server("x");
    keyed["key_name"] = json!("mykey");
    let (status, body) = cloud.create(&token, keyed).await?;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["badRequest"]["message"], "Invalid key_name provided.");

    let mut bad_meta = server("x");
    bad_meta["metadata"] = json!({"n": 1});
    assert_eq!(
        cloud.create(&token, bad_meta).await?.0,
        StatusCode::BAD_REQUEST
    );
    let mut too_much = server("x");
    too_much["metadata"] = Value::Object((0..129).map(|i| (format!("k{i}"), json!("v"))).collect());
    assert_eq!(
        cloud.create(&token, too_much).await?.0,
        StatusCode::FORBIDDEN
    );
    let mut big = server("x");
    big["user_data"] = json!("A".repeat(65536));
    assert_eq!(cloud.create(&token, big).await?.0, StatusCode::BAD_REQUEST);
    let mut flavor = server("x");
    flavor["flavorRef"] = json!(format!("{}/flavors/2", cloud.nova("")));
    assert_eq!(cloud.create(&token, flavor).await?.0, StatusCode::ACCEPTED);
    let mut unknown = server("x");
    unknown["flavorRef"] = json!("99");
    assert_eq!(
        cloud.create(&token, unknown).await?.0,
        StatusCode::BAD_REQUEST
    );
    Ok(())
}

#[tokio::test]
async fn the_instance_quota_is_enforced_with_nova_s_message() -> Result<()> {
    let cloud = Cloud::start(|c| c.quota_instances = 2).await?;
    let token = cloud.token().await?;
    cloud.create_ok(&token, server("q1")).await?;
    cloud.create_ok(&token, server("q2")).await?;
    let (status, body) = cloud.create(&token, server("q3")).await?;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(
        body["forbidden"]["message"],
        "Quota exceeded for instances: Requested 1, but already used 2 of 2 instances"
    );
    let (_, limits) = cloud.get("/limits", &token).await?;
    assert_eq!(limits["limits"]["absolute"]["maxTotalInstances"], 2);
    assert_eq!(limits["limits"]["absolute"]["totalInstancesUsed"], 2);
    assert_eq!(limits["limits"]["absolute"]["totalRAMUsed"], 1024);
    Ok(())
}

#[tokio::test]
async fn injected_faults_answer_like_a_loaded_cloud() -> Result<()> {
    let cloud = Cloud::start(|_| {}).await?;
    let token = cloud.token().await?;
    cloud
        .faults(json!({"fail_next": [
            {"method": "POST", "path_prefix": "/compute/v2.1/servers", "status": 429, "count": 1, "retry_after": 7},
            {"method": "GET", "path_prefix": "/compute/v2.1/servers", "status": 503, "count": 2}
        ]}))
        .await?;
    let (status, headers, body) = cloud
        .call(
            reqwest::Method::POST,
            &cloud.nova("/servers"),
            &token,
            "2.96",
            Some(json!({"server": server("f1")})),
        )
        .await?;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["Retry-After"], "7");
    assert_eq!(body["overLimit"]["code"], 429);
    assert_eq!(body["overLimit"]["retryAfter"], "7");
    let id = cloud.create_ok(&token, server("f1")).await?;
    for _ in 0..2 {
        let (status, body) = cloud.get("/servers", &token).await?;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["serviceUnavailable"]["code"], 503);
    }
    assert_eq!(cloud.get("/servers", &token).await?.0, StatusCode::OK);

    cloud.faults(json!({"create_error_rate": 1.0})).await?;
    let doomed = cloud.create_ok(&token, server("f2")).await?;
    let errored = cloud.wait_status(&token, &doomed, "ERROR").await?;
    assert_eq!(errored["fault"]["code"], 500);
    assert!(errored["fault"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("No valid host")));

    cloud
        .faults(json!({"create_error_rate": 0.0, "stuck_build": true}))
        .await?;
    let stuck = cloud.create_ok(&token, server("f3")).await?;
    cloud.wait_status(&token, &id, "ACTIVE").await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (_, body) = cloud.get(&format!("/servers/{stuck}"), &token).await?;
    assert_eq!(body["server"]["status"], "BUILD");
    Ok(())
}
