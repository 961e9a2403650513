//! Data-path behaviour every provider must show: RC queue pairs connected to each other on
//! one device, SEND/RECV, RDMA WRITE/READ through type-2 memory windows, atomics, window
//! invalidation, and the error completions a device gives for bad keys and bounds. Run on
//! loopback in the unit tests and on `rxe0` in the VM tier. What rxe does is the reference.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{
    Access, CompletionQueue, Device, MemoryRegion, MemoryWindow, MwType, ProtectionDomain, QpInit,
    QpState, QueuePair, RecvWr, RemoteEndpoint, RtrAttributes, RtsAttributes, SendOp, SendWr, Sge,
    Span, WcOpcode, WcStatus, WorkCompletion,
};
use crate::memory::SharedMemory;

/// Generous: rxe under instruction emulation is slow, and error completions wait for
/// retries.
const DEADLINE: Duration = Duration::from_secs(60);

/// `IBV_WC_LOC_QP_OP_ERR`, what rxe reports for a bad lkey (see
/// `bad_lkey_is_a_local_protection_error`).
const LOC_QP_OP_ERR: u32 = 2;

pub fn run_all(dev: &dyn Device) {
    let base = dev.object_counts();
    send_recv_with_scatter_gather_and_immediate(dev);
    write_and_read_through_a_bound_window(dev);
    write_with_immediate_consumes_a_receive(dev);
    atomics(dev);
    invalidated_window_rkey_is_refused(dev);
    access_beyond_the_region_is_refused(dev);
    mr_rkey_without_remote_rights_is_refused(dev);
    bad_lkey_is_a_local_protection_error(dev);
    a_registration_with_a_bound_window_lingers(dev);
    a_span_under_an_iova_is_reached_through_its_pd_only(dev);
    error_is_reached_from_init_not_from_reset(dev);
    assert_eq!(
        dev.object_counts(),
        base,
        "everything created was destroyed"
    );
}

/// One side of a connection: QP, CQ and a registered buffer.
struct Side {
    // Field order is drop order: window before QP before CQ before MR before PD.
    mw: Option<Arc<dyn MemoryWindow>>,
    qp: Arc<dyn QueuePair>,
    cq: Arc<dyn CompletionQueue>,
    mr: Arc<dyn MemoryRegion>,
    _pd: Arc<dyn ProtectionDomain>,
}

impl Side {
    fn new(dev: &dyn Device, len: usize) -> Side {
        let pd = dev.alloc_pd().expect("alloc_pd");
        let memory = Arc::new(SharedMemory::create(c"conformance-data", len).unwrap());
        let mr = pd
            .register(memory, Access::LOCAL_WRITE.union(Access::MW_BIND))
            .expect("register");
        let cq = pd.create_cq(64).expect("create_cq");
        let qp = pd
            .create_qp(QpInit {
                send_cq: Arc::clone(&cq),
                recv_cq: Arc::clone(&cq),
                max_send_wr: 16,
                max_recv_wr: 16,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline_data: 0,
            })
            .expect("create_qp");
        assert_eq!(qp.state().unwrap(), QpState::Reset);
        Side {
            mw: None,
            qp,
            cq,
            mr,
            _pd: pd,
        }
    }

    fn sge(&self, offset: u64, length: u32) -> Sge {
        Sge {
            addr: self.mr.addr() + offset,
            length,
            lkey: self.mr.lkey(),
        }
    }

