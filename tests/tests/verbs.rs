//! Unmodified verbs programs — the distribution's own ibverbs-utils binaries — run through
//! rdmad's libibverbs with `rdmactl exec`, as an unprivileged user.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use rdmad_tests::daemon::{
    device_and_gid, object_counts, rdmactl, rdmactl_ok, start_on, wait_for_sessions,
};
use rdmad_tests::NOBODY;
use serde_json::Value;

/// A second unprivileged user (`daemon`), the other tenant.
const DAEMON_USER: u32 = 1;

/// Builds one of the C programs in `tests/verbs/` against the distribution's
/// libibverbs-dev, into a directory any user may run it from.
fn c_program(name: &str) -> (tempfile::TempDir, PathBuf) {
    c_program_at(&format!("tests/verbs/{name}.c"))
}

/// Builds the C program at `path` (in the repository) the same way.
fn c_program_at(path: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("rdmad-verbs-")
        .tempdir()
        .expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let source = rdmad_tests::repo_root().join(path);
    let name = source.file_stem().expect("a file name").to_owned();
    let binary = dir.path().join(name);
    let out = std::process::Command::new("cc")
        .args(["-Wall", "-Wextra", "-Werror", "-O1", "-o"])
        .arg(&binary)
        .arg(&source)
        .arg("-libverbs")
        .output()
        .expect("cc must be installed");
    assert!(
        out.status.success(),
        "cc {}: {}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    (dir, binary)
}

/// Kills process `pid` (SIGKILL) if it still runs `limit` after this is made and before it
/// is dropped: a program that hangs then fails its test with what it printed, instead of
/// holding the test (and the VM tier) until an outer time-out that shows nothing.
struct Watchdog(Option<std::sync::mpsc::Sender<()>>);

impl Watchdog {
    fn new(pid: u32, limit: std::time::Duration) -> Watchdog {
        let (done, finished) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = finished.recv_timeout(limit) {
                eprintln!("watchdog: process {pid} still runs after {limit:?}: killing it");
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        });
        Watchdog(Some(done))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // The process is waited for by now: its pid must not be killed once reused.
        if let Some(done) = self.0.take() {
            // The thread is gone only once it has killed: nothing to tell it then.
            let _ = done.send(());
        }
    }
}

/// The standard outputs of a client and its server, once both succeeded; if either failed,
/// the failure shows what both printed (a server that failed first leaves its client only a
/// refused or broken connection to report).
fn both_stdouts(
    client: &std::process::Output,
    server: &std::process::Output,
    what: &str,
) -> (String, String) {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(
        client.status.success() && server.status.success(),
        "{what}: client {}, server {}\nclient stdout:\n{}\nclient stderr:\n{}\n\
         server stdout:\n{}\nserver stderr:\n{}",
        client.status,
        server.status,
        text(&client.stdout),
        text(&client.stderr),
        text(&server.stdout),
        text(&server.stderr)
    );
    (text(&client.stdout), text(&server.stdout))
}

fn stdout(out: &std::process::Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("utf-8 output")
}

mod bodies {
    use super::*;

    /// `ibv_devices` and `ibv_devinfo -v` show exactly the devices rdmad serves, with the
    /// GUID, firmware, port and GID table rdmad reports; opening a device is a session of
    /// the program's user, gone when the program exits.
    pub async fn ibv_devices_and_ibv_devinfo_show_what_rdmad_serves(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, daemon) = start_on(provider, "").await;
        let devices: Value =
            serde_json::from_str(&rdmactl_ok(&bus, Some(NOBODY), &["-j", "dev"])).unwrap();
        let devices = devices.as_array().expect("device list");
        assert!(!devices.is_empty(), "{devices:?}");

        let listed = stdout(
            &rdmactl(&bus, Some(NOBODY), &["exec", "--", "ibv_devices"]),
            "ibv_devices",
        );
        let rows: Vec<Vec<&str>> = listed
            .lines()
            .skip(2)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(rows.len(), devices.len(), "ibv_devices printed:\n{listed}");
        for (row, device) in rows.iter().zip(devices) {
            assert_eq!(row[0], device["ifname"], "ibv_devices printed:\n{listed}");
            // ibv_devices prints the GUID as 16 hex digits, rdmad as xxxx:xxxx:xxxx:xxxx.
            let guid = device["node_guid"].as_str().unwrap().replace(':', "");
            assert_eq!(row[1], guid, "ibv_devices printed:\n{listed}");
        }

