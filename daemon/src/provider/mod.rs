//! The verbs abstraction. The engine sees only these traits; two implementations stand
//! behind them:
//!
//! - [`verbs`]: real libibverbs devices through `rdma-sys` (the only `unsafe` besides the
//!   shared-memory code);
//! - [`loopback`]: an in-process software device with the same observable behaviour, used
//!   where the host has no RDMA device and by the unit tests.
//!
//! Children hold an `Arc` to their parent (MR → PD → device context), so kernel objects are
//! destroyed in the right order whatever order the engine drops them in. Operations a device
//! lacks answer [`ProviderError::NotSupported`]; nothing here panics on a device's behalf.

pub mod cm;
#[cfg(test)]
pub(crate) mod conformance;
#[cfg(test)]
pub(crate) mod conformance_data;
pub mod counters;
pub mod loopback;
pub mod types;
#[allow(unsafe_code)]
pub mod verbs;

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::memory::SharedMemory;
pub use counters::{ObjectCounts, ObjectKind};
pub use types::*;

pub type Result<T, E = ProviderError> = std::result::Result<T, E>;

/// Which implementation serves a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProviderKind {
    Verbs,
    Loopback,
}

impl ProviderKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Verbs => "verbs",
            ProviderKind::Loopback => "loopback",
        }
    }
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The device (or this build of rdmad) cannot do `operation`.
    #[error("{device}: {operation} is not supported")]
    NotSupported {
        device: String,
        operation: &'static str,
    },
    /// There is no RDMA device to open; the text says why (e.g. no kernel support).
    #[error("no RDMA device available: {0}")]
    NoDevices(String),
    /// A verb failed with an errno.
    #[error("{device}: {operation} failed: {source}")]
    Os {
        device: String,
        operation: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// An argument the device would refuse (bad port, bad access flags, range out of bounds).
    #[error("{device}: {message}")]
    InvalidArgument { device: String, message: String },
    /// A connection by address failed: the peer refused it, or could not be reached or
    /// did not answer; the message says which, with what the peer said.
    #[error("{message}")]
    Connection { device: String, message: String },
    /// The queue pair is in the error state and the device would never complete what was
    /// posted (Soft-RoCE's receives): nothing was posted; the caller completes the
    /// requests flushed (`WrFlushError`) itself, after those the device holds.
    #[error("{device}: the queue pair is in the error state: the requests complete flushed")]
    Flushed { device: String },
}

/// A batch post that stopped part-way: the first `posted` requests are on the device (they
/// complete as usual, and what they use must stay alive until they do); the rest are not.
#[derive(Debug, thiserror::Error)]
#[error("{error} ({posted} of the batch posted)")]
pub struct PostError {
    pub posted: usize,
    #[source]
    pub error: ProviderError,
}

impl PostError {
    /// Nothing of the batch was posted.
    pub fn none(error: ProviderError) -> PostError {
        PostError { posted: 0, error }
    }
}

impl From<PostError> for ProviderError {
    fn from(e: PostError) -> ProviderError {
        e.error
    }
}

impl ProviderError {
    pub fn not_supported(device: &str, operation: &'static str) -> Self {
        ProviderError::NotSupported {
            device: device.to_owned(),
            operation,
        }
    }

    pub fn invalid(device: &str, message: impl Into<String>) -> Self {
        ProviderError::InvalidArgument {
            device: device.to_owned(),
            message: message.into(),
        }
    }

    /// The current `errno` as an [`ProviderError::Os`].
    pub fn last_os(device: &str, operation: &'static str) -> Self {
        ProviderError::Os {
            device: device.to_owned(),
            operation,
            source: std::io::Error::last_os_error(),
        }
    }
}

/// An opened RDMA device.
pub trait Device: Send + Sync + fmt::Debug {
    /// The device name (`rxe0`, `mlx5_0`, `lo0`).
    fn name(&self) -> &str;
    fn provider(&self) -> ProviderKind;
    /// Identity and capabilities.
    fn attributes(&self) -> Result<DeviceAttributes>;
    /// Live state of one port (numbered from 1).
    fn query_port(&self, port: u8) -> Result<PortAttributes>;
    /// The populated entries of one port's GID table.
    fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>>;
    /// Allocates a protection domain; it keeps the device open while it lives.
    fn alloc_pd(&self) -> Result<Arc<dyn ProtectionDomain>>;
    /// How many provider objects of each kind are alive on this device.
    fn object_counts(&self) -> ObjectCounts;
    /// Objects the device refused to destroy, kept and retried (see [`Lingering`]).
    fn lingering(&self) -> Vec<Lingering>;
    /// Tries again to destroy what the device refused to, windows before registrations;
    /// returns how many objects are still left.
    fn retry_lingering(&self) -> usize;
    /// The connection manager that connects this device's queue pairs by address.
    fn connection_manager(&self) -> Result<Arc<dyn cm::ConnectionManager>> {
        Err(ProviderError::not_supported(
            self.name(),
            "connecting by address (rdma_cm needs a kernel RDMA device)",
        ))
    }
}

/// A registration or window the device refused to destroy (`ibv_dereg_mr` fails with
/// EINVAL on rxe while a window is bound over the MR). It is not dropped on the floor:
/// the provider keeps it — a registration with its memory mapped, with its PD — counts it
/// among the live objects of [`Device::object_counts`], lists it in [`Device::lingering`]
/// and tries again on [`Device::retry_lingering`] until the device accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lingering {
    pub kind: ObjectKind,
    /// The lkey of a registration, the rkey of a window.
    pub key: u32,
    /// Bytes registered (0 for a window).
    pub len: u64,
    /// The device's last answer.
    pub error: String,
    /// When the device first refused.
    pub since: std::time::SystemTime,
    /// How many times the device refused.
    pub attempts: u32,
}

