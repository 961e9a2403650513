//! Connections by IP address and port: the kernel's RDMA connection manager (`rdma_cm`),
//! behind two traits. A [`ConnectionManager`] makes [`CmId`]s — one per listener, one per
//! connection — and runs their events; the engine drives a connection through them and
//! moves its own queue pair with the path rdma_cm chose ([`CmPath`]).
//!
//! Queue pairs are never handed to rdma_cm: rdmad creates them as always (on its own
//! context, with its rings), tells rdma_cm their number, and moves them itself, RESET →
//! INIT before connecting, RTR and RTS with the attributes rdma_cm computed for the
//! connection (`rdma_init_qp_attr`), as librdmacm documents for QPs it did not create.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use super::{RemoteEndpoint, Result, RtrAttributes, RtsAttributes};

/// The most private data a connection request carries over RoCE/IB with the TCP port
/// space (the REQ's 92 bytes less rdma_cm's 36-byte header).
pub const REQUEST_PRIVATE_DATA: usize = 56;
/// The most private data an accept (REP) or a reject (REJ) carries.
pub const REPLY_PRIVATE_DATA: usize = 196;
/// The most private data a reject carries.
pub const REJECT_PRIVATE_DATA: usize = 148;

/// rdma_cm for one provider: it makes identifiers and delivers their events.
pub trait ConnectionManager: Send + Sync + fmt::Debug {
    /// Binds to `addr` and listens. At most `backlog` requests wait for
    /// [`CmId::next_request`]; later ones are refused at once with `refusal` as the
    /// reject's private data (the peer sees it).
    fn listen(&self, addr: SocketAddr, backlog: u32, refusal: &[u8]) -> Result<Box<dyn CmId>>;

    /// A new identifier for an outgoing connection, bound to `from` if given, with
    /// addresses and route resolved towards `to` (waits up to `timeout` for each).
    fn resolve(
        &self,
        from: Option<SocketAddr>,
        to: SocketAddr,
        timeout: Duration,
    ) -> Result<Box<dyn CmId>>;
}

/// One rdma_cm identifier: a listener, or one end of a connection. Dropping it destroys
/// it; an established connection is disconnected first (the peer sees it).
pub trait CmId: Send + Sync + fmt::Debug {
    /// The device and port the identifier is bound to (after resolution, or for a
    /// request, the device it arrived on).
    fn device(&self) -> Option<(String, u8)>;
    /// The local address (a listener's, or a connection's own end).
    fn local_addr(&self) -> Option<SocketAddr>;
    /// The peer's address (a connection's).
    fn peer_addr(&self) -> Option<SocketAddr>;

    /// The path to the peer for a queue pair connecting through this identifier: the
    /// peer's GID and QPN, both PSNs, the source GID index, port and path MTU
    /// (`rdma_init_qp_attr` for RTR and RTS). Needs the peer's QPN: after a request
    /// arrived, or after [`CmId::connect`] returned.
    fn path(&self) -> Result<CmPath>;

    /// Sends a connection request for queue pair `param.qp_num`, and waits up to `timeout`
    /// for the answer: the peer's accept ([`CmReply`]; then move the QP to RTS and call
    /// [`CmId::establish`]), or an error saying why not (rejected, with the peer's reason
    /// and private data; unreachable; no answer).
    fn connect(&self, param: &ConnParam, timeout: Duration) -> Result<CmReply>;
    /// Tells the peer the connection is established (after the QP reached RTS).
    fn establish(&self) -> Result<()>;

    /// Accepts a request (the QP `param.qp_num` is in RTS already) and waits up to
    /// `timeout` for the peer to confirm.
    fn accept(&self, param: &ConnParam, timeout: Duration) -> Result<()>;
    /// Refuses a request; the peer sees `private_data` (at most
    /// [`REJECT_PRIVATE_DATA`] bytes; more is cut).
    fn reject(&self, private_data: &[u8]) -> Result<()>;

    /// For a listener: the next connection request, waiting up to `timeout`.
    fn next_request(&self, timeout: Duration) -> Result<Option<CmRequest>>;
    /// For a listener: runs `f` each time a request arrives for [`CmId::next_request`].
    fn on_request(&self, f: std::sync::Arc<dyn Fn() + Send + Sync>);

    /// Runs `f` once when the connection ends from the other side or the device (peer
    /// disconnected, connection error, device removed) — at once if it already has.
    fn on_disconnect(&self, f: Box<dyn FnOnce() + Send>);
}

/// What a connection request or accept carries (`struct rdma_conn_param`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnParam {
    pub qp_num: u32,
    pub private_data: Vec<u8>,
    /// RDMA READs and atomics the local QP accepts from the peer at once.
    pub responder_resources: u8,
    /// RDMA READs and atomics the local QP has outstanding towards the peer at once.
    pub initiator_depth: u8,
    /// Transport retries the peer's QP makes (0–7).
    pub retry_count: u8,
    /// Retries the peer's QP makes when the local QP has no receive posted (7: forever).
    pub rnr_retry_count: u8,
}

/// A peer's accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmReply {
    pub private_data: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
}

/// A connection request a listener received; dropping it without an accept refuses it.
#[derive(Debug)]
pub struct CmRequest {
    /// The new connection's identifier, on the device the request arrived on.
    pub id: Box<dyn CmId>,
    pub private_data: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
}

/// What rdma_cm chose for a queue pair's connection: the peer's GID, QPN and first PSN,
/// the local port and GID of the route, the path MTU, both PSNs, the READ/atomic depths
/// the two ends agreed on and the retry counts the peer asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmPath {
    pub remote: RemoteEndpoint,
    pub rtr: RtrAttributes,
    pub rts: RtsAttributes,
}
