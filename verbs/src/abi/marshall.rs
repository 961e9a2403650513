//! libibverbs's conversions between the kernel's forms of QP attributes, address vectors
//! and path records and verbs' (`<infiniband/marshall.h>`). librdmacm calls them for every
//! `rdma_init_qp_attr`: the kernel's connection manager computes the attributes of each
//! state a connected QP moves through (the peer's QPN and PSN, the path's GID, MTU and
//! depths), and `rdma_connect`, `rdma_accept` and `rdma_create_qp` hand them to
//! `ibv_modify_qp` — which, for a QP of this library, is rdmad's. They copy field by field,
//! as rdma-core's do; `qp_state` and the attribute mask are left to the caller.

use super::sys;

// librdmacm hands these a `dst` on its stack that it has not initialised: they write
// through raw pointers, field by field, and never make a reference to it.

/// # Safety
/// `dst` and `src` are NULL or point at the structures their types name (`dst` may be
/// uninitialised).
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_copy_ah_attr_from_kern(
    dst: *mut sys::ibv_ah_attr,
    src: *const sys::ib_uverbs_ah_attr,
) {
    if dst.is_null() {
        return;
    }
    // SAFETY: `src` is NULL or a `struct ib_uverbs_ah_attr` the kernel filled.
    let Some(src) = (unsafe { src.as_ref() }) else {
        return;
    };
    // SAFETY: `dst` points at a `struct ibv_ah_attr`, written through the pointer.
    unsafe { ah_attr_from_kern(dst, src) };
}

/// # Safety
/// `dst` points at a `struct ibv_ah_attr` (initialised or not).
unsafe fn ah_attr_from_kern(dst: *mut sys::ibv_ah_attr, src: &sys::ib_uverbs_ah_attr) {
    // SAFETY: plain stores of integer fields through the caller's pointer.
    unsafe {
        (*dst).grh.dgid.raw = src.grh.dgid;
        (*dst).grh.flow_label = src.grh.flow_label;
        (*dst).grh.sgid_index = src.grh.sgid_index;
        (*dst).grh.hop_limit = src.grh.hop_limit;
        (*dst).grh.traffic_class = src.grh.traffic_class;
        (*dst).dlid = src.dlid;
        (*dst).sl = src.sl;
        (*dst).src_path_bits = src.src_path_bits;
        (*dst).static_rate = src.static_rate;
        (*dst).is_global = src.is_global;
        (*dst).port_num = src.port_num;
    }
}

/// # Safety
/// `dst` and `src` are NULL or point at the structures their types name (`dst` may be
/// uninitialised; its `qp_state` is left as it is).
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_copy_qp_attr_from_kern(
    dst: *mut sys::ibv_qp_attr,
    src: *const sys::ib_uverbs_qp_attr,
) {
    if dst.is_null() {
        return;
    }
    // SAFETY: `src` is NULL or a `struct ib_uverbs_qp_attr` the kernel filled.
    let Some(src) = (unsafe { src.as_ref() }) else {
        return;
    };
    // SAFETY: `dst` points at a `struct ibv_qp_attr`: plain stores of integer fields
    // through the pointer, and the two address vectors through pointers to them.
    unsafe {
        (*dst).cur_qp_state = src.cur_qp_state;
        (*dst).path_mtu = src.path_mtu;
        (*dst).path_mig_state = src.path_mig_state;
        (*dst).qkey = src.qkey;
        (*dst).rq_psn = src.rq_psn;
        (*dst).sq_psn = src.sq_psn;
        (*dst).dest_qp_num = src.dest_qp_num;
        (*dst).qp_access_flags = src.qp_access_flags as _;
        (*dst).cap.max_send_wr = src.max_send_wr;
        (*dst).cap.max_recv_wr = src.max_recv_wr;
        (*dst).cap.max_send_sge = src.max_send_sge;
        (*dst).cap.max_recv_sge = src.max_recv_sge;
        (*dst).cap.max_inline_data = src.max_inline_data;
        ah_attr_from_kern(std::ptr::addr_of_mut!((*dst).ah_attr), &src.ah_attr);
        ah_attr_from_kern(std::ptr::addr_of_mut!((*dst).alt_ah_attr), &src.alt_ah_attr);
        (*dst).pkey_index = src.pkey_index;
        (*dst).alt_pkey_index = src.alt_pkey_index;
        (*dst).en_sqd_async_notify = src.en_sqd_async_notify;
        (*dst).sq_draining = src.sq_draining;
        (*dst).max_rd_atomic = src.max_rd_atomic;
        (*dst).max_dest_rd_atomic = src.max_dest_rd_atomic;
        (*dst).min_rnr_timer = src.min_rnr_timer;
        (*dst).port_num = src.port_num;
        (*dst).timeout = src.timeout;
        (*dst).retry_cnt = src.retry_cnt;
        (*dst).rnr_retry = src.rnr_retry;
        (*dst).alt_port_num = src.alt_port_num;
        (*dst).alt_timeout = src.alt_timeout;
    }
}

