//! Reliable-connected queue pairs: creation, state transitions and posting.
//!
//! **Teardown order.** A type-2 window bound through a QP holds a reference to that QP in
//! rxe; destroying the QP then blocks in the kernel for about 50 s (`__rxe_cleanup`, with a
//! WARN). The provider cannot know which windows are bound through a QP, so the engine must
//! invalidate (`SendOp::LocalInvalidate`) or drop every window bound through a QP before it
//! drops the QP. Dropping a window deallocates it, which releases its hold on the QP.

use std::io;
use std::os::raw::{c_int, c_uint};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use rdma_sys::{
    atomic_t, bind_mw_t, ibv_create_qp, ibv_destroy_qp, ibv_gid, ibv_modify_qp, ibv_mtu,
    ibv_mw_bind_info, ibv_post_recv, ibv_post_send, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask,
    ibv_qp_cap, ibv_qp_init_attr, ibv_qp_state, ibv_qp_type, ibv_query_qp, ibv_recv_wr,
    ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode, rdma_t,
};

use super::cq::VerbsCq;
use super::{verb_error, PdInner, VerbsMr, VerbsMw};
use crate::provider::counters::Tracked;
use crate::provider::{
    Access, CompletionQueue, MwType, ObjectKind, PostError, ProviderError, QpInit, QpState,
    QueuePair, RecvWr, RemoteEndpoint, Result, RtrAttributes, RtsAttributes, SendOp, SendWr, Sge,
};

/// An RC QP. Holds its CQs and PD, so they are destroyed after it.
#[derive(Debug)]
pub(super) struct VerbsQp {
    qp: NonNull<ibv_qp>,
    qp_num: u32,
    _tracked: Tracked,
    // Dropped after the QP is destroyed (field drops follow `Drop::drop`).
    _send_cq: Arc<dyn CompletionQueue>,
    _recv_cq: Arc<dyn CompletionQueue>,
    pd: Arc<PdInner>,
    /// Set once the QP is moved to ERR ([`QueuePair::to_error`]). Soft-RoCE (Linux 6.1)
    /// never completes a receive posted to a QP in ERR — measured: the receives it held
    /// complete flushed, later ones never do (sends posted in ERR do complete flushed) — so
    /// from then on `post_recv` takes none ([`ProviderError::Flushed`]) and the caller
    /// completes them flushed itself.
    errored: AtomicBool,
    /// `post_recv` calls under way: `to_error` lets them finish before it moves the QP,
    /// so no receive reaches the device after the move.
    recv_posts: AtomicU32,
}

/// Counts a `post_recv` under way for as long as it lives.
struct RecvPosting<'a>(&'a AtomicU32);

impl Drop for RecvPosting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

// SAFETY: the QP is only passed to libibverbs calls, which are thread safe (module docs of
// `verbs`); it is destroyed once, in `Drop`. `qp_num` is copied out at creation.
unsafe impl Send for VerbsQp {}
// SAFETY: as for `Send`.
unsafe impl Sync for VerbsQp {}

/// The CQ behind `cq` if it is one of ours on the PD's device.
fn our_cq<'a>(pd: &PdInner, cq: &'a Arc<dyn CompletionQueue>, which: &str) -> Result<&'a VerbsCq> {
    let name = &pd.context.name;
    let cq = cq
        .as_any()
        .downcast_ref::<VerbsCq>()
        .ok_or_else(|| ProviderError::invalid(name, format!("the {which} CQ is not a verbs CQ")))?;
    if !Arc::ptr_eq(cq.context(), &pd.context) {
        return Err(ProviderError::invalid(
            name,
            format!("the {which} CQ belongs to {}", cq.context().name),
        ));
    }
    Ok(cq)
}

pub(super) fn create(pd: &Arc<PdInner>, init: QpInit) -> Result<Arc<dyn QueuePair>> {
    let send_cq = our_cq(pd, &init.send_cq, "send")?.raw();
    let recv_cq = our_cq(pd, &init.recv_cq, "receive")?.raw();
    let mut attr = ibv_qp_init_attr {
        qp_context: ptr::null_mut(),
        send_cq,
        recv_cq,
        srq: ptr::null_mut(),
        cap: ibv_qp_cap {
            max_send_wr: init.max_send_wr,
            max_recv_wr: init.max_recv_wr,
            max_send_sge: init.max_send_sge,
            max_recv_sge: init.max_recv_sge,
            max_inline_data: init.max_inline_data,
        },
        qp_type: ibv_qp_type::IBV_QPT_RC,
        sq_sig_all: 0,
    };
    // SAFETY: a live PD and CQs of the same device (checked above; the QP keeps `Arc`s to
    // them); `attr` is a valid in/out pointer. Destroyed in `VerbsQp::drop`.
    let qp = unsafe { ibv_create_qp(pd.pd.as_ptr(), &mut attr) };
    let Some(qp) = NonNull::new(qp) else {
        return Err(ProviderError::last_os(&pd.context.name, "ibv_create_qp"));
    };
    // SAFETY: a fresh, valid QP; its number never changes.
    let qp_num = unsafe { (*qp.as_ptr()).qp_num };
    Ok(Arc::new(VerbsQp {
        qp,
        qp_num,
        _tracked: pd.context.counters.track(ObjectKind::Qp),
        _send_cq: init.send_cq,
        _recv_cq: init.recv_cq,
        pd: Arc::clone(pd),
        errored: AtomicBool::new(false),
        recv_posts: AtomicU32::new(0),
    }))
}