        let name = devices[0]["ifname"].as_str().unwrap();
        let info = stdout(
            &rdmactl(
                &bus,
                Some(NOBODY),
                &["exec", "--", "ibv_devinfo", "-v", "-d", name],
            ),
            "ibv_devinfo",
        );
        assert!(info.contains(&format!("hca_id:\t{name}\n")), "{info}");
        let guid = devices[0]["node_guid"].as_str().unwrap();
        assert!(
            info.contains(&format!("node_guid:\t\t\t{guid}\n")),
            "{info}"
        );
        let ports = devices[0]["ports"].as_array().unwrap();
        assert!(
            info.contains(&format!("phys_port_cnt:\t\t\t{}\n", ports.len())),
            "{info}"
        );
        if ports[0]["state"] == "active" {
            assert!(info.contains("state:\t\t\tPORT_ACTIVE (4)"), "{info}");
        }
        for gid in devices[0]["gids"].as_array().unwrap() {
            assert!(
                info.contains(gid["gid"].as_str().unwrap())
                    || info.contains(&gid_hex(gid["gid"].as_str().unwrap())),
                "GID {gid} missing from:\n{info}"
            );
        }
        // ibv_devinfo opened the device — a session of its user — and closed it on exit.
        let log = daemon.wait_for_log("session opened", 1).await;
        let opened = log.lines().find(|l| l.contains("session opened")).unwrap();
        assert!(opened.contains(&format!("uid={NOBODY}")), "{opened}");
        wait_for_sessions(&bus, 0).await;
    }

    /// An unmodified `ibv_rc_pingpong` on both ends — the server as one user, the client as
    /// another, each through rdmad (or the server native on the kernel device, `native`) —
    /// exchanges and checks (`-c`) its messages; afterwards nothing of either is left.
    pub async fn ibv_rc_pingpong_through_rdmad(provider: &str) {
        pingpong(provider, false, false).await
    }

    /// The same, both ends sleeping on completion channels (`-e`: `ibv_req_notify_cq`,
    /// `ibv_get_cq_event`, `ibv_ack_cq_events`) instead of polling.
    pub async fn ibv_rc_pingpong_with_completion_events(provider: &str) {
        pingpong(provider, false, true).await
    }

    pub async fn ibv_rc_pingpong_against_a_native_peer(provider: &str) {
        assert_eq!(provider, "verbs", "a native peer needs a kernel device");
        pingpong(provider, true, false).await
    }

    /// perftest, unmodified, both ends through rdmad as two users: the SEND tests, and
    /// the RDMA WRITE, READ and atomic tests, whose server hands its peer an rkey before
    /// either QP is connected; the latency tests also with inline data (`-I`). Each
    /// completes its run and prints its result line, and nothing of either is left in
    /// rdmad.
    pub async fn perftest_through_rdmad(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _daemon) = start_on(provider, "").await;
        let before = object_counts(&bus).await;
        for (tool, size, iters, inline) in [
            ("ib_send_lat", "64", "200", None),
            ("ib_send_lat", "64", "200", Some("64")),
            ("ib_send_bw", "65536", "200", None),
            ("ib_write_lat", "64", "200", None),
            ("ib_write_lat", "64", "200", Some("128")),
            ("ib_write_bw", "65536", "200", None),
            ("ib_read_bw", "65536", "200", None),
            ("ib_atomic_bw", "8", "200", None),
        ] {
            let mut args = vec!["-s", size, "-n", iters];
            if let Some(bytes) = inline {
                args.extend(["-I", bytes]);
            }
            perftest(&bus, [Side::Rdmad, Side::Rdmad], tool, &args).await;
        }
        wait_for_sessions(&bus, 0).await;
        let after = object_counts(&bus).await;
        for kind in ["qps", "regions", "mrs", "pds", "sessions"] {
            assert_eq!(after[kind], before[kind], "{kind}: {before:?} -> {after:?}");
        }
    }

    /// perftest with one end on the kernel device and the other through rdmad, both ways:
    /// the native end reaches memory through the rkey rdmad handed out, and the other way
    /// round (VM tier: the host has no kernel device).
    pub async fn perftest_against_a_native_peer(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        assert_eq!(provider, "verbs", "a native peer needs a kernel device");
        let (bus, _daemon) = start_on(provider, "").await;
        let before = object_counts(&bus).await;
        for sides in [[Side::Native, Side::Rdmad], [Side::Rdmad, Side::Native]] {
            for tool in ["ib_write_bw", "ib_read_bw"] {
                perftest(&bus, sides, tool, &["-s", "65536", "-n", "100"]).await;
            }
        }
        wait_for_sessions(&bus, 0).await;
        let after = object_counts(&bus).await;
        for kind in ["qps", "regions", "mrs", "pds", "sessions"] {
            assert_eq!(after[kind], before[kind], "{kind}: {before:?} -> {after:?}");
        }
    }

    /// How one end of a perftest run runs.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Side {
        /// Through rdmad (`rdmactl exec`), the server as `nobody`, the client as `daemon`.
        Rdmad,
        /// On the kernel device, as root.
        Native,
    }

    /// Runs perftest's `tool` with `args`, its server and client as `sides` say, on the
    /// first device rdmad serves, and checks both print their result line.
    async fn perftest(
        bus: &rdmad_tests::bus::PrivateBus,
        sides: [Side; 2],
        tool: &str,
        args: &[&str],
    ) {
        let (device, gid) = device_and_gid(bus);
        let port = free_port().to_string();
        let mut common = vec![tool, "-d", &device, "-x", &gid, "-p", &port, "-F"];
        common.extend(args);
        let command = |side: Side, uid: u32, client: bool| {
            let mut command = match side {
                Side::Rdmad => {
                    let mut c =
                        rdmad_tests::daemon::as_user(Some(uid), &rdmad_tests::binary("rdmactl"));
                    c.args(["exec", "--"])
                        .args(&common)
                        .env("RDMAD_BUS_ADDRESS", &bus.address);
                    c
                }
                Side::Native => {
                    let mut c = std::process::Command::new(tool);
                    c.args(&common[1..]);
                    c
                }
            };
            if client {
                command.arg("127.0.0.1");
            }
            command
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            command
        };
        let server = command(sides[0], NOBODY, false)
            .spawn()
            .expect("start the perftest server");
        rdmad_tests::wait_for_listener(port.parse().unwrap()).await;
        let client = command(sides[1], DAEMON_USER, true)
            .output()
            .expect("run the perftest client");
        let server = server.wait_with_output().expect("server output");
        let (size, iters) = (args[1], args[3]);
        let (client, server) = both_stdouts(&client, &server, &format!("{tool} ({sides:?})"));
        for (printed, who) in [(client, "client"), (server, "server")] {
            let result = printed.lines().find(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() >= 4 && f[0] == size && f[1] == iters
            });
            assert!(
                result.is_some(),
                "{tool} {who} ({sides:?}) printed no result line:\n{printed}"
            );
        }
    }

    /// The repository's C example (`verbs/examples/rdma-write.c`, built against the
    /// distribution's libibverbs-dev), unmodified, as two users through rdmad: the client
    /// RDMA-WRITEs into the server's buffer by the address and rkey the server sent it, the
    /// server checks every byte, for several sizes, busy-polling and with completion events.
    pub async fn the_c_example_writes_through_rdmad(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _daemon) = start_on(provider, "").await;
        let before = object_counts(&bus).await;
        let (device, gid) = device_and_gid(&bus);
        let (_dir, example) = c_program_at("verbs/examples/rdma-write.c");
        let example = example.to_str().unwrap();
        for (size, iters, events) in [
            ("1", "3", false),
            ("65536", "5", true),
            ("1048576", "2", false),
        ] {
            let port = free_port().to_string();
            let mut args = vec![
                "exec", "--", example, "-d", &device, "-g", &gid, "-p", &port, "-s", size, "-n",
                iters,
            ];
            if events {
                args.push("-e");
            }
            let server = rdmad_tests::daemon::spawn_rdmactl(&bus, Some(NOBODY), &args);
            rdmad_tests::wait_for_listener(port.parse().unwrap()).await;
            args.push("127.0.0.1");
            let client = rdmactl(&bus, Some(DAEMON_USER), &args);
            let server = server.wait_with_output().expect("server output");
            let (client, server) = both_stdouts(
                &client,
                &server,
                &format!("rdma-write of {size} bytes (events: {events})"),
            );
            assert_eq!(
                server,
                format!(
                    "rdma-write: server: {size} bytes written by the peer checked ({iters} \
                     iterations)\n"
                ),
                "events: {events}"
            );
            assert_eq!(
                client,
                format!("rdma-write: client: {size} bytes written {iters} times\n"),
                "events: {events}"
            );
        }
        wait_for_sessions(&bus, 0).await;
        let after = object_counts(&bus).await;
        for kind in ["qps", "regions", "mrs", "pds", "sessions"] {
            assert_eq!(after[kind], before[kind], "{kind}: {before:?} -> {after:?}");
        }
    }

    /// What programs rely on beyond the happy path, each a C program of `tests/verbs/`
    /// printing one line per check, run as `nobody` through rdmad, and on rxe0 natively
    /// first: rdmad's answers must be the device's, line for line.
    /// - `qp_error`: `ibv_modify_qp` to ERR flushes what the queue pair holds (receives of
    ///   a connected QP, receives posted in INIT) with `IBV_WC_WR_FLUSH_ERR`, in order, and
    ///   so is a send posted after.
    /// - `events`: a CQ armed before its QP exists raises its event; a non-blocking
    ///   `channel->fd` answers `EAGAIN` and wakes `poll(2)`; a QP whose send and receive CQs
    ///   are on two channels raises each channel's event, and a receive not the send CQ's.
    /// - `inline`: `IBV_SEND_INLINE` from the unregistered stack, overwritten at once,
    ///   through a send queue of 8 reused five times over.
    pub async fn verbs_semantics_match_the_device(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _daemon) = start_on(provider, "").await;
        let before = object_counts(&bus).await;
        let (device, gid) = device_and_gid(&bus);
        for (name, checks) in [("qp_error", 7), ("events", 12), ("inline", 2)] {
            let (_dir, program) = c_program(name);
            let program = program.to_str().unwrap();
            let through_rdmad = stdout(
                &rdmactl(&bus, Some(NOBODY), &["exec", "--", program, &device, &gid]),
                &format!("{name} through rdmad"),
            );
            assert_eq!(through_rdmad.lines().count(), checks, "{through_rdmad}");
            assert!(!through_rdmad.contains("FAIL"), "{through_rdmad}");
            if provider == "verbs" {
                let native = std::process::Command::new(program)
                    .args([&device, &gid])
                    .output()
                    .expect("run natively");
                assert_eq!(stdout(&native, &format!("{name} natively")), through_rdmad);
            }
        }
        wait_for_sessions(&bus, 0).await;
        let after = object_counts(&bus).await;
        for kind in ["qps", "cqs", "regions", "mrs", "pds", "sessions"] {
            assert_eq!(after[kind], before[kind], "{kind}: {before:?} -> {after:?}");
        }
    }

    /// A broken or hostile verbs program (`tests/verbs/hostile.c`, as `nobody`) hands the
    /// verbs pointers that are not theirs, posts with keys it does not own — another
    /// user's program's rkey among them, through its own connection — scribbles over the
    /// library's rings with requests in flight and exits without cleaning up, while another
    /// user's `ibv_rc_pingpong` pair runs beside it: each misuse is an error value, the
    /// other program's memory is untouched,
    /// the neighbour keeps exchanging (and checking) its messages during and after, rdmad
    /// logs the broken ring with the offender's session, and once both are gone rdmad's
    /// object counts — and on rxe0 the kernel's — are back to their baseline.
    pub async fn a_hostile_verbs_program_harms_only_itself(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, daemon) = start_on(provider, "").await;
        let before = object_counts(&bus).await;
        let kernel_before = rdmad_tests::kernel_verbs_objects(provider);
        let (device, gid) = device_and_gid(&bus);
        let (_dir, hostile) = c_program("hostile");

        let port = free_port().to_string();
        let neighbour = |extra: Option<&str>| {
            let mut command =
                rdmad_tests::daemon::as_user(Some(DAEMON_USER), &rdmad_tests::binary("rdmactl"));
            command
                .args(["exec", "--", "ibv_rc_pingpong", "-d", &device, "-g", &gid])
                .args(["-p", &port, "-n", "1000000000", "-c"])
                .args(extra)
                .env("RDMAD_BUS_ADDRESS", &bus.address)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped());
            rdmad_tests::KillOnDrop(command.spawn().expect("start rdmactl exec"))
        };
        let mut server = neighbour(None);
        rdmad_tests::wait_for_listener(port.parse().unwrap()).await;
        let mut client = neighbour(Some("127.0.0.1"));
        let neighbour_progress = || async {
            let qps: Value =
                serde_json::from_str(&rdmactl_ok(&bus, Some(DAEMON_USER), &["-j", "qp"])).unwrap();
            qps.as_array()
                .unwrap()
                .iter()
                .map(|q| q["completed"].as_u64().unwrap_or(0))
                .sum::<u64>()
        };
        let deadline = std::time::Instant::now() + rdmad_tests::TIMEOUT;
        while neighbour_progress().await == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the neighbour never ran"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }

        // A second program of the neighbour's user, whose registered memory the hostile
        // program is told the rkey and address of.
        let mut victim =
            rdmad_tests::daemon::as_user(Some(DAEMON_USER), &rdmad_tests::binary("rdmactl"))
                .args([
                    "exec",
                    "--",
                    hostile.to_str().unwrap(),
                    &device,
                    &gid,
                    "victim",
                ])
                .env("RDMAD_BUS_ADDRESS", &bus.address)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start the victim");
        let victim_watchdog = Watchdog::new(victim.id(), 2 * rdmad_tests::TIMEOUT);
        let mut victim_out = std::io::BufReader::new(victim.stdout.take().unwrap());
        let mut line = String::new();
        std::io::BufRead::read_line(&mut victim_out, &mut line).expect("the victim's rkey");
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert!(fields.len() == 3 && fields[0] == "victim", "{line:?}");

        let attacker = rdmad_tests::daemon::as_user(Some(NOBODY), &rdmad_tests::binary("rdmactl"))
            .args(["exec", "--", hostile.to_str().unwrap(), &device, &gid])
            .args([fields[1], fields[2]])
            .env("RDMAD_BUS_ADDRESS", &bus.address)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start the hostile program");
        let attacker_watchdog = Watchdog::new(attacker.id(), rdmad_tests::TIMEOUT);
        let out = attacker
            .wait_with_output()
            .expect("the hostile program's output");
        drop(attacker_watchdog);
        let printed = stdout(&out, "hostile");
        assert!(!printed.contains("FAIL"), "{printed}");
        assert_eq!(
            printed.lines().filter(|l| l.starts_with("ok ")).count(),
            18,
            "{printed}"
        );
        assert!(
            printed
                .contains("ok an RDMA WRITE with another program's rkey is a remote access error"),
            "{printed}"
        );
        std::io::Write::write_all(victim.stdin.as_mut().unwrap(), b"done\n").unwrap();
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut victim_out, &mut rest).unwrap();
        assert!(victim.wait().unwrap().success(), "{rest}");
        drop(victim_watchdog);
        assert_eq!(rest, "ok the victim's memory is as it was\n");
        let scribbled: u64 = printed
            .lines()
            .find_map(|l| {
                l.strip_prefix("scribbled ")?
                    .strip_suffix(" bytes")?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no scribbling:\n{printed}"));
        assert!(scribbled > 0, "{printed}");

        // The neighbour goes on: more messages after the hostile program is gone.
        let after_attack = neighbour_progress().await;
        let deadline = std::time::Instant::now() + rdmad_tests::TIMEOUT;
        while neighbour_progress().await <= after_attack {
            assert!(
                std::time::Instant::now() < deadline,
                "the neighbour stopped at {after_attack} completions"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        for (who, child) in [("server", &mut server), ("client", &mut client)] {
            assert!(
                child.try_wait().unwrap().is_none(),
                "the neighbour's {who} stopped (a message failed its check?)"
            );
        }

        // rdmad names the offender's session for the broken ring.
        let log = daemon.wait_for_log("submission tail out of range", 1).await;
        let session = log
            .lines()
            .find(|l| l.contains("session opened") && l.contains(&format!("uid={NOBODY}")))
            .and_then(|l| l.split_whitespace().find(|f| f.starts_with("session=")))
            .expect("the hostile program's session")
            .to_owned();
        assert!(
            log.lines()
                .any(|l| l.contains("submission tail out of range") && l.contains(&session)),
            "{log}"
        );

        for child in [&mut client, &mut server] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        wait_for_sessions(&bus, 0).await;
        let after = object_counts(&bus).await;
        for kind in ["qps", "cqs", "regions", "mrs", "pds", "sessions"] {
            assert_eq!(after[kind], before[kind], "{kind}: {before:?} -> {after:?}");
        }
        assert_eq!(
            rdmad_tests::kernel_verbs_objects(provider),
            kernel_before,
            "the kernel's verbs objects"
        );
    }

    /// Two unmodified programs exchanging messages show in `rdmactl session` and `rdmactl
    /// qp` under their own command name and pid; SIGKILLed mid-transfer, they leave
    /// nothing behind in rdmad.
    pub async fn a_verbs_program_killed_mid_transfer_leaves_nothing(provider: &str) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _daemon) = start_on(provider, "").await;
        let before = object_counts(&bus).await;
        let (device, gid) = device_and_gid(&bus);
        let port = free_port().to_string();
        let args = [
            "exec",
            "--",
            "ibv_rc_pingpong",
            "-d",
            &device,
            "-g",
            &gid,
            "-p",
            &port,
            "-n",
            "1000000000",
        ];
        let spawn = |uid: u32, extra: Option<&str>| {
            let mut command =
                rdmad_tests::daemon::as_user(Some(uid), &rdmad_tests::binary("rdmactl"));
            command
                .args(args)
                .args(extra)
                .env("RDMAD_BUS_ADDRESS", &bus.address)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            rdmad_tests::KillOnDrop(command.spawn().expect("start rdmactl exec"))
        };
        let mut server = spawn(NOBODY, None);
        rdmad_tests::wait_for_listener(port.parse().unwrap()).await;
        let mut client = spawn(DAEMON_USER, Some("127.0.0.1"));
        // Until both QPs move messages.
        let deadline = std::time::Instant::now() + rdmad_tests::TIMEOUT;
        let qps = loop {
            let qps: Value = serde_json::from_str(&rdmactl_ok(&bus, None, &["-j", "qp"])).unwrap();
            let moving = qps
                .as_array()
                .unwrap()
                .iter()
                .filter(|q| q["state"] == "rts" && q["completed"].as_u64().unwrap_or(0) > 0);
            if moving.count() == 2 {
                break qps;
            }
            assert!(std::time::Instant::now() < deadline, "no traffic: {qps}");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        };
        // setpriv and rdmactl exec replace themselves: the child is the program.
        let pids = [server.id(), client.id()];
        for q in qps.as_array().unwrap() {
            assert_eq!(q["command"], "ibv_rc_pingpong", "{q}");
            assert!(
                pids.contains(&(q["pid"].as_u64().unwrap() as u32)),
                "{q} {pids:?}"
            );
        }
        let sessions: Value =
            serde_json::from_str(&rdmactl_ok(&bus, None, &["-j", "session"])).unwrap();
        for s in sessions.as_array().unwrap() {
            assert_eq!(s["command"], "ibv_rc_pingpong", "{s}");
            // The library calls on a direct connection, opened over its bus connection.
            let connection = s["bus_name"].as_str().unwrap();
            assert!(connection.contains("/direct"), "{s}");
        }
        client.kill().unwrap();
        client.wait().unwrap();
        server.kill().unwrap();
        server.wait().unwrap();
        wait_for_sessions(&bus, 0).await;
        let after = object_counts(&bus).await;
        for kind in ["qps", "regions", "mrs", "sessions"] {
            assert_eq!(after[kind], before[kind], "{kind}: {before:?} -> {after:?}");
        }
    }

    async fn pingpong(provider: &str, native_server: bool, events: bool) {
        let _alone = rdmad_tests::ALONE.lock().await;
        let (bus, _daemon) = start_on(provider, "").await;
        let before = object_counts(&bus).await;
        let (device, gid) = device_and_gid(&bus);
        let port = free_port();
        let port = port.to_string();
        let mut args = vec![
            "ibv_rc_pingpong",
            "-d",
            &device,
            "-g",
            &gid,
            "-p",
            &port,
            "-n",
            "50",
            "-c",
        ];
        if events {
            args.push("-e");
        }
        let server = if native_server {
            std::process::Command::new(args[0])
                .args(&args[1..])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start ibv_rc_pingpong")
        } else {
            let mut exec = vec!["exec", "--"];
            exec.extend(&args);
            rdmad_tests::daemon::as_user(Some(NOBODY), &rdmad_tests::binary("rdmactl"))
                .args(&exec)
                .env("RDMAD_BUS_ADDRESS", &bus.address)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start rdmactl exec")
        };
        rdmad_tests::wait_for_listener(port.parse().unwrap()).await;
        let mut exec = vec!["exec", "--"];
        exec.extend(&args);
        exec.push("127.0.0.1");
        let client = rdmactl(&bus, Some(DAEMON_USER), &exec);
        let server = server.wait_with_output().expect("server output");
        let (client, server) = both_stdouts(&client, &server, "ibv_rc_pingpong");
        for (printed, who) in [(client, "client"), (server, "server")] {
            assert!(printed.contains("50 iters in"), "{who}:\n{printed}");
        }
        wait_for_sessions(&bus, 0).await;
        let after = object_counts(&bus).await;
        for kind in ["qps", "regions", "mrs", "sessions"] {
            assert_eq!(after[kind], before[kind], "{kind}: {before:?} -> {after:?}");
        }
    }

    /// A port nothing listens on now (the kernel's pick).
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }
    /// `fe80::1` as ibv_devinfo prints a GID: eight groups of four hex digits.
    fn gid_hex(gid: &str) -> String {
        let address: std::net::Ipv6Addr = gid.parse().expect("GID in IPv6 notation");
        address
            .segments()
            .iter()
            .map(|s| format!("{s:04x}"))
            .collect::<Vec<_>>()
            .join(":")
    }
}

