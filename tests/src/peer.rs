//! The other host of a two-host test: the peer guest of `tests/vm/run --peer`, joined to
//! the test's guest by a wire that exists only between the two (see tests/vm/README.md).
//! The peer runs `rdmad-vm-peer` on its wire address; a test asks it to run programs there
//! — natively on its `rxe0`, or through an rdmad of its own — and gets their output.
//!
//! One request per TCP connection: a JSON line each way.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The port `rdmad-vm-peer` listens on, on the peer's wire address.
pub const PORT: u16 = 18400;

/// How long a program on the peer may take once the test waits for it: then it is killed
/// and the test fails, saying where its threads waited (a hung program would otherwise
/// hold the run until the VM tier's time-out, which leaves nothing to read).
pub const PROGRAM_LIMIT: Duration = Duration::from_secs(4 * crate::TIMEOUT.as_secs());

/// What a test asks of the peer.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// Start `argv` as `uid` (root if none) with `env` added, output collected: its id.
    Spawn {
        argv: Vec<String>,
        uid: Option<u32>,
        env: Vec<(String, String)>,
    },
    /// Wait for a spawned program to end (at most `timeout_ms`, after which it is killed
    /// and the reply says where its threads waited): its output.
    Wait { id: u64, timeout_ms: u64 },
    /// Send `signal` to a spawned program.
    Signal { id: u64, signal: i32 },
    /// Wait until something on the peer listens on TCP `port` (or `timeout_ms` passes).
    Listening { port: u16, timeout_ms: u64 },
    /// Start a private bus and an rdmad on it serving the peer's devices with `config`:
    /// the bus's address.
    StartRdmad { config: String },
    /// Wait until the peer's rdmad on `bus` has `sessions` sessions: its object counts.
    Settled { bus: String, sessions: u64 },
    /// Stop the peer's rdmad on `bus` and its bus.
    StopRdmad { bus: String },
    /// Start `argv` as `uid` with `env` added, and make this connection its stdin and
    /// stdout from the next line on; closing the connection kills it. No reply: a program
    /// that cannot start answers one `{"error": "Spawn", "message": …}` line, as an
    /// `rdmad-test-client` command that failed would.
    Attach {
        argv: Vec<String>,
        uid: Option<u32>,
        env: Vec<(String, String)>,
    },
}

/// The peer's answer.
#[derive(Debug, Serialize, Deserialize)]
pub enum Reply {
    Spawned {
        id: u64,
    },
    Output {
        /// The exit code, or 128 + the signal that killed it.
        status: i32,
        stdout: String,
        stderr: String,
    },
    Rdmad {
        bus: String,
    },
    Counts(std::collections::HashMap<String, u64>),
    Done,
    Failed(String),
}

fn owned(argv: &[&str]) -> Vec<String> {
    argv.iter().map(|s| s.to_string()).collect()
}

fn owned_pairs(env: &[(&str, &str)]) -> Vec<(String, String)> {
    env.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// What a program the peer ran printed, and how it ended.
#[derive(Debug, Clone)]
pub struct Output {
    pub status: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn success(&self) -> bool {
        self.status == 0
    }
}

/// The peer guest, as the test's guest reaches it.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The peer's IPv4 address on the wire.
    pub address: String,
    /// The peer's IPv6 address on the wire.
    pub address6: String,
    /// This guest's IPv4 address on the wire.
    pub own_address: String,
    /// This guest's IPv6 address on the wire.
    pub own_address6: String,
    agent: SocketAddr,
}

impl Peer {
    /// The peer `tests/vm/run --peer` booted (`RDMAD_VM_PEER`, …), or `None` outside a
    /// two-guest run.
    pub fn from_env() -> Option<Peer> {
        let address = std::env::var("RDMAD_VM_PEER").ok()?;
        let address6 = std::env::var("RDMAD_VM_PEER6").ok()?;
        let own_address = std::env::var("RDMAD_VM_SELF").ok()?;
        let own_address6 = std::env::var("RDMAD_VM_SELF6").ok()?;
        let agent = format!("{address}:{PORT}").parse().ok()?;
        Some(Peer {
            address,
            address6,
            own_address,
            own_address6,
            agent,
        })
    }

