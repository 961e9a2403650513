//! Two hosts: the VM tier's two guests, each its own kernel with its own `rxe0`, joined by
//! a wire that exists only between them (`tests/vm/run --peer`; scripts/test-vm runs this
//! binary that way). The test runs in one guest; the other, the peer, runs what the test
//! asks through its agent (`rdmad_tests::peer`). RDMA traffic crosses the wire as RoCE v2
//! between two kernels.
//!
//! Every test is named `rxe_*`: none can run on the host, which has neither a kernel RDMA
//! device nor a peer.

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;

use rdmad_tests::across::{assert_back, assert_both_back, connected_across, peer};
use rdmad_tests::bus::PrivateBus;
use rdmad_tests::client::{assert_completion, Client};
use rdmad_tests::daemon::{
    device_and_gid, object_counts, spawn_rdmactl, start_on, wait_for_sessions,
};
use rdmad_tests::peer::{Output, Peer, PeerProgram, PeerRdmad};
use rdmad_tests::NOBODY;

/// The index of `rxe0`'s GID for `address` (an IPv4 address's is `::ffff:a.b.c.d`), from
/// the GID table a shell on that host printed (`index gid` lines, as sysfs spells GIDs).
fn gid_index(table: &str, address: &str) -> String {
    let ip: std::net::IpAddr = address.parse().expect("an IP address");
    let v6 = match ip {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        std::net::IpAddr::V6(v6) => v6,
    };
    let spelled = v6
        .segments()
        .iter()
        .map(|s| format!("{s:04x}"))
        .collect::<Vec<_>>()
        .join(":");
    table
        .lines()
        .find_map(|l| {
            let (index, gid) = l.split_once(' ')?;
            (gid.trim() == spelled).then(|| index.to_owned())
        })
        .unwrap_or_else(|| panic!("no GID {spelled} for {address} in:\n{table}"))
}

/// The shell command printing rxe0's GID table as `index gid` lines. One `grep` reads
/// every entry: rxe's table has 1,024, and a process per entry (`cat` in a loop) took
/// 2–5 minutes in an emulated guest.
const GID_TABLE: &str = "cd /sys/class/infiniband/rxe0/ports/1/gids && grep -H . * | sed 's/:/ /'";

/// This host's rxe0 GID table, as `index gid` lines.
fn local_gid_table() -> String {
    let local = std::process::Command::new("sh")
        .args(["-c", GID_TABLE])
        .output()
        .expect("read the local GID table");
    String::from_utf8_lossy(&local.stdout).into_owned()
}

/// This host's and the peer's rxe0 GID index for their wire address.
fn wire_gids(peer: &Peer) -> (String, String) {
    let local = local_gid_table();
    let remote = peer.run(None, &["sh", "-c", GID_TABLE], &[]);
    assert!(remote.success(), "the peer's GID table: {remote:?}");
    (
        gid_index(&local, &peer.own_address),
        gid_index(&remote.stdout, &peer.address),
    )
}

fn assert_ran(out: &Output, what: &str) {
    assert!(
        out.success(),
        "{what} on the peer failed (status {}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        out.stdout,
        out.stderr
    );
}

/// The output of a program this host runs through its rdmad (`rdmactl exec`): one that
/// has not ended within [`rdmad_tests::peer::PROGRAM_LIMIT`] (as a program on the peer) fails the test showing
/// where it waits.
fn here_within(program: std::process::Child, name: &str) -> std::process::Output {
    rdmad_tests::process::output_within(
        program,
        rdmad_tests::peer::PROGRAM_LIMIT,
        &format!("{name} through this host's rdmad"),
    )
}

/// The output of the server this host runs through its rdmad once the peer's client has
/// ended. A client that failed may leave the server waiting for it forever, so then the
/// server gets [`rdmad_tests::TIMEOUT`] to end and, if it does not, the failure shows what
/// the client printed before where the server waits.
fn here_serving(server: std::process::Child, name: &str, client: &Output) -> std::process::Output {
    if client.success() {
        return here_within(server, name);
    }
    rdmad_tests::process::output_within(
        server,
        rdmad_tests::TIMEOUT,
        &format!(
            "{name} through this host's rdmad, serving the peer's client, which failed \
             (status {}):\nits stdout:\n{}\nits stderr:\n{}\n-- and this host's server",
            client.status, client.stdout, client.stderr
        ),
    )
}

fn assert_local(out: &std::process::Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} here failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The wire itself: `ibv_rc_pingpong` on the two kernels' own devices, no rdmad, both
/// ways round — RC traffic crosses the wire and the users' programs work across it.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_native_programs_talk_across_the_wire() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let (here, there) = wire_gids(&peer);
    for (round, port) in [("peer serves", "18515"), ("this host serves", "18516")] {
        let common = ["-d", "rxe0", "-p", port, "-n", "50", "-c"];
        let (local_out, remote_out) = if round == "peer serves" {
            let server = peer.spawn(
                None,
                &[&["ibv_rc_pingpong", "-g", &there][..], &common].concat(),
                &[],
            );
            peer.wait_for_listener(port.parse().unwrap());
            let client = std::process::Command::new("ibv_rc_pingpong")
                .args(["-g", &here])
                .args(common)
                .arg(&peer.address)
                .output()
                .expect("run ibv_rc_pingpong");
            (client, server.wait())
        } else {
            let server = std::process::Command::new("ibv_rc_pingpong")
                .args(["-g", &here])
                .args(common)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start ibv_rc_pingpong");
            rdmad_tests::wait_for_listener(port.parse().unwrap()).await;
            let client = peer.run(
                None,
                &[
                    &["ibv_rc_pingpong", "-g", &there][..],
                    &common,
                    &[&peer.own_address],
                ]
                .concat(),
                &[],
            );
            (server.wait_with_output().expect("server output"), client)
        };
        assert_ran(&remote_out, &format!("ibv_rc_pingpong ({round})"));
        let local = assert_local(&local_out, &format!("ibv_rc_pingpong ({round})"));
        for (printed, side) in [(&local, "here"), (&remote_out.stdout, "peer")] {
            assert!(
                printed.contains("50 iters in"),
                "{round}, {side} printed:\n{printed}"
            );
        }
    }
}

