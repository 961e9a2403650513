//! `rdmad-bench`: what rdmad costs a client, next to what the client would do without it,
//! in one run on one device.
//!
//! ```text
//! rdmad-bench [regions] [OPTIONS]   a warm region against registering one's own memory
//! rdmad-bench ring [OPTIONS]        the proxied data path against the device in-process
//! rdmad-bench control [OPTIONS]     alloc+free per second with many clients, against GetId
//! ```
//!
//! `rdmad-bench SUBCOMMAND --help` lists each one's options; docs/benchmarks.md has the
//! figures and how to read them.

use std::error::Error;
use std::time::Duration;

mod control;
mod regions;
mod ring;

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1).peekable();
    let result = match args.peek().map(String::as_str) {
        Some("ring") => {
            args.next();
            ring::run(args).await
        }
        Some("control") => {
            args.next();
            control::run(args).await
        }
        Some("regions") => {
            args.next();
            regions::run(args).await
        }
        _ => regions::run(args).await,
    };
    if let Err(e) = result {
        eprintln!("rdmad-bench: {e}");
        std::process::exit(1);
    }
}

/// The machine the figures come from: CPUs, kernel and load.
fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".into(), |s| s.trim().to_owned());
    let load = std::fs::read_to_string("/proc/loadavg").map_or_else(
        |_| "unknown".into(),
        |s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    );
    format!("{cpus} CPUs ({model}), kernel {kernel}, load average {load}")
}

/// The `p` quantile (0 < p ≤ 1, nearest rank) of sorted samples.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = (p * sorted.len() as f64).ceil() as usize;
    sorted[i.clamp(1, sorted.len()) - 1]
}

/// Microseconds with three significant digits or so.
fn us(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us >= 1000.0 {
        format!("{us:.0}")
    } else if us >= 10.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}