rdmad::on_both_providers!(async
    ibv_devices_and_ibv_devinfo_show_what_rdmad_serves
        / rxe_ibv_devices_and_ibv_devinfo_show_what_rdmad_serves,
    ibv_rc_pingpong_through_rdmad / rxe_ibv_rc_pingpong_through_rdmad,
    ibv_rc_pingpong_with_completion_events / rxe_ibv_rc_pingpong_with_completion_events,
    perftest_through_rdmad / rxe_perftest_through_rdmad,
    a_verbs_program_killed_mid_transfer_leaves_nothing
        / rxe_a_verbs_program_killed_mid_transfer_leaves_nothing,
    a_hostile_verbs_program_harms_only_itself / rxe_a_hostile_verbs_program_harms_only_itself,
    the_c_example_writes_through_rdmad / rxe_the_c_example_writes_through_rdmad,
    verbs_semantics_match_the_device / rxe_verbs_semantics_match_the_device,
);

/// One end through rdmad, the other native on rxe0 (VM tier only: the host has no kernel
/// device).
#[tokio::test(flavor = "multi_thread")]
async fn rxe_ibv_rc_pingpong_against_a_native_peer() {
    bodies::ibv_rc_pingpong_against_a_native_peer("verbs").await
}

/// perftest with one end native on rxe0, the other through rdmad (VM tier only).
#[tokio::test(flavor = "multi_thread")]
async fn rxe_perftest_against_a_native_peer() {
    bodies::perftest_against_a_native_peer("verbs").await
}

