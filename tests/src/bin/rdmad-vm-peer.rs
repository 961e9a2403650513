//! The peer guest's agent in a two-guest VM run (`tests/vm/run --peer`): listens on the
//! guest's own wire address (`RDMAD_VM_SELF`, a link-local address that exists only on the
//! wire between the two guests) and runs what the test in the other guest asks
//! (`rdmad_tests::peer`). It runs until the VM run ends.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdmad_tests::bus::PrivateBus;
use rdmad_tests::daemon::{start_on, wait_for_sessions, Daemon};
use rdmad_tests::peer::{Reply, Request, PORT};

/// A spawned program: the child, and the threads collecting its stdout and stderr.
struct Running {
    child: Child,
    stdout: JoinHandle<String>,
    stderr: JoinHandle<String>,
}

type Programs = Arc<Mutex<HashMap<u64, Running>>>;

/// The rdmads started on request, by their bus's address, and the runtime they live in.
struct Daemons {
    runtime: tokio::runtime::Runtime,
    running: Mutex<HashMap<String, (PrivateBus, Daemon)>>,
}

static DAEMONS: std::sync::LazyLock<Daemons> = std::sync::LazyLock::new(|| Daemons {
    runtime: tokio::runtime::Runtime::new().expect("a tokio runtime"),
    running: Mutex::default(),
});

fn main() {
    let Ok(address) = std::env::var("RDMAD_VM_SELF") else {
        eprintln!("rdmad-vm-peer: RDMAD_VM_SELF is not set: run me as tests/vm/run --peer does");
        std::process::exit(2);
    };
    let listener = match TcpListener::bind((address.as_str(), PORT)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("rdmad-vm-peer: cannot listen on {address}:{PORT}: {e}");
            std::process::exit(1);
        }
    };
    eprintln!("rdmad-vm-peer: listening on {address}:{PORT}");
    let programs: Programs = Arc::default();
    let mut next = 0u64;
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        next += 1;
        let (programs, id) = (programs.clone(), next);
        std::thread::spawn(move || serve(stream, &programs, id));
    }
}

fn serve(stream: TcpStream, programs: &Programs, id: u64) {
    let mut reader = BufReader::new(&stream);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let reply = match serde_json::from_str::<Request>(&line) {
        Ok(Request::Attach { argv, uid, env }) => {
            return attach(reader, &stream, &argv, uid, env, id)
        }
        // The harness's helpers fail by panicking: the test hears why.
        Ok(request) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            answer(request, programs, id)
        }))
        .unwrap_or_else(|panic| {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Reply::Failed(format!("the peer's agent failed: {why}"))
        }),
        Err(e) => Reply::Failed(format!("not a request ({e}): {line:?}")),
    };
    let mut text = serde_json::to_string(&reply).expect("a reply serializes");
    text.push('\n');
    let _ = (&stream).write_all(text.as_bytes());
}

/// `argv` as `uid` (root if none) with `env` added; `None` for an empty `argv`.
fn command(argv: &[String], uid: Option<u32>, env: Vec<(String, String)>) -> Option<Command> {
    let (program, args) = argv.split_first()?;
    let mut command = match uid {
        None => Command::new(program),
        Some(uid) => {
            let mut c = Command::new("setpriv");
            c.arg(format!("--reuid={uid}"))
                .arg(format!("--regid={uid}"))
                .arg("--clear-groups")
                .arg(program);
            c
        }
    };
    command.args(args).envs(env);
    Some(command)
}

/// Runs `argv` with the connection as its stdin and stdout (`Request::Attach`) until
/// either side closes; then kills it.
fn attach(
    mut from_test: BufReader<&TcpStream>,
    stream: &TcpStream,
    argv: &[String],
    uid: Option<u32>,
    env: Vec<(String, String)>,
    id: u64,
) {
    let spawned = command(argv, uid, env)
        .ok_or_else(|| "an empty command".to_owned())
        .and_then(|mut c| {
            c.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| e.to_string())
        });
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => {
            let line = serde_json::json!({"error": "Spawn", "message": format!("{argv:?}: {e}")});
            let _ = writeln!(&*stream, "{line}");
            return;
        }
    };
    eprintln!("rdmad-vm-peer: [{id}] attached {argv:?} as {uid:?}");
    let mut stdin = child.stdin.take().expect("piped stdin");
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut to_test = stream.try_clone().expect("clone the connection");
    let output = std::thread::spawn(move || pump(&mut stdout, &mut to_test));
    // Commands until the test closes the connection.
    pump(&mut from_test, &mut stdin);
    drop(stdin);
    let _ = child.kill();
    let _ = child.wait();
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let _ = output.join();
    eprintln!("rdmad-vm-peer: [{id}] detached");
}