impl Lingering {
    fn new(kind: ObjectKind, key: u32, len: u64, error: &ProviderError) -> Lingering {
        Lingering {
            kind,
            key,
            len,
            error: error.to_string(),
            since: std::time::SystemTime::now(),
            attempts: 1,
        }
    }

    /// Records one more refusal.
    fn refused_again(&mut self, error: &ProviderError) {
        self.attempts = self.attempts.saturating_add(1);
        self.error = error.to_string();
    }
}

/// A protection domain: the scope of memory registrations, windows and QPs.
pub trait ProtectionDomain: Send + Sync + fmt::Debug {
    /// Registers the whole of `memory` with `access`, known to the device by the
    /// daemon's own address of it. The region keeps `memory` mapped and the PD alive until
    /// it is dropped (deregistered).
    fn register(&self, memory: Arc<SharedMemory>, access: Access) -> Result<Arc<dyn MemoryRegion>> {
        let span = Span::whole(&memory);
        self.register_span(memory, span, access)
    }

    /// Registers the part of `memory` that `span` names, known to the device (in work
    /// requests, and to peers with the rkey) by `span.iova` (`ibv_reg_mr_iova2`).
    fn register_span(
        &self,
        memory: Arc<SharedMemory>,
        span: Span,
        access: Access,
    ) -> Result<Arc<dyn MemoryRegion>>;

    /// Allocates an unbound memory window.
    fn alloc_mw(&self, kind: MwType) -> Result<Arc<dyn MemoryWindow>> {
        let _ = kind;
        Err(ProviderError::not_supported(
            self.device_name(),
            "memory windows",
        ))
    }

    /// Creates a completion queue with room for at least `depth` entries.
    fn create_cq(&self, depth: u32) -> Result<Arc<dyn CompletionQueue>> {
        let _ = depth;
        Err(ProviderError::not_supported(
            self.device_name(),
            "completion queues",
        ))
    }

    /// Creates an RC queue pair in the RESET state.
    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn QueuePair>> {
        let _ = init;
        Err(ProviderError::not_supported(
            self.device_name(),
            "queue pairs",
        ))
    }

    fn device_name(&self) -> &str;
}

/// A registered memory region.
pub trait MemoryRegion: Send + Sync + fmt::Debug {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
    fn access(&self) -> Access;
    /// The memory behind the registration.
    fn memory(&self) -> &Arc<SharedMemory>;
    /// Which part of the memory is registered, and the address the device knows it by
    /// (by default all of it, at the daemon's own address).
    fn span(&self) -> Span {
        Span::whole(self.memory())
    }
    /// The address the device knows the registration's first byte by.
    fn addr(&self) -> u64 {
        self.span().iova
    }
    /// Bytes registered.
    fn len(&self) -> usize {
        self.span().len
    }
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// For the provider that made it, to reach its own type (e.g. to bind a window).
    fn as_any(&self) -> &dyn Any;
}

/// A memory window. A type-2 window is bound with a `SendOp::BindMw` work request on a QP
/// (and is then usable only through connections of that QP), and invalidated with
/// `SendOp::LocalInvalidate` on the same QP. Invalidate (or drop) windows before their QP:
/// rxe blocks for about 50 s destroying a QP with a valid type-2 window.
pub trait MemoryWindow: Send + Sync + fmt::Debug {
    fn kind(&self) -> MwType;
    /// The rkey of the current (or next) binding; it changes with every bind.
    fn rkey(&self) -> u32;
    fn as_any(&self) -> &dyn Any;
}

/// A completion queue with a completion channel, so an idle worker can sleep until it has
/// work: `arm`, then wait for `event_fd` to be readable, then `acknowledge_events` and
/// `poll`.
pub trait CompletionQueue: Send + Sync + fmt::Debug {
    /// Moves up to `max` completions into `out` (appending); returns how many.
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize>;
    /// Whether work feeding this CQ is under way that moves on only when the CQ is polled
    /// (a software device run by its users, in bounded turns): its poller must not sleep
    /// yet. A hardware device works on its own and never needs this.
    fn needs_polling(&self) -> bool {
        false
    }
    /// Requests an event on `event_fd` for the next completion (`ibv_req_notify_cq`).
    fn arm(&self) -> Result<()>;
    /// A non-blocking descriptor that becomes readable when an armed CQ gets a completion.
    fn event_fd(&self) -> std::os::fd::BorrowedFd<'_>;
    /// Consumes and acknowledges pending events (never blocks); returns how many.
    fn acknowledge_events(&self) -> Result<u32>;
    fn as_any(&self) -> &dyn Any;
}

/// A reliable-connected queue pair.
pub trait QueuePair: Send + Sync + fmt::Debug {
    fn qp_num(&self) -> u32;
    fn state(&self) -> Result<QpState>;
    /// RESET → INIT on `port` with the given remote access rights.
    fn to_init(&self, port: u8, access: Access) -> Result<()>;
    /// INIT → RTR towards `remote`.
    fn to_rtr(&self, remote: &RemoteEndpoint, attrs: &RtrAttributes) -> Result<()>;
    /// RTR → RTS.
    fn to_rts(&self, attrs: &RtsAttributes) -> Result<()>;
    /// Any state → ERROR: outstanding work requests complete with `WrFlushError`.
    fn to_error(&self) -> Result<()>;
    /// Posts a batch of send-queue work requests. On a refusal (e.g. queue full) none
    /// from the first refused one on is posted; the error says how many were.
    fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError>;
    /// Posts a batch of receive work requests, failing like [`QueuePair::post_send`].
    fn post_recv(&self, wrs: &[RecvWr]) -> Result<(), PostError>;
    fn as_any(&self) -> &dyn Any;
}
