use std::time::{Duration, Instant};

use super::*;
use crate::provider::{
    conformance, conformance_data, QpState, RecvWr, RemoteEndpoint, RtrAttributes, RtsAttributes,
    SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

#[test]
fn loopback_conformance() {
    conformance::run_all(&LoopbackDevice::new(DEFAULT_NAME));
}

#[test]
fn loopback_data_path_conformance() {
    let dev = LoopbackDevice::new(DEFAULT_NAME);
    conformance_data::run_all(&dev);
    assert_eq!(dev.object_counts(), ObjectCounts::default());
}

#[test]
fn deregistered_keys_stop_resolving_and_bounds_are_checked() {
    let dev = LoopbackDevice::new("lo-test");
    let pd = dev.alloc_pd().unwrap();
    let mem = Arc::new(SharedMemory::create(c"t", 8192).unwrap());
    let mr = pd.register(Arc::clone(&mem), Access::LOCAL_WRITE).unwrap();
    let (lkey, addr) = (mr.lkey(), mr.addr());
    dev.check_local_access(lkey, addr, 8192, Access::LOCAL_WRITE)
        .unwrap();
    dev.check_local_access(lkey, addr + 4096, 4096, Access::NONE)
        .unwrap();
    assert!(dev
        .check_local_access(lkey, addr + 4096, 4097, Access::NONE)
        .is_err());
    assert!(dev
        .check_local_access(lkey, addr - 1, 2, Access::NONE)
        .is_err());
    assert!(dev
        .check_local_access(lkey, addr, 8, Access::REMOTE_READ)
        .is_err());
    assert!(dev
        .check_local_access(lkey ^ 0x100, addr, 8, Access::NONE)
        .is_err());
    drop(mr);
    assert!(dev.check_local_access(lkey, addr, 8, Access::NONE).is_err());
}

const ALL_REMOTE: Access = Access::REMOTE_WRITE
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

/// One QP with its CQ and a registered buffer. Field order is drop order. (The data path's
/// tests use these ends too.)
pub(crate) struct End {
    pub(crate) qp: Arc<dyn QueuePair>,
    pub(crate) cq: Arc<dyn CompletionQueue>,
    pub(crate) mr: Arc<dyn MemoryRegion>,
    pd: Arc<dyn ProtectionDomain>,
}

pub(crate) struct Opts {
    pub(crate) depth: u32,
    pub(crate) cq_depth: u32,
    pub(crate) mr_access: Access,
    pub(crate) qp_access: Access,
    pub(crate) rnr_retry: u8,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    /// Bytes of each end's registered memory.
    pub(crate) mem: usize,
    /// Each QP's `max_inline_data`.
    pub(crate) inline: u32,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            depth: 16,
            cq_depth: 64,
            mr_access: Access::LOCAL_WRITE | Access::MW_BIND,
            qp_access: ALL_REMOTE,
            rnr_retry: 7,
            timeout: 14,
            retry_cnt: 7,
            mem: 8192,
            inline: 0,
        }
    }
}

impl End {
    fn new(dev: &LoopbackDevice, pd: Option<&Arc<dyn ProtectionDomain>>, opts: &Opts) -> End {
        let pd = pd.map_or_else(|| dev.alloc_pd().unwrap(), Arc::clone);
        let mem = Arc::new(SharedMemory::create(c"lo-qp", opts.mem).unwrap());
        let mr = pd.register(mem, opts.mr_access).unwrap();
        let cq = pd.create_cq(opts.cq_depth).unwrap();
        let qp = pd
            .create_qp(QpInit {
                send_cq: Arc::clone(&cq),
                recv_cq: Arc::clone(&cq),
                max_send_wr: opts.depth,
                max_recv_wr: opts.depth,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline_data: opts.inline,
            })
            .unwrap();
        End { qp, cq, mr, pd }
    }

    fn endpoint(&self) -> RemoteEndpoint {
        RemoteEndpoint {
            gid: std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
            qp_num: self.qp.qp_num(),
            psn: 0,
            lid: 0,
        }
    }

    fn connect(&self, remote: &RemoteEndpoint, opts: &Opts) {
        self.qp.to_init(1, opts.qp_access).unwrap();
        self.qp.to_rtr(remote, &rtr()).unwrap();
        self.qp.to_rts(&rts(opts)).unwrap();
    }

    fn sge(&self, offset: u64, length: u32) -> Sge {
        Sge {
            addr: self.mr.addr() + offset,
            length,
            lkey: self.mr.lkey(),
        }
    }

    fn post(&self, wr_id: u64, op: SendOp, sges: Vec<Sge>) -> Result<()> {
        Ok(self.qp.post_send(&[SendWr {
            wr_id,
            op,
            sges: sges.into(),
            signaled: true,
            inline: false,
        }])?)
    }

    fn recv(&self, wr_id: u64, sges: Vec<Sge>) -> Result<()> {
        Ok(self.qp.post_recv(&[RecvWr {
            wr_id,
            sges: sges.into(),
        }])?)
    }

    fn polled(&self) -> Vec<WorkCompletion> {
        let mut out = Vec::new();
        self.cq.poll(&mut out, 1000).unwrap();
        out
    }

    fn wait(&self) -> WorkCompletion {
        let start = Instant::now();
        let mut out = Vec::new();
        loop {
            self.cq.poll(&mut out, 1).unwrap();
            if let Some(wc) = out.pop() {
                return wc;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "no completion");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        self.mr.memory().read_at(offset, &mut buf).unwrap();
        buf
    }

    fn bind(&self, mw: &Arc<dyn MemoryWindow>, offset: u64, len: u64, access: Access) -> WcStatus {
        self.post(
            900,
            SendOp::BindMw {
                mw: Arc::clone(mw),
                mr: Arc::clone(&self.mr),
                addr: self.mr.addr() + offset,
                len,
                access,
            },
            vec![],
        )
        .unwrap();
        let wc = self.wait();
        assert_eq!(wc.opcode, WcOpcode::BindMw);
        wc.status
    }
}

fn rtr() -> RtrAttributes {
    RtrAttributes {
        port: 1,
        sgid_index: 1,
        path_mtu: 4096,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 1,
    }
}

fn rts(opts: &Opts) -> RtsAttributes {
    RtsAttributes {
        psn: 0,
        timeout: opts.timeout,
        retry_cnt: opts.retry_cnt,
        rnr_retry: opts.rnr_retry,
        max_rd_atomic: 1,
    }
}

pub(crate) fn pair(dev: &LoopbackDevice, opts: &Opts) -> (End, End) {
    pair_into(dev, None, opts)
}

/// Two connected ends, the second in `pd` (a PD of its own if `None`).
fn pair_into(
    dev: &LoopbackDevice,
    pd: Option<&Arc<dyn ProtectionDomain>>,
    opts: &Opts,
) -> (End, End) {
    let a = End::new(dev, None, opts);
    let b = End::new(dev, pd, opts);
    a.connect(&b.endpoint(), opts);
    b.connect(&a.endpoint(), opts);
    (a, b)
}

fn send(_wr_id: u64) -> SendOp {
    SendOp::Send { imm: None }
}

fn is_invalid<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(r, Err(ProviderError::InvalidArgument { .. }))
}

