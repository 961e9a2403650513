//! Running the real `rdmad` and `rdmactl` against a private bus.

use std::path::PathBuf;
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use rdmad_client::BUS_NAME;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::bus::PrivateBus;
use crate::notify::NotifySocket;
use crate::{binary, TIMEOUT};

/// How to start the daemon.
pub struct DaemonOptions {
    /// `--provider`.
    pub provider: &'static str,
    /// Contents of the configuration file.
    pub config: String,
    /// Give the daemon a `NOTIFY_SOCKET` (and `WATCHDOG_USEC` if set).
    pub notify: bool,
    pub watchdog_usec: Option<u64>,
    /// More environment for the daemon (e.g. the test hooks of a debug build, see
    /// `rdmad::test_hooks`).
    pub env: Vec<(&'static str, String)>,
}

impl Default for DaemonOptions {
    fn default() -> Self {
        DaemonOptions {
            provider: "loopback",
            config: String::new(),
            notify: false,
            watchdog_usec: None,
            env: Vec::new(),
        }
    }
}

pub struct Daemon {
    pub child: tokio::process::Child,
    pub config_path: PathBuf,
    pub notify: Option<NotifySocket>,
    stderr: Arc<Mutex<String>>,
    /// Bumped after every line copied into `stderr`; closed when the daemon closes it.
    stderr_lines: tokio::sync::watch::Receiver<usize>,
    /// Copies stderr into `stderr`; ends when the daemon closes it.
    stderr_reader: Option<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Daemon {
    /// Starts `rdmad` on `bus` without waiting for anything.
    pub fn spawn(bus: &PrivateBus, options: DaemonOptions) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("rdmad-test-")
            .tempdir()
            .expect("tempdir");
        let config_path = dir.path().join("rdmad.toml");
        std::fs::write(&config_path, &options.config).expect("write config");
        let notify = options
            .notify
            .then(|| NotifySocket::bind(&dir.path().join("notify")));
        let mut command = tokio::process::Command::new(binary("rdmad"));
        command
            .arg("--bus")
            .arg(&bus.address)
            .arg("--provider")
            .arg(options.provider)
            .arg("--config")
            .arg(&config_path)
            .args(["--log-target", "stderr"])
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(socket) = &notify {
            command.env("NOTIFY_SOCKET", &socket.path);
        }
        if let Some(usec) = options.watchdog_usec {
            command.env("WATCHDOG_USEC", usec.to_string());
        }
        command.envs(options.env.iter().map(|(k, v)| (k, v)));
        let mut child = command.spawn().expect("spawn rdmad");
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut lines = BufReader::new(child.stderr.take().expect("piped stderr")).lines();
        let sink = Arc::clone(&stderr);
        let (line_count, stderr_lines) = tokio::sync::watch::channel(0);
        let stderr_reader = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("rdmad: {line}");
                let mut s = sink.lock().unwrap_or_else(|e| e.into_inner());
                s.push_str(&line);
                s.push('\n');
                drop(s);
                line_count.send_modify(|n| *n += 1);
            }
        });
        Daemon {
            child,
            config_path,
            notify,
            stderr,
            stderr_lines,
            stderr_reader: Some(stderr_reader),
            _dir: dir,
        }
    }

    /// Starts `rdmad` and returns once it owns `org.rdmad1`.
    pub async fn start(bus: &PrivateBus, options: DaemonOptions) -> Daemon {
        let mut daemon = Daemon::spawn(bus, options);
        daemon.wait_for_name(bus).await;
        daemon
    }

    /// Waits until the daemon owns the bus name; fails the test if it exits first.
    pub async fn wait_for_name(&mut self, bus: &PrivateBus) {
        let connection = bus.connect().await;
        let dbus = zbus::fdo::DBusProxy::new(&connection)
            .await
            .expect("DBus proxy");
        let mut changes = dbus
            .receive_name_owner_changed_with_args(&[(0, BUS_NAME)])
            .await
            .expect("subscribe to NameOwnerChanged");
        if dbus
            .name_has_owner(BUS_NAME.try_into().expect("valid name"))
            .await
            .expect("NameHasOwner")
        {
            return;
        }
        tokio::select! {
            _ = changes.next() => {}
            status = self.child.wait() => panic!(
                "rdmad exited ({status:?}) before owning {BUS_NAME}:\n{}", self.stderr()
            ),
            _ = tokio::time::sleep(TIMEOUT) => panic!(
                "rdmad did not own {BUS_NAME} within {TIMEOUT:?}:\n{}", self.stderr()
            ),
        }
    }

    /// Everything the daemon wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until the daemon has written `needle` to stderr `times` times (counting
    /// lines that contain it); returns everything it wrote up to then. Fails the test if
    /// stderr closes first or nothing more comes within [`TIMEOUT`].
    pub async fn wait_for_log(&self, needle: &str, times: usize) -> String {
        let mut lines = self.stderr_lines.clone();
        loop {
            let log = self.stderr();
            if log.lines().filter(|l| l.contains(needle)).count() >= times {
                return log;
            }
            match tokio::time::timeout(TIMEOUT, lines.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => panic!("rdmad closed stderr before logging {needle:?}:\n{log}"),
                Err(_) => panic!("rdmad did not log {needle:?} within {TIMEOUT:?}:\n{log}"),
            }
        }
    }

    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = self.child.id().expect("rdmad is running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).expect("kill");
    }

    /// Waits for the daemon to exit and for all it wrote to stderr.
    pub async fn wait(&mut self) -> ExitStatus {
        let status = tokio::time::timeout(TIMEOUT, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("rdmad did not exit within {TIMEOUT:?}"))
            .expect("wait for rdmad");
        if let Some(reader) = self.stderr_reader.take() {
            reader.await.expect("stderr reader");
        }
        status
    }

    /// Replaces the configuration file's contents.
    pub fn write_config(&self, text: &str) {
        std::fs::write(&self.config_path, text).expect("write config");
    }
}

