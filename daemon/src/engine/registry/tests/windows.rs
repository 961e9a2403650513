//! Windows and their memory: which goes first on every teardown path, and what a device
//! refuses to destroy.

use super::*;

/// A queue pair made on the device directly, served by no data-path worker, with a
/// registered buffer: the remote peer of a session's queue pair.
struct Peer {
    // Field order is drop order.
    qp: Arc<dyn crate::provider::QueuePair>,
    cq: Arc<dyn crate::provider::CompletionQueue>,
    mr: Arc<dyn MemoryRegion>,
}

impl Peer {
    /// Connects a new peer and `record` to each other.
    fn connect_to(entry: &DeviceEntry, record: &QueuePairRecord) -> Peer {
        use crate::memory::SharedMemory;
        use crate::provider::{Access, QpInit, RemoteEndpoint, RtrAttributes, RtsAttributes};
        let cq = entry.pd.create_cq(16).unwrap();
        let qp = entry
            .pd
            .create_qp(QpInit {
                send_cq: Arc::clone(&cq),
                recv_cq: Arc::clone(&cq),
                max_send_wr: 8,
                max_recv_wr: 8,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            })
            .unwrap();
        let memory = Arc::new(SharedMemory::create(c"peer", 4096).unwrap());
        let mr = entry.pd.register(memory, Access::LOCAL_WRITE).unwrap();
        let psn = 0x1234;
        record
            .connect(
                entry.device.as_ref(),
                RemoteEndpoint {
                    gid: record.local.gid,
                    qp_num: qp.qp_num(),
                    psn,
                    lid: record.local.lid,
                },
            )
            .unwrap();
        qp.to_init(record.local.port, Access::LOCAL_WRITE).unwrap();
        qp.to_rtr(
            &RemoteEndpoint {
                gid: record.local.gid,
                qp_num: record.local.qp_num,
                psn: record.local.psn,
                lid: record.local.lid,
            },
            &RtrAttributes {
                port: record.local.port,
                sgid_index: record.local.gid_index,
                path_mtu: record.local.mtu,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
            },
        )
        .unwrap();
        qp.to_rts(&RtsAttributes {
            psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
        })
        .unwrap();
        Peer { qp, cq, mr }
    }

    /// RDMA WRITEs 8 bytes to `addr` through `rkey`; returns how the device answered.
    fn write(&self, addr: u64, rkey: u32) -> crate::provider::WcStatus {
        use crate::provider::{SendOp, SendWr, Sge};
        self.qp
            .post_send(&[SendWr {
                wr_id: 1,
                op: SendOp::Write {
                    remote_addr: addr,
                    rkey,
                    imm: None,
                },
                sges: smallvec::smallvec![Sge {
                    addr: self.mr.addr(),
                    length: 8,
                    lkey: self.mr.lkey(),
                }],
                signaled: true,
                inline: false,
            }])
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut wcs = Vec::new();
        while wcs.is_empty() {
            assert!(std::time::Instant::now() < deadline, "no completion");
            self.cq.poll(&mut wcs, 1).unwrap();
        }
        wcs[0].status
    }
}

/// A session of `who`'s with a queue pair connected to a new peer, and a region of `pool`
/// exported through it for the peer to write.
struct Exported {
    session: SessionId,
    qp: QpId,
    record: Arc<QueuePairRecord>,
    peer: Peer,
    region: RegionId,
    export: ExportId,
    addr: u64,
    rkey: u32,
}

fn exported(who: &Tenant, pool: &Arc<Pool>) -> Exported {
    let session = who.open_session();
    let qp = who.create_qp(session);
    let record = who.engine.registry.own_qp(&who.owner, qp).unwrap();
    let peer = Peer::connect_to(&who.engine.devices()[0], &record);
    let region = who.allocate(session, pool, 4096).unwrap().region;
    let (export, addr, rkey, _) = who.export(region, qp, REMOTE_WRITE).unwrap();
    Exported {
        session,
        qp,
        record,
        peer,
        region,
        export,
        addr,
        rkey,
    }
}

