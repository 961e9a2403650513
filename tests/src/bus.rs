//! A private system-like bus (`tests/bus/private-bus.conf.in`): deny by default, like the
//! real system bus, plus the shipped rdmad policy file.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Stdio};

use crate::repo_root;

pub struct PrivateBus {
    pub address: String,
    child: Child,
    _dir: tempfile::TempDir,
}

impl PrivateBus {
    /// Starts `dbus-daemon` and returns once it has printed its address (it prints it
    /// after the socket is listening).
    pub fn start() -> PrivateBus {
        let dir = tempfile::Builder::new()
            .prefix("rdmad-bus-")
            .tempdir()
            .expect("tempdir");
        // Other users' clients must reach the socket.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod bus dir");
        let policy = repo_root().join("unit/org.rdmad1.conf");
        assert!(policy.exists(), "{} is missing", policy.display());
        let config = include_str!("../bus/private-bus.conf.in")
            .replace("@SOCKET@", &dir.path().join("bus").display().to_string())
            .replace("@POLICY@", &policy.display().to_string());
        let config_path = dir.path().join("bus.conf");
        std::fs::write(&config_path, config).expect("write bus config");
        let mut child = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config_path.display()))
            .args(["--nofork", "--nopidfile", "--print-address"])
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .expect("dbus-daemon must be installed (apt-get install dbus-daemon)");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("piped stdout"))
            .read_line(&mut line)
            .expect("read bus address");
        let address = line.trim().to_owned();
        assert!(address.starts_with("unix:"), "dbus-daemon printed {line:?}");
        PrivateBus {
            address,
            child,
            _dir: dir,
        }
    }

    pub async fn connect(&self) -> zbus::Connection {
        zbus::connection::Builder::address(self.address.as_str())
            .expect("address")
            .build()
            .await
            .expect("connect to the private bus")
    }
}

impl Drop for PrivateBus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