/// An unmodified verbs program through this host's rdmad against the same program on the
/// peer's own device (which never heard of rdmad), both ways round: `ibv_rc_pingpong` with
/// its messages checked, then perftest's `ib_write_bw` (64 KiB). Afterwards rdmad holds
/// nothing of them.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_a_program_through_rdmad_talks_to_a_native_peer() {
    let _alone = rdmad_tests::ALONE.lock().await;
    programs_across_the_wire(None).await;
}

/// Unmodified verbs programs on both hosts, each through its own host's rdmad as an
/// unprivileged user: `ibv_rc_pingpong` and `ib_write_bw`, both ways round. Afterwards
/// neither rdmad holds anything of them.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_programs_on_both_hosts_through_their_rdmad() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let peer_rdmad = peer.start_rdmad("");
    let before = peer_rdmad.settled(0);
    programs_across_the_wire(Some(&peer_rdmad)).await;
    let after = peer_rdmad.settled(0);
    for kind in ["qps", "regions", "mrs", "pds", "sessions"] {
        assert_eq!(
            after[kind], before[kind],
            "the peer's {kind}: {before:?} -> {after:?}"
        );
    }
}

/// `ibv_rc_pingpong` and `ib_write_bw`, each served once by this host (through its rdmad)
/// and once by the peer (native, or through `peer_rdmad`), as `nobody` on both.
async fn programs_across_the_wire(peer_rdmad: Option<&PeerRdmad>) {
    let peer = peer();
    let (bus, _daemon) = start_on("verbs", "").await;
    let before = object_counts(&bus).await;
    let (device, here) = device_and_gid(&bus);
    let (_, there) = wire_gids(&peer);
    assert_eq!(device, "rxe0");
    let rdmactl_path = rdmad_tests::binary("rdmactl");
    let rdmactl_path = rdmactl_path.to_str().unwrap();
    let peer_env: Vec<(&str, &str)> = peer_rdmad
        .map(|r| vec![("RDMAD_BUS_ADDRESS", r.bus.as_str())])
        .unwrap_or_default();
    let peer_side = if peer_rdmad.is_some() {
        "the peer's rdmad"
    } else {
        "the native peer"
    };
    let programs: [(&str, &[&str], &str); 2] = [
        ("ibv_rc_pingpong", &["-n", "50", "-c"], "50 iters in"),
        ("ib_write_bw", &["-F", "-s", "65536", "-n", "200"], "65536"),
    ];
    let mut port = if peer_rdmad.is_some() {
        18540u16
    } else {
        18520
    };
    for (program, args, result) in programs {
        for this_host_serves in [false, true] {
            port += 1;
            let port_text = port.to_string();
            let gid_flag = if program == "ibv_rc_pingpong" {
                "-g"
            } else {
                "-x"
            };
            let local: Vec<&str> = [
                &[
                    "exec", "--", program, "-d", "rxe0", gid_flag, &here, "-p", &port_text,
                ][..],
                args,
            ]
            .concat();
            let mut remote: Vec<&str> = match peer_rdmad {
                Some(_) => vec![rdmactl_path, "exec", "--"],
                None => vec![],
            };
            remote.extend([program, "-d", "rxe0", gid_flag, &there, "-p", &port_text]);
            remote.extend(args);
            let peer_uid = peer_rdmad.map(|_| NOBODY);
            let (local_out, remote_out) = if this_host_serves {
                let server = spawn_rdmactl(&bus, Some(NOBODY), &local);
                rdmad_tests::wait_for_listener(port).await;
                remote.push(&peer.own_address);
                let client = peer.run(peer_uid, &remote, &peer_env);
                (here_serving(server, program, &client), client)
            } else {
                let server = peer.spawn(peer_uid, &remote, &peer_env);
                peer.wait_for_listener(port);
                let local = [&local[..], &[&peer.address]].concat();
                let client = spawn_rdmactl(&bus, Some(NOBODY), &local);
                (here_within(client, program), server.wait())
            };
            let round = format!(
                "{program} between this host's rdmad and {peer_side}, {} serving",
                if this_host_serves {
                    "this host"
                } else {
                    "the peer"
                }
            );
            assert_ran(&remote_out, &round);
            let printed = assert_local(&local_out, &round);
            for (text, side) in [(&printed, "this host"), (&remote_out.stdout, "the peer")] {
                assert!(text.contains(result), "{round}: {side} printed:\n{text}");
            }
        }
    }
    wait_for_sessions(&bus, 0).await;
    let after = object_counts(&bus).await;
    for kind in ["qps", "regions", "mrs", "pds", "sessions"] {
        assert_eq!(after[kind], before[kind], "{kind}: {before:?} -> {after:?}");
    }
}