/// `ibv_mtu` for a path MTU in bytes.
fn ibv_mtu_of(bytes: u32) -> Option<ibv_mtu::Type> {
    Some(match bytes {
        256 => ibv_mtu::IBV_MTU_256,
        512 => ibv_mtu::IBV_MTU_512,
        1024 => ibv_mtu::IBV_MTU_1024,
        2048 => ibv_mtu::IBV_MTU_2048,
        4096 => ibv_mtu::IBV_MTU_4096,
        _ => return None,
    })
}

fn qp_state(state: ibv_qp_state::Type) -> Option<QpState> {
    Some(match state {
        ibv_qp_state::IBV_QPS_RESET => QpState::Reset,
        ibv_qp_state::IBV_QPS_INIT => QpState::Init,
        ibv_qp_state::IBV_QPS_RTR => QpState::Rtr,
        ibv_qp_state::IBV_QPS_RTS => QpState::Rts,
        ibv_qp_state::IBV_QPS_SQD => QpState::Sqd,
        ibv_qp_state::IBV_QPS_SQE => QpState::Sqe,
        ibv_qp_state::IBV_QPS_ERR => QpState::Error,
        _ => return None,
    })
}

/// The next rkey of a window: the key (low 8 bits) incremented, the index kept
/// (`ibv_inc_rkey`, without its overflow on `u32::MAX`).
pub(super) fn inc_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}

/// PSNs are 24 bits.
const PSN_MASK: u32 = 0xff_ffff;

fn raw_sge(sge: &Sge) -> ibv_sge {
    ibv_sge {
        addr: sge.addr,
        length: sge.length,
        lkey: sge.lkey,
    }
}

impl VerbsQp {
    fn name(&self) -> &str {
        &self.pd.context.name
    }

    fn modify(
        &self,
        attr: &mut ibv_qp_attr,
        mask: ibv_qp_attr_mask,
        operation: &'static str,
    ) -> Result<()> {
        // SAFETY: a live QP and a fully initialised attribute struct; the mask names only
        // fields set by the caller.
        let rc = unsafe { ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as c_int) };
        if rc != 0 {
            return Err(verb_error(self.name(), operation, rc));
        }
        Ok(())
    }

    fn invalid(&self, message: String) -> ProviderError {
        ProviderError::invalid(self.name(), message)
    }

    /// Translates one send WR (without its `sg_list`/`next`, set once all are built).
    fn raw_send_wr<'a>(
        &self,
        wr: &'a SendWr,
        binds: &mut Vec<(usize, &'a VerbsMw, u32)>,
        index: usize,
    ) -> Result<ibv_send_wr> {
        // SAFETY: `ibv_send_wr` is plain C data (integers, pointers, unions of them) for
        // which all-zero bytes are valid: NULL pointers, opcode 0, no flags.
        let mut raw: ibv_send_wr = unsafe { std::mem::zeroed() };
        raw.wr_id = wr.wr_id;
        raw.num_sge = c_int::try_from(wr.sges.len())
            .map_err(|_| self.invalid(format!("{} SGEs in one work request", wr.sges.len())))?;
        raw.send_flags = if wr.signaled {
            ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        if wr.inline {
            // The device copies the bytes during `ibv_post_send`, from the daemon's
            // mapping of the region (the SGEs' addresses), instead of reading them later.
            raw.send_flags |= ibv_send_flags::IBV_SEND_INLINE.0;
        }
        let set_imm = |raw: &mut ibv_send_wr, imm: u32| {
            raw.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        };
        match &wr.op {
            SendOp::Send { imm } => {
                raw.opcode = match imm {
                    Some(imm) => {
                        set_imm(&mut raw, *imm);
                        ibv_wr_opcode::IBV_WR_SEND_WITH_IMM
                    }
                    None => ibv_wr_opcode::IBV_WR_SEND,
                };
            }
            SendOp::Write {
                remote_addr,
                rkey,
                imm,
            } => {
                raw.opcode = match imm {
                    Some(imm) => {
                        set_imm(&mut raw, *imm);
                        ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
                    }
                    None => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                };
                raw.wr.rdma = rdma_t {
                    remote_addr: *remote_addr,
                    rkey: *rkey,
                };
            }
            SendOp::Read { remote_addr, rkey } => {
                raw.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                raw.wr.rdma = rdma_t {
                    remote_addr: *remote_addr,
                    rkey: *rkey,
                };
            }
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            } => {
                raw.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
                raw.wr.atomic = atomic_t {
                    remote_addr: *remote_addr,
                    compare_add: *add,
                    swap: 0,
                    rkey: *rkey,
                };
            }
            SendOp::CompareSwap {
                remote_addr,
                rkey,
                compare,
                swap,
            } => {
                raw.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
                raw.wr.atomic = atomic_t {
                    remote_addr: *remote_addr,
                    compare_add: *compare,
                    swap: *swap,
                    rkey: *rkey,
                };
            }
            SendOp::BindMw {
                mw,
                mr,
                addr,
                len,
                access,
            } => {
                let mw = mw
                    .as_any()
                    .downcast_ref::<VerbsMw>()
                    .ok_or_else(|| self.invalid("the window is not a verbs window".into()))?;
                let mr = mr
                    .as_any()
                    .downcast_ref::<VerbsMr>()
                    .ok_or_else(|| self.invalid("the region is not a verbs region".into()))?;
                if mw.kind != MwType::Type2 {
                    return Err(self
                        .invalid("only type-2 windows are bound with a work request".to_owned()));
                }
                if !Arc::ptr_eq(&mw.pd.context, &self.pd.context)
                    || !Arc::ptr_eq(&mr.pd.context, &self.pd.context)
                {
                    return Err(
                        self.invalid("the window or region belongs to another device".to_owned())
                    );
                }
                let new_rkey = inc_rkey(mw.rkey.load(Ordering::Acquire));
                raw.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
                raw.bind_mw_tso_union.bind_mw = bind_mw_t {
                    mw: mw.mw.as_ptr(),
                    rkey: new_rkey,
                    bind_info: ibv_mw_bind_info {
                        mr: mr.mr.as_ptr(),
                        addr: *addr,
                        length: *len,
                        mw_access_flags: access.bits() as c_uint,
                    },
                };
                binds.push((index, mw, new_rkey));
            }
            SendOp::LocalInvalidate { rkey } => {
                raw.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
                raw.imm_data_invalidated_rkey_union.invalidated_rkey = *rkey;
            }
        }
        Ok(raw)
    }
}

