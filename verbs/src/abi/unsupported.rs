//! The verbs this library does not offer (yet), under libibverbs's names and versions so
//! that every program and provider library linked against libibverbs loads (they are
//! bound at load time). Each fails the way libibverbs reports an unsupported verb: a
//! pointer-returning verb returns NULL with `errno` `EOPNOTSUPP`, one that returns an
//! error number returns `EOPNOTSUPP`, one that returns −1 sets `errno`. The destroy,
//! modify and query verbs of objects this library never makes return `EINVAL`: whatever
//! pointer they get is not one of ours. rdma-core's private verbs (`ibv_cmd_*`, `verbs_*`)
//! are only ever called by a provider library for its own devices, never for rdmad's.
//!
//! None of them reads its arguments, so each is declared without them: under the C
//! calling convention a callee may ignore what it is passed.

use std::ffi::c_int;
use std::sync::Mutex;

use super::set_errno;

/// Says once per verb, on stderr, that a program asked for a verb rdmad does not offer.
fn report(name: &str) {
    static SEEN: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut seen = SEEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !seen.contains(&name) {
        if let Some(name) = NAMES.iter().find(|n| **n == name) {
            seen.push(name);
            eprintln!(
                "rdmad-verbs: {name} is not supported through rdmad (docs/verbs.md lists what is)"
            );
        }
    }
}

const NAMES: &[&str] = &[
    "ibv_create_ah",
    "ibv_create_ah_from_wc",
    "ibv_create_srq",
    "ibv_import_device",
    "ibv_import_mr",
    "ibv_import_pd",
    "ibv_reg_dmabuf_mr",
    "ibv_import_dm",
];