/// A command run as `uid` (same gid, no supplementary groups), or as root for `None`.
pub fn as_user(uid: Option<u32>, program: &std::path::Path) -> Command {
    match uid {
        None => Command::new(program),
        Some(uid) => {
            let mut command = Command::new("setpriv");
            command
                .arg(format!("--reuid={uid}"))
                .arg(format!("--regid={uid}"))
                .arg("--clear-groups")
                .arg(program);
            command
        }
    }
}

/// Runs `rdmactl ARGS` against `bus` as `uid`.
pub fn rdmactl(bus: &PrivateBus, uid: Option<u32>, args: &[&str]) -> Output {
    as_user(uid, &binary("rdmactl"))
        .args(args)
        .env("RDMAD_BUS_ADDRESS", &bus.address)
        .stdin(Stdio::null())
        .output()
        .expect("run rdmactl")
}

/// Starts `rdmactl ARGS` as `uid` (root for `None`) against `bus`, its stdout and stderr
/// piped: a server that `rdmactl exec` runs while the test starts its client.
pub fn spawn_rdmactl(bus: &PrivateBus, uid: Option<u32>, args: &[&str]) -> std::process::Child {
    as_user(uid, &binary("rdmactl"))
        .args(args)
        .env("RDMAD_BUS_ADDRESS", &bus.address)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start rdmactl")
}