fn is_enomem<T: std::fmt::Debug>(r: Result<T>) -> bool {
    matches!(&r, Err(ProviderError::Os { source, .. }) if source.raw_os_error() == Some(libc::ENOMEM))
}

#[test]
fn state_machine_refuses_wrong_transitions_and_early_posts() {
    let dev = LoopbackDevice::new("lo-sm");
    let opts = Opts::default();
    let a = End::new(&dev, None, &opts);
    let b = End::new(&dev, None, &opts);
    let qp = &a.qp;
    assert_eq!(qp.state().unwrap(), QpState::Reset);
    assert!(is_invalid(qp.to_rtr(&b.endpoint(), &rtr())));
    assert!(is_invalid(qp.to_rts(&rts(&opts))));
    assert!(is_invalid(a.recv(1, vec![])), "recv in RESET");
    assert!(is_invalid(a.post(1, send(1), vec![])), "send in RESET");
    assert!(is_invalid(qp.to_init(2, ALL_REMOTE)), "bad port");
    qp.to_init(1, ALL_REMOTE).unwrap();
    qp.to_init(1, ALL_REMOTE).unwrap(); // INIT → INIT is allowed
    a.recv(1, vec![]).unwrap(); // receives may be posted from INIT on
    assert!(is_invalid(a.post(1, send(1), vec![])), "send in INIT");
    assert!(is_invalid(qp.to_rts(&rts(&opts))));
    let mut bad = rtr();
    bad.sgid_index = 7;
    assert!(is_invalid(qp.to_rtr(&b.endpoint(), &bad)));
    bad = rtr();
    bad.path_mtu = 1000;
    assert!(is_invalid(qp.to_rtr(&b.endpoint(), &bad)));
    qp.to_rtr(&b.endpoint(), &rtr()).unwrap();
    assert!(is_invalid(a.post(1, send(1), vec![])), "send in RTR");
    assert!(is_invalid(qp.to_init(1, ALL_REMOTE)));
    let mut bad_rts = rts(&opts);
    bad_rts.rnr_retry = 8;
    assert!(is_invalid(qp.to_rts(&bad_rts)));
    qp.to_rts(&rts(&opts)).unwrap();
    qp.to_rts(&rts(&opts)).unwrap(); // RTS → RTS is allowed
    assert!(is_invalid(qp.to_rtr(&b.endpoint(), &rtr())));
    qp.to_error().unwrap();
    assert_eq!(qp.state().unwrap(), QpState::Error);
    let flushed = a.polled();
    assert_eq!(flushed.len(), 1);
    assert_eq!(
        (flushed[0].wr_id, flushed[0].status, flushed[0].opcode),
        (1, WcStatus::WrFlushError, WcOpcode::Recv)
    );
    assert!(is_invalid(qp.to_rts(&rts(&opts))));
    // Work posted to an ERROR QP is accepted and flushed.
    a.post(5, send(5), vec![]).unwrap();
    a.recv(6, vec![]).unwrap();
    let flushed = a.polled();
    assert_eq!(
        flushed
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect::<Vec<_>>(),
        [(5, WcStatus::WrFlushError), (6, WcStatus::WrFlushError)]
    );
}

#[test]
fn qp_numbers_are_unique_24_bit() {
    let dev = LoopbackDevice::new("lo-qpn");
    let opts = Opts::default();
    let ends: Vec<End> = (0..8).map(|_| End::new(&dev, None, &opts)).collect();
    let mut nums: Vec<u32> = ends.iter().map(|e| e.qp.qp_num()).collect();
    assert!(nums.iter().all(|&n| n > 1 && n <= 0xff_ffff));
    nums.sort_unstable();
    nums.dedup();
    assert_eq!(nums.len(), 8);
    assert_eq!(dev.object_counts().qps, 8);
    drop(ends);
    assert_eq!(dev.object_counts(), ObjectCounts::default());
}

/// A SEND or WRITE marked inline within the QP's `max_inline_data` runs like any other;
/// one beyond it, or a READ marked inline, is refused when posted (rxe: EINVAL) and
/// nothing of it runs.
#[test]
fn inline_requests_are_held_to_the_qps_max_inline_data() {
    let dev = LoopbackDevice::new("lo-inline");
    let opts = Opts {
        inline: 16,
        mr_access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        ..Opts::default()
    };
    let (a, b) = pair(&dev, &opts);
    a.mr.memory().write_at(0, b"sixteen bytes!!!+").unwrap();
    let inline = |wr_id, op, sges: Vec<Sge>| {
        a.qp.post_send(&[SendWr {
            wr_id,
            op,
            sges: sges.into(),
            signaled: true,
            inline: true,
        }])
    };
    b.recv(10, vec![b.sge(0, 64)]).unwrap();
    inline(1, send(1), vec![a.sge(0, 16)]).unwrap();
    assert_eq!((a.wait().wr_id, b.wait().byte_len), (1, 16));
    assert_eq!(b.read(0, 16), b"sixteen bytes!!!");
    let write = SendOp::Write {
        remote_addr: b.mr.addr() + 100,
        rkey: b.mr.rkey(),
        imm: None,
    };
    inline(2, write.clone(), vec![a.sge(0, 8)]).unwrap();
    assert_eq!(a.wait().status, WcStatus::Success);
    assert_eq!(b.read(100, 8), b"sixteen ");
    for (op, len) in [
        (write, 17),
        (
            SendOp::Read {
                remote_addr: b.mr.addr(),
                rkey: b.mr.rkey(),
            },
            8,
        ),
    ] {
        let refused = inline(3, op, vec![a.sge(0, len)]).unwrap_err();
        assert_eq!(refused.posted, 0);
        assert!(
            matches!(refused.error, ProviderError::InvalidArgument { .. }),
            "{refused:?}"
        );
    }
    // Loopback runs what it takes while it is posted: nothing was taken.
    assert!(a.polled().is_empty(), "a refused request never completes");
    assert_eq!(b.read(100, 9), b"sixteen \0");
}

#[test]
fn send_waits_for_a_receive_then_delivers_in_order() {
    let dev = LoopbackDevice::new("lo-rnr");
    let (a, b) = pair(&dev, &Opts::default());
    a.mr.memory().write_at(0, b"first second").unwrap();
    a.post(1, SendOp::Send { imm: Some(9) }, vec![a.sge(0, 5)])
        .unwrap();
    a.post(2, send(2), vec![a.sge(6, 6)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        a.polled().is_empty(),
        "RNR: nothing completes without a receive"
    );
    assert!(b.polled().is_empty());
    b.recv(10, vec![b.sge(0, 64)]).unwrap();
    let got = b.wait();
    assert_eq!(
        (got.wr_id, got.status, got.byte_len, got.imm),
        (10, WcStatus::Success, 5, Some(9))
    );
    assert_eq!(a.wait().wr_id, 1);
    assert!(
        a.polled().is_empty(),
        "the second send waits for the next receive"
    );
    b.recv(11, vec![b.sge(100, 64)]).unwrap();
    assert_eq!(b.wait().wr_id, 11);
    assert_eq!(a.wait().wr_id, 2);
    assert_eq!(b.read(0, 5), b"first");
    assert_eq!(b.read(100, 6), b"second");
}

#[test]
fn finite_rnr_retry_gives_up() {
    let dev = LoopbackDevice::new("lo-rnr-finite");
    let opts = Opts {
        rnr_retry: 2,
        ..Opts::default()
    };
    let (a, _b) = pair(&dev, &opts);
    a.post(1, send(1), vec![]).unwrap();
    a.post(2, send(2), vec![]).unwrap();
    let wc = a.wait();
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RnrRetryExceeded));
    assert_eq!(a.wait().status, WcStatus::WrFlushError);
    assert_eq!(a.qp.state().unwrap(), QpState::Error);

    let opts = Opts {
        rnr_retry: 0,
        ..Opts::default()
    };
    let (a, _b) = pair(&dev, &opts);
    a.post(3, send(3), vec![]).unwrap();
    assert_eq!(a.polled()[0].status, WcStatus::RnrRetryExceeded);
}

