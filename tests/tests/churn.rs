//! Churn: a thousand client processes open sessions, allocate, share and attach regions,
//! create and connect QPs, export, start transfers — and are killed with SIGKILL at a
//! random point of that script, sometimes in the middle of a call. Afterwards the daemon's
//! objects, the provider's objects (on rxe0 the kernel's verbs objects too), the pool's
//! usage and the daemon's descriptors are back to their baseline, and its memory has grown by less than [`RSS_GROWTH_BOUND`].
//!
//! `RDMAD_CHURN_CLIENTS` (default 1000) and `RDMAD_CHURN_SEED` (default: the clock; the
//! seed is printed) reproduce a run.

rdmad::on_both_providers!(async
    churn_of_killed_clients_leaves_nothing_behind
        / rxe_churn_of_killed_clients_leaves_nothing_behind
);

mod bodies {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use rdmad_tests::client::Client;
    use rdmad_tests::daemon::{object_counts, start_on, wait_for_sessions};
    use rdmad_tests::rng::Rng;
    use rdmad_tests::{kernel_verbs_objects, NOBODY};
    use serde_json::Value;

    /// What the daemon's resident memory may grow by over the whole run, measured after a
    /// warm-up of [`WARM_UP`] clients (allocator arenas, caches and the bus connection
    /// tables have reached their working size by then).
    const RSS_GROWTH_BOUND: u64 = 8 << 20;
    const WARM_UP: usize = 32;
    /// Clients alive at once.
    const PARALLEL: usize = 8;
    /// The script's length: a client is killed before step 0 ..= after the last one.
    const STEPS: usize = 23;

    const CONFIG: &str = "[[pool]]\nname = \"default\"\ncapacity = \"64MiB\"\n\
                          size_classes = [\"4KiB\", \"64KiB\"]\n";

    fn status_kib(pid: u32, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
    }

    fn open_fds(pid: u32) -> usize {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    }

