//! Waiting for a program with a bound: a program that hangs fails its test with what it
//! printed and where each of its threads waits, instead of holding the run until the VM
//! tier's timeout kills everything and nothing is left to read.

use std::process::{Child, ExitStatus, Output};
use std::time::Duration;

/// Waits at most `limit` for `child` (its stdout and stderr piped) and returns its output.
/// If it has not ended by then, the test fails showing where the threads of it and of its
/// descendants wait (their kernel stacks, and their own stacks when `gdb` is installed)
/// and what it printed; they are killed first, so nothing is left running.
pub fn output_within(child: Child, limit: Duration, what: &str) -> Output {
    let pid = child.id();
    match within(pid, limit, move || child.wait_with_output()) {
        Ok(output) => output.unwrap_or_else(|e| panic!("{what}: waiting for it failed: {e}")),
        Err((report, output)) => {
            let printed = match output {
                Some(Ok(out)) => format!(
                    "stdout:\n{}\nstderr:\n{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
                _ => "(its output could not be read after it was killed)".to_owned(),
            };
            panic!("{what} did not end within {limit:?}; its processes were:\n{report}\n{printed}")
        }
    }
}

/// Waits at most `limit` for `child` to end: its status, or, if it had not ended, where
/// the threads of it and of its descendants waited (they are killed).
pub fn wait_within(mut child: Child, limit: Duration) -> Result<ExitStatus, String> {
    let pid = child.id();
    match within(pid, limit, move || child.wait()) {
        Ok(status) => status.map_err(|e| format!("waiting for it failed: {e}")),
        Err((report, _)) => Err(format!(
            "it did not end within {limit:?}; its processes were:\n{report}"
        )),
    }
}

/// Runs `wait` (which returns once process `pid` has ended) on a thread of its own for at
/// most `limit`. If it has not returned by then: where the process tree's threads wait,
/// and `wait`'s result once the tree is killed (if it comes within [`crate::TIMEOUT`]).
fn within<T: Send + 'static>(
    pid: u32,
    limit: Duration,
    wait: impl FnOnce() -> T + Send + 'static,
) -> Result<T, (String, Option<T>)> {
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(wait());
    });
    if let Ok(result) = ended.recv_timeout(limit) {
        return Ok(result);
    }
    let tree = tree_of(pid);
    let report: String = tree.iter().map(|&p| describe(p)).collect();
    // Descendants first, so none is reparented and left behind.
    for &p in tree.iter().rev() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    Err((report, ended.recv_timeout(crate::TIMEOUT).ok()))
}

/// `pid` and its descendants, parents before children (`/proc/PID/task/TID/children`).
fn tree_of(pid: u32) -> Vec<u32> {
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        for tid in tasks(p) {
            let children = std::fs::read_to_string(format!("/proc/{p}/task/{tid}/children"))
                .unwrap_or_default();
            tree.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
        }
        i += 1;
    }
    tree
}

fn tasks(pid: u32) -> Vec<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Where process `pid`'s threads wait: each thread's name, kernel wait channel and kernel
/// stack, then `gdb`'s backtrace of every thread if `gdb` is there.
fn describe(pid: u32) -> String {
    let read = |path: String| {
        std::fs::read_to_string(path)
            .map(|s| s.trim_end().to_owned())
            .unwrap_or_else(|e| format!("({e})"))
    };
    let cmdline = read(format!("/proc/{pid}/cmdline")).replace('\0', " ");
    let mut out = format!("== process {pid}: {cmdline}\n");
    for tid in tasks(pid) {
        let task = format!("/proc/{pid}/task/{tid}");
        out += &format!(
            "-- thread {tid} {} (waits in {}):\n{}\n",
            read(format!("{task}/comm")),
            read(format!("{task}/wchan")),
            read(format!("{task}/stack"))
        );
    }
    match std::process::Command::new("gdb")
        .args([
            "-p",
            &pid.to_string(),
            "-batch",
            "-nx",
            "-ex",
            "thread apply all bt",
        ])
        .stdin(std::process::Stdio::null())
        .output()
    {
        Ok(gdb) => out += &String::from_utf8_lossy(&gdb.stdout),
        Err(e) => out += &format!("(no gdb backtrace: {e})\n"),
    }
    out
}