#[test]
fn missing_peer_is_retry_exceeded() {
    let dev = LoopbackDevice::new("lo-nopeer");
    let opts = Opts {
        timeout: 1,
        ..Opts::default()
    };
    let a = End::new(&dev, None, &opts);
    let mut nowhere = a.endpoint();
    nowhere.qp_num = 0xabcdef;
    a.connect(&nowhere, &opts);
    a.post(1, send(1), vec![]).unwrap();
    let wc = a.wait();
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RetryExceeded));
    assert_eq!(a.qp.state().unwrap(), QpState::Error);
}

#[test]
fn peer_connecting_late_still_receives() {
    // As on a real transport, a request retries until the peer reaches RTR.
    let dev = LoopbackDevice::new("lo-late");
    let opts = Opts::default();
    let a = End::new(&dev, None, &opts);
    let b = End::new(&dev, None, &opts);
    a.connect(&b.endpoint(), &opts);
    a.post(1, send(1), vec![]).unwrap();
    b.qp.to_init(1, ALL_REMOTE).unwrap();
    b.recv(2, vec![]).unwrap();
    assert!(a.polled().is_empty());
    b.qp.to_rtr(&a.endpoint(), &rtr()).unwrap();
    assert_eq!(a.wait().status, WcStatus::Success);
    assert_eq!(b.wait().wr_id, 2);
}

#[test]
fn errors_flush_later_requests_in_order() {
    let dev = LoopbackDevice::new("lo-flush");
    let (a, b) = pair(&dev, &Opts::default());
    // Bad lkey first, then two good sends: the second and third are flushed.
    let mut bad = a.sge(0, 8);
    bad.lkey ^= 0x100;
    a.qp.post_send(&[
        SendWr {
            wr_id: 1,
            op: send(1),
            sges: smallvec::smallvec![bad],
            signaled: true,
            inline: false,
        },
        SendWr {
            wr_id: 2,
            op: send(2),
            sges: smallvec::smallvec![],
            signaled: false,
            inline: false,
        },
        SendWr {
            wr_id: 3,
            op: send(3),
            sges: smallvec::smallvec![],
            signaled: true,
            inline: false,
        },
    ])
    .unwrap();
    let got: Vec<_> = a.polled().iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::LocalProtectionError),
            (2, WcStatus::WrFlushError),
            (3, WcStatus::WrFlushError)
        ]
    );
    // to_error on the receiver flushes its receives.
    b.recv(7, vec![]).unwrap();
    b.recv(8, vec![]).unwrap();
    b.qp.to_error().unwrap();
    let got: Vec<_> = b.polled().iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        [(7, WcStatus::WrFlushError), (8, WcStatus::WrFlushError)]
    );
}

#[test]
fn a_qp_connected_to_itself_fails_its_own_request_first_then_flushes() {
    // The responder error of the first WRITE (a bad rkey) puts the QP in error while its
    // turn runs that very request: its error completion comes first, once, then the
    // flushes of the rest and of the receive.
    let dev = LoopbackDevice::new("lo-self");
    let opts = Opts::default();
    let a = End::new(&dev, None, &opts);
    a.connect(&a.endpoint(), &opts);
    a.recv(9, vec![a.sge(4096, 8)]).unwrap();
    let write = |wr_id, rkey| SendWr {
        wr_id,
        op: SendOp::Write {
            remote_addr: a.mr.addr() + 1024,
            rkey,
            imm: None,
        },
        sges: smallvec::smallvec![a.sge(0, 8)],
        signaled: true,
        inline: false,
    };
    a.qp.post_send(&[write(1, a.mr.rkey() ^ 0x100), write(2, a.mr.rkey())])
        .unwrap();
    let got: Vec<_> = a.polled().iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::RemoteAccessError),
            (2, WcStatus::WrFlushError),
            (9, WcStatus::WrFlushError)
        ]
    );
    assert_eq!(a.qp.state().unwrap(), QpState::Error);
}

#[test]
fn queue_depths_are_enforced() {
    let dev = LoopbackDevice::new("lo-depth");
    let opts = Opts {
        depth: 2,
        ..Opts::default()
    };
    let (a, b) = pair(&dev, &opts);
    // Sends wait (RNR), so they stay outstanding.
    let wrs: Vec<SendWr> = (0..3)
        .map(|i| SendWr {
            wr_id: i,
            op: send(i),
            sges: smallvec::smallvec![],
            signaled: true,
            inline: false,
        })
        .collect();
    // Two fit: the error says so.
    let refused = a.qp.post_send(&wrs).unwrap_err();
    assert_eq!(refused.posted, 2, "{refused}");
    assert!(is_enomem::<()>(Err(refused.error)));
    assert!(is_enomem(a.post(9, send(9), vec![])));
    // Too many SGEs is EINVAL.
    assert!(is_invalid(b.recv(1, vec![b.sge(0, 1); 5])));
    // The two posted sends consume receives and free their slots.
    b.qp.post_recv(&[
        RecvWr {
            wr_id: 1,
            sges: smallvec::smallvec![],
        },
        RecvWr {
            wr_id: 2,
            sges: smallvec::smallvec![],
        },
    ])
    .unwrap();
    assert_eq!(a.polled().len(), 2);
    a.post(3, send(3), vec![]).unwrap();
    // The receive queue holds two.
    let c = End::new(&dev, None, &opts);
    c.qp.to_init(1, ALL_REMOTE).unwrap();
    c.recv(1, vec![]).unwrap();
    c.recv(2, vec![]).unwrap();
    assert!(is_enomem(c.recv(3, vec![])));
}

/// A signaled WRITE `i` of the 8 bytes at `8 i` of `a`'s memory to the same place in `b`'s
/// (whose registration must grant remote write).
fn write_slot(a: &End, b: &End, i: u64) -> SendWr {
    SendWr {
        wr_id: i,
        op: SendOp::Write {
            remote_addr: b.mr.addr() + i * 8,
            rkey: b.mr.rkey(),
            imm: None,
        },
        sges: smallvec::smallvec![a.sge(i * 8, 8)],
        signaled: true,
        inline: false,
    }
}

