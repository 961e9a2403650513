//! The D-Bus API as a zbus client sees it, and `rdmactl` as root and as another user.

use rdmad_client::proxy::{DeviceProxy, ManagerProxy};
use rdmad_client::{device_path, Error, MANAGER_PATH};
use rdmad_tests::bus::PrivateBus;
use rdmad_tests::client::Client;
use rdmad_tests::daemon::{rdmactl, rdmactl_ok, Daemon, DaemonOptions};
use rdmad_tests::NOBODY;
use serde_json::Value;

async fn loopback_daemon() -> (PrivateBus, Daemon) {
    let bus = PrivateBus::start();
    let daemon = Daemon::start(&bus, DaemonOptions::default()).await;
    (bus, daemon)
}

#[tokio::test]
async fn manager_lists_and_finds_devices() {
    let (bus, _daemon) = loopback_daemon().await;
    let connection = bus.connect().await;
    let manager = ManagerProxy::new(&connection).await.unwrap();
    assert_eq!(manager.version().await.unwrap(), env!("CARGO_PKG_VERSION"));
    assert_eq!(manager.n_devices().await.unwrap(), 1);
    let devices = manager.list_devices().await.unwrap();
    assert_eq!(devices[0].provider, "loopback");
    assert_eq!(devices[0].path.as_str(), device_path("loopback0"));
    let path = manager.get_device("loopback0").await.unwrap();
    assert_eq!(path, devices[0].path);

    match manager.get_device("mlx5_0").await {
        Err(Error::NoSuchObject(message)) => {
            assert_eq!(message, "no device named \"mlx5_0\" (devices: loopback0)")
        }
        other => panic!("expected org.rdmad1.Error.NoSuchObject, got {other:?}"),
    }
}

#[tokio::test]
async fn device_object_reports_ports_gids_and_capabilities() {
    let (bus, _daemon) = loopback_daemon().await;
    let connection = bus.connect().await;
    let device = DeviceProxy::builder(&connection)
        .path(device_path("loopback0"))
        .unwrap()
        .build()
        .await
        .unwrap();
    assert_eq!(device.name().await.unwrap(), "loopback0");
    assert_eq!(device.provider().await.unwrap(), "loopback");
    assert_eq!(device.node_guid().await.unwrap(), "0200:00ff:fe00:0001");
    let ports = device.ports().await.unwrap();
    assert_eq!(ports.len(), 1);
    assert_eq!(
        (
            ports[0].port,
            ports[0].state.as_str(),
            ports[0].active_mtu,
            ports[0].link_layer.as_str()
        ),
        (1, "active", 4096, "ethernet")
    );
    let gids = device.gids().await.unwrap();
    assert!(gids
        .iter()
        .any(|g| g.gid == "::ffff:127.0.0.1" && g.gid_type == "RoCE v2" && g.index == 1));
    let caps = device.capabilities().await.unwrap();
    assert!(caps.max_qp > 0 && caps.max_mr > 0 && caps.max_cqe > 0 && caps.max_sge > 0);
    assert_eq!(caps.atomics, "hca");
    assert!(caps.memory_windows.contains(&"type2b".to_owned()));
}

/// Standard D-Bus tooling works: introspection and the ObjectManager.
#[tokio::test]
async fn introspection_and_object_manager() {
    let (bus, _daemon) = loopback_daemon().await;
    let connection = bus.connect().await;
    let introspect = zbus::fdo::IntrospectableProxy::builder(&connection)
        .destination(rdmad_client::BUS_NAME)
        .unwrap()
        .path(MANAGER_PATH)
        .unwrap()
        .build()
        .await
        .unwrap();
    let xml = introspect.introspect().await.unwrap();
    for needle in [
        "<interface name=\"org.rdmad1.Manager\">",
        "<interface name=\"org.freedesktop.DBus.ObjectManager\">",
        "<method name=\"ListDevices\">",
        "<property name=\"Version\" type=\"s\" access=\"read\">",
    ] {
        assert!(xml.contains(needle), "{needle} missing from\n{xml}");
    }
    let objects = rdmad_tests::daemon::object_manager(&connection)
        .await
        .get_managed_objects()
        .await
        .unwrap();
    let device = objects
        .iter()
        .find(|(path, _)| path.as_str() == device_path("loopback0"))
        .expect("device object listed by GetManagedObjects");
    assert!(device.1.keys().any(|i| i.as_str() == "org.rdmad1.Device"));
}

/// The text output and `-j` carry the same keys, for root and for an unprivileged user.
#[tokio::test]
async fn rdmactl_dev_text_and_json_agree_for_every_user() {
    let (bus, _daemon) = loopback_daemon().await;
    for uid in [None, Some(NOBODY)] {
        let json: Value =
            serde_json::from_str(&rdmactl_ok(&bus, uid, &["-j", "dev"])).expect("JSON");
        let devices = json.as_array().expect("a list of devices");
        assert_eq!(devices.len(), 1);
        let dev = &devices[0];
        assert_eq!(dev["ifname"], "loopback0");
        assert_eq!(dev["ports"][0]["state"], "active");

        let text = rdmactl_ok(&bus, uid, &["dev"]);
        let first = text.lines().next().unwrap();
        for (key, value) in dev.as_object().unwrap() {
            if value.is_string() || value.is_number() {
                let plain = value.as_str().map_or(value.to_string(), str::to_owned);
                assert!(
                    first.contains(&format!("{key} {plain}")),
                    "{key} in {first:?}"
                );
            } else if value.as_array().is_some_and(Vec::is_empty) {
                // An empty list (no lingering objects) is one word on the device's line.
                assert!(first.contains(&format!("{key} none")), "{key} in {first:?}");
            } else {
                assert!(text.contains(&format!("\n    {key} ")), "{key} in {text}");
            }
        }
        // `dev` and `dev show` and `dev show NAME` are the same thing here.
        assert_eq!(rdmactl_ok(&bus, uid, &["dev", "show"]), text);
        assert_eq!(rdmactl_ok(&bus, uid, &["dev", "show", "loopback0"]), text);
    }
}