/// Runs `rdmactl ARGS`, asserts success and returns stdout.
pub fn rdmactl_ok(bus: &PrivateBus, uid: Option<u32>, args: &[&str]) -> String {
    let out = rdmactl(bus, uid, args);
    assert!(
        out.status.success(),
        "rdmactl {args:?} as {uid:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// The device rdmad on `bus` serves first and the index of its IPv4-mapped GID (what
/// `ibv_rc_pingpong -g` and perftest's `-x` take).
pub fn device_and_gid(bus: &PrivateBus) -> (String, String) {
    let devices: serde_json::Value =
        serde_json::from_str(&rdmactl_ok(bus, Some(crate::NOBODY), &["-j", "dev"])).unwrap();
    let device = &devices[0];
    let gid = device["gids"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["gid"].as_str().unwrap().starts_with("::ffff:"))
        .unwrap_or_else(|| panic!("no IPv4-mapped GID on {device}"));
    (
        device["ifname"].as_str().unwrap().to_owned(),
        gid["index"].to_string(),
    )
}

/// A private bus and a daemon on it serving `provider` (`"loopback"` or `"verbs"`) with
/// configuration `config` (logging at info level, the default), ready, its pools' warm
/// sets filled.
pub async fn start_on(provider: &str, config: &str) -> (PrivateBus, Daemon) {
    start_with_env(provider, config, Vec::new()).await
}

/// As [`start_on`], with more environment for the daemon.
pub async fn start_with_env(
    provider: &str,
    config: &str,
    env: Vec<(&'static str, String)>,
) -> (PrivateBus, Daemon) {
    let bus = PrivateBus::start();
    let daemon = Daemon::start(
        &bus,
        DaemonOptions {
            provider: if provider == "verbs" {
                "verbs"
            } else {
                "loopback"
            },
            config: config.to_owned(),
            env,
            ..DaemonOptions::default()
        },
    )
    .await;
    // Object counts taken from here on are a baseline: the daemon's own registrations (its
    // pools' warm sets) are all there.
    daemon.wait_for_log("warm sets filled", 1).await;
    (bus, daemon)
}

/// A private bus and a loopback daemon on it with configuration `config`, ready once its
/// name is on the bus, whatever level it logs at (its warm sets may still be filling).
pub async fn start_loopback(config: &str) -> (PrivateBus, Daemon) {
    let bus = PrivateBus::start();
    let daemon = Daemon::start(
        &bus,
        DaemonOptions {
            config: config.to_owned(),
            ..DaemonOptions::default()
        },
    )
    .await;
    (bus, daemon)
}

/// `Manager.ObjectCounts`: live daemon and provider objects by kind.
pub async fn object_counts(bus: &PrivateBus) -> std::collections::HashMap<String, u64> {
    let connection = bus.connect().await;
    rdmad_client::proxy::ManagerProxy::new(&connection)
        .await
        .expect("manager proxy")
        .object_counts()
        .await
        .expect("ObjectCounts")
}

/// rdmad's `org.freedesktop.DBus.ObjectManager` (on `/org/rdmad1`).
pub async fn object_manager(
    connection: &zbus::Connection,
) -> zbus::fdo::ObjectManagerProxy<'static> {
    zbus::fdo::ObjectManagerProxy::builder(connection)
        .destination(rdmad_client::BUS_NAME)
        .expect("bus name")
        .path(rdmad_client::MANAGER_PATH)
        .expect("path")
        .build()
        .await
        .expect("ObjectManager proxy")
}

/// Waits (on the ObjectManager's `InterfacesRemoved` signals, never by sleeping) until `n`
/// sessions remain; returns the object counts then.
pub async fn wait_for_sessions(bus: &PrivateBus, n: u64) -> std::collections::HashMap<String, u64> {
    let connection = bus.connect().await;
    let objects = object_manager(&connection).await;
    let mut removed = objects
        .receive_interfaces_removed()
        .await
        .expect("subscribe to InterfacesRemoved");
    loop {
        let now = object_counts(bus).await;
        if now["sessions"] == n {
            return now;
        }
        tokio::time::timeout(TIMEOUT, removed.next())
            .await
            .unwrap_or_else(|_| {
                panic!("sessions did not go down to {n} within {TIMEOUT:?}: {now:?}")
            });
    }
}
