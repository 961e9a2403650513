//! What a session's queue pairs may touch, as the data-path worker sees it: a snapshot the
//! registry keeps up to date, so the worker never looks anything up in the registry.

use std::sync::{Arc, Mutex};

use super::validate::RegionRights;
use crate::lock::lock;

/// A session's rights on the data path: the regions its queue pairs may use, owned ones
/// read-write and attached ones as their key allowed. One per session, shared by the
/// registry (which writes it) and every queue pair of the session (whose worker reads it).
///
/// Consistency rule: the registry replaces the snapshot under its own lock, in the same
/// critical section as the change that alters the session's rights — allocating, attaching,
/// detaching, freeing a region (by its owner, while attached elsewhere too), closing the
/// session (which leaves it empty) — so when that call returns, every batch the worker
/// takes afterwards sees the new rights. Revoking a key changes nothing here: live
/// attachments stay. A batch taken before the change was validated against the old
/// snapshot; its requests pin the registrations they use until they complete, as they
/// always have. The worker loads the snapshot once per batch and holds it only for that
/// batch, so a region dropped from the snapshot is released as soon as that batch is done.
#[derive(Debug, Default)]
pub struct SessionRights {
    current: Mutex<Arc<RegionRights>>,
}

impl SessionRights {
    /// The rights in force now (for one batch).
    pub fn load(&self) -> Arc<RegionRights> {
        Arc::clone(&lock(&self.current))
    }

    /// Replaces the rights: only the registry does, under its lock.
    pub fn store(&self, rights: RegionRights) {
        let old = std::mem::replace(&mut *lock(&self.current), Arc::new(rights));
        // The old snapshot (and the registrations it names) goes outside the tiny lock.
        drop(old);
    }
}