/// Requests that would complete at once count against the send queue's depth all the
/// same: a call is checked whole, as a device sees the list only when it is rung — with a
/// depth of two, the third WRITE of one call is refused, and only the first two run.
#[test]
fn a_call_is_held_to_the_queue_depth_as_a_whole() {
    let dev = LoopbackDevice::new("lo-depth-whole");
    let opts = Opts {
        depth: 2,
        mr_access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        ..Opts::default()
    };
    let (a, b) = pair(&dev, &opts);
    let writes: Vec<SendWr> = (0..3).map(|i| write_slot(&a, &b, i)).collect();
    let refused = a.qp.post_send(&writes).unwrap_err();
    assert_eq!(refused.posted, 2, "{refused}");
    assert!(is_enomem::<()>(Err(refused.error)));
    let done: Vec<_> = a.polled().iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(done, [(0, WcStatus::Success), (1, WcStatus::Success)]);
    // Once they completed, a call of two fits again.
    a.qp.post_send(&writes[..2]).unwrap();
    assert_eq!(a.polled().len(), 2);
}

#[test]
fn send_larger_than_receive_is_a_length_error() {
    let dev = LoopbackDevice::new("lo-len");
    let (a, b) = pair(&dev, &Opts::default());
    b.recv(1, vec![b.sge(0, 4)]).unwrap();
    a.post(2, send(2), vec![a.sge(0, 8)]).unwrap();
    let wc = b.wait();
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::LocalLengthError));
    assert_eq!(a.wait().status, WcStatus::RemoteInvalidRequestError);
    assert_eq!(a.qp.state().unwrap(), QpState::Error);
    assert_eq!(b.qp.state().unwrap(), QpState::Error);
}

#[test]
fn receive_buffer_must_be_locally_writable() {
    let dev = LoopbackDevice::new("lo-lw");
    let opts = Opts::default();
    let a = End::new(&dev, None, &opts);
    let b = End::new(
        &dev,
        None,
        &Opts {
            mr_access: Access::NONE,
            ..Opts::default()
        },
    );
    a.connect(&b.endpoint(), &opts);
    b.connect(&a.endpoint(), &opts);
    b.recv(1, vec![b.sge(0, 16)]).unwrap();
    a.post(2, send(2), vec![a.sge(0, 8)]).unwrap();
    assert_eq!(b.wait().status, WcStatus::LocalProtectionError);
    assert_eq!(a.wait().status, WcStatus::RemoteOperationError);
    // RDMA READ into a buffer without local write is a local protection error.
    let (a, b) = pair(&dev, &opts);
    let mw = b.pd.alloc_mw(MwType::Type2).unwrap();
    assert_eq!(b.bind(&mw, 0, 4096, Access::REMOTE_READ), WcStatus::Success);
    let ro =
        a.pd.register(Arc::clone(a.mr.memory()), Access::NONE)
            .unwrap();
    let sge = Sge {
        addr: ro.addr(),
        length: 8,
        lkey: ro.lkey(),
    };
    a.post(
        3,
        SendOp::Read {
            remote_addr: b.mr.addr(),
            rkey: mw.rkey(),
        },
        vec![sge],
    )
    .unwrap();
    assert_eq!(a.wait().status, WcStatus::LocalProtectionError);
}

/// Two connected ends whose responder (the second) allows remote reads only.
fn pair_with_a_read_only_responder(dev: &LoopbackDevice) -> (End, End) {
    let opts = Opts::default();
    let a = End::new(dev, None, &opts);
    let b = End::new(dev, None, &opts);
    a.connect(&b.endpoint(), &opts);
    b.connect(
        &a.endpoint(),
        &Opts {
            qp_access: Access::REMOTE_READ,
            ..Opts::default()
        },
    );
    (a, b)
}

#[test]
fn qp_access_flags_gate_remote_operations() {
    let dev = LoopbackDevice::new("lo-qpacc");
    let (a, b) = pair_with_a_read_only_responder(&dev);
    let mw = b.pd.alloc_mw(MwType::Type2).unwrap();
    assert_eq!(b.bind(&mw, 0, 4096, ALL_REMOTE), WcStatus::Success);
    a.post(
        1,
        SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey: mw.rkey(),
            imm: None,
        },
        vec![a.sge(0, 8)],
    )
    .unwrap();
    assert_eq!(a.wait().status, WcStatus::RemoteInvalidRequestError);
    assert_eq!(
        b.qp.state().unwrap(),
        QpState::Error,
        "class C: responder errors too"
    );
    drop(mw);
}

/// A WRITE's checks in rxe's order, whether it moves in one step or not: the requester's
/// own gather list first (its own error; the responder is untouched), then the
/// responder's rights, then the rkey — and a WRITE with immediate that fails at the rkey
/// consumes the receive it took, which completes with the error.
#[test]
fn a_write_checks_its_gather_list_then_the_responders_rights_then_the_rkey() {
    let dev = LoopbackDevice::new("lo-wrorder");
    let opts = Opts::default();
    // A responder that allows no remote write, and a gather list outside every MR.
    let (a, b) = pair_with_a_read_only_responder(&dev);
    let write = SendOp::Write {
        remote_addr: b.mr.addr(),
        rkey: b.mr.rkey(),
        imm: None,
    };
    a.post(1, write, vec![a.sge(opts.mem as u64, 8)]).unwrap();
    assert_eq!(a.wait().status, WcStatus::LocalProtectionError);
    assert_eq!(
        b.qp.state().unwrap(),
        QpState::Rts,
        "the responder saw nothing"
    );
    assert!(b.polled().is_empty());

    // A good gather list, an rkey that is no key, with immediate data: the receive the
    // WRITE took completes with the remote access error, and both QPs are in error.
    let (a, b) = pair(&dev, &opts);
    b.recv(7, vec![b.sge(0, 16)]).unwrap();
    a.post(
        2,
        SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey: b.mr.rkey() ^ 0x100,
            imm: Some(5),
        },
        vec![a.sge(0, 8)],
    )
    .unwrap();
    assert_eq!(a.wait().status, WcStatus::RemoteAccessError);
    let wc = b.wait();
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (7, WcStatus::RemoteAccessError, WcOpcode::RecvRdmaWithImm)
    );
    assert_eq!(b.qp.state().unwrap(), QpState::Error);
    assert_eq!(a.qp.state().unwrap(), QpState::Error);
}

