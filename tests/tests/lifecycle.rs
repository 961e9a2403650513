//! The daemon as systemd sees it: readiness, status, watchdog, reload, stop.

use nix::sys::signal::Signal;
use rdmad_client::proxy::ManagerProxy;
use rdmad_client::BUS_NAME;
use rdmad_tests::bus::PrivateBus;
use rdmad_tests::daemon::{Daemon, DaemonOptions};

fn with_notify() -> DaemonOptions {
    DaemonOptions {
        notify: true,
        ..DaemonOptions::default()
    }
}

/// READY=1 comes only when a client can already find the name and the objects.
#[tokio::test]
async fn ready_is_sent_after_the_name_is_owned_and_objects_are_served() {
    let bus = PrivateBus::start();
    let mut daemon = Daemon::spawn(&bus, with_notify());
    let ready = daemon.notify.as_mut().unwrap().wait_for("READY=1").await;
    assert!(
        ready
            .lines()
            .any(|l| l == "STATUS=Serving 1 device: loopback0 (loopback); 0 sessions, 0 regions"),
        "{ready:?}"
    );

    let connection = bus.connect().await;
    let dbus = zbus::fdo::DBusProxy::new(&connection).await.unwrap();
    assert!(dbus
        .name_has_owner(BUS_NAME.try_into().unwrap())
        .await
        .unwrap());
    let manager = ManagerProxy::new(&connection).await.unwrap();
    let devices = manager.list_devices().await.unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].name, "loopback0");
    daemon.signal(Signal::SIGTERM);
    assert!(daemon.wait().await.success());
}

#[tokio::test]
async fn watchdog_is_pinged_when_enabled() {
    let bus = PrivateBus::start();
    let mut daemon = Daemon::spawn(
        &bus,
        DaemonOptions {
            watchdog_usec: Some(200_000),
            ..with_notify()
        },
    );
    let notify = daemon.notify.as_mut().unwrap();
    notify.wait_for("READY=1").await;
    // Two pings, so it is a timer, not a one-off.
    notify.wait_for("WATCHDOG=1").await;
    notify.wait_for("WATCHDOG=1").await;
}

#[tokio::test]
async fn no_watchdog_pings_without_watchdog_usec() {
    let bus = PrivateBus::start();
    let mut daemon = Daemon::spawn(&bus, with_notify());
    daemon.notify.as_mut().unwrap().wait_for("READY=1").await;
    // Use a reload as a marker: everything sent before its READY=1 is in `received`.
    daemon.signal(Signal::SIGHUP);
    let notify = daemon.notify.as_mut().unwrap();
    notify.wait_for("RELOADING=1").await;
    notify.wait_for("READY=1").await;
    assert!(
        !notify.received.iter().any(|m| m.contains("WATCHDOG=1")),
        "{:?}",
        notify.received
    );
}

/// SIGHUP applies a valid file; an invalid one is refused, logged with file, line and key,
/// and the old configuration keeps running.
#[tokio::test]
async fn sighup_reloads_a_valid_config_and_keeps_the_old_one_on_error() {
    let bus = PrivateBus::start();
    let mut daemon = Daemon::spawn(&bus, with_notify());
    daemon.notify.as_mut().unwrap().wait_for("READY=1").await;
    let connection = bus.connect().await;
    let manager = ManagerProxy::new(&connection).await.unwrap();
    assert_eq!(manager.n_reloads().await.unwrap(), 0);

    daemon.write_config("[daemon]\nlog_level = \"debug\"\n");
    daemon.signal(Signal::SIGHUP);
    let notify = daemon.notify.as_mut().unwrap();
    let reloading = notify.wait_for("RELOADING=1").await;
    assert!(reloading.contains("MONOTONIC_USEC="), "{reloading:?}");
    notify.wait_for("READY=1").await;
    assert_eq!(manager.n_reloads().await.unwrap(), 1);

    daemon.write_config("[daemon]\nlog_level = \"debug\"\nprovider = \"loopbak\"\n");
    daemon.signal(Signal::SIGHUP);
    let notify = daemon.notify.as_mut().unwrap();
    notify.wait_for("RELOADING=1").await;
    notify.wait_for("READY=1").await;
    assert_eq!(
        manager.n_reloads().await.unwrap(),
        1,
        "the bad file was not applied"
    );
    assert_eq!(
        manager.list_devices().await.unwrap().len(),
        1,
        "still serving"
    );
    let expected = format!(
        "{}:3: daemon.provider: unknown variant `loopbak`",
        daemon.config_path.display()
    );
    assert!(daemon.stderr().contains(&expected), "{}", daemon.stderr());
}

