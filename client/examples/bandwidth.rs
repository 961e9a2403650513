//! RDMA WRITE bandwidth between two processes through queue pairs rdmad created.
//!
//! ```text
//! bandwidth sink                      export a 1 MiB region for the peer's writes
//! bandwidth source [SIZE] [COUNT]     write COUNT messages of SIZE bytes into it
//! ```
//!
//! Both print their endpoint as one JSON line on stdout and read the peer's from stdin.
//! The sink then prints `{"addr":…,"rkey":…,"len":…}` of its export, which the source
//! reads as its second line; the sink exits when its stdin closes. `scripts/demo` runs
//! both.

use std::io::BufRead;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use rdmad_client::names::object_id;
use rdmad_client::proxy::{ManagerProxy, Options, QueuePairProxy, RegionProxy, SessionProxy};
use rdmad_client::queue_pair::QueuePairRing;
use rdmad_client::ring::{Opcode, RegionSge, Status, Submission};
use rdmad_client::types::Endpoint;
use zbus::zvariant::Value;

const REGION: u64 = 1 << 20;
const DEPTH: u32 = 64;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let role = args.get(1).map(String::as_str).unwrap_or("");
    if role != "sink" && role != "source" {
        eprintln!("usage: bandwidth sink | bandwidth source [SIZE] [COUNT]");
        std::process::exit(2);
    }
    let size: u32 = args.get(2).map_or(Ok(65536), |s| s.parse())?;
    let count: u64 = args.get(3).map_or(Ok(2000), |s| s.parse())?;
    if u64::from(size) > REGION || size == 0 {
        return Err(format!("SIZE must be 1 to {REGION}").into());
    }

    let connection = rdmad_client::connect(None).await?;
    let manager = ManagerProxy::new(&connection).await?;
    let session = SessionProxy::builder(&connection)
        .path(manager.open_session(Options::new()).await?)?
        .build()
        .await?;
    let device = manager
        .list_devices()
        .await?
        .first()
        .ok_or("no device")?
        .name
        .clone();
    let (region_path, fd, _) = session
        .allocate_region("default", REGION, Options::new())
        .await?;
    drop(OwnedFd::from(fd));
    let region = object_id(region_path.as_str()).ok_or("region id")?;
    let mut options = Options::new();
    options.insert("send_depth", Value::from(DEPTH));
    let (qp_path, ring_fd, doorbell, completions, info) =
        session.create_queue_pair(&device, options).await?;
    let mut ring = QueuePairRing::new(ring_fd.into(), doorbell.into(), completions.into(), info)?;
    let qp = QueuePairProxy::builder(&connection)
        .path(qp_path.clone())?
        .build()
        .await?;

    println!("{}", serde_json::to_string(&qp.endpoint().await?)?);
    let mut lines = std::io::stdin().lock().lines();
    let peer: Endpoint = serde_json::from_str(&lines.next().ok_or("no peer endpoint")??)?;
    qp.connect(&peer, Options::new()).await?;

    if role == "sink" {
        let r = RegionProxy::builder(&connection)
            .path(region_path)?
            .build()
            .await?;
        let mut options = Options::new();
        options.insert("access", Value::from("w"));
        let (addr, rkey, len, _) = r.export_remote(&qp_path.as_ref(), options).await?;
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
        opcode: Opcode::Write,
        wr_id,
        signaled: true,
        imm: None,
        remote_addr: addr,
        rkey,
        compare_add: 0,
        swap: 0,
        sges: vec![RegionSge {
            region,
            offset: 0,
            length: size,
        }],
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
            .wait(Duration::from_secs(30))?
            .ok_or("no completion within 30 s")?;
        if c.status != Status::Success {
            return Err(format!("write {}: {:?}", c.wr_id, c.status).into());
        }
        done += 1;
    }
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "bandwidth: {count} RDMA WRITEs of {size} B on {device}: {:.1} MB/s, {:.0} messages/s",
        (count * u64::from(size)) as f64 / seconds / 1e6,
        count as f64 / seconds
    );
    Ok(())
}