/// `ibv_reg_mr` of the program's own memory — heap (unaligned, with a neighbour on the same
/// page), stack, page-aligned — keeps its contents through registration and
/// deregistration and stays the program's memory; another thread writing on the same page
/// while it is registered and deregistered 200 times loses none of its writes (they wait
/// for each move); bad buffers and flags get libibverbs's errors; a registration past the
/// user's `registered_bytes` is NULL with `ENOMEM` and the daemon's reason; everything is
/// gone when the program exits.
#[tokio::test(flavor = "multi_thread")]
async fn ibv_reg_mr_registers_the_programs_own_memory_within_its_quota() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let (bus, _daemon) = start_on(
        "loopback",
        "[[pool]]\nname = \"default\"\ncapacity = \"256MiB\"\ngranularity = \"4KiB\"\n\
         [quota.default]\nregistered_bytes = \"8MiB\"\n",
    )
    .await;
    let before = object_counts(&bus).await;
    let (_dir, program) = c_program("reg_mr");
    let program = program.to_str().unwrap();
    let out = rdmactl(&bus, Some(NOBODY), &["exec", "--", program, "16777216"]);
    let printed = stdout(&out, "reg_mr");
    assert!(printed.ends_with("0 failed\n"), "{printed}");
    assert!(
        printed.contains("quota Cannot allocate memory"),
        "{printed}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rdmad-verbs: ibv_reg_mr: ") && stderr.contains("registered_bytes"),
        "the daemon's refusal should reach the program's stderr:\n{stderr}"
    );
    wait_for_sessions(&bus, 0).await;
    let after = object_counts(&bus).await;
    for kind in ["regions", "mrs", "sessions"] {
        assert_eq!(after[kind], before[kind], "{kind}: {before:?} -> {after:?}");
    }
}

