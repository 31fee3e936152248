//! Round trip against a real OpenStack (the fixture in
//! `/work/shared/openstack-fixture`). Runs only with `OSFIX` set, e.g.
//! `OSFIX=1 OS_CLIENT_CONFIG_FILE=/tmp/osfix/clouds.yaml OS_CLOUD=osfix-demo
//! cargo test -p vq-controller --test real_openstack -- --ignored`.

use std::collections::BTreeMap;
use std::time::Duration;

use vq_common::config::OpenStackSection;
use vq_controller::openstack::{cluster_tag, CloudApi, CreateServer, Credentials, HttpCloud};

#[tokio::test]
#[ignore = "needs a real OpenStack (set OSFIX and OS_CLOUD)"]
async fn real_openstack_roundtrip() {
    if std::env::var("OSFIX").is_err() {
        eprintln!("OSFIX not set; skipping");
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = |k: &str| std::env::var(k).ok();
    let creds = Credentials::discover(&OpenStackSection::default(), &env).unwrap();
    let cloud = HttpCloud::new(creds, None).unwrap();
    let cluster = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let tag = cluster_tag(&cluster);

    let quota = cloud.quota().await.unwrap();
    eprintln!("quota: {quota:?}");
    let flavor = cloud.resolve_flavor("m1.tiny").await.unwrap();
    let image = cloud.resolve_image("cirros-fake").await.unwrap();
    assert!(cloud.resolve_image("no-such-image").await.is_err());
    assert!(cloud.resolve_flavor("no-such-flavor").await.is_err());
    assert!(cloud.list_servers(&tag).await.unwrap().is_empty());

    let name = format!("{cluster}-cms-0000beef");
    let req = CreateServer {
        name: name.clone(),
        flavor_ref: flavor,
        image_ref: image,
        user_data: b"#cloud-config\n".to_vec(),
        metadata: BTreeMap::from([
            ("vq-cluster".to_string(), cluster.clone()),
            ("vq-pool".to_string(), "cms".to_string()),
            ("vq-agent".to_string(), name.clone()),
        ]),
        tags: vec![tag.clone()],
        network: None,
        key_name: None,
        security_groups: vec![],
        availability_zone: None,
    };
    let id = cloud.create_server(&req).await.unwrap();
    let mut status = String::new();
    for _ in 0..60 {
        let list = cloud.list_servers(&tag).await.unwrap();
        assert_eq!(list.len(), 1, "the tag filter finds exactly our server");
        let s = &list[0];
        assert_eq!(s.id, id);
        assert_eq!(s.name, name);
        assert_eq!(s.metadata["vq-pool"], "cms");
        assert!(s.tags.contains(&tag));
        assert!(s.created.is_some());
        status = s.status.clone();
        if status == "ACTIVE" || status == "ERROR" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(status, "ACTIVE");
    cloud.delete_server(&id).await.unwrap();
    for _ in 0..60 {
        if cloud.list_servers(&tag).await.unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(cloud.list_servers(&tag).await.unwrap().is_empty());
    cloud
        .delete_server(&id)
        .await
        .expect("deleting a gone server succeeds");
}

/// Against real Nova's version document: the default microversion is
/// served, and one above the cloud's maximum is refused naming both
/// versions (the controller refuses to start with this error).
#[tokio::test]
#[ignore = "needs a real OpenStack (set OSFIX and OS_CLOUD)"]
async fn real_nova_version_document_decides_the_microversion() {
    if std::env::var("OSFIX").is_err() {
        eprintln!("OSFIX not set; skipping");
        return;
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let env = |k: &str| std::env::var(k).ok();
    let creds = || Credentials::discover(&OpenStackSection::default(), &env).unwrap();
    let served = HttpCloud::new(creds(), None)
        .unwrap()
        .check_compute_version()
        .await
        .expect("real Nova serves vq's default microversion");
    eprintln!("compute microversions {} to {}", served.min, served.max);
    let above = vq_common::config::Microversion {
        major: served.max.major,
        minor: served.max.minor + 1,
    };
    let err = HttpCloud::new(creds(), Some(above))
        .unwrap()
        .check_compute_version()
        .await
        .expect_err("a microversion above the cloud's maximum is refused");
    let text = err.to_string();
    assert!(
        matches!(err, vq_controller::error::CloudError::Microversion { .. })
            && text.contains(&above.to_string())
            && text.contains(&served.max.to_string()),
        "the refusal names both versions: {text}"
    );
}