#[test]
fn window_types_keys_and_bounds() {
    let dev = LoopbackDevice::new("lo-mw");
    let opts = Opts::default();
    let (a, b) = pair(&dev, &opts);
    // A second QP in b's PD, connected to a third QP.
    let (c, b2) = pair_into(&dev, Some(&b.pd), &opts);

    let write = |from: &End, to: &End, rkey: u32, offset: u64, len: u32| -> WcStatus {
        from.post(
            1,
            SendOp::Write {
                remote_addr: to.mr.addr() + offset,
                rkey,
                imm: None,
            },
            vec![from.sge(0, len)],
        )
        .unwrap();
        from.wait().status
    };

    // Type 2 bound through b2: usable by c (b2's peer), not through b.
    let mw2 = b.pd.alloc_mw(MwType::Type2).unwrap();
    let before = mw2.rkey();
    assert_eq!(
        b2.bind(&mw2, 0, 8192, Access::REMOTE_WRITE),
        WcStatus::Success
    );
    let rkey = mw2.rkey();
    assert_eq!(rkey >> 8, before >> 8, "same window index");
    assert_eq!(rkey & 0xff, (before + 1) & 0xff, "next variant byte");
    // The window lies over b2's MR: c (b2's peer) writes through it.
    assert_eq!(write(&c, &b2, rkey, 0, 8), WcStatus::Success);
    // Through b (same PD, another QP), at the same address: refused.
    a.post(
        1,
        SendOp::Write {
            remote_addr: b2.mr.addr(),
            rkey,
            imm: None,
        },
        vec![a.sge(0, 8)],
    )
    .unwrap();
    assert_eq!(
        a.wait().status,
        WcStatus::RemoteAccessError,
        "a type-2 window works only through the QP it was bound through"
    );

    // Type 1: allocates, but is not bound with a work request (as the verbs provider).
    let (a, b) = pair(&dev, &opts);
    let mw1 = b.pd.alloc_mw(MwType::Type1).unwrap();
    assert_eq!(mw1.kind(), MwType::Type1);
    let bind1 = SendWr {
        wr_id: 5,
        op: SendOp::BindMw {
            mw: Arc::clone(&mw1),
            mr: Arc::clone(&b.mr),
            addr: b.mr.addr(),
            len: 64,
            access: Access::REMOTE_WRITE,
        },
        sges: smallvec::smallvec![],
        signaled: true,
        inline: false,
    };
    assert!(is_invalid(b.qp.post_send(&[bind1]).map_err(|e| e.error)));
    assert_eq!(
        b.qp.state().unwrap(),
        QpState::Rts,
        "refused at post, not failed"
    );
    // A never-bound type-1 rkey grants nothing.
    assert_eq!(write(&a, &b, mw1.rkey(), 0, 8), WcStatus::RemoteAccessError);
    // A type-1 key cannot be invalidated.
    let (_a, b) = pair(&dev, &opts);
    let mw1 = b.pd.alloc_mw(MwType::Type1).unwrap();
    b.post(6, SendOp::LocalInvalidate { rkey: mw1.rkey() }, vec![])
        .unwrap();
    assert_eq!(b.wait().status, WcStatus::Other(2));
    // Window bounds: [0, 4096) of an 8192-byte MR (stricter than rxe, see qp.rs).
    let (a, b) = pair(&dev, &opts);
    let mw = b.pd.alloc_mw(MwType::Type2).unwrap();
    assert_eq!(
        b.bind(&mw, 0, 4096, Access::REMOTE_WRITE),
        WcStatus::Success
    );
    assert_eq!(
        write(&a, &b, mw.rkey(), 4090, 8),
        WcStatus::RemoteAccessError,
        "beyond the window (inside the MR)"
    );
}

#[test]
fn type2_rebind_invalidate_and_drop() {
    let dev = LoopbackDevice::new("lo-mw2");
    let opts = Opts::default();
    let (a, b) = pair(&dev, &opts);
    let mw = b.pd.alloc_mw(MwType::Type2).unwrap();
    assert_eq!(
        b.bind(&mw, 0, 4096, Access::REMOTE_WRITE),
        WcStatus::Success
    );
    let (a2, b2) = pair(&dev, &opts);
    // A bound type-2 window cannot be bound again.
    let mw_b2 = b2.pd.alloc_mw(MwType::Type2).unwrap();
    assert_eq!(
        b2.bind(&mw_b2, 0, 4096, Access::REMOTE_WRITE),
        WcStatus::Success
    );
    assert_eq!(
        b2.bind(&mw_b2, 0, 4096, Access::REMOTE_WRITE),
        WcStatus::MemoryWindowBindError
    );
    assert_eq!(
        b2.qp.state().unwrap(),
        QpState::Error,
        "a bind error is fatal"
    );
    drop((a2, b2));
    // Invalidate, then bind again: a new key, the old one dead.
    let old = mw.rkey();
    b.post(7, SendOp::LocalInvalidate { rkey: old }, vec![])
        .unwrap();
    assert_eq!(b.wait().status, WcStatus::Success);
    assert_eq!(
        b.bind(&mw, 0, 4096, Access::REMOTE_WRITE),
        WcStatus::Success
    );
    let new = mw.rkey();
    assert_ne!(old, new);
    a.post(
        8,
        SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey: new,
            imm: None,
        },
        vec![a.sge(0, 8)],
    )
    .unwrap();
    assert_eq!(a.wait().status, WcStatus::Success);
    // Dropping the window kills its key.
    drop(mw);
    a.post(
        9,
        SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey: new,
            imm: None,
        },
        vec![a.sge(0, 8)],
    )
    .unwrap();
    assert_eq!(a.wait().status, WcStatus::RemoteAccessError);
}

#[test]
fn bind_needs_mw_bind_on_the_mr() {
    let dev = LoopbackDevice::new("lo-mwbind");
    let opts = Opts {
        mr_access: Access::LOCAL_WRITE,
        ..Opts::default()
    };
    let (_a, b) = pair(&dev, &opts);
    let mw = b.pd.alloc_mw(MwType::Type2).unwrap();
    assert_eq!(
        b.bind(&mw, 0, 4096, Access::REMOTE_WRITE),
        WcStatus::MemoryWindowBindError
    );
}

#[test]
fn mr_with_remote_rights_works_and_misaligned_atomics_fail() {
    let dev = LoopbackDevice::new("lo-mr");
    let opts = Opts {
        mr_access: Access::LOCAL_WRITE | ALL_REMOTE,
        ..Opts::default()
    };
    let (a, b) = pair(&dev, &opts);
    a.post(
        1,
        SendOp::FetchAdd {
            remote_addr: b.mr.addr() + 8,
            rkey: b.mr.rkey(),
            add: 5,
        },
        vec![a.sge(0, 8)],
    )
    .unwrap();
    assert_eq!(a.wait().status, WcStatus::Success);
    assert_eq!(b.read(8, 8), 5u64.to_ne_bytes());
    a.post(
        2,
        SendOp::FetchAdd {
            remote_addr: b.mr.addr() + 4,
            rkey: b.mr.rkey(),
            add: 5,
        },
        vec![a.sge(0, 8)],
    )
    .unwrap();
    assert_eq!(a.wait().status, WcStatus::RemoteInvalidRequestError);
}

