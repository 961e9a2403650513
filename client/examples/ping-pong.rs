//! Two processes bouncing a message through queue pairs that rdmad created: the latency
//! of the proxied data path.
//!
//! ```text
//! ping-pong ping|pong [ITERATIONS] [SIZE] [--spin] [--write]
//! ```
//!
//! Each side opens a session, allocates a region, creates a queue pair on the first
//! device, prints its endpoint as one JSON line on stdout, and reads the peer's endpoint
//! from the first line of stdin. `pong` echoes every message back; `ping` times the round
//! trips and prints the median and 99th percentile. With `--spin` a side busy-polls its ring
//! for completions instead of sleeping on the completion channel. `scripts/demo` runs both.
//!
//! With `--listen [ADDRESS:]PORT` on one side and `--connect ADDRESS:PORT` on the other,
//! the two sides connect by address instead (rdmad's rdma_cm: the sides may be on two
//! hosts, each with its own rdmad), and nothing is read from stdin.
//!
//! With `--write` the messages are RDMA WRITEs instead of SEND/RECV, as perftest's
//! `ib_write_lat` does it: after connecting, each side exports its region through its QP
//! and prints `{"addr":…,"rkey":…}` as its second line, reads the peer's as its second line
//! of stdin, and learns of an arriving message by watching the message's last 8 bytes in
//! its own memory (a round number); the WRITE's own completion is reaped after that.

use std::time::{Duration, Instant};

use rdmad_client::proxy::{Options, RegionProxy};
use rdmad_client::queue_pair::{QueuePairRing, Wait};
use rdmad_client::ring::{Opcode, RegionSge, Status, Submission};
use rdmad_client::RegionMapping;
use zbus::zvariant::Value;

fn request(opcode: Opcode, wr_id: u64, region: u64, offset: u64, length: u32) -> Submission {
    Submission::new(
        opcode,
        wr_id,
        RegionSge {
            region,
            offset,
            length,
        },
    )
}

/// Waits for the completions of `wr_ids`, in any order; an error completion ends the
/// program.
fn complete(
    ring: &mut QueuePairRing,
    wait: Wait,
    wr_ids: &[u64],
) -> Result<(), Box<dyn std::error::Error>> {
    let mut left: Vec<u64> = wr_ids.to_vec();
    while !left.is_empty() {
        let c = ring
            .wait_with(wait, Duration::from_secs(30))?
            .ok_or("no completion within 30 s")?;
        if c.status != Status::Success || !left.contains(&c.wr_id) {
            return Err(format!("waiting for {left:?}: got {c:?}").into());
        }
        left.retain(|&id| id != c.wr_id);
    }
    Ok(())
}

fn submit(ring: &mut QueuePairRing, s: &Submission) -> Result<(), Box<dyn std::error::Error>> {
    ring.submit(s)?.map_err(|_| "ring full")?;
    Ok(())
}