/// Copies `from` to `to` as it arrives, until either ends. (Not `std::io::copy`: between a
/// socket and a pipe it splices, and a splice from the socket was seen to return 0 — read
/// as the end — while the connection was open.)
fn pump(from: &mut impl Read, to: &mut impl Write) {
    let mut buffer = [0u8; 8192];
    loop {
        match from.read(&mut buffer) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to
                    .write_all(&buffer[..n])
                    .and_then(|()| to.flush())
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}

fn answer(request: Request, programs: &Programs, id: u64) -> Reply {
    match request {
        Request::Attach { .. } => Reply::Failed("Attach is answered by its own loop".into()),
        Request::Spawn { argv, uid, env } => {
            let Some(mut command) = command(&argv, uid, env) else {
                return Reply::Failed("an empty command".into());
            };
            command
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            match command.spawn() {
                Ok(mut child) => {
                    let stdout = collect(child.stdout.take());
                    let stderr = collect(child.stderr.take());
                    eprintln!("rdmad-vm-peer: [{id}] started {argv:?} as {uid:?}");
                    programs.lock().unwrap().insert(
                        id,
                        Running {
                            child,
                            stdout,
                            stderr,
                        },
                    );
                    Reply::Spawned { id }
                }
                Err(e) => Reply::Failed(format!("cannot start {argv:?}: {e}")),
            }
        }
        Request::Wait { id, timeout_ms } => {
            let Some(running) = programs.lock().unwrap().remove(&id) else {
                return Reply::Failed(format!("no program {id}"));
            };
            let limit = Duration::from_millis(timeout_ms);
            let status = match rdmad_tests::process::wait_within(running.child, limit) {
                Ok(s) => {
                    use std::os::unix::process::ExitStatusExt;
                    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
                }
                Err(e) => {
                    let (stdout, stderr) = (
                        running.stdout.join().unwrap_or_default(),
                        running.stderr.join().unwrap_or_default(),
                    );
                    eprintln!("rdmad-vm-peer: [{id}] killed: {e}");
                    return Reply::Failed(format!(
                        "program {id}: {e}\nstdout:\n{stdout}\nstderr:\n{stderr}"
                    ));
                }
            };
            eprintln!("rdmad-vm-peer: [{id}] ended with status {status}");
            Reply::Output {
                status,
                stdout: running.stdout.join().unwrap_or_default(),
                stderr: running.stderr.join().unwrap_or_default(),
            }
        }
        Request::Signal { id, signal } => {
            let programs = programs.lock().unwrap();
            let Some(running) = programs.get(&id) else {
                return Reply::Failed(format!("no program {id}"));
            };
            let pid = nix::unistd::Pid::from_raw(running.child.id() as i32);
            match nix::sys::signal::Signal::try_from(signal)
                .map_err(|e| e.to_string())
                .and_then(|s| nix::sys::signal::kill(pid, s).map_err(|e| e.to_string()))
            {
                Ok(()) => Reply::Done,
                Err(e) => Reply::Failed(format!("signal {signal} to program {id}: {e}")),
            }
        }
        Request::StartRdmad { config } => {
            let daemons = &*DAEMONS;
            let _entered = daemons.runtime.enter();
            let (bus, daemon) = daemons.runtime.block_on(start_on("verbs", &config));
            let address = bus.address.clone();
            eprintln!("rdmad-vm-peer: rdmad started on {address}");
            daemons
                .running
                .lock()
                .unwrap()
                .insert(address.clone(), (bus, daemon));
            Reply::Rdmad { bus: address }
        }
        Request::Settled { bus, sessions } => {
            let daemons = &*DAEMONS;
            let running = daemons.running.lock().unwrap();
            let Some((bus, _)) = running.get(&bus) else {
                return Reply::Failed(format!("no rdmad on {bus}"));
            };
            let counts = daemons.runtime.block_on(wait_for_sessions(bus, sessions));
            Reply::Counts(counts)
        }
        Request::StopRdmad { bus } => {
            let daemons = &*DAEMONS;
            let stopped = daemons.running.lock().unwrap().remove(&bus);
            match stopped {
                Some(pair) => {
                    let _entered = daemons.runtime.enter();
                    drop(pair);
                    eprintln!("rdmad-vm-peer: rdmad on {bus} stopped");
                    Reply::Done
                }
                None => Reply::Failed(format!("no rdmad on {bus}")),
            }
        }
        Request::Listening { port, timeout_ms } => {
            let deadline = Instant::now() + Duration::from_millis(timeout_ms);
            loop {
                if rdmad_tests::listens_on(port) {
                    return Reply::Done;
                }
                if Instant::now() >= deadline {
                    return Reply::Failed(format!("nothing listened on port {port}"));
                }
                // Polling the kernel's socket table: a listener gives no other sign.
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn collect(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
        text
    })
}