#[test]
fn event_fd_wakes_only_when_armed() {
    let dev = LoopbackDevice::new("lo-ev");
    let (a, b) = pair(&dev, &Opts::default());
    assert_eq!(b.cq.acknowledge_events().unwrap(), 0);
    b.recv(1, vec![]).unwrap();
    a.post(1, send(1), vec![]).unwrap();
    assert_eq!(b.cq.acknowledge_events().unwrap(), 0, "not armed: no event");
    assert_eq!(b.polled().len(), 1);
    b.cq.arm().unwrap();
    b.recv(2, vec![]).unwrap();
    b.recv(3, vec![]).unwrap();
    let fd = b.cq.event_fd();
    let poster = {
        let qp = Arc::clone(&a.qp);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            qp.post_send(&[
                SendWr {
                    wr_id: 2,
                    op: send(2),
                    sges: smallvec::smallvec![],
                    signaled: true,
                    inline: false,
                },
                SendWr {
                    wr_id: 3,
                    op: send(3),
                    sges: smallvec::smallvec![],
                    signaled: true,
                    inline: false,
                },
            ])
            .unwrap();
        })
    };
    // Sleep on the descriptor the way a worker does.
    let woke = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move {
            // The CQ (and so the descriptor) outlives this registration, which is all the
            // deprecated constructor's I/O-safety caveat is about.
            #[allow(deprecated)]
            let afd = tokio::io::unix::AsyncFd::new(fd).unwrap();
            tokio::time::timeout(Duration::from_secs(10), afd.readable())
                .await
                .is_ok()
        });
    poster.join().unwrap();
    assert!(woke, "event_fd became readable");
    assert_eq!(b.cq.acknowledge_events().unwrap(), 1, "one event per arm");
    assert_eq!(b.cq.acknowledge_events().unwrap(), 0);
    assert_eq!(b.polled().len(), 2);
}

#[test]
fn cq_overflow_puts_the_qp_in_error() {
    let dev = LoopbackDevice::new("lo-ovf");
    let opts = Opts {
        cq_depth: 2,
        ..Opts::default()
    };
    let (a, _b) = pair(&dev, &opts);
    for i in 0..3 {
        let mw = a.pd.alloc_mw(MwType::Type2).unwrap();
        a.post(
            i,
            SendOp::BindMw {
                mw,
                mr: Arc::clone(&a.mr),
                addr: a.mr.addr(),
                len: 8,
                access: Access::REMOTE_READ,
            },
            vec![],
        )
        .unwrap();
    }
    assert_eq!(a.qp.state().unwrap(), QpState::Error);
    let cq = a.cq.as_any().downcast_ref::<cq::LoopbackCq>().unwrap();
    assert!(cq.inner.overflows() >= 1);
    assert_eq!(a.polled().len(), 2);
}

#[test]
fn two_qps_hammering_each_other_do_not_deadlock() {
    let dev = LoopbackDevice::new("lo-hammer");
    let opts = Opts {
        depth: 64,
        cq_depth: 4096,
        mr_access: Access::LOCAL_WRITE | ALL_REMOTE,
        ..Opts::default()
    };
    let (a, b) = pair(&dev, &opts);
    let a = Arc::new(a);
    let b = Arc::new(b);
    let run = |me: Arc<End>, peer: Arc<End>| {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            // A full queue (ENOMEM) is the device telling us to wait for the peer.
            let retry = |post: &dyn Fn() -> Result<()>, out: &mut Vec<WorkCompletion>| loop {
                match post() {
                    Ok(()) => break,
                    Err(e) => {
                        assert!(is_enomem::<()>(Err(e)));
                        me.cq.poll(out, 100).unwrap();
                        std::thread::yield_now();
                    }
                }
            };
            for i in 0..500u64 {
                retry(&|| me.recv(i, vec![me.sge(0, 64)]), &mut out);
                let write = SendOp::Write {
                    remote_addr: peer.mr.addr() + 128,
                    rkey: peer.mr.rkey(),
                    imm: None,
                };
                retry(
                    &|| me.post(i, write.clone(), vec![me.sge(256, 64)]),
                    &mut out,
                );
                retry(&|| me.post(i, send(i), vec![me.sge(512, 16)]), &mut out);
                me.cq.poll(&mut out, 100).unwrap();
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while out.len() < 1500 && Instant::now() < deadline {
                me.cq.poll(&mut out, 100).unwrap();
                std::thread::yield_now();
            }
            out
        })
    };
    let ta = run(Arc::clone(&a), Arc::clone(&b));
    let tb = run(Arc::clone(&b), Arc::clone(&a));
    let ca = ta.join().unwrap();
    let cb = tb.join().unwrap();
    for out in [&ca, &cb] {
        assert_eq!(out.len(), 1500, "500 writes, 500 sends, 500 receives");
        assert!(out.iter().all(|w| w.status == WcStatus::Success));
    }
    drop((a, b));
    assert_eq!(dev.object_counts(), ObjectCounts::default());
}