    fn write(&self, offset: usize, data: &[u8]) {
        self.mr.memory().write_at(offset, data).unwrap();
    }

    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        self.mr.memory().read_at(offset, &mut buf).unwrap();
        buf
    }

    /// Waits for the next completion.
    fn completion(&self) -> WorkCompletion {
        let start = Instant::now();
        let mut out = Vec::new();
        loop {
            self.cq.poll(&mut out, 1).expect("poll");
            if let Some(wc) = out.pop() {
                return wc;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "no completion within {DEADLINE:?}"
            );
            std::thread::yield_now();
        }
    }

    fn post(&self, wr_id: u64, op: SendOp, sges: Vec<Sge>) {
        self.qp
            .post_send(&[SendWr {
                wr_id,
                op,
                sges: sges.into(),
                signaled: true,
                inline: false,
            }])
            .expect("post_send");
    }

    /// Binds a type-2 window over the whole region with `access` and returns its rkey.
    fn bind_window(&mut self, access: Access) -> u32 {
        let mw = self.mr_pd_window();
        self.post(
            900,
            SendOp::BindMw {
                mw: Arc::clone(&mw),
                mr: Arc::clone(&self.mr),
                addr: self.mr.addr(),
                len: self.mr.len() as u64,
                access,
            },
            Vec::new(),
        );
        let wc = self.completion();
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (900, WcStatus::Success, WcOpcode::BindMw)
        );
        let rkey = mw.rkey();
        self.mw = Some(mw);
        rkey
    }

    fn mr_pd_window(&self) -> Arc<dyn MemoryWindow> {
        self._pd.alloc_mw(MwType::Type2).expect("alloc_mw type 2")
    }
}

fn endpoint(dev: &dyn Device, side: &Side) -> (RemoteEndpoint, u32) {
    let gids = dev.gid_table(1).unwrap();
    let gid = gids
        .iter()
        .find(|g| g.is_ipv4_mapped())
        .expect("an IPv4-mapped GID");
    let psn = side.qp.qp_num().wrapping_mul(7919) & 0xff_ffff;
    (
        RemoteEndpoint {
            gid: gid.gid,
            qp_num: side.qp.qp_num(),
            psn,
            lid: dev.query_port(1).unwrap().lid,
        },
        gid.index,
    )
}

/// Two sides connected to each other, RTS, with full remote access allowed on the QPs.
fn pair(dev: &dyn Device, len: usize) -> (Side, Side) {
    let a = Side::new(dev, len);
    let b = Side::new(dev, len);
    let remote = Access::REMOTE_WRITE
        .union(Access::REMOTE_READ)
        .union(Access::REMOTE_ATOMIC)
        .union(Access::LOCAL_WRITE);
    let mtu = dev.query_port(1).unwrap().active_mtu;
    let (ea, ia) = endpoint(dev, &a);
    let (eb, ib) = endpoint(dev, &b);
    for (side, own_psn, peer, index) in [(&a, ea.psn, &eb, ia), (&b, eb.psn, &ea, ib)] {
        side.qp.to_init(1, remote).expect("to_init");
        assert_eq!(side.qp.state().unwrap(), QpState::Init);
        side.qp
            .to_rtr(
                peer,
                &RtrAttributes {
                    port: 1,
                    sgid_index: index,
                    path_mtu: mtu,
                    max_dest_rd_atomic: 1,
                    min_rnr_timer: 12,
                },
            )
            .expect("to_rtr");
        side.qp
            .to_rts(&RtsAttributes {
                psn: own_psn,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: 1,
            })
            .expect("to_rts");
        assert_eq!(side.qp.state().unwrap(), QpState::Rts);
    }
    (a, b)
}

fn send_recv_with_scatter_gather_and_immediate(dev: &dyn Device) {
    let (a, b) = pair(dev, 8192);
    a.write(0, b"hello, ");
    a.write(4096, b"world");
    b.qp.post_recv(&[RecvWr {
        wr_id: 7,
        sges: smallvec::smallvec![b.sge(100, 5), b.sge(200, 100)],
    }])
    .unwrap();
    a.post(
        1,
        SendOp::Send { imm: Some(0xfeed) },
        vec![a.sge(0, 7), a.sge(4096, 5)],
    );
    let sent = a.completion();
    assert_eq!(
        (sent.wr_id, sent.status, sent.opcode),
        (1, WcStatus::Success, WcOpcode::Send)
    );
    let got = b.completion();
    assert_eq!(
        (got.wr_id, got.status, got.opcode),
        (7, WcStatus::Success, WcOpcode::Recv)
    );
    assert_eq!((got.byte_len, got.imm), (12, Some(0xfeed)));
    assert_eq!(got.qp_num, b.qp.qp_num());
    assert_eq!(b.read(100, 5), b"hello");
    assert_eq!(b.read(200, 7), b", world");
}

