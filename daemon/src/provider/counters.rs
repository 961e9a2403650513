//! Live counts of provider objects, kept the same way by every provider so tests and
//! `rdmactl` can check that everything created was destroyed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ObjectKind {
    Pd,
    Mr,
    Mw,
    Cq,
    Qp,
}

impl ObjectKind {
    /// The name `rdma resource show` gives the kind.
    pub fn as_str(self) -> &'static str {
        match self {
            ObjectKind::Pd => "pd",
            ObjectKind::Mr => "mr",
            ObjectKind::Mw => "mw",
            ObjectKind::Cq => "cq",
            ObjectKind::Qp => "qp",
        }
    }
}

/// A snapshot of how many objects of each kind are alive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ObjectCounts {
    pub pds: u64,
    pub mrs: u64,
    pub mws: u64,
    pub cqs: u64,
    pub qps: u64,
}

/// Shared by a device and all its children.
#[derive(Debug, Default)]
pub struct Counters {
    live: [AtomicU64; 5],
}

impl Counters {
    /// Counts one more live object of `kind` until the returned guard is dropped.
    pub fn track(self: &Arc<Self>, kind: ObjectKind) -> Tracked {
        self.live[kind as usize].fetch_add(1, Ordering::Relaxed);
        Tracked {
            counters: Arc::clone(self),
            kind,
        }
    }

    pub fn snapshot(&self) -> ObjectCounts {
        let get = |kind: ObjectKind| self.live[kind as usize].load(Ordering::Relaxed);
        ObjectCounts {
            pds: get(ObjectKind::Pd),
            mrs: get(ObjectKind::Mr),
            mws: get(ObjectKind::Mw),
            cqs: get(ObjectKind::Cq),
            qps: get(ObjectKind::Qp),
        }
    }
}

/// Held by a provider object; its drop is the object's destruction in the counts.
#[derive(Debug)]
pub struct Tracked {
    counters: Arc<Counters>,
    kind: ObjectKind,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.counters.live[self.kind as usize].fetch_sub(1, Ordering::Relaxed);
    }
}