#[test]
fn a_completion_polled_frees_its_place_in_the_send_queue() {
    // A's queue holds one SEND. Each waits for B's receive, which B posts from its own
    // thread: B's post runs A's turn there, and A, polling on its thread, posts the next
    // SEND the moment it sees the completion. A completed request must not still count
    // against the queue's depth, or that post fails with ENOMEM.
    const SENDS: u64 = 10_000;
    let dev = LoopbackDevice::new("lo-place");
    let opts = Opts {
        depth: 1,
        ..Opts::default()
    };
    let a = End::new(&dev, None, &opts);
    let b = Arc::new(End::new(&dev, None, &opts));
    a.connect(&b.endpoint(), &opts);
    b.connect(&a.endpoint(), &opts);
    let receiver = {
        let b = Arc::clone(&b);
        std::thread::spawn(move || {
            let mut out = Vec::new();
            for i in 0..SENDS {
                b.recv(i, vec![]).unwrap();
                let deadline = Instant::now() + Duration::from_secs(20);
                while out.len() as u64 <= i {
                    b.cq.poll(&mut out, 1).unwrap();
                    assert!(Instant::now() < deadline, "receive {i} never completed");
                    std::thread::yield_now();
                }
            }
            out
        })
    };
    let mut out = Vec::new();
    for i in 0..SENDS {
        if let Err(e) = a.post(i, send(i), vec![]) {
            panic!(
                "SEND {i}, posted once SEND {} had completed: {e}",
                i.wrapping_sub(1)
            );
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while out.len() as u64 <= i {
            a.cq.poll(&mut out, 1).unwrap();
            assert!(Instant::now() < deadline, "SEND {i} never completed");
            std::hint::spin_loop();
        }
    }
    let received = receiver.join().unwrap();
    assert_eq!(received.len() as u64, SENDS);
    assert!(out
        .iter()
        .chain(&received)
        .all(|w| w.status == WcStatus::Success));
}

#[test]
fn counts_are_exact_whatever_the_drop_order() {
    let dev = LoopbackDevice::new("lo-counts");
    let (a, b) = pair(&dev, &Opts::default());
    let mw = b.pd.alloc_mw(MwType::Type2).unwrap();
    assert_eq!(b.bind(&mw, 0, 64, Access::REMOTE_READ), WcStatus::Success);
    a.post(1, send(1), vec![]).unwrap(); // left waiting (RNR)
    let counts = dev.object_counts();
    assert_eq!(
        (counts.pds, counts.mrs, counts.mws, counts.cqs, counts.qps),
        (2, 2, 1, 2, 2)
    );
    let End { qp, cq, mr, pd } = b;
    drop(pd);
    drop(mr); // refused, as by rxe: the window is bound over it
    assert_eq!(dev.lingering().len(), 1);
    drop(cq);
    drop(qp); // the waiting send on a now times out
    drop(mw);
    assert_eq!(
        dev.retry_lingering(),
        0,
        "the window is gone: the MR goes too"
    );
    drop(a);
    assert_eq!(dev.object_counts(), ObjectCounts::default());
}

/// Key-table indices wrap (24 bits, as rxe's) without ever handing out one a live MR or
/// window still holds — before, the counter wrapped onto live keys and a new registration
/// replaced an old one's translation, so the old key reached the new memory. With every
/// index taken, registering and allocating windows fail with ENOMEM, and an index handed
/// out again makes a new key: the dead object's key reaches nothing.
#[test]
fn key_indices_wrap_around_live_keys() {
    let register = |pd: &Arc<dyn ProtectionDomain>| {
        let mem = Arc::new(SharedMemory::create(c"wrap", 4096).unwrap());
        pd.register(mem, Access::LOCAL_WRITE)
    };
    let resolves = |dev: &LoopbackDevice, mr: &Arc<dyn MemoryRegion>, key: u32| {
        dev.check_local_access(key, mr.addr(), 4096, Access::LOCAL_WRITE)
            .is_ok()
    };

    // The real 24-bit space, two indices before the wrap: index 0 is never used.
    let dev = LoopbackDevice::with_key_indices("lo-wrap24", LAST_INDEX - 1, LAST_INDEX);
    let pd = dev.alloc_pd().unwrap();
    let mrs: Vec<_> = (0..3).map(|_| register(&pd).unwrap()).collect();
    let indices: Vec<u32> = mrs.iter().map(|mr| mr.lkey() >> 8).collect();
    assert_eq!(indices, [LAST_INDEX - 1, LAST_INDEX, 1]);

    // A space of 8 indices, starting two before its end: MRs and windows share it.
    let dev = LoopbackDevice::with_key_indices("lo-wrap8", 7, 8);
    let pd = dev.alloc_pd().unwrap();
    let mut mrs: Vec<Arc<dyn MemoryRegion>> = Vec::new();
    let mut mws: Vec<Arc<dyn MemoryWindow>> = Vec::new();
    for i in 0..8 {
        if i % 3 == 1 {
            mws.push(pd.alloc_mw(MwType::Type2).unwrap());
        } else {
            mrs.push(register(&pd).unwrap());
        }
    }
    let mut taken: Vec<u32> = mrs
        .iter()
        .map(|mr| mr.lkey() >> 8)
        .chain(mws.iter().map(|mw| mw.rkey() >> 8))
        .collect();
    taken.sort_unstable();
    assert_eq!(taken, (1..=8).collect::<Vec<_>>());
    assert!(is_enomem(register(&pd)), "every index is taken");
    assert!(is_enomem(pd.alloc_mw(MwType::Type2)));

    // Free one MR and one window: exactly their indices come back, with new keys.
    let dead_mr = mrs.remove(1);
    let dead_mr_key = dead_mr.lkey();
    let dead_mw_key = mws[0].rkey();
    drop(dead_mr);
    drop(mws.remove(0));
    let again = register(&pd).unwrap();
    let window = pd.alloc_mw(MwType::Type2).unwrap();
    let mut reused = [again.lkey() >> 8, window.rkey() >> 8];
    reused.sort_unstable();
    let mut freed = [dead_mr_key >> 8, dead_mw_key >> 8];
    freed.sort_unstable();
    assert_eq!(reused, freed, "only the freed indices are handed out again");
    for key in [again.lkey(), window.rkey()] {
        assert!(
            key != dead_mr_key && key != dead_mw_key,
            "{key:#x}: an index handed out again makes a new key"
        );
    }
    assert!(
        !resolves(&dev, &again, dead_mr_key),
        "the dead key reaches nothing"
    );
    assert!(resolves(&dev, &again, again.lkey()));
    for mr in &mrs {
        assert!(
            resolves(&dev, mr, mr.lkey()),
            "live keys still reach their own memory"
        );
    }
    assert!(is_enomem(register(&pd)));
}

/// A SEND larger than a turn moves a chunk per poll of the sender's CQ, across SGE and turn
/// boundaries that do not line up, and arrives whole with its full length.
#[test]
fn a_send_larger_than_a_turn_arrives_whole() {
    let dev = LoopbackDevice::new("lo-turns");
    let opts = Opts {
        mem: 1 << 20,
        ..Opts::default()
    };
    let (a, b) = pair(&dev, &opts);
    let pattern: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    a.mr.memory().write_at(0, &pattern).unwrap();
    b.recv(1, vec![b.sge(1000, 123_457), b.sge(200_000, 400_000)])
        .unwrap();
    a.post(2, send(2), vec![a.sge(0, 100_001), a.sge(100_001, 199_999)])
        .unwrap();
    assert!(
        a.cq.needs_polling(),
        "the first turn leaves work for the next poll"
    );
    let wc = a.wait();
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (2, WcStatus::Success, 300_000)
    );
    assert!(!a.cq.needs_polling());
    let got = b.wait();
    assert_eq!((got.wr_id, got.byte_len), (1, 300_000));
    let mut arrived = b.read(1000, 123_457);
    arrived.extend(b.read(200_000, 300_000 - 123_457));
    assert!(arrived == pattern, "the bytes arrived in order");
}

/// A half-done SEND whose QP is destroyed, or fails, gives its receive back: the responder
/// still completes it (here, flushed), never loses it.
#[test]
fn a_half_done_send_gives_its_receive_back() {
    for how in ["destroy", "error"] {
        let dev = LoopbackDevice::new("lo-give-back");
        let opts = Opts {
            mem: 1 << 20,
            ..Opts::default()
        };
        let (a, b) = pair(&dev, &opts);
        b.recv(1, vec![b.sge(0, 500_000)]).unwrap();
        a.post(2, send(2), vec![a.sge(0, 500_000)]).unwrap();
        assert!(a.cq.needs_polling(), "{how}: the send is under way");
        match how {
            "destroy" => drop(a),
            _ => a.qp.to_error().unwrap(),
        }
        b.qp.to_error().unwrap();
        let flushed: Vec<_> = b.polled().iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(flushed, [(1, WcStatus::WrFlushError)], "{how}");
    }
}

