//! The daemon on a real RDMA device: Soft-RoCE `rxe0` in the VM tier
//! (`tests/vm/run`). Every test here is named `rxe_*`; the host test run leaves them out and
//! the VM tier runs them, so none of them is ever skipped silently.

use rdmad_client::proxy::ManagerProxy;
use rdmad_tests::bus::PrivateBus;
use rdmad_tests::daemon::{rdmactl_ok, Daemon, DaemonOptions};
use rdmad_tests::NOBODY;
use serde_json::Value;

/// `node_guid` as `ibv_devinfo -d rxe0` prints it.
fn ibv_devinfo_node_guid() -> String {
    let out = std::process::Command::new("ibv_devinfo")
        .args(["-d", "rxe0"])
        .output()
        .expect("ibv_devinfo (ibverbs-utils) must be installed");
    assert!(out.status.success(), "ibv_devinfo failed: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.trim().strip_prefix("node_guid:"))
        .unwrap_or_else(|| panic!("no node_guid in {text}"))
        .trim()
        .to_owned()
}

#[tokio::test]
async fn rxe_daemon_serves_rxe0_with_the_verbs_provider() {
    let bus = PrivateBus::start();
    let _daemon = Daemon::start(
        &bus,
        DaemonOptions {
            provider: "verbs",
            ..DaemonOptions::default()
        },
    )
    .await;
    let guid = ibv_devinfo_node_guid();
    for uid in [None, Some(NOBODY)] {
        let json: Value = serde_json::from_str(&rdmactl_ok(&bus, uid, &["-j", "dev"])).unwrap();
        let rxe = json
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["ifname"] == "rxe0")
            .unwrap_or_else(|| panic!("rxe0 not in {json}"));
        assert_eq!(rxe["provider"], "verbs");
        assert_eq!(rxe["node_guid"], guid.as_str());
        let port = &rxe["ports"][0];
        assert_eq!(
            (port["port"].as_u64(), port["state"].as_str()),
            (Some(1), Some("active"))
        );
        assert_eq!(port["link_layer"], "ethernet");
        assert!(rxe["gids"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["gid"] == "::ffff:10.0.2.15" && g["gid_type"] == "RoCE v2"));
        assert!(rxe["caps"]["memory_windows"]
            .as_array()
            .unwrap()
            .contains(&Value::from("type2b")));

        let text = rdmactl_ok(&bus, uid, &["dev", "show", "rxe0"]);
        assert!(
            text.starts_with(&format!("ifname rxe0 provider verbs node_guid {guid} ")),
            "{text}"
        );
    }
}

/// With `provider = auto` on a host with an RDMA device, the loopback device is not served.
#[tokio::test]
async fn rxe_auto_provider_serves_the_real_device_only() {
    let bus = PrivateBus::start();
    let _daemon = Daemon::start(
        &bus,
        DaemonOptions {
            provider: "auto",
            ..DaemonOptions::default()
        },
    )
    .await;
    let connection = bus.connect().await;
    let names: Vec<String> = ManagerProxy::new(&connection)
        .await
        .unwrap()
        .list_devices()
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.name)
        .collect();
    assert!(names.contains(&"rxe0".to_owned()), "{names:?}");
    assert!(!names.contains(&"loopback0".to_owned()), "{names:?}");
}
