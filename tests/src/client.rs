//! Driving `rdmad-test-client` (a scriptable client process) as any uid, on this host or
//! on the peer of a two-host run.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Stdio};

use serde_json::Value;

use crate::binary;
use crate::bus::PrivateBus;
use crate::daemon::as_user;

pub struct Client {
    process: Process,
    stdin: Box<dyn Write + Send>,
    stdout: BufReader<Box<dyn Read + Send>>,
}

/// Where the client runs.
enum Process {
    Local(Child),
    /// On the peer, behind its agent: closing the connection kills it.
    Peer(std::net::TcpStream),
}

impl Client {
    /// Starts a client connected to `bus` running as `uid` (root for `None`).
    pub fn start(bus: &PrivateBus, uid: Option<u32>) -> Client {
        Client::spawn(bus, uid, false)
    }

    /// Starts a client that makes its calls on a direct connection to rdmad (opened over
    /// `bus`), running as `uid`.
    pub fn start_direct(bus: &PrivateBus, uid: Option<u32>) -> Client {
        Client::spawn(bus, uid, true)
    }

    fn spawn(bus: &PrivateBus, uid: Option<u32>, direct: bool) -> Client {
        let mut command = as_user(uid, &binary("rdmad-test-client"));
        if direct {
            command.env("RDMAD_TEST_DIRECT", "1");
        }
        let mut child = command
            .env("RDMAD_BUS_ADDRESS", &bus.address)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn rdmad-test-client");
        let stdin = Box::new(child.stdin.take().expect("stdin"));
        let stdout: Box<dyn Read + Send> = Box::new(child.stdout.take().expect("stdout"));
        Client {
            process: Process::Local(child),
            stdin,
            stdout: BufReader::new(stdout),
        }
    }

    /// Starts a client on the peer of a two-host run, connected to the peer's rdmad, as
    /// `uid` there.
    pub fn on_peer(rdmad: &crate::peer::PeerRdmad, uid: Option<u32>) -> Client {
        let path = binary("rdmad-test-client");
        let stream = rdmad.peer().attach(
            uid,
            &[path.to_str().expect("a UTF-8 path")],
            &[("RDMAD_BUS_ADDRESS", &rdmad.bus)],
        );
        // A peer that stopped answering fails the test instead of hanging it.
        stream
            .set_read_timeout(Some(crate::TIMEOUT * 3))
            .expect("a read time-out");
        let stdin = Box::new(stream.try_clone().expect("clone the connection"));
        let stdout: Box<dyn Read + Send> =
            Box::new(stream.try_clone().expect("clone the connection"));
        Client {
            process: Process::Peer(stream),
            stdin,
            stdout: BufReader::new(stdout),
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

    /// The client's pid (on this host).
    pub fn pid(&self) -> u32 {
        match &self.process {
            Process::Local(child) => child.id(),
            Process::Peer(_) => panic!("a client on the peer has no pid here"),
        }
    }

    /// SIGKILL, as a crash would (on the peer: its agent kills it once the connection
    /// closes).
    pub fn kill(&mut self) {
        match &mut self.process {
            Process::Local(child) => {
                child.kill().expect("kill client");
                child.wait().expect("reap client");
            }
            Process::Peer(stream) => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        match &mut self.process {
            Process::Local(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            Process::Peer(stream) => {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// Asserts that completion `c` (as `wait` answers it) is request `wr_id`'s, with `status`
/// and `opcode`.
pub fn assert_completion(c: &Value, wr_id: u64, status: &str, opcode: &str) {
    assert_eq!(
        (
            c["wr_id"].as_u64(),
            c["status"].as_str(),
            c["opcode"].as_str()
        ),
        (Some(wr_id), Some(status), Some(opcode)),
        "{c}"
    );
}

/// The entry of a listing the test client printed (`pools`, `quota UID`, …) whose `name` is
/// `name`.
pub fn named<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array()
        .and_then(|entries| entries.iter().find(|e| e["name"] == name))
        .unwrap_or_else(|| panic!("no {name:?} in {list}"))
}