/// On every path that ends an export's window — ReleaseExport, freeing the region,
/// destroying the queue pair, closing the session (its client died), closing every
/// session (shutdown) — the window is deallocated before the region's registration is
/// dropped, even while the queue pair it was bound through is still held elsewhere, as
/// by a data-path worker that did not let go of it in time. The peer's old rkey gets a
/// remote access error at once, the registration is really deregistered (nothing
/// lingers: the loopback device, like rxe, refuses to deregister an MR with a bound
/// window), and once the queue pair is let go of, nothing is left.
#[test]
fn windows_go_before_their_memory_on_every_path() {
    use crate::provider::WcStatus;
    let engine = engine_on(ProviderChoice::Loopback, COLD_POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let device = Arc::clone(&engine.devices()[0].device);
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let baseline = device.object_counts();
    for path in ["release", "free", "destroy", "close", "close all"] {
        let Exported {
            session: s,
            qp,
            record,
            peer,
            region,
            export,
            addr,
            rkey,
        } = exported(&alice, &pool);
        assert_eq!(peer.write(addr, rkey), WcStatus::Success, "{path}");
        let with_region = device.object_counts();
        match path {
            "release" => engine.release_export(&alice.owner, region, export).unwrap(),
            "free" => {
                alice.free(region).unwrap();
            }
            "destroy" => {
                engine.destroy_qp(&alice.owner, qp).unwrap();
            }
            "close" => assert_eq!(engine.close_sessions_of(":1.1").sessions, [s]),
            _ => assert_eq!(engine.close_all().sessions, [s]),
        }
        let now = device.object_counts();
        assert_eq!(now.mws, baseline.mws, "{path}: the window is gone");
        assert!(
            engine.lingering().is_empty(),
            "{path}: {:?}",
            engine.lingering()
        );
        let region_gone = matches!(path, "free" | "close" | "close all");
        assert_eq!(
            now.mrs,
            with_region.mrs - u64::from(region_gone),
            "{path}: the region's registration is deregistered with it"
        );
        assert_eq!(
            now.qps, with_region.qps,
            "{path}: the queue pair is still held (by `record`, as by a slow worker)"
        );
        assert_eq!(
            peer.write(addr, rkey),
            WcStatus::RemoteAccessError,
            "{path}: the old rkey"
        );
        drop(record);
        drop(peer);
        engine.close_sessions_of(":1.1");
        assert_eq!(device.object_counts(), baseline, "{path}: nothing is left");
    }
}

/// What a device refuses to destroy is not dropped on the floor: a registration whose
/// deregistration failed (here: a window still bound over it, which the registry never
/// lets happen by itself) is kept, counted, shown in the status line, and retried after
/// every teardown until the device accepts.
#[test]
fn a_refused_deregistration_lingers_and_is_retried() {
    use crate::provider::{ObjectKind, WcStatus};
    let engine = engine_on(ProviderChoice::Loopback, COLD_POOL);
    let pool = Arc::clone(engine.pool("p").unwrap());
    let device = Arc::clone(&engine.devices()[0].device);
    let alice = Tenant::new(&engine, caller(1000, ":1.1"));
    let baseline = device.object_counts();
    let Exported {
        record,
        peer,
        region,
        export,
        addr,
        rkey,
        ..
    } = exported(&alice, &pool);
    // Keep the window, let go of the registration it is bound over, free the region.
    let (_, taken) = engine
        .registry
        .remove_export(&alice.owner, region, export)
        .unwrap();
    let TakenWindow {
        window,
        bound_through,
        over,
    } = taken;
    drop(over);
    alice.free(region).unwrap();
    let lingering = engine.lingering();
    assert_eq!(lingering.len(), 1, "{lingering:?}");
    let (name, l) = &lingering[0];
    assert_eq!(
        (name.as_str(), l.kind, l.len),
        ("loopback0", ObjectKind::Mr, 4096)
    );
    assert!(l.error.contains("ibv_dereg_mr"), "{}", l.error);
    assert_eq!(
        l.attempts, 2,
        "refused on the free, and by the retry after it"
    );
    assert!(
        engine
            .status_line()
            .contains("1 object the device refused to destroy"),
        "{}",
        engine.status_line()
    );
    assert_eq!(
        peer.write(addr, rkey),
        WcStatus::Success,
        "as on rxe, the window still works while the registration stays"
    );
    assert_eq!(engine.retry_lingering(), 1, "still refused");
    assert_eq!(engine.lingering()[0].1.attempts, 3);

    drop(window);
    drop(bound_through);
    drop(peer);
    drop(record);
    // The next teardown retries: the registration goes.
    engine.close_sessions_of(":1.1");
    assert!(engine.lingering().is_empty());
    assert_eq!(device.object_counts(), baseline);
}
