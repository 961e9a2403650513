//! Driving `rdmad-test-client` (a scriptable client process) as any uid.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};

use serde_json::Value;

use crate::binary;
use crate::bus::PrivateBus;
use crate::daemon::as_user;

pub struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Client {
    /// Starts a client connected to `bus` running as `uid` (root for `None`).
    pub fn start(bus: &PrivateBus, uid: Option<u32>) -> Client {
        let mut child = as_user(uid, &binary("rdmad-test-client"))
            .env("RDMAD_BUS_ADDRESS", &bus.address)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn rdmad-test-client");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Client {
            child,
            stdin,
            stdout,
        }
    }

    /// Runs one command; returns the whole answer (`{"ok": …}` or `{"error": …}`).
    pub fn call(&mut self, command: &str) -> Value {
        writeln!(self.stdin, "{command}").expect("write command");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read answer");
        assert!(
            !line.is_empty(),
            "rdmad-test-client died running {command:?}"
        );
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{command}: {e}: {line}"))
    }

    /// Writes a command without waiting for its answer (to kill the client mid-call).
    pub fn send(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").expect("write command");
        self.stdin.flush().expect("flush command");
    }

    /// Reads the answer to the oldest command written with [`Client::send`].
    pub fn answer(&mut self) -> Value {
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read answer");
        assert!(!line.is_empty(), "rdmad-test-client died");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    }

    /// Runs a command that must succeed; returns its value.
    pub fn ok(&mut self, command: &str) -> Value {
        let answer = self.call(command);
        match answer.get("ok") {
            Some(v) => v.clone(),
            None => panic!("{command:?} failed: {answer}"),
        }
    }

    /// Runs a command that must fail with the D-Bus error `name`; returns the message.
    pub fn err(&mut self, command: &str, name: &str) -> String {
        let answer = self.call(command);
        assert_eq!(answer["error"], name, "{command:?} answered {answer}");
        answer["message"].as_str().unwrap_or_default().to_owned()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        self.child.kill().expect("kill client");
        self.child.wait().expect("reap client");
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