/// What a post builds for the provider (the WRs and their SGE lists), kept per thread and
/// reused: a thread that posts again does not allocate (the data-path worker posts every
/// batch from its own thread). Cleared at the start of each post; the pointers left in it
/// between posts are never followed.
#[derive(Default)]
struct PostScratch {
    sends: Vec<ibv_send_wr>,
    recvs: Vec<ibv_recv_wr>,
    sges: Vec<ibv_sge>,
    /// Where each WR's SGEs start in `sges`.
    firsts: Vec<usize>,
}

impl PostScratch {
    /// Empty, for the next post.
    fn cleared(&mut self) -> &mut PostScratch {
        self.sends.clear();
        self.recvs.clear();
        self.sges.clear();
        self.firsts.clear();
        self
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<PostScratch> = std::cell::RefCell::default();
}

/// Links `wrs[i].next` to `wrs[i + 1]` and points each WR at its SGEs (`firsts[i]` is the
/// index of its first SGE in `sges`). Neither vector may be resized afterwards.
macro_rules! link_chain {
    ($wrs:expr, $sges:expr, $firsts:expr) => {{
        let n = $wrs.len();
        let wr_base = $wrs.as_mut_ptr();
        let sge_base = $sges.as_mut_ptr();
        for (i, &first) in $firsts.iter().enumerate() {
            // SAFETY: `i < n` and `first + num_sge <= sges.len()` (the SGEs of WR `i` were
            // appended at `first`); both vectors are complete, so the pointers stay valid
            // until they are dropped after the post.
            unsafe {
                let wr = wr_base.add(i);
                (*wr).sg_list = if (*wr).num_sge > 0 {
                    sge_base.add(first)
                } else {
                    ptr::null_mut()
                };
                (*wr).next = if i + 1 < n {
                    wr_base.add(i + 1)
                } else {
                    ptr::null_mut()
                };
            }
        }
        wr_base
    }};
}

/// How many of a chain's `len` WRs a post that returned `rc` took: all of them if it
/// succeeded, else those before `bad`.
fn posted<T>(rc: c_int, base: *const T, bad: *const T, len: usize) -> usize {
    if rc == 0 {
        len
    } else {
        posted_before(base, bad, len)
    }
}

/// How many WRs of a chain starting at `base` were posted when the provider stopped at
/// `bad` (none if `bad` is NULL, all of them if it lies outside the chain).
fn posted_before<T>(base: *const T, bad: *const T, len: usize) -> usize {
    if bad.is_null() {
        return 0;
    }
    let offset = (bad as usize).wrapping_sub(base as usize) / std::mem::size_of::<T>();
    offset.min(len)
}

impl QueuePair for VerbsQp {
    fn qp_num(&self) -> u32 {
        self.qp_num
    }