/// rdmad to rdmad: a client of this host's rdmad and one of the peer's, each as `nobody`,
/// connect their QPs by the endpoints their daemons gave them and use every operation the
/// ring carries across the wire — SEND/RECV, with immediate data, RDMA WRITE (with
/// immediate data too) and READ into the peer's export, fetch-and-add and
/// compare-and-swap, a 1 MiB stream (its bandwidth printed) — then the export is released
/// and its old rkey is refused with a remote access error, the memory untouched. Both
/// daemons end with nothing of them.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_rdmad_clients_on_two_hosts_move_data() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let peer_rdmad = peer.start_rdmad("");
    let before_there = peer_rdmad.settled(0);
    let (bus, _daemon) = start_on("verbs", "").await;
    let before_here = object_counts(&bus).await;
    {
        let (mut a, mut b) = connected_across(&bus, &peer_rdmad);

        // SEND / RECV, then with immediate data.
        b.ok("post 0 recv 0 100 64 1");
        a.ok("write 0 0 hello-across-the-wire");
        a.ok("post 0 send 0 0 21 2");
        assert_completion(&a.ok("wait 0"), 2, "Success", "Send");
        let got = b.ok("wait 0");
        assert_completion(&got, 1, "Success", "Recv");
        assert_eq!(got["byte_len"], 21, "{got}");
        assert_eq!(b.ok("read 0 100 21"), "hello-across-the-wire");
        b.ok("post 0 recv 0 200 64 3");
        a.ok("post 0 send:4242 0 0 5 4");
        assert_completion(&a.ok("wait 0"), 4, "Success", "Send");
        let got = b.ok("wait 0");
        assert_completion(&got, 3, "Success", "Recv");
        assert_eq!(got["imm"], 4242, "{got}");

        // The peer's export: WRITE, READ, both atomics, WRITE with immediate data.
        let export = b.ok("export 0 0 rwa");
        let (addr, rkey, id) = (
            export[0].as_u64().unwrap(),
            export[1].as_u64().unwrap(),
            export[3].as_u64().unwrap(),
        );
        a.ok("write 0 0 remote-write");
        a.ok(&format!("post 0 write 0 0 12 5 {} {rkey}", addr + 1000));
        assert_completion(&a.ok("wait 0"), 5, "Success", "Write");
        assert_eq!(b.ok("read 0 1000 12"), "remote-write");
        b.ok("write 0 2000 readable");
        a.ok(&format!("post 0 read 0 500 8 6 {} {rkey}", addr + 2000));
        assert_completion(&a.ok("wait 0"), 6, "Success", "Read");
        assert_eq!(a.ok("read 0 500 8"), "readable");
        b.ok("write-u64 0 3000 40");
        a.ok(&format!("post 0 fadd 0 3008 8 7 {} {rkey} 2", addr + 3000));
        assert_completion(&a.ok("wait 0"), 7, "Success", "FetchAdd");
        assert_eq!(
            (b.ok("read-u64 0 3000"), a.ok("read-u64 0 3008")),
            (42.into(), 40.into())
        );
        a.ok(&format!(
            "post 0 cswap 0 3016 8 8 {} {rkey} 42 7",
            addr + 3000
        ));
        assert_completion(&a.ok("wait 0"), 8, "Success", "CompareSwap");
        assert_eq!(
            (b.ok("read-u64 0 3000"), a.ok("read-u64 0 3016")),
            (7.into(), 42.into())
        );
        b.ok("post 0 recv 0 400 0 9");
        a.ok("write 0 0 imm!");
        a.ok(&format!("post 0 write:77 0 0 4 10 {} {rkey}", addr + 4000));
        assert_completion(&a.ok("wait 0"), 10, "Success", "Write");
        let got = b.ok("wait 0");
        assert_eq!(
            (got["wr_id"].as_u64(), got["imm"].as_u64()),
            (Some(9), Some(77)),
            "{got}"
        );
        assert_eq!(b.ok("read 0 4000 4"), "imm!");

        // A stream of 1 MiB WRITEs into the whole export.
        let stream = a.ok(&format!("stream 0 0 16 1048576 {addr} {rkey}"));
        eprintln!("1 MiB RDMA WRITEs across the wire, rdmad to rdmad: {stream}");
        assert_eq!(stream["bytes"], 16u64 << 20, "{stream}");

        // Released: the old rkey is refused and the memory stays as it was.
        b.ok("write 0 0 untouched");
        b.ok(&format!("unexport 0 {id}"));
        a.ok("write 0 0 stale-write");
        a.ok(&format!("post 0 write 0 0 11 11 {addr} {rkey}"));
        let c = a.ok("wait 0");
        assert_eq!(
            (c["wr_id"].as_u64(), c["status"].as_str()),
            (Some(11), Some("RemoteAccessError")),
            "{c}"
        );
        assert_eq!(b.ok("read 0 0 9"), "untouched");
    }
    assert_both_back(&bus, &before_here, &peer_rdmad, &before_there).await;
}

/// The peer's client killed in the middle of a stream of 1 MiB WRITEs into its export:
/// the writer's requests fail (the peer's daemon tore the QP and the export down), the
/// writer hears it as a failed completion instead of hanging, its daemon keeps serving,
/// and both daemons end with nothing of either client.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_a_peer_killed_mid_transfer_fails_the_writer_cleanly() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let peer_rdmad = peer.start_rdmad("");
    let before_there = peer_rdmad.settled(0);
    let (bus, _daemon) = start_on("verbs", "").await;
    let before_here = object_counts(&bus).await;
    {
        let (mut a, mut b) = connected_across(&bus, &peer_rdmad);
        let export = b.ok("export 0 0 w");
        let (addr, rkey) = (export[0].as_u64().unwrap(), export[1].as_u64().unwrap());
        // The first WRITE lands: the stream is under way when the peer dies.
        a.ok(&format!("post 0 write 0 0 8 1 {addr} {rkey}"));
        assert_completion(&a.ok("wait 0"), 1, "Success", "Write");
        a.send(&format!("stream 0 0 100000 1048576 {addr} {rkey}"));
        b.kill();
        let answer = a.answer();
        let failed = answer["message"].as_str().unwrap_or_default();
        assert!(
            answer.get("error").is_some() && failed.contains("failed"),
            "the stream should end in a failed WRITE once the peer is gone: {answer}"
        );
        // The writer's daemon still serves it.
        assert_eq!(a.ok("qps").as_array().map(Vec::len), Some(1));
    }
    assert_both_back(&bus, &before_here, &peer_rdmad, &before_there).await;
}