/// Copies a path record's fields but its GIDs from `$src` to `*$dst` (a raw pointer), in
/// either direction between verbs' and the kernel's forms (the same names; C's implicit
/// conversions where the widths differ).
macro_rules! path_rec_fields {
    ($dst:expr, $src:expr) => {{
        let (dst, src) = ($dst, $src);
        (*dst).dlid = src.dlid;
        (*dst).slid = src.slid;
        (*dst).raw_traffic = src.raw_traffic as _;
        (*dst).flow_label = src.flow_label;
        (*dst).hop_limit = src.hop_limit;
        (*dst).traffic_class = src.traffic_class;
        (*dst).reversible = src.reversible as _;
        (*dst).numb_path = src.numb_path;
        (*dst).pkey = src.pkey;
        (*dst).sl = src.sl;
        (*dst).mtu_selector = src.mtu_selector;
        (*dst).mtu = src.mtu as _;
        (*dst).rate_selector = src.rate_selector;
        (*dst).rate = src.rate;
        (*dst).packet_life_time = src.packet_life_time;
        (*dst).preference = src.preference;
        (*dst).packet_life_time_selector = src.packet_life_time_selector;
    }};
}

/// # Safety
/// `dst` and `src` are NULL or point at the structures their types name (`dst` may be
/// uninitialised).
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_copy_path_rec_from_kern(
    dst: *mut sys::ibv_sa_path_rec,
    src: *const sys::ib_user_path_rec,
) {
    if dst.is_null() {
        return;
    }
    // SAFETY: `src` is NULL or a `struct ib_user_path_rec` the kernel filled.
    let Some(src) = (unsafe { src.as_ref() }) else {
        return;
    };
    // SAFETY: `dst` points at a `struct ibv_sa_path_rec`: plain stores of integer fields
    // through the pointer.
    unsafe {
        (*dst).dgid.raw = src.dgid;
        (*dst).sgid.raw = src.sgid;
        path_rec_fields!(dst, src);
    }
}

/// # Safety
/// `dst` and `src` are NULL or point at the structures their types name (`dst` may be
/// uninitialised).
#[no_mangle]
pub unsafe extern "C" fn __rdmad_ibv_copy_path_rec_to_kern(
    dst: *mut sys::ib_user_path_rec,
    src: *const sys::ibv_sa_path_rec,
) {
    if dst.is_null() {
        return;
    }
    // SAFETY: `src` is NULL or an initialised `struct ibv_sa_path_rec`.
    let Some(src) = (unsafe { src.as_ref() }) else {
        return;
    };
    // SAFETY: any 16 bytes are a valid `[u8; 16]`, whichever view of the GIDs was written.
    let (dgid, sgid) = unsafe { (src.dgid.raw, src.sgid.raw) };
    // SAFETY: `dst` points at a `struct ib_user_path_rec`: plain stores of integer fields
    // through the pointer.
    unsafe {
        (*dst).dgid = dgid;
        (*dst).sgid = sgid;
        path_rec_fields!(dst, src);
    }
}

