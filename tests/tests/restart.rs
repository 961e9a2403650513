//! The daemon going away under its clients — stopped (SIGTERM) or crashing (SIGKILL) —
//! and a new instance taking its place: clients see the name vanish through
//! `DaemonWatch` and get errors that say what happened; what they mapped stays readable in
//! their own process; the new instance starts with nothing of the old one's; on Soft-RoCE
//! the kernel holds no verbs object of the dead instance.

rdmad::on_both_providers!(async
    clients_see_the_daemon_go_and_a_restarted_daemon_starts_clean
        / rxe_clients_see_the_daemon_go_and_a_restarted_daemon_starts_clean,
);

mod bodies {
    use nix::sys::signal::Signal;
    use rdmad_tests::bus::PrivateBus;
    use rdmad_tests::client::Client;
    use rdmad_tests::daemon::{object_counts, Daemon, DaemonOptions};
    use rdmad_tests::{kernel_verbs_objects, NOBODY};

    const CONFIG: &str = "[[pool]]\nname = \"default\"\ncapacity = \"16MiB\"\n\
                          size_classes = [\"4KiB\"]\n";

    async fn start(bus: &PrivateBus, provider: &'static str) -> Daemon {
        Daemon::start(
            bus,
            DaemonOptions {
                provider,
                config: CONFIG.to_owned(),
                ..DaemonOptions::default()
            },
        )
        .await
    }

    pub async fn clients_see_the_daemon_go_and_a_restarted_daemon_starts_clean(provider: &str) {
        let provider = if provider == "verbs" {
            "verbs"
        } else {
            "loopback"
        };
        let kernel_before = kernel_verbs_objects(provider);
        let bus = PrivateBus::start();
        let mut daemon = start(&bus, provider).await;
        let fresh = object_counts(&bus).await;

        for signal in [Signal::SIGTERM, Signal::SIGKILL] {
            let mut c = Client::start(&bus, Some(NOBODY));
            let owner = c.ok("watch");
            c.ok("open");
            c.ok("alloc default 4096");
            c.ok("write 0 0 before-restart");
            let device = c.ok("devices")[0]["name"].as_str().unwrap().to_owned();
            c.ok(&format!("qp {device} 8 8"));
            c.ok("share 0 ro");
            assert_ne!(object_counts(&bus).await, fresh);

            daemon.signal(signal);
            let status = daemon.wait().await;
            let gone = c.ok("gone");
            assert_eq!(gone["previous"], owner, "{signal}");
            assert_eq!(gone["current"], serde_json::Value::Null, "{signal}");
            let message = gone["message"].as_str().unwrap();
            assert!(message.contains("left the bus"), "{signal}: {message}");
            if signal == Signal::SIGTERM {
                assert!(status.success(), "a stop is a clean exit: {status:?}");
            }

            // Calls while no daemon runs: a clear error, not a transport dump.
            let absent = c.call("info 0");
            assert_eq!(
                absent["error"], "org.freedesktop.DBus.Error.ServiceUnknown",
                "{signal}: {absent}"
            );
            assert!(
                absent["message"]
                    .as_str()
                    .unwrap()
                    .starts_with("rdmad is not running: nothing owns org.rdmad1"),
                "{signal}: {absent}"
            );
            // A stopping daemon gives every page back, whatever the client kept: its mapping
            // reads zeros. A killed one cannot: the pages live on while the client maps them.
            let kept = if signal == Signal::SIGTERM {
                "\0".repeat(14)
            } else {
                "before-restart".to_owned()
            };
            assert_eq!(c.ok("read 0 0 14"), kept, "{signal}");
            if let Some(before) = &kernel_before {
                assert_eq!(
                    &kernel_verbs_objects(provider).unwrap(),
                    before,
                    "{signal}: verbs objects of the dead daemon are left in the kernel"
                );
            }

            daemon = start(&bus, provider).await;
            assert_eq!(
                object_counts(&bus).await,
                fresh,
                "{signal}: the new instance"
            );
            let pools = c.ok("pools");
            assert_eq!(pools[0]["used"], 0, "{signal}: {pools}");
            // The old objects are not the new instance's.
            let stale = c.call("info 0");
            assert_eq!(
                stale["error"], "org.freedesktop.DBus.Error.UnknownObject",
                "{signal}: {stale}"
            );
            assert!(
                stale["message"]
                    .as_str()
                    .unwrap()
                    .contains("rdmad restarted"),
                "{signal}: {stale}"
            );
            // And the client starts over.
            assert_ne!(c.ok("watch"), owner);
            c.ok("open");
            c.ok("alloc default 4096");
            c.kill();
        }
    }
}