/// Waits until an rdma_cm listener on `port` shows in `rdma resource show cm_id` on the
/// peer, or on this host for `None` (rdma_cm listeners are not TCP sockets).
fn wait_for_cm_listener(peer: Option<&Peer>, port: u16) {
    let show = ["rdma", "resource", "show", "cm_id"];
    let deadline = std::time::Instant::now() + rdmad_tests::TIMEOUT;
    loop {
        let shown = match peer {
            Some(peer) => peer.run(None, &show, &[]).stdout,
            None => {
                let out = std::process::Command::new(show[0])
                    .args(&show[1..])
                    .output()
                    .expect("run rdma resource show cm_id");
                String::from_utf8_lossy(&out.stdout).into_owned()
            }
        };
        if shown
            .lines()
            .any(|l| l.contains("LISTEN") && l.contains(&format!(":{port} ")))
        {
            return;
        }
        let host = if peer.is_some() {
            "the peer"
        } else {
            "this host"
        };
        assert!(
            std::time::Instant::now() < deadline,
            "no rdma_cm listener on {host}'s port {port}:\n{shown}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// `ucmatose` on the peer connects to client `a`'s `listener` (on this host's `port`);
/// `a` accepts it as its queue pair `qp` and exchanges ucmatose's messages. Returns the
/// peer's `ucmatose`, which ends when the queue pair goes.
fn ucmatose_connects(
    a: &mut Client,
    peer: &Peer,
    listener: u64,
    port: u16,
    qp: usize,
) -> PeerProgram {
    let port = port.to_string();
    let client = peer.spawn(
        None,
        &["ucmatose", "-s", &peer.own_address, "-p", &port],
        &[],
    );
    let accepted = a.ok(&format!("accept {listener}"));
    assert_eq!(accepted[1]["address"], peer.address.as_str(), "{accepted}");
    ucmatose_exchange(a, qp);
    client
}

/// Ten 100-byte messages each way on client `c`'s queue pair `q` (region 0), as
/// `ucmatose` exchanges them: receives first, then the sends, then all twenty completions.
fn ucmatose_exchange(c: &mut Client, q: usize) {
    for i in 0..10 {
        c.ok(&format!(
            "post {q} recv 0 {} 100 {}",
            4096 + i * 128,
            100 + i
        ));
    }
    c.ok("write 0 0 rdmad-says-hello");
    for i in 0..10 {
        c.ok(&format!("post {q} send 0 0 100 {}", 200 + i));
    }
    let (mut sends, mut recvs) = (0, 0);
    for _ in 0..20 {
        let got = c.ok(&format!("wait {q}"));
        assert_eq!(got["status"], "Success", "{got}");
        match got["opcode"].as_str() {
            Some("Send") => sends += 1,
            Some("Recv") => {
                assert_eq!(got["byte_len"], 100, "{got}");
                recvs += 1
            }
            _ => panic!("unexpected completion {got}"),
        }
    }
    assert_eq!((sends, recvs), (10, 10));
}

/// Connections by address through rdma_cm, with `ucmatose` (librdmacm's example, which
/// never heard of rdmad) on the peer's own device: an rdmad client connects to a
/// `ucmatose` server and exchanges its messages; `ucmatose` as a client connects to an
/// rdmad listener and does the same; past the listening user's queue pair quota the next
/// `ucmatose` is rejected and hears why; a port nobody listens on is named as such; a
/// low port needs a grant. Both ucmatose runs end cleanly (rdmad disconnects when its
/// queue pair goes), and rdmad ends with nothing of them.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_connections_by_address_with_rdma_cm_programs() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let (bus, _daemon) = start_on("verbs", "[quota.default]\nqps = 1\n").await;
    let before = object_counts(&bus).await;
    {
        // rdmad connects to ucmatose.
        let server = peer.spawn(None, &["ucmatose", "-p", "7471"], &[]);
        wait_for_cm_listener(Some(&peer), 7471);
        let mut a = Client::start(&bus, Some(NOBODY));
        a.ok("open");
        a.ok("alloc default 65536");
        a.ok("qp rxe0 16 16");
        let conn = a.ok(&format!("connect-to 0 {} 7471", peer.address));
        assert_eq!(conn["address"], peer.address.as_str(), "{conn}");
        assert_eq!(conn["port"], 7471, "{conn}");
        ucmatose_exchange(&mut a, 0);
        let info = a.ok("qpinfo 0");
        assert!(
            info["peer"]
                .as_str()
                .unwrap_or_default()
                .starts_with(&format!("{}:7471 ", peer.address)),
            "rdmactl shows the peer's address: {info}"
        );
        a.ok("destroy 0");
        let out = server.wait();
        assert!(out.success(), "ucmatose server: {out:?}");

        // A port nobody listens on.
        a.ok("qp rxe0 16 16");
        let why = a.err(
            &format!("connect-to 1 {} 7472", peer.address),
            "org.rdmad1.Error.ConnectionFailed",
        );
        assert!(why.contains("nothing listens"), "{why}");
        a.ok("destroy 1");

        // A low port needs a grant.
        let why = a.err(
            &format!("listen {} 80", peer.own_address),
            "org.rdmad1.Error.NotAuthorized",
        );
        assert!(
            why.contains("port 80") && why.contains("listen.grant"),
            "{why}"
        );

        // ucmatose connects to rdmad.
        let listening = a.ok(&format!("listen {} 7480 2", peer.own_address));
        let listener = listening[0].as_u64().unwrap();
        let client = ucmatose_connects(&mut a, &peer, listener, 7480, 2);
        // The quota holds one queue pair: the next request is refused, and says so.
        let second = peer.spawn(
            None,
            &["ucmatose", "-s", &peer.own_address, "-p", "7480"],
            &[],
        );
        let quota = a.err(
            &format!("accept {listener} 20000"),
            "org.rdmad1.Error.QuotaExceeded",
        );
        assert!(quota.contains("qps"), "{quota}");
        let refused = second.wait();
        assert!(
            !refused.success() && refused.stdout.contains("REJECTED"),
            "the second ucmatose should be rejected: {refused:?}"
        );
        a.ok("destroy 2");
        let out = client.wait();
        assert!(out.success(), "ucmatose client: {out:?}");
        a.ok(&format!("stop-listening {listener}"));
    }
    assert_back(&bus, &before).await;
}

/// rdmad opens the kernel's connection manager when a call first needs it, and does not
/// keep a failure: with `rdma_ucm` unloaded (as on a host where rdmad started before the
/// module was loaded), `Listen` fails and names the module; once it is loaded the same
/// daemon listens, and `ucmatose` on the peer connects and exchanges its messages.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_the_connection_manager_opens_once_its_module_is_loaded() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let (bus, _daemon) = start_on("verbs", "").await;
    let before = object_counts(&bus).await;
    {
        let module = UnloadedModule::new("rdma_ucm");
        let mut a = Client::start(&bus, Some(NOBODY));
        a.ok("open");
        a.ok("alloc default 65536");
        let listen = format!("listen {} 7490 2", peer.own_address);
        let why = a.err(&listen, "org.rdmad1.Error.DeviceError");
        assert!(
            why.contains("rdma_cm") && why.contains("rdma_ucm"),
            "the error names what is missing: {why}"
        );
        module.load();
        let listening = a.ok(&listen);
        let listener = listening[0].as_u64().unwrap();
        let client = ucmatose_connects(&mut a, &peer, listener, 7490, 0);
        a.ok("destroy 0");
        let out = client.wait();
        assert!(out.success(), "ucmatose client: {out:?}");
        a.ok(&format!("stop-listening {listener}"));
    }
    assert_back(&bus, &before).await;
}

/// A kernel module unloaded for a test, loaded again by [`UnloadedModule::load`] or, if
/// the test fails first, when dropped (so the guest's later tests have it). Meanwhile the
/// kernel cannot load modules by itself (`/proc/sys/kernel/modprobe` names no program):
/// librdmacm's first use asks the kernel where `rdma_cm` is, and the kernel would load
/// `rdma_ucm` for it.
struct UnloadedModule {
    name: &'static str,
    modprobe: String,
}

/// Where the kernel finds its module loader.
const KERNEL_MODPROBE: &str = "/proc/sys/kernel/modprobe";

impl UnloadedModule {
    fn new(name: &'static str) -> UnloadedModule {
        let modprobe =
            std::fs::read_to_string(KERNEL_MODPROBE).expect("read the kernel's modprobe");
        std::fs::write(KERNEL_MODPROBE, "/nonexistent/rdmad-test-no-modprobe\n")
            .expect("keep the kernel from loading modules");
        let module = UnloadedModule { name, modprobe };
        let out = std::process::Command::new("rmmod")
            .arg(name)
            .output()
            .expect("run rmmod");
        assert!(
            out.status.success(),
            "rmmod {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        module
    }

    fn load(&self) {
        let out = std::process::Command::new("modprobe")
            .arg(self.name)
            .output()
            .expect("run modprobe");
        assert!(
            out.status.success(),
            "modprobe {}: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for UnloadedModule {
    fn drop(&mut self) {
        let _ = std::process::Command::new("modprobe")
            .arg(self.name)
            .status();
        let _ = std::fs::write(KERNEL_MODPROBE, &self.modprobe);
    }
}

/// The next `n` completions of client `c`'s queue pair `q`, each a success, by work
/// request id.
fn completions(c: &mut Client, q: usize, n: usize) -> HashMap<u64, serde_json::Value> {
    (0..n)
        .map(|_| {
            let got = c.ok(&format!("wait {q}"));
            assert_eq!(got["status"], "Success", "{got}");
            (got["wr_id"].as_u64().expect("wr_id"), got)
        })
        .collect()
}

/// `rping` (librdmacm's example that advertises buffers, RDMA READs one and WRITEs the
/// other back) against rdmad both ways: an rdmad client connects to `rping -s` on the peer
/// and plays the client's part with an export of its region, then destroys its queue pair
/// (the server sees the disconnect and ends cleanly); then `rping -c` on the peer connects
/// to an rdmad listener whose client plays the server's part — READ, WRITE, the "go
/// ahead" messages — and `rping` checks the data (`-V`). rdmad ends with nothing of them.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_rping_talks_to_rdmad_both_ways() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let (bus, _daemon) = start_on("verbs", "").await;
    let before = object_counts(&bus).await;
    let text = "rdma-ping-0:ABCDEFGHIJKLMNOPQRSTUVWXYZ";
    {
        let mut a = Client::start(&bus, Some(NOBODY));
        a.ok("open");
        a.ok("alloc default 65536");

        // rdmad plays rping's client.
        let server = peer.spawn(
            None,
            &["rping", "-s", "-v", "-a", &peer.address, "-p", "7490"],
            &[],
        );
        wait_for_cm_listener(Some(&peer), 7490);
        a.ok("qp rxe0 16 16");
        a.ok(&format!("connect-to 0 {} 7490", peer.address));
        a.ok("post 0 recv 0 4096 16 1");
        a.ok("post 0 recv 0 4112 16 2");
        let export = a.ok("export 0 0 rw");
        let (addr, rkey) = (export[0].as_u64().unwrap(), export[1].as_u64().unwrap());
        a.ok(&format!("write 0 0 {text}"));
        a.ok(&format!("rping-adv 0 2048 {addr} {rkey} 64"));
        a.ok("post 0 send 0 2048 16 10");
        let got = completions(&mut a, 0, 2);
        assert!(got.contains_key(&10) && got.contains_key(&1), "{got:?}");
        a.ok(&format!("rping-adv 0 2064 {} {rkey} 64", addr + 1024));
        a.ok("post 0 send 0 2064 16 11");
        let got = completions(&mut a, 0, 2);
        assert!(got.contains_key(&11) && got.contains_key(&2), "{got:?}");
        assert_eq!(a.ok(&format!("read 0 1024 {}", text.len())), text);
        a.ok("destroy 0");
        let out = server.wait();
        assert!(out.success(), "rping -s: {out:?}");
        assert!(
            out.stdout.contains(&format!("server ping data: {text}")),
            "{out:?}"
        );

        // rdmad plays rping's server.
        let listening = a.ok(&format!("listen {} 7491", peer.own_address));
        let listener = listening[0].as_u64().unwrap();
        let client = peer.spawn(
            None,
            &[
                "rping",
                "-c",
                "-v",
                "-V",
                "-C",
                "1",
                "-S",
                "64",
                "-a",
                &peer.own_address,
                "-p",
                "7491",
            ],
            &[],
        );
        a.ok(&format!("accept {listener}"));
        a.ok("post 1 recv 0 4096 16 20");
        let got = completions(&mut a, 1, 1);
        assert_eq!(got[&20]["byte_len"], 16, "{got:?}");
        let source = a.ok("rping-info 0 4096");
        a.ok(&format!(
            "post 1 read 0 1024 {} 21 {} {}",
            source["size"], source["buf"], source["rkey"]
        ));
        completions(&mut a, 1, 1);
        a.ok("post 1 recv 0 4112 16 22");
        a.ok("post 1 send 0 2048 16 23");
        let got = completions(&mut a, 1, 2);
        assert!(got.contains_key(&22) && got.contains_key(&23), "{got:?}");
        let sink = a.ok("rping-info 0 4112");
        let ping = a.ok(&format!("read 0 1024 {}", source["size"]));
        let ping = ping.as_str().unwrap_or_default();
        let len = ping.find('\0').unwrap_or(ping.len()) + 1;
        assert!(ping.starts_with("rdma-ping-0: "), "{ping:?}");
        a.ok(&format!(
            "post 1 write 0 1024 {len} 24 {} {}",
            sink["buf"], sink["rkey"]
        ));
        completions(&mut a, 1, 1);
        a.ok("post 1 send 0 2048 16 25");
        completions(&mut a, 1, 1);
        let out = client.wait();
        assert!(out.success(), "rping -c: {out:?}");
        assert!(out.stdout.contains("ping data: rdma-ping-0: "), "{out:?}");
        a.ok(&format!("stop-listening {listener}"));
    }
    assert_back(&bus, &before).await;
}

/// rdmad to rdmad by address: a client of the peer's rdmad listens, a client of this
/// host's rdmad connects to it with private data and hears the listener's in the accept;
/// a message crosses; then the peer's client dies, its daemon's teardown disconnects, and
/// this side's posted receive completes flushed (the queue pair is in the error state)
/// while its daemon keeps serving. Both daemons end with nothing of either client.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_rdmad_clients_connect_by_address_across_hosts() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let peer_rdmad = peer.start_rdmad("");
    let before_there = peer_rdmad.settled(0);
    let (bus, _daemon) = start_on("verbs", "").await;
    let before_here = object_counts(&bus).await;
    {
        let mut b = Client::on_peer(&peer_rdmad, Some(NOBODY));
        b.ok("open");
        b.ok("alloc default 65536");
        let listening = b.ok(&format!("listen {} 7500 4 welcome-from-b", peer.address));
        assert_eq!(listening[2], 7500, "{listening}");
        let mut a = Client::start(&bus, Some(NOBODY));
        a.ok("open");
        a.ok("alloc default 65536");
        a.ok("qp rxe0 16 16");
        a.send(&format!("connect-to 0 {} 7500 hello-from-a", peer.address));
        let accepted = b.ok(&format!("accept {}", listening[0]));
        assert_eq!(accepted[1]["private_data"], "hello-from-a", "{accepted}");
        assert_eq!(
            accepted[1]["address"],
            peer.own_address.as_str(),
            "{accepted}"
        );
        let connected = a.answer();
        assert_eq!(
            connected["ok"]["private_data"], "welcome-from-b",
            "{connected}"
        );

        b.ok("post 0 recv 0 0 64 1");
        a.ok("write 0 0 across-by-address");
        a.ok("post 0 send 0 0 17 2");
        assert_completion(&a.ok("wait 0"), 2, "Success", "Send");
        assert_completion(&b.ok("wait 0"), 1, "Success", "Recv");
        assert_eq!(b.ok("read 0 0 17"), "across-by-address");

        a.ok("post 0 recv 0 100 64 3");
        b.kill();
        let flushed = a.ok("wait 0");
        assert_eq!(
            (flushed["wr_id"].as_u64(), flushed["status"].as_str()),
            (Some(3), Some("WrFlushError")),
            "{flushed}"
        );
        assert_eq!(a.ok("qpinfo 0")["state"], "error");
    }
    assert_both_back(&bus, &before_here, &peer_rdmad, &before_there).await;
}

/// The operator's walk-through (docs/two-hosts.md) as a test: the `ping-pong` example of
/// rdmad-client listens by address through the peer's rdmad (`pong --listen`) and
/// connects to it through this host's (`ping --connect`), each as `nobody`, and reports
/// its round trips.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_the_ping_pong_example_connects_by_address_across_hosts() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let peer_rdmad = peer.start_rdmad("");
    let (bus, _daemon) = start_on("verbs", "").await;
    let ping_pong = rdmad_tests::example("ping-pong");
    let ping_pong = ping_pong.to_str().expect("a UTF-8 path");
    let at = format!("{}:7510", peer.address);
    let pong = peer.spawn(
        Some(NOBODY),
        &[ping_pong, "pong", "200", "--listen", &at],
        &[("RDMAD_BUS_ADDRESS", &peer_rdmad.bus)],
    );
    wait_for_cm_listener(Some(&peer), 7510);
    let ping = rdmad_tests::daemon::as_user(Some(NOBODY), std::path::Path::new(ping_pong))
        .args(["ping", "200", "--connect", &at])
        .env("RDMAD_BUS_ADDRESS", &bus.address)
        .output()
        .expect("run ping-pong");
    let pong = pong.wait();
    let out = String::from_utf8_lossy(&ping.stdout);
    eprintln!("{out}");
    assert!(
        ping.status.success(),
        "ping: {}{}\npong: {pong:?}",
        out,
        String::from_utf8_lossy(&ping.stderr)
    );
    assert!(pong.success(), "pong: {pong:?}");
    assert!(
        out.contains("200 SEND round trips of 64 B on rxe0"),
        "{out}"
    );
    assert!(
        String::from_utf8_lossy(&ping.stderr).contains(&format!("connected to {at}")),
        "{}",
        String::from_utf8_lossy(&ping.stderr)
    );
}

/// GID choice on hosts with several addresses (each guest has an IPv4 link-local and an
/// IPv6 unique-local address on the wire, and an IPv6 link-local one): with the IPv6 GID
/// pinned in `[[device]]`, a queue pair's endpoint carries it; a connection by address
/// uses the GID of the address it was made to, whatever the pin — the IPv6 GIDs for the
/// peer's IPv6 address, the IPv4-mapped ones for its IPv4 address — and a message
/// crosses each.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_the_gid_follows_the_address_or_the_pin() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let table = local_gid_table();
    assert!(
        table
            .lines()
            .filter(|l| !l.ends_with(" 0000:0000:0000:0000:0000:0000:0000:0000"))
            .count()
            >= 3,
        "several addresses, several GIDs:\n{table}"
    );
    let pinned = gid_index(&table, &peer.own_address6);
    let peer_rdmad = peer.start_rdmad("");
    let (bus, _daemon) = start_on(
        "verbs",
        &format!("[[device]]\nname = \"rxe0\"\ngid_index = {pinned}\n"),
    )
    .await;
    let mut a = Client::start(&bus, Some(NOBODY));
    a.ok("open");
    a.ok("alloc default 65536");
    a.ok("qp rxe0 16 16");
    let endpoint = a.ok("endpoint 0");
    assert_eq!(endpoint["gid"], peer.own_address6.as_str(), "{endpoint}");

    let mut b = Client::on_peer(&peer_rdmad, Some(NOBODY));
    b.ok("open");
    b.ok("alloc default 65536");
    for (q, (address, port, peer_gid)) in [
        (&peer.address6, 7520, peer.address6.clone()),
        (&peer.address, 7521, format!("::ffff:{}", peer.address)),
    ]
    .into_iter()
    .enumerate()
    {
        let listening = b.ok(&format!("listen {address} {port}"));
        a.ok("qp rxe0 16 16");
        a.send(&format!("connect-to {} {address} {port}", q + 1));
        b.ok(&format!("accept {}", listening[0]));
        assert!(a.answer().get("ok").is_some());
        let info = a.ok(&format!("qpinfo {}", q + 1));
        // `ADDRESS:PORT GID/QPN`
        let shown = info["peer"].as_str().unwrap_or_default();
        let (at, gid) = shown.split_once(' ').unwrap_or_default();
        assert!(
            at.ends_with(&format!(":{port}")) && gid.split('/').next() == Some(peer_gid.as_str()),
            "connected to {address}: {info}"
        );
        b.ok(&format!("post {q} recv 0 0 64 1"));
        a.ok(&format!("write 0 0 over-{port}"));
        a.ok(&format!("post {} send 0 0 9 2", q + 1));
        assert_completion(&a.ok(&format!("wait {}", q + 1)), 2, "Success", "Send");
        assert_completion(&b.ok(&format!("wait {q}")), 1, "Success", "Recv");
        assert_eq!(b.ok("read 0 0 9"), format!("over-{port}"));
    }
}