    /// Pool usage as users see it: bytes in use and regions, by pool.
    fn pool_usage(c: &mut Client) -> Vec<(String, u64, u64)> {
        let pools = c.ok("pools");
        pools
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["name"].as_str().unwrap().to_owned(),
                    p["used"].as_u64().unwrap(),
                    p["regions"].as_u64().unwrap(),
                )
            })
            .collect()
    }

    /// Runs one client of the churn: `kill_at` steps with their answers, then (if
    /// `mid_call`) one more step written without waiting, then SIGKILL.
    fn one_client(
        bus: &rdmad_tests::bus::PrivateBus,
        uid: u32,
        device: &str,
        peer_token: &str,
        kill_at: usize,
        mid_call: bool,
    ) {
        let mut c = Client::start(bus, Some(uid));
        let mut said: HashMap<&str, Value> = HashMap::new();
        for step in 0..=kill_at.min(STEPS) {
            let command = match step {
                0 => "open".to_owned(),
                1 => "alloc default 4096".to_owned(),
                2 => "alloc default 65536".to_owned(),
                3 => "write 0 0 churn-bytes".to_owned(),
                4 => "share 0 rw".to_owned(),
                5 => format!("attach {peer_token}"),
                6 => "write 2 0 churn".to_owned(),
                7 | 8 => format!("qp {device} 16 16"),
                9 => "endpoint 0".to_owned(),
                10 => "endpoint 1".to_owned(),
                11 => format!("connect 0 {}", said["endpoint 1"]),
                12 => format!("connect 1 {}", said["endpoint 0"]),
                13 => "export 1 1 rw".to_owned(),
                14 => "post 1 recv 1 0 4096 1".to_owned(),
                15 => "post 0 send 0 0 64 2".to_owned(),
                16 => {
                    let export = &said["export 1 1 rw"];
                    format!("post 0 write 0 0 4096 3 {} {}", export[0], export[1])
                }
                // Sends the peer has no receive for: they stay in flight.
                17..=20 => format!("post 0 send 0 0 64 {step}"),
                21 => "wait 0".to_owned(),
                22 => "free 0".to_owned(),
                _ => "read 1 0 8".to_owned(),
            };
            if step == kill_at {
                if mid_call {
                    c.send(&command);
                }
                break;
            }
            let answer = c.ok(&command);
            match step {
                9 => said.insert("endpoint 0", answer),
                10 => said.insert("endpoint 1", answer),
                13 => said.insert("export 1 1 rw", answer),
                _ => None,
            };
        }
        c.kill();
    }

    pub async fn churn_of_killed_clients_leaves_nothing_behind(provider: &str) {
        let clients: usize = std::env::var("RDMAD_CHURN_CLIENTS")
            .map(|v| v.parse().expect("RDMAD_CHURN_CLIENTS: a number"))
            .unwrap_or(1000);
        let seed = std::env::var("RDMAD_CHURN_SEED")
            .map(|v| v.parse().expect("RDMAD_CHURN_SEED: a number"))
            .unwrap_or_else(|_| Rng::seed_from_clock());
        println!("churn: {clients} clients, RDMAD_CHURN_SEED={seed}");

        let (bus, daemon) = start_on(provider, CONFIG).await;
        let pid = daemon.child.id().expect("daemon pid");
        // A long-lived owner whose region every churning client attaches.
        let mut peer = Client::start(&bus, None);
        peer.ok("open");
        peer.ok("alloc default 4096");
        let token = peer.ok("share 0 rw")[0].as_str().unwrap().to_owned();
        let device = peer.ok("devices")[0]["name"].as_str().unwrap().to_owned();

        let next = AtomicUsize::new(0);
        let plan = Mutex::new(Rng::new(seed));
        let mut baseline = None;
        for (from, to) in [(0, WARM_UP.min(clients)), (WARM_UP.min(clients), clients)] {
            next.store(from, Ordering::SeqCst);
            std::thread::scope(|s| {
                for _ in 0..PARALLEL {
                    s.spawn(|| loop {
                        if next.fetch_add(1, Ordering::SeqCst) >= to {
                            break;
                        }
                        let (uid, kill_at, mid_call) = {
                            let mut rng = plan.lock().unwrap();
                            let uid = if rng.below(2) == 0 { NOBODY } else { 1 };
                            (uid, rng.below(STEPS + 1), rng.below(2) == 0)
                        };
                        one_client(&bus, uid, &device, &token, kill_at, mid_call);
                    });
                }
            });
            let counts = wait_for_sessions(&bus, 1).await;
            if baseline.is_none() {
                baseline = Some((
                    counts,
                    pool_usage(&mut peer),
                    open_fds(pid),
                    status_kib(pid, "VmRSS:"),
                    kernel_verbs_objects(provider),
                ));
            }
        }
        let (counts, pools, fds, rss, kernel) = baseline.unwrap();

        let after = wait_for_sessions(&bus, 1).await;
        assert_eq!(after, counts, "objects after the churn vs the baseline");
        assert_eq!(pool_usage(&mut peer), pools, "pool usage");
        assert_eq!(open_fds(pid), fds, "the daemon's open descriptors");
        assert_eq!(
            kernel_verbs_objects(provider),
            kernel,
            "the kernel's verbs objects"
        );
        let grown = status_kib(pid, "VmRSS:").saturating_sub(rss) * 1024;
        println!(
            "churn: {clients} clients on {provider}; daemon RSS {} KiB after the warm-up, \
             grew by {} KiB (bound {} KiB)",
            rss,
            grown / 1024,
            RSS_GROWTH_BOUND / 1024
        );
        assert!(grown < RSS_GROWTH_BOUND, "RSS grew by {grown} bytes");

        // The daemon still serves, and the shared region is intact.
        assert_eq!(peer.ok("read 0 0 5"), "churn");
        let counts = object_counts(&bus).await;
        assert_eq!(counts["sessions"], 1);
    }
}
