//! Unmodified verbs programs — the distribution's own ibverbs-utils binaries — run through
//! rdmad's libibverbs with `rdmactl exec`, as an unprivileged user.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use rdmad_tests::daemon::{object_counts, rdmactl, rdmactl_ok, start_on, wait_for_sessions};
use rdmad_tests::NOBODY;
use serde_json::Value;

/// Builds one of the C programs in `tests/verbs/` against the distribution's
/// libibverbs-dev, into a directory any user may run it from.
fn c_program(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("rdmad-verbs-")
        .tempdir()
        .expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let source = rdmad_tests::repo_root().join(format!("tests/verbs/{name}.c"));
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
);

/// `ibv_reg_mr` of the program's own memory — heap (unaligned, with a neighbour on the same
/// page), stack, page-aligned — keeps its contents through registration and
/// deregistration and stays the program's memory; bad buffers and flags get libibverbs's
/// errors; a registration past the user's `registered_bytes` is NULL with `ENOMEM` and the
/// daemon's reason; everything is gone when the program exits.
#[tokio::test(flavor = "multi_thread")]
async fn ibv_reg_mr_registers_the_programs_own_memory_within_its_quota() {
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