/// A tenant that floods rdmad with connections that cannot succeed — twelve `ConnectTo`s at
/// once to an address on the wire where no host answers — does not hold up another
/// tenant: while they wait (each user has at most four connections being made at a time,
/// the rest queued without a thread), a second user connects to a `ucmatose` server on
/// the peer and exchanges its messages. Every one of the flooder's calls ends saying the
/// address cannot be reached, and rdmad ends with nothing of either.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_a_tenant_flooding_hopeless_connections_does_not_hold_up_another() {
    let _alone = rdmad_tests::ALONE.lock().await;
    let peer = peer();
    let (bus, _daemon) = start_on("verbs", "").await;
    let before = object_counts(&bus).await;
    {
        let server = peer.spawn(None, &["ucmatose", "-p", "7530"], &[]);
        wait_for_cm_listener(Some(&peer), 7530);
        let nowhere = peer
            .address
            .rsplit_once('.')
            .map(|(net, _)| format!("{net}.99"));
        let nowhere = nowhere.expect("an IPv4 wire address");
        let mut flood: Vec<Client> = (0..12)
            .map(|_| {
                let mut x = Client::start(&bus, Some(NOBODY));
                x.ok("open");
                x.ok("qp rxe0 4 4");
                x.send(&format!("connect-to 0 {nowhere} 7530"));
                x
            })
            .collect();
        let mut y = Client::start(&bus, Some(1));
        y.ok("open");
        y.ok("alloc default 65536");
        y.ok("qp rxe0 16 16");
        y.ok(&format!("connect-to 0 {} 7530", peer.address));
        ucmatose_exchange(&mut y, 0);
        y.ok("destroy 0");
        let out = server.wait();
        assert!(out.success(), "ucmatose server: {out:?}");
        for x in &mut flood {
            let answer = x.answer();
            assert_eq!(
                answer["error"], "org.rdmad1.Error.ConnectionFailed",
                "{answer}"
            );
        }
    }
    assert_back(&bus, &before).await;
}