/// A program whose rdmad goes away (stopped, crashed, restarted) learns it the way a
/// program learns its device died: `IBV_EVENT_DEVICE_FATAL` from `ibv_get_async_event`.
#[tokio::test(flavor = "multi_thread")]
async fn a_program_is_told_when_rdmad_goes_away() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let (bus, mut daemon) = start_on("loopback", "").await;
    let (_dir, program) = c_program("async_event");
    let child = rdmad_tests::daemon::as_user(Some(NOBODY), &rdmad_tests::binary("rdmactl"))
        .args(["exec", "--", program.to_str().unwrap(), "loopback0"])
        .env("RDMAD_BUS_ADDRESS", &bus.address)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start async_event");
    daemon.wait_for_log("session opened", 1).await;
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(daemon.wait().await.success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .expect("async_event output");
    let printed = stdout(&out, "async_event");
    // `ibv_event_type_str(IBV_EVENT_DEVICE_FATAL)`.
    assert_eq!(printed, "opened\nevent local catastrophic error\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Left the bus, or (if it stopped before the watch began) is not on it.
    assert!(stderr.contains("rdmad-verbs: rdmad "), "{stderr}");
}

/// A program that cannot reach rdmad is told why, once, and gets no devices.
#[tokio::test]
async fn a_program_without_rdmad_is_told_why() {
    let (bus, _daemon) = start_on("loopback", "").await;
    let out = rdmactl(
        &bus,
        Some(NOBODY),
        &[
            "--bus",
            "unix:path=/nonexistent/bus",
            "exec",
            "--",
            "ibv_devices",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("rdmad-verbs: cannot connect to the unix:path=/nonexistent/bus bus"),
        "{stderr}"
    );
    assert!(stderr.contains("Failed to get IB devices list"), "{stderr}");
}

/// `rdmactl exec` of a program that does not exist fails as env(1) does.
#[tokio::test]
async fn exec_of_a_missing_program_says_so() {
    let (bus, _daemon) = start_on("loopback", "").await;
    let out = rdmactl(&bus, Some(NOBODY), &["exec", "--", "/nonexistent/program"]);
    assert_eq!(out.status.code(), Some(127));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("rdmactl exec: cannot run /nonexistent/program: No such file"),
        "{stderr}"
    );
}

/// `rdmactl exec` as a user who cannot read rdmad's libibverbs (a checkout in a private
/// directory) says so, naming the file, instead of calling it missing.
#[tokio::test]
async fn exec_with_a_library_the_user_cannot_read_says_so() {
    let (bus, _daemon) = start_on("loopback", "").await;
    let private = tempfile::tempdir().unwrap();
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let library = private.path().join("libibverbs.so.1");
    std::fs::write(&library, b"").unwrap();
    let out = rdmad_tests::daemon::as_user(Some(NOBODY), &rdmad_tests::binary("rdmactl"))
        .args(["exec", "--", "true"])
        .env("RDMAD_BUS_ADDRESS", &bus.address)
        .env("RDMAD_VERBS_DIR", private.path())
        .output()
        .expect("run rdmactl");
    assert_eq!(out.status.code(), Some(126));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("this user cannot read it") && stderr.contains(&*library.to_string_lossy()),
        "{stderr}"
    );
}
