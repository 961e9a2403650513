//! RDMA WRITE bandwidth between two processes through queue pairs rdmad created.
//!
//! ```text
//! bandwidth sink                      export a 1 MiB region for the peer's writes
//! bandwidth source [SIZE] [COUNT] [OFFSET]
//!                                     write COUNT messages of SIZE bytes into it, at
//!                                     OFFSET bytes into the export (default 0)
//! ```
//!
//! `--spin` (either role) busy-polls the ring for completions instead of sleeping.
//!
//! Both print their endpoint as one JSON line on stdout and read the peer's from stdin.
//! The sink then prints `{"addr":…,"rkey":…,"len":…}` of its export, which the source
//! reads as its second line; the sink exits when its stdin closes. `scripts/demo` runs
//! both.
//!
//! The source then copies the same bytes with `memcpy` in its own memory, the raw
//! alternative, with the same alignment as the writes': the source at a page boundary (as
//! a region's memory is), the target OFFSET bytes past one. (Some CPUs' string copy, which
//! `memcpy` uses at these sizes, is over ten times slower when the target lies a few bytes
//! past the source modulo 4 KiB; a baseline in whatever alignment the allocator gave would
//! measure that, not the copy.)

use std::time::{Duration, Instant};

use rdmad_client::proxy::{Options, RegionProxy};
use rdmad_client::ring::{Opcode, RegionSge, Status, Submission};
use zbus::zvariant::Value;

const REGION: u64 = 1 << 20;
const DEPTH: u32 = 64;

mod common;

const PAGE: usize = 4096;

/// The `len` bytes of `buf` that start `skew` bytes past a page boundary.
fn page_offset(buf: &mut [u8], skew: usize, len: usize) -> &mut [u8] {
    let start = buf.as_ptr().align_offset(PAGE) + skew;
    &mut buf[start..start + len]
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (args, wait) = common::args_and_wait();
    let role = args.get(1).map(String::as_str).unwrap_or("");
    if role != "sink" && role != "source" {
        eprintln!("usage: bandwidth sink | bandwidth source [SIZE] [COUNT] [OFFSET] [--spin]");
        std::process::exit(2);
    }
    let size: u32 = args.get(2).map_or(Ok(65536), |s| s.parse())?;
    let count: u64 = args.get(3).map_or(Ok(2000), |s| s.parse())?;
    let offset: u64 = args.get(4).map_or(Ok(0), |s| s.parse())?;
    if u64::from(size) > REGION || size == 0 {
        return Err(format!("SIZE must be 1 to {REGION}").into());
    }
    // SIZE is at most REGION here, so this cannot overflow whatever OFFSET is.
    if offset > REGION - u64::from(size) {
        return Err(format!("OFFSET + SIZE must be at most {REGION}").into());
    }

    let mut options = Options::new();
    options.insert("send_depth", Value::from(DEPTH));
    let mut side = common::setup(REGION, options).await?;
    let mut lines = std::io::stdin().lines();
    side.connect_over_stdio(&mut lines).await?;
    let (device, region, ring) = (&side.device, side.region, &mut side.ring);

    if role == "sink" {
        let r = RegionProxy::builder(&side.connection)
            .path(side.region_path.clone())?
            .build()
            .await?;
        let mut options = Options::new();
        options.insert("access", Value::from("w"));
        let (addr, rkey, len, _) = r.export_remote(&side.qp_path.as_ref(), options).await?;
        println!(
            "{}",
            serde_json::json!({"addr": addr, "rkey": rkey, "len": len})
        );
        // Keep the region (and so the export) until the source is done.
        for _ in lines {}
        return Ok(());
    }

    let export: serde_json::Value = serde_json::from_str(&lines.next().ok_or("no export")??)?;
    let (addr, rkey) = (
        export["addr"].as_u64().ok_or("addr")?,
        export["rkey"].as_u64().ok_or("rkey")? as u32,
    );
    let write = |wr_id: u64| Submission {
        remote_addr: addr + offset,
        rkey,
        ..Submission::new(
            Opcode::Write,
            wr_id,
            RegionSge {
                region,
                offset: 0,
                length: size,
            },
        )
    };
    let start = Instant::now();
    let (mut posted, mut done) = (0u64, 0u64);
    while done < count {
        while posted < count && posted - done < u64::from(DEPTH) {
            if ring.submit(&write(posted))?.is_err() {
                break;
            }
            posted += 1;
        }
        let c = ring
            .wait_with(wait, Duration::from_secs(30))?
            .ok_or("no completion within 30 s")?;
        if c.status != Status::Success {
            return Err(format!("write {}: {:?}", c.wr_id, c.status).into());
        }
        done += 1;
    }
    let seconds = start.elapsed().as_secs_f64();
    // The raw alternative in the same run: the same bytes copied by this process, aligned
    // as the writes are.
    let (len, skew) = (size as usize, (offset % PAGE as u64) as usize);
    let (mut from_buf, mut to_buf) = (vec![1u8; len + PAGE], vec![0u8; len + 2 * PAGE]);
    let from = &*page_offset(&mut from_buf, 0, len);
    let to = page_offset(&mut to_buf, skew, len);
    let copy_start = Instant::now();
    for _ in 0..count {
        to.copy_from_slice(std::hint::black_box(from));
        std::hint::black_box(&mut *to);
    }
    let copy_seconds = copy_start.elapsed().as_secs_f64();
    println!(
        "memcpy: {count} copies of {size} B in this process, the target {skew} B past a page \
         boundary as the writes' is: {:.1} MB/s",
        (count * u64::from(size)) as f64 / copy_seconds / 1e6
    );
    println!(
        "bandwidth: {count} RDMA WRITEs of {size} B on {device}: {:.1} MB/s, {:.0} messages/s; {}",
        (count * u64::from(size)) as f64 / seconds / 1e6,
        count as f64 / seconds,
        common::conditions(wait)
    );
    Ok(())
}