/// perftest over rdma_cm: `ib_send_bw -R` makes its queue pairs with `rdma_create_qp`,
/// connects them with `rdma_connect` / `rdma_accept` (librdmacm moves them through INIT,
/// RTR and RTS with the attributes the kernel's connection manager computes) and exchanges
/// its parameters over an rdma_cm connection of its own. Unmodified, as `nobody`, through
/// this host's rdmad against the peer's native one both ways round, then against the
/// peer's through its own rdmad: every run reports its bandwidth on both sides, and
/// neither rdmad holds anything of them afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_perftest_over_rdma_cm_through_rdmad() {
    let _alone = rdmad_tests::ALONE.lock().await;
    rdma_cm_program_rounds(
        &CmProgram {
            // -F: report even when perftest's measure of the CPU's clock is too noisy to
            // trust, as it can be under emulation ("Can't produce a report" otherwise).
            args: &[
                "ib_send_bw",
                "-R",
                "-F",
                "-d",
                "rxe0",
                "-s",
                "4096",
                "-n",
                "200",
            ],
            server: &[],
            client: &[],
            printed: |text| {
                text.lines()
                    .any(|l| l.trim_start().starts_with("4096 ") && l.contains("200"))
            },
            retry_crashed_client: true,
        },
        18560,
    )
    .await;
}