    fn state(&self) -> Result<QpState> {
        // SAFETY: plain C data; all-zero bytes are valid.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a live QP and valid out-pointers.
        let rc = unsafe {
            ibv_query_qp(
                self.qp.as_ptr(),
                &mut attr,
                ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int,
                &mut init,
            )
        };
        if rc != 0 {
            return Err(verb_error(self.name(), "ibv_query_qp", rc));
        }
        qp_state(attr.qp_state).ok_or_else(|| ProviderError::Os {
            device: self.name().to_owned(),
            operation: "ibv_query_qp",
            source: io::Error::other(format!("unknown QP state {}", attr.qp_state)),
        })
    }

    fn to_init(&self, port: u8, access: Access) -> Result<()> {
        self.pd.context.check_port(port)?;
        // SAFETY: plain C data; all-zero bytes are valid.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qp_access_flags = access.bits() as c_uint;
        self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )
    }

    fn to_rtr(&self, remote: &RemoteEndpoint, attrs: &RtrAttributes) -> Result<()> {
        self.pd.context.check_port(attrs.port)?;
        let path_mtu = ibv_mtu_of(attrs.path_mtu)
            .ok_or_else(|| self.invalid(format!("path MTU {} bytes", attrs.path_mtu)))?;
        let sgid_index = u8::try_from(attrs.sgid_index)
            .map_err(|_| self.invalid(format!("GID index {}", attrs.sgid_index)))?;
        // SAFETY: plain C data; all-zero bytes are valid.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = path_mtu;
        attr.dest_qp_num = remote.qp_num;
        attr.rq_psn = remote.psn & PSN_MASK;
        attr.max_dest_rd_atomic = attrs.max_dest_rd_atomic;
        attr.min_rnr_timer = attrs.min_rnr_timer;
        attr.ah_attr.is_global = 1;
        attr.ah_attr.grh.dgid = ibv_gid {
            raw: remote.gid.octets(),
        };
        attr.ah_attr.grh.sgid_index = sgid_index;
        attr.ah_attr.grh.hop_limit = 64;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = attrs.port;
        self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )
    }

    fn to_rts(&self, attrs: &RtsAttributes) -> Result<()> {
        // SAFETY: plain C data; all-zero bytes are valid.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = attrs.psn & PSN_MASK;
        attr.timeout = attrs.timeout;
        attr.retry_cnt = attrs.retry_cnt;
        attr.rnr_retry = attrs.rnr_retry;
        attr.max_rd_atomic = attrs.max_rd_atomic;
        self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )
    }

    fn to_error(&self) -> Result<()> {
        // Receives posted from here on are refused; those being posted reach the device
        // before the move (the two SeqCst pairs: one side sees the other's store).
        let was = self.errored.swap(true, Ordering::SeqCst);
        while self.recv_posts.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        // SAFETY: plain C data; all-zero bytes are valid.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        let moved = self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(ERR)",
        );
        if moved.is_err() && !was {
            // Not in ERR after all (RESET refuses the move): receives are taken again.
            self.errored.store(false, Ordering::SeqCst);
        }
        moved
    }

    /// Binding a window updates its rkey (`MemoryWindow::rkey`) once the bind is posted,
    /// both in rdmad's copy and in the `ibv_mw` the provider reads the current key from on
    /// the next bind (rxe checks it: without the update, the second bind of a window after
    /// an invalidation completes with `MemoryWindowBindError` — measured). Binding one window
    /// from two threads at once, or twice in one batch, is not supported.
    fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        // Windows this batch binds: rare, and `Vec::new` allocates nothing until a push.
        let mut binds = Vec::new();
        let (rc, posted) = SCRATCH.with_borrow_mut(|scratch| {
            let PostScratch {
                sends: raw_wrs,
                sges,
                firsts,
                ..
            } = scratch.cleared();
            for (index, wr) in wrs.iter().enumerate() {
                raw_wrs.push(
                    self.raw_send_wr(wr, &mut binds, index)
                        .map_err(PostError::none)?,
                );
                firsts.push(sges.len());
                sges.extend(wr.sges.iter().map(raw_sge));
            }
            let head = link_chain!(raw_wrs, sges, firsts);
            let mut bad: *mut ibv_send_wr = ptr::null_mut();
            // SAFETY: a live QP; `head` is a NULL-terminated chain of fully initialised WRs
            // whose SGE lists, windows and regions stay alive for the call (the provider
            // copies WRs into its queue before returning).
            let rc = unsafe { ibv_post_send(self.qp.as_ptr(), head, &mut bad) };
            Ok((rc, posted(rc, head, bad, wrs.len())))
        })?;
        for &(index, mw, rkey) in &binds {
            if index < posted {
                mw.rkey.store(rkey, Ordering::Release);
                // SAFETY: a live window; the provider reads `rkey` only inside a post on
                // this window (not concurrent with this one, see above).
                unsafe { (*mw.mw.as_ptr()).rkey = rkey };
            }
        }
        if rc != 0 {
            tracing::debug!(
                "{}: ibv_post_send on QP {} posted {posted} of {} work requests",
                self.name(),
                self.qp_num,
                wrs.len()
            );
            return Err(PostError {
                posted,
                error: verb_error(self.name(), "ibv_post_send", rc),
            });
        }
        Ok(())
    }

    fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        self.recv_posts.fetch_add(1, Ordering::SeqCst);
        let _posting = RecvPosting(&self.recv_posts);
        if self.errored.load(Ordering::SeqCst) {
            return Err(PostError::none(ProviderError::Flushed {
                device: self.name().to_owned(),
            }));
        }
        let (rc, posted) = SCRATCH.with_borrow_mut(|scratch| {
            let PostScratch {
                recvs: raw_wrs,
                sges,
                firsts,
                ..
            } = scratch.cleared();
            for wr in wrs {
                raw_wrs.push(ibv_recv_wr {
                    wr_id: wr.wr_id,
                    next: ptr::null_mut(),
                    sg_list: ptr::null_mut(),
                    num_sge: c_int::try_from(wr.sges.len()).map_err(|_| {
                        PostError::none(
                            self.invalid(format!("{} SGEs in one work request", wr.sges.len())),
                        )
                    })?,
                });
                firsts.push(sges.len());
                sges.extend(wr.sges.iter().map(raw_sge));
            }
            let head = link_chain!(raw_wrs, sges, firsts);
            let mut bad: *mut ibv_recv_wr = ptr::null_mut();
            // SAFETY: a live QP; `head` is a NULL-terminated chain of initialised WRs whose
            // SGE lists stay alive for the call (the provider copies them).
            let rc = unsafe { ibv_post_recv(self.qp.as_ptr(), head, &mut bad) };
            Ok((rc, posted(rc, head, bad, wrs.len())))
        })?;
        if rc != 0 {
            tracing::debug!(
                "{}: ibv_post_recv on QP {} posted {posted} of {} work requests",
                self.name(),
                self.qp_num,
                wrs.len()
            );
            return Err(PostError {
                posted,
                error: verb_error(self.name(), "ibv_post_recv", rc),
            });
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        // Blocks (~50 s on rxe) if a type-2 window bound through this QP is still valid:
        // the engine invalidates or drops windows first (module docs).
        // SAFETY: created in `create`, destroyed only here.
        let rc = unsafe { ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            tracing::error!(
                "{} (QP {})",
                verb_error(self.name(), "ibv_destroy_qp", rc),
                self.qp_num
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::SharedMemory;
    use crate::provider::verbs::open_device;
    use crate::provider::{
        Device, MemoryRegion, MemoryWindow, ObjectCounts, ProtectionDomain, WcOpcode, WcStatus,
        WorkCompletion,
    };
    use std::time::{Duration, Instant};

    const RXE: &str = "rxe0";
    const DEADLINE: Duration = Duration::from_secs(60);

    fn new_qp(pd: &Arc<dyn ProtectionDomain>, cq: &Arc<dyn CompletionQueue>) -> Arc<dyn QueuePair> {
        pd.create_qp(QpInit {
            send_cq: Arc::clone(cq),
            recv_cq: Arc::clone(cq),
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline_data: 0,
        })
        .expect("create_qp")
    }

    fn endpoint(dev: &dyn Device, qp: &dyn QueuePair) -> (RemoteEndpoint, u32) {
        let gid = dev
            .gid_table(1)
            .unwrap()
            .into_iter()
            .find(|g| g.is_ipv4_mapped())
            .expect("an IPv4-mapped GID");
        let endpoint = RemoteEndpoint {
            gid: gid.gid,
            qp_num: qp.qp_num(),
            psn: qp.qp_num().wrapping_mul(31) & PSN_MASK,
            lid: dev.query_port(1).unwrap().lid,
        };
        (endpoint, gid.index)
    }

    /// Connects two QPs of `dev` to each other (RTS, all remote rights on both).
    fn connect(dev: &dyn Device, x: &dyn QueuePair, y: &dyn QueuePair) {
        let mtu = dev.query_port(1).unwrap().active_mtu;
        let access = Access::LOCAL_WRITE
            | Access::REMOTE_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_ATOMIC;
        let (ex, index) = endpoint(dev, x);
        let (ey, _) = endpoint(dev, y);
        for (qp, own, peer) in [(x, &ex, &ey), (y, &ey, &ex)] {
            qp.to_init(1, access).unwrap();
            let rtr = RtrAttributes {
                port: 1,
                sgid_index: index,
                path_mtu: mtu,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
            };
            qp.to_rtr(peer, &rtr).unwrap();
            let rts = RtsAttributes {
                psn: own.psn,
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
                max_rd_atomic: 1,
            };
            qp.to_rts(&rts).unwrap();
        }
    }

    fn wait(cq: &dyn CompletionQueue) -> WorkCompletion {
        let start = Instant::now();
        let mut out = Vec::new();
        loop {
            cq.poll(&mut out, 1).unwrap();
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

    fn post(qp: &dyn QueuePair, wr_id: u64, op: SendOp, sges: Vec<Sge>) {
        qp.post_send(&[SendWr {
            wr_id,
            op,
            sges: sges.into(),
            signaled: true,
            inline: false,
        }])
        .unwrap();
    }

    fn sge(mr: &Arc<dyn MemoryRegion>, offset: u64, length: u32) -> Sge {
        Sge {
            addr: mr.addr() + offset,
            length,
            lkey: mr.lkey(),
        }
    }

    fn bind(
        qp: &dyn QueuePair,
        cq: &dyn CompletionQueue,
        mw: &Arc<dyn MemoryWindow>,
        mr: &Arc<dyn MemoryRegion>,
        access: Access,
    ) -> WorkCompletion {
        let op = SendOp::BindMw {
            mw: Arc::clone(mw),
            mr: Arc::clone(mr),
            addr: mr.addr(),
            len: mr.len() as u64,
            access,
        };
        post(qp, 900, op, Vec::new());
        wait(cq)
    }

    fn region(pd: &Arc<dyn ProtectionDomain>, len: usize) -> Arc<dyn MemoryRegion> {
        let memory = Arc::new(SharedMemory::create(c"rxe-data", len).unwrap());
        pd.register(memory, Access::LOCAL_WRITE | Access::MW_BIND)
            .unwrap()
    }

    fn read(mr: &Arc<dyn MemoryRegion>, offset: usize, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        mr.memory().read_at(offset, &mut buf).unwrap();
        buf
    }

    #[test]
    fn rxe_data_path_conformance() {
        let dev = open_device(RXE).expect("open rxe0");
        crate::provider::conformance_data::run_all(&dev);
        assert_eq!(dev.object_counts(), ObjectCounts::default());
    }

    /// **Finding (rxe, Linux 6.1):** rxe *does* enforce the type-2 binding to the QP. A
    /// window bound through QP X is usable by the peer connected to X; the same rkey sent by
    /// a peer connected to another QP Y of the same PD and device is refused: the requester
    /// gets `RemoteAccessError` (`IBV_WC_REM_ACCESS_ERR`) and the target memory is not
    /// touched. (`rxe_lookup_mw` rejects `mw->qp != qp` for type-2 windows, besides
    /// key, PD, access and state.) The window's *bounds* inside its MR are not enforced by
    /// rxe (vm-notes.md), but its QP is.
    #[test]
    fn rxe_window_rkey_used_through_another_qp() {
        let dev = open_device(RXE).expect("open rxe0");
        {
            // Target: one PD, one MR, QPs X and Y. Initiators: A1 ↔ X, A2 ↔ Y.
            let target_pd = dev.alloc_pd().unwrap();
            let target_mr = region(&target_pd, 4096);
            let target_cq = target_pd.create_cq(32).unwrap();
            let x = new_qp(&target_pd, &target_cq);
            let y = new_qp(&target_pd, &target_cq);
            let pd = dev.alloc_pd().unwrap();
            let mr = region(&pd, 4096);
            let cq = pd.create_cq(32).unwrap();
            let a1 = new_qp(&pd, &cq);
            let a2 = new_qp(&pd, &cq);
            connect(&dev, a1.as_ref(), x.as_ref());
            connect(&dev, a2.as_ref(), y.as_ref());

            let mw = target_pd.alloc_mw(MwType::Type2).unwrap();
            let unbound = mw.rkey();
            let wc = bind(
                x.as_ref(),
                target_cq.as_ref(),
                &mw,
                &target_mr,
                Access::REMOTE_WRITE,
            );
            assert_eq!(
                (wc.status, wc.opcode),
                (WcStatus::Success, WcOpcode::BindMw)
            );
            let rkey = mw.rkey();
            assert_eq!(
                rkey,
                inc_rkey(unbound),
                "the bound rkey is the incremented one"
            );

            mr.memory().write_at(0, b"via-x via-y").unwrap();
            let write = |qp: &dyn QueuePair, wr_id: u64, at: u64, offset: u64| {
                let op = SendOp::Write {
                    remote_addr: target_mr.addr() + at,
                    rkey,
                    imm: None,
                };
                post(qp, wr_id, op, vec![sge(&mr, offset, 5)]);
            };
            write(a1.as_ref(), 1, 0, 0);
            let wc = wait(cq.as_ref());
            assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success), "{wc:?}");
            assert_eq!(read(&target_mr, 0, 5), b"via-x");

            write(a2.as_ref(), 2, 100, 6);
            let wc = wait(cq.as_ref());
            assert_eq!(wc.wr_id, 2);
            assert_eq!(wc.status, WcStatus::RemoteAccessError, "{wc:?}");
            assert_eq!(
                read(&target_mr, 100, 5),
                [0u8; 5],
                "the target was not written"
            );

            // Teardown: the window before the QP it is bound through.
            drop(mw);
        }
        assert_eq!(dev.object_counts(), ObjectCounts::default());
    }

    /// A window can be bound again after a local invalidation: each bind takes the next
    /// rkey, and only the current one grants access.
    #[test]
    fn rxe_window_rebinds_after_invalidation() {
        let dev = open_device(RXE).expect("open rxe0");
        {
            let pd = dev.alloc_pd().unwrap();
            let target_mr = region(&pd, 4096);
            let mr = region(&pd, 4096);
            let cq = pd.create_cq(32).unwrap();
            let target_cq = pd.create_cq(32).unwrap();
            let a = new_qp(&pd, &cq);
            let b = new_qp(&pd, &target_cq);
            connect(&dev, a.as_ref(), b.as_ref());
            let mw = pd.alloc_mw(MwType::Type2).unwrap();
            let mut keys = Vec::new();
            for round in 0..3u64 {
                let wc = bind(
                    b.as_ref(),
                    target_cq.as_ref(),
                    &mw,
                    &target_mr,
                    Access::REMOTE_WRITE,
                );
                assert_eq!(wc.status, WcStatus::Success, "round {round}: {wc:?}");
                let rkey = mw.rkey();
                assert!(!keys.contains(&rkey), "a fresh rkey every bind");
                keys.push(rkey);
                mr.memory().write_at(0, &round.to_ne_bytes()).unwrap();
                let op = SendOp::Write {
                    remote_addr: target_mr.addr() + 8 * round,
                    rkey,
                    imm: None,
                };
                post(a.as_ref(), round, op, vec![sge(&mr, 0, 8)]);
                assert_eq!(wait(cq.as_ref()).status, WcStatus::Success);
                assert_eq!(read(&target_mr, 8 * round as usize, 8), round.to_ne_bytes());
                post(
                    b.as_ref(),
                    50 + round,
                    SendOp::LocalInvalidate { rkey },
                    Vec::new(),
                );
                let wc = wait(target_cq.as_ref());
                assert_eq!(
                    (wc.status, wc.opcode),
                    (WcStatus::Success, WcOpcode::LocalInvalidate)
                );
            }
        }
        assert_eq!(dev.object_counts(), ObjectCounts::default());
    }

    /// Arm, complete, wake: the channel descriptor becomes readable, the events are
    /// acknowledged without blocking, and a second acknowledgement finds none.
    #[test]
    fn rxe_completion_channel_wakes_an_armed_cq() {
        let dev = open_device(RXE).expect("open rxe0");
        {
            let pd = dev.alloc_pd().unwrap();
            let mr = region(&pd, 4096);
            let cq = pd.create_cq(16).unwrap();
            let peer_cq = pd.create_cq(16).unwrap();
            let a = new_qp(&pd, &cq);
            let b = new_qp(&pd, &peer_cq);
            connect(&dev, a.as_ref(), b.as_ref());
            assert_eq!(
                cq.acknowledge_events().unwrap(),
                0,
                "nothing pending, no blocking"
            );
            // SAFETY: F_GETFL on the channel's open descriptor.
            let flags = unsafe {
                libc::fcntl(
                    std::os::fd::AsRawFd::as_raw_fd(&cq.event_fd()),
                    libc::F_GETFL,
                )
            };
            assert_ne!(flags & libc::O_NONBLOCK, 0);

            cq.arm().unwrap();
            b.post_recv(&[RecvWr {
                wr_id: 5,
                sges: smallvec::smallvec![sge(&mr, 100, 16)],
            }])
            .unwrap();
            post(
                a.as_ref(),
                6,
                SendOp::Send { imm: None },
                vec![sge(&mr, 0, 16)],
            );
            let mut pfd = libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&cq.event_fd()),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let ready = unsafe { libc::poll(&mut pfd, 1, 60_000) };
            assert_eq!(ready, 1, "the channel became readable");
            assert_eq!(cq.acknowledge_events().unwrap(), 1);
            assert_eq!(cq.acknowledge_events().unwrap(), 0);
            let wc = wait(cq.as_ref());
            assert_eq!(
                (wc.wr_id, wc.status, wc.opcode),
                (6, WcStatus::Success, WcOpcode::Send)
            );
            let wc = wait(peer_cq.as_ref());
            assert_eq!((wc.wr_id, wc.byte_len, wc.imm), (5, 16, None));

            // Leave an event unacknowledged: dropping the CQ must not hang.
            cq.arm().unwrap();
            b.post_recv(&[RecvWr {
                wr_id: 7,
                sges: smallvec::smallvec![sge(&mr, 100, 16)],
            }])
            .unwrap();
            post(
                a.as_ref(),
                8,
                SendOp::Send { imm: None },
                vec![sge(&mr, 0, 16)],
            );
            assert_eq!(wait(cq.as_ref()).status, WcStatus::Success);
            assert_eq!(wait(peer_cq.as_ref()).wr_id, 7);

            // ERROR flushes what is outstanding.
            b.post_recv(&[RecvWr {
                wr_id: 9,
                sges: smallvec::smallvec![sge(&mr, 200, 16)],
            }])
            .unwrap();
            b.to_error().unwrap();
            assert_eq!(b.state().unwrap(), QpState::Error);
            let wc = wait(peer_cq.as_ref());
            assert_eq!((wc.wr_id, wc.status), (9, WcStatus::WrFlushError));
            // What is posted in ERROR: a send completes flushed; a receive Soft-RoCE would
            // never complete is refused as flushed, for the caller to complete.
            post(
                b.as_ref(),
                11,
                SendOp::Send { imm: None },
                vec![sge(&mr, 0, 16)],
            );
            let wc = wait(peer_cq.as_ref());
            assert_eq!((wc.wr_id, wc.status), (11, WcStatus::WrFlushError));
            let refused = b
                .post_recv(&[RecvWr {
                    wr_id: 10,
                    sges: smallvec::smallvec![sge(&mr, 200, 16)],
                }])
                .expect_err("a receive posted in ERROR");
            assert_eq!(refused.posted, 0);
            assert!(
                matches!(refused.error, ProviderError::Flushed { .. }),
                "{refused}"
            );
        }
        assert_eq!(dev.object_counts(), ObjectCounts::default());
    }

    /// A batch larger than the send queue is refused by `ibv_post_send` with an errno
    /// (returned, not -1/`errno`), reported as `ProviderError::Os` with that errno.
    #[test]
    fn rxe_send_queue_overflow_is_an_os_error() {
        let dev = open_device(RXE).expect("open rxe0");
        {
            let pd = dev.alloc_pd().unwrap();
            let mr = region(&pd, 4096);
            let cq = pd.create_cq(256).unwrap();
            let peer_cq = pd.create_cq(16).unwrap();
            let a = new_qp(&pd, &cq);
            let b = new_qp(&pd, &peer_cq);
            connect(&dev, a.as_ref(), b.as_ref());
            // Writes to the peer's region through its MR rkey (no remote rights): each
            // would fail remotely, but the batch is refused before that for its size.
            let wrs: Vec<SendWr> = (0..128)
                .map(|i| SendWr {
                    wr_id: i,
                    op: SendOp::Write {
                        remote_addr: mr.addr(),
                        rkey: mr.rkey(),
                        imm: None,
                    },
                    sges: smallvec::smallvec![sge(&mr, 0, 8)],
                    signaled: false,
                    inline: false,
                })
                .collect();
            match a.post_send(&wrs) {
                Err(PostError {
                    posted,
                    error:
                        ProviderError::Os {
                            operation, source, ..
                        },
                }) => {
                    assert_eq!(operation, "ibv_post_send");
                    assert_eq!(source.raw_os_error(), Some(libc::ENOMEM), "{source}");
                    assert!(posted < wrs.len(), "{posted} of {} posted", wrs.len());
                }
                other => panic!("expected an Os error, got {other:?}"),
            }
        }
        assert_eq!(dev.object_counts(), ObjectCounts::default());
    }

    #[test]
    fn rxe_foreign_cq_is_refused() {
        let dev = open_device(RXE).expect("open rxe0");
        let pd = dev.alloc_pd().unwrap();
        let cq = pd.create_cq(4).unwrap();
        // A CQ of another context of the same device is not usable either.
        let other_dev = open_device(RXE).unwrap();
        let other_cq = other_dev.alloc_pd().unwrap().create_cq(4).unwrap();
        let init = |send_cq: &Arc<dyn CompletionQueue>| QpInit {
            send_cq: Arc::clone(send_cq),
            recv_cq: Arc::clone(&cq),
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let result = pd.create_qp(init(&other_cq));
        assert!(
            matches!(result, Err(ProviderError::InvalidArgument { .. })),
            "{result:?}"
        );
        assert_eq!(dev.object_counts().qps, 0);
    }

    #[test]
    fn rkey_increment_keeps_the_index() {
        assert_eq!(inc_rkey(0x1234_5600), 0x1234_5601);
        assert_eq!(inc_rkey(0x1234_56ff), 0x1234_5600);
        assert_eq!(inc_rkey(u32::MAX), 0xffff_ff00);
    }

    #[test]
    fn mtu_and_state_decoding() {
        assert_eq!(ibv_mtu_of(1024), Some(ibv_mtu::IBV_MTU_1024));
        assert_eq!(ibv_mtu_of(1500), None);
        assert_eq!(qp_state(ibv_qp_state::IBV_QPS_ERR), Some(QpState::Error));
        assert_eq!(qp_state(ibv_qp_state::IBV_QPS_UNKNOWN), None);
    }

    #[test]
    fn posted_before_counts_from_the_head() {
        let wrs = [0u64; 4];
        let base = wrs.as_ptr();
        assert_eq!(posted_before(base, base.wrapping_add(2), 4), 2);
        assert_eq!(posted_before(base, ptr::null(), 4), 0);
    }
}