#[tokio::test]
async fn rdmactl_status_for_every_user() {
    let (bus, _daemon) = loopback_daemon().await;
    for uid in [None, Some(NOBODY)] {
        let json: Value = serde_json::from_str(&rdmactl_ok(&bus, uid, &["-j", "status"])).unwrap();
        assert_eq!(json["version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(json["devices"], serde_json::json!(["loopback0"]));
        let text = rdmactl_ok(&bus, uid, &["status"]);
        for key in json.as_object().unwrap().keys() {
            assert!(
                text.lines().any(|l| l.starts_with(&format!("{key} "))),
                "{key}: {text}"
            );
        }
    }
}

#[tokio::test]
async fn rdmactl_errors_are_one_line_and_non_zero() {
    let (bus, daemon) = loopback_daemon().await;
    let out = rdmactl(&bus, Some(NOBODY), &["dev", "show", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "rdmactl: no device named \"nope\" (devices: loopback0)\n"
    );

    let out = rdmactl(&bus, Some(NOBODY), &["reload"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "rdmactl: Reload needs administrator rights: run it as root (or set daemon.admin_group in the configuration)\n"
    );
    assert_eq!(
        rdmactl_ok(&bus, None, &["reload"]),
        "configuration reloaded\n"
    );

    drop(daemon);
    let out = rdmactl(&bus, Some(NOBODY), &["status"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("rdmactl: rdmad is not running"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

/// `Manager.Reload` as root applies a valid file and refuses a bad one with its location.
#[tokio::test]
async fn reload_over_dbus_reports_config_errors() {
    let (bus, daemon) = loopback_daemon().await;
    let connection = bus.connect().await;
    let manager = ManagerProxy::new(&connection).await.unwrap();
    daemon.write_config("[daemon]\nlog_level = \"trace\"\n");
    manager.reload().await.unwrap();
    assert_eq!(manager.n_reloads().await.unwrap(), 1);
    daemon.write_config("[daemon]\nlog_level = 3\n");
    match manager.reload().await {
        Err(Error::InvalidArgument(message)) => assert!(
            message.starts_with(&format!(
                "{}:2: daemon.log_level: ",
                daemon.config_path.display()
            )),
            "{message}"
        ),
        other => panic!("expected org.rdmad1.Error.InvalidArgument, got {other:?}"),
    }
    assert_eq!(manager.n_reloads().await.unwrap(), 1);
}

#[test]
fn rdmactl_without_a_bus_says_so() {
    let out = std::process::Command::new(rdmad_tests::binary("rdmactl"))
        .args(["--bus", "unix:path=/nonexistent/bus", "status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("rdmactl: cannot connect to the unix:path=/nonexistent/bus bus"),
        "{stderr}"
    );
}

/// Calls that wait on the device — registering memory, creating a queue pair — run off the
/// threads that serve the bus: while two clients' calls each take seconds on a slow device
/// (as many as the daemon has bus threads), a third client's calls are answered at once,
/// before either of them — a listing, and an allocation from a warm pool and its `Free`.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_device_call_never_delays_another_clients_call() {
    let bus = PrivateBus::start();
    let daemon = Daemon::start(
        &bus,
        DaemonOptions {
            config: "[[pool]]\nname = \"cold\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n\
                     warm = 0\n\
                     [[pool]]\nname = \"warm\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n\
                     warm = 1\n"
                .into(),
            env: vec![("RDMAD_TEST_SLOW_DEVICE_MS", "4000".into())],
            ..DaemonOptions::default()
        },
    )
    .await;
    // The warm region is registered (slowly, too) before the slow calls start.
    daemon.wait_for_log("test hook: ibv_reg_mr done", 1).await;
    let mut quick = Client::start(&bus, Some(NOBODY));
    quick.ok("open");
    let warm_ready = |pools: serde_json::Value| {
        pools
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "warm" && p["warm_regions"] == 1)
    };
    while !warm_ready(quick.ok("pools")) {}
    let slow: Vec<Client> = ["alloc cold 4096", "qp loopback0 4 4"]
        .into_iter()
        .map(|command| {
            let mut c = Client::start(&bus, Some(NOBODY));
            c.ok("open");
            c.send(command);
            c
        })
        .collect();
    // Both calls are waiting on the device now.
    daemon.wait_for_log("test hook: ibv_reg_mr takes", 2).await;
    daemon
        .wait_for_log("test hook: ibv_create_qp takes", 1)
        .await;
    let answered: Vec<_> = slow
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                let answer = c.answer();
                (answer, std::time::Instant::now(), c)
            })
        })
        .collect();
    quick.ok("sessions");
    quick.ok("alloc warm 4096");
    quick.ok("free 0");
    let quick_done = std::time::Instant::now();
    for thread in answered {
        let (answer, at, _client) = thread.join().unwrap();
        assert!(answer.get("ok").is_some(), "{answer}");
        assert!(
            quick_done < at,
            "the quick client was answered only after a slow call ({answer})"
        );
    }
}