fn write_and_read_through_a_bound_window(dev: &dyn Device) {
    let (a, mut b) = pair(dev, 8192);
    let rkey = b.bind_window(Access::REMOTE_WRITE.union(Access::REMOTE_READ));
    a.write(0, b"written remotely");
    a.post(
        2,
        SendOp::Write {
            remote_addr: b.mr.addr() + 1000,
            rkey,
            imm: None,
        },
        vec![a.sge(0, 16)],
    );
    let wc = a.completion();
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert_eq!(b.read(1000, 16), b"written remotely");

    b.write(5000, b"read me");
    a.post(
        3,
        SendOp::Read {
            remote_addr: b.mr.addr() + 5000,
            rkey,
        },
        vec![a.sge(300, 7)],
    );
    let wc = a.completion();
    assert_eq!(
        (wc.status, wc.opcode, wc.byte_len),
        (WcStatus::Success, WcOpcode::RdmaRead, 7)
    );
    assert_eq!(a.read(300, 7), b"read me");
}

fn write_with_immediate_consumes_a_receive(dev: &dyn Device) {
    let (a, mut b) = pair(dev, 4096);
    let rkey = b.bind_window(Access::REMOTE_WRITE);
    b.qp.post_recv(&[RecvWr {
        wr_id: 11,
        sges: smallvec::smallvec![],
    }])
    .unwrap();
    a.write(0, b"imm");
    a.post(
        4,
        SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey,
            imm: Some(42),
        },
        vec![a.sge(0, 3)],
    );
    assert_eq!(a.completion().status, WcStatus::Success);
    let got = b.completion();
    assert_eq!(
        (got.wr_id, got.opcode, got.imm),
        (11, WcOpcode::RecvRdmaWithImm, Some(42))
    );
    assert_eq!(b.read(0, 3), b"imm");
}

fn atomics(dev: &dyn Device) {
    let (a, mut b) = pair(dev, 4096);
    let rkey = b.bind_window(Access::REMOTE_ATOMIC.union(Access::REMOTE_READ));
    b.write(64, &40u64.to_ne_bytes());
    a.post(
        5,
        SendOp::FetchAdd {
            remote_addr: b.mr.addr() + 64,
            rkey,
            add: 2,
        },
        vec![a.sge(0, 8)],
    );
    let wc = a.completion();
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::FetchAdd)
    );
    assert_eq!(
        a.read(0, 8),
        40u64.to_ne_bytes(),
        "fetch-and-add returns the old value"
    );
    assert_eq!(b.read(64, 8), 42u64.to_ne_bytes());

    a.post(
        6,
        SendOp::CompareSwap {
            remote_addr: b.mr.addr() + 64,
            rkey,
            compare: 42,
            swap: 7,
        },
        vec![a.sge(8, 8)],
    );
    assert_eq!(a.completion().opcode, WcOpcode::CompareSwap);
    assert_eq!(a.read(8, 8), 42u64.to_ne_bytes());
    assert_eq!(
        b.read(64, 8),
        7u64.to_ne_bytes(),
        "swapped: compare matched"
    );

    a.post(
        7,
        SendOp::CompareSwap {
            remote_addr: b.mr.addr() + 64,
            rkey,
            compare: 1,
            swap: 99,
        },
        vec![a.sge(16, 8)],
    );
    assert_eq!(a.completion().status, WcStatus::Success);
    assert_eq!(
        b.read(64, 8),
        7u64.to_ne_bytes(),
        "not swapped: compare did not match"
    );
}

/// After a local invalidation the old rkey is refused; the initiator gets a remote access
/// error and the target's memory is untouched.
fn invalidated_window_rkey_is_refused(dev: &dyn Device) {
    let (a, mut b) = pair(dev, 4096);
    let rkey = b.bind_window(Access::REMOTE_WRITE);
    b.post(20, SendOp::LocalInvalidate { rkey }, Vec::new());
    let wc = b.completion();
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::LocalInvalidate)
    );
    a.write(0, b"stale");
    a.post(
        8,
        SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey,
            imm: None,
        },
        vec![a.sge(0, 5)],
    );
    let wc = a.completion();
    assert_eq!(wc.status, WcStatus::RemoteAccessError, "{wc:?}");
    assert_eq!(b.read(0, 5), [0u8; 5]);
    assert_eq!(a.qp.state().unwrap(), QpState::Error);
}