mod common;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (args, wait) = common::args_and_wait();
    let by_write = args.iter().any(|a| a == "--write");
    let mut args: Vec<String> = args.into_iter().filter(|a| a != "--write").collect();
    let meet = common::Meet::from_args(&mut args)?;
    let role = args.get(1).map(String::as_str).unwrap_or("");
    if role != "ping" && role != "pong" {
        eprintln!(
            "usage: ping-pong ping|pong [ITERATIONS] [SIZE] [--spin] \
             [--write | --listen [ADDRESS:]PORT | --connect ADDRESS:PORT]"
        );
        std::process::exit(2);
    }
    if by_write && meet != common::Meet::Stdio {
        return Err(
            "--write exchanges its exports over stdio: not with --listen or --connect".into(),
        );
    }
    let iterations: u64 = args.get(2).map_or(Ok(1000), |s| s.parse())?;
    let size: u32 = args.get(3).map_or(Ok(64), |s| s.parse())?;
    if !(8..=2048).contains(&size) {
        return Err("SIZE must be 8 to 2048 bytes".into());
    }

    let mut side = common::setup_meeting(4096, Options::new(), &meet).await?;
    let mut stdin = std::io::stdin().lines();
    if meet == common::Meet::Stdio {
        let peer = side.connect_over_stdio(&mut stdin).await?;
        eprintln!(
            "{role}: {} QPN {} connected to {}/{}",
            side.device,
            side.qp.endpoint().await?.qp_num,
            peer.gid,
            peer.qp_num
        );
    }
    let (device, region, buffer, ring) = (&side.device, side.region, &side.buffer, &mut side.ring);

    // Messages go out from offset 0 and come in at offset 2048.
    let (send_at, recv_at) = (0, 2048);
    if by_write {
        let r = RegionProxy::builder(&side.connection)
            .path(side.region_path.clone())?
            .build()
            .await?;
        let mut options = Options::new();
        options.insert("access", Value::from("w"));
        let (addr, rkey, _, _) = r.export_remote(&side.qp_path.as_ref(), options).await?;
        println!("{}", serde_json::json!({"addr": addr, "rkey": rkey}));
        let line = stdin
            .next()
            .ok_or("stdin closed before the peer's export")??;
        let export: serde_json::Value = serde_json::from_str(line.trim())?;
        let peer = Remote {
            addr: export["addr"].as_u64().ok_or("export without addr")? + recv_at,
            rkey: export["rkey"].as_u64().ok_or("export without rkey")? as u32,
        };
        let rtts = write_rounds(role, iterations, size, (region, buffer, ring), wait, peer)?;
        if role == "ping" {
            report("RDMA WRITE", iterations, size, device, rtts, wait);
        }
        // Each side's last WRITE was seen to land by the other before it wrote back (or
        // exited): neither export is needed any longer.
        return Ok(());
    }
    let mut rtts = Vec::with_capacity(iterations as usize);
    let mut last_id = 0;
    let mut fresh = || {
        last_id += 1;
        last_id
    };
    let mut pending_recv = fresh();
    submit(
        ring,
        &request(Opcode::Recv, pending_recv, region, recv_at, size),
    )?;
    for i in 0..iterations {
        if role == "ping" {
            buffer.write(send_at as usize, &i.to_le_bytes())?;
            let start = Instant::now();
            let send_id = fresh();
            submit(ring, &request(Opcode::Send, send_id, region, send_at, size))?;
            complete(ring, wait, &[send_id, pending_recv])?;
            rtts.push(start.elapsed());
            let mut echo = [0u8; 8];
            buffer.read(recv_at as usize, &mut echo)?;
            if u64::from_le_bytes(echo) != i {
                return Err(
                    format!("round {i}: the echo carried {}", u64::from_le_bytes(echo)).into(),
                );
            }
        } else {
            complete(ring, wait, &[pending_recv])?;
            let mut msg = vec![0u8; size as usize];
            buffer.read(recv_at as usize, &mut msg)?;
            buffer.write(send_at as usize, &msg)?;
        }
        pending_recv = fresh();
        submit(
            ring,
            &request(Opcode::Recv, pending_recv, region, recv_at, size),
        )?;
        if role == "pong" {
            let send_id = fresh();
            submit(ring, &request(Opcode::Send, send_id, region, send_at, size))?;
            complete(ring, wait, &[send_id])?;
        }
    }
    if role == "ping" {
        report("SEND", iterations, size, device, rtts, wait);
    }
    Ok(())
}

/// Where this side's messages land in the peer's region.
#[derive(Clone, Copy)]
struct Remote {
    addr: u64,
    rkey: u32,
}

/// The `--write` rounds: round `i` is the number `i + 1` in a message's last 8 bytes; ping
/// writes it and times until pong's copy of it lands back in ping's memory.
fn write_rounds(
    role: &str,
    iterations: u64,
    size: u32,
    (region, buffer, ring): (u64, &RegionMapping, &mut QueuePairRing),
    wait: Wait,
    peer: Remote,
) -> Result<Vec<Duration>, Box<dyn std::error::Error>> {
    let (send_at, recv_at) = (0u64, 2048u64);
    let mark = |at: u64| (at + u64::from(size) - 8) as usize;
    let arrived = |round: u64| -> Result<(), Box<dyn std::error::Error>> {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = [0u8; 8];
        loop {
            buffer.read(mark(recv_at), &mut seen)?;
            if u64::from_le_bytes(seen) == round {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("round {round}: nothing arrived within 30 s").into());
            }
            // The write comes through the daemon's worker, which may need this CPU.
            std::thread::yield_now();
        }
    };
    let mut rtts = Vec::with_capacity(iterations as usize);
    for i in 1..=iterations {
        if role == "pong" {
            arrived(i)?;
        }
        buffer.write(mark(send_at), &i.to_le_bytes())?;
        let start = Instant::now();
        let write = Submission {
            remote_addr: peer.addr,
            rkey: peer.rkey,
            ..request(Opcode::Write, i, region, send_at, size)
        };
        submit(ring, &write)?;
        if role == "ping" {
            arrived(i)?;
            rtts.push(start.elapsed());
        }
        complete(ring, wait, &[i])?;
    }
    Ok(rtts)
}

fn report(
    what: &str,
    iterations: u64,
    size: u32,
    device: &str,
    mut rtts: Vec<Duration>,
    wait: Wait,
) {
    rtts.sort();
    let median = rtts[rtts.len() / 2];
    let p99 = rtts[(rtts.len() * 99 / 100).min(rtts.len() - 1)];
    println!(
        "ping-pong: {iterations} {what} round trips of {size} B on {device}: median {:.1} µs, p99 {:.1} µs (one way ≈ {:.1} µs); {}",
        median.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        median.as_secs_f64() * 1e6 / 2.0,
        common::conditions(wait)
    );
}
