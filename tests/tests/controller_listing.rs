//! The controller's cloud client against vq-cloudsim listings that real
//! Nova produces while servers are being scheduled (issue 12): pages that
//! list a server twice, a repeated `next` link, a low page-size cap.
//!
//! `cargo test -p vq-tests --test controller_listing`.

use anyhow::{ensure, Context, Result};
use vq_common::config::OpenStackSection;
use vq_controller::openstack::{cluster_tag, CloudApi, CreateServer, Credentials, HttpCloud};
use vq_tests::cloudsim::{Sim, SimConfig, SimHandle};

/// reqwest (rustls without a built-in provider) needs one installed.
fn http() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

async fn sim_faults(sim: &SimHandle, faults: serde_json::Value) -> Result<()> {
    http()
        .post(format!("{}/_sim/faults", sim.base_url()))
        .json(&faults)
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}

async fn cloud_with_servers(dir: &std::path::Path, n: usize) -> Result<(SimHandle, HttpCloud)> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let agent_cfg = dir.join("jobagent.toml");
    std::fs::write(&agent_cfg, "")?;
    let sim = Sim::start(SimConfig::new(dir.join("sim"), "/bin/true", &agent_cfg)).await?;
    let section = OpenStackSection {
        cloud: Some("cloudsim".into()),
        clouds_yaml: Some(sim.clouds_yaml().to_path_buf()),
        compute_microversion: None,
    };
    let creds = Credentials::discover(&section, &|_| None)?;
    let cloud = HttpCloud::new(creds, None)?;
    let flavor = cloud.resolve_flavor("m1.small").await?;
    let image = cloud.resolve_image("vq-worker").await?;
    for i in 0..n {
        cloud
            .create_server(&CreateServer {
                name: format!("vq-list-{i}"),
                flavor_ref: flavor.clone(),
                image_ref: image.clone(),
                user_data: Vec::new(),
                metadata: Default::default(),
                tags: vec![cluster_tag("list")],
                network: None,
                key_name: None,
                security_groups: Vec::new(),
                availability_zone: None,
            })
            .await?;
    }
    Ok((sim, cloud))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_with_overlapping_pages_counts_each_server_once() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (sim, cloud) = cloud_with_servers(dir.path(), 5).await?;
    sim_faults(
        &sim,
        serde_json::json!({"max_limit": 2, "overlapping_pages": true}),
    )
    .await?;
    let listed = cloud.list_servers(&cluster_tag("list")).await?;
    let mut ids: Vec<&str> = listed.iter().map(|s| s.id.as_str()).collect();
    let n = ids.len();
    ids.sort_unstable();
    ids.dedup();
    eprintln!("5 servers, pages of 2 that overlap: {n} listed");
    ensure!(
        n == 5 && ids.len() == 5,
        "{n} entries ({} distinct) for 5 servers",
        ids.len()
    );
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_next_link_is_an_incomplete_listing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (sim, cloud) = cloud_with_servers(dir.path(), 3).await?;
    sim_faults(
        &sim,
        serde_json::json!({"max_limit": 2, "repeated_next_link": true}),
    )
    .await?;
    let err = cloud
        .list_servers(&cluster_tag("list"))
        .await
        .err()
        .context("a listing whose next link repeats was taken as complete")?;
    let text = vq_common::error::chain(&err);
    ensure!(text.contains("already followed"), "{text}");
    sim.shutdown().await;
    Ok(())
}