#[no_mangle]
pub extern "C" fn __rdmad_ibv_create_ah() -> *mut std::ffi::c_void {
    report("ibv_create_ah");
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_create_ah_from_wc() -> *mut std::ffi::c_void {
    report("ibv_create_ah_from_wc");
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_create_srq() -> *mut std::ffi::c_void {
    report("ibv_create_srq");
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_import_device() -> *mut std::ffi::c_void {
    report("ibv_import_device");
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_import_mr() -> *mut std::ffi::c_void {
    report("ibv_import_mr");
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_import_pd() -> *mut std::ffi::c_void {
    report("ibv_import_pd");
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_reg_dmabuf_mr() -> *mut std::ffi::c_void {
    report("ibv_reg_dmabuf_mr");
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_import_dm() -> *mut std::ffi::c_void {
    report("ibv_import_dm");
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_qp_to_qp_ex() -> *mut std::ffi::c_void {
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_verbs_init_and_alloc_context() -> *mut std::ffi::c_void {
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_verbs_open_device() -> *mut std::ffi::c_void {
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_attach_mcast() -> c_int {
    libc::EINVAL
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_destroy_ah() -> c_int {
    libc::EINVAL
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_destroy_srq() -> c_int {
    libc::EINVAL
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_detach_mcast() -> c_int {
    libc::EINVAL
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_modify_srq() -> c_int {
    libc::EINVAL
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_query_srq() -> c_int {
    libc::EINVAL
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_resize_cq() -> c_int {
    libc::EINVAL
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_init_ah_from_wc() -> c_int {
    set_errno(libc::EOPNOTSUPP);
    -1
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_rereg_mr() -> c_int {
    set_errno(libc::EOPNOTSUPP);
    -1
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_resolve_eth_l2_from_gid() -> c_int {
    set_errno(libc::EOPNOTSUPP);
    -1
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_read_ibdev_sysfs_file() -> c_int {
    set_errno(libc::EOPNOTSUPP);
    -1
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_query_qp_data_in_order() -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn __rdmad_ioctl_final_num_attrs() -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_unimport_mr() {}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_unimport_pd() {}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_unimport_dm() {}

#[no_mangle]
pub extern "C" fn __rdmad_verbs_log() {}

#[no_mangle]
pub extern "C" fn __rdmad_verbs_init_cq() {}

#[no_mangle]
pub extern "C" fn __rdmad_verbs_register_driver_34() {}

#[no_mangle]
pub extern "C" fn __rdmad_verbs_set_ops() {}

#[no_mangle]
pub extern "C" fn __rdmad_verbs_uninit_context() {}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_query_ece() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_set_ece() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_execute_ioctl() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_advise_mr() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_alloc_dm() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_alloc_mw() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_alloc_pd() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_attach_mcast() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_close_xrcd() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_ah() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_counters() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_cq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_cq_ex() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_flow() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_flow_action_esp() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_qp() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_qp_ex() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_qp_ex2() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_rwq_ind_table() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_srq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_srq_ex() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_create_wq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_dealloc_mw() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_dealloc_pd() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_dereg_mr() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_destroy_ah() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_destroy_counters() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_destroy_cq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_destroy_flow() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_destroy_flow_action() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_destroy_qp() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_destroy_rwq_ind_table() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_destroy_srq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_destroy_wq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_detach_mcast() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_free_dm() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_get_context() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_modify_cq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_modify_flow_action_esp() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_modify_qp() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_modify_qp_ex() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_modify_srq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_modify_wq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_open_qp() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_open_xrcd() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_poll_cq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_post_recv() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_post_send() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_post_srq_recv() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_query_context() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_query_device_any() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_query_mr() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_query_port() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_query_qp() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_query_srq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_read_counters() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_reg_dm_mr() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_reg_dmabuf_mr() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_reg_mr() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_req_notify_cq() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_rereg_mr() -> c_int {
    libc::EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn __rdmad_ibv_cmd_resize_cq() -> c_int {
    libc::EOPNOTSUPP
}

/// rdma-core's `verbs_allow_disassociate_destroy`: read by provider libraries only.
#[no_mangle]
pub static __rdmad_verbs_allow_disassociate_destroy: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

symver! {
    __rdmad_ibv_create_ah => "ibv_create_ah" @ "IBVERBS_1.1";
    __rdmad_ibv_create_ah_from_wc => "ibv_create_ah_from_wc" @ "IBVERBS_1.1";
    __rdmad_ibv_create_srq => "ibv_create_srq" @ "IBVERBS_1.1";
    __rdmad_ibv_import_device => "ibv_import_device" @ "IBVERBS_1.10";
    __rdmad_ibv_import_mr => "ibv_import_mr" @ "IBVERBS_1.10";
    __rdmad_ibv_import_pd => "ibv_import_pd" @ "IBVERBS_1.10";
    __rdmad_ibv_reg_dmabuf_mr => "ibv_reg_dmabuf_mr" @ "IBVERBS_1.12";
    __rdmad_ibv_import_dm => "ibv_import_dm" @ "IBVERBS_1.13";
    __rdmad_ibv_qp_to_qp_ex => "ibv_qp_to_qp_ex" @ "IBVERBS_1.6";
    __rdmad_verbs_init_and_alloc_context => "_verbs_init_and_alloc_context" @ "IBVERBS_PRIVATE_34";
    __rdmad_verbs_open_device => "verbs_open_device" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_attach_mcast => "ibv_attach_mcast" @ "IBVERBS_1.1";
    __rdmad_ibv_destroy_ah => "ibv_destroy_ah" @ "IBVERBS_1.1";
    __rdmad_ibv_destroy_srq => "ibv_destroy_srq" @ "IBVERBS_1.1";
    __rdmad_ibv_detach_mcast => "ibv_detach_mcast" @ "IBVERBS_1.1";
    __rdmad_ibv_modify_srq => "ibv_modify_srq" @ "IBVERBS_1.1";
    __rdmad_ibv_query_srq => "ibv_query_srq" @ "IBVERBS_1.1";
    __rdmad_ibv_resize_cq => "ibv_resize_cq" @ "IBVERBS_1.1";
    __rdmad_ibv_init_ah_from_wc => "ibv_init_ah_from_wc" @ "IBVERBS_1.1";
    __rdmad_ibv_rereg_mr => "ibv_rereg_mr" @ "IBVERBS_1.1";
    __rdmad_ibv_resolve_eth_l2_from_gid => "ibv_resolve_eth_l2_from_gid" @ "IBVERBS_1.1";
    __rdmad_ibv_read_ibdev_sysfs_file => "ibv_read_ibdev_sysfs_file" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_query_qp_data_in_order => "ibv_query_qp_data_in_order" @ "IBVERBS_1.14";
    __rdmad_ioctl_final_num_attrs => "__ioctl_final_num_attrs" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_unimport_mr => "ibv_unimport_mr" @ "IBVERBS_1.10";
    __rdmad_ibv_unimport_pd => "ibv_unimport_pd" @ "IBVERBS_1.10";
    __rdmad_ibv_unimport_dm => "ibv_unimport_dm" @ "IBVERBS_1.13";
    __rdmad_verbs_log => "__verbs_log" @ "IBVERBS_PRIVATE_34";
    __rdmad_verbs_init_cq => "verbs_init_cq" @ "IBVERBS_PRIVATE_34";
    __rdmad_verbs_register_driver_34 => "verbs_register_driver_34" @ "IBVERBS_PRIVATE_34";
    __rdmad_verbs_set_ops => "verbs_set_ops" @ "IBVERBS_PRIVATE_34";
    __rdmad_verbs_uninit_context => "verbs_uninit_context" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_query_ece => "ibv_query_ece" @ "IBVERBS_1.10";
    __rdmad_ibv_set_ece => "ibv_set_ece" @ "IBVERBS_1.10";
    __rdmad_execute_ioctl => "execute_ioctl" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_advise_mr => "ibv_cmd_advise_mr" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_alloc_dm => "ibv_cmd_alloc_dm" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_alloc_mw => "ibv_cmd_alloc_mw" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_alloc_pd => "ibv_cmd_alloc_pd" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_attach_mcast => "ibv_cmd_attach_mcast" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_close_xrcd => "ibv_cmd_close_xrcd" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_ah => "ibv_cmd_create_ah" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_counters => "ibv_cmd_create_counters" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_cq => "ibv_cmd_create_cq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_cq_ex => "ibv_cmd_create_cq_ex" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_flow => "ibv_cmd_create_flow" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_flow_action_esp => "ibv_cmd_create_flow_action_esp" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_qp => "ibv_cmd_create_qp" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_qp_ex => "ibv_cmd_create_qp_ex" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_qp_ex2 => "ibv_cmd_create_qp_ex2" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_rwq_ind_table => "ibv_cmd_create_rwq_ind_table" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_srq => "ibv_cmd_create_srq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_srq_ex => "ibv_cmd_create_srq_ex" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_create_wq => "ibv_cmd_create_wq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_dealloc_mw => "ibv_cmd_dealloc_mw" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_dealloc_pd => "ibv_cmd_dealloc_pd" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_dereg_mr => "ibv_cmd_dereg_mr" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_destroy_ah => "ibv_cmd_destroy_ah" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_destroy_counters => "ibv_cmd_destroy_counters" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_destroy_cq => "ibv_cmd_destroy_cq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_destroy_flow => "ibv_cmd_destroy_flow" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_destroy_flow_action => "ibv_cmd_destroy_flow_action" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_destroy_qp => "ibv_cmd_destroy_qp" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_destroy_rwq_ind_table => "ibv_cmd_destroy_rwq_ind_table" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_destroy_srq => "ibv_cmd_destroy_srq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_destroy_wq => "ibv_cmd_destroy_wq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_detach_mcast => "ibv_cmd_detach_mcast" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_free_dm => "ibv_cmd_free_dm" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_get_context => "ibv_cmd_get_context" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_modify_cq => "ibv_cmd_modify_cq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_modify_flow_action_esp => "ibv_cmd_modify_flow_action_esp" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_modify_qp => "ibv_cmd_modify_qp" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_modify_qp_ex => "ibv_cmd_modify_qp_ex" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_modify_srq => "ibv_cmd_modify_srq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_modify_wq => "ibv_cmd_modify_wq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_open_qp => "ibv_cmd_open_qp" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_open_xrcd => "ibv_cmd_open_xrcd" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_poll_cq => "ibv_cmd_poll_cq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_post_recv => "ibv_cmd_post_recv" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_post_send => "ibv_cmd_post_send" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_post_srq_recv => "ibv_cmd_post_srq_recv" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_query_context => "ibv_cmd_query_context" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_query_device_any => "ibv_cmd_query_device_any" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_query_mr => "ibv_cmd_query_mr" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_query_port => "ibv_cmd_query_port" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_query_qp => "ibv_cmd_query_qp" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_query_srq => "ibv_cmd_query_srq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_read_counters => "ibv_cmd_read_counters" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_reg_dm_mr => "ibv_cmd_reg_dm_mr" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_reg_dmabuf_mr => "ibv_cmd_reg_dmabuf_mr" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_reg_mr => "ibv_cmd_reg_mr" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_req_notify_cq => "ibv_cmd_req_notify_cq" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_rereg_mr => "ibv_cmd_rereg_mr" @ "IBVERBS_PRIVATE_34";
    __rdmad_ibv_cmd_resize_cq => "ibv_cmd_resize_cq" @ "IBVERBS_PRIVATE_34";
    __rdmad_verbs_allow_disassociate_destroy => "verbs_allow_disassociate_destroy" @ "IBVERBS_PRIVATE_34";
}
