//! A stand-in for systemd's notification socket: records what the daemon tells systemd.

use std::path::{Path, PathBuf};

use crate::TIMEOUT;

pub struct NotifySocket {
    pub path: PathBuf,
    socket: tokio::net::UnixDatagram,
    /// Every message received, in order.
    pub received: Vec<String>,
}

impl NotifySocket {
    pub fn bind(path: &Path) -> NotifySocket {
        let socket = tokio::net::UnixDatagram::bind(path).expect("bind notify socket");
        NotifySocket {
            path: path.to_owned(),
            socket,
            received: Vec::new(),
        }
    }

    /// Waits for the next message (one datagram may carry several `KEY=value` lines).
    pub async fn next(&mut self) -> String {
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(TIMEOUT, self.socket.recv(&mut buf))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "no notification within {TIMEOUT:?}; received so far: {:?}",
                    self.received
                )
            })
            .expect("recv");
        let message = String::from_utf8_lossy(&buf[..n]).into_owned();
        self.received.push(message.clone());
        message
    }

    /// Waits for a message containing the line `line` (e.g. `READY=1`); returns it.
    pub async fn wait_for(&mut self, line: &str) -> String {
        loop {
            let message = self.next().await;
            if message.lines().any(|l| l == line) {
                return message;
            }
        }
    }
}