fn access_beyond_the_region_is_refused(dev: &dyn Device) {
    let (a, mut b) = pair(dev, 4096);
    let rkey = b.bind_window(Access::REMOTE_WRITE);
    a.post(
        9,
        SendOp::Write {
            remote_addr: b.mr.addr() + 4090,
            rkey,
            imm: None,
        },
        vec![a.sge(0, 16)],
    );
    assert_eq!(a.completion().status, WcStatus::RemoteAccessError);
}

/// Regions are registered without remote rights; their own rkey never grants access.
fn mr_rkey_without_remote_rights_is_refused(dev: &dyn Device) {
    let (a, b) = pair(dev, 4096);
    a.post(
        10,
        SendOp::Write {
            remote_addr: b.mr.addr(),
            rkey: b.mr.rkey(),
            imm: None,
        },
        vec![a.sge(0, 8)],
    );
    assert_eq!(a.completion().status, WcStatus::RemoteAccessError);
    assert_eq!(b.read(0, 8), [0u8; 8]);
}

/// A send whose SGE has an unknown lkey completes in error on the sender. Hardware reports
/// `IBV_WC_LOC_PROT_ERR`; rxe (Linux 6.1, measured) reports `IBV_WC_LOC_QP_OP_ERR` (2): its
/// `copy_data` fails the lkey lookup with `-EINVAL`, and the requester maps everything but
/// `-EFAULT` to a local QP operation error. Both are accepted.
fn bad_lkey_is_a_local_protection_error(dev: &dyn Device) {
    let (a, b) = pair(dev, 4096);
    b.qp.post_recv(&[RecvWr {
        wr_id: 1,
        sges: smallvec::smallvec![b.sge(0, 64)],
    }])
    .unwrap();
    let mut bad = a.sge(0, 8);
    bad.lkey ^= 0x100;
    a.post(11, SendOp::Send { imm: None }, vec![bad]);
    let wc = a.completion();
    assert!(
        matches!(
            wc.status,
            WcStatus::LocalProtectionError | WcStatus::Other(LOC_QP_OP_ERR)
        ),
        "{wc:?}"
    );
    assert_eq!(wc.wr_id, 11);
}

/// rxe refuses to deregister an MR while a window is bound over it (`ibv_dereg_mr`:
/// EINVAL), and the window's rkey keeps working. The provider keeps such a registration —
/// counted, listed — and deregisters it on a retry once the window is gone.
fn a_registration_with_a_bound_window_lingers(dev: &dyn Device) {
    let base = dev.object_counts();
    let (a, mut b) = pair(dev, 4096);
    let rkey = b.bind_window(Access::REMOTE_WRITE);
    let Side {
        mw,
        qp,
        cq,
        mr,
        _pd,
    } = b;
    let (key, addr) = (mr.lkey(), mr.addr());
    drop(mr);
    let lingering = dev.lingering();
    assert_eq!(lingering.len(), 1, "{lingering:?}");
    assert_eq!(
        (lingering[0].kind, lingering[0].key, lingering[0].len),
        (super::ObjectKind::Mr, key, 4096)
    );
    assert!(lingering[0].error.contains("ibv_dereg_mr"), "{lingering:?}");
    assert_eq!(dev.object_counts().mrs, base.mrs + 2, "still registered");
    assert_eq!(
        dev.retry_lingering(),
        1,
        "refused again while the window is bound"
    );
    assert_eq!(dev.lingering()[0].attempts, 2);
    a.write(0, b"through");
    a.post(
        30,
        SendOp::Write {
            remote_addr: addr,
            rkey,
            imm: None,
        },
        vec![a.sge(0, 7)],
    );
    assert_eq!(
        a.completion().status,
        WcStatus::Success,
        "the window still reaches the registration"
    );
    drop(mw);
    assert_eq!(dev.retry_lingering(), 0);
    assert!(dev.lingering().is_empty());
    drop((qp, cq, _pd, a));
    assert_eq!(dev.object_counts(), base);
}

