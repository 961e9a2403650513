//! Harness for the integration tests: a private `dbus-daemon` whose policy includes the
//! shipped `unit/org.rdmad1.conf`, the real `rdmad` and `rdmactl` binaries, and callers
//! running as other users. Readiness is always an event (the bus address printed, the bus
//! name owned, a notify message), never a sleep.

pub mod across;
pub mod bus;
pub mod client;
pub mod daemon;
pub mod notify;
pub mod peer;
pub mod process;
pub mod rng;

use std::path::PathBuf;
use std::time::Duration;

/// How long any single wait may take before the test fails. Generous: the VM tier runs
/// under instruction emulation.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// The uid/gid tests use for an unprivileged caller (`nobody`).
pub const NOBODY: u32 = 65534;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

/// Path of a binary of the workspace, built next to the running test
/// (`target/<profile>/deps/test-…` → `target/<profile>/NAME`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe
        .parent()
        .expect("test binary has a directory")
        .to_owned();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} does not exist: build the binaries first (cargo build --workspace --bins)",
        path.display()
    );
    path
}

/// Path of an example of the workspace (`target/<profile>/examples/NAME`).
pub fn example(name: &str) -> PathBuf {
    let path = binary("examples").join(name);
    assert!(
        path.exists(),
        "{} does not exist: build the examples first (cargo build --workspace --examples)",
        path.display()
    );
    path
}

/// Held by a test for its whole run when it compares figures that are per device or per
/// host — the kernel's verbs objects, latency, host memory: the tests of one binary run in
/// parallel threads of one process (on the host and in the VM tier's guest alike), so each
/// test of such a binary holds it.
pub static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The kernel's verbs objects per RDMA device (`rdma resource show`: ctx, pd, cq, qp, mr,
/// …) when `provider` is `"verbs"`; `None` on the loopback provider, which the kernel never
/// sees. A daemon that has released everything leaves this as it was. Only meaningful while
/// no other process uses the device: the VM tier runs one test binary per guest, and a
/// binary whose tests compare it holds [`ALONE`] in each of them.
pub fn kernel_verbs_objects(provider: &str) -> Option<String> {
    if provider != "verbs" {
        return None;
    }
    let out = std::process::Command::new("rdma")
        .args(["resource", "show"])
        .output()
        .expect("run `rdma resource show` (iproute2)");
    assert!(out.status.success(), "rdma resource show: {out:?}");
    Some(String::from_utf8(out.stdout).expect("rdma resource show prints UTF-8"))
}

/// A D-Bus error name as the fuzzing tables print it: `fdo.UnknownObject` for
/// `org.freedesktop.DBus.Error.UnknownObject`, `NoSuchObject` for
/// `org.rdmad1.Error.NoSuchObject`, any other name whole.
pub fn short_error_name(name: &str) -> String {
    name.strip_prefix("org.freedesktop.DBus.Error.")
        .map(|s| format!("fdo.{s}"))
        .or_else(|| name.strip_prefix("org.rdmad1.Error.").map(str::to_owned))
        .unwrap_or_else(|| name.to_owned())
}

/// Whether a TCP socket (IPv4 or IPv6) of this host listens on `port` (`/proc/net/tcp*`).
pub fn listens_on(port: u16) -> bool {
    let needle = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|t| {
            t.lines().any(|l| {
                let fields: Vec<&str> = l.split_whitespace().collect();
                fields.len() > 3 && fields[1].ends_with(&needle) && fields[3] == "0A"
            })
        })
    })
}

/// Waits until something listens on TCP `port` (a program's server side, started by the
/// test); fails the test after [`TIMEOUT`].
pub async fn wait_for_listener(port: u16) {
    let deadline = std::time::Instant::now() + TIMEOUT;
    while !listens_on(port) {
        assert!(
            std::time::Instant::now() < deadline,
            "nothing listened on port {port} within {TIMEOUT:?}"
        );
        // Polling a condition the server makes true; it has no other signal.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A child process that is killed (and reaped) when the guard is dropped, so a failing test
/// leaves no program running behind it.
pub struct KillOnDrop(pub std::process::Child);

impl std::ops::Deref for KillOnDrop {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