/// SIGTERM: STOPPING=1, the name is released, exit status 0, and the daemon logs that
/// it released everything.
#[tokio::test]
async fn sigterm_stops_cleanly() {
    let bus = PrivateBus::start();
    let mut daemon = Daemon::spawn(&bus, with_notify());
    daemon.notify.as_mut().unwrap().wait_for("READY=1").await;
    daemon.signal(Signal::SIGTERM);
    daemon.notify.as_mut().unwrap().wait_for("STOPPING=1").await;
    let status = daemon.wait().await;
    assert!(status.success(), "{status:?}\n{}", daemon.stderr());
    assert!(
        !daemon.stderr().contains("still hold"),
        "{}",
        daemon.stderr()
    );
    let connection = bus.connect().await;
    let dbus = zbus::fdo::DBusProxy::new(&connection).await.unwrap();
    assert!(!dbus
        .name_has_owner(BUS_NAME.try_into().unwrap())
        .await
        .unwrap());
}

/// A bad file stops the start with the file, line and key; nothing is served.
#[tokio::test]
async fn invalid_config_is_refused_at_start() {
    let bus = PrivateBus::start();
    let mut daemon = Daemon::spawn(
        &bus,
        DaemonOptions {
            config: "[daemon]\n\n[[device]]\nname = \"loopback0\"\nprot = 1\n".into(),
            ..with_notify()
        },
    );
    let status = daemon.wait().await;
    assert_eq!(status.code(), Some(1));
    let expected = format!(
        "rdmad: {}:5: device[0].prot: unknown field `prot`",
        daemon.config_path.display()
    );
    assert!(daemon.stderr().contains(&expected), "{}", daemon.stderr());
    assert!(daemon.notify.as_ref().unwrap().received.is_empty());
}

/// Only one daemon can own the name; the second says why and exits.
#[tokio::test]
async fn second_daemon_reports_the_name_is_taken() {
    let bus = PrivateBus::start();
    let _first = Daemon::start(&bus, DaemonOptions::default()).await;
    let mut second = Daemon::spawn(&bus, DaemonOptions::default());
    assert_eq!(second.wait().await.code(), Some(1));
    assert!(
        second.stderr().contains("another process owns org.rdmad1"),
        "{}",
        second.stderr()
    );
}

/// The shipped bus policy lets only root own org.rdmad1.
#[tokio::test]
async fn policy_refuses_the_name_to_other_users() {
    let bus = PrivateBus::start();
    let out =
        rdmad_tests::daemon::as_user(Some(rdmad_tests::NOBODY), &rdmad_tests::binary("rdmad"))
            .args([
                "--bus",
                &bus.address,
                "--provider",
                "loopback",
                "--log-target",
                "stderr",
            ])
            .args(["--config", "/dev/null"])
            .output()
            .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the bus refused to let this user own org.rdmad1"),
        "{stderr}"
    );
}

/// STATUS= follows the live counts.
#[tokio::test]
async fn status_follows_sessions_and_regions() {
    let bus = PrivateBus::start();
    let mut daemon = Daemon::spawn(&bus, with_notify());
    daemon.notify.as_mut().unwrap().wait_for("READY=1").await;
    let connection = bus.connect().await;
    let manager = ManagerProxy::new(&connection).await.unwrap();
    let session = manager.open_session(Default::default()).await.unwrap();
    rdmad_client::proxy::SessionProxy::builder(&connection)
        .path(session)
        .unwrap()
        .build()
        .await
        .unwrap()
        .allocate_region("default", 4096, Default::default())
        .await
        .unwrap();
    daemon
        .notify
        .as_mut()
        .unwrap()
        .wait_for("STATUS=Serving 1 device: loopback0 (loopback); 1 session, 1 region")
        .await;
}