/// A registration of part of a memory under an address of the client's choosing (what
/// `ibv_reg_mr` of a verbs program's buffer becomes in rdmad): its rkey reaches exactly
/// those bytes, named by that address, and only through a queue pair of its own PD; its
/// lkey names them in local requests by that address too.
fn a_span_under_an_iova_is_reached_through_its_pd_only(dev: &dyn Device) {
    const IOVA: u64 = 0x7f00_dead_1000;
    let span = Span {
        offset: 4096,
        len: 4096,
        iova: IOVA,
    };
    let remote = Access::LOCAL_WRITE
        .union(Access::REMOTE_WRITE)
        .union(Access::REMOTE_READ);
    let register = |side: &Side| {
        side._pd
            .register_span(Arc::clone(side.mr.memory()), span, remote)
            .expect("register_span")
    };

    let (a, b) = pair(dev, 3 * 4096);
    let reg = register(&b);
    assert_eq!((reg.addr(), reg.len()), (IOVA, 4096));
    a.write(0, b"by iova");
    a.post(
        20,
        SendOp::Write {
            remote_addr: IOVA + 10,
            rkey: reg.rkey(),
            imm: None,
        },
        vec![a.sge(0, 7)],
    );
    assert_eq!(a.completion().status, WcStatus::Success);
    assert_eq!(
        b.read(4096 + 10, 7),
        b"by iova",
        "landed at the span's offset"
    );

    // A local request names the span's bytes by the iova too.
    a.qp.post_recv(&[RecvWr {
        wr_id: 21,
        sges: smallvec::smallvec![a.sge(100, 7)],
    }])
    .unwrap();
    b.qp.post_send(&[SendWr {
        wr_id: 22,
        op: SendOp::Send { imm: None },
        sges: smallvec::smallvec![Sge {
            addr: IOVA + 10,
            length: 7,
            lkey: reg.lkey(),
        }],
        signaled: true,
        inline: false,
    }])
    .unwrap();
    assert_eq!(b.completion().status, WcStatus::Success);
    assert_eq!(a.completion().status, WcStatus::Success);
    assert_eq!(a.read(100, 7), b"by iova");

    // Past the span's end: a remote access error, and nothing beyond the span is touched.
    a.post(
        23,
        SendOp::Write {
            remote_addr: IOVA + 4096 - 4,
            rkey: reg.rkey(),
            imm: None,
        },
        vec![a.sge(0, 8)],
    );
    assert_eq!(a.completion().status, WcStatus::RemoteAccessError);
    assert_eq!(b.read(8192, 8), [0u8; 8]);
    assert_eq!(b.read(4096 + 4092, 4), [0u8; 4]);
    drop(reg);

    // Through a queue pair of another PD the rkey reaches nothing.
    let (c, d) = pair(dev, 4096);
    let (_x, y) = pair(dev, 3 * 4096);
    let reg = register(&y);
    c.write(0, b"intruder");
    c.post(
        24,
        SendOp::Write {
            remote_addr: IOVA,
            rkey: reg.rkey(),
            imm: None,
        },
        vec![c.sge(0, 8)],
    );
    assert_eq!(c.completion().status, WcStatus::RemoteAccessError);
    assert_eq!(y.read(4096, 8), [0u8; 8]);
    assert_eq!(d.read(0, 8), [0u8; 8]);
}

/// Any state but RESET may move to ERROR (the kernel's `ib_modify_qp_is_ok` has no
/// RESET → ERR): a QP never brought to INIT refuses, one in INIT flushes its receives.
fn error_is_reached_from_init_not_from_reset(dev: &dyn Device) {
    let side = Side::new(dev, 4096);
    assert!(side.qp.to_error().is_err(), "RESET → ERR must be refused");
    assert_eq!(side.qp.state().unwrap(), QpState::Reset);
    side.qp.to_init(1, Access::NONE).expect("to_init");
    side.qp
        .post_recv(&[RecvWr {
            wr_id: 30,
            sges: smallvec::smallvec![side.sge(0, 64)],
        }])
        .unwrap();
    side.qp.to_error().expect("INIT → ERR");
    assert_eq!(side.qp.state().unwrap(), QpState::Error);
    let wc = side.completion();
    assert_eq!((wc.wr_id, wc.status), (30, WcStatus::WrFlushError));
}