symver! {
    __rdmad_ibv_copy_path_rec_from_kern => "ibv_copy_path_rec_from_kern" @ "IBVERBS_1.0";
    __rdmad_ibv_copy_path_rec_to_kern => "ibv_copy_path_rec_to_kern" @ "IBVERBS_1.0";
    __rdmad_ibv_copy_qp_attr_from_kern => "ibv_copy_qp_attr_from_kern" @ "IBVERBS_1.0";
    __rdmad_ibv_copy_ah_attr_from_kern => "ibv_copy_ah_attr_from_kern" @ "IBVERBS_1.1";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kernel_qp_attr_becomes_the_verbs_one_field_by_field() {
        let mut src = sys::ib_uverbs_qp_attr {
            path_mtu: 3,
            rq_psn: 0x12_3456,
            sq_psn: 0x65_4321,
            dest_qp_num: 0x11,
            qp_access_flags: 7,
            max_dest_rd_atomic: 4,
            max_rd_atomic: 2,
            min_rnr_timer: 12,
            port_num: 1,
            timeout: 14,
            retry_cnt: 6,
            rnr_retry: 7,
            pkey_index: 0,
            ..Default::default()
        };
        src.ah_attr.grh.dgid = [0xfd; 16];
        src.ah_attr.grh.sgid_index = 2;
        src.ah_attr.grh.hop_limit = 64;
        src.ah_attr.is_global = 1;
        src.ah_attr.port_num = 1;
        let mut dst = sys::ibv_qp_attr {
            qp_state: sys::ibv_qp_state_IBV_QPS_RTR,
            ..Default::default()
        };
        // SAFETY: both point at live structures of their types.
        unsafe { __rdmad_ibv_copy_qp_attr_from_kern(&mut dst, &src) };
        assert_eq!(dst.qp_state, sys::ibv_qp_state_IBV_QPS_RTR, "left alone");
        assert_eq!(
            (dst.path_mtu, dst.rq_psn, dst.sq_psn, dst.dest_qp_num),
            (3, 0x12_3456, 0x65_4321, 0x11)
        );
        assert_eq!(dst.qp_access_flags, 7);
        assert_eq!((dst.max_dest_rd_atomic, dst.max_rd_atomic), (4, 2));
        assert_eq!(
            (dst.min_rnr_timer, dst.timeout, dst.retry_cnt, dst.rnr_retry),
            (12, 14, 6, 7)
        );
        // SAFETY: any 16 bytes are a valid `[u8; 16]`.
        assert_eq!(unsafe { dst.ah_attr.grh.dgid.raw }, [0xfd; 16]);
        assert_eq!(
            (
                dst.ah_attr.grh.sgid_index,
                dst.ah_attr.grh.hop_limit,
                dst.ah_attr.is_global,
                dst.ah_attr.port_num,
                dst.port_num
            ),
            (2, 64, 1, 1, 1)
        );
    }

    #[test]
    fn a_path_record_goes_to_the_kernel_and_back_unchanged() {
        let mut path = sys::ibv_sa_path_rec {
            dlid: 0x1234u16.to_be(),
            flow_label: 0xabcdu32.to_be(),
            hop_limit: 64,
            mtu: 4,
            pkey: 0xffffu16.to_be(),
            rate: 3,
            packet_life_time: 18,
            ..Default::default()
        };
        path.dgid.raw = [1; 16];
        path.sgid.raw = [2; 16];
        let mut kern = sys::ib_user_path_rec::default();
        let mut back = sys::ibv_sa_path_rec::default();
        // SAFETY: all three point at live structures of their types.
        unsafe {
            __rdmad_ibv_copy_path_rec_to_kern(&mut kern, &path);
            __rdmad_ibv_copy_path_rec_from_kern(&mut back, &kern);
        }
        assert_eq!((kern.dgid, kern.sgid), ([1; 16], [2; 16]));
        // SAFETY: any 16 bytes are a valid `[u8; 16]`.
        let gids = unsafe { (back.dgid.raw, back.sgid.raw) };
        assert_eq!(gids, ([1; 16], [2; 16]));
        assert_eq!(
            (
                back.dlid,
                back.flow_label,
                back.hop_limit,
                back.mtu,
                back.pkey
            ),
            (path.dlid, path.flow_label, 64, 4, path.pkey)
        );
        assert_eq!((back.rate, back.packet_life_time), (3, 18));
    }

    #[test]
    fn null_pointers_are_left_alone() {
        // SAFETY: NULL is what these accept without reading or writing.
        unsafe {
            __rdmad_ibv_copy_qp_attr_from_kern(std::ptr::null_mut(), std::ptr::null());
            __rdmad_ibv_copy_ah_attr_from_kern(std::ptr::null_mut(), std::ptr::null());
            __rdmad_ibv_copy_path_rec_from_kern(std::ptr::null_mut(), std::ptr::null());
            __rdmad_ibv_copy_path_rec_to_kern(std::ptr::null_mut(), std::ptr::null());
        }
    }
}
