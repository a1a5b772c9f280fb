//! Against the real Docker engine: `SANDBOX_TEST_DOCKER=1` and an image to run
//! (`SANDBOX_K8S_POD_IMAGE`, built by `cargo xtask images`).

use std::time::Duration;

use test_docker::{ContainerSpec, Owner};

/// The image the tests run (needed with `SANDBOX_TEST_DOCKER=1`, which turns the tests on).
fn image() -> String {
    match std::env::var("SANDBOX_K8S_POD_IMAGE") {
        Ok(i) if !i.is_empty() => i,
        _ => panic!("SANDBOX_TEST_DOCKER=1 needs SANDBOX_K8S_POD_IMAGE"),
    }
}

fn count(args: &[&str]) -> usize {
    let out = std::process::Command::new("docker")
        .args(args)
        .output()
        .expect("docker");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .count()
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn lifecycle_commit_and_cleanup() {
    let image = image();
    let id: String = format!("t{}", std::process::id());
    let owner = Owner::new("sandbox-harness.test-docker", id.clone());
    let net = format!("testdocker-{id}");
    owner.create_network(&net).await.unwrap();
    let spec = ContainerSpec {
        name: format!("testdocker-{id}-a"),
        image,
        env: vec![("SANDBOX_BASE_DIR".into(), "/".into())],
        labels: vec![("extra".into(), "yes".into())],
        ..ContainerSpec::default()
    };
    let started = owner.run(&spec, &net).await.unwrap();
    assert!(started.ip.contains('.'), "ip {}", started.ip);
    let st = test_docker::inspect(&started.id).await.unwrap().unwrap();
    assert!(st.running && !st.paused, "{st:?}");
    test_docker::pause(&started.id).await.unwrap();
    let st = test_docker::inspect(&started.id).await.unwrap().unwrap();
    assert!(st.paused && st.status == "paused", "{st:?}");
    test_docker::unpause(&started.id).await.unwrap();
    let tag = format!("sandbox-harness-test/test-docker:{id}");
    owner.commit(&started.id, &tag).await.unwrap();
    assert!(test_docker::image_exists(&tag).await.unwrap());
    test_docker::stop(&started.id, Duration::from_secs(1))
        .await
        .unwrap();
    let st = test_docker::inspect(&started.id).await.unwrap().unwrap();
    assert!(!st.running && st.status == "exited", "{st:?}");
    test_docker::start(&started.id).await.unwrap();
    assert!(
        test_docker::inspect(&started.id)
            .await
            .unwrap()
            .unwrap()
            .running
    );
    test_docker::kill(&started.id).await.unwrap();
    let code = test_docker::wait(&started.id).await.unwrap();
    assert_eq!(code, 137);

    let filter = format!("label=sandbox-harness.test-docker={id}");
    assert_eq!(count(&["ps", "-aq", "--filter", &filter]), 1);
    assert_eq!(count(&["images", "-q", "--filter", &filter]), 1);
    owner.cleanup_blocking(Some(&net), false);
    assert_eq!(count(&["ps", "-aq", "--filter", &filter]), 0);
    assert_eq!(count(&["images", "-q", "--filter", &filter]), 0);
    assert_eq!(count(&["network", "ls", "-q", "--filter", &filter]), 0);
    assert!(test_docker::inspect(&started.id).await.unwrap().is_none());
    assert!(!test_docker::image_exists(&tag).await.unwrap());
    // `rmi -f` of a gone image is not an error.
    test_docker::remove_image(&tag).await.unwrap();
}

#[tokio::test]
#[cfg_attr(
    not(docker_tests),
    ignore = "needs Docker: set SANDBOX_TEST_DOCKER=1 (cargo xtask test does)"
)]
async fn stale_owner_leftovers_are_removed() {
    let image = image();
    // A pid that cannot be alive: above the kernel's pid_max limit (4194304).
    let dead = "4194305";
    let ns = "sandbox-harness.test-docker-stale";
    let id = format!("s{}", std::process::id());
    let net = format!("testdocker-stale-{id}");
    let out = std::process::Command::new("docker")
        .args([
            "network",
            "create",
            "--label",
            &format!("{ns}={id}"),
            "--label",
            &format!("{ns}.pid={dead}"),
            &net,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = std::process::Command::new("docker")
        .args([
            "run",
            "-d",
            "--network",
            &net,
            "--label",
            &format!("{ns}={id}"),
            "--label",
            &format!("{ns}.pid={dead}"),
            &image,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let filter = format!("label={ns}={id}");
    assert_eq!(count(&["ps", "-aq", "--filter", &filter]), 1);
    test_docker::remove_stale(ns).await.unwrap();
    assert_eq!(count(&["ps", "-aq", "--filter", &filter]), 0);
    assert_eq!(count(&["network", "ls", "-q", "--filter", &filter]), 0);
}