/// `rping` through rdmad: unmodified, as `nobody`, a client that advertises its buffers,
/// lets the server READ one and WRITE the other, and checks every byte (`-V`), against the
/// peer's native `rping` both ways round and against the peer's through its own rdmad —
/// completion channels, RDMA READ and WRITE by the rkeys rdmad's library handed out, and a
/// clean disconnect at the end; neither rdmad holds anything of them afterwards.
#[tokio::test(flavor = "multi_thread")]
async fn rxe_rping_through_rdmad() {
    let _alone = rdmad_tests::ALONE.lock().await;
    rdma_cm_program_rounds(
        &CmProgram {
            args: &["rping", "-v", "-V", "-C", "10", "-S", "100"],
            server: &["-s"],
            client: &["-c", "-a"],
            printed: |text| text.matches("ping data: rdma-ping-").count() >= 10,
            retry_crashed_client: false,
        },
        18570,
    )
    .await;
}

/// An rdma_cm program both ends of which run the same arguments.
struct CmProgram {
    args: &'static [&'static str],
    /// What the server adds.
    server: &'static [&'static str],
    /// What the client adds before the server's address.
    client: &'static [&'static str],
    /// Whether a side's standard output shows it did its work.
    printed: fn(&str) -> bool,
    /// Whether a round whose client died of SIGSEGV is run again ([`CRASHED_CLIENT_RUNS`]).
    retry_crashed_client: bool,
}

