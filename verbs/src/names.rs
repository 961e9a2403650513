//! The tables behind libibverbs's string helpers (`ibv_wc_status_str`, …) and its rate
//! conversions, with libibverbs's own wording so that programs print what they print
//! on a kernel device.

use std::ffi::CStr;

/// `ibv_node_type_str`.
pub fn node_type(value: i32) -> &'static CStr {
    match value {
        1 => c"InfiniBand channel adapter",
        2 => c"InfiniBand switch",
        3 => c"InfiniBand router",
        4 => c"iWARP NIC",
        5 => c"usNIC",
        6 => c"usNIC UDP",
        7 => c"unspecified",
        _ => c"unknown",
    }
}

/// `ibv_port_state_str`.
pub fn port_state(value: u32) -> &'static CStr {
    match value {
        0 => c"no state change (NOP)",
        1 => c"down",
        2 => c"init",
        3 => c"armed",
        4 => c"active",
        5 => c"active defer",
        _ => c"unknown",
    }
}

/// `ibv_event_type_str`.
pub fn event_type(value: u32) -> &'static CStr {
    const NAMES: [&CStr; 20] = [
        c"CQ error",
        c"local work queue catastrophic error",
        c"invalid request local work queue error",
        c"local access violation work queue error",
        c"communication established",
        c"send queue drained",
        c"path migrated",
        c"path migration request error",
        c"local catastrophic error",
        c"port active",
        c"port error",
        c"LID change",
        c"P_Key change",
        c"SM change",
        c"SRQ catastrophic error",
        c"SRQ limit reached",
        c"last WQE reached",
        c"client reregistration",
        c"GID table change",
        c"WQ fatal",
    ];
    NAMES.get(value as usize).copied().unwrap_or(c"unknown")
}

/// `ibv_wc_status_str`.
pub fn wc_status(value: u32) -> &'static CStr {
    const NAMES: [&CStr; 23] = [
        c"success",
        c"local length error",
        c"local QP operation error",
        c"local EE context operation error",
        c"local protection error",
        c"Work Request Flushed Error",
        c"memory management operation error",
        c"bad response error",
        c"local access error",
        c"remote invalid request error",
        c"remote access error",
        c"remote operation error",
        c"transport retry counter exceeded",
        c"RNR retry counter exceeded",
        c"local RDD violation error",
        c"remote invalid RD request",
        c"aborted error",
        c"invalid EE context number",
        c"invalid EE context state",
        c"fatal error",
        c"response timeout error",
        c"general error",
        c"TM error",
    ];
    match NAMES.get(value as usize) {
        Some(name) => name,
        None if value == 23 => c"TM software rendezvous",
        None => c"unknown",
    }
}

/// `enum ibv_rate` values with their multiple of 2.5 Gb/s (0: none; libibverbs gives the
/// 14/56/112/168/25/100/200/300 Gb/s rates no multiple) and their rate in Mb/s.
const RATES: [(i32, i32, i32); 24] = [
    (2, 1, 2500),
    (5, 2, 5000),
    (3, 4, 10000),
    (6, 8, 20000),
    (4, 12, 30000),
    (7, 16, 40000),
    (8, 24, 60000),
    (9, 32, 80000),
    (10, 48, 120000),
    (11, 0, 14062),
    (12, 0, 56250),
    (13, 0, 112500),
    (14, 0, 168750),
    (15, 0, 25781),
    (16, 0, 103125),
    (17, 0, 206250),
    (18, 0, 309375),
    (19, 11, 28125),
    (20, 20, 53125),
    (21, 160, 425000),
    (22, 240, 637500),
    (23, 320, 850000),
    (24, 480, 1275000),
    (0, 0, 0),
];

/// `ibv_rate_to_mult`: the rate as a multiple of 2.5 Gb/s, −1 for a rate with none.
pub fn rate_to_mult(rate: i32) -> i32 {
    RATES
        .iter()
        .find(|r| r.0 == rate && r.1 != 0)
        .map_or(-1, |r| r.1)
}

/// `mult_to_ibv_rate`: 0 (`IBV_RATE_MAX`) for a multiple with no rate.
pub fn mult_to_rate(mult: i32) -> i32 {
    RATES
        .iter()
        .find(|r| r.1 == mult && r.1 != 0)
        .map_or(0, |r| r.0)
}

/// `ibv_rate_to_mbps`: −1 for an unknown rate.
pub fn rate_to_mbps(rate: i32) -> i32 {
    RATES
        .iter()
        .find(|r| r.0 == rate && r.2 != 0)
        .map_or(-1, |r| r.2)
}

/// `mbps_to_ibv_rate`: 0 (`IBV_RATE_MAX`) for a rate no value names.
pub fn mbps_to_rate(mbps: i32) -> i32 {
    RATES
        .iter()
        .find(|r| r.2 == mbps && r.2 != 0)
        .map_or(0, |r| r.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_convert_both_ways() {
        // IBV_RATE_10_GBPS = 3, IBV_RATE_100_GBPS = 16 (EDR 4x).
        assert_eq!(rate_to_mult(3), 4);
        assert_eq!(mult_to_rate(4), 3);
        assert_eq!(rate_to_mbps(16), 103125);
        assert_eq!(mbps_to_rate(103125), 16);
        assert_eq!(rate_to_mult(99), -1);
        assert_eq!(mbps_to_rate(1), 0);
    }

    #[test]
    fn strings_match_libibverbs() {
        assert_eq!(wc_status(5), c"Work Request Flushed Error");
        assert_eq!(wc_status(999), c"unknown");
        assert_eq!(port_state(4), c"active");
        assert_eq!(event_type(19), c"WQ fatal");
        assert_eq!(event_type(20), c"unknown");
        assert_eq!(node_type(1), c"InfiniBand channel adapter");
    }
}