    fn ask(&self, request: &Request) -> Reply {
        let stream = self.send(request);
        let mut answer = String::new();
        BufReader::new(&stream)
            .read_line(&mut answer)
            .expect("read the peer's answer");
        serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("the peer's answer {answer:?} is not a reply: {e}"))
    }

    /// Starts `argv` on the peer as `uid` with `env` added: a connection that is its stdin
    /// and stdout ([`Request::Attach`]).
    pub fn attach(&self, uid: Option<u32>, argv: &[&str], env: &[(&str, &str)]) -> TcpStream {
        self.send(&Request::Attach {
            argv: owned(argv),
            uid,
            env: owned_pairs(env),
        })
    }

    /// Opens a connection to the agent and sends `request` on it.
    fn send(&self, request: &Request) -> TcpStream {
        // The peer boots alongside this guest: its agent may not listen yet.
        let deadline = Instant::now() + crate::TIMEOUT * 3;
        let stream = loop {
            match TcpStream::connect_timeout(&self.agent, Duration::from_secs(5)) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "the peer's agent at {} did not answer: {e}",
                        self.agent
                    );
                    // A connection refused until the peer's agent starts: retry.
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        };
        let mut line = serde_json::to_string(request).expect("a request serializes");
        line.push('\n');
        (&stream)
            .write_all(line.as_bytes())
            .expect("send to the peer");
        stream
    }

    /// Starts `argv` on the peer as `uid` (root if `None`) with `env` added.
    pub fn spawn(&self, uid: Option<u32>, argv: &[&str], env: &[(&str, &str)]) -> PeerProgram {
        let request = Request::Spawn {
            argv: owned(argv),
            uid,
            env: owned_pairs(env),
        };
        match self.ask(&request) {
            Reply::Spawned { id } => PeerProgram {
                peer: self.clone(),
                id,
                what: argv.join(" "),
            },
            other => panic!("the peer did not start {argv:?}: {other:?}"),
        }
    }

    /// Runs `argv` on the peer to its end.
    pub fn run(&self, uid: Option<u32>, argv: &[&str], env: &[(&str, &str)]) -> Output {
        self.spawn(uid, argv, env).wait()
    }

    /// Waits until a program on the peer listens on TCP `port`.
    pub fn wait_for_listener(&self, port: u16) {
        match self.ask(&Request::Listening {
            port,
            timeout_ms: crate::TIMEOUT.as_millis() as u64,
        }) {
            Reply::Done => {}
            other => panic!("nothing listened on the peer's port {port}: {other:?}"),
        }
    }
}

impl Peer {
    /// Starts an rdmad of the peer's own, serving its `rxe0`, on a private bus there.
    pub fn start_rdmad(&self, config: &str) -> PeerRdmad {
        match self.ask(&Request::StartRdmad {
            config: config.to_owned(),
        }) {
            Reply::Rdmad { bus } => PeerRdmad {
                peer: self.clone(),
                bus,
            },
            other => panic!("the peer did not start rdmad: {other:?}"),
        }
    }
}

/// An rdmad running on the peer, stopped when this is dropped.
#[derive(Debug)]
pub struct PeerRdmad {
    peer: Peer,
    /// Its bus's address, on the peer (`RDMAD_BUS_ADDRESS` for programs run there).
    pub bus: String,
}

impl PeerRdmad {
    /// The peer it runs on.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Waits until it has `sessions` sessions: its `Manager.ObjectCounts` then.
    pub fn settled(&self, sessions: u64) -> std::collections::HashMap<String, u64> {
        match self.peer.ask(&Request::Settled {
            bus: self.bus.clone(),
            sessions,
        }) {
            Reply::Counts(counts) => counts,
            other => panic!("the peer's rdmad did not settle: {other:?}"),
        }
    }
}

impl PeerRdmad {
    /// Forgets the peer's rdmad without asking the peer to stop it: for a peer that was
    /// powered off.
    pub fn gone_with_its_host(self) {
        std::mem::forget(self);
    }
}

impl Drop for PeerRdmad {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.peer.ask(&Request::StopRdmad {
                bus: self.bus.clone(),
            });
        }
    }
}

/// A program running on the peer.
#[derive(Debug)]
pub struct PeerProgram {
    peer: Peer,
    id: u64,
    what: String,
}

impl PeerProgram {
    /// Waits for it to end: what it printed.
    pub fn wait(self) -> Output {
        match self.peer.ask(&Request::Wait {
            id: self.id,
            timeout_ms: PROGRAM_LIMIT.as_millis() as u64,
        }) {
            Reply::Output {
                status,
                stdout,
                stderr,
            } => Output {
                status,
                stdout,
                stderr,
            },
            other => panic!("the peer lost {}: {other:?}", self.what),
        }
    }

    /// Sends it `signal`.
    pub fn signal(&self, signal: i32) {
        match self.peer.ask(&Request::Signal {
            id: self.id,
            signal,
        }) {
            Reply::Done => {}
            other => panic!("the peer did not signal {}: {other:?}", self.what),
        }
    }
}
