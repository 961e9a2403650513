//! Two processes bouncing a message through queue pairs that rdmad created: the latency
//! of the proxied data path.
//!
//! ```text
//! ping-pong ping|pong [ITERATIONS] [SIZE] [--spin]
//! ```
//!
//! Each side opens a session, allocates a region, creates a queue pair on the first
//! device, prints its endpoint as one JSON line on stdout, and reads the peer's endpoint
//! from the first line of stdin. `pong` echoes every message back; `ping` times the round
//! trips and prints the median and 99th percentile. With `--spin` a side busy-polls its ring
//! for completions instead of sleeping on the completion channel. `scripts/demo` runs both.

use std::time::{Duration, Instant};

use rdmad_client::proxy::Options;
use rdmad_client::queue_pair::{QueuePairRing, Wait};
use rdmad_client::ring::{Opcode, RegionSge, Status, Submission};

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
    let role = args.get(1).map(String::as_str).unwrap_or("");
    if role != "ping" && role != "pong" {
        eprintln!("usage: ping-pong ping|pong [ITERATIONS] [SIZE] [--spin]");
        std::process::exit(2);
    }
    let iterations: u64 = args.get(2).map_or(Ok(1000), |s| s.parse())?;
    let size: u32 = args.get(3).map_or(Ok(64), |s| s.parse())?;

    let mut side = common::setup(4096, Options::new()).await?;
    let mut stdin = std::io::stdin().lines();
    let peer = side.connect_over_stdio(&mut stdin).await?;
    let (device, region, buffer, ring) = (&side.device, side.region, &side.buffer, &mut side.ring);
    eprintln!(
        "{role}: {device} QPN {} connected to {}/{}",
        side.qp.endpoint().await?.qp_num,
        peer.gid,
        peer.qp_num
    );

    // Messages go out from offset 0 and come in at offset 2048.
    let (send_at, recv_at) = (0, 2048);
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
        rtts.sort();
        let median = rtts[rtts.len() / 2];
        let p99 = rtts[(rtts.len() * 99 / 100).min(rtts.len() - 1)];
        println!(
            "ping-pong: {iterations} round trips of {size} B on {device}: median {:.1} µs, p99 {:.1} µs (one way ≈ {:.1} µs); {}",
            median.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            median.as_secs_f64() * 1e6 / 2.0,
            common::conditions(wait)
        );
    }
    Ok(())
}