/// Each kind of change to the key tables reaches the very next request, including a key a
/// request has just failed to find, and a deregistered MR's memory is let go.
#[test]
fn every_key_change_reaches_the_next_request() {
    let dev = LoopbackDevice::with_key_indices("lo-keys", 100, LAST_INDEX);
    let opts = Opts::default();
    let write = |from: &End, rkey: u32, addr: u64| -> WcStatus {
        let op = SendOp::Write {
            remote_addr: addr,
            rkey,
            imm: None,
        };
        from.post(1, op, vec![from.sge(0, 8)]).unwrap();
        from.wait().status
    };
    // A requester and a responder in `pd` (a failed request leaves both in error).
    let to = |pd: &Arc<dyn ProtectionDomain>| pair_into(&dev, Some(pd), &opts);
    // The key a window gets when it is bound next (ibv_inc_rkey: the next variant byte).
    let next_bind = |mw: &Arc<dyn MemoryWindow>| {
        let k = mw.rkey();
        (k & !0xff) | (k.wrapping_add(1) & 0xff)
    };

    // An MR registered under the key a request has just failed to find: `pair` registers
    // two MRs (indices 100 and 101), so the next one gets index 102.
    let (a, b) = pair(&dev, &opts);
    let next = make_key(102, 0, 0x9e);
    assert_eq!(write(&a, next, 0x1000), WcStatus::RemoteAccessError);
    let mem = Arc::new(SharedMemory::create(c"lo-keys", 4096).unwrap());
    let mr =
        b.pd.register(Arc::clone(&mem), Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
    assert_eq!(mr.rkey(), next, "the key the failed request named");
    let (x, _y) = to(&b.pd);
    let addr = mr.addr();
    assert_eq!(write(&x, next, addr), WcStatus::Success);
    // Deregistered: its memory is held by nothing, and its key fails.
    drop(mr);
    assert_eq!(Arc::strong_count(&mem), 1, "the memory outlived its MR");
    assert_eq!(write(&x, next, addr), WcStatus::RemoteAccessError);
    assert_eq!(Arc::strong_count(&mem), 1, "the memory outlived its MR");

    // A window bound under the key a request has just failed to find: that key works;
    // invalidated: it fails.
    let (x, y) = to(&b.pd);
    let mw = y.pd.alloc_mw(MwType::Type2).unwrap();
    let key = next_bind(&mw);
    let (p, _q) = to(&b.pd);
    assert_eq!(write(&p, key, y.mr.addr()), WcStatus::RemoteAccessError);
    assert_eq!(
        y.bind(&mw, 0, 4096, Access::REMOTE_WRITE),
        WcStatus::Success
    );
    assert_eq!(mw.rkey(), key, "the key the failed request named");
    assert_eq!(write(&x, key, y.mr.addr()), WcStatus::Success);
    y.post(7, SendOp::LocalInvalidate { rkey: key }, vec![])
        .unwrap();
    assert_eq!(y.wait().status, WcStatus::Success);
    assert_eq!(write(&x, key, y.mr.addr()), WcStatus::RemoteAccessError);

    // A bound window deallocated: its key fails.
    let (x, y) = to(&b.pd);
    let mw = y.pd.alloc_mw(MwType::Type2).unwrap();
    assert_eq!(
        y.bind(&mw, 0, 4096, Access::REMOTE_WRITE),
        WcStatus::Success
    );
    let key = mw.rkey();
    assert_eq!(write(&x, key, y.mr.addr()), WcStatus::Success);
    drop(mw);
    assert_eq!(write(&x, key, y.mr.addr()), WcStatus::RemoteAccessError);
}

/// One post of many tiny requests runs at most a turn's worth of them (each costs a turn at
/// least `REQUEST_COST`) and leaves the rest for the next poll of the send CQ, which
/// completes them all, in order: a QP posting a flood holds the device no longer than a
/// turn, whether its requests run from the post or from the queue.
#[test]
fn a_flood_in_one_post_runs_a_turn_at_a_time() {
    use super::qp::{REQUEST_COST, TURN_BYTES};
    let dev = LoopbackDevice::new("lo-flood");
    let opts = Opts {
        depth: 512,
        cq_depth: 1024,
        mr_access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        ..Opts::default()
    };
    let (a, b) = pair(&dev, &opts);
    let write = |wr_id| write_slot(&a, &b, wr_id);
    let per_turn = TURN_BYTES.div_ceil(REQUEST_COST + 8);
    let turn: Vec<SendWr> = (0..per_turn).map(write).collect();
    a.qp.post_send(&turn).unwrap();
    assert!(!a.cq.needs_polling(), "a turn's worth runs in the post");
    assert_eq!(a.polled().len() as u64, per_turn);
    let flood: Vec<SendWr> = (0..400).map(write).collect();
    a.qp.post_send(&flood).unwrap();
    assert!(
        a.cq.needs_polling(),
        "the rest of a flood waits for the next poll"
    );
    let done: Vec<(u64, WcStatus)> = std::iter::from_fn(|| Some(a.polled()))
        .take_while(|polled| !polled.is_empty())
        .flatten()
        .map(|wc| (wc.wr_id, wc.status))
        .collect();
    assert_eq!(
        done,
        (0..400).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
}

/// The device keeps the peer a QP's requests last found ready from one turn to the next
/// (one lookup fewer for every request): a peer that went to the error state, or was
/// destroyed, since then is not reached, and a destroyed peer's objects are gone at once.
#[test]
fn a_peer_that_fails_or_goes_between_requests_is_not_reached() {
    let write = |a: &End, (remote_addr, rkey): (u64, u32), wr_id| {
        a.post(
            wr_id,
            SendOp::Write {
                remote_addr,
                rkey,
                imm: None,
            },
            vec![a.sge(0, 8)],
        )
        .unwrap();
        let wc = a.wait();
        (wc.wr_id, wc.status)
    };
    let opts = Opts {
        mr_access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        timeout: 1,
        retry_cnt: 0,
        ..Opts::default()
    };

    let dev = LoopbackDevice::new("lo-peer-error");
    let (a, b) = pair(&dev, &opts);
    let target = (b.mr.addr(), b.mr.rkey());
    assert_eq!(write(&a, target, 1), (1, WcStatus::Success));
    b.qp.to_error().unwrap();
    assert_eq!(write(&a, target, 2), (2, WcStatus::RetryExceeded));

    let dev = LoopbackDevice::new("lo-peer-gone");
    let (a, b) = pair(&dev, &opts);
    let target = (b.mr.addr(), b.mr.rkey());
    assert_eq!(write(&a, target, 1), (1, WcStatus::Success));
    // The peer's MR stays: only the QP that would answer goes.
    let End {
        qp, cq, mr: _mr, ..
    } = b;
    drop((qp, cq));
    let counts = dev.object_counts();
    assert_eq!(
        (counts.qps, counts.cqs),
        (1, 1),
        "the destroyed peer's QP and CQ are gone at once"
    );
    assert_eq!(write(&a, target, 2), (2, WcStatus::RetryExceeded));
}

/// A QP destroyed with the rest of a long request waiting for its CQ's next poll is not run
/// again: the poll finds nothing to do, and the QP's objects are gone at once.
#[test]
fn a_qp_destroyed_with_a_turn_left_is_not_run_again() {
    let dev = LoopbackDevice::new("lo-turn-left");
    let opts = Opts {
        mem: 1 << 20,
        mr_access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        ..Opts::default()
    };
    let (a, b) = pair(&dev, &opts);
    a.post(
        1,
        SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey: b.mr.rkey(),
            imm: None,
        },
        vec![a.sge(0, 512 << 10)],
    )
    .unwrap();
    assert!(a.cq.needs_polling(), "the write waits for the next poll");
    let End { qp, cq, .. } = a;
    drop(qp);
    assert!(!cq.needs_polling(), "a destroyed QP has no turn left");
    let mut polled = Vec::new();
    assert_eq!(cq.poll(&mut polled, 16).unwrap(), 0);
    assert_eq!(dev.object_counts().qps, 1);
    drop(cq);
    assert_eq!(dev.object_counts().cqs, 1);
}