/// How many times a round of a [`CmProgram`] with `retry_crashed_client` runs at most.
///
/// Debian 12's perftest (4.5-0.17) races itself over rdma_cm (`-R`): after the exchange on
/// its control connection the client asks at once to connect its test queue pairs, while
/// the server only then listens for them. A request that comes first is rejected; the
/// client's retry then uses the CM identifiers it has just destroyed and dies of SIGSEGV,
/// and the server waits for it forever (perftest 3d9d8d0, "Fix crashes and logical flaws
/// in RDMA CM connection retry", fixes it). The server's last control message completes
/// later through rdmad than natively, so under emulation the client wins now and then:
/// such a run is stopped and the round runs again, on a port of its own. Any other failure
/// fails the test at once, and so does a crash in the last run.
const CRASHED_CLIENT_RUNS: u16 = 3;

/// SIGSEGV, as the peer's agent reports a program it killed: 128 + the signal.
const DIED_OF_SIGSEGV: i32 = 128 + nix::libc::SIGSEGV;

/// Runs `program` as `nobody` through this host's rdmad against the peer's native
/// program, the peer serving and then this host; then against the peer's through its own
/// rdmad. Each run must succeed on both sides, print its work, and make its queue pairs in
/// this host's rdmad; afterwards neither rdmad holds anything of them.
async fn rdma_cm_program_rounds(program: &CmProgram, first_port: u16) {
    let peer = peer();
    let (bus, daemon) = start_on("verbs", "").await;
    let before = object_counts(&bus).await;
    let peer_rdmad = peer.start_rdmad("");
    let peer_before = peer_rdmad.settled(0);
    let name = program.args[0];
    let rounds = [
        ("the native peer serves", false, false),
        ("this host serves the native peer", true, false),
        ("the peer serves through its rdmad", false, true),
    ];
    for (i, &(round, this_host_serves, through_peer_rdmad)) in rounds.iter().enumerate() {
        let round = format!("{name}, {round}");
        let created = daemon.stderr().matches("queue pair created").count();
        let mut run = 0;
        let (local_out, remote_out) = loop {
            run += 1;
            let port = first_port + i as u16 + (run - 1) * rounds.len() as u16;
            match cm_program_run(
                program,
                &peer,
                &bus,
                port,
                this_host_serves,
                through_peer_rdmad.then_some(&peer_rdmad),
            ) {
                CmRun::Ended(local, remote) => break (local, remote),
                CmRun::ClientCrashed(side) => {
                    assert!(
                        run < CRASHED_CLIENT_RUNS,
                        "{round}: the client on {side} died of SIGSEGV in each of {run} runs"
                    );
                    eprintln!(
                        "{round}: the client on {side} died of SIGSEGV (perftest's own rdma_cm \
                         retry, see CRASHED_CLIENT_RUNS); its server is stopped and the round \
                         runs again"
                    );
                }
            }
        };
        assert_ran(&remote_out, &round);
        let printed = assert_local(&local_out, &round);
        for (text, side) in [(&printed, "this host"), (&remote_out.stdout, "the peer")] {
            assert!(
                (program.printed)(text),
                "{round}: {side} did not print its work:\n{text}"
            );
        }
        assert!(
            daemon.stderr().matches("queue pair created").count() > created,
            "{round}: this host's {name} made no queue pair in rdmad:\n{}",
            daemon.stderr()
        );
    }
    wait_for_sessions(&bus, 0).await;
    assert_back(&bus, &before).await;
    let peer_after = peer_rdmad.settled(0);
    for kind in ["qps", "regions", "mrs", "pds", "sessions"] {
        assert_eq!(
            peer_after[kind], peer_before[kind],
            "the peer's {kind}: {peer_before:?} -> {peer_after:?}"
        );
    }
}

/// How one run of a round of a [`CmProgram`] ended.
enum CmRun {
    /// Both sides ended: this host's output and the peer's.
    Ended(std::process::Output, Output),
    /// The client on this side died of SIGSEGV (the program retries such runs); its
    /// server was stopped.
    ClientCrashed(&'static str),
}

/// One run of `program` on `port`: this host's side through its rdmad (as `nobody`), the
/// peer's native or, with `peer_rdmad`, through that.
fn cm_program_run(
    program: &CmProgram,
    peer: &Peer,
    bus: &PrivateBus,
    port: u16,
    this_host_serves: bool,
    peer_rdmad: Option<&PeerRdmad>,
) -> CmRun {
    let rdmactl_path = rdmad_tests::binary("rdmactl");
    let rdmactl_path = rdmactl_path.to_str().unwrap();
    let name = program.args[0];
    let port_text = port.to_string();
    let (here_role, there_role) = if this_host_serves {
        (program.server, program.client)
    } else {
        (program.client, program.server)
    };
    let mut local: Vec<&str> = [&["exec", "--"][..], program.args, &["-p", &port_text]].concat();
    local.extend(here_role);
    let mut remote: Vec<&str> = match peer_rdmad {
        Some(_) => vec![rdmactl_path, "exec", "--"],
        None => vec![],
    };
    remote.extend(program.args);
    remote.extend(["-p", &port_text]);
    remote.extend(there_role);
    let peer_env: Vec<(&str, &str)> = match peer_rdmad {
        Some(r) => vec![("RDMAD_BUS_ADDRESS", r.bus.as_str())],
        None => vec![],
    };
    let peer_uid = peer_rdmad.map(|_| NOBODY);
    if this_host_serves {
        let mut server = spawn_rdmactl(bus, Some(NOBODY), &local);
        wait_for_cm_listener(None, port);
        remote.push(&peer.own_address);
        let client = peer.run(peer_uid, &remote, &peer_env);
        if program.retry_crashed_client && client.status == DIED_OF_SIGSEGV {
            let _ = server.kill();
            let _ = server.wait();
            return CmRun::ClientCrashed("the peer");
        }
        CmRun::Ended(here_serving(server, name, &client), client)
    } else {
        let server = peer.spawn(peer_uid, &remote, &peer_env);
        wait_for_cm_listener(Some(peer), port);
        local.push(&peer.address);
        let client = here_within(spawn_rdmactl(bus, Some(NOBODY), &local), name);
        if program.retry_crashed_client && client.status.signal() == Some(nix::libc::SIGSEGV) {
            server.signal(nix::libc::SIGKILL);
            let _ = server.wait();
            return CmRun::ClientCrashed("this host");
        }
        CmRun::Ended(client, server.wait())
    }
}
